"""Hybrid sharding (`--strategy hsdp`) on 2 simulated nodes x 2 CPU ranks (`launch(..., nodes=2)`).

HSDP shards within a node and replicates across nodes (`parallel/mesh.py`). It must not change the
arithmetic: the hand-written one and PyTorch's FSDP2 on a 2-D mesh give the losses, gradient norms
and weights of one process training on the whole global batch, with and without accumulation (the
weights compared as `tests/reference.py` says, by what AdamW does to each element). It must send what
the formula says (`parallel/comm.py`): per rank, within its node 2 all-gathers of each layer unit,
1 of the root (it stays gathered from forward to backward) and 1 reduce-scatter over S ranks,
(3P - P_root)(S-1)/S elements, and across nodes the all-reduce of its gradient shard over the
R copies, 2(P/S)(R-1)/R, which is less than what flat FSDP's ring sends across nodes. It must
save and resume (sharded and full checkpoints, `parallel/flat_state.py`): a run resumed from a
checkpoint of step 2 ends bitwise where the uninterrupted run ends. And the memory estimate of
hsdp with S ranks per copy is fsdp's on S ranks, plus the replicate all-reduce's shard. The
hand-written run with accumulation and offload is trained again under the NCCL-like harness
(`tests/nccl_like.py`): bit for bit the plain run.
"""

import json

import pytest
import torch
from hsdp_workers import everything, one_step_bytes
from interrupted import few_games
from reference import assert_close_named, assert_parameters_match, run_reference

from minidist import finetune
from minidist.memory import estimator, hybrid
from minidist.runtime.launch import launch
from minidist.step import lr_schedule

# The full suite only: hybrid sharding on 4 ranks, in several launches.
pytestmark = pytest.mark.slow

STEPS, SEQ, LR, SEED, GLOBAL_BATCH = 4, 48, 3e-3, 3, 8
WORLD, NODES = 4, 2
# (implementation, batch per device, accumulation, checkpoint form): 4 ranks, a global batch of 8.
# "+offload": with --cpu_offload, whose masters and step live on the host (parallel/offload.py).
RUNS = [("minidist", 2, 1, "sharded"), ("minidist", 1, 2, "full"), ("torch", 2, 1, "sharded"),
        ("torch", 1, 2, "sharded"), ("minidist", 1, 2, "sharded+offload")]
# Trained again under the NCCL-like harness (tests/nccl_like.py), in the same launch: the hand-written
# run with accumulation and offload, the most collectives and host tensors (a twin: about 5 s here).
NCCL_LIKE = [("minidist", 1, 2, "sharded+offload")]


def argv_for(model, games, out, impl, batch, accum, form, *extra):
    form, *offload = form.split("+")
    extra = (*extra, "--cpu_offload") if offload else extra
    return ["--model", model, "--data", str(games), "--output_dir", str(out), "--impl", impl, "--strategy", "hsdp",
            "--max_steps", str(STEPS), "--max_seq_length", str(SEQ), "--learning_rate", str(LR), "--warmup_steps", "2",
            "--seed", str(SEED), "--eval_prefixes", "0", "--batch_size_per_device", str(batch),
            "--gradient_accumulation_steps", str(accum), "--save_steps", "2", "--checkpoint_format", form, *extra]


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """64 of the bundled games, what every run and the reference read: every rank of every run
    tokenizes its data again (about 0.2 s for all 3,000 here), and 4 steps of 8 use 32 games."""
    return few_games(tmp_path_factory.mktemp("games"))


@pytest.fixture(scope="module")
def reference(tiny_model, games):
    args = finetune.parse_args(["--max_steps", str(STEPS), "--warmup_steps", "2"])
    return run_reference(tiny_model, steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=SEQ, lr=LR, seed=SEED,
                         lr_lambda=lambda s: lr_schedule(s, args.warmup_steps, args.max_steps), data=games)


@pytest.fixture(scope="module")
def ranks(tiny_model, games, tmp_path_factory):
    """Everything this module runs on the 2 x 2 ranks, in one launch (`hsdp_workers.everything`):
    every run uninterrupted, then each resumed from its checkpoint of step 2 in a fresh folder,
    then offload's placement and one step's bytes. Rank 0's results, and every rank's bytes."""
    root = tmp_path_factory.mktemp("hsdp")
    argvs = [argv_for(tiny_model, games, root / f"{impl}-{b}x{a}-{form}", impl, b, a, form) for impl, b, a, form in RUNS]
    twins = [argv_for(tiny_model, games, root / f"{impl}-{b}x{a}-{form}-nccl-like", impl, b, a, form)
             for impl, b, a, form in NCCL_LIKE]
    resumes = []
    for impl, b, a, form in RUNS:
        out = root / f"{impl}-{b}x{a}-{form}-resumed"
        resumes.append((str(root / f"{impl}-{b}x{a}-{form}" / "checkpoint-2"), str(out),
                        argv_for(tiny_model, games, out, impl, b, a, form, "--resume", str(out / "checkpoint-2"))))
    by_rank = launch(everything, WORLD, tiny_model, argvs + twins, range(len(argvs), len(argvs) + len(twins)), resumes,
                     nodes=NODES, timeout_s=900)
    return {"root": root, **by_rank[0], "offload": [r["offload"] for r in by_rank],
            "step_bytes": [r["step_bytes"] for r in by_rank]}


@pytest.fixture(scope="module")
def runs(ranks):
    """{run: (uninterrupted, resumed, output folder)}, the NCCL-like twins keyed ("minidist/nccl-like", ...)."""
    root, whole = ranks["root"], ranks["whole"]
    whole, twins = whole[:len(RUNS)], whole[len(RUNS):]
    out = {run: (w, r, root / "{}-{}x{}-{}".format(*run)) for run, w, r in zip(RUNS, whole, ranks["resumed"])}
    # The twins, keyed ("minidist/nccl-like", ...): trained, not resumed.
    out.update({(f"{impl}/nccl-like", *rest): (twin, None, root / "{}-{}x{}-{}-nccl-like".format(impl, *rest))
                for (impl, *rest), twin in zip(NCCL_LIKE, twins)})
    return out


@pytest.mark.parametrize("impl,batch,accum,form", RUNS)
def test_hsdp_matches_one_process(runs, reference, impl, batch, accum, form):
    """Same losses (rtol 1e-5), gradient norms before clipping (rtol 1e-5) and weights as one process
    on the whole batch of 8. The weights as `reference.assert_parameters_match` says: elements no
    batch touched bit for bit, the few in AdamW's eps regime within what AdamW can move them, every
    other within rtol 1e-5 and atol 1% of one step (test_finetune.py's tolerance). The norms catch a
    wrong gradient scale, which AdamW hides from the weights (m / sqrt(v) is the same for 2g as for g)."""
    result, _, out = runs[impl, batch, accum, form]
    assert_close_named(torch.tensor(result["losses"]), torch.tensor(reference.losses), "losses", rtol=1e-5, atol=0)
    norms = [json.loads(line)["grad_norm"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_close_named(torch.tensor(norms), torch.tensor(reference.grad_norms), "gradient norms", rtol=1e-5, atol=0)
    assert_parameters_match(result["parameters"], reference, rtol=1e-5, atol=LR / 100)


@pytest.mark.parametrize("impl,batch,accum,form", NCCL_LIKE)
def test_hsdp_under_the_nccl_like_harness_is_the_plain_run(runs, impl, batch, accum, form):
    """The reduce-scatters within a node and the all-reduces across nodes deferred to `wait()`,
    their outputs NaN until then, minidist on its NCCL branches: the plain run, bit for bit."""
    plain, _, _ = runs[impl, batch, accum, form]
    twin, _, _ = runs[f"{impl}/nccl-like", batch, accum, form]
    assert twin["collectives_deferred"] >= STEPS  # the harness stood in every step's way
    assert twin["losses"] == plain["losses"]
    for name, tensor in plain["parameters"].items():
        assert torch.equal(twin["parameters"][name], tensor), name


@pytest.mark.parametrize("impl,batch,accum,form", RUNS)
def test_hsdp_resumes_bitwise_from_its_checkpoint(runs, impl, batch, accum, form):
    """A run resumed from step 2's checkpoint (replicas' shards saved once, read into every copy)
    ends with the uninterrupted run's losses and weights, bitwise."""
    whole, resumed, out = runs[impl, batch, accum, form]
    assert resumed["losses"] == whole["losses"]
    for name, tensor in whole["parameters"].items():
        assert torch.equal(resumed["parameters"][name], tensor), name
    saved = json.loads((out / "checkpoint-2" / "checkpoint.json").read_text())
    assert (saved["world_size"], saved["form"], saved["run"]["strategy"]) == (WORLD, form.split("+")[0], f"{impl}/hsdp")


def test_offloaded_hsdp_keeps_its_masters_on_the_host(ranks):
    """The "+offload" run above would match with offload silently off: here, after one bf16 step on
    2 x 2 ranks, the fp32 masters and their gradient shards are on the host, each unit's bf16 copy
    of its shard on the device (test_offload.py checks the same for zero1, zero2 and fsdp)."""
    for rank in ranks["offload"]:
        where = rank["hsdp"]
        assert where["masters_host"] and where["masters_fp32"] and where["grads_host"], where
        assert where["num_grads"] > 0 and not where["device_side_host"], where
        assert where["device_side_dtype"] == {"torch.bfloat16"}, where


def test_metrics_log_bytes_within_and_across_nodes(runs):
    """The loop logs rank 0's bytes split by node, and every rank's bytes across nodes (under HSDP
    all equal); torch's own strategies are not counted (None)."""
    keys = ("comm_bytes", "comm_bytes_within_node", "comm_bytes_across_nodes", "comm_bytes_across_nodes_by_rank")
    for (impl, *_), (_, _, out) in runs.items():
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        for r in records:
            if impl == "torch":
                assert [r[k] for k in keys] == [None] * 4
            else:
                assert r["comm_bytes_across_nodes"] > 0 and r["comm_bytes_within_node"] > 0
                assert r["comm_bytes_across_nodes"] + r["comm_bytes_within_node"] == r["comm_bytes"]
                assert r["comm_bytes_across_nodes_by_rank"] == [r["comm_bytes_across_nodes"]] * WORLD


@pytest.fixture(scope="module")
def step_bytes(ranks):
    return ranks["step_bytes"]


def test_simulated_nodes_give_each_rank_its_node(step_bytes):
    """launch(nodes=2): local ranks 0, 1 on each node; hsdp's default shard size is the ranks per node."""
    assert [r["hsdp"]["local"] for r in step_bytes] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [(r["hsdp"]["shard_rank"], r["hsdp"]["replicate_rank"]) for r in step_bytes] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(r["hsdp"]["shard_size"] == 2 and r["hsdp"]["replicate_size"] == 2 for r in step_bytes)
    assert all(r["fsdp"]["shard_size"] == 4 and r["fsdp"]["replicate_size"] == 1 for r in step_bytes)
    # The copies hold the same reduced gradient shards: rank r and rank r + 2.
    for a, b in ((0, 2), (1, 3)):
        for x, y in zip(step_bytes[a]["hsdp"]["grads"], step_bytes[b]["hsdp"]["grads"]):
            assert torch.equal(x, y)


def test_bytes_within_and_across_nodes_follow_the_formula(step_bytes):
    """One fp32 step, per rank, P = the units' padded elements:

    - hsdp (S = 2 per node, R = 2 nodes): within (3P - P_root)(S-1)/S x 4 bytes (2 all-gathers
      of each layer unit, 1 of the root, which stays gathered from forward to backward, and 1
      reduce-scatter), across 2(P/S)(R-1)/R x 4 (the all-reduce of the shard), on every rank;
    - flat fsdp (N = 4): (3P - P_root)(N-1)/N x 4 per rank on one ring 0 -> 1 -> 2 -> 3 -> 0; ranks 1 and 3
      send to a rank on the other node, so all of theirs crosses nodes, ranks 0 and 2 none of it.
    Across nodes hsdp sends less, both on the busiest rank and summed over the ranks."""
    S, R, N = 2, 2, 4
    units_h, units_f = step_bytes[0]["hsdp"]["units"], step_bytes[0]["fsdp"]["units"]  # the root last
    p_hsdp, p_fsdp = sum(units_h), sum(units_f)
    for rank, r in enumerate(step_bytes):
        h, f = r["hsdp"]["bytes"], r["fsdp"]["bytes"]
        assert h["comm_bytes_within_node"] == (3 * p_hsdp - units_h[-1]) * (S - 1) / S * 4
        assert h["comm_bytes_across_nodes"] == 2 * (p_hsdp / S) * (R - 1) / R * 4
        assert f["comm_bytes"] == (3 * p_fsdp - units_f[-1]) * (N - 1) / N * 4
        assert f["comm_bytes_across_nodes"] == (f["comm_bytes"] if rank % 2 else 0)
    across = {k: [r[k]["bytes"]["comm_bytes_across_nodes"] for r in step_bytes] for k in ("hsdp", "fsdp")}
    assert max(across["hsdp"]) < max(across["fsdp"]) and sum(across["hsdp"]) < sum(across["fsdp"])


def test_the_estimate_of_hsdp_is_fsdp_on_its_shard_group_plus_the_all_reduce():
    """CodeLlama-7b on 2 nodes x 4: hsdp's model states are fsdp's on 4 ranks (16P/4), not on 8;
    the peak (in backward at this batch) adds one fp32 shard of the largest unit (the root)."""
    shape = estimator.model_shape("codellama/CodeLlama-7b-hf")
    sizes = {"batch_size_per_device": 2, "max_seq_length": 1024}
    for impl in ("minidist", "torch"):
        hsdp = estimator.setup(strategy="hsdp", impl=impl, world_size=8, hsdp_shard_size=4, **sizes)
        h, f = (estimator.estimate(shape, st) for st in (hsdp, estimator.setup(strategy="fsdp", impl=impl,
                                                                                world_size=4, **sizes)))
        for term in ("parameters", "gradients", "optimizer_states", "gathered_units", "activations"):
            assert h[term] == f[term], term
        # The terms asked for one by one (as lesson 10's notebook might) are the same as in the estimate.
        assert estimator.model_states(shape, hsdp) == estimator.model_states(shape, estimator.setup(
            strategy="fsdp", impl=impl, world_size=4, **sizes))
        assert estimator.buffers(shape, hsdp)["gathered_units"] == f["gathered_units"]
        extra = 4 * -(-shape.root_params // 4)
        assert hybrid.all_reduce_buffer(shape, hsdp) == extra
        assert estimator.peak_moment(shape, hsdp)[0] == "backward"
        assert h["peak"] == f["peak"] + extra
        # One node (no --hsdp_shard_size): no copies, exactly fsdp on all the ranks.
        one = estimator.estimate(shape, estimator.setup(strategy="hsdp", impl=impl, world_size=4, **sizes))
        assert one == f


def test_launch_refuses_nodes_that_do_not_divide_the_ranks():
    with pytest.raises(ValueError, match="needs nodes that divide the 4 ranks equally, got nodes=3"):
        launch(one_step_bytes, 4, "unused", [], nodes=3)
