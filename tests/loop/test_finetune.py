"""The training loop against a single-process reference written independently of it.

The reference (tests/reference.py) is the textbook loop: one process, the whole global batch as
one batch, the mean token loss, AdamW. Every split of the same global batch over ranks and
micro-batches, with PyTorch's DDP or FSDP2 or the hand-written DDP, must give the same losses
and the same final weights.
"""

import json
import os
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from minidist import finetune
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.step import lr_schedule
from minidist.runtime.launch import launch
from in_process import run_here
from interrupted import few_games
from reference import train_reference
from train_workers import run_finetunes, run_finetunes_then_leave

STEPS, SEQ, LR, SEED = 4, 48, 3e-3, 3


def common_args(model, out, name):
    # 64 games (`runs` writes them), the reference's too: tokenizing all 3,000 in every rank of every run cost more.
    return ["--model", model, "--max_steps", str(STEPS), "--max_seq_length", str(SEQ), "--learning_rate", str(LR),
            "--warmup_steps", "2", "--seed", str(SEED), "--eval_prefixes", "0", "--output_dir", str(out / name),
            "--data", str(out / "games.jsonl")]


@pytest.fixture(scope="module")
def reference(tiny_model, runs):
    """Losses and final weights of a plain single-process run on a global batch of 4, of the runs' games."""
    args = finetune.parse_args(["--max_steps", str(STEPS), "--warmup_steps", "2"])
    losses, parameters, _ = train_reference(tiny_model, steps=STEPS, global_batch=4, seq_len=SEQ, lr=LR, seed=SEED,
                                            lr_lambda=lambda s: lr_schedule(s, args), data=runs[0] / "games.jsonl")
    return losses, parameters


SPLITS = [  # (implementation, strategy, world size, batch per device, accumulation, extra flags)
    ("torch", "ddp", 1, 4, 1, []),
    ("torch", "ddp", 2, 2, 1, []),
    ("torch", "ddp", 2, 1, 2, []),
    ("torch", "fsdp", 2, 2, 1, []),
    ("torch", "fsdp", 2, 1, 2, ["--gradient_checkpointing"]),
    ("torch", "fsdp", 2, 1, 2, ["--no_layer_wrap_policy"]),
    # The hand-written strategies through the same loop (tests/parallel/test_ddp.py and tests/parallel/test_zero_fsdp.py
    # test them in depth): their per-layer checkpointing, ZeRO buckets, FSDP units and meta-device loading.
    ("minidist", "ddp", 2, 1, 2, ["--gradient_checkpointing", "--bucket_cap_mb", "0.5"]),
    ("minidist", "zero1", 2, 2, 1, ["--bucket_cap_mb", "0.5"]),
    ("minidist", "zero2", 2, 1, 2, ["--gradient_checkpointing", "--bucket_cap_mb", "0.5"]),
    ("minidist", "fsdp", 2, 1, 2, ["--gradient_checkpointing"]),
    # Tensor parallelism (lesson 11): each layer cut over --tp_size ranks that see the same batch, the
    # data-parallel strategy over the rest (world / tp ranks), batch per device counted per data-parallel rank.
    ("minidist", "ddp", 2, 4, 1, ["--tp_size", "2"]),
    ("minidist", "ddp", 2, 2, 2, ["--tp_size", "2", "--sequence_parallel"]),
    ("minidist", "ddp", 4, 4, 1, ["--tp_size", "4", "--sequence_parallel"]),
    ("minidist", "fsdp", 4, 2, 1, ["--tp_size", "2", "--gradient_checkpointing"]),
    ("minidist", "fsdp", 4, 1, 2, ["--tp_size", "2", "--sequence_parallel"]),
    # PyTorch's own (parallelize_module, then fully_shard on the data dimension): the reference.
    ("torch", "fsdp", 2, 4, 1, ["--tp_size", "2"]),
    ("torch", "fsdp", 4, 1, 2, ["--tp_size", "2", "--sequence_parallel", "--gradient_checkpointing"]),
    # Pipeline parallelism (lesson 12): the layers cut into --pp_size stages, the accumulation steps the
    # pipeline's micro-batches, the data-parallel strategy over each stage's ranks (world / pp / tp).
    ("minidist", "ddp", 2, 2, 2, ["--pp_size", "2"]),
    ("minidist", "ddp", 2, 1, 4, ["--pp_size", "2", "--pp_schedule", "gpipe"]),
    ("minidist", "zero1", 4, 1, 2, ["--pp_size", "2"]),
    # The hand-written FSDP over each stage: 1F1B runs two forwards on stage 0 before a backward, GPipe four
    # on both stages, each backward gathering its units again (and recomputing its layers).
    ("minidist", "fsdp", 4, 1, 2, ["--pp_size", "2"]),
    ("minidist", "fsdp", 2, 1, 4, ["--pp_size", "2", "--pp_schedule", "gpipe", "--gradient_checkpointing"]),
    # 3-D: 2 stages x 2 tensor-parallel slices x 2 data-parallel ranks, on 8 ranks.
    ("minidist", "ddp", 8, 1, 2, ["--pp_size", "2", "--tp_size", "2", "--gradient_checkpointing"]),
    # PyTorch's own schedules (torch.distributed.pipelining) around the same stages, FSDP2 over each stage.
    ("torch", "fsdp", 4, 1, 2, ["--pp_size", "2"]),
    # PyTorch's 3-D, composed as torchtitan does: the stages cut first, each stage's layers over its tensor-parallel
    # ranks (parallelize_module), then FSDP2 over its data-parallel ones: pp 2 x tp 2 x FSDP2 2 on 8 ranks.
    ("torch", "fsdp", 8, 1, 2, ["--pp_size", "2", "--tp_size", "2"]),
    ("torch", "fsdp", 8, 1, 2, ["--pp_size", "2", "--tp_size", "2", "--pp_schedule", "gpipe",
                                "--gradient_checkpointing"]),
]


BF16 = [  # (implementation, strategy, extra flags): 2 ranks, 2 sequences per device
    ("torch", "ddp", []),
    ("torch", "fsdp", []),
    # The hand-written DDP under autocast, summing its gradients in bf16: half the bytes on the wire.
    ("minidist", "ddp", ["--reduce_dtype", "bf16"]),
    # Tensor parallelism in bf16: one data-parallel rank of 2 tensor-parallel ones, so 4 sequences each.
    ("minidist", "ddp", ["--tp_size", "2", "--batch_size_per_device", "4"]),
    ("minidist", "fsdp", ["--tp_size", "2", "--sequence_parallel", "--batch_size_per_device", "4"]),
    # A pipeline in bf16: two stages on the 2 ranks, 2 micro-batches of 2. PyTorch's pipelining must be told
    # the activations' dtype (bf16 under FSDP2's policy, the parameters fp32): told fp32, step 1 was NaN.
    ("minidist", "ddp", ["--pp_size", "2", "--gradient_accumulation_steps", "2"]),
    ("torch", "fsdp", ["--pp_size", "2", "--gradient_accumulation_steps", "2"]),
]


def split_argv(model, out, impl, strategy, world, batch, accum, extra):
    return common_args(model, out, f"{impl}-{strategy}-{world}x{batch}x{accum}{''.join(extra)}") + [
        "--impl", impl, "--strategy", strategy, "--batch_size_per_device", str(batch),
        "--gradient_accumulation_steps", str(accum)] + extra


def bf16_argv(model, out, impl, strategy, extra):
    return common_args(model, out, f"bf16-{impl}-{strategy}{''.join(extra)}") + [
        "--impl", impl, "--strategy", strategy, "--batch_size_per_device", "2", "--mixed_precision", "bf16",
        "--no_save"] + extra


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every run of this module, by its argument list. Runs of the same world size share one
    launch (one after the other in the same ranks), because starting the ranks costs more than a
    4-step run of the tiny model; each run still starts from its own seed and output folder."""
    out = tmp_path_factory.mktemp("finetune")
    few_games(out)  # out/games.jsonl: what every run and the reference read (common_args)
    by_world = {}
    for impl, strategy, world, batch, accum, extra in SPLITS:
        by_world.setdefault(world, []).append(split_argv(tiny_model, out, impl, strategy, world, batch, accum, extra))
    for impl, strategy, extra in BF16:
        by_world.setdefault(2, []).append(bf16_argv(tiny_model, out, impl, strategy, extra))
    results = {}
    for world, argvs in by_world.items():
        for argv, result in zip(argvs, launch(run_finetunes, world, argvs, timeout_s=600)[0]):
            results[tuple(argv)] = result
    return out, results


@pytest.mark.parametrize("impl,strategy,world,batch,accum,extra", SPLITS)
def test_every_split_matches_the_single_process_reference(tiny_model, reference, runs, impl, strategy, world, batch,
                                                          accum, extra):
    out, results = runs
    argv = split_argv(tiny_model, out, impl, strategy, world, batch, accum, extra)
    result, run_dir = results[tuple(argv)], Path(argv[argv.index("--output_dir") + 1])
    ref_losses, ref_params = reference
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert result["parameters"].keys() == ref_params.keys()
    # AdamW divides by sqrt(v) + eps: where a gradient is as small as eps (rare embedding rows),
    # a last-bit difference in summation order moves that element's step by a fraction of lr.
    # Seen here: at most 1e-5 on a handful of 400k elements; allowed: 1% of one step (lr).
    for name, ref in ref_params.items():
        torch.testing.assert_close(result["parameters"][name], ref, rtol=1e-5, atol=LR / 100, msg=name)

    # What the run leaves behind: one metrics line per step, and a model from_pretrained can load.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "step_time_s", "tokens", "tokens_per_s"):
        assert all(r[key] > 0 for r in records), key
    # The whole step's peak: on CPU traced on the first step only, by default (a traced step is slow).
    assert records[0]["peak_memory_bytes"] > 0 and all(r["peak_memory_bytes"] is None for r in records[1:])
    # minidist counts what its collectives send: DDP one all-reduce of every gradient per step (2P);
    # ZeRO a reduce-scatter and an all-gather (2P, up to the padding of its flat buckets).
    parameters = sum(t.numel() for t in result["parameters"].values())
    assert all(r["comm_bytes_tensor_parallel"] is None for r in records) or "--tp_size" in extra
    if impl == "torch":
        assert [r["comm_bytes"] for r in records] == [None] * STEPS
    elif "--pp_size" in extra:  # activations between stages, counted exactly in tests/parallel/test_pipeline.py
        assert all(r["comm_bytes"] > 0 for r in records)
    elif "--tp_size" in extra:  # activations, counted exactly in tests/parallel/test_tensor_bytes.py, and apart
        tp = int(extra[extra.index("--tp_size") + 1])
        for r in records:
            assert r["comm_bytes_tensor_parallel"] > 0
            if world == tp:  # one data-parallel rank: the tensor-parallel group sends everything
                assert r["comm_bytes"] == r["comm_bytes_tensor_parallel"]
            else:
                assert r["comm_bytes"] > r["comm_bytes_tensor_parallel"]
    elif strategy != "fsdp":
        for r in records:
            assert 0 <= r["comm_bytes"] - 2 * parameters * (world - 1) / world * 4 < 2 * 4 * world * 8
    saved = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(tensor, result["parameters"][name], rtol=0, atol=0)


@pytest.mark.parametrize("impl,strategy,extra", BF16)
def test_bf16_tracks_fp32(tiny_model, reference, runs, impl, strategy, extra):
    """bf16 compute keeps 8 bits of mantissa (relative rounding 2**-8 = 0.4%) while the master
    weights, gradients and (unless --reduce_dtype bf16) reductions stay fp32: over a few steps the
    loss stays within 1% of fp32's, and it is not bitwise equal (so bf16 really ran)."""
    out, results = runs
    argv = bf16_argv(tiny_model, out, impl, strategy, extra)
    result, run_dir = results[tuple(argv)], Path(argv[argv.index("--output_dir") + 1])
    losses, fp32 = torch.tensor(result["losses"]), torch.tensor(reference[0])
    torch.testing.assert_close(losses, fp32, rtol=1e-2, atol=0)
    assert not torch.equal(losses, fp32)
    if "--reduce_dtype" in extra:  # each of P gradients, all-reduced in 2 bytes: 2P(N-1)/N x 2
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        parameters = sum(t.numel() for t in reference[1].values())
        assert [r["comm_bytes"] for r in records] == [2 * parameters * (2 - 1) / 2 * 2] * STEPS


@pytest.mark.parametrize("argv,expected", [
    (["--model", "/no/such/model"], "model folder '/no/such/model' not found"),
    (["--data", "/no/such/games.jsonl"], "No games file at /no/such/games.jsonl"),
    (["--impl", "torch", "--strategy", "zero2"], "PyTorch has no zero2 of its own"),
    (["--strategy", "ddp", "--ddp_variant", "naive"], "--ddp_variant only applies to --impl minidist with --strategy ddp"),
    (["--impl", "minidist", "--strategy", "fsdp", "--bucket_cap_mb", "1"], "--bucket_cap_mb only applies to"),
    (["--batch_size_per_device", "0"], "--batch_size_per_device must be at least 1"),
])
def test_bad_input_ends_with_one_line(tiny_model, tmp_path, capsys, argv, expected):
    status, err = run_here(["--model", tiny_model, "--impl", "torch", "--output_dir", str(tmp_path),
                            "--eval_prefixes", "0", *argv], capsys)
    assert status != 0
    assert expected in err.strip().splitlines()[-1], err
    assert "Traceback" not in err


def test_the_help_gives_the_defaults_the_strategies_use(capsys):
    """Options that default to None ("not given") name in their help the value the strategy then
    uses, read from `ParallelOptions.DEFAULTS`, the one place that holds it."""
    from minidist.parallel.options import ParallelOptions

    with pytest.raises(SystemExit):
        finetune.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name, default in ParallelOptions.DEFAULTS.items():
        assert f"--{name}" in text and f"(default {default})" in text, name


def test_a_model_that_is_not_cached_fails_fast_offline(tmp_path):
    # Offline with an empty cache, as on a compute node: a hub name that is not cached must fail
    # fast. In a process of its own: huggingface_hub reads HF_HUB_OFFLINE when it is imported.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": tempfile.mkdtemp()}
    done = subprocess.run([sys.executable, "-m", "minidist.finetune", "--model", "some-org/not-cached", "--impl",
                           "torch", "--output_dir", str(tmp_path), "--eval_prefixes", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "could not load 'some-org/not-cached'" in done.stderr.strip().splitlines()[-1], done.stderr
    assert "Traceback" not in done.stderr


def test_a_global_batch_larger_than_the_data_is_refused(tiny_model, tmp_path, capsys):
    games = tmp_path / "few.jsonl"
    jsonl.write_games(jsonl.load_games(bundled_games("test"))[:3], games)
    status, err = run_here(["--model", tiny_model, "--impl", "torch", "--data", str(games), "--eval_prefixes", "0",
                            "--output_dir", str(tmp_path)], capsys)
    assert status != 0 and "Traceback" not in err
    assert "global_batch_size 8 is larger than" in err.strip().splitlines()[-1]


def test_a_finished_run_leaves_no_gloo_worker_thread_behind(tiny_model, tmp_path):
    # A gloo group runs collectives on threads of its own. If the group outlives `cleanup`, they
    # run on into interpreter shutdown, where one that lets go of a finished collective's tensors
    # aborts the process ("terminate called without an active exception"; minidist/runtime/distributed.py,
    # "Leaving cleanly"). So after every strategy has trained in these ranks, the group must be
    # really gone: no gloo thread left. (The abort itself is rare; tests/checkpoint/exit_loop.py counts it.)
    games = tmp_path / "games.jsonl"
    jsonl.write_games(jsonl.load_games(bundled_games("train"))[:16], games)
    argvs = [["--model", tiny_model, "--impl", impl, "--strategy", strategy, "--mixed_precision", "bf16",
              "--max_steps", "1", "--batch_size_per_device", "1", "--max_seq_length", "16", "--data", str(games),
              "--eval_prefixes", "0", "--no_save", "--output_dir", str(tmp_path / f"{impl}-{strategy}")]
             for impl, strategy in [("minidist", "ddp"), ("minidist", "zero1"), ("minidist", "zero2"),
                                    ("minidist", "fsdp"), ("torch", "ddp"), ("torch", "fsdp")]]
    assert launch(run_finetunes_then_leave, 2, argvs, timeout_s=300) == [0, 0]


def test_the_final_model_is_saved_in_its_own_dtype_unless_asked_otherwise(tiny_model, tmp_path):
    """A model published in bf16 (CodeLlama-7b) is written back in bf16, half the bytes of the
    fp32 masters; one whose config names no dtype in fp32; `--save_dtype` chooses."""
    games = tmp_path / "games.jsonl"
    jsonl.write_games(jsonl.load_games(bundled_games("train"))[:16], games)
    in_bf16 = tmp_path / "published-in-bf16"
    shutil.copytree(tiny_model, in_bf16)
    config = json.loads((in_bf16 / "config.json").read_text())
    (in_bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    for model, flags, expected in [(tiny_model, [], torch.float32), (in_bf16, [], torch.bfloat16),
                                   (in_bf16, ["--save_dtype", "fp32"], torch.float32),
                                   (tiny_model, ["--save_dtype", "bf16"], torch.bfloat16)]:
        out = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
        finetune.main(["--model", str(model), "--impl", "torch", "--data", str(games), "--max_steps", "1",
                       "--max_seq_length", "16",
                       "--batch_size_per_device", "2", "--eval_prefixes", "0", "--output_dir", str(out), *flags])
        saved = AutoModelForCausalLM.from_pretrained(out / "model", dtype="auto")
        assert {p.dtype for p in saved.parameters()} == {expected}, (model, flags)
