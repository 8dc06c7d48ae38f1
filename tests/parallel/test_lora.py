"""LoRA (`--lora_rank`, minidist/hf/lora.py) under every strategy, against one process with peft.

The reference (tests/reference.py) applies peft's `get_peft_model` itself and trains the whole
global batch in one process. Every strategy, on 2 ranks with 2 accumulation steps, must give the
same losses and LoRA weights (fp32, tight), leave the frozen base bit-identical on every rank,
send only the adapters' gradients, and write an adapter that `PeftModel.from_pretrained` loads.
The hand-written FSDP also under the NCCL-like harness (`tests/nccl_like.py`): the plain run, bit
for bit.
"""

import json
import signal
from pathlib import Path

import pytest
import torch
from in_process import run_here
from interrupted import few_games, interrupt_with_torchrun
from lora_workers import everything
from peft import LoraConfig, PeftModel, get_peft_model
from reference import train_reference
from transformers import AutoModelForCausalLM

from minidist import finetune
from minidist.runtime.launch import launch
from minidist.step import lr_schedule

# The full suite only: LoRA under every strategy, in several launches.
pytestmark = pytest.mark.slow

STEPS, SEQ, LR, SEED, RANK = 4, 48, 3e-3, 3, 4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

CASES = [  # (implementation, strategy, extra flags): 2 ranks x 1 sequence x 2 accumulation steps
    ("torch", "ddp", []),
    ("torch", "fsdp", []),
    ("minidist", "ddp", ["--bucket_cap_mb", "0.01"]),
    ("minidist", "zero1", ["--bucket_cap_mb", "0.01"]),
    ("minidist", "zero2", ["--bucket_cap_mb", "0.01", "--gradient_checkpointing"]),
    ("minidist", "fsdp", []),
    ("minidist", "fsdp", ["--gradient_checkpointing", "--lora_target_modules", "all-linear"]),
    ("minidist", "fsdp", ["--no_layer_wrap_policy"]),
]


# Trained again under the NCCL-like harness (tests/nccl_like.py), in the same launch: the hand-written
# FSDP, whose frozen base is all-gathered beside the adapters (`parallel/frozen.py`), LoRA's own
# collectives. DDP and ZeRO reduce the adapters as any gradient, under the harness in test_ddp.py and
# test_zero_fsdp.py; a LoRA twin costs about 6 s here.
NCCL_LIKE = [("minidist", "fsdp", [])]


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """64 of the bundled games for the references and every run (4 steps of 4 draw 16): otherwise
    each rank of each of the module's 30-odd runs tokenizes all 3,000."""
    return str(few_games(tmp_path_factory.mktemp("games")))


def argv_for(model, games, out, impl, strategy, extra):
    name = f"{impl}-{strategy}{''.join(extra)}".replace("--", "-")
    return ["--model", model, "--data", games, "--max_steps", str(STEPS), "--max_seq_length", str(SEQ),
            "--learning_rate", str(LR),
            "--warmup_steps", "2", "--seed", str(SEED), "--eval_prefixes", "0", "--output_dir", str(out / name),
            "--impl", impl, "--strategy", strategy, "--batch_size_per_device", "1",
            "--gradient_accumulation_steps", "2", "--lora_rank", str(RANK), *extra]


def targets_of(extra):
    return "all-linear" if "all-linear" in extra else ATTENTION


@pytest.fixture(scope="module")
def references(tiny_model, games):
    """Per target set: the single-process losses and final state (frozen base included)."""
    args = finetune.parse_args(["--max_steps", str(STEPS), "--warmup_steps", "2"])
    out = {}
    for targets in ("all-linear", tuple(ATTENTION)):
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets if isinstance(targets, str)
                            else list(targets), task_type="CAUSAL_LM")
        losses, state, trained = train_reference(tiny_model, steps=STEPS, global_batch=4, seq_len=SEQ, lr=LR, seed=SEED,
                                                 lr_lambda=lambda s: lr_schedule(s, args.warmup_steps, args.max_steps), lora_config=config,
                                                 data=games)
        out[targets if isinstance(targets, str) else "attention"] = losses, state, trained
    return out


FULL = [("torch", "ddp", 2, 1), ("torch", "fsdp", 2, 1), ("minidist", "ddp", 2, 1), ("minidist", "zero1", 2, 1),
        ("minidist", "zero2", 2, 1), ("minidist", "fsdp", 2, 1), ("minidist", "hsdp", 4, 2),
        ("torch", "hsdp", 4, 2)]  # (implementation, strategy, ranks, nodes)
RESUMED = [("minidist", "fsdp"), ("torch", "ddp")]  # stopped by SIGTERM under torchrun, then resumed
PEAKS = [("minidist", "fsdp", []), ("minidist", "fsdp", ["--mixed_precision", "bf16", "--gradient_checkpointing"]),
         ("minidist", "fsdp", ["--gradient_accumulation_steps", "2", "--lora_target_modules", "all-linear"]),
         ("torch", "fsdp", ["--mixed_precision", "bf16", "--lora_dropout", "0.1"]),
         ("minidist", "zero2", ["--mixed_precision", "bf16"]), ("torch", "ddp", ["--mixed_precision", "bf16"])]


def full_argv(model, games, impl, strategy, world, out, *extra):
    """A run with --checkpoint_format full, saving at 2 and 4: a global batch of 4, as `references`
    (2 ranks x 2 accumulation steps, or 4 x 1)."""
    return ["--model", model, "--data", games, "--output_dir", str(out), "--impl", impl,
            "--strategy", strategy, "--max_steps", str(STEPS), "--max_seq_length", str(SEQ), "--learning_rate", str(LR),
            "--eval_prefixes", "0", "--batch_size_per_device", "1", "--gradient_accumulation_steps", str(4 // world),
            "--warmup_steps", "2", "--seed", str(SEED), "--lora_rank", str(RANK), "--save_steps", "2",
            "--checkpoint_format", "full", *extra,
            *(["--bucket_cap_mb", "0.01"] if impl == "minidist" and strategy in ("ddp", "zero1", "zero2") else [])]


def stopped_argv(model, games, impl, strategy, out, *extra):
    """6 steps of 4 games (24 of the 64), for the run stopped by SIGTERM, its reference and its resume."""
    return ["--model", model, "--data", games, "--output_dir", str(out), "--impl", impl,
            "--strategy", strategy, "--max_steps", "6", "--max_seq_length", "48", "--eval_prefixes", "0",
            "--batch_size_per_device", "2", "--warmup_steps", "2", "--seed", "3", "--lora_rank", "4", *extra]


def peak_argv(model, games, out, impl, strategy, extra):
    """5 steps on the weighty model, each step's whole peak of live tensors traced (`--trace_memory_every 1`)."""
    return ["--model", model, "--data", games, "--max_steps", "5", "--max_seq_length", "32",
            "--batch_size_per_device", "2", "--eval_prefixes", "0", "--no_save", "--trace_memory_every", "1",
            "--lora_rank", "8", "--impl", impl, "--strategy", strategy, "--output_dir", str(out), *extra]


@pytest.fixture(scope="module")
def launches(tiny_model, games, weighty_model, long_games, tmp_path_factory):
    """Every run of this module, in one launch per world size (`lora_workers.everything`): starting
    ranks costs more than a run (about 5 CPU s a rank). On 2 ranks, one after the other: the peaks
    (`PEAKS`), every case and a bf16 FSDP run (the NCCL-like twins too), the 2-rank `FULL` runs and
    their resumes from step 2, and the `RESUMED` runs' references and resumes (torchrun stops them
    first, in processes of its own: a run killed cannot share the ranks). On 2 simulated nodes x 2
    ranks: the 4-rank `FULL` runs and their resumes. Returns each world size's results by rank, the
    output folders' root and the cases' argument lists in the order of their results."""
    root = tmp_path_factory.mktemp("lora")
    argvs = [argv_for(tiny_model, games, root, *case) for case in CASES]
    argvs.append(argv_for(tiny_model, games, root, "minidist", "fsdp", ["--mixed_precision", "bf16"]))
    twins = [argv_for(tiny_model, games, root / "nccl-like", *case) for case in NCCL_LIKE]
    peaks = [peak_argv(weighty_model, long_games, root / "peaks" / f"{i}", *case) for i, case in enumerate(PEAKS)]
    stopped = []
    for impl, strategy in RESUMED:
        out = root / "sigterm" / f"{impl}-{strategy}"
        out.mkdir(parents=True)
        first = interrupt_with_torchrun(stopped_argv(tiny_model, games, impl, strategy, out / "out", "--save_steps",
                                                     "2"), out / "torchrun.log", signal.SIGTERM, "step:3")
        (out / "stopped.log").write_text(first["log"])
        stopped += [stopped_argv(tiny_model, games, impl, strategy, out / "reference"),
                    stopped_argv(tiny_model, games, impl, strategy, out / "out", "--save_steps", "2", "--resume")]
    by_world = {}
    for world, nodes in sorted({(w, n) for *_, w, n in FULL}):
        full, resumes = [], []
        for impl, strategy in [(i, s) for i, s, w, n in FULL if (w, n) == (world, nodes)]:
            whole, resumed = root / "full" / f"{impl}-{strategy}", root / "full" / f"{impl}-{strategy}-resumed"
            full.append(full_argv(tiny_model, games, impl, strategy, world, whole))
            resumes.append((str(whole / "checkpoint-2"), str(resumed / "checkpoint-2"),
                            full_argv(tiny_model, games, impl, strategy, world, resumed, "--resume",
                                      str(resumed / "checkpoint-2"))))
        if world == 2:
            by_world[world] = launch(everything, world, argvs + twins, range(len(argvs), len(argvs) + len(twins)),
                                     peaks, full, resumes, stopped, nodes=nodes, timeout_s=1800)
        else:
            by_world[world] = launch(everything, world, [], (), [], full, resumes, [], nodes=nodes, timeout_s=900)
    return {"ranks": by_world, "root": root, "argvs": argvs + twins}


@pytest.fixture(scope="module")
def runs(launches):
    """Each case's results, by rank: {argv: [rank 0's, rank 1's]}, and the output folders' root."""
    ranks = [rank["lora"] for rank in launches["ranks"][2]]
    return {tuple(argv): [rank[i] for rank in ranks] for i, argv in enumerate(launches["argvs"])}, launches["root"]


def reference_for(references, extra):
    return references["all-linear" if "all-linear" in extra else "attention"]


@pytest.mark.parametrize("impl,strategy,extra", CASES)
def test_lora_matches_one_process_and_leaves_the_base_untouched(tiny_model, games, references, runs, impl, strategy,
                                                                extra):
    results, out = runs
    argv = argv_for(tiny_model, games, out, impl, strategy, extra)
    per_rank = results[tuple(argv)]
    result = per_rank[0]
    ref_losses, ref_state, trained = reference_for(references, extra)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert result["parameters"].keys() == ref_state.keys()
    lora_names = [n for n in ref_state if "lora_" in n]
    assert sum(ref_state[n].numel() for n in lora_names) == trained > 0
    for name in lora_names:  # the adapters trained as in one process (tolerance: test_finetune.py's)
        torch.testing.assert_close(result["parameters"][name], ref_state[name], rtol=1e-5, atol=LR / 100, msg=lambda m: f"{name}: {m}")
    for name, ref in ref_state.items():  # the frozen base, gathered from every rank's shard where sharded
        if "lora_" not in name:
            assert torch.equal(result["parameters"][name], ref), name
    assert any(result["parameters"][n].abs().sum() > 0 for n in lora_names if "lora_B" in n)  # B left zero
    for rank in per_rank:  # replicated strategies: every rank's own copy of the base
        assert bool(rank["frozen"]) == (strategy != "fsdp")
        for name, tensor in rank["frozen"].items():
            assert torch.equal(tensor, ref_state[name]), name
    records = [json.loads(line) for line in (Path(argv[argv.index("--output_dir") + 1]) / "metrics.jsonl")
               .read_text().splitlines()]
    if impl == "minidist" and strategy != "fsdp":
        # Only the adapters' gradients are reduced: 2 P_lora (N-1)/N fp32 elements (ZeRO: up to padding).
        for r in records:
            assert 0 <= r["comm_bytes"] - 2 * trained * (2 - 1) / 2 * 4 < 2 * 4 * 2 * 64
    if impl == "minidist" and strategy == "fsdp":
        # Every layer unit, frozen flat and trainable flat, gathered twice per micro-batch (2 x 2), the
        # root once per micro-batch (it stays gathered from forward to backward: 2 x P_root less), and
        # only the adapters reduce-scattered, once: (4 (P + P_lora) - 2 P_root + P_lora) (N-1)/N fp32
        # elements, up to the padding of each flat (fewer than N elements). Without the wrap policy the
        # whole model is the root. A full fine-tune would send (4 + 1) P - 2 P_root.
        from minidist.memory.estimator import model_shape

        base = model_shape(tiny_model).num_params
        root = base + trained if "--no_layer_wrap_policy" in extra else model_shape(tiny_model).root_params
        for r in records:
            sent = (4 * (base + trained) - 2 * root + trained) * (2 - 1) / 2 * 4
            assert 0 <= r["comm_bytes"] - sent < 5 * 6 * 4


@pytest.mark.parametrize("impl,strategy,extra", NCCL_LIKE)
def test_lora_under_the_nccl_like_harness_is_the_plain_run(tiny_model, games, runs, impl, strategy, extra):
    """Adapters' reductions and the frozen base's all-gathers (FSDP) deferred to `wait()`, their
    outputs NaN until then: the plain run's losses, weights and frozen copies, bit for bit."""
    results, out = runs
    plain = results[tuple(argv_for(tiny_model, games, out, impl, strategy, extra))]
    twin = results[tuple(argv_for(tiny_model, games, out / "nccl-like", impl, strategy, extra))]
    for got, want in zip(twin, plain):
        assert got["collectives_deferred"] >= STEPS  # the harness stood in every step's way
        assert got["losses"] == want["losses"]
        for key in ("parameters", "frozen"):
            assert (got[key] or {}).keys() == (want[key] or {}).keys(), key
            for name, tensor in (want[key] or {}).items():
                assert torch.equal(got[key][name], tensor), name


def test_fsdp_keeps_the_frozen_base_in_bf16_and_tracks_fp32(tiny_model, games, references, runs):
    results, out = runs
    result = results[tuple(argv_for(tiny_model, games, out, "minidist", "fsdp", ["--mixed_precision", "bf16"]))][0]
    ref_losses, ref_state, _ = references["attention"]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-2, atol=0)
    assert not torch.equal(torch.tensor(result["losses"]), torch.tensor(ref_losses))
    for name, ref in ref_state.items():  # the frozen flat is bf16: the base rounded once, then untouched
        if "lora_" not in name:
            assert torch.equal(result["parameters"][name], ref.to(torch.bfloat16).float()), name


@pytest.mark.parametrize("impl,strategy", [("minidist", "fsdp"), ("torch", "ddp"), ("minidist", "zero2")])
def test_the_saved_adapter_loads_with_peft_and_gives_the_same_logits(tiny_model, games, runs, impl, strategy):
    results, out = runs
    extra = next(extra for i, s, extra in CASES if (i, s) == (impl, strategy))
    argv = argv_for(tiny_model, games, out, impl, strategy, extra)
    result, folder = results[tuple(argv)][0], Path(argv[argv.index("--output_dir") + 1]) / "model"
    assert (folder / "adapter_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    assert not (folder / "model.safetensors").exists()  # the adapter alone, not the base again
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder).eval()
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=ATTENTION, task_type="CAUSAL_LM")
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), config).eval()
    trained.load_state_dict(result["parameters"])
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)


@pytest.mark.parametrize("argv,expected", [
    (["--lora_rank", "0"], "--lora_rank must be at least 1, got 0"),
    (["--lora_rank", "-2"], "--lora_rank must be at least 1, got -2"),
    (["--lora_rank", "4", "--lora_alpha", "0"], "--lora_alpha must be more than 0"),
    (["--lora_rank", "4", "--lora_alpha", "-1"], "--lora_alpha must be more than 0"),
    # A scale of inf / 4 makes every adapted layer's output inf: refused, not trained into a divergence.
    (["--lora_rank", "4", "--lora_alpha", "inf"], "--lora_alpha must be more than 0 and finite, got inf; leave it out "
                                                  "(alpha = 2 x --lora_rank: 8 here) or pass a positive number"),
    (["--lora_rank", "4", "--lora_alpha", "nan"], "--lora_alpha must be more than 0 and finite, got nan"),
    (["--lora_rank", "4", "--lora_dropout", "1"], "--lora_dropout must be in [0, 1)"),
    (["--lora_rank", "4", "--lora_dropout", "nan"], "--lora_dropout must be in [0, 1), got nan"),
    (["--lora_rank", "inf"], "argument --lora_rank: invalid int value: 'inf'"),
    (["--lora_alpha", "8"], "--lora_alpha needs --lora_rank"),
    (["--lora_rank", "4", "--lora_target_modules", "q_proj,c_attn"], "has no linear layer named c_attn"),
])
def test_bad_lora_flags_end_with_one_line(tiny_model, tmp_path, capsys, argv, expected):
    status, err = run_here(["--model", tiny_model, "--impl", "torch", "--output_dir", str(tmp_path),
                            "--eval_prefixes", "0", *argv], capsys)
    assert status == 2
    assert expected in err.strip().splitlines()[-1], err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def full_resumes(launches):
    """Each strategy with --checkpoint_format full: 4 steps uninterrupted (saving at 2 and 4), then
    resumed in a fresh folder from its checkpoint of step 2: {(impl, strategy): (whole, resumed, folder)}."""
    out = {}
    for world, nodes in sorted({(w, n) for *_, w, n in FULL}):
        cases = [(i, s) for i, s, w, n in FULL if (w, n) == (world, nodes)]
        rank0 = launches["ranks"][world][0]
        out.update({case: (w, r, launches["root"] / "full" / f"{case[0]}-{case[1]}")
                    for case, w, r in zip(cases, rank0["full"], rank0["resumed"])})
    return out


@pytest.mark.parametrize("impl,strategy", [case[:2] for case in FULL])
def test_a_full_lora_checkpoint_holds_the_adapter_and_resumes_bitwise(tiny_model, full_resumes, impl, strategy):
    """`--checkpoint_format full` under LoRA: checkpoint-N/model is the adapter (peft loads it onto
    the base, with the run's adapter weights), and a run resumed from it ends bitwise where the
    uninterrupted run ends."""
    whole, resumed, out = full_resumes[impl, strategy]
    assert resumed["losses"] == whole["losses"]  # floats compared exactly
    for name, tensor in whole["parameters"].items():
        assert torch.equal(resumed["parameters"][name], tensor), name
    folder = out / "checkpoint-4" / "model"
    assert (folder / "adapter_config.json").exists() and not (folder / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder)
    adapter = {name: tensor for name, tensor in loaded.state_dict().items() if "lora_" in name}
    assert adapter.keys() == {name for name in whole["parameters"] if "lora_" in name}
    for name, tensor in adapter.items():
        assert torch.equal(tensor, whole["parameters"][name]), name


@pytest.mark.parametrize("impl", ["minidist", "torch"])
def test_lora_under_hsdp_matches_one_process(full_resumes, references, impl):
    """LoRA under hybrid sharding, 2 simulated nodes x 2 ranks (`launch(..., nodes=2)`): the losses
    and adapters of one process with peft (the tolerances of the 2-rank cases above), the frozen
    base untouched (sharded within a node and replicated across: gathered, never reduced)."""
    result, _, out = full_resumes[impl, "hsdp"]
    ref_losses, ref_state, trained = references["attention"]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert result["parameters"].keys() == ref_state.keys()
    for name, ref in ref_state.items():
        if "lora_" in name:
            torch.testing.assert_close(result["parameters"][name], ref, rtol=1e-5, atol=LR / 100, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(result["parameters"][name], ref), name
    assert any(result["parameters"][n].abs().sum() > 0 for n in ref_state if "lora_B" in n)
    if impl == "minidist":  # across nodes, only the adapters' gradient shards are all-reduced over the
        # R = 2 copies: 2 (P_lora / S)(R-1)/R fp32 elements per step, up to each unit's padding (< S)
        for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()):
            assert 0 <= r["comm_bytes_across_nodes"] - 4 * trained / 2 < 4 * 3 * 2


@pytest.fixture(scope="module")
def stopped_runs(launches):
    """Per case: (torchrun's log of the run stopped by SIGTERM, the uninterrupted run, the resumed one)."""
    results = launches["ranks"][2][0]["stopped"]
    return {case: ((launches["root"] / "sigterm" / "{}-{}".format(*case) / "stopped.log").read_text(),
                   *results[2 * i:2 * i + 2]) for i, case in enumerate(RESUMED)}


@pytest.mark.parametrize("impl,strategy", RESUMED)
def test_a_lora_run_stopped_by_sigterm_resumes_bitwise(stopped_runs, impl, strategy):
    log, reference, resumed = stopped_runs[impl, strategy]
    assert "stopped by SIGTERM after step 3: saved" in log, log[-2000:]
    assert resumed["losses"] == reference["losses"]  # floats compared exactly
    for name, tensor in reference["parameters"].items():
        assert torch.equal(resumed["parameters"][name], tensor), name


@pytest.mark.parametrize("impl,strategy,extra", CASES + [("minidist", "fsdp", ["--mixed_precision", "bf16"])])
def test_the_estimate_of_lora_model_states_is_what_the_loop_measures(tiny_model, games, runs, impl, strategy, extra):
    """Parameters (frozen base and adapters), gradients and AdamW states of the adapters only, per
    rank (the fullest), as `memory/lora_terms.py` estimates them: within 2%, as tests/memory/test_memory.py
    holds a full fine-tune."""
    from minidist.memory import estimator

    _, out = runs
    argv = argv_for(tiny_model, games, out, impl, strategy, extra)
    records = [json.loads(line) for line in (Path(argv[argv.index("--output_dir") + 1]) / "metrics.jsonl")
               .read_text().splitlines()]
    measured = records[-1]["memory_bytes"]
    options = {"bucket_cap_mb": 0.01} if "--bucket_cap_mb" in extra else {}
    setup = estimator.setup(strategy=strategy, impl=impl, world_size=2, batch_size_per_device=1, max_seq_length=SEQ,
                            mixed_precision="bf16" if "bf16" in extra else "fp32", gradient_accumulation_steps=2,
                            layer_wrap_policy="--no_layer_wrap_policy" not in extra,
                            gradient_checkpointing="--gradient_checkpointing" in extra, lora_rank=RANK,
                            lora_target_modules="all-linear" if "all-linear" in extra else None, **options)
    estimate = estimator.model_states(estimator.model_shape(tiny_model), setup)
    full = estimator.model_states(estimator.model_shape(tiny_model), estimator.setup(**setup.options.__dict__,
                                                                                     world_size=2))
    for term in ("parameters", "gradients", "optimizer_states"):
        got, want = max(measured[term]), estimate[term]
        assert abs(got - want) <= 0.02 * want, f"{term}: measured {got}, estimated {want}"
    # LoRA's point: gradients and optimizer states a small fraction of a full fine-tune's.
    assert estimate["gradients"] + estimate["optimizer_states"] < 0.05 * (full["gradients"] + full["optimizer_states"])


def test_a_lora_checkpoint_resumed_without_its_lora_flags_is_refused_in_one_line(tiny_model, tmp_path, capsys):
    common = ["--model", tiny_model, "--output_dir", str(tmp_path), "--eval_prefixes", "0", "--max_steps", "1",
              "--max_seq_length", "32", "--batch_size_per_device", "2", "--impl", "minidist", "--strategy", "fsdp",
              "--no_save"]
    finetune.main([*common, "--lora_rank", "4", "--save_steps", "1"])
    for flags, theirs in ([], "minidist/fsdp"), (["--lora_rank", "8"], "minidist/fsdp + LoRA r=8"):
        status, err = run_here([*common, *flags, "--resume"], capsys)
        assert status == 2 and "Traceback" not in err
        assert (f"was written with another strategy (minidist/fsdp + LoRA r=4 alpha=8 on q_proj,k_proj,v_proj,o_proj; "
                f"this run: {theirs}" in err.strip().splitlines()[-1]), err


def test_codellama_lora_numbers_to_know():
    """P_lora at rank 16 is r (d_in + d_out) per target layer, 32 layers; model states about 2P + 16 P_lora."""
    from minidist.memory import estimator, lora_terms

    shape = estimator.model_shape("codellama/CodeLlama-7b-hf")  # the bundled config
    attention = estimator.setup(strategy="zero1", world_size=1, lora_rank=16)
    assert lora_terms.lora_params(shape, attention) == 32 * 4 * 16 * (4096 + 4096) == 16_777_216
    every = estimator.setup(strategy="zero1", world_size=1, lora_rank=16, lora_target_modules="all-linear")
    assert lora_terms.lora_params(shape, every) == 16_777_216 + 32 * 3 * 16 * (4096 + 11008) == 39_976_960
    states = sum(estimator.model_states(shape, attention).values())
    assert abs(states - (2 * shape.num_params + 16 * 16_777_216)) < 1e-3 * states  # 13.75 GB, not 108


@pytest.mark.parametrize("argv,expected", [
    (["--lora_rank", "0"], "--lora_rank must be at least 1, got 0"),
    (["--lora_rank", "16", "--lora_target_modules", "c_attn"], "has no linear layer named c_attn"),
])
def test_the_memory_command_takes_lora_flags_and_refuses_bad_ones_in_one_line(capsys, argv, expected):
    from minidist.memory.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main(["codellama/CodeLlama-7b-hf", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert expected in err.strip().splitlines()[-1], err


def test_the_whole_step_peak_under_lora_is_what_the_estimate_says(weighty_model, launches):
    """The whole step's peak of live tensors (`measure.LiveTensors`) under LoRA, on 2 gloo ranks,
    within 5% of the estimate, as tests/memory/test_memory.py holds a full fine-tune: FSDP's units are
    gathered whole but only their adapters have gradients and are reduce-scattered (`moments.py`),
    and the activations are traced with the adapters (dropout's masks too: `lora_terms.adapt`).

    Each rank's lowest of steps 2 to 5 (the first creates AdamW's states): in about one step in
    ten, one more gathered bf16 layer of FSDP2 (1.5 MB, 8.5% of the peak) is still alive at its
    peak, whenever gloo's threads let go of it (Python's garbage collector off, it still happens);
    with 3 steps one run in three saw it in both steps 2 and 3."""
    from minidist.memory import estimator

    shape = estimator.model_shape(weighty_model)

    def flag(extra, f, default):  # the value given to flag f in the case's extra arguments
        return extra[extra.index(f) + 1] if f in extra else default

    for i, (impl, name, extra) in enumerate(PEAKS):
        folder = launches["root"] / "peaks" / f"{i}"  # trained first in the module's 2-rank launch
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        setup = estimator.setup(strategy=name, impl=impl, world_size=2, batch_size_per_device=2, max_seq_length=32,
                                padded=False, backend="gloo", mixed_precision=flag(extra, "--mixed_precision", "fp32"),
                                gradient_checkpointing="--gradient_checkpointing" in extra, lora_rank=8,
                                gradient_accumulation_steps=int(flag(extra, "--gradient_accumulation_steps", 1)),
                                lora_target_modules=flag(extra, "--lora_target_modules", None),
                                lora_dropout=float(flag(extra, "--lora_dropout", 0)))
        want = estimator.estimate(shape, setup)["peak"]
        for got in [min(step) for step in zip(*(r["memory_bytes"]["peak"] for r in records[1:]))]:  # per rank
            assert abs(got - want) <= 0.05 * want, f"{impl}/{name} {extra}: measured {got}, estimated {want}"


@pytest.mark.parametrize("mode,padded", [("fp32", False), ("bf16", True), ("autocast", False)])
@pytest.mark.parametrize("lora_key", [(4, None, 0.0), (4, "all-linear", 0.1)], ids=["attention", "all-linear-dropout"])
def test_lora_activations_traced_are_what_a_real_peft_forward_saves(mode, padded, lora_key):
    """The trace with LoRA's adapters (`lora_terms.adapt`): byte for byte, layer by layer, what a
    real CPU forward of the peft model saves, and in all what the loop's tracker counts. LoRA
    changes it: a frozen linear layer saves no input (its weight wants no gradient; layer 0's input
    wants none either), each adapter saves its r-wide `lora_A` output, and with dropout a mask and
    the dropped input."""
    from tiny_configs import BATCH, CONFIGS, SEQ, assert_equal

    from minidist.memory import lora_terms, measure, trace
    from minidist.step import token_loss_sum

    config = CONFIGS["llama"]()
    adapt = lora_terms.adapt(lora_key, mode)
    torch.manual_seed(0)
    model = adapt(trace.build(config, mode))
    batch = trace.batch_for(BATCH, SEQ, padded, config.vocab_size)
    real = trace.run_and_record(model, batch, mode)
    assert_equal(trace.trace(config, BATCH, SEQ, mode, padded, adapt=adapt), real, f"LoRA {lora_key} {mode}")
    assert not {p.untyped_storage()._cdata for p in model.parameters()} & real.storages.keys()  # frozen: model states
    with measure.SavedActivations() as tracker:
        loss = token_loss_sum(model, batch, trace._Autocast(mode))
    assert tracker.current == real.saved + real.weight_copies
    del loss
    base = trace.trace(config, BATCH, SEQ, mode, padded)
    assert real.layers[0] < real.layers[1]  # layer 0's frozen layers get an input that wants no gradient
    if lora_key[2] == 0:  # q, k, v, o: less saved than a full fine-tune (no input kept for a frozen weight)
        assert real.saved + real.weight_copies < base.saved + base.weight_copies
