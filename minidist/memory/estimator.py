"""Memory: where the bytes of a training step go, per rank, for any model, strategy and batch.

    python -m minidist.memory codellama/CodeLlama-7b-hf --world_size 4 --strategy fsdp \\
        --batch_size_per_device 1 --max_seq_length 1024 --gradient_checkpointing --gpu_memory 80GB

The model is built from its config on the meta device (shapes, no storage, no weights read), so
P counts every parameter once, a tied embedding included. Sizes are bytes; 1 GB = 1e9 bytes.
`measure.py` measures the same terms in the training loop; tests/test_memory.py holds the two
together. `report.py` prints them (the command above, in `__main__.py`).

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
layer wrap policy the one unit is the whole model. When each is alive: `moments.py`.

**Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4, redone for the Llama layer as transformers runs it): what autograd saves
for backward, per token and per layer, read off `modeling_llama.py` and checked with saved-tensor
hooks. h = hidden, I = MLP width, q = heads x head_dim, kv = key/value heads x head_dim, n = heads,
c = bytes of the compute dtype, r = bytes of the residual stream:
- each RMSNorm: its input upcast to fp32 (4h), x*rsqrt in the residual dtype (r h), rsqrt (4);
- the norm's output as read by the next linears (c h, once; under autocast each linear saves its
  own bf16 cast: 3 for q, k, v and 2 for gate, up); the weights themselves are parameters;
- attention through SDPA (flash or memory-efficient kernels save no T x T scores): q and k after
  the rotary embedding, v (c(q + 2 kv)), the output (c q), the log-sum-exp (4n); with padding SDPA
  also saves an additive mask, c T per token, and grouped key/value heads reach it repeated to
  q (`repeat_kv`; without a mask SDPA takes them as they are); cos and sin are saved once (2 T d r);
- the gated MLP: gate, silu(gate), up and their product (4 c I).
So a Llama layer saves (8 + 2r)h + (2 or, under autocast, 5)c h + c(2q + 2kv) + 4cI + 4n + 8 bytes
per token: in fp32 40h + 16I + 4n + 8, in bf16 24h + 8I + 4n + 8, autocast 34h + 8I + 4n + 8 (q = kv = h).
Outside the layers: the input ids (8), the final norm and the output layer's input (8 + r + c)h + 4,
the fp32 log-probabilities of the loss (4V per target), the targets (8). Autocast also keeps a
bf16 copy of every linear weight until backward (2 bytes per weight).

**Checkpointing** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost") keeps only each layer's input (r h per token per layer) and
recomputes one layer at a time in backward, so one layer's activations come back for a moment.

**The peak** is the most that is alive at one moment: `moments.py` walks each strategy's step
(the end of forward, backward as it reduces, the optimizer step) and `peak_moment` says where it
falls and what is alive then; the terms above are each one's own size, not all alive at once.
Not counted: the CUDA context, NCCL and the caching allocator's fragmentation; `--gpu_memory
80GB` (8e10 bytes) for an A100 that reports 85.1e9 leaves them about 5 GB.

Exact (tested) for Llama-architecture models (`model_type` llama); for others the layer term is
Korthikanti et al.'s GPT layer, 34 s b h + 5 a s^2 b bytes in 16 bits, an approximation.
"""

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from minidist.memory import moments
from minidist.parallel.options import STRATEGIES, ParallelOptions

GB = 1e9
BUNDLED = {"codellama/CodeLlama-7b-hf": Path(__file__).parent.parent / "configs" / "codellama-7b"}


@dataclass(frozen=True)
class Shape:
    """What the estimate needs to know about a model, counted on the meta device."""

    name: str
    architecture: str
    model_type: str
    num_params: int
    param_rows: tuple  # (dim 0, numel) of every parameter: FSDP2's shards are rows
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_params: int  # one decoder layer: an FSDP unit under the layer wrap policy
    root_params: int  # the rest: embeddings, final norm, output layer
    layer_linear_params: int  # weights autocast copies to bf16, per layer
    head_linear_params: int
    largest_module_params: int  # DeepSpeed's "largest layer": the biggest module's own parameters
    base_params: int  # without the output layer, as `AutoModel` builds it (what accelerate sizes)
    config_dtype_bytes: int  # the dtype the config names (`torch_dtype`), in which transformers builds it


def load_config(name_or_path: str):
    """A config from a local folder, the bundled copy of a known hub model, or the hub."""
    from transformers import AutoConfig

    path = Path(name_or_path).expanduser()
    source = path if (path / "config.json").exists() else BUNDLED.get(name_or_path, name_or_path)
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(f"could not read the config of {name_or_path!r} ({first}): pass a folder with a "
                                f"config.json, a bundled model ({', '.join(BUNDLED)}), or run where the hub is reachable")


def model_shape(name_or_path: str) -> Shape:
    """Build the model on the meta device and count what the estimate needs."""
    from transformers import AutoModelForCausalLM

    config = load_config(name_or_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())  # each tensor once: a tied embedding is one parameter
    unit_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in unit_classes]
    layer_params = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    linear = lambda m: sum(p.numel() for x in m.modules() if isinstance(x, torch.nn.Linear) for p in x.parameters())
    head = model.get_output_embeddings()
    hidden, heads = config.hidden_size, config.num_attention_heads
    return Shape(
        name=name_or_path, architecture=type(model).__name__, model_type=config.model_type,
        num_params=sum(p.numel() for p in params), param_rows=tuple((p.shape[0] if p.dim() else 1, p.numel()) for p in params),
        num_layers=config.num_hidden_layers, hidden_size=hidden,
        intermediate_size=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads, vocab_size=config.vocab_size,
        layer_params=layer_params, root_params=sum(p.numel() for p in params) - len(layers) * layer_params,
        layer_linear_params=linear(layers[0]) if layers else 0, head_linear_params=linear(head) if head else 0,
        largest_module_params=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        base_params=sum(p.numel() for p in model.base_model.parameters()), config_dtype_bytes=params[0].element_size(),
    )


@dataclass(frozen=True)
class Setup:
    """One training configuration: the run's parallel options and the sizes of a step."""

    options: ParallelOptions = ParallelOptions(mixed_precision="bf16")
    world_size: int = 1
    batch_size_per_device: int = 1
    max_seq_length: int = 512
    padded: bool = True  # right-padded batches: SDPA gets (and saves) a mask
    gradient_accumulation_steps: int = 1  # from the second micro-batch on, gradients are there in forward
    backend: str = "nccl"  # or "gloo" (CPU ranks), which copies what it reduce-scatters (moments.py)

    @property
    def strategy(self) -> str:
        return self.options.strategy


def setup(**flags) -> Setup:
    """A Setup named as `minidist.finetune`'s flags: `setup(strategy="ddp", world_size=4)`.

    The options not given are ParallelOptions' defaults, except bf16, as on the GPUs. zero1 and
    zero2 exist only by hand, so for them `impl` is minidist whatever was asked."""
    sizes = {f.name: flags.pop(f.name) for f in fields(Setup) if f.name in flags}
    options = {"mixed_precision": "bf16", **flags}
    if options.get("strategy") in ("zero1", "zero2"):
        options["impl"] = "minidist"
    return Setup(ParallelOptions(**options), **sizes)


def as_dict(setup: Setup) -> dict:
    """The setup as one flat dict of flag names (options and sizes), for reports and JSON."""
    sizes = {f.name: getattr(setup, f.name) for f in fields(setup) if f.name != "options"}
    return {**asdict(setup.options), **sizes}


def compute_mode(setup: Setup) -> str:
    """fp32; autocast (bf16 matmuls over fp32 weights: DDP); bf16 (the weights themselves are bf16)."""
    return "fp32" if setup.options.mixed_precision == "fp32" else "autocast" if setup.strategy == "ddp" else "bf16"


def shard_numel(s: Shape, setup: Setup) -> int:
    """Elements of one rank's shard: FSDP2 takes ceil(rows/N) rows of every tensor, a flat shard 1/N."""
    n = setup.world_size
    if setup.strategy == "fsdp" and setup.options.impl == "torch":
        return sum(math.ceil(rows / n) * (numel // rows) for rows, numel in s.param_rows)
    return math.ceil(s.num_params / n)


def model_states(s: Shape, setup: Setup) -> dict:
    """Parameters, gradients and optimizer states held by one rank (the first, whose shards are fullest)."""
    k, full, shard = setup.strategy, s.num_params, shard_numel(s, setup)
    zero_paper = setup.options.mixed_precision == "bf16" and k in ("zero1", "zero2")
    w, g, o = (2, 2, 12) if zero_paper else (4, 4, 8)
    return {
        "parameters": w * (shard if k == "fsdp" else full),
        "gradients": g * (shard if k in ("zero2", "fsdp") else full),
        # AdamW also keeps one fp32 step counter per parameter tensor.
        "optimizer_states": o * (full if k == "ddp" else shard) + 4 * len(s.param_rows),
    }


def layer_bytes_per_token(s: Shape, mode: str, seq: int, padded: bool) -> float:
    """Bytes one decoder layer saves for backward per token (see the module docstring)."""
    h, i, n = s.hidden_size, s.intermediate_size, s.num_heads
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    c = 4 if mode == "fp32" else 2
    r = 2 if mode == "bf16" else 4
    mask = c * seq if padded else 0
    if s.model_type != "llama":  # Korthikanti et al. eq. 1, 16-bit activations, scaled to c bytes
        return c / 2 * (34 * h + 5 * n * seq) + mask
    norms = 2 * (4 * h + r * h + 4)
    linear_inputs = (5 if mode == "autocast" else 2) * c * h
    if padded:  # with a mask, transformers repeats grouped key/value heads for SDPA (repeat_kv): q-sized
        kv = q
    attention = c * (q + 2 * kv) + c * q + 4 * n
    mlp = 4 * c * i
    return norms + linear_inputs + attention + mlp + mask


def activations(s: Shape, setup: Setup) -> dict:
    """Activation memory of one micro-batch: what forward saves, and what lives for a moment."""
    mode, b, t = compute_mode(setup), setup.batch_size_per_device, setup.max_seq_length
    c, r = (4 if mode == "fp32" else 2), (2 if mode == "bf16" else 4)
    tokens, targets = b * t, b * (t - 1)
    per_layer = layer_bytes_per_token(s, mode, t, setup.padded) * tokens
    shared = 2 * t * s.head_dim * r + (b * t * t if setup.padded else 0)  # cos and sin; the boolean mask
    head = (12 + (4 + r + c) * s.hidden_size) * tokens  # input ids; final norm; output layer's input
    loss = (4 * s.vocab_size + 8) * targets + 4  # fp32 log-probabilities, targets, the count
    layers = s.num_layers * (r * s.hidden_size * tokens if setup.options.gradient_checkpointing else per_layer)
    copies = 0
    if mode == "autocast":  # bf16 weight copies live until backward; checkpointed layers recast theirs
        copies = 2 * (s.head_linear_params + (0 if setup.options.gradient_checkpointing else s.num_layers * s.layer_linear_params))
    recompute = 0
    if setup.options.gradient_checkpointing:  # one layer's activations again, and under autocast its weight copies
        recompute = per_layer + (2 * s.layer_linear_params if mode == "autocast" else 0)
    return {"saved": layers + shared + head + loss, "per_layer": per_layer, "weight_copies": copies,
            "layer": layers // max(s.num_layers, 1),  # what one layer keeps until backward: all, or its input
            "recompute": recompute, "logits": 8 * tokens * s.vocab_size}


def buffers(s: Shape, setup: Setup) -> dict:
    """Communication buckets and FSDP's gathered units (AdamW's temporary: `moments.py`)."""
    k, mode = setup.strategy, compute_mode(setup)
    c = 4 if mode == "fp32" else 2
    gathered = 0  # FSDP: the root and two layers at once (the whole model without the wrap policy)
    if k == "fsdp":
        wrapped = setup.options.layer_wrap_policy and s.layer_params
        gathered = c * (s.root_params + 2 * s.layer_params if wrapped else s.num_params)
    # DDP's buckets hold a copy of every fp32 gradient (`--ddp_variant naive` has none).
    naive = setup.options.impl == "minidist" and setup.options.value("ddp_variant") == "naive"
    buckets = {"ddp": 0 if naive else 4 * s.num_params}.get(k, 0)
    if k in ("zero1", "zero2"):  # the largest flat gradient bucket (fp32), one at a time or two
        largest = max(moments.buckets([numel for _, numel in s.param_rows], int(setup.options.value("bucket_cap_mb") * 2**20)))
        buckets = 4 * largest * (2 if k == "zero2" else 1)
    return {"gathered_units": gathered, "buckets": buckets}


def estimate(s: Shape, setup: Setup) -> dict:
    """Every term of one rank's peak, and the peak."""
    check_setup(setup)
    states, acts, bufs = model_states(s, setup), activations(s, setup), buffers(s, setup)
    at = moments.moments(s, setup, states, acts)
    peak = max(sum(terms.values()) for terms in at.values())
    bufs["optimizer_step"] = at["step"]["optimizer step temporary"]  # AdamW's, as the step makes it
    return {**states, **bufs, "activations": acts["saved"], "activations_per_layer": acts["per_layer"],
            "weight_copies": acts["weight_copies"], "recompute": acts["recompute"], "logits": acts["logits"],
            "peak": peak}


def peak_moment(s: Shape, setup: Setup) -> tuple[str, dict]:
    """The moment of the step where the peak falls, and what is alive then (`moments.py`)."""
    at = moments.moments(s, setup, model_states(s, setup), activations(s, setup))
    name = max(at, key=lambda m: sum(at[m].values()))
    return name, at[name]


def largest_batch(s: Shape, setup: Setup, gpu_memory: float, limit: int = 4096) -> int:
    """The largest batch per device whose estimated peak fits in `gpu_memory` (0: not even 1)."""
    fits = lambda b: estimate(s, replace(setup, batch_size_per_device=b))["peak"] <= gpu_memory
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
