"""The checks behind the self-checking exercises (`lessons/exercises/`), run in each rank by `launch`.

`check(exercise, sources)` starts the exercise's ranks once and runs, in each, the exercise's
check on every source in turn (an exercise with no ranks, the packing mask's, runs in the caller's
process): a path to a learner's file (a copy of a skeleton), or "minidist" for minidist's own
implementation under the skeleton's names. Each check runs the source inside
minidist's own classes and compares with what does not depend on the file being checked: the
library's all-reduce (01), a plain copy of the model whose gradients the library averages (02,
04 in fp32), one process on the whole global batch (03), the unsharded model's loss (05), the whole
block in one process (11), the whole Llama trained in one process (12), a cell-by-cell definition
of the packing mask and each game's attention alone (03's mask); and with
minidist's own implementation beside it where only it knows the answer (ZeRO's bf16 step, FSDP's
gradient shards and bytes). It also watches what a right answer must do besides the numbers: the
bytes sent, when a bucket's all-reduce starts, how much gathered memory stays alive. What
differs comes back in words: which rank, which tensor, expected and got, and a hint at the usual
mistake. An exception raised by the source becomes such a sentence too, with the line of the
learner's file it came from.

Every rank runs every collective of a check whatever it finds (problems are collected, never
returned early), so that the ranks stay in step from one source to the next. A source that
raises on some ranks only can still leave the others waiting in a collective; the learner's
command checks one source per launch, where `launch` ends that cleanly.
"""

import ast
import importlib.util
import os
import re
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minidist.parallel import comm

ROOT = Path(__file__).resolve().parents[2]
SKELETONS = ROOT / "lessons" / "exercises"
# exercise -> (ranks, what the check runs, the names a source must define); 0 ranks: in the caller's process
EXERCISES = {
    "01_ring_all_reduce": (3, "the ring all-reduce on 3 gloo ranks", ("ring_all_reduce",)),
    "02_bucket_hook": (2, "bucketed DDP's gradient hook on 2 gloo ranks", ("BucketedDDP",)),
    "03_accumulation": (2, "train_step with 3 micro-batches on 2 gloo ranks", ("train_step",)),
    "03_packing_mask": (0, "the packing mask on 6 layouts of packed rows, in this process", ("document_mask",)),
    "04_zero2_step": (2, "ZeRO-2's step on 2 gloo ranks, fp32 and bf16", ("ShardedOptimizer",)),
    "05_fsdp_gather_free": (2, "FSDP's gather and free on 2 gloo ranks", ("Unit",)),
    "11_tensor_parallel": (2, "the backward of tensor parallelism's f on 2 gloo ranks", ("CopyToTensorParallel",)),
    "12_pipeline_parallel": (4, "1F1B's list of actions, run on 4 gloo stages", ("one_f_one_b",)),
}


class CheckError(Exception):
    """A check cannot run the source at all (a name missing): said in one line."""


def skeleton(exercise: str) -> Path:
    return SKELETONS / f"{exercise}.py"


def exercise_of(path: Path) -> str:
    """Which exercise a learner's file answers: its `EXERCISE = "..."` line (read, not run), or
    the exercise's name its own name starts with, or the lesson number (the lesson's first exercise)."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError) as e:
        raise CheckError(f"{path}: cannot read it as Python ({e})") from None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXERCISE" for t in node.targets)
                and isinstance(node.value, ast.Constant) and node.value.value in EXERCISES):
            return node.value.value
    for name in EXERCISES:
        if path.name.startswith(name):
            return name
    for name in EXERCISES:
        if path.name.startswith(name[:3]):
            return name
    raise CheckError(f"{path}: no EXERCISE = \"...\" line and no lesson number (01_ to 05_, 11_, 12_) in its name: keep the "
                     "skeleton's EXERCISE line")


# ---------------------------------------------------------------------------------- the parent's side
def check(exercise: str, sources: list[str], timeout_s: float = 240) -> list[str | None]:
    """Run `exercise`'s check on each source (in one launch); per source None (it passes) or the
    message that says why not."""
    from minidist.runtime.launch import RankFailed, launch

    world, _, _ = EXERCISES[exercise]
    sources = [s if s == "minidist" else str(Path(s).resolve()) for s in sources]
    if world == 0:  # a check of one function on tensors: here, no ranks to start
        import warnings

        with warnings.catch_warnings():  # run_checks' filter stays inside this call
            return [_verdict([problems], ranked=False) for problems in run_checks(exercise, sources)]
    # A rank stuck in a collective that its peer never joins fails after a minute, not the default half hour.
    with mock.patch.dict(os.environ, MINIDIST_TIMEOUT_S="60"):
        try:
            per_rank = launch(run_checks, world, exercise, sources, timeout_s=timeout_s)
        except RankFailed as e:  # the check itself broke (not the learner's code, which is caught in the rank)
            return [f"the check failed on rank {e.rank}:\n{e.traceback}"] * len(sources)
        except TimeoutError:
            return [f"no answer after {timeout_s} s: a rank is stuck, most likely in a send or a collective its "
                    "neighbour never joins (a round where one rank sends and the other does not receive)"] * len(sources)
    return [_verdict([ranks[i] for ranks in per_rank]) for i in range(len(sources))]


def _verdict(by_rank: list[dict], ranked: bool = True) -> str | None:
    """The first problems, each with its rank (`ranked`; a check without ranks has none), one of each
    kind, and how many more there were. A rank that raised comes first, the earliest first: its
    peers' errors ("connection closed") follow from it."""
    order = sorted(range(len(by_rank)), key=lambda r: (by_rank[r]["raised_at"] is None, by_rank[r]["raised_at"] or 0, r))
    problems = [f"rank {rank}: {p}" if ranked else p for rank in order for p in by_rank[rank]["problems"]]
    if not problems:
        return None
    seen, shown, repeats = set(), [], 0
    for p in problems:  # one of each kind (the same hint, or the same sentence on another rank)
        key = p.split("Hint: ", 1)[1] if "Hint: " in p else (p.split(": ", 1)[1] if ranked else p)
        if key in seen:
            repeats += 1
        elif len(shown) < 3:
            seen.add(key)
            shown.append(p)
    others = len(problems) - len(shown) - repeats
    more = [f"{repeats} more of the same kinds" if repeats else "", f"{others} more of other kinds" if others else ""]
    more = "; ".join(m for m in more if m)
    return "\n".join(shown) + (f"\n({more}{', on this rank or others' if ranked else ''})" if more else "")


# ---------------------------------------------------------------------------------- in each rank
def run_checks(exercise: str, sources: list[str]) -> list[dict]:
    """Each rank: the problems found with each source (none: it passes), and when it raised, if it did."""
    import time
    import warnings

    # minidist's comm.all_gather calls all_gather_into_tensor, which torch 2.13 calls deprecated: a
    # warning about minidist, not about the learner's code, that would sit under every failed check.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    out = []
    for i, source in enumerate(sources):
        comm.counter.reset()
        try:
            out.append({"problems": CHECKS[exercise](lambda: load(exercise, source, i)), "raised_at": None})
        except CheckError as e:
            out.append({"problems": [str(e)], "raised_at": None})
        except Exception as e:  # the learner's code raised: say where, in their file
            out.append({"problems": [describe(e, source, HINTS.get(exercise, ()))], "raised_at": time.time()})
    return out


def load(exercise: str, source: str, index: int) -> SimpleNamespace:
    """The source's names: minidist's own implementation ("minidist"), or a learner's file, run fresh."""
    names = EXERCISES[exercise][2]
    if source == "minidist":
        return SimpleNamespace(**{name: _own(name) for name in names})
    spec = importlib.util.spec_from_file_location(f"exercise_source_{index}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in names:
        if not hasattr(module, name):
            raise CheckError(f"{source} defines no {name}: keep the skeleton's names")
    return module


def _own(name: str):
    """minidist's implementation of what the skeleton names `name` (imported only when asked for:
    the training loop's module pulls in transformers)."""
    if name == "ring_all_reduce":
        return comm.ring_all_reduce
    if name == "BucketedDDP":
        from minidist.parallel.ddp import BucketedDDP
        return BucketedDDP
    if name == "train_step":
        from minidist.step import train_step
        return train_step
    if name == "ShardedOptimizer":
        from minidist.parallel.zero import ShardedOptimizer
        return ShardedOptimizer
    if name == "CopyToTensorParallel":
        from minidist.parallel.tensor.ops import CopyToTensorParallel
        return CopyToTensorParallel
    if name == "one_f_one_b":
        from minidist.parallel.pipeline.schedules import one_f_one_b
        return one_f_one_b
    if name == "document_mask":
        from minidist.packing import document_mask
        return document_mask
    from minidist.parallel.fsdp import Unit
    return Unit


def describe(error: Exception, source: str, hints) -> str:
    """An exception as one sentence: its type and message, the line of the learner's file it came
    from (else the last line it passed), and a hint where its text is a known mistake."""
    frames = traceback.extract_tb(error.__traceback__)
    theirs = [f for f in frames if source != "minidist" and Path(f.filename) == Path(source)]
    frame = (theirs or frames)[-1]
    where = f"{_short(frame.filename)}, line {frame.lineno}: {(frame.line or '').strip()}"
    text = f"{type(error).__name__}: {error}"
    message = f"raised {text.splitlines()[0] if text.strip() else type(error).__name__} (at {where})"
    if isinstance(error, NotImplementedError):
        return message + ". Hint: this is the skeleton's blank; write the code its docstring describes."
    for fragment, hint in [*hints, *ANY_EXERCISE]:
        if fragment in text:
            return f"{message}. Hint: {hint}"
    return message


def _short(filename: str) -> str:
    path = Path(filename)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _close(got: torch.Tensor, expected: torch.Tensor, rtol=1e-5, atol=1e-6) -> bool:
    return got.shape == expected.shape and torch.allclose(got.double(), expected.double(), rtol=rtol, atol=atol)


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    """'element k: expected e, got g' at the largest difference."""
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} where {tuple(expected.shape)} was expected"
    diff = (got.double() - expected.double()).abs().reshape(-1)
    k = int(diff.argmax())
    return f"element {k}: expected {expected.reshape(-1)[k].item():.6g}, got {got.reshape(-1)[k].item():.6g}"


def _ratio(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    """The factor s with got = s x expected, if there is one (to 1e-4), else None."""
    g, e = got.double().reshape(-1), expected.double().reshape(-1)
    if float(e @ e) == 0:
        return None
    s = float(g @ e / (e @ e))
    return s if float((g - s * e).norm()) <= 1e-4 * float((s * e).norm()) + 1e-12 else None


# ---------------------------------------------------------------------------------- 01: the ring
RING_CASES = [(torch.float32, (7,)), (torch.float32, (1,)), (torch.float64, (3, 4)), (torch.int64, (12,)),
              (torch.float32, (1000,))]
LIBRARY_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                       "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single")


@contextmanager
def point_to_point_only(sent: list):
    """The library's collectives refuse (this exercise builds one); every send is counted in `sent`."""
    def refuse(name):
        def collective(*args, **kwargs):
            raise RuntimeError(f"torch.distributed.{name} was called: this exercise builds the all-reduce from "
                               "sends and receives between neighbours (dist.isend, dist.irecv), no library collective")
        return collective

    def counted(send):
        def wrapper(tensor, *args, **kwargs):
            sent.append(tensor.numel() * tensor.element_size())
            return send(tensor, *args, **kwargs)
        return wrapper

    # Patched where the library looks them up too: batch_isend_irecv checks `op.op is isend`
    # against distributed_c10d's own name, so a P2POp(dist.isend, ...) must find the same function there.
    from torch.distributed import distributed_c10d as c10d

    patches = [mock.patch.object(dist, name, refuse(name)) for name in LIBRARY_COLLECTIVES]
    for name in ("isend", "send"):
        wrapper = counted(getattr(dist, name))
        patches += [mock.patch.object(dist, name, wrapper), mock.patch.object(c10d, name, wrapper)]
    for p in patches:
        p.start()
    try:
        yield
    finally:
        for p in reversed(patches):
            p.stop()


def check_ring(load_solution) -> list[str]:
    n, rank = dist.get_world_size(), dist.get_rank()
    cases = []
    for k, (dtype, shape) in enumerate(RING_CASES):
        g = torch.Generator().manual_seed(100 * k + rank)
        x = (torch.randint(-1000, 1000, shape, generator=g) if dtype == torch.int64
             else torch.randn(shape, generator=g, dtype=dtype))
        expected, magnitude = x.clone(), x.abs().double()
        dist.all_reduce(expected)  # the library's answer, before the library is put away
        dist.all_reduce(magnitude)
        cases.append((x, expected, magnitude))
    problems, sent = [], []
    with point_to_point_only(sent):
        ring = load_solution().ring_all_reduce  # loaded here: an `from torch.distributed import isend` sees the counter
        for x, expected, magnitude in cases:
            name = f"{x.dtype} tensor of shape {tuple(x.shape)}"
            mine, before = x.clone(), len(sent)
            returned = ring(mine)
            problems += _ring_problems(name, x, mine, returned, expected, magnitude, n, rank)
            nbytes = x.numel() * x.element_size()
            got, low, high = sum(sent[before:]), 2 * (n - 1) * (x.numel() // n), 2 * (n - 1) * -(-x.numel() // n)
            if not low * x.element_size() <= got <= high * x.element_size():
                problems.append(f"{name}: sent {got} bytes, a ring sends 2(N-1)/N x {nbytes} = "
                                f"{2 * (n - 1) * nbytes / n:.0f} bytes (2(N-1) = {2 * (n - 1)} chunks of about 1/N "
                                "each). Hint: one chunk per round to the right neighbour, 2(N-1) rounds; sending the "
                                "whole tensor to every rank gets the sum with (N-1) x the bytes")
    return problems


def _ring_problems(name, x, mine, returned, expected, magnitude, n, rank) -> list[str]:
    if x.dtype.is_floating_point:  # the ring adds in its own order: the last bits may differ (lesson 01)
        bound = 2 * (n - 1) * torch.finfo(x.dtype).eps * magnitude + 1e-30

        def right(got, exp, b):
            return bool(((got.double() - exp.double()).abs() <= b).all())
    else:
        bound = magnitude

        def right(got, exp, b):
            return bool(torch.equal(got, exp))
    if right(mine, expected, bound):
        if returned is not None and returned is not mine:
            return [f"{name}: returned a new tensor; return `tensor` itself (the one that holds the sum)"]
        return []
    if isinstance(returned, torch.Tensor) and returned.shape == x.shape and right(returned, expected, bound):
        return [f"{name}: the sum came back in a new tensor, but `tensor` itself does not hold it "
                f"({_first_difference(mine, expected)}). Hint: work in place on views of tensor.view(-1), as "
                "torch.tensor_split gives them, and return tensor"]
    if torch.equal(mine, x):
        return [f"{name}: the tensor is unchanged ({_first_difference(mine, expected)}). Hint: add what you "
                "receive into your own chunk (reduce-scatter), then copy the finished chunks in (all-gather)"]
    if x.dtype.is_floating_point and right(mine * n, expected, bound * n):
        return [f"{name}: this is the average over ranks, not the sum. Hint: the all-reduce sums; DDP divides "
                "elsewhere"]
    flat, want, b = mine.reshape(-1), expected.reshape(-1), bound.reshape(-1)
    pieces = [(c, e, bb) for c, e, bb in zip(torch.tensor_split(flat, n), torch.tensor_split(want, n),
                                              torch.tensor_split(b, n))]
    done = [k for k, (c, e, bb) in enumerate(pieces) if c.numel() and right(c, e, bb)]
    if len(done) == 1 and sum(c.numel() > 0 for c, _, _ in pieces) > 1:
        return [f"{name}: only chunk {done[0]} of {n} holds the sum over ranks ({_first_difference(mine, expected)}). "
                "Hint: that is where the reduce-scatter phase ends; then the all-gather phase passes the finished chunks "
                "around the ring for N-1 more rounds, copying what arrives over your chunk, not adding it"]
    return [f"{name}: {_first_difference(mine, expected)} (the sum over ranks; chunks right: {done or 'none'}). "
            f"Hint: in reduce-scatter round s rank r sends chunk (r - s) % N and adds what it receives into chunk "
            "(r - s - 1) % N; in all-gather round s it sends chunk (r + 1 - s) % N and copies what it receives into "
            "chunk (r - s) % N"]


# ---------------------------------------------------------------------------------- the small models
class Block(nn.Module):
    """A residual layer: FSDP's unit class in exercise 05."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h):
        return h + torch.tanh(self.linear(h))


class ToyNet(nn.Module):
    """4 -> 9 -> 3 blocks -> 3: 354 parameters in 10 tensors, small and quick on CPU ranks."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__()
        self.inp = nn.Linear(4, 9)
        self.blocks = nn.ModuleList(Block(9) for _ in range(3))
        self.out = nn.Linear(9, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


# 100 fp32 elements per bucket: ToyNet's 10 tensors pack into 5 buckets of 39, 90, 90, 90 and 36
BUCKET_CAP_MB = 400 / 2**20


def toy_batch(rank: int, step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 4, generator=g).to(dtype), torch.randn(6, 3, generator=g)


def toy_loss(model, x, y):
    return ((model(x).float() - y) ** 2).sum()


# ---------------------------------------------------------------------------------- 02: the bucket hook
def check_bucket_hook(load_solution) -> list[str]:
    n, rank = dist.get_world_size(), dist.get_rank()
    theirs = load_solution().BucketedDDP

    class Watched(theirs):
        """Their hook, with what it saw recorded: the order gradients arrived, each local gradient."""

        def _on_grad_ready(self, param):
            self.seen.append(id(param))
            self.local[id(param)] = param.grad.detach().clone()
            self.current = id(param)
            super()._on_grad_ready(param)

    plain = ToyNet()  # the expected gradients: this copy's, averaged over ranks by the library
    model = Watched(ToyNet(), bucket_cap_mb=BUCKET_CAP_MB)
    names = {id(p): name for name, p in model.module.named_parameters()}
    problems = []
    for step in range(2):
        x, y = toy_batch(rank, step)
        toy_loss(plain, x, y).backward()
        for q in plain.parameters():
            dist.all_reduce(q.grad)
            q.grad /= n
        model.seen, model.local, launches = [], {}, []
        real_all_reduce = comm.all_reduce

        def recorded(tensor, group=None, async_op=False):
            # Which bucket: the one whose buffer is sent, else (a copy or a cast of it is sent) the
            # bucket of the gradient whose hook is running.
            b = next((b for b, bucket in enumerate(model.buckets) if bucket.buffer.data_ptr() == tensor.data_ptr()),
                     model._bucket_of[model.current][0])
            launches.append((b, len(model.seen), tensor.detach().clone(), async_op))
            return real_all_reduce(tensor, group=group, async_op=async_op)

        with mock.patch.object(comm, "all_reduce", recorded):
            toy_loss(model, x, y).backward()
        found = _launch_problems(model, launches, names, n, step)
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
            found += _gradient_problem(f"step {step + 1}, gradient of {name!r}", p.grad, q.grad, n,
                                       model.local.get(id(p)))[:1]
            if len(found) and found[-1].startswith(f"step {step + 1}, gradient"):
                break  # the first parameter that is wrong says it
        problems = problems or found  # the first step with problems (the ranks still run both)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    return problems


def _launch_problems(model, launches, names, n, step) -> list[str]:
    """When each bucket's all-reduce started, and what it held."""
    out, where = [], f"step {step + 1}"
    position = {pid: k + 1 for k, pid in enumerate(model.seen)}  # gradient k of the backward (1-based)
    for b, bucket in enumerate(model.buckets):
        full_at = max(position.get(id(p), 0) for p in bucket.params)
        mine = [launch[1:] for launch in launches if launch[0] == b]
        label = f"{where}, bucket {b} ({', '.join(repr(names[id(p)]) for p in bucket.params)})"
        if not mine:
            out.append(f"{label}: its buffer was never all-reduced. Hint: when the bucket is full, launch "
                       "comm.all_reduce(bucket.sent, ..., async_op=True) on bucket.sent = bucket.buffer")
            continue
        at, sent, async_op = mine[0]
        if len(mine) > 1 and at >= full_at:
            out.append(f"{label}: all-reduced {len(mine)} times in one backward. Hint: once per backward, when "
                       "bucket.pending reaches 0")
        if at < full_at:
            out.append(f"{label}: its all-reduce started after gradient {at} of the backward, but the bucket was "
                       f"full only after gradient {full_at}: it fired before the bucket was full. Hint: launch when "
                       "bucket.pending, counted down once per gradient, reaches 0")
        elif at > full_at:
            out.append(f"{label}: full after gradient {full_at} of the backward, its all-reduce started only after "
                       f"gradient {at}. Hint: launch it as soon as it is full, so that it overlaps the rest of "
                       "backward (launching every bucket at the end is the naive DDP)")
        if not async_op:
            out.append(f"{label}: launched with async_op=False, so backward waited for it. Hint: async_op=True, and "
                       "keep the handle in bucket.handle (_finish waits for it)")
        for p, offset in zip(bucket.params, bucket.offsets):
            local = model.local.get(id(p))
            if local is None or position.get(id(p), 0) > at:
                continue  # not arrived yet when it was sent: reported above
            piece = sent[offset:offset + p.numel()].view_as(local)
            if _close(piece, local / n):
                continue
            if _close(piece, local):
                out.append(f"{label}: sent {names[id(p)]!r}'s gradient without dividing by world_size ({n}). Hint: "
                           "divide the bucket by self.world_size before its all-reduce: the sum of the ranks' "
                           "averages is the average")
            else:
                out.append(f"{label}: when its all-reduce started, the slice of {names[id(p)]!r} did not hold its "
                           f"gradient ({_first_difference(piece, local / n)}, as the gradient / world_size). Hint: "
                           "copy each gradient into its slice before launching")
            break  # one sentence per bucket
    return out


def _gradient_problem(label, got, expected, n, local=None) -> list[str]:
    if got is None:
        return [f"{label}: param.grad is None after backward. Hint: call self._finish() when self.count.add(param) "
                "says this was the backward's last gradient"]
    if _close(got, expected):
        return []
    s = _ratio(got, expected)
    if s is not None and abs(s - n) < 1e-3:
        return [f"{label}: {n} x the expected ({_first_difference(got, expected)}). Hint: divide by world_size: "
                "the all-reduce sums over ranks, DDP wants the average"]
    if local is not None and _close(got, local):
        return [f"{label}: still this rank's own gradient ({_first_difference(got, expected)}, the average over "
                "ranks). Hint: the bucket's all-reduce must have run, and _finish waited for it"]
    return [f"{label}: {_first_difference(got, expected)}"]


# ---------------------------------------------------------------------------------- 03: accumulation
class TinyLM(nn.Module):
    """A language model small enough to be instant: embedding, one residual layer, output head.
    Called as a Hugging Face model is (`model(input_ids=..., ...).logits`), so `token_loss_sum` runs on it."""

    def __init__(self, vocab: int = 13, width: int = 8):
        torch.manual_seed(0)
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        h = self.embed(input_ids)
        return SimpleNamespace(logits=self.head(h + torch.tanh(self.mix(h))))


MICRO_BATCHES, PER_MICRO_BATCH = 3, 2


def token_batches(world_size: int):
    """The global batch (sequences of 3 to 9 tokens, different lengths) cut into micro-batches as
    `data.GlobalBatchSampler.micro_batches` cuts it: rank r gets micro-batches a x N + r."""
    g = torch.Generator().manual_seed(7)
    count = MICRO_BATCHES * PER_MICRO_BATCH * world_size
    sequences = [torch.randint(0, 13, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g)
                 for _ in range(count)]

    def pad(seqs):
        width = max(len(q) for q in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, q in enumerate(seqs):
            ids[row, :len(q)], mask[row, :len(q)] = q, 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    micro = [pad(sequences[m * PER_MICRO_BATCH:(m + 1) * PER_MICRO_BATCH]) for m in range(len(sequences) // PER_MICRO_BATCH)]
    by_rank = [[micro[a * world_size + r] for a in range(MICRO_BATCHES)] for r in range(world_size)]
    return sequences, by_rank, pad(sequences)


def summed_token_loss(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def check_accumulation(load_solution) -> list[str]:
    from minidist.runtime.distributed import get_env
    from minidist.strategy.options import ParallelOptions
    from minidist.strategy import MinidistDDP

    n, rank = dist.get_world_size(), dist.get_rank()
    train_step = load_solution().train_step
    sequences, by_rank, whole = token_batches(n)
    num_targets = sum(len(q) - 1 for q in sequences)
    # What it must equal: one process, the whole global batch, each token weighing 1/num_targets.
    single = TinyLM()
    (summed_token_loss(single, whole) / num_targets).backward()
    mine = by_rank[rank]
    with torch.no_grad():
        my_loss = float(sum(summed_token_loss(single, b) for b in mine))

    strategy = MinidistDDP(ParallelOptions(strategy="ddp", impl="minidist", bucket_cap_mb=BUCKET_CAP_MB), get_env())
    model = strategy.wrap(TinyLM())
    forwards, backwards = [], []
    model.module.register_forward_pre_hook(lambda *_: forwards.append(1))
    model.module.head.bias.register_post_accumulate_grad_hook(lambda _: backwards.append(1))
    comm.counter.reset()
    returned = train_step(model, strategy, mine, num_targets, n)
    sent = comm.counter.take()
    problems = []
    params = sum(p.numel() for p in model.module.parameters())
    one = 2 * params * (n - 1) / n * 4  # one all-reduce of the fp32 gradients
    k = len(mine)
    if len(forwards) != k or len(backwards) != k:
        problems.append(f"{len(forwards)} forward and {len(backwards)} backward passes for {k} micro-batches. Hint: "
                        "one forward and one backward per micro-batch: each backward frees its micro-batch's "
                        "activations, while a single backward of the summed losses keeps all of them alive at once")
    if sent == 0:
        problems.append(f"sent nothing in the step; one all-reduce of the gradients was expected ({one:.0f} bytes). "
                        "Hint: the last micro-batch runs outside no_sync: its backward all-reduces the sum")
    elif abs(sent - one) > 0.5:
        times = f" ({sent / one:.2g} all-reduces)" if abs(sent / one - round(sent / one)) < 1e-9 else ""
        problems.append(f"sent {sent:.0f} bytes in a step of {k} micro-batches{times}; one all-reduce of the gradients, "
                        f"{one:.0f} bytes, was expected. Hint: every micro-batch but the last runs inside "
                        "`with strategy.no_sync(model):`, so that only the last backward communicates")
    got = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                     for p in model.module.parameters()])
    want = torch.cat([p.grad.reshape(-1) for p in single.parameters()])
    if not _close(got, want, rtol=1e-4, atol=1e-6):
        s = _ratio(got, want)
        where = _first_difference(got, want)
        if s is not None and abs(s * n - 1) < 1e-3:
            problems.append(f"the gradients are 1/{n} of the whole batch's ({where}). Hint: the wrapper averages over "
                            "the ranks (divides by world_size): scale each loss by world_size / num_targets")
        elif s is not None:
            problems.append(f"the gradients are {s:.4g} x the whole batch's ({where}). Hint: each micro-batch's summed "
                            "loss times world_size / num_targets")
        else:
            problems.append(f"the gradients are not the whole global batch's, and not by one factor ({where}; the "
                            "flattened gradients of all parameters). Hint: tokens weigh unequally: the mean per "
                            "micro-batch weighs a token of a short micro-batch more; sum the token losses "
                            "(token_loss_sum) and divide by num_targets, the whole global batch's target count")
    value = float(returned) if isinstance(returned, (torch.Tensor, float, int)) else None
    if value is None or abs(value - my_loss) > 1e-4 * abs(my_loss):
        problems.append(f"train_step returned {returned!r}; it returns the summed token loss of this rank's "
                        f"micro-batches, unscaled: {my_loss:.6g} (the loop logs it)")
    return problems


# ---------------------------------------------------------------------------------- 03: the packing mask
# (what the layout is, its document ids): rows as `packing.collate_packed` numbers them, 1, 2, ... for
# the games of a row and 0 for the padding after them
MASK_LAYOUTS = [
    ("one game", [[1, 1, 1, 1, 1]]),
    ("three games", [[1, 1, 1, 2, 2, 3, 3, 3, 3]]),
    ("two games, then padding", [[1, 1, 1, 1, 2, 2, 2, 0, 0, 0]]),
    ("a row of padding alone", [[0, 0, 0, 0]]),
    ("a game of one token", [[1, 2, 2, 2, 3, 0]]),
    ("three rows", [[1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]]),
]
ATTENTION_ROW = [1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0]  # the row the attention check runs
# The kinds of wrong cell, in the order a message names them, each with its hint.
MASK_HINTS = {
    "future": ("a token sees only itself and the tokens before it: key j <= query i, the causal mask "
               "(torch.tril) and the same-game test together"),
    "other game": ("resetting the position ids is not enough: the key must belong to the query's own game, "
                   "document_ids[..., i] == document_ids[..., j], or a game attends to the games before it in "
                   "the row, which the same game alone never sees"),
    "diagonal": ("a token sees itself: j <= i, not j < i (torch.tril(), not tril(-1)); with j < i a game's first "
                 "token would see nothing at all, and the rest would not see themselves"),
    "padding sees nothing": ("a query that sees no key is a softmax over nothing, 0/0, whose result is the "
                             "kernel's choice: let each padding token see itself (the diagonal, torch.eye)"),
    "padding sees more": ("a padding token sees itself alone: document id 0 is not a game, so the same-game test "
                          "must also ask that the query is a real token (document_ids != 0)"),
    "sees padding": "a real token never attends to padding: padding is no game's token (document id 0)",
    "misses its game": "a token sees every token of its own game up to itself, not only some of them",
}


def _mask_by_definition(docs: list[list[int]]) -> torch.Tensor:
    """The mask as the lesson defines it, cell by cell: query i sees key j iff j <= i and both are
    tokens of the same game; a padding token (0) sees itself alone."""
    s = len(docs[0])
    out = torch.zeros(len(docs), 1, s, s, dtype=torch.bool)
    for r, row in enumerate(docs):
        for i in range(s):
            for j in range(s):
                out[r, 0, i, j] = i == j or (j < i and row[i] == row[j] != 0)
    return out


def _token(row: list[int], i: int) -> str:
    """'game 2, its token 0' or 'padding' for position i of a row of document ids."""
    if row[i] == 0:
        return "padding"
    return f"game {row[i]}, its token {i - row.index(row[i])}"


def _wrong_cell_kind(row: list[int], i: int, j: int, got: torch.Tensor) -> str:
    """Which mistake a wrong cell (query i, key j) of this row shows; `got` is the row's [s, s] mask."""
    if got[i, j]:  # seen, and should not be
        if row[i] == 0:
            return "padding sees more"
        if row[j] == 0:
            return "sees padding"
        return "future" if j > i else "other game"
    if i == j and row[i] == 0:
        return "padding sees more" if got[i].any() else "padding sees nothing"
    return "diagonal" if i == j else "misses its game"


def _mask_problems(name: str, docs: list[list[int]], got, expected: torch.Tensor) -> list[str]:
    """What is wrong with one layout's mask, in one sentence: the first wrong cell of the first kind
    (MASK_HINTS' order), expected against got, and how many cells are wrong."""
    label = f"{name} (document_ids {docs if len(docs) > 1 else docs[0]})"
    if not isinstance(got, torch.Tensor):
        return [f"{label}: returned a {type(got).__name__}, not a tensor. Hint: return the [rows, 1, s, s] tensor of "
                "booleans"]
    if tuple(got.shape) != tuple(expected.shape):
        return [f"{label}: the mask has shape {tuple(got.shape)}, expected (rows, 1, s, s) = {tuple(expected.shape)}. "
                "Hint: the 1 is the heads' dimension, which SDPA broadcasts over every head (.unsqueeze(1)); without "
                "it SDPA lines the rows up with the heads"]
    if got.dtype != torch.bool:
        return [f"{label}: the mask's dtype is {got.dtype}, expected torch.bool. Hint: a boolean mask says may attend "
                "(True) or not; a float mask is added to the scores (0.0 and 1.0 would mask nothing): return "
                "booleans, as comparisons and & | give them"]
    wrong = (got != expected).nonzero().tolist()
    if not wrong:
        return []
    kinds = {}
    for r, _, i, j in wrong:
        kinds.setdefault(_wrong_cell_kind(docs[r], i, j, got[r, 0]), (r, i, j))
    kind = next(k for k in MASK_HINTS if k in kinds)
    r, i, j = kinds[kind]
    cells = got[0, 0].numel() * len(docs)
    return [f"{label}: row {r}, query {i} ({_token(docs[r], i)}) and key {j} ({_token(docs[r], j)}): expected "
            f"{bool(expected[r, 0, i, j])}, got {bool(got[r, 0, i, j])} ({len(wrong)} of {cells} cells wrong). "
            f"Hint: {MASK_HINTS[kind]}"]


def _attention_problems(document_mask) -> list[str]:
    """A tiny attention (torch SDPA, 2 heads, float64) over one packed row with the learner's mask:
    changing game 1's queries, keys and values must leave the other games' outputs unchanged, each
    game's outputs must equal the game alone under plain causal attention, and nothing may be nan."""
    row = ATTENTION_ROW
    docs = torch.tensor([row])
    mask = document_mask(docs.clone())
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, len(row), len(row)):
        return []  # said by the mask's own check
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, len(row), 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    changed = [t.clone() for t in (q, k, v)]
    first = docs[0] == 1
    for t in changed:
        t[:, :, first] = torch.randn(t[:, :, first].shape, generator=g, dtype=torch.float64)
    out_changed = F.scaled_dot_product_attention(*changed, attn_mask=mask)
    where = f"attention with your mask (torch SDPA on document_ids {row})"
    problems = []
    real = [i for i in range(len(row)) if row[i] != 0]
    if not torch.isfinite(out[0, :, real]).all():
        i = next(i for i in real if not torch.isfinite(out[0, :, i]).all())
        problems.append(f"{where}: position {i} ({_token(row, i)}) came out nan. Hint: a token that sees no key, its "
                        "own included, divides 0 by 0 in the softmax")
    later = [i for i in real if row[i] != 1]
    delta = (out_changed[0, :, later] - out[0, :, later]).abs().amax(dim=(0, 2))
    if not (delta <= 1e-12).all():
        i = later[int(delta.argmax())]
        problems.append(f"{where}: changing game 1's tokens changed the output at position {i} ({_token(row, i)}) by "
                        f"{float(delta.max()):.3g}. Hint: in a packed row the games must not see each other, or a "
                        "game learns from whatever games happen to share its row")
    for d in sorted(set(row) - {0}):
        mine = [i for i in range(len(row)) if row[i] == d]
        alone = F.scaled_dot_product_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], is_causal=True)
        gap = (out[:, :, mine] - alone).abs().nan_to_num(float("inf")).amax()
        if gap > 1e-10:
            problems.append(f"{where}: the outputs of game {d} (positions {mine[0]} to {mine[-1]}) differ from the "
                            f"same game alone under causal attention by {float(gap):.3g}. Hint: a packed game must "
                            "compute exactly what it computes alone: the same keys, in the same causal order")
            break
    return problems


def check_document_mask(load_solution) -> list[str]:
    """The learner's `document_mask` on each layout of `MASK_LAYOUTS` against the mask by definition,
    then the attention it gives (`_attention_problems`). In the caller's process: no ranks."""
    document_mask = load_solution().document_mask
    problems = []
    for name, docs in MASK_LAYOUTS:
        given = torch.tensor(docs)
        got = document_mask(given)
        if not torch.equal(given, torch.tensor(docs)):
            problems.append(f"{name}: document_ids was changed in place. Hint: build the mask from comparisons, "
                            "which make new tensors; leave the input as it came")
        problems += _mask_problems(name, docs, got, _mask_by_definition(docs))
    return problems + _attention_problems(document_mask)


# ---------------------------------------------------------------------------------- 04: ZeRO-2's step
def check_zero2_step(load_solution) -> list[str]:
    from minidist.strategy.options import ADAMW_OPTIONS
    from minidist.parallel.precision import MixedPrecision
    from minidist.parallel.zero import ShardedOptimizer, ZeroDP

    rank = dist.get_rank()
    theirs = load_solution().ShardedOptimizer
    problems = []
    for dtype in (torch.float32, torch.bfloat16):
        mp, found = MixedPrecision(param_dtype=dtype), []
        reference = ZeroDP(ToyNet(), 2, mp, BUCKET_CAP_MB)
        model = ZeroDP(ToyNet(), 2, mp, BUCKET_CAP_MB)
        options = dict(lr=0.05, weight_decay=0.1, **ADAMW_OPTIONS)
        ref_opt = ShardedOptimizer(reference.buckets, torch.optim.AdamW, reference.group, **options)
        opt = theirs(model.buckets, torch.optim.AdamW, model.group, **options)
        plain = ToyNet()  # fp32: what ZeRO must equal, AdamW on every weight with the averaged gradient
        plain_opt = torch.optim.AdamW(plain.parameters(), **options)
        for step in range(3):
            x, y = toy_batch(rank, step, dtype)
            toy_loss(reference, x, y).backward()
            toy_loss(model, x, y).backward()
            toy_loss(plain, x.float(), y).backward()
            for q in plain.parameters():
                dist.all_reduce(q.grad)
                q.grad /= dist.get_world_size()
            plain_opt.step()
            plain_opt.zero_grad()
            before = [b.weights.detach().clone() for b in model.buckets]
            comm.counter.reset()
            ref_opt.step()
            ref_bytes = comm.counter.take()
            opt.step()
            sent = comm.counter.take()
            where = f"{str(dtype)[6:]}, step {step + 1}"
            if abs(sent - ref_bytes) > 0.5:
                found.append(f"{where}: the step sent {sent:.0f} bytes; minidist's sends {ref_bytes:.0f}, one "
                             "all-gather of each bucket's weights ((N-1)/N of them). Hint: after stepping, "
                             "comm.all_gather(bucket.weights, my_shard.clone(), group=self.group) for each bucket")
            for b, (bucket, ref_bucket, old) in enumerate(zip(model.buckets, reference.buckets, before)):
                found += _zero_bucket_problems(f"{where}, bucket {b}", bucket, ref_bucket, old, rank)[:1]
                first = bucket.weights.detach().clone()
                dist.broadcast(first, 0)  # every rank must hold the same weights after a step
                if not torch.equal(first, bucket.weights.detach()):
                    found.append(f"{where}, bucket {b}: this rank's weights differ from rank 0's "
                                 f"({_first_difference(bucket.weights.detach(), first)}, rank 0's). Hint: the ranks "
                                 "drift apart unless every rank all-gathers everyone's updated shard")
            if dtype == torch.float32:
                for (name, q), want in zip(model.module.named_parameters(), plain.parameters()):
                    if not _close(q.detach(), want.detach(), rtol=1e-4, atol=1e-6):
                        found.append(f"{where}: {name!r} is not what AdamW on the averaged gradient gives in one "
                                     f"process ({_first_difference(q.detach(), want.detach())}). Hint: each master gets "
                                     "its shard's gradient, the inner AdamW steps, then every rank all-gathers")
                        break
            opt.zero_grad()
            ref_opt.zero_grad()
        problems = problems or found[:3]  # fp32's problems first; bf16's where fp32 had none
    return problems


def _zero_bucket_problems(label, bucket, ref_bucket, old, rank) -> list[str]:
    out, layout = [], bucket.layout
    if not _close(bucket.master.detach(), ref_bucket.master.detach()):
        out.append(f"{label}: the fp32 master of this rank's shard is not AdamW's step "
                   f"({_first_difference(bucket.master.detach(), ref_bucket.master.detach())}). Hint: "
                   "bucket.master.grad = bucket.own_gradient() as fp32, then self.optimizer.step()")
    weights, expected = bucket.weights.detach(), ref_bucket.weights.detach()
    for q in range(layout.padded_numel // layout.shard_numel):
        lo, hi = q * layout.shard_numel, min((q + 1) * layout.shard_numel, layout.numel)
        if lo >= hi or _close(weights[lo:hi], expected[lo:hi]):
            continue
        span = f"{label}, elements [{lo}, {hi}) of its flat weights ({'this rank' if q == rank else f'rank {q}'}'s shard)"
        stale = torch.equal(weights[lo:hi], old[lo:hi])
        if q == rank and stale:
            out.append(f"{span}: unchanged by the step. Hint: copy the updated master into "
                       "bucket.weights[bucket.layout.shard_slice] before the all-gather (in bf16 the master is a "
                       "separate fp32 tensor; in fp32 it is a view, which is why fp32 may pass)")
        elif stale:
            out.append(f"{span}: unchanged by the step on this rank, while rank {q} updated it. Hint: all-gather "
                       "every rank's updated shard into bucket.weights after the step")
        else:
            out.append(f"{span}: {_first_difference(weights[lo:hi], expected[lo:hi])}. Hint: after the step each "
                       "shard of the weights holds its own rank's updated master: step first, then all-gather")
    return out


# ---------------------------------------------------------------------------------- 05: FSDP's gather and free
def check_fsdp_gather_free(load_solution) -> list[str]:
    from minidist.parallel import fsdp

    rank = dist.get_rank()
    theirs = load_solution().Unit
    reference = fsdp.FullyShardedDataParallel(ToyNet(), unit_classes=("Block",))
    with mock.patch.object(fsdp, "Unit", theirs):  # the wrapper builds its units from the module's name
        model = fsdp.FullyShardedDataParallel(ToyNet(), unit_classes=("Block",))
    names = {id(m): name for name, m in model.module.named_modules()}
    label = {id(u): "the root" if u is model.root else f"unit {names[id(u.module)]!r}" for u in model.units}

    def live(u):  # the gathered bytes a unit holds
        return u._data.untyped_storage().nbytes()

    peak = []  # units holding gathered memory, seen as each block starts its forward
    for unit in model.layer_units:
        unit.module.register_forward_pre_hook(lambda *_: peak.append(sum(live(u) > 0 for u in model.units)))
    plain = ToyNet()  # the same weights, unsharded: its loss is what a gathered forward computes
    problems, optimizers = [], [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(2):
        x, y = toy_batch(rank, step)
        comm.counter.reset()
        ref_loss = toy_loss(reference, x, y)
        ref_loss.backward()
        ref_bytes = comm.counter.take()
        loss = toy_loss(model, x, y)
        # The root stays gathered from its forward to its backward (minidist's post_forward, as FSDP2's).
        after_forward = [u for u in model.units if live(u) and u is not model.root]
        loss.backward()
        sent = comm.counter.take()
        after_backward = [u for u in model.units if live(u)]
        where, found = f"step {step + 1}", []
        for moment, held in (("forward", after_forward), ("backward", after_backward)):
            if held:
                found.append(f"{where}: after the {moment}, {label[id(held[0])]} still holds {live(held[0])} bytes of "
                             f"gathered weights ({len(held)} of {len(model.units)} units do). Hint: free must give the "
                             "memory back: self._data.untyped_storage().resize_(0)")
        if abs(sent - ref_bytes) > 0.5:
            found.append(f"{where}: sent {sent:.0f} bytes in forward and backward; minidist's FSDP sends {ref_bytes:.0f} "
                         "(each layer unit all-gathered twice, the root once, each gradient reduce-scattered once). Hint: gather must do "
                         "nothing unless the unit is sharded (the prefetch may have started it already)")
        if peak and max(peak) > 3:
            found.append(f"{where}: {max(peak)} units held gathered weights at once in forward; FSDP holds at most "
                         "3 (the root, the running unit, the prefetched next one). Hint: free each unit after it ran")
        counted = max(peak) if peak else 0
        if model.max_unsharded < counted <= 3:  # (more than 3: the memory itself is the problem, said above)
            found.append(f"{where}: model.max_unsharded says {model.max_unsharded}, but {counted} units were gathered "
                         "at once. Hint: self.fsdp._count_unsharded(+1) when a gather starts, (-1) when a unit is freed")
        want = toy_loss(plain, x, y).detach() if step == 0 else ref_loss.detach()  # (then SGD moves the shards)
        if not _close(loss.detach(), want):
            found.append(f"{where}: the loss is {loss.item():.6g}, the unsharded model's is {want.item():.6g}. Hint: "
                         "gather every rank's shard into the unit's full buffer, and wait for it before the unit runs")
        for unit, ref_unit in zip(model.units, reference.units):
            got, want = unit.flat_param.grad, ref_unit.flat_param.grad
            if got is None or not _close(got, want):
                found.append(f"{where}: the gradient shard of {label[id(unit)]} "
                             f"{'is None' if got is None else _first_difference(got, want)} (minidist's FSDP)")
                break
        problems = problems or found
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        peak.clear()
    return problems


# ---------------------------------------------------------------------------------- 11: f's backward
def check_copy_to_tp_backward(load_solution) -> list[str]:
    """A linear layer, then f, then a column-parallel linear, GELU and a row-parallel one (g at its
    exit), in float64 on every rank, against the same network whole in one process."""
    from minidist.parallel.tensor import ops
    from minidist.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear

    n = dist.get_world_size()
    torch.manual_seed(0)  # the same weights and batch on every rank, as tensor parallelism has them
    before, column, row = nn.Linear(6, 8).double(), nn.Linear(8, 12).double(), nn.Linear(12, 8).double()
    x, w = torch.randn(3, 5, 6, dtype=torch.float64), torch.randn(3, 5, 8, dtype=torch.float64)
    h = before(x)
    expected = torch.autograd.grad((row(F.gelu(column(h))) * w).sum(), h)[0]  # one process, the whole block
    column, row = ColumnParallelLinear(column, None), RowParallelLinear(row, None)
    h = before(x)
    # This rank's term alone, without the sum (f's backward as g's, the identity): to name that mistake.
    local = torch.autograd.grad((F.linear(F.gelu(column(h)), row.weight) * w).sum(), h)[0]
    h.retain_grad()
    with mock.patch.object(ops, "CopyToTensorParallel", load_solution().CopyToTensorParallel):
        out = row(F.gelu(column(ops.copy_to_tp(h, None))))
        comm.counter.reset()
        (out * w).sum().backward()
        sent = comm.counter.take()
    problems = []
    if h.grad is None or not _close(h.grad, expected, rtol=1e-9, atol=1e-12):
        problems.append(_f_gradient_problem(h.grad, expected, local, n))
    one = 2 * (n - 1) / n * h.numel() * h.element_size()  # one all-reduce of the block's input gradient
    if abs(sent - one) > 0.5:
        problems.append(f"backward sent {sent:.0f} bytes through minidist.parallel.comm; f's backward is one all-reduce "
                        f"of the block's input gradient, 2(N-1)/N x {h.numel() * h.element_size()} = {one:.0f} bytes "
                        "(the block's exit, g, sends nothing in backward). Hint: comm.all_reduce(copy, group=ctx.group), "
                        "once: torch.distributed's own call sums too, but no byte count sees it")
    return problems


def _f_gradient_problem(got, expected, local, n) -> str:
    if got is None:
        return "the block's input has no gradient. Hint: backward returns (the gradient of x, None)"
    where = _first_difference(got, expected)
    s = _ratio(got, expected)
    if _close(got, local, rtol=1e-9, atol=1e-12):
        return (f"the block's input gradient is only this rank's part of the sum ({where}). Hint: every rank's "
                "slice of the block used x, so dL/dx sums their terms over the ranks: all-reduce it (returning "
                "grad unchanged is g's backward, not f's)")
    if s is not None and abs(s * n - 1) < 1e-6:
        return (f"the block's input gradient is 1/{n} of the right one ({where}). Hint: sum, not average: the ranks "
                "hold different terms of one sum, not copies of one gradient as in DDP")
    if s is not None:
        return f"the block's input gradient is {s:.4g} x the right one ({where}). Hint: one all-reduce, a sum"
    return f"the block's input gradient is wrong ({where}). Hint: the sum over the ranks of `grad`, the same on each"



# ---------------------------------------------------------------------------------- 12: 1F1B's list
PIPELINE_MICRO_BATCHES = (2, 8)  # fewer micro-batches than the 4 stages (the warm-up capped), and more
# executor.check's refusal -> the hint: what in a 1F1B list makes it
TABLE_HINTS = {
    "must run F and B": "every rank runs F i and B i once for each i in range(m): cap the warm-up at m",
    "backward before its forward": "a micro-batch's backward comes after its forward, on every stage",
    "out of order": ("backwards go in micro-batch order, 0 first, in the steady state and the cool-down: a stage "
                     "receives gradients in the order the next stage sent them"),
    "deadlock": "stage rank warms up with p - 1 - rank forwards (at most m), then runs one forward, one backward",
}


def check_one_f_one_b(load_solution) -> list[str]:
    """The learner's lists, one per stage, checked by `executor.check`, then run by the executor on a
    4-layer Llama over 4 stages (tests/parallel/pipeline_workers.run: 2 AdamW steps, float64) against
    the whole model in one process; and each stage's peak of held micro-batches against 1F1B's."""
    from minidist.parallel.pipeline import executor, schedules

    if str(ROOT / "tests" / "parallel") not in sys.path:  # the pipeline tests' model, batches and reference
        sys.path.insert(0, str(ROOT / "tests" / "parallel"))
    import pipeline_workers

    one_f_one_b = load_solution().one_f_one_b
    pp, rank = dist.get_world_size(), dist.get_rank()
    problems = []
    # Under the name "1f1b", the learner's function makes the table (schedules.table calls it once per rank).
    with mock.patch.dict(schedules.SCHEDULES, {"1f1b": one_f_one_b}):
        for m in PIPELINE_MICRO_BATCHES:
            table = schedules.table("1f1b", m, pp)
            try:
                executor.check(table, m)
            except ValueError as e:  # the same table on every rank: every rank stops here, in step
                hint = next((h for fragment, h in TABLE_HINTS.items() if fragment in str(e)), TABLE_HINTS["deadlock"])
                named = int(re.search(r"rank (\d+)", str(e)).group(1))  # the rank the refusal names first
                its = " ".join(f"{kind}{i}" for kind, i in table[named])
                return [(f"with m = {m} micro-batches on {pp} stages, executor.check refuses the table: {e}. "
                         f"Your list for rank {named}: {its}. Hint: {hint}")]
            result = pipeline_workers.run("1f1b", m)
            problems += _pipeline_parity_problems(result, m, rank, pp)
            problems += _held_problems(result["peak_held"], table[rank], m, rank, pp)
    return problems


def _pipeline_parity_problems(result: dict, m: int, rank: int, pp: int) -> list[str]:
    problems = []
    if rank == pp - 1:
        for step, (mine, expected) in enumerate(zip(result["losses"], result["reference"])):
            if abs(mine - expected) > 1e-10 * abs(expected):
                problems.append(f"with m = {m}, step {step}'s loss is {mine:.10g}, one process's {expected:.10g}")
    name, worst = max(result["worst"].items(), key=lambda kv: kv[1])
    if worst > 1e-10:
        problems.append(f"with m = {m}, the weight {name} after 2 steps is {worst:.3g} (relative) from one process's")
    return problems


def _held_problems(held: int, actions: list, m: int, rank: int, pp: int) -> list[str]:
    """1F1B holds exactly min(m, p - rank) micro-batches' activations at its peak on stage `rank`."""
    expected = min(m, pp - rank)
    if held == expected:
        return []
    said = (f"with m = {m}, this stage held {held} micro-batches' activations at once; 1F1B holds min(m, p - rank) "
            f"= {expected}")
    if actions == [("F", i) for i in range(m)] + [("B", i) for i in range(m)]:
        return [(f"{said}: your list is GPipe's (every forward, then every backward). Hint: start the backwards "
                 "once the pipeline is full: after p - 1 - rank forwards, one forward then one backward")]
    if held == expected + 1:
        return [(f"{said}. Hint: one forward too many before the first backward: the warm-up is p - 1 - rank "
                 "forwards, and the steady state's first forward makes p - rank")]
    if held < expected:
        return [(f"{said}: the pipeline is never full, and the stages wait (the bubble grows). Hint: warm up "
                 "with p - 1 - rank forwards (at most m)")]
    return [f"{said}. Hint: alternate one forward and one backward after the warm-up of p - 1 - rank forwards"]

CHECKS = {"01_ring_all_reduce": check_ring, "02_bucket_hook": check_bucket_hook, "03_accumulation": check_accumulation,
          "03_packing_mask": check_document_mask,
          "04_zero2_step": check_zero2_step, "05_fsdp_gather_free": check_fsdp_gather_free,
          "11_tensor_parallel": check_copy_to_tp_backward, "12_pipeline_parallel": check_one_f_one_b}

# (text in the exception, the hint): mistakes whose first sign is an exception, in every exercise
ANY_EXERCISE = [("Timed out", "a rank waited a minute for a peer that never came: a send without the neighbour's "
                 "matching receive, or a collective that only some ranks called"),
                ("Connection closed by peer", "another rank stopped first: its own message, above, is the cause")]
# and per exercise
HINTS = {
    "11_tensor_parallel": [("incorrect number of gradients", ("backward returns one gradient per input of forward: "
                                                              "(the gradient of x, None for the group)"))],
    "02_bucket_hook": [("'NoneType' object has no attribute 'wait'", "a bucket had no handle when backward ended: "
                        "launch every bucket's all-reduce with async_op=True when it is full, and keep the handle "
                        "in bucket.handle"),
                       ("copy_", "say what is sent: bucket.sent = bucket.buffer (then _finish finds the buffer)")],
}
