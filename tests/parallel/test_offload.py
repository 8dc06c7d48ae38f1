"""`--cpu_offload` (ZeRO-Offload, `parallel/offload.py`): same training, the model states split over two sides.

- **Parity**: offloading moves tensors, not arithmetic. On the CPU every operation is the one the
  run without offload does, so ZeRO-1, ZeRO-2 and FSDP by hand, fp32 and bf16, on 1 and 2 ranks,
  with and without accumulation, give the same losses, gradient norms and weights, bit for bit,
  as without offload (which tests/parallel/test_zero_fsdp.py holds to the single-process reference; the
  fp32 runs here are held to it too). PyTorch's FSDP2 with its `CPUOffloadPolicy` against itself
  without: bit for bit as well. And each hand-written one under the NCCL-like harness
  (`tests/nccl_like.py`), on 1 and 2 ranks: bit for bit the run without it.
- **Where things live**: masters, their gradients and Adam's moments on the host; the weights
  the device computes with (FSDP: its compute-dtype shard) on the device.
- **Resume**: a checkpoint written with offload (sharded for FSDP and ZeRO-1, full for ZeRO-2)
  resumes into the same run, bit for bit.
- **The estimator's device and host columns** against the measured split (`memory/sides.py`).
"""

import json

import pytest
import torch
from interrupted import few_games
from offload_workers import everything
from reference import train_reference

from minidist.hf import models
from minidist.runtime.launch import launch

# The full suite only: CPU offload under every strategy, in several launches.
pytestmark = pytest.mark.slow

# Two steps per parity run: the first creates AdamW's moments (on the host, offloaded), the second
# reads and updates them; any later step repeats the second's operations on the same tensors, so it
# could only show again what the second shows.
GLOBAL_BATCH, STEPS, SEQ, LR, BUCKET_CAP_MB = 16, 2, 48, 3e-3, 0.05
SHARDED = ("zero1", "zero2", "fsdp")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(models.write_tiny_llama(tmp_path_factory.mktemp("models") / "llama", hidden_size=64, num_layers=2,
                                       tie_word_embeddings=True))


def variants(accum):
    """Each sharded strategy, fp32 and bf16, without and with offload; PyTorch's FSDP2 in fp32.
    And each sharded strategy offloaded under the NCCL-like harness (`tests/nccl_like.py`), fp32
    without accumulation and bf16 with it."""
    out = [{"strategy": s, "steps": STEPS, "mixed_precision": p, "cpu_offload": o}
           for s in SHARDED for p in ("fp32", "bf16") for o in (False, True)]
    out += [{"strategy": s, "steps": STEPS, "mixed_precision": "fp32" if accum == 1 else "bf16", "cpu_offload": True,
             "nccl_like": True} for s in SHARDED]
    return out + [{"strategy": "fsdp", "steps": STEPS, "impl": "torch", "cpu_offload": o} for o in (False, True)]


# (strategy, checkpoint form) for the resume test: each form and each kind of flat (buckets, units).
RESUMES = [("fsdp", "sharded"), ("zero1", "sharded"), ("zero2", "full")]
SPLIT_SEQ, SPLIT_BATCH = 32, 2
# (strategy, precision, world size): ZeRO-2 with several buckets (1 MiB), FSDP unit by unit. Seen: within
# 0.1% on the host, 2.0 to 4.1% on the device (ZeRO-2 fp32 on one rank, not listed: 5.5% over the estimate).
SPLITS = [("zero2", "bf16", 2), ("zero2", "fp32", 2), ("fsdp", "bf16", 2), ("fsdp", "fp32", 1)]


@pytest.fixture(scope="module")
def launches(llama, weighty_model, long_games, tmp_path_factory):
    """Everything this module runs in ranks, in one launch per world size (`offload_workers.everything`):
    starting ranks costs more than most runs here (about 5 CPU s a rank). On 1 and 2 ranks the
    measured splits (`SPLITS` of that size) and the parity runs; on 2 ranks also where things
    live and the resumed runs (`resume_argvs`). {world: each rank's results}, and the resumes' folder."""
    plan = [(accum, llama, accum, variants(accum)) for accum in (1, 2)]
    root = tmp_path_factory.mktemp("offload")
    out = {}
    for world in (1, 2):
        cases = [(s, p, 1.0) for s, p, w in SPLITS if w == world]
        where, resumes = ((llama,), (resume_argvs(llama, root),)) if world == 2 else (None, None)
        out[world] = launch(everything, world, (plan, GLOBAL_BATCH, SEQ, LR, BUCKET_CAP_MB), where, resumes,
                            (weighty_model, cases, SPLIT_BATCH, SPLIT_SEQ, long_games), timeout_s=1200)
    return out, root


@pytest.fixture(scope="module")
def parity_runs(launches):
    """{world: rank 0's {accumulation: {variant: result}}}."""
    return {world: ranks[0]["parity"] for world, ranks in launches[0].items()}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("accum", [1, 2])
def test_offload_trains_exactly_as_without(parity_runs, llama, world, accum):
    runs = parity_runs[world][accum]
    offloaded = [name for name in runs if name.endswith("/offload")]
    assert len(offloaded) == 7
    for name in offloaded:
        got, want = runs[name], runs[name[:-len("/offload")]]
        assert got["losses"] == want["losses"], name  # floats compared exactly
        assert got["grad_norms"] == want["grad_norms"], name
        assert got["parameters"].keys() == want["parameters"].keys()
        for key, tensor in want["parameters"].items():
            assert torch.equal(got["parameters"][key], tensor), f"{name} {key}"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("accum", [1, 2])
def test_offload_under_the_nccl_like_harness_is_the_plain_run(parity_runs, world, accum):
    """Under the harness minidist takes its NCCL branches: a host shard goes through
    `flat.collective_device` before any collective (as a GPU rank sends it through its GPU), a
    host tensor given to a collective straight would raise, the collectives run at `wait()`. The
    runs are the plain offloaded ones, bit for bit; at least one host tensor went that way."""
    runs = parity_runs[world][accum]
    twins = [name for name in runs if name.endswith("/nccl-like")]
    assert len(twins) == len(SHARDED)
    for name in twins:
        got, want = runs[name], runs[name[:-len("/nccl-like")]]
        assert got["losses"] == want["losses"] and got["grad_norms"] == want["grad_norms"], name
        for key, tensor in want["parameters"].items():
            assert torch.equal(got["parameters"][key], tensor), f"{name} {key}"
        assert got["host_tensors_routed"] > 0, name
        # One rank: comm.py calls no library. ZeRO-1's collectives are all synchronous: nothing to defer.
        assert (got["collectives_deferred"] > 0) == (world > 1 and not name.startswith("zero1")), name


def test_offload_in_fp32_matches_one_process(parity_runs, llama):
    """The tolerances of tests/parallel/test_zero_fsdp.py: the split of the batch reorders fp32 sums."""
    ref_losses, ref_params, _ = train_reference(llama, steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=SEQ, lr=LR)
    for name, run in parity_runs[2][2].items():
        if name.endswith("/offload") and "bf16" not in name:
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
            for key, tensor in ref_params.items():
                torch.testing.assert_close(run["parameters"][key], tensor, rtol=1e-5, atol=LR / 50, msg=lambda m: f"{name} {key}: {m}")


def test_masters_and_their_gradients_live_on_the_host(launches):
    for rank in (ranks["where"] for ranks in launches[0][2]):
        for strategy, where in rank.items():
            assert where["masters_host"] and where["masters_fp32"], strategy
            assert where["grads_host"], strategy
            assert where["num_grads"] > 0 or strategy == "zero1", strategy  # ZeRO-1's gradients stay on the device
            assert not where["device_side_host"], strategy
            assert where["device_side_dtype"] == {"torch.bfloat16"}, strategy


def finetune_args(model, games, out, strategy, *extra, offload=True):
    return ["--model", model, "--data", games, "--output_dir", str(out), "--impl", "minidist", "--strategy", strategy,
            *(["--cpu_offload"] if offload else []),
            "--max_steps", "6", "--max_seq_length", "48", "--eval_prefixes", "0", "--batch_size_per_device", "2",
            "--learning_rate", "3e-3", "--warmup_steps", "2", "--seed", "3", *extra]


def resume_argvs(llama, tmp_path):
    """Per strategy of `RESUMES`, in its folder under `tmp_path`: the run without offload, the
    offloaded run straight, the one saving at 3, the one resumed from its checkpoint-3. All on 64
    games (6 steps of 4 draw 24): otherwise each rank of each of the 12 runs tokenizes all 3,000."""
    games, argvs = str(few_games(tmp_path)), []
    for strategy, form in RESUMES:
        root = tmp_path / strategy
        argvs += [finetune_args(llama, games, root / "plain", strategy, offload=False),
                  finetune_args(llama, games, root / "straight", strategy),
                  finetune_args(llama, games, root / "saved", strategy, "--save_steps", "3",
                                "--checkpoint_format", form),
                  finetune_args(llama, games, root / "saved", strategy, "--checkpoint_format", form,
                                "--resume", str(root / "saved" / "checkpoint-3"))]
    return argvs


def test_an_offloaded_run_resumes_bitwise(launches):
    """Per strategy: 6 steps straight; 6 steps saving at 3; then from checkpoint-3 to step 6 again.
    The resumed run's losses and final weights are the uninterrupted run's, exactly. And the
    training loop (which traces the first step's memory under a dispatch mode) with offload
    gives the losses of the loop without it."""
    by_world, tmp_path = launches
    results = by_world[2][0]["resumes"]
    for i, (strategy, form) in enumerate(RESUMES):
        plain, straight, saved, resumed = results[4 * i:4 * i + 4]
        assert straight["losses"] == plain["losses"], strategy
        assert saved["losses"] == straight["losses"], strategy
        assert resumed["losses"] == straight["losses"], strategy
        for name, tensor in straight["parameters"].items():
            assert torch.equal(resumed["parameters"][name], tensor), f"{strategy} {name}"
            assert torch.equal(plain["parameters"][name], tensor), f"{strategy} {name}"
        checkpoint = json.loads((tmp_path / strategy / "saved" / "checkpoint-6" / "checkpoint.json").read_text())
        assert checkpoint["step"] == 6


@pytest.fixture(scope="module")
def splits(launches):
    """{(strategy, precision, world): per rank, the measured split}, on conftest's 4.15M-parameter
    Llama (tests/memory/test_memory.py's) and games longer than the sequence: full, unpadded
    micro-batches, as the estimate assumes (`padded=False`)."""
    out = {}
    for world, ranks in launches[0].items():
        cases = [(s, p, w) for s, p, w in SPLITS if w == world]
        out.update({case: [rank["splits"][i] for rank in ranks] for i, case in enumerate(cases)})
    return out


@pytest.mark.parametrize("strategy,precision,world", SPLITS)
def test_the_estimates_device_and_host_columns_are_the_measured_split(weighty_model, splits, strategy, precision,
                                                                      world):
    """`memory/sides.py` splits a whole step's live tensors by the side that holds them; the
    estimator's `device` and `host` (`memory/offload_split.py`) within 5% of each, the tolerance
    of tests/memory/test_memory.py's whole-step peaks. Without offload the device would hold both."""
    from minidist.memory import estimator

    model_dir, ranks = weighty_model, splits[strategy, precision, world]
    options = {"bucket_cap_mb": 1.0} if strategy == "zero2" else {}
    shape = estimator.model_shape(model_dir)
    common = dict(strategy=strategy, impl="minidist", world_size=world, batch_size_per_device=SPLIT_BATCH,
                  max_seq_length=SPLIT_SEQ, mixed_precision=precision, padded=False, backend="gloo", **options)
    want = estimator.estimate(shape, estimator.setup(cpu_offload=True, **common))
    whole = estimator.estimate(shape, estimator.setup(**common))
    for rank, got in enumerate(ranks):
        for side in ("device", "host"):
            assert abs(got[side] - want[side]) <= 0.05 * want[side], f"rank {rank} {side}: measured {got[side]}, " \
                                                                       f"estimated {want[side]}"
        assert got["device"] < 0.8 * whole["peak"]  # what offload is for


@pytest.mark.parametrize("impl", ["torch", "minidist"])
def test_offload_with_ddp_is_refused_in_one_line(tiny_model, tmp_path, capsys, impl):
    """DDP has no optimizer shard to put on the host: one line, exit 2, naming what to use instead."""
    from in_process import said

    from minidist import finetune

    line = said(finetune.main, ["--model", tiny_model, "--output_dir", str(tmp_path), "--impl", impl, "--strategy", "ddp",
                                "--cpu_offload"], capsys)
    assert f"--cpu_offload needs sharded optimizer states, which {impl}/ddp does not have" in line
    assert "--strategy zero1 or zero2, or --strategy fsdp" in line
    line = said(memory_command_main, ["codellama/CodeLlama-7b-hf", "--strategy", "ddp", "--impl", impl, "--cpu_offload"],
                capsys)
    assert "--cpu_offload needs sharded optimizer states" in line


def memory_command_main(argv):
    from minidist.memory import __main__ as memory_command

    memory_command.main(argv)


def test_the_memory_command_prints_a_device_and_a_host_column(capsys):
    """CodeLlama-7b, FSDP by hand on 8 GPUs, bf16: the device keeps its compute-dtype shard, the
    host the fp32 master, its gradient, Adam's moments and the step's temporary (4 x 3.37 + 3.37 GB)."""
    memory_command_main(["codellama/CodeLlama-7b-hf", "--world_size", "8", "--strategy", "fsdp", "--impl", "minidist",
                         "--max_seq_length", "1024", "--cpu_offload"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[4].split() == ["device", "host"]
    columns = {line[:34].strip(): (line[35:45].strip(), line[46:].strip()) for line in lines[5:]}
    assert columns["optimizer states (AdamW)"] == ("", "6.74 GB")
    assert columns["parameters"] == ("", "3.37 GB")  # the fp32 shard: the master
    assert columns["compute-dtype shard (FSDP)"] == ("1.68 GB", "")
    assert columns["activations saved for backward"][1] == ""
    device, host = columns["peak per rank, each side"]
    assert host == "16.85 GB" and float(device.split()[0]) < 11
    assert "over PCIe per step and rank: 3.37 GB of gradients out, 1.68 GB of weights back" in out


def test_waiting_for_the_copies_synchronizes_once_per_batch_of_copies(monkeypatch):
    """After the wait, nothing is in flight: the next backward's end must not synchronize again
    unless a new asynchronous copy started (a GPU path, so the stream is a stand-in here)."""
    from types import SimpleNamespace

    from minidist.parallel import offload

    calls = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(synchronize=lambda: calls.append(1)))
    monkeypatch.setattr(offload, "_copying", True)  # as after to_host(..., non_blocking=True) on a GPU
    offload.wait_for_copies()
    offload.wait_for_copies()
    assert calls == [1] and offload._copying is False
