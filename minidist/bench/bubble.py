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

**What a CPU run measures, and what moves it off the formula.** Lesson 12 has the figures, from
the command below; here is what moves a measurement off the formula, and how `measure` keeps each
out.

- *The micro-batch's size.* The formula's m micro-batches each cost t_f + t_b, whatever m. So
  `measure` (`micro_batch=1`, the command's default) gives each micro-batch one sequence and the
  step m of them; `sequences=8` (`--sequences 8`) cuts one batch of 8 into m instead, so that an
  action shrinks as 1/m while the fixed costs of an action and of a hand-over do not, and the
  stages idle more than the formula says at large m.
- *Unequal stages.* The last stage also computes the final norm, the head and the loss, and a
  pipeline runs at its slowest stage's pace: the first stage waits for it. With the chess
  vocabulary (1,975 tokens) the head of a hidden-256 model is 0.65 of a decoder layer, a third
  more work for the last of two 2-layer stages; `measure` takes a 64-token vocabulary (the head is
  1% of a 2-layer stage; `--vocab 1975` shows the imbalance). Even so the last stage's actions
  take a little longer than the first's (the head, the norm and the loss are still some work), so
  the first stage idles a little more than the formula, the last a little less.
- *Shared cores and the hand-overs: why the host's clock alone cannot check the formula here.* The
  formula gives each stage its own processor, always at work when its input is there. Here the ranks
  share the machine's cores with everything else (one thread per rank, `torch.set_num_threads(1)`,
  or their thread pools fight over the cores): an action can take several times its CPU time on the
  host's clock, and a receive includes gloo's copy and, on a loaded machine, the receiver waiting
  to be scheduled again. At p = 4 on 2 cores it cannot hold at all: four stages that would compute at once take turns, so at
  most 2 of the 4 compute at any moment and the mean idle over the stages is at least 1 - 2/4 = 0.5,
  whatever m (the formula: 0.43 at m = 4, 0.27 at m = 8).
- *So the measurement reads two clocks.* `CpuTimed` is the executor, timing the same interval (from
  after the receive to before the send) on the host's clock, the timeline as it ran (`stage_idle`),
  and on the rank's thread's CPU clock: the work the action did, which a rank waiting for a core or
  for a message does not add to. `replay` runs each step's measured work through the same table on a
  core per stage with free hand-overs, the machine the formula is about, with the work and the
  imbalance this run measured (`replayed_idle`): there the formula holds, and a table that runs one
  micro-batch at a time idles its own (p - 1) / p (lesson 12 has the figures and the band the test
  holds them to). The host's clock minus the replay is what the machine added: hand-overs and
  shared cores.

**The ranks' clocks.** Each rank times its actions from its own step's start. `measure` starts
the ranks together (a barrier before each step), and a step of the pipeline lasts until its last
rank ends: `idle_fraction` is taken against that common step time (`stage_idle`), and `bars` lays
the ranks' timelines on one axis.

    python -m minidist.bench bubble --pp 2 --m 1 2 4 8

prints each stage's idle fraction (median of the steps, and their range), on the host's clock and
replayed on a core per stage, against the formula, on CPU ranks started by `launch`; `--gantt`
draws each case's last step as it ran, as text.
"""

import importlib
import statistics
import time

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
    return [[idle_fraction(step[0], pipeline_steps[n]) for n, step in enumerate(steps)] for steps in steps_by_rank]


def replay(table: list, work_by_rank: list[list[float]]) -> list[Timeline]:
    """The timelines the table would have on a machine with a core per stage and free hand-overs:
    rank r's n-th action takes `work_by_rank[r][n]` seconds and starts as soon as its rank has
    finished the one before and its input exists (a forward's, once the stage before has run that
    micro-batch's forward; a backward's, once the stage after has run its backward). The same
    dependencies as `executor.check` plays, with durations (module doc)."""
    executor.check(table, len(table[0]) // 2)  # a table that cannot finish is refused first
    pp = len(table)
    ends, timelines = {}, [[] for _ in range(pp)]  # ends[rank, kind, i]: when that action ended
    while any(len(timelines[r]) < len(table[r]) for r in range(pp)):
        for rank in range(pp):
            while len(timelines[rank]) < len(table[rank]):
                n = len(timelines[rank])
                kind, i = table[rank][n]
                source = rank - 1 if kind == "F" else rank + 1  # where its input comes from
                if 0 <= source < pp and (source, kind, i) not in ends:
                    break  # not computed yet: another rank moves first
                ready = ends[source, kind, i] if 0 <= source < pp else 0.0
                start = max(timelines[rank][-1][3] if n else 0.0, ready)
                ends[rank, kind, i] = start + work_by_rank[rank][n]
                timelines[rank].append((kind, i, start, ends[rank, kind, i]))
    return timelines


def replayed_idle(table: list, steps_by_rank: list[list[tuple[Timeline, float, list[float]]]]) -> list[list[float]]:
    """Each stage's idle fraction per step on a core per stage with free hand-overs: every step's
    measured work per action (`measure`'s third item) replayed through `table` (`replay`), each
    stage's computing set against that replayed step (module doc)."""
    idle = []
    for n in range(len(steps_by_rank[0])):
        timelines = replay(table, [steps[n][2] for steps in steps_by_rank])
        step = max(timeline[-1][3] for timeline in timelines)
        idle.append([idle_fraction(timeline, step) for timeline in timelines])
    return [list(by_stage) for by_stage in zip(*idle)]


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


class CpuTimed(executor.Executor):
    """The executor, reading this thread's CPU clock (`time.thread_time`) beside the host's at each of
    its clock readings: `work()` is then each action of the last step's timeline in CPU seconds, the
    work it did, which a rank waiting for a core does not add to (module doc)."""

    def step(self, *args, **kwargs):
        self.readings = []  # (host clock, CPU clock) at each reading of this step
        return super().step(*args, **kwargs)

    def now(self) -> float:
        wall = super().now()
        self.readings.append((wall, time.thread_time()))
        return wall

    def work(self) -> list[float]:
        cpu_at = {wall - self.start: cpu for wall, cpu in self.readings}  # keyed as the timeline's times are
        return [cpu_at[end] - cpu_at[start] for _, _, start, end in self.timeline]


def measure(tables: list, *, hidden=256, layers=4, vocab=64, sequences=8, length=64, steps=3,
            micro_batch=None) -> list:
    """In each rank of a `launch` (rank r is stage r): run every table of actions (`schedules.table`)
    for a warm-up step and `steps` steps on one batch of `sequences` x `length` random tokens, every
    sequence full, cut into as many equal micro-batches as the table has; or, with `micro_batch`,
    on m micro-batches of `micro_batch` sequences each, the same work per action whatever m (module
    doc); return, per table, this rank's (timeline, step_time, work) per step after the warm-up
    (`CpuTimed`)."""
    torch.set_num_threads(1)  # one core per stage (module doc)
    pp, rank = dist.get_world_size(), dist.get_rank()
    stage = stages.Stage(model(hidden, layers, vocab), rank, pp)
    results = []
    for table in tables:
        m = len(table[0]) // 2
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(vocab, (sequences if micro_batch is None else m * micro_batch, length),
                               generator=generator)
        batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}
        micro_batches = [{key: value.chunk(m)[i] for key, value in batch.items()} for i in range(m)]
        sequences_in_step = tokens.shape[0]
        run = CpuTimed(stage)
        measured = []
        for step in range(1 + steps):
            dist.barrier()  # the ranks start the step together: their clocks share an origin
            run.step(table, micro_batches, sequences_in_step * (length - 1))
            stage.zero_grad(set_to_none=True)
            if step > 0:  # the first step of a table allocates what the next ones reuse
                measured.append((run.timeline, run.step_time, run.work()))
        results.append(measured)
    return results


def _parser():
    from minidist.runtime.errors import ArgumentParser

    p = ArgumentParser(prog="python -m minidist.bench bubble", description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2, help="stages, one CPU rank each (default 2)")
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batches per step")
    p.add_argument("--schedule", nargs="+", default=["gpipe", "1f1b"], help="schedules to run")
    p.add_argument("--steps", type=int, default=5, help="measured steps per case, after one warm-up")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64, help="1975 for the chess tokenizer's (module doc)")
    p.add_argument("--micro_batch", type=int, default=1, help="sequences per micro-batch, whatever m (module doc)")
    p.add_argument("--sequences", type=int, default=None,
                   help="a global batch of this many sequences cut into m micro-batches instead (module doc)")
    p.add_argument("--length", type=int, default=64, help="tokens per sequence")
    p.add_argument("--gantt", action="store_true", help="draw each case's last step as text, as it ran")
    return p


def main(argv=None) -> None:
    import os

    from minidist.runtime.errors import one_line_errors
    from minidist.runtime.launch import launch

    p = _parser()
    args = p.parse_args(argv)
    with one_line_errors(p.prog, ValueError):
        stages.balance(args.layers, args.pp)
        cases = [(name, m) for name in args.schedule for m in args.m]
        tables = [schedules.table(name, m, args.pp) for name, m in cases]
        if args.sequences is not None and any(args.sequences % m for m in args.m):
            raise ValueError(f"--sequences {args.sequences} must split into each --m's equal micro-batches")
    sizes = {name: getattr(args, name) for name in ("hidden", "layers", "vocab", "length", "steps")}
    sizes |= {"micro_batch": args.micro_batch} if args.sequences is None else {"sequences": args.sequences}
    # By its module's name, not __main__'s: each rank imports the function it runs.
    by_name = importlib.import_module("minidist.bench.bubble").measure
    by_rank = launch(by_name, args.pp, tables, timeout_s=600, **sizes)
    print(f"pp {args.pp}, " + ", ".join(f"{k} {v}" for k, v in sizes.items()) + f", 1 thread per rank, load average "
          f"{os.getloadavg()[0]:.1f}: idle fraction per stage, median of the steps (min-max); 'wall': as the "
          "ranks ran on this machine; 'a core each': their measured work replayed on a core per stage")
    print("schedule  m  step (s)  formula  clock        " + "  ".join(f"stage {r:<12}" for r in range(args.pp)))
    for n, (name, m) in enumerate(cases):
        steps_by_rank = [rank[n] for rank in by_rank]
        step = statistics.median(max(rank[n][k][1] for rank in by_rank) for k in range(args.steps))
        for clock, idle in (("wall", stage_idle(steps_by_rank)), ("a core each", replayed_idle(tables[n], steps_by_rank))):
            cells = [f"{statistics.median(s):.3f} ({min(s):.2f}-{max(s):.2f})" for s in idle]
            print(f"{name:<8} {m:>2}  {step:8.3f}  {expected(args.pp, m):.3f}    {clock:<11}  "
                  + "  ".join(f"{c:<18}" for c in cells))
        if args.gantt:
            last = [rank[n][-1] for rank in by_rank]
            print(gantt([timeline for timeline, *_ in last], max(step_time for _, step_time, _ in last)))


if __name__ == "__main__":
    main()
