"""Loading a model under FSDP: the weights are read once, on rank 0, and the other ranks wait for it.

At 7B every rank that reads the model holds it whole in fp32 on the host (27 GB), so 4 ranks on a
node need 108 GB. Both FSDPs (`strategy.MinidistFSDP`, `strategy.TorchFSDP`, and HSDP through
them) read the weights on rank 0 alone: the other ranks build the model on the meta device, and
`wrap` scatters (by hand) or broadcasts (PyTorch's distributed state-dict API) rank 0's weights
into every rank's shards. Each case here counts the safetensors files each rank opens (rank 0
only), and checks that every rank ends with the weights, buffers (Llama's rotary frequencies,
never in a state dict) and logits of the model loaded in one process, with a tied output layer
still tied.

Reading 7B from a network filesystem can take longer than the process group's timeout (600 s),
which is meant to catch a hung collective. So the ranks wait for rank 0 on a CPU barrier with an
hour's timeout (`distributed.wait_for_rank0`). The slowed cases run under a 4 s process-group
timeout while rank 0's read takes 6 s: without that barrier the other ranks time out.
"""

import pytest
import torch

from minidist.hf import models
from minidist.runtime.launch import launch
from loading_workers import load_and_report

# The full suite only: loading under FSDP, one launch per model and world size.
pytestmark = pytest.mark.slow

TIMEOUT_S, SLOW_S = 4, 6  # the process group's timeout, and how long rank 0's read of each file takes

# (implementation, strategy, model, world size, simulated nodes, rank 0 slowed beyond the timeout)
CASES = [
    ("torch", "fsdp", "llama", 2, 1, True),
    ("minidist", "fsdp", "llama", 2, 1, True),
    ("torch", "fsdp", "gpt2", 2, 1, False),
    ("torch", "fsdp+offload", "llama", 2, 1, False),  # rank 1's shards made on the host (--cpu_offload)
    ("torch", "hsdp", "llama", 4, 2, False),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    return {  # both with an output layer tied to the embedding, as GPT-2 and many small models have
        "llama": str(models.write_tiny_llama(out / "llama", hidden_size=64, num_layers=2, tie_word_embeddings=True)),
        "gpt2": str(models.write_tiny_gpt2(out / "gpt2", hidden_size=64, num_layers=2)),
    }


@pytest.mark.parametrize("impl, strategy, model, world, nodes, slow", CASES,
                         ids=[f"{i}-{s}-{m}-{w}ranks{'-slow' * slow}" for i, s, m, w, _, slow in CASES])
def test_weights_are_read_on_rank_0_only(model_dirs, monkeypatch, impl, strategy, model, world, nodes, slow):
    if slow:  # read by init_distributed in every rank
        monkeypatch.setenv("MINIDIST_TIMEOUT_S", str(TIMEOUT_S))
    results = launch(load_and_report, world, model_dirs[model], impl, strategy, SLOW_S if slow else 0.0, nodes=nodes)

    assert results[0]["reads"] and all(path.endswith(".safetensors") for path in results[0]["reads"])
    assert [r["reads"] for r in results[1:]] == [[]] * (world - 1)  # nobody else opened a weights file

    reference = models.load_model(model_dirs[model])
    expected = reference.state_dict()
    full = results[0]["full"]
    assert full.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    buffers = dict(reference.named_buffers())
    with torch.no_grad():
        logits = reference(torch.arange(1, 17).unsqueeze(0)).logits
    for rank, result in enumerate(results):
        assert result["buffers"].keys() == buffers.keys()
        for name, buf in buffers.items():  # Llama's inv_freq: not in a state dict, yet right on every rank
            torch.testing.assert_close(result["buffers"][name], buf, rtol=0, atol=0, msg=lambda m: f"rank {rank}: {name}: {m}")
        torch.testing.assert_close(result["logits"], logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank}, logits: {m}")
        assert result["tied"] in (None, True), f"rank {rank}: the output layer is no longer the embedding"
