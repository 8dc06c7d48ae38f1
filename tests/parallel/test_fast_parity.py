"""Each hand-written strategy once, on 2 ranks, against the single-process reference: the fast tier's parity.

DDP, ZeRO-2, FSDP, tensor parallelism and a pipeline each train a few steps of the tiny Llama
through the training script's own command line (`python -m minidist.finetune --impl minidist
...`), all five one after the other in the same 2 ranks: starting a rank (forking it, importing
transformers, joining the group) costs more CPU than a 3-step run of this model, so one launch
holds them all. Each split of the global batch of 4 must give the losses, the gradient norms and
the final weights of one process training on the whole batch (`tests/reference.py`), and DDP,
ZeRO-2 and FSDP must send the bytes the lessons' formulas say. In the same launch, the bytes a
tensor-parallel step sends are counted against `parallel/tensor/traffic.py`'s formula.

The full suite holds the same strategies far more widely: every split, world sizes 1 to 8,
accumulation, checkpointing, mixed precision, the NCCL-like harness (`test_zero_fsdp.py`,
`test_ddp.py`, `test_tensor.py`, `test_pipeline.py`, `tests/loop/test_finetune.py`)."""

from pathlib import Path

import pytest
import tensor_bytes_workers
import torch

from minidist.parallel.tensor import traffic
from minidist.runtime.launch import launch
from interrupted import few_games
from pipeline_launches import run_planned
from reference import run_reference
from train_workers import run_finetunes

STEPS, SEQ, LR, SEED, WORLD, GLOBAL_BATCH = 3, 48, 3e-3, 3, 2, 4

STRATEGIES = {  # name -> the flags that choose it, 2 ranks, a global batch of 4 sequences
    "ddp": ["--strategy", "ddp", "--batch_size_per_device", "2"],
    # 2 micro-batches of 1: the first under no_sync, the gradients reduce-scattered once
    "zero2": ["--strategy", "zero2", "--batch_size_per_device", "1", "--gradient_accumulation_steps", "2"],
    "fsdp": ["--strategy", "fsdp", "--batch_size_per_device", "2"],
    # one data-parallel rank of 2 tensor-parallel ones, each seeing the whole global batch
    "tp": ["--strategy", "ddp", "--tp_size", "2", "--batch_size_per_device", "4"],
    # two stages, 1F1B over 2 micro-batches of 2
    "pp": ["--strategy", "ddp", "--pp_size", "2", "--batch_size_per_device", "2", "--gradient_accumulation_steps", "2"],
}

TP_BYTES = {  # `tensor_bytes_workers.counted`'s cases: float64, micro-batches of different lengths
    "tp": {"sequence_parallel": False, "lengths": [(16, 11, 7), (8, 5)]},
    "sequence parallel": {"sequence_parallel": True, "lengths": [(16, 11, 7)]},
}


def argv(model, out, name):
    return ["--model", model, "--impl", "minidist", *STRATEGIES[name], "--max_steps", str(STEPS),
            "--max_seq_length", str(SEQ), "--learning_rate", str(LR), "--warmup_steps", "1", "--seed", str(SEED),
            "--eval_prefixes", "0", "--output_dir", str(out / name), "--data", str(out / "games.jsonl")]


@pytest.fixture(scope="module")
def launched(tiny_model, tmp_path_factory):
    """Rank 0's results: {strategy: (what `finetune.train` returned, its metrics.jsonl records)},
    and every rank's tensor-parallel byte counts, from one launch of 2 ranks."""
    import json

    out = tmp_path_factory.mktemp("fast")
    few_games(out)  # 64 games: what every run and the reference read
    argvs = [argv(tiny_model, out, name) for name in STRATEGIES]
    ranks = launch(run_planned, WORLD, [(run_finetunes, (argvs,)), (tensor_bytes_workers.counted, (TP_BYTES,))],
                   timeout_s=600)
    runs = {}
    for name, result in zip(STRATEGIES, ranks[0][0]):
        lines = (out / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = result, [json.loads(line) for line in lines]
    return out, runs, [rank[1] for rank in ranks]


@pytest.fixture(scope="module")
def reference(tiny_model, launched):
    """The single-process run on the whole global batch of 4: losses, final weights, and the
    gradient norm of each step, read where it clips. The learning rate of each step is the one
    the runs logged (the loop's warm-up and cosine), so that only the strategies differ (LambdaLR
    asks once more after the last step, for a step that is not taken).

    AdamW hides a wrong gradient scale (m / sqrt(v) is the same for 2g as for g) and clipping
    at 1.0 equalises norms above it: a strategy that forgot to average over its ranks would
    still match the weights, but not the gradient norms."""
    out, runs, _ = launched
    lrs = [record["lr"] for record in runs["ddp"][1]]
    ref = run_reference(tiny_model, steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=SEQ, lr=LR, seed=SEED,
                        lr_lambda=lambda step: lrs[min(step, STEPS - 1)] / LR, data=Path(out, "games.jsonl"))
    return ref.losses, ref.parameters, ref.grad_norms  # the norms as the reference clipped by them


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_matches_the_single_process_reference(launched, reference, name):
    """Losses and gradient norms to 1e-5 relative, every weight by name to 1e-5 relative plus 1%
    of one step (AdamW divides by sqrt(v) + eps: where a gradient is as small as eps, in rare
    embedding rows, a last-bit difference in the order of the sums moves that element by a
    fraction of lr; tests/loop/test_finetune.py holds every split to the same)."""
    result, records = launched[1][name]
    ref_losses, ref_params, ref_norms = reference
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{name}, losses: {m}")
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in records]), torch.tensor(ref_norms), rtol=1e-5,
                               atol=0, msg=lambda m: f"{name}, gradient norms: {m}")
    assert result["parameters"].keys() == ref_params.keys()
    for key, ref in ref_params.items():
        torch.testing.assert_close(result["parameters"][key], ref, rtol=1e-5, atol=LR / 100,
                                   msg=lambda m, key=key: f"{name}, {key}: {m}")


@pytest.mark.parametrize("name", ["ddp", "zero2", "fsdp"])
def test_data_parallel_bytes_follow_the_formulas(launched, reference, name):
    """Bytes each rank sends per step, 4 bytes an element, P parameters, N = 2 ranks: DDP
    all-reduces every gradient, 2P(N-1)/N; ZeRO-2 reduce-scatters the gradients and all-gathers
    the weights, the same 2P(N-1)/N whatever the accumulation (no_sync sends nothing); FSDP
    gathers every unit for forward and the layer units again for backward, and reduce-scatters
    the gradients, (3P - P_root)(N-1)/N with the root unit (embedding, final norm, output layer)
    kept from forward to backward. ZeRO's and FSDP's flat buffers are padded to a multiple of N:
    fewer than N elements each, sent at most 3 times a step, in at most 3 buffers here (FSDP's root
    and 2 layer units; ZeRO-2's one bucket of 25 MB); with the gradient norm's scalar, within that."""
    records = launched[1][name][1]
    parameters = reference[1]
    p = sum(t.numel() for t in parameters.values())
    p_root = sum(t.numel() for key, t in parameters.items() if not key.startswith("model.layers."))
    share = (WORLD - 1) / WORLD
    expected = {"ddp": 2 * p, "zero2": 2 * p, "fsdp": 3 * p - p_root}[name] * share * 4
    padding = 0 if name == "ddp" else 3 * 3 * WORLD * 4
    for r in records:
        assert 0 <= r["comm_bytes"] - expected <= padding, (name, r["step"], r["comm_bytes"], expected)


@pytest.mark.parametrize("case", list(TP_BYTES))
def test_tensor_parallel_bytes_follow_the_formula(launched, case):
    """What `comm.counter` counts for one step of the float64 Llama cut over 2 ranks equals
    `traffic.tensor_parallel_bytes`, summed over the micro-batches, on every rank."""
    sequence_parallel = TP_BYTES[case]["sequence_parallel"]
    for rank, by_case in enumerate(launched[2]):
        result = by_case[case]
        parts = [traffic.tensor_parallel_bytes(result["config"], b, s, WORLD, sequence_parallel=sequence_parallel,
                                               element_bytes=8) for b, s in result["shapes"]]
        assert result["bytes"] == sum(part.total for part in parts), (rank, case, result["bytes"], parts)
