"""Tensor and sequence parallelism in the memory estimate: what one rank of a cut layer holds.

Tensor parallelism (`parallel/tensor/`, Shoeybi et al. 2019) cuts every weight matrix of a Llama
over the t ranks of a group: attention by heads, the MLP through its inner width, the vocabulary
by rows (padded to a multiple of t, `vocab.padded_vocab_size`). What a rank holds is then the
model of a smaller config: t times fewer heads and key/value heads of the same width, an MLP
t times narrower, a vocabulary of V_padded / t tokens, and the same hidden size (`split_config`).
Its q, k, v, gate, up and head are column slices, its o and down row slices, its embedding a
block of rows, and its norms whole: exactly the parameters of one rank, so the estimator counts
that model (`estimator.rank_shape`) and every term follows from it:

- **model states**: the split matrices' weights, gradients and AdamW states are 1/t of the
  whole; the norms are whole on every rank. Data parallelism (DDP, FSDP) then works over the
  world_size / t ranks that hold the same slice (`data_parallel`);
- **activations**: traced on that smaller model (`trace.py`): each head, each MLP column and
  each vocabulary slice saves what it saves in the whole model, so most of what a block saves
  falls as 1/t. The blocks' inputs do not: f (`ops.copy_to_tp`) hands every rank the whole
  input, and the first linears (q, k, v; gate, up) save it. Nor do the norms outside the blocks,
  which every rank runs on the whole sequence: what they save (their input, the residual
  stream; x * rsqrt; rsqrt) is the same on every rank;
- **the logits**: b x s x V_padded / t, and the vocabulary-parallel loss saves its softmax the
  same size (`vocab.vocab_parallel_cross_entropy`), never the whole vocabulary's (`logits`).

**Sequence parallelism** (Korthikanti et al. 2022, section 4.2.2) runs the norms on a chunk of
s / t tokens, so what the norms save is cut by t too (`sequence_parallel`): the trace tells
which storages only the norms saved (`Trace.layer_norms`, `outside_norms`). The blocks' inputs
are all-gathered back to the whole sequence before the first linears, which save the gathered
tensor: the same bytes as without sequence parallelism. (Megatron-LM saves the chunk instead and
gathers it again in backward: one more all-gather per block, and those bytes / t too.) With
activation checkpointing each layer keeps its input, a chunk under sequence parallelism (an
estimate: no measurement of the loop's checkpointing under tensor parallelism stands beside it).

So, per token and layer in fp32 (h hidden, q and kv the query and key/value widths, n heads,
I the MLP's width; `llama_layer.py` derives each term): 2(8h + 4) in the norms, / t only under
sequence parallelism; 8h of the blocks' inputs, whole; (8q + 8kv + 4n + 16I) / t for the rest.
Korthikanti et al.'s GPT layer (fp16, dropout, the T x T scores kept) is sbh(10 + 24/t + 5as/ht)
under tensor parallelism and sbh(34/t + 5as/ht) with sequence parallelism too; tests/memory/
test_tensor_parallel_memory.py measures the Llama terms on 1, 2 and 4 ranks.
"""

import copy
from dataclasses import replace

import torch

from minidist.memory import trace
from minidist.parallel.tensor import llama
from minidist.parallel.tensor.vocab import padded_vocab_size


def split_config(config, tp: int):
    """The config of the model one of `tp` ranks holds: heads, key/value heads, the MLP's width and
    the (padded) vocabulary divided by tp, each head as wide as in the whole model. Refuses, in one sentence,
    a model `parallel/tensor/llama.py` cannot cut over tp ranks."""
    with torch.device("meta"):
        llama.check_splittable(trace.model_class(config).from_config(copy.deepcopy(config)), tp)
    config = copy.deepcopy(config)
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        setattr(config, name, getattr(config, name) // tp)
    padded = padded_vocab_size(config.vocab_size, tp)
    config.vocab_padding = padded - config.vocab_size  # rows no token looks up, on the last rank (`logits`)
    config.vocab_size = padded // tp
    config.pad_token_id = None  # it may lie past this slice, and it changes nothing that is saved or held
    return config


def data_parallel(setup):
    """The setup over the ranks that hold the same slice: world_size / tp of them, checked."""
    tp = setup.options.tp_size
    if setup.world_size % tp:
        raise ValueError(f"--tp_size {tp} must divide the {setup.world_size} ranks into equal groups")
    if setup.lora_rank:
        raise ValueError("LoRA with --tp_size has not been built: use one or the other")
    return replace(setup, world_size=setup.world_size // tp)


def sequence_parallel(terms: dict, tp: int) -> dict:
    """The traced terms with what the norms saved cut by tp: each rank runs them on s / tp tokens."""
    layers = [saved - norms + norms // tp for saved, norms in zip(terms["layers"], terms["layer_norms"])]
    outside = terms["outside"] - terms["outside_norms"] + terms["outside_norms"] // tp
    return {**terms, "layers": layers, "outside": outside}


def logits(targets: int, shape) -> int:
    """The estimate's logits term for one rank's slice of the vocabulary (`shape.vocab_size` tokens):
    what is alive beside the saved softmax at the loss's worst moment. As with the whole
    vocabulary (`moments.py`), two fp32 tensors of targets x V/t: the logits as the head made them,
    which the loop holds while the loss runs, and the loss's input (`step.token_loss_sum`'s shifted
    copy); the vocabulary-parallel loss computes its exponentials and softmax in place, into the one
    it saves. The rank whose slice holds the vocabulary's padding also copies its logits to mask the
    padding out of the softmax: one more. The estimate is that rank's, the worst."""
    return 4 * targets * shape.vocab_size * (3 if getattr(shape.config, "vocab_padding", 0) else 2)
