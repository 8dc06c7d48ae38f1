"""Shared fixtures: a tiny Llama written once per test session, loaded like any hub model."""

import pytest

from minidist.models import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer, 64-wide Llama with the chess tokenizer: small enough for many short runs."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", hidden_size=64, num_layers=2))
