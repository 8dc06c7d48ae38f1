"""Results that take seconds to compute, kept on disk: traces of a model on fake tensors.

Tracing CodeLlama-7b's step takes a few seconds (`trace.py`) to a minute (`tracker.py`), and every
lesson notebook, test and command that estimates it would do so again in its own process. So a
result is kept as JSON under `$MINIDIST_CACHE/<kind>/` (default `~/.cache/minidist`, where
`--model tiny` lives too), named by a hash of everything that produced it: the config, the sizes,
the torch and transformers versions (a new release may save other tensors), and the source of
this package (`minidist/memory/*.py`: a changed trace must not read an old one). Another process
may compute the same result at the same time: each writes its own file, then renames it into
place, which is atomic, so a reader sees a whole file or none.
"""

import functools
import hashlib
import json
import os
from pathlib import Path

from minidist.hf.models import cache_root


@functools.cache
def _code() -> str:
    sources = sorted(Path(__file__).parent.glob("*.py"))
    return hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()


def cached(kind: str, key: dict, compute) -> dict:
    """`compute()` (a JSON-able dict), or what an earlier call with the same `key` kept."""
    import torch
    import transformers

    named = json.dumps({**key, "torch": torch.__version__, "transformers": transformers.__version__, "code": _code()},
                       sort_keys=True, default=str)
    path = cache_root() / kind / f"{hashlib.sha256(named.encode()).hexdigest()[:20]}.json"
    if path.exists():
        return json.loads(path.read_text())
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result
