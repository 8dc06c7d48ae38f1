"""A Hugging Face Llama split over the tensor-parallel ranks, in place.

Each decoder layer has two blocks, attention and the MLP, and each becomes a column-parallel
entry and a row-parallel exit (Megatron-LM, section 3, figure 3):

- **Attention** is split by heads. q, k and v are column-parallel: rank r computes its own
  heads, and attention runs head by head, so nothing is sent until o, row-parallel, sums the
  heads' contributions. With grouped-query attention several query heads share one key/value
  head: cutting both in the same order keeps each query head with its key/value head on the
  same rank, so the tp size must divide the key/value heads too, as Megatron-LM requires
  (`num_query_groups_per_partition = divide(num_query_groups, world_size)` in its attention);
  a size that does not is refused in one line.
- **The MLP** is split through its inner width: gate and up column-parallel, the activation
  element by element, down row-parallel.
- **The vocabulary** is split in the embedding, the head and the loss (`vocab.py`).

The block's entry operator (f, or an all-gather under sequence parallelism) is a forward
pre-hook on the block (`EnterBlock`), not a part of each linear: attention's input feeds three
linears (q, k, v), and their gradients, summed first, need one all-reduce instead of three. Hugging Face's attention reshapes with -1 heads,
so with its q, k, v and o replaced it runs on this rank's heads unchanged. Parameter names stay
Hugging Face's, so a full checkpoint's names still say where each slice comes from.

**Sequence parallelism** (Korthikanti et al. 2022) keeps the residual stream between blocks cut
along the sequence: the norms run on a chunk, the blocks' entries all-gather and their exits
reduce-scatter (`ops.py`). The model's embedding stays whole, because Hugging Face's model
derives the rotary positions and the causal mask from its length; the first layer's input is
split (`ops.split_sequence`), and the head's entry gathers the last norm's output back. The
norms' weights are the same on every rank but each rank's chunk gives only its share of their
gradient, so they pass through f (`SequenceParallelRMSNorm`). Llama has no dropout; where a
model has it between blocks, it would run on the chunk too.
"""

import torch
import torch.distributed as dist
from torch import nn

from minidist.parallel.tensor import ops
from minidist.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from minidist.parallel.tensor.vocab import VocabParallelEmbedding, VocabParallelHead, padded_vocab_size

SPLIT = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)  # what holds slices

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class EnterBlock:
    """A forward pre-hook: a block's input through f (identity forward, all-reduce backward), or
    under sequence parallelism through an all-gather of the sequence (reduce-scatter backward);
    with `split`, into the sequence-parallel region (`ops.split_sequence`). The input is the first
    positional argument, or `hidden_states` (HF passes attention's so).

    In eval mode sequence parallelism steps aside: generation feeds one token at a time, which
    cannot be cut along the sequence. Nothing is split, the blocks' exits all-reduce instead of
    reduce-scattering (`RowParallelLinear`), and the values are the same."""

    def __init__(self, group, sequence_parallel: bool, split: bool = False):
        self.group, self.sequence_parallel, self.split = group, sequence_parallel, split

    def op(self, training: bool):
        if self.split:
            return ops.split_sequence if training else None
        return ops.gather_sequence if self.sequence_parallel and training else ops.copy_to_tp

    def __call__(self, module, args, kwargs):
        op = self.op(module.training)
        if op is None:
            return args, kwargs
        if args:
            return (op(args[0], self.group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": op(kwargs["hidden_states"], self.group)}


class SequenceParallelRMSNorm(nn.Module):
    """Llama's RMSNorm (transformers' `LlamaRMSNorm`, the same arithmetic) on this rank's chunk of
    the sequence, its weight passed through f: every rank holds the same weight, and the
    gradient of each is the sum of every chunk's share."""

    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.group, self.weight, self.variance_epsilon = group, norm.weight, norm.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return ops.copy_to_tp(self.weight, self.group) * hidden_states.to(input_dtype)


def check_splittable(model: nn.Module, tp_size: int) -> None:
    """Raise ValueError, in one sentence, if `model` cannot be cut over `tp_size` ranks."""
    config = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(isinstance(getattr(getattr(layer, block, None), name, None), nn.Linear)
                                 for layer in layers for block, names in (("self_attn", ATTENTION), ("mlp", MLP))
                                 for name in names):
        raise ValueError(f"tensor parallelism splits Llama-style decoder layers (self_attn.q_proj/k_proj/v_proj/"
                         f"o_proj, mlp.gate_proj/up_proj/down_proj), which {type(model).__name__} does not have")
    for what, count in (("attention heads", config.num_attention_heads),
                        ("key/value heads", config.num_key_value_heads),
                        ("MLP's inner features", config.intermediate_size)):
        if count % tp_size:
            raise ValueError(f"--tp_size {tp_size} does not divide the model's {count} {what}: "
                             f"each rank must get an equal share")


def parallelize_llama(model: nn.Module, group, sequence_parallel: bool = False) -> list[str]:
    """Cut `model` (a Llama for causal LM, the same weights on every rank) over `group`, in place.
    Returns what was done that a learner should be told (the vocabulary's padding)."""
    tp = dist.get_world_size(group)
    check_splittable(model, tp)
    enter = EnterBlock(group, sequence_parallel)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group))
        attention.o_proj = RowParallelLinear(attention.o_proj, group, sequence_parallel)
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group, sequence_parallel)
        attention.register_forward_pre_hook(enter, with_kwargs=True)
        mlp.register_forward_pre_hook(enter, with_kwargs=True)
        if sequence_parallel:
            layer.input_layernorm = SequenceParallelRMSNorm(layer.input_layernorm, group)
            layer.post_attention_layernorm = SequenceParallelRMSNorm(layer.post_attention_layernorm, group)
    tied = model.config.tie_word_embeddings
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, group)
    model.lm_head = VocabParallelHead(model.lm_head, group)
    if tied:  # one matrix, cut the same way in both places
        model.lm_head.weight = model.model.embed_tokens.weight
    model.lm_head.register_forward_pre_hook(enter, with_kwargs=True)
    if sequence_parallel:
        model.model.layers[0].register_forward_pre_hook(EnterBlock(group, True, split=True), with_kwargs=True)
        model.model.norm = SequenceParallelRMSNorm(model.model.norm, group)
    model.train(model.training)  # the new modules start in training mode: give them the model's (from_pretrained: eval)
    vocab, padded = model.config.vocab_size, padded_vocab_size(model.config.vocab_size, tp)
    if padded == vocab:
        return []
    return [f"vocabulary padded from {vocab:,} to {padded:,} tokens, so that {tp} ranks get equal slices"]


def split_parameters(model: nn.Module) -> dict[str, tuple[int, int | None]]:
    """Every parameter of a cut model that holds a slice: its name, the dimension it is cut along,
    and the real size of that dimension when the last slices are padding (the vocabulary), else
    None. The others (the norms; a row-parallel bias) are the same on every rank."""
    cut = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, SPLIT):
            continue
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, (VocabParallelEmbedding, VocabParallelHead)):
            real = module.num_embeddings if isinstance(module, VocabParallelEmbedding) else module.vocab_size
            cut[prefix + "weight"] = (0, real)
        elif isinstance(module, ColumnParallelLinear):
            cut.update({prefix + name: (0, None) for name, p in module.named_parameters() if p is not None})
        else:
            cut[prefix + "weight"] = (1, None)  # a row-parallel bias is added after the sum: whole
    return cut
