"""The fine-tuned model, written once at the end of a run: loadable by `from_pretrained`, or not there.

Checkpoints (`state.py`) hold the whole training state; this is the product, `OUTPUT_DIR/model`, a
Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads. Rank 0 writes it from the
full state dict the strategy gathered. Two things matter:

- **The dtype.** `auto` keeps the model as it was published: the `dtype` its config.json names
  (CodeLlama-7b is bf16, 13.5 GB on disk instead of 27 in fp32), read from the file, as loading
  it in fp32 overwrites the loaded config's. A config that names none gets fp32, the dtype of the
  masters it was trained in.
- **All or nothing.** Like a checkpoint, it is written to `model.tmp/` and renamed to `model`, so
  a folder named `model` is always complete. If the disk is full (or read-only) the `.tmp` is
  removed and the run stops in one line that says what is still there: the checkpoints, which a
  `--resume` finishes from (it skips the steps already done, then evaluates and writes the model).

With LoRA (`lora.py`) the product is the adapter alone, in the same dtype: `model/` then holds
`adapter_config.json` and `adapter_model.safetensors`, which `PeftModel.from_pretrained(base,
folder)` puts back on the base model, and the tokenizer.
"""

import json
import shutil
from pathlib import Path

import torch

from minidist.runtime.errors import UsageError
from minidist.checkpoint.save_errors import reason


def saved_dtype(choice: str, name_or_path: str) -> torch.dtype:
    """The dtype to write: `fp32`, `bf16`, or `auto` (the one the model's config names; see above)."""
    if choice != "auto":
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]
    from minidist.hf.models import load_config

    named = getattr(load_config(name_or_path), "dtype", None)
    named = getattr(torch, named, None) if isinstance(named, str) else named
    return named if isinstance(named, torch.dtype) else torch.float32


def write(out: Path, model, full_state: dict | None, dtype_choice: str, name_or_path: str, tokenizer,
          rates: dict) -> None:
    """On rank 0: write `out/eval.json` (the legal-move rates) and, unless `full_state` is None
    (`--no_save`), the model to `out/model`; a full disk ends the run in one line."""
    tmp, final = out / "model.tmp", out / "model"
    try:
        (out / "eval.json").write_text(json.dumps(rates))
        if full_state is None:
            return
        dtype = saved_dtype(dtype_choice, name_or_path)
        full_state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full_state.items()}
        shutil.rmtree(tmp, ignore_errors=True)  # a write that a kill cut short
        from minidist.hf import lora

        if lora.is_peft(model):
            lora.save_adapter(model, tmp, full_state, dtype)
        else:
            model.save_pretrained(tmp, state_dict=full_state)
            # save_pretrained wrote the dtype of the model in memory (the fp32 masters, or none at
            # all when FSDP holds them); from_pretrained(dtype="auto") reads this one.
            model.config.dtype = dtype
            model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)  # an earlier run's model, replaced by this one
        tmp.rename(final)
    except Exception as err:  # safetensors reports a full disk as its own error: ask save_errors.reason
        why = reason(err, out)
        if why is None:
            raise  # not the disk's fault: a bug, and a traceback
        shutil.rmtree(tmp, ignore_errors=True)  # left, it would keep the disk full
        latest = out / "latest"
        kept = (f"{latest} names {latest.read_text().strip()}: free some space and run again with --resume to write it"
                if latest.exists() else "no checkpoint was saved (--save_steps 0), so the training must run again")
        raise UsageError(f"could not write the fine-tuned model to {final}: {why}; removed "
                         f"{tmp.name}; {kept}") from err
