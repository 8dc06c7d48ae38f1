"""Bytes per step, by formula: what the tensor parallelism of `llama.py` sends, against FSDP.

**Tensor parallelism sends activations, not weights.** Each block of a decoder layer (attention,
the MLP) has one entry and one exit (`ops.py`). Without sequence parallelism the exit, g, is an
all-reduce of the block's output in forward, and the entry, f, an all-reduce of its input's
gradient in backward: four all-reduces of b x s x h numbers per layer and micro-batch, for b
sequences of s tokens and hidden size h. With sequence parallelism each all-reduce becomes an
all-gather and a reduce-scatter of the same b x s x h, the same bytes under the ring (an
all-reduce *is* a reduce-scatter then an all-gather): it saves memory, not traffic. The traffic
grows with the tokens, b x s, and not with the weights: FSDP's is the other way round, two
all-gathers and a reduce-scatter of the layer's P weights, whatever the batch.

`tensor_parallel_bytes` counts every collective the code really does in a training step (the
model in training mode), per micro-batch, under the ring model that `comm.py` counts (per rank,
for a tensor of S bytes over t ranks: all-reduce 2(t-1)/t x S, all-gather and reduce-scatter
(t-1)/t x S); `tests/parallel/test_tensor_bytes.py` checks it against `comm.counter` exactly.
Besides the layers:

- the vocabulary-parallel embedding sums its ranks' lookups (g: an all-reduce of b x s x h);
- the head's entry, f (all-gather forward and reduce-scatter backward under sequence parallelism);
- the vocabulary-parallel loss: an all-reduce (MAX) of each predicting token's largest logit and
  one (SUM) of its two sums, b(s-1) and 2b(s-1) numbers: three numbers per token, not its
  V/t logits (`vocab.py`);
- under sequence parallelism only: the first layer's split (an all-gather of the gradient in
  backward), and each norm's weight gradient summed through f (an all-reduce of h numbers, two
  norms per layer and the final one), as is a row-parallel linear's bias if the model has one.

**At 7B** (CodeLlama-7b: h 4096, 32 layers of P = 202,383,360 weights; b = 1, s = 4096, bf16
activations; computed by the functions below): on t = 4 ranks a layer sends 6 x b s h x 2 bytes =
201 MB per rank per step, 6.44 GB for the 32 layers, plus 0.10 GB for the embedding, head and loss
(sequence parallelism adds 0.03 GB: the split and the norms). FSDP on 4 ranks sends 3 x P x 3/4 x
4 bytes = 1.82 GB per layer in fp32 (1.21 GB with bf16 gathers): nine times more (six). At
s = 512 a TP layer sends 25 MB, 72 times less. Over groups of the same size the (t-1)/t factors
cancel: TP sends less than FSDP while b x s < 12P / 16h = 37,000 tokens (P / 2h with bf16 gathers).
Yet TP's bytes sit on the critical path: each exit's all-reduce waits for its block and the next
block waits for it, while FSDP gathers the next layer as this one computes. NVLink 3 gives an A100
300 GB/s per direction ("600 GB/s" counting both, NVIDIA A100 datasheet): a layer's 201 MB take
0.7 ms. InfiniBand HDR gives 200 Gb/s = 25 GB/s per port (NVIDIA ConnectX-6 datasheet): 8 ms,
about as long as the layer's compute, (6P + 12 h s) FLOPs per token x 4,096 tokens / 4 GPUs =
1.45e12 FLOPs, 4.6 ms at the A100's 312 TFLOP/s bf16 peak, 9.3 ms at half of it. So tensor
parallelism stays inside a node, on NVLink.

Every activation is counted at one `element_bytes`: what the code sends when the model runs in
one dtype (float64 in the tests; bf16 when the weights themselves are bf16, as FSDP's gathered
units are). Under autocast over fp32 weights (DDP) the residual stream stays fp32 and the matmuls'
outputs are bf16, so some collectives carry 4 bytes an element and others 2: the formula with 2
is then a lower bound and with 4 an upper one. The loss's numbers are in the logits' dtype, which
the loop promotes to at least fp32 (`step.token_loss_sum`), hence `loss_bytes`' default.
"""

from dataclasses import dataclass
from fractions import Fraction


def all_reduce_bytes(nbytes: int, t: int) -> Fraction:
    """What one rank sends in a ring all-reduce of `nbytes` over `t` ranks: 2(t-1)/t of it."""
    return Fraction(2 * (t - 1) * nbytes, t)


def gather_or_scatter_bytes(nbytes: int, t: int) -> Fraction:
    """What one rank sends in a ring all-gather (of an `nbytes` output) or reduce-scatter (of an
    `nbytes` input) over `t` ranks: (t-1)/t of it."""
    return Fraction((t - 1) * nbytes, t)


@dataclass(frozen=True)
class TensorParallelBytes:
    """Bytes one rank sends per step, by where in the model they go (exact fractions)."""

    per_layer: Fraction  # one decoder layer's two blocks: their entries and exits, forward and backward
    layer_norms: Fraction  # one layer's norm weights (and row-parallel biases) through f: sequence parallel only
    num_layers: int
    embedding: Fraction  # the vocabulary-parallel embedding's all-reduce, in forward
    head: Fraction  # the head's entry
    loss: Fraction  # the vocabulary-parallel loss's MAX and SUM
    split: Fraction  # the first layer's split under sequence parallelism (its backward all-gather)
    final_norm: Fraction  # the final norm's weight through f, under sequence parallelism

    @property
    def layers(self) -> Fraction:
        return self.num_layers * (self.per_layer + self.layer_norms)

    @property
    def total(self) -> Fraction:
        return self.layers + self.embedding + self.head + self.loss + self.split + self.final_norm


def tensor_parallel_bytes(config, batch: int, seq: int, tp: int, *, sequence_parallel: bool = False,
                          element_bytes: int = 2, loss_bytes: int | None = None, weight_bytes: int | None = None,
                          micro_batches: int = 1) -> TensorParallelBytes:
    """Bytes one rank sends per step for `parallelize_llama(model, group of tp, sequence_parallel)`
    and `vocab_parallel_cross_entropy`, on `micro_batches` micro-batches of `batch` sequences of
    `seq` tokens each (as the model sees them: padded). `config` is the Llama's (hidden size,
    layers, biases). `loss_bytes`: the logits' element size (default: at least fp32, as the loop
    computes the loss); `weight_bytes`: the norms' weights' (default `element_bytes`). Micro-batches
    of different lengths: sum the totals of one call each."""
    t, k = tp, micro_batches
    activation = batch * seq * config.hidden_size * element_bytes  # b x s x h, the residual stream
    weight = config.hidden_size * (element_bytes if weight_bytes is None else weight_bytes)
    predicting = batch * (seq - 1) * (max(element_bytes, 4) if loss_bytes is None else loss_bytes)
    if sequence_parallel:
        # A block's entry all-gathers forward and reduce-scatters backward; its exit the reverse.
        entry = exit_ = 2 * gather_or_scatter_bytes(activation, t)
        biases = bool(getattr(config, "attention_bias", False)) + bool(getattr(config, "mlp_bias", False))
        norm = all_reduce_bytes(weight, t)
    else:
        # f all-reduces in backward, g in forward.
        entry = exit_ = all_reduce_bytes(activation, t)
        biases, norm = 0, Fraction(0)
    return TensorParallelBytes(
        per_layer=k * 2 * (entry + exit_),  # attention and the MLP
        layer_norms=k * (2 + biases) * norm,  # input_layernorm, post_attention_layernorm, o_proj's and down_proj's biases
        num_layers=config.num_hidden_layers,
        embedding=k * all_reduce_bytes(activation, t),
        head=k * entry,
        loss=k * (all_reduce_bytes(predicting, t) + all_reduce_bytes(2 * predicting, t)),
        split=k * gather_or_scatter_bytes(activation, t) if sequence_parallel else Fraction(0),
        final_norm=k * norm,
    )


def fsdp_bytes_per_layer(layer_params: int, n: int, gather_bytes: int = 4, reduce_bytes: int = 4,
                         micro_batches: int = 1) -> Fraction:
    """What FSDP sends per rank per step for one layer of `layer_params` weights over `n` ranks: an
    all-gather before forward and another before backward (per micro-batch), and one reduce-scatter
    of the gradient (per step under `no_sync`): 3 x P x (n-1)/n x 4 bytes in fp32. The hand-written
    FSDP gathers in the compute dtype (`gather_bytes` 2 under bf16) and reduces in fp32 (`fsdp.py`)."""
    gathers = 2 * micro_batches * gather_or_scatter_bytes(layer_params * gather_bytes, n)
    return gathers + gather_or_scatter_bytes(layer_params * reduce_bytes, n)
