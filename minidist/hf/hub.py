"""The model hub, asked from a machine that may not reach it: is a name cached, is the hub there?

A compute node usually has no internet. Given a hub name it has not cached, `from_pretrained`
retries the connection five times with back-off, about 25 seconds, before it says so; and even a
cached name is looked up online first. So before loading a hub name we ask two questions that
take well under a second: does the local cache (`$HF_HOME`) hold the repository, and does the
hub answer a TCP connection (not asked when `HF_HUB_OFFLINE=1` says the answer)? A name that is
neither cached nor reachable fails at once, in one line; a cached name on a machine without the
hub loads from the cache alone.
"""

import functools
import socket
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 3.0  # a hub that does not answer in this time will not serve 13 GB either


@functools.cache
def reachable() -> bool:
    """Whether the hub (`HF_ENDPOINT`, default huggingface.co) accepts a connection; False when offline."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:  # no route, no DNS, refused, timed out: all mean "not from here"
        return False


def is_cached(repo_id: str) -> bool:
    """Whether the local cache holds the repository's config.json (what every load reads first)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # a name the hub could never hold (HFValidationError): not cached
        return False


def local_files_only(repo_id: str) -> bool:
    """For a hub name about to be loaded: True to read the cache alone (the hub is out of reach),
    False to ask the hub; FileNotFoundError at once when it is neither cached nor reachable."""
    if reachable():
        return False
    if is_cached(repo_id):
        return True
    raise FileNotFoundError(
        f"could not load {repo_id!r}: it is not in the hub cache and the hub cannot be reached from here; "
        f"cache it first with `python -m minidist.hf.models download {repo_id}` where there is internet, "
        f"or pass a local folder")
