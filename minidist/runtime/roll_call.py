"""Who has joined? A line every 30 s while the ranks of a job wait for each other at the rendezvous.

`init_process_group` returns only when every rank of the world has reached it. Rank 0 hosts the
store (a `TCPStore` at MASTER_ADDR:MASTER_PORT) and waits inside its constructor until the other
ranks have connected; the others wait until they reach it. A rank that never comes (a typo in
WORLD_SIZE, a node that did not start, `RANK=0 WORLD_SIZE=2` typed in one terminal) leaves the
rest waiting for the process group's whole timeout, 600 s, in silence.

So while a rank waits there, a thread beside it takes the roll: it connects to the same store as a
client, sets a key of its own (`minidist/joined/<rank>`), and every `every_s` seconds rank 0 says
which ranks have not set theirs yet:

    minidist: waiting for rank 1 to join (1 of 2 joined, 30 s); each rank needs the same MASTER_ADDR, ...

A rank other than 0 speaks only while it cannot reach rank 0's store at all; once it can, rank 0
speaks for everyone (one line per period for the job, not one per rank). `missing` keeps the last
roll, so a rendezvous that times out can name the ranks it waited for in its one-line error.

Under torchrun the store is the agent's, which has already gathered every rank of a node (and
outlives restarts, so old keys would lie): the roll call is for the launches without an agent.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

EVERY_S = 30.0
_KEY = "minidist/joined/"
_NAMED = 8  # ranks named in a line; a longer list ends with "..."


def ranks_named(ranks: list[int]) -> str:
    """`[1]` -> "rank 1", `[1, 3]` -> "ranks 1, 3": the ranks a line names, the first few of a long list."""
    shown = ", ".join(str(r) for r in ranks[:_NAMED]) + (", ..." if len(ranks) > _NAMED else "")
    return f"rank{'s' * (len(ranks) > 1)} {shown}"


class RollCall(threading.Thread):
    """Take the roll while this rank waits at the rendezvous; `stop()` when the group exists."""

    def __init__(self, addr: str, port: int, rank: int, world_size: int, every_s: float = EVERY_S):
        super().__init__(daemon=True, name="minidist-roll-call")  # never keeps a failed process alive
        self.addr, self.port, self.rank, self.world_size, self.every_s = addr, port, rank, world_size, every_s
        self.missing: list[int] | None = None  # None: the store was never reached
        self._done = threading.Event()
        self._start = time.monotonic()

    def stop(self, wait_s: float | None = None) -> None:
        """End the roll call and wait for its thread: none may be left inside the store's C++ code when
        the interpreter shuts down, which would abort the process (see distributed.py, "Leaving cleanly").
        `wait_s` bounds the wait, for a rendezvous that failed: a client that connected to a port some
        other program holds waits for an answer that never comes, and the process must still say why
        and exit (the thread is a daemon: the exit ends it)."""
        self._done.set()
        if self.is_alive():
            self.join(wait_s)

    def run(self) -> None:
        store, next_line = None, self._start + self.every_s
        while not self._done.is_set():
            if store is None:
                store = self._connect()
            if time.monotonic() >= next_line and not self._done.is_set():
                self._say(store)
                next_line += self.every_s
            self._done.wait(0.1)

    def _connect(self):
        """A client of the rendezvous store with our key set, or None while the store is not up.

        A plain socket asks first whether anyone listens: a store client would retry on its own,
        logging every try, and block for its whole timeout."""
        try:
            socket.create_connection((self.addr, self.port), timeout=1.0).close()
            store = dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=min(self.every_s, 5.0)))
            store.set(f"{_KEY}{self.rank}", "1")
            return store
        except (OSError, RuntimeError):  # not up yet (rank 0 has not started): try again on the next turn
            return None

    def _say(self, store) -> None:
        waited = f"{time.monotonic() - self._start:.0f} s"
        if store is None:
            print(f"minidist: rank {self.rank} waiting for rank 0's store at {self.addr}:{self.port} ({waited})",
                  file=sys.stderr, flush=True)
            return
        try:
            self.missing = [r for r in range(self.world_size) if not store.check([f"{_KEY}{r}"])]
        except RuntimeError:  # the store went away: the rendezvous is ending, one way or the other
            return
        if self.rank == 0 and self.missing:
            joined = self.world_size - len(self.missing)
            print(f"minidist: waiting for {ranks_named(self.missing)} to join ({joined} of {self.world_size} "
                  f"joined, {waited}); each rank needs the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE",
                  file=sys.stderr, flush=True)
