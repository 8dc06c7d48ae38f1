"""Worker functions for tests/parallel/test_pipeline_reference.py, run in each rank by `launch`.

Each rank is one stage of PyTorch's pipeline (`reference.TorchExecutor`) around the same
`stages.Stage` the hand-written executor runs, on the tiny float64 Llama and global batches of
`pipeline_workers`, and compares its stage's weights with the single-process reference (trained
once by the test, and handed to every rank). One launch of 4 ranks runs the pipelines of 4 stages
on the world and those of 2 stages on two groups at once, ranks 0-1 and 2-3: starting ranks costs
more than a case, and the groups are what a pipeline beside data parallelism runs on."""

from contextlib import contextmanager

import pipeline_workers
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from pipeline_workers import LR, STEPS, global_batch, split, targets, tiny_llama
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from minidist.batches import collate
from minidist.parallel import comm
from minidist.parallel.pipeline import executor, reference, schedules, stages


class DefaultScale(reference.TorchExecutor):
    """Sabotage: PyTorch's default, which divides the gradients by m once more after the step."""

    scale_grads = True


@contextmanager
def sends():
    """The bytes of each message this rank sends while inside: PyTorch's pipeline sends with
    `torch.distributed.isend` (`batch_isend_irecv` and the blocking `send` call it too), which is
    wrapped here for the time being; `comm.counter` sees none of it."""
    real, tally = c10d.isend, []

    def isend(tensor, *args, **kwargs):
        tally.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    c10d.isend = dist.isend = isend  # the module's own name too: batch_isend_irecv checks ops against it
    try:
        yield tally
    finally:
        c10d.isend = dist.isend = real


def my_stage(group):
    """This rank's stage of the tiny Llama in `group`'s pipeline, its parameters by their names in the
    whole model, and an AdamW."""
    model = tiny_llama()
    stage = stages.Stage(model, dist.get_rank(group), dist.get_world_size(group))
    return stage, stage.names(model), torch.optim.AdamW(stage.parameters(), lr=LR)


def parity(group, ref, schedule, m, sabotage=False):
    """STEPS steps of PyTorch's pipeline on pipeline_workers' global batches: losses, each weight's
    distance from the one-process reference `ref`, what was sent (message by message) and counted."""
    stage, mine, optimizer = my_stage(group)
    run = (DefaultScale if sabotage else reference.TorchExecutor)(stage, schedule, m, group=group)
    losses, sent, counted = [], [], []
    comm.counter.take()
    for step in range(STEPS):
        b = global_batch(stage.config.vocab_size, step)
        with sends() as tally:
            loss = run.step(split(b, m), targets(b))
        losses.append(None if loss is None else loss.item())
        sent.append(tally)
        counted.append(comm.counter.take())
        optimizer.step()
        optimizer.zero_grad()
    worst = {n: relative(p, ref["weights"][n]) for n, p in mine.items()}
    return {"losses": losses, "worst": worst, "sent": sent, "counted": counted,
            "schedule": run.schedule_class.__name__}


def loop_batches(vocab_size, step, m):
    """Micro-batches as the loop makes them: each collated to its own longest sequence (widths differ
    within a step, and the step's longest differs between steps), and the global batch's targets."""
    generator = torch.Generator().manual_seed(100 + step)
    longest = pipeline_workers.LENGTH - 4 * step
    sequences = [torch.randint(4, vocab_size, (int(n),), generator=generator).tolist()
                 for n in torch.randint(3, longest + 1, (pipeline_workers.SEQUENCES,), generator=generator)]
    rows = len(sequences) // m
    micro_batches = [collate(sequences[i * rows:(i + 1) * rows], 0) for i in range(m)]
    return micro_batches, sum(len(s) - 1 for s in sequences)


def against_executor(group, ref, schedule, m, dp_size):
    """The hand-written executor and PyTorch's, each on its own copy of this rank's stage, with the
    same `dp_size` (the loss's scale; no data-parallel reduction here), on the same loop-like
    micro-batches: their losses, and the largest difference of the first step's gradients and of
    the weights after STEPS steps."""
    runs = []
    for torch_s in (False, True):
        stage, mine, optimizer = my_stage(group)
        if torch_s:
            run = reference.TorchExecutor(stage, schedule, m, group, dp_size)
        else:
            run = executor.Executor(stage, group, dp_size)
        losses, widths, votes = [], [], []
        for step in range(STEPS):
            micro_batches, num_targets = loop_batches(stage.config.vocab_size, step, m)
            widths.append([batch["input_ids"].shape[1] for batch in micro_batches])
            with sends() as tally:
                if torch_s:
                    loss = run.step(micro_batches, num_targets)
                else:
                    loss = run.step(schedules.table(schedule, m, stage.pp), micro_batches, num_targets)
            losses.append(None if loss is None else loss.item())
            votes.append(tally.count(4))  # the stages' int32 vote: a new PyTorch stage was built for this step
            if step == 0:
                grads = {n: p.grad.clone() for n, p in mine.items()}
            optimizer.step()
            optimizer.zero_grad()
        runs.append((losses, grads, mine))  # widths and votes: the last run's, PyTorch's
    (hand_losses, hand_grads, hand), (torch_losses, torch_grads, torch_weights) = runs
    return {"hand": hand_losses, "torch": torch_losses, "widths": widths, "votes": votes,
            "grads": max(relative(torch_grads[n], g) for n, g in hand_grads.items()),
            "weights": max(relative(p, hand[n]) for n, p in torch_weights.items())}


def relative(tensor, expected):
    """The largest difference, relative to the largest entry of `expected`."""
    return ((tensor.detach() - expected.detach()).abs().max() / expected.detach().abs().max()).item()


def wrong_rank(group, ref):
    """What TorchExecutor says to a stage that is not this rank's place in the pipeline."""
    model = tiny_llama(num_layers=2)
    pp = dist.get_world_size(group)
    stage = stages.Stage(model, (dist.get_rank(group) + 1) % pp, pp)
    try:
        reference.TorchExecutor(stage, "gpipe", 2, group)
    except ValueError as refused:
        return str(refused)
    return None


def torch_1f1b_refusal(group, ref):
    """What PyTorch's `Schedule1F1B` says to fewer micro-batches than stages (m = p - 1)."""
    stage, _, _ = my_stage(group)
    hidden = torch.empty(1, 16, stage.config.hidden_size, dtype=torch.float64, device="meta", requires_grad=True)
    pipeline_stage = PipelineStage(stage, stage.rank, stage.pp, torch.device("cpu"),
                                   input_args=hidden, output_args=hidden, group=group)
    try:
        Schedule1F1B(pipeline_stage, stage.pp - 1, loss_fn=lambda output, target: output)
    except ValueError as refused:
        return str(refused)
    return None


def cases(specs, ref):
    """Every case of this launch, in order: (worker name, pp, its keyword arguments) -> its result on
    this rank. pp 2 runs on this rank's pair (ranks 0-1 or 2-3), pp 4 on the world; `ref`: the
    one-process reference (`pipeline_workers.reference()`)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    pair = pairs[dist.get_rank() // 2]
    return [globals()[name](group=pair if pp == 2 else None, ref=ref, **kwargs) for name, pp, kwargs in specs]
