"""MFU's denominator: the peak `metrics.peak_flops` picks from the name CUDA reports for the card.

No GPU is needed: the lookup is a function of `torch.cuda.get_device_name`, which the tests replace
with the names real cards report. The H100 comes in two forms with one name stem: the SXM module
(989 TFLOP/s dense bf16) and the PCIe card (756 TFLOP/s; NVIDIA H100 datasheet), so matching "H100"
alone would rate a PCIe card's MFU against the SXM's peak, 0.76x what it really reached."""

import pytest
import torch

from minidist.runtime import metrics

CUDA = torch.device("cuda", 0)  # peak_flops reads only its type; the name comes from the stand-in below


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),  # the A100's PCIe card has the SXM's tensor-core peak
    ("NVIDIA H100 80GB HBM3", 989e12),  # the SXM module
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA GeForce RTX 3090", None),  # a card the table does not know: no MFU rather than a wrong one
])
def test_each_card_is_rated_against_its_own_peak(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.peak_flops(CUDA) == peak


def test_the_cpu_has_no_peak():
    assert metrics.peak_flops(torch.device("cpu")) is None
