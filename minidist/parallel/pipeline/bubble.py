"""The bubble: the share of a step a stage spends idle, measured from the executor's timeline of a
real run and set against what the schedules promise, (p - 1) / (m + p - 1).

**Where the formula comes from.** Take p stages that are equal: a micro-batch's forward takes t_f
on every stage, its backward t_b. Each stage computes m forwards and m backwards, so it is busy
m·(t_f + t_b) per step, whatever the schedule. Under GPipe the last micro-batch leaves stage 0 at
m·t_f and needs p - 1 more forwards to get through the last stage: the forwards end at
(m + p - 1)·t_f, and the backwards, which come back the same way, take (m + p - 1)·t_b. The step
lasts (m + p - 1)·(t_f + t_b), and every stage idles the difference, (p - 1)·(t_f + t_b): stage r
waits r·t_f before its first forward, (p - 1 - r)·(t_f + t_b) between its last forward and its
first backward, and r·t_b after its last backward. Divided by the step:

    idle fraction = (p - 1) / (m + p - 1)

1F1B reorders each stage's actions inside the same start and end (`schedules.py`): the same bubble,
less memory. Only more micro-batches shrink it (at p = 2, m = 1 idles 1/2 of the step, m = 4 a
fifth, m = 8 a ninth): that is why a pipeline wants m well above p.

**What breaks it on a CPU, and how the measurement avoids it.**

- *Unequal stages.* The last stage also computes the final norm, the head and the loss. A
  pipeline runs at its slowest stage's pace, and the others wait for it: with the chess vocabulary
  (1,975 tokens) the head of a hidden-256 model is 0.65 of a decoder layer, a third more work for
  the last of two 2-layer stages, and the first stage then idles more than the formula says, the
  last less. To check the formula, `measure` takes a small vocabulary (256: the head is 8% of a
  layer, 4% of a 2-layer stage); `--vocab 1975` shows the imbalance.
- *Shared cores.* The formula gives each stage its own processor. Here 2 cores are shared by the
  p ranks and by whatever else runs: measure with p = 2, one thread per rank
  (`torch.set_num_threads(1)`), or the two ranks' thread pools fight over both cores. At p = 4 on
  2 cores the formula held at m = 1, where one stage computes at a time (0.74 to 0.77 against
  0.75), but not from m = 4 up: stages that would compute at once take turns on the cores, and a
  rank whose input has arrived waits for a core; each stage idled 0.36 to 0.67 against 0.43 at
  m = 4, and 0.43 to 0.67 against 0.27 at m = 8 (one run of the command below, `--pp 4`).
- *The hand-overs.* A receive's wait is counted as idle (`executor.py`), and it includes gloo
  copying the activations over the loopback and, on a loaded machine, the receiver waiting to be
  scheduled again: a fixed cost per hand-over, 2m of them per step, against a compute per action
  that shrinks as 1/m (and runs below peak on small matrices). At p = 2 and m = 8 (one sequence
  per micro-batch) the stages idled 0.22 to 0.33 of the step, against 0.11 (two runs of the
  command below, load average 7 to 12); at m = 1, 2 and 4 within 0.12 of the formula.

**The ranks' clocks.** Each rank times its actions from its own step's start. `measure` starts
the ranks together (a barrier before each step), and a step of the pipeline lasts until its last
rank ends: `idle_fraction` is taken against that common step time (`stage_idle`), and `bars` lays
the ranks' timelines on one axis.

    python -m minidist.parallel.pipeline.bubble --pp 2 --m 1 2 4 8

prints each stage's measured idle fraction (median of the steps, and their range) against the
formula, on CPU ranks started by `launch`; `--gantt` draws each case's last step as text.
"""

import importlib
import statistics

import torch
import torch.distributed as dist

from minidist.parallel.pipeline import executor, schedules, stages

Timeline = list[tuple[str, int, float, float]]  # (kind, i, start, end): Executor.timeline


def expected(p: int, m: int) -> float:
    """The bubble of p equal stages and m micro-batches, GPipe or 1F1B: (p - 1) / (m + p - 1) (module doc)."""
    return (p - 1) / (m + p - 1)


def idle_fraction(timeline: Timeline, step_time: float) -> float:
    """The share of `step_time` this stage's `timeline` did not compute."""
    return 1 - sum(end - start for _, _, start, end in timeline) / step_time


def stage_idle(steps_by_rank: list[list[tuple[Timeline, float]]]) -> list[list[float]]:
    """Each stage's idle fraction per step, from every rank's (timeline, step_time) per step: against the
    step of the whole pipeline, which ends when its last rank does (module doc)."""
    pipeline_steps = [max(steps[n][1] for steps in steps_by_rank) for n in range(len(steps_by_rank[0]))]
    return [[idle_fraction(timeline, pipeline_steps[n]) for n, (timeline, _) in enumerate(steps)]
            for steps in steps_by_rank]


def bars(timeline_by_rank: list[Timeline]) -> list[tuple[int, str, int, float, float]]:
    """The Gantt chart of one step: a bar (rank, kind, i, start, end) per action, ready to draw (one row
    per rank, a colour per kind; matplotlib's `broken_barh` takes (start, end - start))."""
    return [(rank, kind, i, start, end) for rank, timeline in enumerate(timeline_by_rank)
            for kind, i, start, end in timeline]


def gantt(timeline_by_rank: list[Timeline], step_time: float, width: int = 60) -> str:
    """The same chart as text: a line per rank, `width` columns for the step, F or B where that rank
    computed a forward or a backward, `.` where it idled."""
    lines = []
    for rank, timeline in enumerate(timeline_by_rank):
        row = ["."] * width
        for _, kind, _, start, end in bars([timeline]):
            for column in range(round(start / step_time * width), round(end / step_time * width)):
                row[min(column, width - 1)] = kind
        lines.append(f"rank {rank}: " + "".join(row))
    return "\n".join(lines)


def model(hidden: int, layers: int, vocab: int):
    """A Llama of the given sizes (the chess model's config, its vocabulary cut to `vocab`), seeded."""
    from transformers import LlamaForCausalLM

    from minidist.hf import models

    config = models.tiny_llama_config(hidden_size=hidden, num_layers=layers)
    config.vocab_size = vocab
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def measure(tables: list, *, hidden=256, layers=4, vocab=256, sequences=8, length=64, steps=3) -> list:
    """In each rank of a `launch` (rank r is stage r): run every table of actions (`schedules.table`)
    for a warm-up step and `steps` steps on one batch of `sequences` x `length` random tokens, every
    sequence full, cut into as many equal micro-batches as the table has; return, per table, this
    rank's (timeline, step_time) per step after the warm-up."""
    torch.set_num_threads(1)  # one core per stage (module doc)
    pp, rank = dist.get_world_size(), dist.get_rank()
    stage = stages.Stage(model(hidden, layers, vocab), rank, pp)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (sequences, length), generator=generator)
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}
    results = []
    for table in tables:
        m = len(table[0]) // 2
        micro_batches = [{key: value.chunk(m)[i] for key, value in batch.items()} for i in range(m)]
        run = executor.Executor(stage)
        measured = []
        for step in range(1 + steps):
            dist.barrier()  # the ranks start the step together: their clocks share an origin
            run.step(table, micro_batches, sequences * (length - 1))
            stage.zero_grad(set_to_none=True)
            if step > 0:  # the first step of a table allocates what the next ones reuse
                measured.append((run.timeline, run.step_time))
        results.append(measured)
    return results


def main(argv=None) -> None:
    from minidist.runtime.errors import ArgumentParser, one_line_errors
    from minidist.runtime.launch import launch

    p = ArgumentParser(prog="python -m minidist.parallel.pipeline.bubble", description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2, help="stages, one CPU rank each (default 2)")
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batches per step")
    p.add_argument("--schedule", nargs="+", default=["gpipe", "1f1b"], help="schedules to run")
    p.add_argument("--steps", type=int, default=3, help="measured steps per case, after one warm-up")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256, help="1975 for the chess tokenizer's (module doc)")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--gantt", action="store_true", help="draw each case's last step as text")
    args = p.parse_args(argv)
    with one_line_errors(p.prog, ValueError):
        stages.balance(args.layers, args.pp)
        cases = [(name, m) for name in args.schedule for m in args.m]
        tables = [schedules.table(name, m, args.pp) for name, m in cases]
        if any(args.sequences % m for m in args.m):
            raise ValueError(f"--sequences {args.sequences} must split into each --m's equal micro-batches")
    sizes = {name: getattr(args, name) for name in ("hidden", "layers", "vocab", "sequences", "length", "steps")}
    # By its module's name, not __main__'s: each rank imports the function it runs.
    by_name = importlib.import_module("minidist.parallel.pipeline.bubble").measure
    by_rank = launch(by_name, args.pp, tables, timeout_s=600, **sizes)
    print(f"pp {args.pp}, " + ", ".join(f"{k} {v}" for k, v in sizes.items()) + ", 1 thread per rank: "
          "idle fraction per stage, median of the steps (min-max)")
    print("schedule  m  step (s)  formula  " + "  ".join(f"stage {r:<12}" for r in range(args.pp)))
    for n, (name, m) in enumerate(cases):
        idle = stage_idle([rank[n] for rank in by_rank])
        cells = [f"{statistics.median(s):.3f} ({min(s):.2f}-{max(s):.2f})" for s in idle]
        step = statistics.median(max(rank[n][k][1] for rank in by_rank) for k in range(args.steps))
        print(f"{name:<8} {m:>2}  {step:8.3f}  {expected(args.pp, m):.3f}    " + "  ".join(f"{c:<18}" for c in cells))
        if args.gantt:
            last = [rank[n][-1] for rank in by_rank]
            print(gantt([timeline for timeline, _ in last], max(end for _, end in last)))


if __name__ == "__main__":
    main()
