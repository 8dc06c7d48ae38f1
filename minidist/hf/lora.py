"""LoRA: fine-tune a few low-rank matrices and freeze the rest (`--lora_rank R`).

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (ICLR 2022), section 4:
keep a pretrained weight W (d_out x d_in) frozen and learn its change as a product of two thin
matrices, W + (alpha / r) B A, with A (r x d_in) and B (d_out x r). A starts random (Kaiming
uniform, as `nn.Linear` does) and B at zero, so training starts from the pretrained model exactly.
The `peft` library does the surgery: `get_peft_model(model, LoraConfig(...))` puts a
`lora_A`/`lora_B` pair beside every target linear layer (`q_proj`, ...) and sets
`requires_grad=False` on every other parameter. This module reads the flags into its own options
(`LoraOptions`), checks them, builds that config from them, and counts what LoRA costs.

**What it saves: memory.** A full fine-tune with mixed-precision AdamW holds 16 bytes per
parameter (`memory/estimator.py`). With LoRA only the P_lora adapter parameters are trained: they
alone have gradients, fp32 masters and Adam moments, and the P frozen base parameters are only
computed with. So about 2P (a bf16 base) + 16 P_lora; for CodeLlama-7b at rank 16 on q, k, v, o:
2 x 6.74e9 + 16 x 16.8e6 = 13.5 + 0.27 GB instead of 108 GB (`memory/lora_terms.py` counts
P_lora exactly and puts it in the estimate). Gradients and activations still flow through the
frozen layers: backward needs the frozen weights to pass the gradient down.

**Under every strategy.** Frozen parameters are never reduced and never stepped: PyTorch's DDP
and FSDP2 skip them, the hand-written DDP and ZeRO put only trainable parameters in their buckets
(`ddp.py`, `zero.py`), and the hand-written FSDP shards the frozen base in a second flat per unit,
gathered but never reduce-scattered (`parallel/frozen.py`). Sharded checkpoints then hold the
adapter and its Adam moments (plus the frozen weights where the checkpoint is PyTorch's
`get_state_dict`: both DDPs and FSDP2). A full checkpoint's `model` folder is the adapter alone, as
peft saves it; its resume puts it beside the live frozen base (`with_saved_adapter`).

**The same adapter on every rank.** Ranks are seeded differently (`finetune.py`), and A is random:
`apply` draws it under the run's `--seed` alone, in a forked RNG, so every rank (and a
single-process reference) starts from the same adapter, without consuming the rank's own RNG.
Under FSDP by hand the ranks > 0 hold a meta-device model: their adapter has shapes only, and
rank 0's is scattered to them with the rest of each unit.

**The product** is the adapter alone, `adapter_model.safetensors` and `adapter_config.json`, a few
MB instead of 13.5 GB: `PeftModel.from_pretrained(base, folder)` loads it onto the base model
(`save_adapter`).
"""

import argparse
import math
from dataclasses import dataclass, fields

import torch
from torch import nn

# Llama's attention projections, as in the paper's section 7.1 (it adapts W_q and W_v; q, k, v, o is
# the common choice since). "all-linear" is peft's name for every linear layer except the output one.
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora_rank", type=int, default=None, metavar="R",
                        help="fine-tune rank-R LoRA adapters (peft) and freeze the model (default: full fine-tune)")
    parser.add_argument("--lora_alpha", type=float, default=None,
                        help="LoRA's scale is alpha / R (default: alpha = 2 R)")
    parser.add_argument("--lora_target_modules", default=None,
                        help=f"comma-separated linear layer names, or all-linear (default: {DEFAULT_TARGETS})")
    parser.add_argument("--lora_dropout", type=float, default=None, help="dropout on the adapters' input (default 0)")


@dataclass(frozen=True)
class LoraOptions:
    """LoRA's flags, as given (`add_arguments`): `rank` None is a full fine-tune. The loop builds
    them once from its flags (`from_args`), the memory command from its own; nothing here reads
    an argparse Namespace after that."""

    rank: int | None = None
    alpha: float | None = None  # None: 2 x rank
    target_modules: str | None = None  # comma-separated, or "all-linear"; None: DEFAULT_TARGETS
    dropout: float | None = None  # None: 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoraOptions":
        """The options from parsed flags; a parser without a flag (the memory command has no
        --lora_alpha) leaves it at its default."""
        return cls(**{f.name: getattr(args, f"lora_{f.name}", None) for f in fields(cls)})


def enabled(options: LoraOptions) -> bool:
    return options.rank is not None


def check(options: LoraOptions, name_or_path: str | None = None) -> None:
    """Raise ValueError, in one line naming the flag, for LoRA flags that cannot run (with the
    model's folder: also a target module it does not have, seen on its meta-device build)."""
    if not enabled(options):
        for name in ("alpha", "target_modules", "dropout"):
            if getattr(options, name) is not None:
                raise ValueError(f"--lora_{name} needs --lora_rank (without it the whole model is fine-tuned)")
        return
    if options.rank < 1:
        raise ValueError(f"--lora_rank must be at least 1, got {options.rank} (leave it out for a full fine-tune)")
    if options.alpha is not None and not (options.alpha > 0 and math.isfinite(options.alpha)):
        # peft takes any number; an infinite scale times the zero-initialised B is nan in the first forward
        raise ValueError(f"--lora_alpha must be more than 0 and finite, got {options.alpha}; leave it out "
                         f"(alpha = 2 x --lora_rank: {2 * options.rank} here) or pass a positive number")
    if options.dropout is not None and not 0 <= options.dropout < 1:
        raise ValueError(f"--lora_dropout must be in [0, 1), got {options.dropout}")
    if not targets(options):
        raise ValueError("--lora_target_modules names no module")
    if name_or_path is not None:
        from transformers import AutoModelForCausalLM

        from minidist.hf.models import load_config

        with torch.device("meta"):
            check_targets(AutoModelForCausalLM.from_config(load_config(name_or_path)), options)


def fingerprint(options: LoraOptions) -> str:
    """What a checkpoint must share with a run that resumes it (`state.verify`): "" without LoRA."""
    if not enabled(options):
        return ""
    modules = targets(options)
    return (f" + LoRA r={options.rank} alpha={options.alpha or 2 * options.rank} on "
            f"{modules if isinstance(modules, str) else ','.join(modules)}")


def targets(options: LoraOptions) -> list[str] | str:
    given = options.target_modules or DEFAULT_TARGETS
    if given.strip() == "all-linear":
        return "all-linear"
    return [name.strip() for name in given.split(",") if name.strip()]


def config(options: LoraOptions):
    """peft's `LoraConfig` for these options."""
    from peft import LoraConfig

    rank = options.rank
    return LoraConfig(r=rank, lora_alpha=options.alpha or 2 * rank, lora_dropout=options.dropout or 0.0,
                      target_modules=targets(options), bias="none", task_type="CAUSAL_LM")


def check_targets(model: nn.Module, options: LoraOptions) -> None:
    """Raise ValueError naming a target module the model does not have (peft would raise a long one)."""
    wanted = targets(options)
    if wanted == "all-linear":
        return
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    missing = [name for name in wanted if name not in names]
    if missing:
        raise ValueError(f"--lora_target_modules: {type(model).__name__} has no linear layer named "
                         f"{', '.join(missing)} (it has {', '.join(sorted(names))})")


def apply(model: nn.Module, options: LoraOptions, seed: int) -> nn.Module:
    """The model with LoRA adapters (a `PeftModel`): base frozen, adapters trainable, A drawn under `seed`."""
    from peft import get_peft_model

    check_targets(model, options)
    with torch.random.fork_rng(devices=[]):  # the rank's own RNG is left as it was
        torch.manual_seed(seed)
        return get_peft_model(model, config(options))


def describe(model: nn.Module) -> str:
    """One line: how many parameters LoRA trains, of how many."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (f"LoRA r={model.peft_config['default'].r}: training {trained:,} of {total:,} parameters "
            f"({trained / total:.2%}); the rest is frozen")


def is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def save_adapter(model: nn.Module, folder, state_dict: dict, dtype: torch.dtype) -> None:
    """Write the adapter (peft's `save_pretrained`: its weights and adapter_config.json) from the
    gathered `state_dict`, whose frozen entries peft leaves out, in `dtype`."""
    adapter = {k: v.to(dtype) for k, v in state_dict.items() if "lora_" in k}
    model.save_pretrained(folder, state_dict=adapter)


def with_saved_adapter(live: dict, folder) -> dict:
    """A full checkpoint's model state under LoRA (`state.py`, `--checkpoint_format full`): the
    saved adapter (`folder/adapter_model.safetensors`, fp32, written by `save_pretrained`) in place
    of the live adapter entries of `live`, the whole model by its live names; the frozen entries
    stay the live ones, which the run read from the model folder as the first run did (they never
    change). peft saves a key without its adapter name (`...q_proj.lora_A.weight` for the live
    `...q_proj.lora_A.default.weight`); the live names are mapped by peft's own (private) function."""
    from peft.tuners.tuners_utils import _remove_adapter_name_from_state_dict_key as saved_key
    from safetensors.torch import load_file

    saved = load_file(str(folder / "adapter_model.safetensors"))
    out = dict(live)
    for name in live:
        if "lora_" in name:
            out[name] = saved.pop(saved_key(name, "default"))
    if saved:
        raise ValueError(f"{folder} holds adapter weights this model does not have: {', '.join(sorted(saved))}")
    return out
