"""Exercise 12: 1F1B's list of actions for one rank (lesson 12, `lessons/12_pipeline_parallel.md`).

Fill in `one_f_one_b` below, then check it from the repository root:

    MINIDIST_EXERCISE=lessons/exercises/12_pipeline_parallel.py python -m pytest -q tests/course/test_exercises.py

Everything else is minidist's own. The check builds the whole table as `schedules.table` does, one
call of your function per rank, refuses it in one line if `executor.check` does (a table that would
deadlock, or would compute on the wrong micro-batch), and then RUNS it: 4 gloo ranks, a 4-layer
Llama cut into 4 stages of one layer each (`minidist/parallel/pipeline/stages.py`), float64, the
`Executor` running your lists, 2 AdamW steps of 2 and of 8 micro-batches, against the whole model
trained in one process on the same batches. It compares the losses, every weight, and how many
micro-batches' activations each stage held at once (`Executor.peak_held`). minidist's own answer is
`one_f_one_b` in `minidist/parallel/pipeline/schedules.py`: read it after.
"""

EXERCISE = "12_pipeline_parallel"  # tells the check which exercise this file answers


def one_f_one_b(m: int, pp: int, rank: int) -> list[tuple[str, int]]:
    """The order in which stage `rank` of `pp` runs the forward ("F", i) and the backward ("B", i) of
    each of the step's `m` micro-batches, i = 0 .. m-1, under 1F1B (one forward, one backward).

    What a list means (`schedules.py`): ("F", i) receives micro-batch i's activations from stage
    rank - 1 (the first stage embeds its tokens), runs the stage and sends the output to stage
    rank + 1; ("B", i) receives the gradient of that output from stage rank + 1 (the last stage
    starts from its loss) and sends its input's gradient to stage rank - 1. A receive waits, so
    the lists of neighbouring ranks must fit together. GPipe is every forward, then every backward:
    `[("F", i) for i in range(m)] + [("B", i) for i in range(m)]`.

    1F1B has three phases:

    - **warm-up**: the forwards that fill the pipeline before this stage's first backward can come
      back. The last stage needs none (its first forward ends in the loss, and its backward can
      follow at once); each stage before it needs one more. How many for stage `rank`? Never more
      than m: with fewer micro-batches than stages, the first stages run every forward first.
    - **steady state**: one forward, then one backward, in turn, while forwards are left. The
      backward is always of the oldest micro-batch still held: backwards go in micro-batch order,
      0 first, on every stage (a stage receives gradients in the order the next stage sent them).
    - **cool-down**: the backwards left, in micro-batch order.

    Each forward holds a micro-batch's activations until its backward frees them. A right 1F1B holds
    at most p - rank micro-batches on stage `rank` (min(m, p - rank)); GPipe holds all m.

    The usual mistakes: GPipe's order (right gradients, m micro-batches held: the memory 1F1B exists
    to save); a warm-up of p - rank forwards (one too many: p - rank + 1 held); the cool-down's
    backwards newest first (refused: the stage before receives them out of order).
    """
    raise NotImplementedError("one_f_one_b is yours to write (its docstring says how)")
