"""PyTorch's own tensor parallelism on the same Hugging Face Llama: the reference beside `llama.py`.

PyTorch cuts a model with `parallelize_module(module, mesh, plan)`, where the plan maps each
submodule's name to a *parallel style*. A style turns the module's parameters into DTensors (this
rank's shard plus its placement on the mesh: `Shard(dim)` or `Replicate()`) and hooks its
inputs and outputs: an input arrives in one placement and the module wants another, and DTensor
runs the collective that turns one into the other, forward and backward. The hand-written
version places each collective itself (`ops.py`); here the placements say where the data is and
DTensor derives the collectives. Each piece of the plan, and the hand-written piece it stands for:

| PyTorch (this module)                                   | by hand                                   |
|---------------------------------------------------------|-------------------------------------------|
| `ColwiseParallel` on q, k, v, gate, up                  | `linear.ColumnParallelLinear`             |
| `RowwiseParallel` on o, down                            | `linear.RowParallelLinear` (g, or SP's reduce-scatter) |
| `PrepareModuleInput` on attention and the MLP           | `llama.EnterBlock` (f, or SP's all-gather) |
| `SequenceParallel` on the norms                         | `llama.SequenceParallelRMSNorm`           |
| `PrepareModuleInput` on the first layer, under SP       | `EnterBlock` with `ops.split_sequence`    |
| `RowwiseParallel(input_layouts=Replicate())`, embedding | `vocab.VocabParallelEmbedding`            |
| `ColwiseParallel(output_layouts=Shard(-1))`, head       | `vocab.VocabParallelHead`                 |
| `loss_parallel()` and `F.cross_entropy`                 | `vocab.vocab_parallel_cross_entropy`      |

The plan follows torchtitan's for its own Llama, with three differences that Hugging Face's
model asks for:

- **The embedding's output is whole**, under sequence parallelism too. torchtitan's embedding
  outputs `Shard(1)`, this rank's chunk of the sequence; Hugging Face's `LlamaModel` derives the
  rotary positions and the causal mask from the length of the embedding's output, so it would
  build them for the chunk, and the first attention fails ("The size of tensor a (16) must match
  the size of tensor b (8)": the gathered queries against the chunk's rotary angles). The first
  layer's input is split instead, as `llama.py` does.
- **A block's entry hands its DTensor on** (`use_local_output=False`): q, k and v then take the
  same DTensor, their input gradients are added up as partial sums, and one collective finishes
  them, Megatron's f. Handing a plain tensor on would give each of q, k, v (and gate, up) its
  own: counted with DTensor's `CommDebugMode` on a 2-layer model over 2 ranks without sequence
  parallelism, backward ran 11 all-reduces that way instead of 5
  (tests/parallel/test_tensor_reference.py counts them).
- **Attention runs on plain tensors**: q, k and v return this rank's heads as local tensors
  (`use_local_output=True`, the default), and Hugging Face's attention, which reshapes with -1
  heads, runs on them unchanged, as with the hand-written linears.

What torch 2.13 does here, on CPU ranks with gloo (all of it runs there; nothing needs a GPU):

- **The vocabulary need not divide.** DTensor shards unevenly, as `torch.chunk` does: 1,975 tokens
  over 2 ranks are 988 and 987 rows, over 4 three of 494 and one of 493. `ColwiseParallel`,
  `RowwiseParallel` and `loss_parallel` handle the uneven shards, and the loss matches one
  process in float64; nothing is padded, where the hand-written vocabulary pads (`vocab.py`).
- **Backward must run inside `loss_parallel()` too.** Outside it, DTensor has no rule for the
  loss's backward on the sharded logits and raises "aten.nll_loss_backward.default got mixed
  torch.Tensor and DTensor". So the loop holds the context over forward and backward.
- **The embedding's gradient is whole on every rank.** DTensor computes it replicated, the full
  vocabulary x hidden (1,975 x 128 on each of 2 ranks here), and keeps it as the gradient of the
  sharded weight until the optimizer steps; the hand-written embedding's gradient is its own rows.
  At CodeLlama-7b's 32,016 x 4,096 in fp32 that is 0.52 GB per rank (arithmetic, not measured).
- **The norms' gradients stay partial sums under sequence parallelism**: each rank's is its
  chunk's share, and the all-reduce that completes them runs in the optimizer's step, each time
  AdamW reads the gradient, not once in backward as the hand-written f does: 3 all-reduces per
  norm weight and step on CPU (AdamW's single-tensor path), 15 for the 2-layer test model's 5
  norms (counted with `CommDebugMode`). They are h numbers each, so it costs little. Without
  sequence parallelism the norms are untouched plain tensors, the same on every rank.
- Tied embeddings come out of `parallelize_module` as two parameters (each style makes its own
  DTensor); they are tied again after, both sharded by vocabulary rows.

Only tensor parallelism is here. torchtitan composes it with data parallelism by calling
`fully_shard` on the data dimension of a 2-D mesh afterwards, on the DTensor parameters, and so
does the loop (`--impl torch --strategy fsdp --tp_size T`: `strategy.TorchFSDP`). With a pipeline
too (`--pp_size P`, lesson 12), torchtitan cuts the model into stages first and parallelizes each
stage alone, on the tensor dimension of the 3-D (pp, dp, tp) mesh: `parallelize_llama_torch` takes a
stage (`pipeline/stages.Stage`) as it takes the whole model, and `fully_shard` follows on the stage.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel

from minidist.parallel.tensor.llama import check_splittable

SEQUENCE = Shard(1)  # (batch, sequence, hidden): the residual stream's placement under sequence parallelism


def _between_blocks(sequence_parallel: bool):
    """Where the residual stream lives: whole on every rank, or this rank's chunk of the sequence."""
    return SEQUENCE if sequence_parallel else Replicate()


def block_entry(sequence_parallel: bool, keyword: str | None = None) -> PrepareModuleInput:
    """PyTorch's f (`llama.EnterBlock`): the block's input made whole, an all-gather under sequence
    parallelism; handed on as a DTensor, so backward sums the branches' gradients before the one
    all-reduce (reduce-scatter) that makes it whole again."""
    if keyword:  # attention's input comes by keyword (`hidden_states=`), the MLP's by position
        return PrepareModuleInput(input_kwarg_layouts={keyword: _between_blocks(sequence_parallel)},
                                  desired_input_kwarg_layouts={keyword: Replicate()})
    return PrepareModuleInput(input_layouts=(_between_blocks(sequence_parallel),), desired_input_layouts=(Replicate(),))


def column() -> ColwiseParallel:
    """`linear.ColumnParallelLinear`: the weight's rows sharded (`Shard(0)`), this rank's output
    features returned as a plain tensor."""
    return ColwiseParallel()


def row(sequence_parallel: bool) -> RowwiseParallel:
    """`linear.RowParallelLinear`: the weight's columns sharded (`Shard(1)`), the partial sums
    all-reduced (g) or, under sequence parallelism, reduce-scattered along the sequence."""
    return RowwiseParallel(output_layouts=_between_blocks(sequence_parallel))


def sequence_norm() -> SequenceParallel:
    """`llama.SequenceParallelRMSNorm`: the norm on this rank's chunk, its weight a replicated
    DTensor whose gradient stays a partial sum until the optimizer reads it."""
    return SequenceParallel(use_local_output=True)


def split_first_layer() -> PrepareModuleInput:
    """`EnterBlock` with `ops.split_sequence`: the whole embedding cut to this rank's chunk (no
    communication forward; an all-gather of the gradient backward)."""
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(SEQUENCE,), use_local_output=True)


def embedding() -> RowwiseParallel:
    """`vocab.VocabParallelEmbedding`: rows of the vocabulary sharded, each rank looks up its own
    tokens (zeros for the others') and an all-reduce adds them up, whole on every rank."""
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def head(sequence_parallel: bool) -> ColwiseParallel:
    """`vocab.VocabParallelHead` (with the entry's f or all-gather): the logits sharded by
    vocabulary (`Shard(-1)`), returned as a DTensor for `loss_parallel`."""
    return ColwiseParallel(input_layouts=_between_blocks(sequence_parallel), output_layouts=Shard(-1),
                           use_local_output=False)


def layer_plan(sequence_parallel: bool) -> dict:
    """The plan of one decoder layer, by submodule name."""
    plan = {"self_attn": block_entry(sequence_parallel, "hidden_states"),
            "self_attn.q_proj": column(), "self_attn.k_proj": column(), "self_attn.v_proj": column(),
            "self_attn.o_proj": row(sequence_parallel),
            "mlp": block_entry(sequence_parallel),
            "mlp.gate_proj": column(), "mlp.up_proj": column(), "mlp.down_proj": row(sequence_parallel)}
    if sequence_parallel:
        plan.update({"input_layernorm": sequence_norm(), "post_attention_layernorm": sequence_norm()})
    return plan


def uneven_rows(vocab_size: int, tp: int) -> list[int]:
    """The rows of the vocabulary on each rank, as DTensor's `Shard(0)` cuts them (like `torch.chunk`)."""
    per_rank = -(-vocab_size // tp)
    return [max(0, min(per_rank, vocab_size - rank * per_rank)) for rank in range(tp)]


def parallelize_llama_torch(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> list[str]:
    """Cut `model` (a Llama for causal LM, the same weights on every rank) over the 1-D `tp_mesh`
    with PyTorch's parallel styles, in place. Returns what a learner should be told (how the
    vocabulary was cut), as `llama.parallelize_llama` does.

    `model` may also be a pipeline stage of one (`pipeline/stages.Stage`, `--pp_size`): torchtitan
    cuts the model by depth first, then each stage over its tensor-parallel ranks, so that no rank
    cuts (or sends slices of) layers it does not keep. A stage is cut by the same plan: its layers,
    and the embedding (first stage) or the head (last stage) where it holds them; what crosses to
    the next stage is then the plain residual stream, whole on every tensor-parallel rank."""
    tp = tp_mesh.size()
    layers = model.model.layers
    if isinstance(layers, nn.ModuleDict):  # a stage: its layers keyed by their index in the whole model,
        layers = layers.values()  # which `strategy.check_model` checked before the cut
    else:
        check_splittable(model, tp)
    for layer in layers:
        parallelize_module(layer, tp_mesh, layer_plan(sequence_parallel))
    top = {name: style for name, style in (("model.embed_tokens", embedding()), ("lm_head", head(sequence_parallel)))
           if _holds(model, name)}
    if sequence_parallel:
        top.update({"model.layers.0": split_first_layer(), "model.norm": sequence_norm()})
    if top:  # a middle stage holds layers only
        parallelize_module(model, tp_mesh, top)
    if model.config.tie_word_embeddings:  # each style made a DTensor of its own: one matrix again
        model.lm_head.weight = model.model.embed_tokens.weight
    rows = uneven_rows(model.config.vocab_size, tp)
    if len(set(rows)) == 1 or not top:  # evenly, or no vocabulary here to cut
        return []
    cut = ", ".join(map(str, rows))
    said = f"vocabulary of {model.config.vocab_size:,} tokens cut unevenly, {cut} rows on the {tp} ranks"
    return [said + " (DTensor's uneven Shard: nothing padded)"]


def _holds(model: nn.Module, name: str) -> bool:
    """Whether `model` has the submodule `name` (a pipeline stage holds the embedding or the head, or neither)."""
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def loss_parallel():
    """PyTorch's vocabulary-parallel loss (`vocab.vocab_parallel_cross_entropy`): inside this
    context, `F.cross_entropy` on logits sharded by vocabulary all-reduces the largest logit and
    the sums instead of gathering the logits. Hold it over forward and backward both."""
    return _loss_parallel()


def token_loss_sum(logits, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy (as `step.token_loss_sum`) of DTensor logits sharded by
    vocabulary, inside `loss_parallel()`; a plain tensor, the same on every rank."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the softmax in at least fp32
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")
    return loss.to_local()
