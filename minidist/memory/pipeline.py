"""Pipeline parallelism in the memory estimate: what stage r of p holds (lesson 12).

A pipeline cuts the model by depth (`parallel/pipeline/stages.py`), so a stage holds the model
states of its own modules only: its decoder layers (`stages.balance`), the token embedding on the
first stage, the final norm and the head on the last. The estimate counts them on the meta device
as a Shape of its own (`stage_shape`), and the estimator's `model_states` gives their bytes: 4 + 4
+ 8 per parameter with fp32 AdamW, sharded as usual when data parallelism runs over each stage.

**Activations: how many micro-batches at once, times what one of them keeps.** A stage keeps the
graph of every micro-batch whose forward has run and whose backward has not. How many that is at
most is read off the schedule's own list (`held_micro_batches`): GPipe runs every forward first, so
m; 1F1B's stage r runs p - 1 - r warm-up forwards and then frees one micro-batch per forward, so
min(m, p - r). The first stage is the one 1F1B loads most, and it also holds the embedding.

What one micro-batch keeps on a stage is traced, not derived (`trace_stage`): the stage itself
(`stages.Stage`, the code the executor runs) is built on fake tensors and run on a micro-batch under
`trace.SavedByLayer`, as `trace.py` runs a whole model. That counts its layers' saved tensors, the
rotary cos and sin and the mask the stage computes for itself, the embedding's saved token ids on
the first stage, and the final norm's, the head's and the loss's (the fp32 log-probabilities of the
whole vocabulary) on the last. Besides what autograd saves, the executor holds two tensors per
micro-batch until its backward (`executor.Executor.forward`): the received input, a leaf of the
stage's graph (which `SavedByLayer` counts as a model state, being a leaf that needs a gradient),
and the stage's output, whose gradient will come back. Each is counted unless autograd saved the
same storage already (in fp32 the first layer's norm saves the input; in bf16 it saves an fp32
copy, and the input is held besides).

So the saved activations of stage r peak at held(r) x per_micro_batch(r): nothing is freed during a
forward and nothing is saved during a backward, so the most falls at the end of a forward. That is
what `HeldActivations` measures on a real run, and tests/memory/test_pipeline_memory.py holds the
two together on 2 and 4 CPU ranks, GPipe and 1F1B, m = 1, 2, 4.

`states_and_activations` adds the model states to the held activations: all alive at once in 1F1B's
steady state, where the gradients exist from the first backward on. Under GPipe the m micro-batches
are all held before the first backward makes any gradient, so the sum overstates by up to the
gradients. Not estimated: the step's transients (the last stage's logits beside their
log-probabilities, what backward makes on its way, AdamW's temporaries), which the whole step's
peak adds; tests/memory/test_pipeline_memory.py measures that peak (`measure.step_peak`) but holds
no estimate to it. Nor gradient checkpointing, which a stage does not do.

    python -m minidist.memory codellama/CodeLlama-7b-hf --pp_size 4 --pp_schedule 1f1b \\
        --gradient_accumulation_steps 8 --max_seq_length 4096
"""

import json
from dataclasses import replace

import torch

from minidist.memory import cache, estimator, measure, trace
from minidist.parallel.pipeline import executor, schedules, stages

GB = 1e9


def held_micro_batches(schedule: str, m: int, pp: int, rank: int) -> int:
    """The most micro-batches stage `rank` holds at once under `schedule`: played from its own list
    (a forward adds one, a backward frees one), not from a formula."""
    live = most = 0
    for kind, _ in schedules.table(schedule, m, pp)[rank]:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def stage_shape(shape: estimator.Shape, rank: int, pp: int) -> estimator.Shape:
    """What stage `rank` of `pp` holds, as a Shape of its own (built on the meta device), so that the
    estimator's `model_states` counts its parameters, gradients and AdamW states."""
    with torch.device("meta"):
        stage = stages.Stage(trace.build(shape.config), rank, pp)
    params = list(stage.parameters())
    counts = tuple(sum(p.numel() for p in layer.parameters()) for layer in stage.layers)
    num_params = sum(p.numel() for p in params)
    head = sum(p.numel() for p in stage.lm_head.parameters()) if stage.is_last else 0
    return replace(shape, num_params=num_params, param_rows=tuple((p.shape[0] if p.dim() else 1, p.numel())
                                                                  for p in params),
                   num_layers=len(counts), layer_params=max(counts), layer_param_counts=counts,
                   root_params=num_params - sum(counts), head_linear_params=head, tied_params=0,
                   largest_module_params=max(sum(p.numel() for p in m.parameters(recurse=False))
                                             for m in stage.modules()))


def trace_stage(config, rank: int, pp: int, batch: int, seq: int, mode: str = "fp32", padded: bool = True,
                packed: bool = False) -> dict:
    """What stage `rank` of `pp` keeps for one micro-batch of `batch` x `seq` tokens until its
    backward, traced on fake tensors (module doc): `saved` by autograd (its layers', each on its own
    in `layers`, what several of them share, and what is outside them), `weight_copies` (autocast's),
    and `held`, the received input and the output that the executor keeps besides. `packed`:
    `--pack`'s rows (`trace.packed_batch_for`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as fake, trace._as_the_real_run(padded or packed):
        model = trace.build(config, mode)
        stage = stages.Stage(model, rank, pp)
        data = (trace.packed_batch_for(batch, seq, config.vocab_size) if packed
                else trace.batch_for(batch, seq, padded, config.vocab_size))
        data = {k: fake.from_tensor(v) for k, v in data.items()}
        if not padded and not packed:  # as `trace.trace`: the real run reads the all-ones mask and drops it
            data["attention_mask"] = None
        dtype = next(stage.parameters()).dtype  # the executor receives in the stage's dtype
        received = None if stage.is_first else torch.empty(batch, seq, config.hidden_size, dtype=dtype,
                                                           requires_grad=True)
        with trace.SavedByLayer(stage) as seen, trace._Autocast(mode).autocast():
            output = stage(received, data)
        result = seen.result()
        held = sum(t.untyped_storage().nbytes() for t in (received, output)
                   if t is not None and t.untyped_storage()._cdata not in seen.storages)
    return {"layers": result.layers, "shared": result.shared, "outside": result.outside,
            "weight_copies": result.weight_copies, "held": held}


def per_micro_batch(shape: estimator.Shape, setup: estimator.Setup, rank: int, pp: int) -> dict:
    """`trace_stage` at the setup's micro-batch (`batch_size_per_device` rows), from traces at batch
    1 and 2 (every term is affine in the batch) kept on disk (`cache.py`); `total` is their sum."""
    mode, seq = estimator.compute_mode(setup), setup.max_seq_length
    config_json = shape.config.to_json_string(use_diff=False)

    def at(batch):
        key = {"config": config_json, "rank": rank, "pp": pp, "mode": mode, "seq": seq, "padded": setup.padded,
               "batch": batch, **({"packed": True} if setup.packed else {})}
        return cache.cached("pipeline_stage", key, lambda: trace_stage(
            type(shape.config).from_dict(json.loads(config_json)), rank, pp, batch, seq, mode, setup.padded,
            setup.packed))
    one, two, b = at(1), at(2), setup.batch_size_per_device
    terms = {name: one[name] + (b - 1) * (two[name] - one[name]) for name in ("shared", "outside", "weight_copies",
                                                                            "held")}
    terms["layers"] = [x1 + (b - 1) * (x2 - x1) for x1, x2 in zip(one["layers"], two["layers"])]
    return {**terms, "total": sum(terms["layers"]) + sum(v for k, v in terms.items() if k != "layers")}


def check(setup: estimator.Setup, pp: int, schedule: str, m: int) -> None:
    """Refuse, in one line, what this estimate does not cover."""
    schedules.table(schedule, m, pp)  # an unknown schedule or m < 1: its own one line
    if setup.options.gradient_checkpointing:
        raise ValueError("a pipeline stage does not checkpoint its layers yet: leave out --gradient_checkpointing")
    if setup.options.tp_size > 1 or setup.lora_rank:
        raise ValueError("the pipeline estimate is built for full fine-tuning without --tp_size: "
                         "leave out --tp_size and --lora_rank")


def data_parallel(setup: estimator.Setup, pp: int) -> estimator.Setup:
    """The command's setup (`--world_size` counts every rank) as each stage sees it: data parallelism
    over world_size / pp ranks. A world size of 1 means a pipeline alone, one rank per stage."""
    if setup.world_size != 1 and setup.world_size % pp:
        raise ValueError(f"--pp_size {pp} must divide the {setup.world_size} ranks into equal stages")
    return replace(setup, world_size=max(1, setup.world_size // pp))


def stage_estimate(shape: estimator.Shape, setup: estimator.Setup, rank: int, pp: int, schedule: str, m: int) -> dict:
    """Stage `rank` of `pp` under `schedule` with `m` micro-batches of the setup's size. The setup's
    world_size is the data parallelism over each stage (1: a pipeline alone)."""
    check(setup, pp, schedule, m)
    stages.balance(shape.num_layers, pp)  # more stages than layers: its own one line
    mine = stage_shape(shape, rank, pp)
    states = estimator.model_states(mine, setup)
    one = per_micro_batch(shape, setup, rank, pp)
    held = held_micro_batches(schedule, m, pp, rank)
    return {"rank": rank, "layers": list(stages.balance(shape.num_layers, pp)[rank]), "num_params": mine.num_params,
            **states,
            "per_micro_batch": one["total"], "held_micro_batches": held, "activations": held * one["total"],
            "states_and_activations": sum(states.values()) + held * one["total"]}


def estimate(shape: estimator.Shape, setup: estimator.Setup, pp: int, schedule: str, m: int) -> list[dict]:
    """`stage_estimate` of every stage, by rank."""
    return [stage_estimate(shape, setup, rank, pp, schedule, m) for rank in range(pp)]


def format_stages(shape: estimator.Shape, setup: estimator.Setup, pp: int, schedule: str, m: int) -> str:
    """The per-stage table `python -m minidist.memory ... --pp_size P` prints."""
    rows = estimate(shape, setup, pp, schedule, m)
    lines = [f"{shape.name}: {pp} pipeline stages, {schedule}, {m} micro-batches of {setup.batch_size_per_device} x "
             f"{setup.max_seq_length} tokens, {estimator.compute_mode(setup)} compute, AdamW fp32"
             + (f", {setup.strategy} over {setup.world_size} data-parallel ranks per stage" if setup.world_size > 1
                else ""),
             (f"{'stage':>5} {'layers':>8} {'params':>9} {'states GB':>10} {'1 micro-batch GB':>17} {'held':>5} "
              f"{'activations GB':>15} {'states+acts GB':>15}")]
    for row in rows:
        states = row["parameters"] + row["gradients"] + row["optimizer_states"]
        lines.append(f"{row['rank']:>5} {row['layers'][0]:>3}-{row['layers'][-1]:<4} "
                     f"{row['num_params'] / 1e9:>8.2f}B {states / GB:>10.1f} {row['per_micro_batch'] / GB:>17.2f} "
                     f"{row['held_micro_batches']:>5} {row['activations'] / GB:>15.1f} "
                     f"{row['states_and_activations'] / GB:>15.1f}")
    lines.append("(not counted: the step's transients, such as the last stage's logits beside their log-probabilities)")
    return "\n".join(lines)


class HeldActivations(executor.Executor):
    """The executor, measuring `peak_bytes` in each step: the most bytes of activations this stage
    held at once, each storage once: every tensor autograd saved for a backward still to run
    (`measure.SavedActivations`, which leaves parameters out), with the inputs and outputs the
    executor holds (`held`). Read at the end of every forward, where the most falls (module doc)."""

    def step(self, actions_by_rank, micro_batches, num_targets):
        self.peak_bytes, self.saved = 0, measure.SavedActivations()
        with self.saved:
            return super().step(actions_by_rank, micro_batches, num_targets)

    def forward(self, i, batch, num_targets):
        super().forward(i, batch, num_targets)
        live = dict(self.saved.live)  # storage -> [holders, bytes]
        for tensor in (t for pair in self.held.values() for t in pair if t is not None):
            live.setdefault(tensor.untyped_storage()._cdata, [1, tensor.untyped_storage().nbytes()])
        self.peak_bytes = max(self.peak_bytes, sum(nbytes for _, nbytes in live.values()))
