"""A line that tells a mistake must not send the learner the wrong way: no "--resume" where there is
nothing to resume, no learning rate blamed alone for what an overflow or bad data cause as well."""

import pytest
import torch

from minidist.checkpoint import save_errors
from minidist.runtime.errors import UsageError


@pytest.mark.parametrize("saved_before", [False, True])
def test_a_full_disk_says_resume_only_when_there_is_a_checkpoint(tmp_path, saved_before):
    tmp = tmp_path / "checkpoint-5.tmp"
    tmp.mkdir()
    if saved_before:
        (tmp_path / "latest").write_text("checkpoint-3")
    with pytest.raises(UsageError) as told:
        save_errors.give_up_if("No space left on device", tmp, 5, is_main=True)
    line = str(told.value)
    assert not tmp.exists()
    if saved_before:
        assert f"{tmp_path / 'latest'} still names checkpoint-3" in line and line.endswith("run again with --resume")
    else:
        assert "there is no earlier checkpoint" in line and "--resume" not in line, line


def test_non_finite_weights_name_more_than_the_learning_rate():
    weight = torch.nn.Parameter(torch.tensor([1.0, float("nan")]))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with pytest.raises(UsageError) as told:
        save_errors.refuse_non_finite(optimizer, torch.device("cpu"), 7)
    line = str(told.value)
    assert line.startswith("training diverged: the weights after step 7 are not finite")
    assert "lower --learning_rate" not in line and "overflow" in line and "bad data" in line, line
