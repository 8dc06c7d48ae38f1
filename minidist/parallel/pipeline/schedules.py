"""Pipeline schedules as plain lists: for each rank, the order in which it runs the forward and
the backward of the step's m micro-batches.

An action is `("F", i)` (the forward of micro-batch i) or `("B", i)` (its backward). Sends and
receives are implied by the stage's place, so that a list reads as the diagrams in the papers do:
a forward receives its input from the stage before (unless it is the first) and sends its output
to the stage after (unless it is the last); a backward receives its output's gradient from the
stage after (unless it is the last, which starts from its loss) and sends its input's gradient to
the stage before (`p2p.plan` lays out when each is posted). `executor.Executor.step` runs any such
table; `show` prints it:

    >>> print(show(table("1f1b", m=4, pp=2)))
    rank 0: F0 F1 B0 F2 B1 F3 B2 B3
    rank 1: F0 B0 F1 B1 F2 B2 F3 B3

**GPipe** (Huang et al. 2019): every forward, then every backward. Each stage holds the saved
activations of all m micro-batches at once, before the first backward frees any.

**1F1B** (the one-forward-one-backward order of PipeDream, Narayanan et al. 2019, flushed at each
step as PipeDream-Flush, Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training";
Megatron-LM's default): stage r runs p - 1 - r forwards to fill the pipeline (the warm-up), then
alternates one forward and one backward (the steady state), then runs the backwards left (the
cool-down). A backward frees a micro-batch's activations as soon as the next forward would make
one more, so stage r holds at most p - r micro-batches, not m. Both schedules idle the same
(p - 1) / (m + p - 1) of the time (the bubble): 1F1B saves memory, not time.

**1F1B with fewer micro-batches than stages** (m < p) is not refused: the warm-up is capped at m,
so the first stages run every forward before any backward, as GPipe does, and the last stages
still alternate. It is correct (the executor checks it as any other table) and holds at most
m <= p micro-batches, but with m < p the bubble is most of the step: use m >= p.
"""

Action = tuple[str, int]


def gpipe(m: int, pp: int, rank: int) -> list[Action]:
    """All forwards, then all backwards, in micro-batch order (the same list on every rank)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(m: int, pp: int, rank: int) -> list[Action]:
    """Warm-up forwards, then one forward and one backward in turn, then the backwards left."""
    warmup = min(pp - 1 - rank, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def table(name: str, m: int, pp: int) -> list[list[Action]]:
    """Every rank's list of the schedule `name`, by rank."""
    if name not in SCHEDULES:
        raise ValueError(f"no pipeline schedule named {name!r}: choose one of {', '.join(SCHEDULES)}")
    if m < 1:
        raise ValueError(f"a pipeline needs at least one micro-batch, not {m}")
    return [SCHEDULES[name](m, pp, rank) for rank in range(pp)]


def show(actions_by_rank: list[list[Action]]) -> str:
    """The table as text, one line per rank (`F3` is micro-batch 3's forward)."""
    return "\n".join(f"rank {rank}: " + " ".join(f"{kind}{i}" for kind, i in actions)
                     for rank, actions in enumerate(actions_by_rank))
