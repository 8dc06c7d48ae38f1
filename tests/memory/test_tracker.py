"""PyTorch's MemTracker on one step under fake tensors (`minidist/memory/tracker.py`), beside the estimate.

Tiny Llama configs (no weights: the tracer builds the model from the config), a few seconds each.
What must agree with `estimator.estimate` to the byte are the model states: MemTracker's
"Parameter", "Gradient" and "Optstate" (which holds AdamW's multi-tensor temporary too, made
inside `optimizer.step()`). The whole peak is compared where it falls in the optimizer step
(exact but for the rotary buffer and the token positions) and where it falls in backward (within the 5% the
estimate keeps to a measured step in tests/memory/test_memory.py).
"""

import pytest
import torch
from transformers import LlamaConfig, T5Config

from minidist.memory import __main__ as memory_command
from minidist.memory import estimator, report, tracker

# The full suite only: whole steps under PyTorch's MemTracker.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 4-layer, 128-wide Llama (1M parameters) with grouped key/value heads over a 128-token
    vocabulary: its layers outweigh the root unit and a short batch's activations, so at batch 1
    the peak is AdamW's step, as for CodeLlama-7b."""
    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=256).save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test traces afresh, into a cache folder of its own."""
    monkeypatch.setenv("MINIDIST_CACHE", str(tmp_path))
    tracker._cached.cache_clear()


def test_ddp_step_is_the_estimate_without_ddps_buckets(llama):
    setup = estimator.setup(strategy="ddp", impl="torch", batch_size_per_device=1, max_seq_length=16)
    estimate = estimator.estimate(estimator.model_shape(llama), setup)
    assert estimator.peak_moment(estimator.model_shape(llama), setup)[0] == "step"
    traced = tracker.peak(llama, setup)
    assert traced["Parameter"] == estimate["parameters"]
    assert traced["Gradient"] == estimate["gradients"]
    assert traced["Optstate"] == estimate["optimizer_states"] + estimate["optimizer_step"]
    # A plain step has no DDP buckets (PyTorch's DDP makes them in C++, outside the tracker);
    # what is left over is the rotary embedding's buffer and the token positions, under 2 kB.
    assert 0 <= traced["peak"] - (estimate["peak"] - estimate["buckets"]) < 2048


def test_fsdp2_on_a_fake_process_group_matches_the_estimate(llama):
    """FSDP2 (`TorchFSDP.wrap`) on 2 fake ranks with checkpointing: the peak is AdamW's step on
    the shards, which the estimate counts to the byte."""
    setup = estimator.setup(strategy="fsdp", impl="torch", world_size=2, batch_size_per_device=1,
                            max_seq_length=16, gradient_checkpointing=True)
    shape = estimator.model_shape(llama)
    estimate = estimator.estimate(shape, setup)
    assert estimator.peak_moment(shape, setup)[0] == "step"
    traced = tracker.peak(llama, setup)
    assert traced["Sharded Param"] == estimate["parameters"]
    assert traced["Sharded Grad"] == estimate["gradients"]
    assert traced["OptState"] == estimate["optimizer_states"] + estimate["optimizer_step"]
    assert 0 <= traced["peak"] - estimate["peak"] < 2048


def test_fsdp2_backward_peak_is_within_five_percent_and_fake_equals_real(llama):
    """At 4 x 64 tokens on 4 fake ranks the peak falls in backward (gathered units, activations,
    reduce-scatters). Fake tensors give exactly what real ones give; the estimate is within 5%."""
    setup = estimator.setup(strategy="fsdp", impl="torch", world_size=4, batch_size_per_device=4, max_seq_length=64)
    shape = estimator.model_shape(llama)
    assert estimator.peak_moment(shape, setup)[0] == "backward"
    fake = tracker.trace(llama, setup)
    assert fake == tracker.trace(llama, setup, fake=False)
    assert fake["Unsharded Param"] > 0 and fake["Activation"] > 0  # a layer gathered, activations saved
    assert fake["OptState"] == estimator.estimate(shape, setup)["optimizer_states"]  # states exist, no step yet
    assert fake["peak"] == pytest.approx(estimator.estimate(shape, setup)["peak"], rel=0.05)


def test_the_readme_table_and_the_command_carry_memtracker(llama, capsys):
    shape = estimator.model_shape(llama)
    table = report.readme_table(shape, estimator.setup(max_seq_length=16), 8e10, world_sizes=(2,))
    header, _, *rows = table.splitlines()
    assert header.split("|")[-2].strip() == "PyTorch MemTracker"
    cells = {row.split("|")[2].strip(): row.split("|")[-2].strip() for row in rows}
    assert cells["minidist/zero1"] == cells["minidist/zero2"] == "-"  # minidist's own: nothing to trace
    for strategy in ("torch/ddp", "torch/fsdp"):
        assert cells[strategy].endswith(" GB") and cells[strategy] != "-"
    assert report.report(shape, estimator.setup(strategy="ddp"))["others"]["memtracker"] is None  # not unless asked
    memory_command.main([llama, "--strategy", "ddp", "--impl", "torch", "--max_seq_length", "16", "--memtracker"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("the whole step as PyTorch's MemTracker sees it") and "optstate" in last
    memory_command.main([llama, "--strategy", "zero2", "--max_seq_length", "16", "--memtracker"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "PyTorch's MemTracker did not trace this step (minidist's own zero2: it traces DDP and PyTorch's FSDP)")


def test_a_trace_is_cached_per_setup(llama, monkeypatch):
    setup = estimator.setup(strategy="ddp", impl="torch", batch_size_per_device=1, max_seq_length=16)
    first = tracker.peak(llama, setup)
    tracker._cached.cache_clear()  # a new process: only the cache folder is left

    def no_trace(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(tracker, "trace", no_trace)
    assert tracker.peak(llama, setup) == first
    # Every rank of DDP runs the same plain step: one trace serves every world size.
    assert tracker.peak(llama, estimator.setup(strategy="ddp", impl="torch", world_size=8, batch_size_per_device=1,
                                               max_seq_length=16)) == first
    other = estimator.setup(strategy="ddp", impl="torch", batch_size_per_device=2, max_seq_length=16)
    assert "traced again" in tracker.peak(llama, other)["error"]  # another setup is another trace


def test_what_memtracker_cannot_trace_is_said_not_raised(tmp_path, llama):
    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64).save_pretrained(tmp_path)
    setup = estimator.setup(strategy="ddp", impl="torch", batch_size_per_device=1, max_seq_length=16)
    assert tracker.peak(str(tmp_path), setup)["error"].startswith("ValueError")  # no causal LM for T5
    assert tracker.peak(llama, estimator.setup(strategy="zero2")) is None
    assert tracker.peak(llama, estimator.setup(strategy="fsdp", impl="minidist")) is None
    with pytest.raises(ValueError, match="not minidist/zero1"):
        tracker.trace(llama, estimator.setup(strategy="zero1"))
    assert not torch.distributed.is_initialized()  # the fake process group is gone again
