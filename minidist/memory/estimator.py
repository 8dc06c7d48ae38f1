"""Memory: where the bytes of a training step go, per rank, for any model, strategy and batch.

    python -m minidist.memory codellama/CodeLlama-7b-hf --world_size 4 --strategy fsdp \\
        --batch_size_per_device 1 --max_seq_length 1024 --gradient_checkpointing --gpu_memory 80GB

The model is built from its config on the meta device (shapes, no storage, no weights read), so
P counts every parameter once, a tied embedding included. Sizes are bytes; 1 GB = 1e9 bytes.
`measure.py` measures the same terms in the training loop; tests/memory/test_memory.py holds the
two together. `report.py` prints them (the command above, in `__main__.py`).

**Model states** (Rajbhandari et al. 2020, "ZeRO", section 3). AdamW keeps two moments per
parameter; with fp32 parameters and gradients that is 4 + 4 + 8 = 16 bytes per parameter.
`--mixed_precision bf16` in this loop computes in bf16 but keeps the fp32 parameters as the
master weights (autocast for DDP, FSDP2's bf16 all-gather for FSDP), so the 16 bytes stay
4 + 4 + 8. The ZeRO paper's split, 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master,
m, v), gives the same 16 for DDP and FSDP; it is what the hand-written ZeRO-1/2 hold in bf16
(`zero.py`: bf16 model, fp32 master shard in the optimizer). FSDP, by hand as in FSDP2, keeps
the fp32 shard as the parameter and its fp32 gradient shard: 4 + 4 + 8 per sharded element.
What is sharded over N ranks: ZeRO-1 the optimizer states, ZeRO-2 also the gradients, FSDP
(ZeRO-3) also the parameters. FSDP2 shards each tensor on dim 0 (ceil(rows/N) rows, padded).

**Buffers and gathered units.** A bucketed DDP (PyTorch's) allocates buckets for every gradient
when it wraps the model: a second copy of the gradients, 4P (`ddp.py`'s gradients become views
of its buckets, as with PyTorch's `gradient_as_bucket_view=True`). ZeRO packs its flat buckets
as `zero.py` does (a parameter larger than the cap alone). FSDP gathers the root unit
(embeddings, final norm, output layer) and a layer with the next one prefetched; without the
layer wrap policy the one unit is the whole model. When each is alive: `moments.py`. HSDP holds
and gathers what FSDP on one shard group does, plus its all-reduce across copies: `hybrid.py`.

**Activations**: what autograd saves for backward, traced rather than derived (`trace.py`): the
model's own forward and the loop's loss run on fake tensors (shapes, no data) under saved-tensor
hooks, each storage counted once, per decoder layer, shared by several layers (rotary cos and
sin, a mask), or outside them (embeddings, the head, the loss's fp32 log-probabilities). Every
term is affine in the batch, so traces at batch 1 and 2 give any batch. Layers of different types
(Qwen2-MoE's sparse and dense, T5's encoder and decoder blocks) are each counted for themselves,
with the attention kernel the run takes (SDPA's fused kernels save no T x T scores). Autocast's
bf16 weight copies are traced too. `llama_layer.py` derives a Llama layer by hand, equal to the
trace. Under LoRA the trace runs with the adapters (`lora_terms.adapt`).

**Checkpointing** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost") keeps
only each layer's input (hidden x 2 or 4 bytes per token, as the residual stream is bf16 or
fp32; for an encoder-decoder, counted at the source's length for every layer) and recomputes
one layer at a time in backward, so one layer's activations come back for a moment.

**Tensor and sequence parallelism** (`--tp_size`, `--sequence_parallel`): a rank holds a slice of
every layer, estimated as the model of a smaller config, over the data-parallel ranks that hold
the same slice (`tensor_parallel.py`, `per_rank`).

**The peak** is the most that is alive at one moment: `moments.py` walks each strategy's step
(the end of forward, backward as it reduces, the optimizer step) and `peak_moment` says where it
falls and what is alive then; the terms above are each one's own size, not all alive at once.
Not counted: the CUDA context, NCCL and the caching allocator's fragmentation; `--gpu_memory
80GB` (8e10 bytes) for an A100 that reports 85.1e9 leaves them about 5 GB. Under
`--cpu_offload` the peak is the device's, and the estimate has a device and a host column
(`offload_split.py`).

Tested against measurement (saved-tensor hooks, `measure.LiveTensors`) for Llama, Mistral, Qwen2,
Qwen3, Gemma2, Phi-3, GPT-NeoX, OPT, Mixtral, GPT-2, Qwen2-MoE, T5 and BART
(tests/memory/test_trace.py, test_memory.py). One that cannot be traced ends in one ValueError
naming it: no fallback.
"""

import functools
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from minidist.memory import cache, hybrid, lora_terms, moments, offload_split, tensor_parallel, trace
from minidist.strategy.options import STRATEGIES, ParallelOptions

GB = 1e9
CONFIGS = Path(__file__).parent.parent / "hf" / "configs"
# Configs shipped with minidist, so the estimates in the lessons work offline (lesson 00's t5-base
# question).
BUNDLED = {"codellama/CodeLlama-7b-hf": CONFIGS / "codellama-7b", "google-t5/t5-base": CONFIGS / "t5-base"}


@dataclass(frozen=True)
class Shape:
    """What the estimate needs to know about a model, counted on the meta device."""

    name: str
    architecture: str
    model_type: str
    num_params: int
    param_rows: tuple  # (dim 0, numel) of every parameter: FSDP2's shards are rows
    num_layers: int  # the repeated blocks (`trace.decoder_layers`): an encoder-decoder's both stacks
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_params: int  # the largest decoder layer: an FSDP unit under the layer wrap policy
    layer_param_counts: tuple  # every layer's parameters, in order (MoE and dense layers differ)
    root_params: int  # the rest: embeddings, final norm, output layer
    head_linear_params: int  # the output layer: its gradient comes first in backward
    largest_module_params: int  # DeepSpeed's "largest layer": the biggest module's own parameters
    base_params: int  # without the output layer, as `AutoModel` builds it (what accelerate sizes)
    config_dtype_bytes: int  # the dtype the config names (`torch_dtype`), in which transformers builds it
    tied_params: int = 0  # an output layer that is the input embedding: its gradient comes twice
    is_encoder_decoder: bool = False  # T5, BART: estimated whole; the loop does not train them
    tp_size: int = 1  # > 1: the slice of the model one of tp_size ranks holds (`rank_shape`)
    config: object = field(default=None, repr=False, compare=False)  # what `trace` runs


def load_config(name_or_path: str):
    """A config from a local folder, the bundled copy of a known hub model, or the hub."""
    from minidist.hf import models

    path = Path(name_or_path).expanduser()
    source = path if (path / "config.json").exists() else BUNDLED.get(name_or_path, name_or_path)
    try:
        return models.load_config(str(source))  # a cached hub name without the hub: the cache alone, at once
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(f"could not read the config of {name_or_path!r} ({first}): pass a folder with a "
                                f"config.json, a bundled model ({', '.join(BUNDLED)}), or run where the hub is "
                                "reachable")


def model_shape(name_or_path: str) -> Shape:
    """Build the model on the meta device and count what the estimate needs."""
    return config_shape(load_config(name_or_path), name_or_path)


def config_shape(config, name: str, tp_size: int = 1) -> Shape:
    """The Shape of the model `config` describes, built on the meta device."""
    with torch.device("meta"):
        model = trace.model_class(config).from_config(config)
    params = list(model.parameters())  # each tensor once: a tied embedding is one parameter
    num_params = sum(param.numel() for param in params)
    layers = trace.decoder_layers(model)
    counts = tuple(sum(param.numel() for param in layer.parameters()) for layer in layers)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    hidden, heads = config.hidden_size, config.num_attention_heads
    return Shape(
        name=name, architecture=type(model).__name__, model_type=config.model_type,
        num_params=num_params,
        param_rows=tuple((param.shape[0] if param.dim() else 1, param.numel()) for param in params),
        num_layers=len(counts), hidden_size=hidden,
        intermediate_size=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        vocab_size=head.weight.shape[0] if head is not None else config.vocab_size,  # the head's real rows
        layer_params=max(counts, default=0), layer_param_counts=counts, root_params=num_params - sum(counts),
        head_linear_params=sum(param.numel() for param in head.parameters()) if head is not None else 0,
        largest_module_params=max(sum(param.numel() for param in module.parameters(recurse=False))
                                  for module in model.modules()),
        base_params=sum(param.numel() for param in model.base_model.parameters()),
        config_dtype_bytes=params[0].element_size(),
        tied_params=head.weight.numel() if tied else 0,
        is_encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)), tp_size=tp_size, config=config,
    )


def rank_shape(shape: Shape, tp_size: int) -> Shape:
    """What one of `tp_size` tensor-parallel ranks holds, as a model of its own
    (`tensor_parallel.split_config`); the shape itself where there is nothing to cut. Cached by
    the config (two Shapes that differ only in it, say in the attention, compare equal)."""
    if tp_size == shape.tp_size:
        return shape
    if shape.tp_size != 1:
        raise ValueError(f"this shape is already the slice one of {shape.tp_size} ranks holds: cut the whole model's")
    return _rank_shape(shape.config.to_json_string(use_diff=False), type(shape.config), shape.name, tp_size)


@functools.lru_cache(maxsize=16)
def _rank_shape(config_json: str, config_class, name: str, tp_size: int) -> Shape:
    config = config_class.from_dict(json.loads(config_json))
    return config_shape(tensor_parallel.split_config(config, tp_size), name, tp_size)


def per_rank(shape: Shape, setup: "Setup") -> tuple[Shape, "Setup"]:
    """Under tensor parallelism, the slice one rank holds and the data parallelism over the ranks
    that hold the same slice (`tensor_parallel.py`); anything else unchanged."""
    if setup.options.tp_size == 1 or shape.tp_size == setup.options.tp_size:
        return shape, setup
    return rank_shape(shape, setup.options.tp_size), tensor_parallel.data_parallel(setup)


@dataclass(frozen=True)
class Setup:
    """One training configuration: the run's parallel options and the sizes of a step."""

    options: ParallelOptions = ParallelOptions(mixed_precision="bf16")
    world_size: int = 1
    batch_size_per_device: int = 1
    max_seq_length: int = 512
    padded: bool = True  # right-padded batches: SDPA gets (and saves) a mask
    packed: bool = False  # `--pack`: batch_size_per_device rows of max_seq_length tokens, games packed whole, each
    # attending to itself (the block-diagonal mask, per-game position ids: trace.packed_batch_for)
    target_length: int = 0  # an encoder-decoder's target tokens (0: as many as max_seq_length, the source)
    gradient_accumulation_steps: int = 1  # from the second micro-batch on, gradients are there in forward
    backend: str = "nccl"  # or "gloo" (CPU ranks), which copies what it reduce-scatters (moments.py)
    lora_rank: int = 0  # LoRA adapters of this rank train, the base is frozen (lora_terms.py); 0: full fine-tune
    lora_target_modules: str | None = None  # as finetune's flag (None: lora.DEFAULT_TARGETS)
    lora_dropout: float = 0.0  # > 0: each adapter saves a dropout mask and its dropped input (lora_terms.adapt)

    @property
    def strategy(self) -> str:
        return self.options.strategy


def setup(**flags) -> Setup:
    """A Setup named as `minidist.finetune`'s flags: `setup(strategy="ddp", world_size=4)`.

    The flags that are Setup's own fields (the sizes, the backend, LoRA's) go to it, the others to
    ParallelOptions. The options not given are ParallelOptions' defaults, except bf16, as on the
    GPUs. zero1 and zero2 exist only by hand, so for them `impl` is minidist whatever was asked."""
    sizes = {attribute.name: flags.pop(attribute.name) for attribute in fields(Setup) if attribute.name in flags}
    options = {"mixed_precision": "bf16", **flags}
    if options.get("strategy") in ("zero1", "zero2"):
        options["impl"] = "minidist"
    return Setup(ParallelOptions(**options), **sizes)


def as_dict(setup: Setup) -> dict:
    """The setup as one flat dict of flag names (options and sizes), for reports and JSON."""
    names = [attribute.name for attribute in fields(setup) if attribute.name != "options"]
    sizes = {name: getattr(setup, name) for name in names}
    return {**asdict(setup.options), **sizes}


def compute_mode(setup: Setup) -> str:
    """fp32; autocast (bf16 matmuls over fp32 weights: DDP); bf16 (the weights themselves are bf16)."""
    if setup.options.mixed_precision == "fp32":
        return "fp32"
    return "autocast" if setup.strategy == "ddp" else "bf16"


def shard_numel(shape: Shape, setup: Setup) -> int:
    """Elements of one rank's shard: FSDP2 takes ceil(rows/N) rows of every tensor, a flat shard 1/N."""
    ranks = setup.world_size
    if setup.strategy == "fsdp" and setup.options.impl == "torch":
        return sum(math.ceil(rows / ranks) * (numel // rows) for rows, numel in shape.param_rows)
    return math.ceil(shape.num_params / ranks)


def model_states(shape: Shape, setup: Setup) -> dict:
    """Parameters, gradients and optimizer states held by one rank (the first, whose shards are
    fullest)."""
    setup = hybrid.as_fsdp(setup)  # HSDP holds what FSDP on one shard group holds
    if setup.lora_rank:
        return lora_terms.model_states(shape, setup)
    strategy, full, shard = setup.strategy, shape.num_params, shard_numel(shape, setup)
    zero_paper = setup.options.mixed_precision == "bf16" and strategy in ("zero1", "zero2")
    if zero_paper:  # bf16 weights and gradients; fp32 masters, m and v
        weight_bytes, grad_bytes, state_bytes = 2, 2, 12
    else:  # fp32 ZeRO's master is a view of its own weights, but under --cpu_offload a copy on the host
        weight_bytes, grad_bytes = 4, 4
        state_bytes = 8 + 4 * (setup.options.cpu_offload and strategy != "fsdp")
    if strategy == "zero2" and setup.options.accumulate_sharded:  # the shards' gradients, summed in reduce_dtype
        grad_bytes = 2 if setup.options.value("reduce_dtype") == "bf16" else 4
    return {
        "parameters": weight_bytes * (shard if strategy == "fsdp" else full),
        "gradients": grad_bytes * (shard if strategy in ("zero2", "fsdp") else full),
        # AdamW also keeps one fp32 step counter per parameter tensor.
        "optimizer_states": state_bytes * (full if strategy == "ddp" else shard) + 4 * len(shape.param_rows),
    }


@functools.lru_cache(maxsize=64)
def _traced(config_json: str, config_class, mode: str, seq: int, padded: bool, target: int, lora: tuple, packed: bool,
            batch: int):
    """One trace, kept on disk (`cache.py`): lessons and tests estimate CodeLlama-7b in many processes."""
    def run():
        config = config_class.from_dict(json.loads(config_json))
        adapt = lora_terms.adapt(lora, mode) if lora else None  # LoRA's adapters in the trace
        result = trace.trace(config, batch, seq, mode, padded, target_seq=target or None, adapt=adapt, packed=packed)
        return {attribute.name: getattr(result, attribute.name) for attribute in fields(result)
                if attribute.name != "storages"}
    key = dict(config=config_json, mode=mode, seq=seq, padded=padded, target=target, batch=batch,
               **({"lora": lora} if lora else {}), **({"packed": True} if packed else {}))
    return trace.Trace(**cache.cached("trace", key, run))


def traced(shape: Shape, mode: str, seq: int, padded: bool, batch: int, target: int = 0, lora: tuple = (),
           packed: bool = False) -> dict:
    """The trace at any batch from two (batch 1 and 2): each term is a + b x (per sequence).
    Cached, so `largest_batch`'s dozen estimates cost two traces."""
    if shape.config is None:
        raise ValueError(f"the shape of {shape.name!r} carries no config to trace: build it with model_shape")
    key = (shape.config.to_json_string(use_diff=False), type(shape.config), mode, seq, padded,
           target if shape.is_encoder_decoder else 0, lora, packed)
    one, two = _traced(*key, 1), _traced(*key, 2)

    def at(at_one, at_two):  # term by term, at this batch
        if isinstance(at_one, list):
            return [at(x1, x2) for x1, x2 in zip(at_one, at_two)]
        return at_one + (batch - 1) * (at_two - at_one)
    terms = ("layers", "shared", "outside", "weight_copies", "layer_copies", "layer_norms", "outside_norms")
    return {**{term: at(getattr(one, term), getattr(two, term)) for term in terms},
            "types": one.types, "attention": one.attn_implementation}


def activations(shape: Shape, setup: Setup) -> dict:
    """Activation memory of one micro-batch: what forward saves, and what lives for a moment."""
    shape, tp = rank_shape(shape, setup.options.tp_size), setup.options.tp_size  # a slice of each layer
    mode, batch, seq = compute_mode(setup), setup.batch_size_per_device, setup.max_seq_length
    residual_bytes = 2 if mode == "bf16" else 4  # the residual stream: bf16 weights make it bf16
    tokens = batch * seq
    traced_terms = traced(shape, mode, seq, setup.padded, batch, setup.target_length, lora_terms.trace_key(setup),
                          setup.packed)
    sp = setup.options.sequence_parallel  # the norms, and a checkpointed layer's input, on s / tp tokens
    traced_terms = tensor_parallel.sequence_parallel(traced_terms, tp) if sp else traced_terms
    # What the logits cover: an encoder-decoder's targets, a decoder's every token.
    targets = batch * (setup.target_length or seq) if shape.is_encoder_decoder else tokens
    ckpt = setup.options.gradient_checkpointing
    layers, layer_copies = traced_terms["layers"], traced_terms["layer_copies"]
    # Checkpointing keeps each layer's input (its hidden states) and recomputes the rest in backward,
    # one layer at a time: that layer's activations, and under autocast its weight copies, again.
    kept = [residual_bytes * shape.hidden_size * tokens // (tp if sp else 1)] * len(layers) if ckpt else layers
    recompute = [saved + copies for saved, copies in zip(layers, layer_copies)] if ckpt else [0] * len(kept)
    copies = traced_terms["weight_copies"] - (sum(layer_copies) if ckpt else 0)
    logits = tensor_parallel.logits(targets, shape) if tp > 1 else 8 * targets * shape.vocab_size  # `moments.py`
    return {"saved": sum(kept) + traced_terms["shared"] + traced_terms["outside"], "per_layer": max(layers, default=0),
            "weight_copies": copies, "kept_by_layer": kept, "layer": max(kept, default=0),
            "recompute_by_layer": recompute, "recompute": max(recompute, default=0),
            "logits": logits, "types": traced_terms["types"], "attention": traced_terms["attention"]}


def buffers(shape: Shape, setup: Setup) -> dict:
    """Communication buckets and FSDP's gathered units (AdamW's temporary: `moments.py`)."""
    setup = hybrid.as_fsdp(setup)  # HSDP gathers the units FSDP on one shard group gathers
    compute_bytes = 4 if compute_mode(setup) == "fp32" else 2
    gathered = 0  # FSDP: the root and two layers at once (the whole model without the wrap policy)
    if setup.strategy == "fsdp":
        wrapped = setup.options.layer_wrap_policy and shape.layer_params
        gathered = compute_bytes * (shape.root_params + 2 * shape.layer_params if wrapped else shape.num_params)
    return {"gathered_units": gathered, "buckets": lora_terms.bucket_bytes(shape, setup)}  # of what is trained


def estimate(shape: Shape, setup: Setup) -> dict:
    """Every term of one rank's peak, and the peak."""
    check_setup(setup)
    shape, setup = per_rank(shape, setup)  # tensor parallelism: one rank's slice, over the data-parallel ranks
    # HSDP: FSDP on one shard group of S ranks, plus the all-reduce across copies (`hybrid.py`).
    extra, setup = hybrid.all_reduce_buffer(lora_terms.trained_shape(shape, setup), setup), hybrid.as_fsdp(setup)
    states, acts, bufs = model_states(shape, setup), activations(shape, setup), buffers(shape, setup)
    at = hybrid.add_all_reduce(moments.moments(lora_terms.trained_shape(shape, setup), setup, states, acts, shape),
                               extra)
    sides = offload_split.sides(shape, setup, at) if setup.options.cpu_offload else {}  # device and host columns
    peak = sides["device"] if sides else max(sum(terms.values()) for terms in at.values())  # offload: the GPU's
    bufs["optimizer_step"] = at["step"]["optimizer step temporary"]  # AdamW's, as the step makes it
    return {**states, **bufs, "activations": acts["saved"], "activations_per_layer": acts["per_layer"],
            "weight_copies": acts["weight_copies"], "recompute": acts["recompute"], "logits": acts["logits"],
            "peak": peak, **{side: sides[side] for side in ("device", "host") if sides}}


def peak_moment(shape: Shape, setup: Setup) -> tuple[str, dict]:
    """The moment of the step where the peak falls, and what is alive then (`moments.py`)."""
    shape, setup = per_rank(shape, setup)
    extra, setup = hybrid.all_reduce_buffer(lora_terms.trained_shape(shape, setup), setup), hybrid.as_fsdp(setup)
    at = hybrid.add_all_reduce(moments.moments(lora_terms.trained_shape(shape, setup), setup,
                                               model_states(shape, setup), activations(shape, setup), shape), extra)
    name = max(at, key=lambda moment: sum(at[moment].values()))
    return name, at[name]


def largest_batch(shape: Shape, setup: Setup, gpu_memory: float, limit: int = 4096) -> int:
    """The largest batch per device whose estimated peak fits in `gpu_memory` (0: not even 1)."""
    def fits(batch: int) -> bool:
        return estimate(shape, replace(setup, batch_size_per_device=batch))["peak"] <= gpu_memory

    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_setup(setup: Setup) -> None:
    """Raise ValueError, naming the flag, for a setup no run could have."""
    setup.options.check()
    if setup.backend not in ("nccl", "gloo"):
        raise ValueError(f"the backend must be nccl or gloo, got {setup.backend!r}")
    for name in ("world_size", "batch_size_per_device", "gradient_accumulation_steps"):
        if getattr(setup, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(setup, name)}")
    if setup.max_seq_length < 2:
        raise ValueError(f"--max_seq_length must be at least 2, got {setup.max_seq_length}")
    if setup.target_length and setup.target_length < 2:
        raise ValueError(f"--target_length must be at least 2, got {setup.target_length}")
    if setup.packed and not setup.padded:
        raise ValueError("--pack and --no_padding name two kinds of batch: packed rows have a mask, unpadded ones "
                         "none; pass one of them")
