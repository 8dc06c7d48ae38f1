"""LoRA's model states: a frozen base that is only held, and adapters that are trained.

`estimator.py` counts 16 bytes per parameter for a full fine-tune with AdamW. With LoRA
(`minidist/hf/lora.py`; Hu et al. 2021, section 4.2 "practical benefits": GPT-3 175B's training
memory fell from 1.2 TB to 350 GB) only the P_lora adapter parameters have gradients, fp32 masters
and Adam moments; the P frozen base parameters are held in the dtype each strategy keeps its
weights in, and nothing else. Per rank, N ranks, bf16 (`--mixed_precision bf16`):

    strategy            base (frozen)   adapters: weights + gradients + optimizer (m, v; fp32 masters)
    DDP (autocast)      4P              4L + 4L + 8L      the weights stay fp32 masters (autocast)
    ZeRO-1              2P              2L + 2L + 12L/N   frozen cast to bf16 (`zero.py`)
    ZeRO-2              2P              2L + 2L/N + 12L/N
    FSDP by hand        2P/N            4L/N + 4L/N + 8L/N   frozen flats in bf16 (`parallel/frozen.py`)
    FSDP2 (torch)       4P/N            4L/N + 4L/N + 8L/N   FSDP2 keeps every shard in fp32

so "about 2P + 16 P_lora" is ZeRO's line (and a single GPU's with a bf16 base); FSDP divides even
the base by N. In fp32 every weight is 4 bytes. CodeLlama-7b, rank 16 on q, k, v, o: L = 16.8M
(0.25% of P), 16 L = 0.27 GB, against 16 P = 108 GB for a full fine-tune. `lora_params` counts L
exactly from the config on the meta device, as peft would place the adapters.

Activations are traced on the model with its adapters (`trace.py`, `adapt`): LoRA's own saved
tensors (the r-wide output of each `lora_A`; with dropout its mask and the dropped input) are in,
and the inputs of frozen linear layers, which a full fine-tune saves for their weights' gradients,
are out (tests/parallel/test_lora.py holds it to a real peft forward, byte for byte). The peak's walk
(`moments.py`) gets the adapters as the trained shape (`trained_shape`): gradients, reductions and
the step are theirs; FSDP's gathers are of whole units, frozen and trainable flats together.
"""

import functools
import math

from minidist.memory import moments


@functools.lru_cache(maxsize=32)
def _lora_counts(config_json: str, config_class, rank: int, targets: str | None) -> tuple:
    """Of the adapter tensors peft would add (A is (r, d_in), B (d_out, r)): (dim 0, numel) of each;
    the adapters' parameters in each decoder layer (an FSDP unit), in order; and in the output layer."""
    import json

    import torch

    from minidist.hf import lora
    from minidist.memory import trace

    options = lora.LoraOptions(rank=rank, target_modules=targets)
    with torch.device("meta"):
        model = trace.model_class(config_class).from_config(config_class.from_dict(json.loads(config_json)))
    lora.check_targets(model, options)
    model = lora.apply(model, options, seed=0)  # meta: nothing is drawn
    base = model.get_base_model()  # peft put the adapters inside it, in place

    def trained(module) -> int:
        return sum(p.numel() for p in module.parameters() if p.requires_grad) if module is not None else 0

    return (tuple((p.shape[0], p.numel()) for p in model.parameters() if p.requires_grad),
            tuple(trained(layer) for layer in trace.decoder_layers(base)), trained(base.get_output_embeddings()))


def _counts(s, setup) -> tuple:
    if s.config is None:
        raise ValueError(f"the shape of {s.name!r} carries no config: build it with model_shape")
    return _lora_counts(s.config.to_json_string(use_diff=False), type(s.config), setup.lora_rank,
                        setup.lora_target_modules)


def lora_rows(s, setup) -> tuple:
    return _counts(s, setup)[0]


def lora_params(s, setup) -> int:
    """P_lora: the adapters' parameters for this setup's rank and target modules."""
    return sum(numel for _, numel in lora_rows(s, setup))


def trained_rows(s, setup) -> tuple:
    """(dim 0, numel) of every trained tensor: the adapters with LoRA, else every parameter."""
    return lora_rows(s, setup) if setup.lora_rank else s.param_rows


def trained_shape(s, setup):
    """The shape of what is trained, which `moments.py` walks a step with: under LoRA the adapters
    alone (their gradients are what backward makes, buckets, reduces and steps; the frozen weights
    are in the model states already), with FSDP's units counted in their adapters' parameters (a
    decoder layer's, the root's, the output layer's). FSDP's walk gathers the whole model's units
    (`moments.py`: `whole`), frozen part included, and reduces the trained ones."""
    if not setup.lora_rank:
        return s
    from dataclasses import replace

    rows, layers, head = _counts(s, setup)
    total = sum(numel for _, numel in rows)
    return replace(s, num_params=total, param_rows=rows, tied_params=0, layer_params=max(layers, default=0),
                   layer_param_counts=layers, root_params=total - sum(layers), head_linear_params=head)


def bucket_bytes(s, setup) -> int:
    """The gradient buckets of what is trained (every parameter, or LoRA's adapters): DDP's hold a
    copy of every fp32 gradient (`--ddp_variant naive` has none); ZeRO's largest flat gradient
    bucket (fp32), one at a time (ZeRO-1) or two (ZeRO-2, one filling, one on the wire)."""
    k, o = setup.strategy, setup.options
    trained = [numel for _, numel in trained_rows(s, setup)]
    if k == "ddp":
        return 0 if o.impl == "minidist" and o.value("ddp_variant") == "naive" else 4 * sum(trained)
    if k in ("zero1", "zero2"):
        return 4 * max(moments.buckets(trained, int(o.value("bucket_cap_mb") * 2**20))) * (2 if k == "zero2" else 1)
    return 0


def model_states(s, setup) -> dict:
    """Parameters (base and adapters), gradients and optimizer states of one rank under LoRA."""
    k, n, impl = setup.strategy, setup.world_size, setup.options.impl
    bf16 = setup.options.mixed_precision == "bf16"
    rows = lora_rows(s, setup)
    lora = sum(numel for _, numel in rows)
    if k == "fsdp" and impl == "torch":  # FSDP2 shards every tensor by rows, in fp32
        def shard(param_rows):  # this rank's elements: ceil(rows / N) rows of every tensor
            return sum(math.ceil(dim0 / n) * (numel // dim0) for dim0, numel in param_rows)
        base, trained = 4 * shard(s.param_rows), shard(rows)
        return {"parameters": base + 4 * trained, "gradients": 4 * trained,
                "optimizer_states": 8 * trained + 4 * len(rows)}
    if k == "fsdp":  # flat shards per unit (`parallel/frozen.py`): frozen in the compute dtype
        base, trained = (2 if bf16 else 4) * math.ceil(s.num_params / n), math.ceil(lora / n)
        return {"parameters": base + 4 * trained, "gradients": 4 * trained,
                "optimizer_states": 8 * trained + 4 * len(rows)}
    if k == "ddp":  # autocast: fp32 weights, the frozen ones too
        return {"parameters": 4 * (s.num_params + lora), "gradients": 4 * lora,
                "optimizer_states": 8 * lora + 4 * len(rows)}
    # ZeRO-1/2: the model in the compute dtype; fp32 masters and moments of the flat buckets' shards
    w = 2 if bf16 else 4
    cap = int(setup.options.value("bucket_cap_mb") * 2**20)
    buckets = moments.buckets([numel for _, numel in rows], cap)
    shard = sum(math.ceil(b / n) for b in buckets)
    padded = sum(math.ceil(b / n) * n for b in buckets)
    master = 4 * shard if bf16 else 0  # in fp32 the master is a view of the model's own flat
    return {"parameters": w * (s.num_params + padded),  # the adapters are views of padded flat buffers
            "gradients": w * (padded if k == "zero1" else shard),
            "optimizer_states": master + 8 * shard + 4 * len(buckets)}


def trace_key(setup) -> tuple:
    """What LoRA changes in the traced activations (`estimator.traced`): () without it."""
    return (setup.lora_rank, setup.lora_target_modules, setup.lora_dropout) if setup.lora_rank else ()


def adapt(key: tuple, mode: str):
    """`trace.trace`'s `adapt` for a `trace_key`: the model with its adapters, as the loop computes
    with it, so that the trace sees what LoRA changes. The adapters save the r-wide output of each
    `lora_A` (for `lora_B`'s gradient) and, with dropout, its mask and the dropped input (for
    `lora_A`'s); and a frozen linear layer saves no input, as its weight wants no gradient. The
    adapters are made in the compute dtype (bf16 in bf16, as every strategy casts them; peft would
    upcast them to fp32, and cast each input to fp32 for them), on the model's device: so peft's
    moves to the base layer's device and dtype (`Module.to`) change nothing and are left out, on
    fake tensors as on real ones (`Module._apply` would swap a fake parameter, which it refuses)."""
    from unittest import mock

    import torch
    from peft import get_peft_model

    from minidist.hf import lora

    rank, targets, dropout = key
    options = lora.LoraOptions(rank=rank, target_modules=targets, dropout=dropout)

    def with_adapters(model):
        lora.check_targets(model, options)
        default = torch.get_default_dtype()
        with mock.patch.object(torch.nn.Module, "to", lambda self, *a, **k: self):
            torch.set_default_dtype(torch.bfloat16 if mode == "bf16" else torch.float32)
            try:
                return get_peft_model(model, lora.config(options), autocast_adapter_dtype=False)
            finally:
                torch.set_default_dtype(default)
    return with_adapters
