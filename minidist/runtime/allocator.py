"""The CPU heap's large blocks: why a CPU rank pays for a large buffer every time it makes one, and how
to keep freed blocks for reuse, as PyTorch's CUDA caching allocator does on a GPU.

**What glibc does.** A CPU tensor's memory comes from the C library's `malloc` (PyTorch asks for it
64-byte aligned, `posix_memalign`). glibc serves small requests from its heap, and a request above
its *mmap threshold* with a fresh `mmap` of its own, given back with `munmap` the moment it is freed.
The threshold starts at 128 KiB and rises as large blocks are freed (to the size of each one freed),
but never above 32 MiB on 64-bit Linux. Memory fresh from `mmap` is not there yet: the kernel maps
each 4 KiB page on its first touch, a *minor page fault*, and zeroes it, all paid in system time.
So every buffer above 32 MiB costs a page fault per 4 KiB, every time it is made. An FSDP unit's
flat buffer is one such buffer (a 1536-wide Llama layer is 113 MB in fp32: 28,000 faults), gathered
and freed in every forward and every backward.

**What a GPU does instead.** PyTorch's CUDA caching allocator never gives a freed block back to the
driver: it keeps it, and hands it to the next tensor that fits. `cudaMalloc` is slow (and
synchronises the device), so a step that remade its buffers from the driver would crawl; with the
cache, a training loop stops asking the driver for memory after its first step. The price is that
the memory the process holds (`torch.cuda.memory_reserved`) stays at its high-water mark.

**The same on a CPU rank** (`keep_freed_blocks`), with three of glibc's `mallopt` settings:

- `M_MMAP_MAX = 0`: no block from `mmap` at all; every block, however large, comes from the heap,
  and goes back to it when freed. (Raising `M_MMAP_THRESHOLD` does the same up to the threshold,
  but `mallopt` takes an `int`, and its manual caps the threshold at 32 MiB on 64-bit, though the
  glibc 2.36 measured here took 1 GiB; no block from `mmap` needs no cap.)
- `M_TRIM_THRESHOLD = -1`: the heap is never trimmed, so freed pages stay mapped, and the next
  buffer that reuses them touches them without a fault.
- `M_ARENA_MAX = 1`: one heap for every thread. gloo's worker threads make buffers too (an
  all-gather's output, a received message); each thread has its own heap (*arena*) by default, and
  an arena other than the main one is built of 64 MiB pieces, so it serves any larger block from
  `mmap` whatever the settings above say. Set before the process group starts its threads.

**And one setting only a process's start can make.** PyTorch asks for its memory 64-byte aligned
(`posix_memalign`), and glibc serves that by taking a block a little larger than asked and giving
back the spare pieces at its ends, a few dozen bytes each. Those pieces go to the freeing thread's
*tcache*, a private cache of up to 7 small chunks per size, where they count as in use. So when the
large block is freed, it cannot merge with its neighbours, and it stays a few bytes too small for the
same request made again: the heap grows by one more block, and again, until the tcache is full and
the pieces merge (measured: 8 rounds of a 64 MB tensor, 8 copies of it in the heap), and a step that
makes blocks of many sizes keeps running into it. `glibc.malloc.tcache_count=0` turns the tcache
off, but glibc reads its tunables (`GLIBC_TUNABLES`) only when a program starts. So `launch.py`
starts its fork server, which forks every rank, with it (`tunables_for_new_processes`); a rank that
torchrun or srun starts keeps the tcache unless the job's environment sets the variable.

Measured with `tests/runtime/test_allocator.py` on a shared, loaded 2-core CPU: a 64 MB tensor made,
freed and made again, and a hand-written FSDP unit (113 MB, or 50 MB) gathered and freed over and
over on 2 gloo ranks. With glibc's defaults every round faults every page (16,384 for the tensor;
for a gather twice the unit's pages, 55,300 at 113 MB). With these settings and the tcache off, the
tensor faults no page after its first 2 rounds, and a gather none after its first 2 or 3, but for
one gather in 4 or fewer that grows the heap by one more block (gloo's threads make their buffers
in an order that varies). With the tcache on: the tensor after its first 8 rounds, while one rank's
gathers of the 50 MB unit still faulted one buffer's pages in about half of them after 20 gathers.

**What it changes, and what it does not.** The live-tensor peak the project measures
(`memory/measure.py`, what a GPU's allocator would count) is the same: the tensors are the same
tensors. What changes is the process's resident memory: it no longer shrinks after a peak, and it
stays at its high-water mark, as a GPU process's reserved memory does. That mark is also above the
live peak, by the heap's fragmentation (see above). Measured on one 1536-wide Llama layer, hand-written
FSDP, 2 gloo ranks, rank 0 after 6 steps: resident memory about 0.8 GB with glibc's defaults, 1.2 GB
with these settings and the tcache off, 1.7 GB with the tcache on (measured with `M_MMAP_THRESHOLD` at
1 GiB in place of `M_MMAP_MAX = 0`, the same for these sizes). A GPU rank is left alone: its
tensors live in the caching allocator, and its host memory is the CPU's business.

`MINIDIST_GLIBC_DEFAULTS=1` in the environment leaves glibc as it is, for A/B measurements
(`python -m minidist.bench allocator`).
"""

from __future__ import annotations

import ctypes
import os
import resource

import torch

DEFAULTS_VARIABLE = "MINIDIST_GLIBC_DEFAULTS"  # "1": leave glibc's settings as they are
# mallopt's parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_ARENA_MAX, 1))
TCACHE_OFF = "glibc.malloc.tcache_count=0"  # a tunable, read at a process's start only

_said: str | None = None  # the line of the first CPU call: the settings are made once per process


def _load_glibc():
    """This process's C library if it is glibc (it has `gnu_get_libc_version`), else None: macOS's
    libc and musl have no such settings, or other ones."""
    try:
        libc = ctypes.CDLL(None)  # the C library the interpreter is already linked with
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_blocks(device: torch.device) -> str | None:
    """On a CPU rank, make glibc keep freed large blocks in the heap for reuse (see the module
    docstring); return the one line to say at start, or None on a GPU rank (left alone) and where the C
    library is not glibc (nothing to set, nothing said). Call it before the first large allocation
    and before the process group starts its threads; `init_distributed` does. Calling it again
    returns the first call's line and changes nothing.
    The cost, resident memory that stays at its high-water mark, is in the module docstring."""
    global _said
    if device.type != "cpu":
        return None
    if _said is not None:
        return _said
    libc = _load_glibc()
    if libc is None:
        return None
    if os.environ.get(DEFAULTS_VARIABLE) == "1":
        _said = (f"CPU rank: glibc's malloc left as it is ({DEFAULTS_VARIABLE}=1): large buffers are mmapped "
                 f"afresh each time, a page fault per 4 KiB")
        return _said
    refused = [param for param, value in SETTINGS if libc.mallopt(param, value) != 1]
    if refused:  # a glibc that refuses one: say so, the others stay set
        _said = f"CPU rank: glibc refused mallopt parameter(s) {refused}: large freed blocks may not be kept"
        return _said
    _said = ("CPU rank: glibc keeps freed blocks (no mmap, trimming off, one arena): "
             "resident memory stays at its high-water mark")
    return _said


def tunables_for_new_processes(environ) -> str | None:
    """The `GLIBC_TUNABLES` a CPU rank about to be started should have in its environment: what `environ`
    has, with the tcache turned off (see the module docstring); None with MINIDIST_GLIBC_DEFAULTS=1 and
    where the C library is not glibc. Only a process started (exec'd) with it has it: `launch.py`
    starts its fork server so."""
    if environ.get(DEFAULTS_VARIABLE) == "1" or _load_glibc() is None:
        return None
    given = environ.get("GLIBC_TUNABLES")
    return f"{given}:{TCACHE_OFF}" if given else TCACHE_OFF


def minor_page_faults() -> int:
    """This process's minor page faults so far, every thread: pages the kernel mapped on first
    touch. The benchmarks and tests count them around a step."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
