"""Worker functions for tests/parallel/test_pipeline.py, run in each rank by `launch`.

Each rank is one stage of the pipeline. It also trains the single-process reference itself: the
same Llama, whole, on the same global batch, in this process without any group, and compares its
own stage's weights with the reference's. A "sabotage" breaks one thing the executor does (a
send, or the loss's scale), to show that the parity the test asserts depends on it."""


import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.batches import collate
from minidist.parallel import comm
from minidist.parallel.pipeline import executor, p2p, schedules, stages

HIDDEN, SEQUENCES, LENGTH, STEPS, LR = 64, 8, 16, 2, 1e-2


def tiny_llama(num_layers=4):
    from transformers import LlamaForCausalLM

    from minidist.hf import models

    config = models.tiny_llama_config(hidden_size=HIDDEN, num_layers=num_layers, num_heads=4)
    config.attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()  # float64: parity is the algorithm's, not rounding's


def global_batch(vocab_size, step):
    """Eight sequences of different lengths, right-padded to 16: a new batch each step."""
    generator = torch.Generator().manual_seed(step)
    lengths = torch.randint(5, LENGTH + 1, (SEQUENCES,), generator=generator).tolist()
    lengths[0] = LENGTH
    return collate([torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths], 0)


def split(batch, m):
    """The global batch cut into m micro-batches of rows, as the loop's accumulation does."""
    return [{key: value.chunk(m)[i] for key, value in batch.items()} for i in range(m)]


def targets(batch):
    return int((batch["labels"][:, 1:] != -100).sum())


_REFERENCE = {}


def reference():
    """The whole model trained in one process: losses per step and the final weights (computed once)."""
    if not _REFERENCE:
        model = tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            b = global_batch(model.config.vocab_size, step)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(), ignore_index=-100,
                                   reduction="sum")
            (loss / targets(b)).backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        _REFERENCE.update(losses=losses, weights={n: p.detach().clone() for n, p in model.named_parameters()})
    return _REFERENCE


class ScaledPerMicroBatch(executor.Executor):
    """Sabotage: each micro-batch's loss divided by its own target count, not the global batch's."""

    def forward(self, i, batch, num_targets):
        super().forward(i, batch, targets(batch) * self.m)


def sabotaged_send(direction, real):
    """Sabotage: the sends of one direction carry zeros (the shapes stay right, so nothing hangs)."""

    def send(tensor, dst, group=None):
        rank = dist.get_rank(group)
        wrong = (dst == rank + 1) if direction == "activations" else (dst == rank - 1)
        return real(torch.zeros_like(tensor) if wrong else tensor, dst, group)
    return send


def run(schedule, m, sabotage=None):
    pp, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_llama()
    stage = stages.Stage(model, rank, pp)
    mine = stage.names(model)
    del model  # this rank keeps its stage only
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    run_step = (ScaledPerMicroBatch if sabotage == "scale" else executor.Executor)(stage)
    run_step.m = m
    real_send = p2p.send
    if sabotage in ("activations", "gradients"):
        p2p.send = sabotaged_send(sabotage, real_send)
    losses, sent = [], []
    try:
        comm.counter.take()
        for step in range(STEPS):
            b = global_batch(stage.config.vocab_size, step)
            loss = run_step.step(schedules.table(schedule, m, pp), split(b, m), targets(b))
            losses.append(None if loss is None else loss.item())
            sent.append(comm.counter.take())
            optimizer.step()
            optimizer.zero_grad()
    finally:
        p2p.send = real_send
    weights = reference()["weights"]
    worst = {n: ((p.detach() - weights[n]).abs().max() / weights[n].abs().max()).item() for n, p in mine.items()}
    return {"losses": losses, "reference": reference()["losses"], "worst": worst, "sent": sent,
            "peak_held": run_step.peak_held, "model": sorted(weights)}


def cases(specs):
    """Every case of this launch, in order; a case's result on this rank."""
    return [run(**spec) for spec in specs]
