"""What a model folder must hold, and what its config must say, checked before anything loads.

`from_pretrained` reads a folder in three passes (config, tokenizer, weights) and each pass fails
in its own way, late and sideways: a folder without a tokenizer blames a missing `sentencepiece`
package (transformers falls back to converting a slow tokenizer it cannot find either); one
without weights fails only after the tokenizer, the data and the process group are set up; a
config with `hidden_size: 0` divides by zero while the model is built. The commands call these
checks first, so that the learner reads one sentence naming the folder and what it lacks.
Hub names are the hub's business (`hub.py`): the checks look at local folders only.
"""

import json
import stat
from pathlib import Path

from minidist.hf import models

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, GPT-2's BPE
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Sizes every causal LM config has (GPT-2's n_embd, n_layer, ... answer to these names too).
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("intermediate_size", "num_key_value_heads", "max_position_embeddings")
# A bound on each of those sizes: the largest vocabularies (256,000) and widths (~50,000) of released
# models, and context lengths of millions, lie well below it; a typo of 10**10 does not.
MAX_SIZE = 2**24


def check_config(config, name: str) -> None:
    """ValueError when the config describes no model that can exist: a size that is not a positive
    whole number, or a width that the attention heads do not divide."""
    for size in SIZES + tuple(s for s in OPTIONAL_SIZES if getattr(config, s, None) is not None):
        value = getattr(config, size, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"the config of {name!r} says {size}: {value!r}; it must be a whole number of at least "
                             f"1: fix its config.json")
        if value > MAX_SIZE:  # 10**10 rows of an embedding would be a MemoryError deep in the model's build
            raise ValueError(f"the config of {name!r} says {size}: {value}, more than any model has (at most "
                             f"{MAX_SIZE:,} here): fix its config.json")
    heads, hidden = config.num_attention_heads, config.hidden_size
    if hidden % heads and not getattr(config, "head_dim", None):
        raise ValueError(f"the config of {name!r} has hidden_size {hidden}, which its {heads} attention heads do not "
                         f"divide: fix its config.json")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"the config of {name!r} has {heads} attention heads, which its {kv_heads} key/value heads do "
                         f"not divide: fix its config.json")


def check_folder(name_or_path: str, weights: bool = True, max_seq_length: int | None = None) -> None:
    """For a local folder (after `models.resolve`): FileNotFoundError when it lacks the tokenizer
    or (`weights`) the weights, ValueError when its config cannot be a model, or has fewer
    positions than `max_seq_length` (learned positions, as GPT-2's, end there)."""
    from transformers import AutoConfig

    folder = Path(models.resolve(name_or_path))
    if not folder.is_dir():
        return  # a hub name
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"model folder {str(folder)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                                f"copy the tokenizer's files next to config.json (`tokenizer.save_pretrained(folder)`)")
    if weights and not any((folder / f).exists() for f in WEIGHT_FILES):
        raise FileNotFoundError(f"model folder {str(folder)!r} has a config but no weights (none of "
                                f"{', '.join(WEIGHT_FILES[::2])}): point --model at a folder written by save_pretrained")
    check_config_json(folder)
    check_tokenizer_files(folder)
    if weights:
        check_weights(folder)
    from huggingface_hub.errors import StrictDataclassError  # transformers' own check of a config

    try:
        config = AutoConfig.from_pretrained(folder)
    except (StrictDataclassError, ValueError) as err:
        raise ValueError(f"the config of {str(folder)!r} cannot be a model ({reason(err)}): fix its config.json") from err
    check_config(config, str(folder))
    if getattr(config, "is_encoder_decoder", False):  # T5, BART: AutoModelForCausalLM would build half, or nothing
        raise ValueError(f"{str(folder)!r} is an encoder-decoder ({config.model_type}); minidist.finetune trains causal "
                         f"(decoder-only) language models. Its memory can be estimated: python -m minidist.memory {folder}")
    positions = getattr(config, "max_position_embeddings", None)
    if max_seq_length and positions and max_seq_length > positions:
        raise ValueError(f"--max_seq_length {max_seq_length} is longer than the {positions} positions of {str(folder)!r}: "
                         f"pass --max_seq_length {positions} or less")


def check_tokenizer_files(folder: Path) -> None:
    """ValueError when the tokenizer's JSON files are not JSON objects (tokenizers' own error names no
    file), or when `tokenizer_config.json` names custom code (`auto_map`): transformers would then ask
    "Do you wish to run the custom code? [y/N]" and read stdin, which a batch job does not have, and
    minidist never runs code from a model folder (trust_remote_code stays off)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            content = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError):
            content = None
        if not isinstance(content, dict):
            raise ValueError(f"{path} is not a JSON object (damaged, or not a tokenizer file): copy the tokenizer's "
                             f"files again (`tokenizer.save_pretrained(folder)`)")
        if name == "tokenizer_config.json" and "auto_map" in content:
            raise ValueError(f"{path} names custom code (auto_map: {', '.join(map(str, content['auto_map']))}), "
                             f"which minidist never runs: use a model whose tokenizer transformers has built in")


def check_config_json(folder: Path) -> None:
    """ValueError when the folder's config.json is not a JSON object (an edit gone wrong, a file cut
    short). transformers would say so in a traceback, and `minidist.memory` would take the folder
    for a hub name and send the learner to download it."""
    path = _regular(Path(folder) / "config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err.msg}, line {err.lineno}): fix it, or write the model again "
                         f"(save_pretrained)") from None
    except (UnicodeDecodeError, RecursionError) as err:  # not text; or nested deeper than Python's parser goes
        raise ValueError(f"{path} is not JSON ({type(err).__name__}): fix it, or write the model again") from None
    if not isinstance(config, dict):  # a ValueError, as every bad input here: the commands tell those in one line
        raise ValueError(f"{path} is JSON but not an object of settings: fix it, or write the model again")  # noqa: TRY004


def _regular(path: Path) -> Path:
    """`path`, if it is a regular file: opening a FIFO for reading waits for a writer forever."""
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        raise ValueError(f"{path} is not a regular file (a pipe, a socket or a device): write the model again")
    return path


def check_weights(folder: Path) -> None:
    """ValueError when a weights file's header is damaged: a safetensors file starts with the length of
    its JSON header and the header, which says where every tensor lies. A file cut short by a copy or
    a download, or overwritten at its start, fails there; opening reads the header alone (and maps the
    file, whose size it checks against the header), so this costs no read of the weights. A FIFO in
    its place is refused before anything opens it."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        _regular(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path} is damaged ({reason(err).removeprefix('Error while deserializing header: ')}): "
                             f"copy or download the model again") from None


def reason(err: Exception) -> str:
    """The last line of transformers' config check ("ValueError: The hidden size (30) is not a
    multiple ...")."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
