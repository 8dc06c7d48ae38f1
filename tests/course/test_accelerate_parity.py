"""Accelerate's own FSDP2 against minidist's loop (issue 31, lessons/reference/from_accelerate.md).

The same tiny Llama and global batches, 2 CPU ranks, 1 sequence per device and 2 accumulation steps:
`python -m minidist.finetune --impl torch --strategy fsdp`, then a Trainer-style loop through
`accelerate.Accelerator` with `FullyShardedDataParallelPlugin(fsdp_version=2)`
(`minidist/bench/accelerate_parity.py`). The loss curves must be equal: the token-normalised loss is
the Trainer's `num_items_in_batch` times the number of processes, and `no_sync` is
`accelerator.no_sync`.

On CPU ranks Accelerate 1.15 drops the FSDP plugin without a word (its state stays MULTI_CPU and
`prepare` would wrap DDP); the script then sets the two attributes Accelerate's GPU branch sets. The
test asserts that refusal too, so that a release of Accelerate that runs FSDP on CPU shows up here
(and the override can go).
"""

import pytest

from minidist.bench.accelerate_parity import both_sides, compare
from minidist.runtime.launch import launch

# The full suite only: Accelerate's run against the loop's, each launching its ranks.
pytestmark = pytest.mark.slow


def test_accelerate_fsdp2_loss_curve_equals_minidists(tiny_model, tmp_path):
    rank0, rank1 = launch(both_sides, 2, tiny_model, tmp_path / "run", timeout_s=300)
    same, report = compare(rank0)
    assert same, report
    assert rank0["losses"] == rank1["losses"]  # every rank logs the global batch's loss
    # The one difference from a GPU run: Accelerate chose DDP on CPU processes, and was overridden.
    assert rank0["distributed_type_chosen"] == "DistributedType.MULTI_CPU", rank0
    assert rank0["wrapped_as"] == "FSDPLlamaForCausalLM", rank0  # fully_shard's class: Accelerate's FSDP2 ran
