"""A feature that this torch lacks is refused in one line where it is asked for (`runtime/torch_features.py`).

The torch here has every one; an older one is planted: PyTorch's pipeline schedule as torch 2.6
shipped it, without `scale_grads`. Then lesson 12's PyTorch pipeline (`--impl torch --pp_size 2`)
stops before the model loads, in the training script and the memory estimate alike, while the
hand-written pipeline still runs its checks through.
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


def test_this_torch_has_every_feature():
    assert all(probe() for probe, _, _ in torch_features.FEATURES.values())


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
