"""Trace what a model saves for backward, instead of deriving it by hand, for any architecture.

`llama_layer.layer_bytes_per_token` derives a Llama layer's saved activations by reading
`modeling_llama.py` line by line. That is the lesson's worked example, but it does not scale: a
Mistral, a GPT-NeoX or a Mixtral layer saves other tensors, and the attention kernel the run takes
(SDPA's fused kernels save no T x T scores; `eager`, or SDPA with dropout, does) changes the sum.
So here we ask the model itself:

1. Build it from its config under PyTorch's `FakeTensorMode`: every tensor has a shape, a dtype,
   a device and a storage size, but no data, so a 70B model at 32k tokens costs no memory, and
   every operator runs its "meta" rule instead of its kernel. The dispatch is the real one, so SDPA
   picks the kernel a CPU run would pick, and autograd records what each operator saves.
2. Run forward and the loop's own loss (`step.token_loss_sum`) at the requested batch, length
   and precision (fp32; bf16 weights; autocast), with `torch.autograd.graph.saved_tensors_hooks`.
   The pack hook sees every tensor autograd saves. We count distinct storages (a view shares its
   base's storage, so it counts once), skip parameters and views of them (model states), and note
   which layer was running when each storage was saved. An encoder-decoder (T5, BART) runs
   whole, its encoder's and decoder's blocks are its layers, and its loss is `seq2seq_loss_sum`.
3. A storage saved by one layer only is that layer's. One saved by several (the rotary cos and sin,
   the attention mask, the encoder's output that every decoder block's cross-attention reads) is
   *shared*. (T5's relative position bias is only added to the scores, never saved: its first block
   keeps the T x T int64 bucket indices of the bias table's lookup.) What no layer saved
   (embeddings, final norm, the output layer's input, the loss's fp32 log-probabilities) is
   *outside*. Under autocast the bf16 copies of the weights are saved too; they are counted apart
   (`weight_copies`), as the estimator does.
4. Layers are grouped into *types*: the decoder layer's class, its submodules' classes (a sparse
   MoE block is not a dense MLP) and its config-driven variant (Gemma2's `sliding_attention` and
   `full_attention`). Every layer runs (under fake tensors a forward costs only its Python), so a
   non-uniform model (Qwen2-MoE with every other layer sparse) is counted layer by layer, and
   `types` says what differs.

What the real run does that a trace cannot know, we pin:
- transformers treats fake tensors as "tracing" and then keeps the attention mask it could drop; for
  an unpadded batch we pass no mask and let its checks see no padding, no cache offset and no packed
  sequences, as the real run sees them, so it builds a mask only where one is needed (a sliding
  window shorter than the batch); an encoder-decoder's decoder gets no mask (the labels' padding is
  -100), so its causal mask is dropped too, padded or not;
- MoE routing depends on the data: transformers' grouped-matmul experts save tensors whose sizes
  depend only on tokens x top-k, not on which expert gets which token, so the trace is exact for
  them. (PyTorch's meta rule for `_grouped_mm` accepts bf16 only; in fp32 we take transformers'
  own fallback op, which saves the same input and weight but not the groups' offsets: 4 bytes
  per expert per sparse layer fewer than the real run.)
- the device is the CPU: a GPU run may pick another SDPA kernel (flash saves no mask; memory-
  efficient attention with a mask saves it), which this trace does not model.

Validated against a real CPU forward of tiny models in tests/memory/test_trace.py.
"""

import copy
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.nn.functional as F

MODES = ("fp32", "bf16", "autocast")


@dataclass
class Trace:
    """Bytes saved for backward by one micro-batch, split by where they were saved."""

    layers: list  # per layer (an encoder-decoder's: encoder's, then decoder's), in order: bytes it alone saved
    layer_types: list  # per decoder layer: its type (see `layer_type`)
    shared: int = 0  # saved by several layers (rotary cos/sin, the attention mask, the encoder's output)
    outside: int = 0  # saved by no layer: embeddings, final norm, output layer, loss
    weight_copies: int = 0  # autocast's bf16 copies of the weights
    layer_copies: list = field(default_factory=list)  # per decoder layer: the weight copies it made
    # Of `layers` and `outside`: what only normalisation modules saved (a layer's norms, the final norm).
    # Sequence parallelism cuts these along the sequence (`tensor_parallel.py`).
    layer_norms: list = field(default_factory=list)
    outside_norms: int = 0
    attn_implementation: str = ""
    storages: dict = field(default_factory=dict, repr=False)  # storage -> (bytes, owners)

    @property
    def saved(self) -> int:
        """Everything forward and the loss keep for backward (weight copies apart)."""
        return sum(self.layers) + self.shared + self.outside

    @property
    def types(self) -> dict:
        """{layer type: (count, bytes per layer)}; a type whose layers differ lists the largest."""
        out = {}
        for kind, nbytes in zip(self.layer_types, self.layers):
            count, most = out.get(kind, (0, 0))
            out[kind] = (count + 1, max(most, nbytes))
        return out


def decoder_layers(model) -> list:
    """The model's repeated blocks, in order: the classes it names as not to be split
    (`_no_split_modules`, what FSDP wraps as units), found among its submodules."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    # A unit class may hold another (a stack of blocks): keep the innermost.
    ids = {id(m) for m in layers}
    return [m for m in layers if not any(id(c) in ids for c in m.modules() if c is not m)]


def layer_type(layer) -> str:
    """A layer's type: its class, its config-driven attention variant, and its submodules'
    classes (so a sparse MoE block and a dense MLP differ). Parameter shapes too, as
    a layer may be narrower (Qwen2-MoE's dense MLP width differs from the expert width)."""
    variant = None
    for module in (layer, *(m for m in layer.children() if hasattr(m, "layer_idx"))):  # the layer, its attention
        variant = variant or getattr(module, "attention_type", None) or getattr(module, "layer_type", None)
        types, idx = getattr(getattr(module, "config", None), "layer_types", None), getattr(module, "layer_idx", None)
        variant = variant or (types[idx] if types and isinstance(idx, int) and idx < len(types) else None)
    parts = sorted({type(m).__name__ for m in layer.modules() if m is not layer})
    shapes = tuple(tuple(p.shape) for p in layer.parameters())
    return f"{type(layer).__name__}[{variant or 'attention'}]({','.join(parts)})#{abs(hash(shapes)) % 10**6:06d}"


class SavedByLayer:
    """`with SavedByLayer(model) as seen:` records each storage autograd saves, its bytes and the
    decoder layers (by index) that saved it; -1 for none; and whether only normalisation modules
    (a class named *Norm*) saved it. Works on real and fake tensors alike."""

    def __init__(self, model):
        self.model, self.layers = model, decoder_layers(model)
        self.norms = [m for m in model.modules() if "Norm" in type(m).__name__]
        self.current, self.in_norm = -1, False
        self.storages = {}  # storage key -> [bytes, set of owners, is a weight copy, saved in norms only]
        self.keep = []  # the saved storages stay alive while we hold them, so keys are not reused
        self._stack = ExitStack()

    def _pack(self, tensor):
        base = tensor._base if tensor._base is not None else tensor
        if base.is_leaf and base.requires_grad or isinstance(base, torch.nn.Parameter):
            return tensor  # a parameter (trained or frozen: LoRA's base) or a view of one: a model state
        storage = tensor.untyped_storage()
        entry = self.storages.setdefault(storage._cdata, [storage.nbytes(), set(), _is_weight_copy(base), True])
        entry[1].add(self.current)
        entry[3] = entry[3] and self.in_norm
        self.keep.append(tensor)
        return tensor

    def __enter__(self):
        for i, layer in enumerate(self.layers):
            self._stack.callback(layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "current", i)).remove)
            self._stack.callback(layer.register_forward_hook(lambda *_: setattr(self, "current", -1)).remove)
        for norm in self.norms:
            self._stack.callback(norm.register_forward_pre_hook(lambda *_: setattr(self, "in_norm", True)).remove)
            self._stack.callback(norm.register_forward_hook(lambda *_: setattr(self, "in_norm", False)).remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def result(self, attn_implementation: str = "") -> Trace:
        per_layer = [0] * len(self.layers)
        out = Trace(per_layer, [layer_type(m) for m in self.layers], attn_implementation=attn_implementation,
                    layer_copies=[0] * len(self.layers), layer_norms=[0] * len(self.layers))
        for key, (nbytes, owners, is_copy, in_norms) in self.storages.items():
            layers = owners - {-1}
            out.storages[key] = (nbytes, owners)
            if is_copy:
                out.weight_copies += nbytes
                if len(layers) == 1 and -1 not in owners:  # a layer's own weight, cast inside it
                    out.layer_copies[next(iter(layers))] += nbytes
            elif len(layers) == 1 and -1 not in owners:
                per_layer[next(iter(layers))] += nbytes
                out.layer_norms[next(iter(layers))] += nbytes * in_norms
            elif layers:
                out.shared += nbytes
            else:
                out.outside += nbytes
                out.outside_norms += nbytes * in_norms
        return out


def _is_weight_copy(t) -> bool:
    """A cast of a parameter (autocast's bf16 weight): its grad_fn leads straight to the leaf."""
    fn = t.grad_fn
    return (fn is not None and type(fn).__name__ == "ToCopyBackward0"
            and any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions))


class _Autocast:
    """What `step.token_loss_sum` asks of a strategy, for one process with the whole model: the
    autocast context of the run's precision, and the loss over the whole vocabulary."""

    def __init__(self, mode):
        self.mode = mode

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.mode == "autocast" else nullcontext()

    def cross_entropy_sum(self, logits, targets):
        from minidist.step import cross_entropy_sum

        return cross_entropy_sum(logits, targets)


def batch_for(batch: int, seq: int, padded: bool, vocab_size: int, make=torch.randint,
              target_seq: int | None = None) -> dict:
    """A micro-batch as the loop builds it: the last sequence right-padded from half its length.
    With `target_seq`, an encoder-decoder's: `seq` source tokens, and labels of `target_seq`
    target tokens, the last target padded from half its length too (-100, which the loss skips)."""
    input_ids = make(0, vocab_size, (batch, seq))
    attention_mask = torch.ones_like(input_ids)
    if padded:
        attention_mask[-1, seq // 2:] = 0
    if target_seq is None:  # a causal LM: the labels are the input, shifted by the loss
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "labels": input_ids.masked_fill(attention_mask == 0, -100)}
    labels = make(0, vocab_size, (batch, target_seq))
    if padded:
        labels[-1, target_seq // 2:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_batch_for(batch: int, seq: int, vocab_size: int) -> dict:
    """`--pack`'s micro-batch as `packing.collate_packed` makes it: `batch` rows of `seq` tokens, each
    holding two games (the first half of the row and the rest), with each game's own position ids,
    labels of -100 at each game's first token, and the 4-D block-diagonal causal mask. What a row
    saves depends on its shape alone, not on where its games end or on its tokens."""
    from minidist import packing

    games = [[token % vocab_size for token in range(n)] for n in (seq // 2, seq - seq // 2) if n]
    data = packing.collate_packed([games] * batch, pad_token_id=0)
    return {name: data[name] for name in ("input_ids", "labels", "position_ids", "attention_mask")}


def seq2seq_loss_sum(model, batch: dict, strategy) -> torch.Tensor:
    """`step.token_loss_sum` for an encoder-decoder: the decoder reads the labels shifted right
    (the model's own `prepare_decoder_input_ids_from_labels`: a start token, -100 as padding), so
    logit t predicts label t, and no shift is left for the loss. The labels are not passed to the
    model: it would also compute its own mean loss, which a loop that sums its loss throws away."""
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    with strategy.autocast():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=decoder_input_ids, use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the softmax in fp32 at least
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")


def run_and_record(model, batch: dict, mode: str) -> Trace:
    """Forward and the loop's loss under `SavedByLayer`: what a real (or fake) model saves."""
    from minidist.step import token_loss_sum

    loss_sum = seq2seq_loss_sum if model.config.is_encoder_decoder else token_loss_sum
    with SavedByLayer(model) as seen:
        loss = loss_sum(model, batch, _Autocast(mode))
    del loss
    return seen.result(model.config._attn_implementation)


@contextmanager
def _as_the_real_run(padded: bool, seq2seq: bool = False):
    """Make transformers take, on fake tensors, the paths it takes on real ones (module docstring)."""
    import transformers.integrations.moe as moe
    import transformers.masking_utils as masking

    with ExitStack() as stack:
        # No padding, no cache: the real run drops the causal mask and lets SDPA be causal by itself.
        # An encoder-decoder's decoder is given no mask (BART then makes an all-ones one): never padded.
        if not padded or seq2seq:
            ignore = masking._ignore_causal_mask_sdpa
            stack.enter_context(mock.patch.object(masking, "_ignore_causal_mask_sdpa", lambda padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None: ignore(None, q_length, kv_length, 0, 0, local_attention_size)))
            # and the positions are 0..T-1 in every row: not packed sequences (which need a mask)
            stack.enter_context(mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None))
        grouped = moe._can_use_grouped_mm
        stack.enter_context(mock.patch.object(
            moe, "_can_use_grouped_mm", lambda i, w, o: w.dtype == torch.bfloat16 and grouped(i, w, o)))
        yield


def model_class(config):
    """The whole model a config describes: an encoder-decoder (T5, BART) as one, with its LM head
    (`AutoModelForCausalLM` would build BART's decoder alone), any other as a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


def build(config, mode: str = "fp32", attn_implementation: str | None = None):
    """The model of `config`, as the run builds it (`models.load_model`), in training mode."""
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    config = copy.deepcopy(config)  # from_config writes the attention implementation into the config it gets
    model = model_class(config).from_config(config, dtype=torch.bfloat16 if mode == "bf16" else torch.float32, **kwargs)
    return model.train()


def trace(config, batch: int, seq: int, mode: str = "fp32", padded: bool = True,
          attn_implementation: str | None = None, target_seq: int | None = None, adapt=None,
          packed: bool = False) -> Trace:
    """What one micro-batch of `batch` x `seq` tokens saves for backward, traced on fake tensors.

    config: a transformers config (`estimator.load_config` reads one from a folder or hub name);
    mode: fp32, bf16 (bf16 weights) or autocast (bf16 matmuls over fp32 weights);
    attn_implementation: None takes what transformers picks for the config, as the run does;
    target_seq: an encoder-decoder's target length (default `seq`); a causal LM has none;
    adapt: what changes the built model before it runs (LoRA's adapters: `lora_terms.adapt`);
    packed: `--pack`'s rows (`packed_batch_for`), with their mask and position ids (`padded` unused)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if mode not in MODES:
        raise ValueError(f"the precision must be one of {', '.join(MODES)}, got {mode!r}")
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    if seq2seq and getattr(config, "decoder_start_token_id", None) is None:  # the labels shifted right start with it
        raise ValueError(f"cannot trace {config.model_type!r}: its config names no decoder_start_token_id")
    if packed and seq2seq:
        raise ValueError(f"--pack packs the games of a causal LM; {config.model_type!r} is an encoder-decoder")
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, _as_the_real_run(padded or packed, seq2seq):
        try:
            model = build(config, mode, attn_implementation)
        except ValueError as err:
            raise ValueError(f"cannot trace {config.model_type!r}: transformers builds no causal or seq2seq LM from it "
                             f"({str(err).strip().splitlines()[0][:120]})") from err
        target_seq = (target_seq or seq) if seq2seq else None
        if packed:
            data = packed_batch_for(batch, seq, config.vocab_size)
        else:
            data = batch_for(batch, seq, padded, config.vocab_size, target_seq=target_seq)
        data = {k: fake.from_tensor(v) for k, v in data.items()}
        if not padded and not packed:  # all ones: the real run reads it and drops it, which a fake tensor cannot be read for
            data["attention_mask"] = None
        model = adapt(model) if adapt else model
        if not decoder_layers(model):
            raise ValueError(f"cannot trace {config.model_type!r}: it names no repeated layer class (_no_split_modules)")
        try:
            return run_and_record(model, data, mode)
        except (RuntimeError, NotImplementedError, ValueError) as err:  # an operator that needs data, or
            # has no fake rule; or one of the model's own checks
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            raise ValueError(f"cannot trace {config.model_type!r}: its forward fails on fake tensors ({first})") from err
