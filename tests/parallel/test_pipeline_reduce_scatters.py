"""Under a pipeline both FSDPs reduce-scatter once per step, whatever the number of micro-batches.

A stage runs m micro-batches' backwards in a step; its gradients should be summed locally and
reduce-scattered once, after the last one, as without a pipeline under `no_sync`. The hand-written
executor holds every backward but the last in the strategy's `no_sync`. PyTorch's schedule does the
same for a stage whose module is an `FSDPModule` (`PipelineStage.backward_maybe_with_nosync`, then
`perform_reduce_grad` after the last micro-batch); handed a module around the FSDP2 one, it did
not, and FSDP2 reduce-scattered after every micro-batch: m times the bytes.

One launch of 4 ranks (2 stages x 2 data-parallel ranks), one step each at m = 1 and m = 4, for the
hand-written FSDP and FSDP2 (`--impl torch`): this rank's reduce-scatters are counted where each
FSDP launches them (`train_workers.count_reduce_scatters`).
"""

import pytest
from interrupted import few_games
from train_workers import count_reduce_scatters

from minidist.runtime.launch import launch

pytestmark = pytest.mark.slow  # a launch of 4 ranks

CASES = [(impl, m) for impl in ("minidist", "torch") for m in (1, 4)]


def test_each_fsdp_reduce_scatters_once_per_step_under_a_pipeline(tiny_model, tmp_path):
    games = str(few_games(tmp_path))
    argvs = [["--model", tiny_model, "--data", games, "--output_dir", str(tmp_path / f"{impl}-{m}"), "--impl", impl,
              "--strategy", "fsdp", "--pp_size", "2", "--gradient_accumulation_steps", str(m),
              "--batch_size_per_device", "1", "--max_steps", "1", "--max_seq_length", "32", "--eval_prefixes", "0",
              "--no_save"] for impl, m in CASES]
    by_rank = launch(count_reduce_scatters, 4, argvs, timeout_s=600)
    for rank, counts in enumerate(by_rank):
        got = dict(zip(CASES, counts))
        for impl in ("minidist", "torch"):
            assert got[impl, 1] > 0, (rank, got)
            assert got[impl, 4] == got[impl, 1], (rank, impl, got)  # once per step, not once per micro-batch
