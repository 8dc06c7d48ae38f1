"""Models: load any causal language model, or build the tiny offline Llama.

Everything here goes through the same door a 7B model does: `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained`, given a hub name (`codellama/CodeLlama-7b-hf`) or a local
folder. The only difference between the laptop and the cluster is which folder that is.

Machines without the model hub (a laptop on a train, CI, a compute node) still need a model to
train. So `write_tiny_llama` writes one to a folder: the same `LlamaDecoderLayer` architecture as
CodeLlama-7b, random weights, a few million parameters, and a real `PreTrainedTokenizerFast`
whose vocabulary is chess itself: one token per UCI move (`e2e4`, `e7e8q`), one per result. A
move is then exactly one token, which makes the small model learn fast and keeps the
legal-move evaluation honest (with CodeLlama a move is several sub-word tokens; the evaluation
decodes text, so it works for both).

    python -m minidist.hf.models tiny --out tiny-llama                 # write the tiny model
    python -m minidist.hf.models download codellama/CodeLlama-7b-hf    # cache for offline nodes
"""

import os
import pickle
import shutil
from pathlib import Path

import torch

from minidist.hf import hub
from minidist.runtime.errors import ArgumentParser, UsageError, fail

TINY = "tiny"  # `--model tiny` means: the tiny Llama, written on first use to the cache below
RESULTS = ("1-0", "0-1", "1/2-1/2")
SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def cache_root() -> Path:
    """minidist's own cache, made here, never downloaded: $MINIDIST_CACHE or ~/.cache/minidist.
    `--model tiny` lives in it, and the memory estimator's traces (`memory/cache.py`)."""
    return Path(os.environ.get("MINIDIST_CACHE", Path.home() / ".cache" / "minidist"))


def tiny_model_dir() -> Path:
    """Where `--model tiny` lives."""
    return cache_root() / "tiny-llama"


def uci_vocabulary() -> list[str]:
    """Every move a UCI string can name: 1,792 queen-or-knight moves plus 176 promotions.

    A move is `from` square + `to` square (+ promotion piece). Any piece's move is along a queen
    line or a knight jump, so those two shapes cover them all; promotions are a pawn step or
    capture onto the last rank, four pieces each.
    """
    files, ranks = "abcdefgh", "12345678"
    moves = []
    for f0 in range(8):
        for r0 in range(8):
            for f1 in range(8):
                for r1 in range(8):
                    df, dr = abs(f1 - f0), abs(r1 - r0)
                    queen_line = (df == 0) != (dr == 0) or (df == dr != 0)
                    knight_jump = {df, dr} == {1, 2}
                    if queen_line or knight_jump:
                        moves.append(files[f0] + ranks[r0] + files[f1] + ranks[r1])
    for r0, r1 in (("7", "8"), ("2", "1")):  # white promotes on rank 8, black on rank 1
        for f0 in range(8):
            for f1 in (f0 - 1, f0, f0 + 1):
                if 0 <= f1 < 8:
                    moves += [files[f0] + r0 + files[f1] + r1 + p for p in "qrbn"]
    return moves


def build_chess_tokenizer():
    """A real fast tokenizer (the `tokenizers` library) for chess text: one token per word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    vocab = {tok: i for i, tok in enumerate(specials + uci_vocabulary() + list(RESULTS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, as they were written
    # Like Llama's tokenizer: prepend <s> to every text; the data pipeline appends </s> itself.
    bos = SPECIAL_TOKENS["bos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, vocab[bos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **{f"{k}_token": v for k, v in SPECIAL_TOKENS.items()},
        model_max_length=1024,
    )


def tiny_llama_config(*, hidden_size=256, num_layers=4, num_heads=4, tie_word_embeddings=False):
    """The configuration of a small Llama over the chess vocabulary (no weights yet)."""
    from transformers import LlamaConfig

    tokenizer = build_chess_tokenizer()
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 8 * 8,  # Llama's 8/3 ratio, rounded to 8
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )


def write_tiny_llama(out_dir, *, hidden_size=256, num_layers=4, num_heads=4, seed=0, tie_word_embeddings=False) -> Path:
    """Write a randomly initialised Llama and its chess tokenizer to `out_dir`; return the path.

    The defaults give 4.15M parameters: 4 decoder layers of 0.78M each, plus an input embedding
    and an (untied, as in CodeLlama) output layer of 0.51M each over 1,975 tokens.
    The same seed writes the same weights, so every test and rank starts from one model.
    `tie_word_embeddings=True` shares one matrix between the embedding and the output layer, as
    GPT-2 and many small models do: strategies must then reduce that gradient once, not twice.
    """
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                               tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    return _write(LlamaForCausalLM(config), build_chess_tokenizer(), out_dir)


def _write(model, tokenizer, out_dir) -> Path:
    """The folder `from_pretrained` reads: config.json, model.safetensors, the tokenizer's files.

    Not `model.save_pretrained`: under torch.distributed, transformers writes the weights on rank 0
    only, and every rank may be the one that writes the tiny model first (see `resolve`)."""
    from safetensors.torch import save_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})  # a tied weight once
    tokenizer.save_pretrained(out)
    return out


def write_tiny_gpt2(out_dir, *, hidden_size=64, num_layers=2, num_heads=2, seed=0, n_positions=1024) -> Path:
    """A tiny GPT-2 over the same chess tokenizer: another architecture (`GPT2Block`, learned
    positions, LayerNorm, biases, fused qkv `Conv1D`, output layer tied to the embedding), so
    that strategies and their wrap policy are shown not to depend on Llama. Its learned positions
    end at `n_positions`: a short one shows what code must do at the end of a model's context."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_chess_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
                        n_positions=n_positions, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return _write(GPT2LMHeadModel(config), tokenizer, out_dir)


def resolve(name_or_path: str) -> str:
    """Turn `tiny` into its folder (writing it once), check local folders exist, pass hub names on.

    A name that looks like a path (it exists, starts with . / or ~, or has more slashes than a
    hub id's `org/name`) must be a folder with a config.json, or we say so now rather than let
    the hub client guess. Anything else (`gpt2`, `codellama/CodeLlama-7b-hf`) goes to the hub.
    """
    if name_or_path == TINY:
        folder = tiny_model_dir()
        if not (folder / "config.json").exists():
            # Several ranks may get here at once: each writes a private copy and renames it into
            # place; the first rename wins and the others drop theirs. Nobody reads a half model.
            tmp = write_tiny_llama(folder.with_name(f"{folder.name}.tmp{os.getpid()}"))
            try:
                tmp.rename(folder)
            except OSError:
                shutil.rmtree(tmp)
        return str(folder)
    path = Path(name_or_path)
    looks_local = not is_hub_name(name_or_path)
    if looks_local and not (path.expanduser() / "config.json").exists():
        raise FileNotFoundError(
            f"model folder {name_or_path!r} not found (or has no config.json): pass a hub name "
            f"such as codellama/CodeLlama-7b-hf, `tiny`, or a folder written by "
            f"`python -m minidist.hf.models tiny --out DIR`"
        )
    return str(path.expanduser()) if looks_local else name_or_path


def is_hub_name(name_or_path: str) -> bool:
    """Whether a name goes to the hub: not a path here, not starting with . / or ~, at most `org/name`."""
    if Path(name_or_path).exists() or name_or_path.startswith((".", "/", "~")):
        return False
    return name_or_path.count("/") <= 1


def _from_pretrained(auto_class, name_or_path: str, **kwargs):
    """`auto_class.from_pretrained`, with one sentence instead of a page when the hub is out of reach."""
    source = resolve(name_or_path)
    if is_hub_name(source):  # a hub name: from the cache alone, or at once not at all, without the hub
        kwargs["local_files_only"] = hub.local_files_only(source)
    try:
        return auto_class.from_pretrained(source, **kwargs)
    except pickle.UnpicklingError as err:  # weights_only's refusal: its advice (weights_only=False) would run it
        named = [line.strip() for line in str(err).splitlines() if "GLOBAL" in line]
        raise UsageError(f"the weights of {name_or_path!r} are not plain data: {named[0] if named else 'a pickled object'}"
                         f"; nothing in them was run; use weights you trust, as safetensors") from None
    except OSError as err:
        first_line = str(err).strip().splitlines()[0]
        raise FileNotFoundError(
            f"could not load {name_or_path!r} ({first_line}): on a node without internet, cache it first "
            f"with `python -m minidist.hf.models download {name_or_path}` where there is internet"
        ) from err


def load_config(name_or_path: str):
    """The model's config (`AutoConfig`), through the same door: a cached hub name is read from the
    cache alone when the hub is out of reach, instead of after ~25 s of retries."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, name_or_path)


def load_tokenizer(name_or_path: str):
    """Load a tokenizer; give it a pad token if it has none (Llama's has none: reuse unk or eos)."""
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(AutoTokenizer, name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    return tokenizer


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device="cpu"):
    """Load a causal LM in `dtype` onto `device`. fp32 by default: the master weights of training."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype=dtype)
    return model.to(device)


def build_on_meta(name_or_path: str, dtype: torch.dtype = torch.float32):
    """The model without its weights: every parameter and buffer on the meta device (a shape and
    a dtype, no memory), built from its config.json alone; no weights file is opened. FSDP's ranks
    other than 0 start from this and receive their shards from rank 0 (`strategy/data.py`)."""
    from transformers import AutoModelForCausalLM

    config = load_config(name_or_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def download(repo_id: str) -> Path:
    """Cache a hub model (weights, config, tokenizer) under $HF_HOME for offline compute nodes.

    Run this on a login node with internet; jobs then set HF_HUB_OFFLINE=1 and load by name.
    """
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.txt"]
    return Path(snapshot_download(repo_id, allow_patterns=patterns))


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m minidist.hf.models", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="write the tiny Llama and its chess tokenizer to a folder")
    tiny.add_argument("--out", default=str(tiny_model_dir()))
    tiny.add_argument("--hidden_size", type=int, default=256)
    tiny.add_argument("--num_layers", type=int, default=4)
    tiny.add_argument("--seed", type=int, default=0)
    dl = sub.add_parser("download", help="cache a hub model for offline use (needs internet)")
    dl.add_argument("repo_id")
    args = parser.parse_args(argv)
    if args.command == "tiny":
        if args.num_layers < 1:
            parser.error("--num_layers must be at least 1")
        if args.hidden_size < 4 or args.hidden_size % 4:  # write_tiny_llama's 4 heads share the width
            parser.error(f"--hidden_size must be a positive multiple of 4 (the tiny Llama's 4 heads), got {args.hidden_size}")
        try:
            out = write_tiny_llama(args.out, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed)
        except OSError as err:  # --out names a file, or a folder we may not write
            fail("minidist.hf.models", f"cannot write the model to {args.out} ({err.strerror}): name another folder")
        model = load_model(str(out))
        print(f"wrote {out}: {type(model).__name__}, {num_parameters(model) / 1e6:.2f}M parameters")
        return
    if not hub.reachable():  # at once, not after the hub client's 25 s of retries
        fail("minidist.hf.models", f"could not download {args.repo_id}: the hub cannot be reached from here (or "
                                f"HF_HUB_OFFLINE is set): run this where there is internet")
    try:
        print(f"cached {args.repo_id} in {download(args.repo_id)}")
    except Exception as err:  # no such repo, gated model without a token
        fail("minidist.hf.models", f"could not download {args.repo_id}: {err}")


if __name__ == "__main__":
    main()
