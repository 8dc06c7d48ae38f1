"""A feature that this torch lacks is refused in one line where it is asked for (`runtime/torch_features.py`).

Torch 2.13 has every one; what 2.6 lacks is planted: PyTorch's pipeline schedule without
`scale_grads`, and CPU streams without `record_event`. Then lesson 12's PyTorch pipeline (`--impl
torch --pp_size 2`) stops before the model loads, in the training script and the memory estimate
alike, while the hand-written pipeline still runs its checks through; and FSDP2 on CPU ranks stops
before the model loads, where the hand-written FSDP runs.
"""

import pytest
import torch.distributed.pipelining as pipelining
from in_process import said

from minidist import finetune
from minidist.memory import __main__ as memory_command
from minidist.runtime import torch_features


class OldSchedule1F1B:
    """torch 2.6's signature: no scale_grads."""

    def __init__(self, stage, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None):
        pass


@pytest.mark.parametrize("name", list(torch_features.FEATURES))
def test_a_feature_is_refused_exactly_where_this_torch_lacks_it(name):
    """CI's torch has every feature; an older one (the compatibility runs) lacks some: either way
    `require` agrees with the probe."""
    probe, needs, _ = torch_features.FEATURES[name]
    if probe():
        torch_features.require(name)
    else:
        with pytest.raises(ValueError, match=needs.split(" (")[0]):
            torch_features.require(name)


@pytest.fixture
def old_torch(monkeypatch):
    monkeypatch.setattr(pipelining, "Schedule1F1B", OldSchedule1F1B)
    assert not torch_features.pipeline_scale_grads()


def test_the_pytorch_pipeline_on_an_old_torch_is_one_line(old_torch, tiny_model, tmp_path, capsys):
    line = said(finetune.main, ["--model", tiny_model, "--output_dir", str(tmp_path), "--impl", "torch",
                                "--strategy", "fsdp", "--pp_size", "2"], capsys)
    assert "PyTorch's pipeline schedules (--impl torch --pp_size) need their scale_grads argument, which torch " in line
    assert "use the hand-written pipeline (--impl minidist) or a newer torch" in line, line
    line = said(memory_command.main, ["tiny", "--impl", "torch", "--strategy", "fsdp", "--pp_size", "2"], capsys)
    assert "need their scale_grads argument" in line, line


def test_the_hand_written_pipeline_does_not_ask_for_it(old_torch, capsys):
    memory_command.main(["tiny", "--impl", "minidist", "--strategy", "fsdp", "--pp_size", "2", "--world_size", "2",
                         "--gradient_accumulation_steps", "2"])
    assert "pipeline stages" in capsys.readouterr().out


class OldCpuStream:
    """torch 2.6's `torch.cpu.Stream`: no record_event."""


def test_fsdp2_on_cpu_ranks_of_an_old_torch_is_one_line(monkeypatch, tiny_model, tmp_path, capsys):
    import torch

    monkeypatch.setattr(torch.cpu, "Stream", OldCpuStream)
    line = said(finetune.main, ["--model", tiny_model, "--output_dir", str(tmp_path), "--impl", "torch",
                                "--strategy", "fsdp", "--max_steps", "1"], capsys)
    assert "PyTorch's FSDP2 on CPU ranks (--impl torch without a GPU) needs CPU streams that record events" in line
    assert "use the hand-written FSDP (--impl minidist), a GPU, or a newer torch" in line, line


class GPipeOf29:
    """torch 2.9's `ScheduleGPipe`, which refuses fewer micro-batches than stages, as its 1F1B does."""

    def __init__(self, stage, n_microbatches, *args, **kwargs):
        if n_microbatches < stage.num_stages:
            raise ValueError(f"Number of microbatches ({n_microbatches}) must be greater than or equal to the number "
                             f"of stages ({stage.num_stages}).")


def test_the_pytorch_pipeline_with_fewer_micro_batches_than_stages_on_torch_29_is_one_line(monkeypatch, tiny_model,
                                                                                            tmp_path, capsys):
    monkeypatch.setattr(pipelining, "ScheduleGPipe", GPipeOf29)
    assert not torch_features.pipeline_fewer_microbatches()
    argv = ["--model", tiny_model, "--output_dir", str(tmp_path), "--impl", "torch", "--strategy", "fsdp",
            "--pp_size", "2", "--gradient_accumulation_steps", "1"]
    line = said(finetune.main, argv, capsys)
    assert "PyTorch's pipeline with fewer micro-batches (--gradient_accumulation_steps) than stages (--pp_size) " \
           "needs a GPipe that takes them" in line, line
    assert "give at least as many micro-batches as stages" in line, line
