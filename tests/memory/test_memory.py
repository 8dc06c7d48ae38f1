"""The memory estimator against measurement: model states in the training loop, activations here.

Model states: the loop records, per rank, the bytes of the parameters, gradients and optimizer
states it holds after the optimizer step (`memory/measure.py`); `memory/estimator.py` must
predict them within 2% for every strategy that exists, on 1, 2 and 4 ranks. Activations: the
bytes autograd saves for backward, counted with saved-tensor hooks, must match the estimate
within 5% for several batch sizes and lengths, with and without checkpointing.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memory_workers import train_each
from minidist.memory import __main__ as memory_command
from minidist import packing
from minidist.memory import estimator, measure, report, trace
from minidist.step import token_loss_sum
from minidist.runtime.launch import launch
from minidist.hf.models import load_model, write_tiny_llama
from minidist.strategy.options import ParallelOptions
from minidist.strategy import Strategy, TorchDDP

SEQ, BATCH = 32, 2  # every game is longer than 32 tokens: full, unpadded micro-batches


class CPU:
    device = torch.device("cpu")


# Every strategy and implementation meets each of the 8 mixes of precision, checkpointing and
# accumulation once, on 1, 2 or 4 ranks in turn: 4, 3 and 1 mixes each, as 4 ranks (four processes
# on CI's 2 cores) cost the most. Each strategy starts the 8 at another mix, so that the 4-rank
# runs between them meet 6 of the 8.
MIXES = [(precision, checkpointing, accumulation) for precision in ("fp32", "bf16")
         for checkpointing in (False, True) for accumulation in (1, 2)]
EVERY = [("torch", "ddp"), ("minidist", "ddp"), ("minidist", "zero1"), ("minidist", "zero2"),
         ("minidist", "fsdp"), ("torch", "fsdp")]


def peak_cases(world_size: int) -> list:
    """(impl, strategy, extra flags) for one world size; the extras name the mix."""
    first, last = {1: (0, 4), 2: (4, 7), 4: (7, 8)}[world_size]
    cases = []
    for s, (impl, name) in enumerate(EVERY):
        for precision, checkpointing, accumulation in (MIXES[s:] + MIXES[:s])[first:last]:
            cases.append((impl, name, ["--mixed_precision", precision, "--gradient_accumulation_steps", str(accumulation)]
                          + (["--gradient_checkpointing"] if checkpointing else [])))
    cases.append(("torch", "fsdp", ["--no_layer_wrap_policy"]))  # the whole model as one unit
    if world_size > 1:  # several ZeRO buckets (1 MiB each; the 2 MB embedding and output layer alone)
        cases += [("minidist", name, ["--bucket_cap_mb", "1", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2"])
                  for name in ("zero1", "zero2")]
    if world_size == 2:  # other architectures (`architectures`): the whole step, not only what forward saves
        cases += [("minidist", "fsdp", ["--model", "qwen2_moe"]), ("torch", "fsdp", ["--model", "mixtral", "--mixed_precision", "bf16"]),
                  ("torch", "ddp", ["--model", "mistral", "--mixed_precision", "bf16"]), ("minidist", "zero2", ["--model", "gpt_neox"]),
                  ("minidist", "ddp", ["--model", "gpt2", "--gradient_checkpointing"])]
        # --pack: rows with the block-diagonal mask and per-game position ids (every game is cut to
        # SEQ tokens here, so a micro-batch is BATCH rows of SEQ, the shape the estimate takes)
        cases += [("minidist", "fsdp", ["--pack", "--gradient_checkpointing"]),
                  ("torch", "ddp", ["--pack", "--mixed_precision", "bf16"])]
    return cases


def flag(extra: list, name: str, default):
    return extra[extra.index(name) + 1] if name in extra else default


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.slow  # one launch per world size, 1 to 4 ranks
def test_the_loop_measures_what_the_estimate_says(weighty_model, architectures, long_games, tmp_path, monkeypatch, world_size):
    """Three optimizer steps per case on 2 and 4 ranks, six for FSDP2 there, two on 1 rank, all in one
    launch; the loop's metrics.jsonl against the estimate.

    - The whole step's peak (every live tensor, `measure.LiveTensors`) within 5% of the estimate's
      peak, on every rank: the lowest of the steps after the first (the optimizer states exist
      from step 1 on). Several steps, because with gloo's worker threads FSDP2's peak is not the
      same in every step: one more gathered bf16 layer (1.5 MB) is sometimes still alive at it.
      FSDP2 bf16 on 4 ranks, steps 2 to 4: 3 of 12 (rank, step) peaks 4.5-5.9% above the others,
      which were 1.3% below the estimate; one fresh-clone CI run in four saw a rank 5.7% above in
      both of steps 2 and 3. Taking the lowest of five (steps 2 to 6) makes that about one rank in a
      thousand. The other strategies never needed more than the lower of steps 2 and 3 (the test's
      first form, for every case): three steps keep them, and cost half of six. One rank has no
      gloo threads to race with: there every case's peak is the same to the byte in every step
      after the first (all 25 cases, steps 2 and 3, measured), so step 2 alone is that lowest,
      and a third step would only repeat it.
    - Model states within 2%, and the activations forward saved within 5%.
    Over the three world sizes every strategy and implementation meets fp32 and bf16, with and
    without checkpointing and accumulation (`MIXES`); on 2 ranks, five other architectures
    (a sliding window, two mixtures of experts, one with layers of two sizes, GPT-2's dropout). The ranks are gloo's: the estimate counts
    gloo's copies of what it reduce-scatters (`backend="gloo"`)."""
    cases = peak_cases(world_size)
    common = ["--data", long_games, "--max_seq_length", str(SEQ),
              "--batch_size_per_device", str(BATCH), "--eval_prefixes", "0", "--no_save", "--trace_memory_every", "1"]

    def steps(impl, name):  # one rank has no gloo threads to race with; only FSDP2's peak wanders with them
        if world_size == 1:
            return 2  # the first step, then one steady step: its peak repeats to the byte (docstring)
        return 6 if (impl, name) == ("torch", "fsdp") else 3

    def model(extra):  # a case names its model first ("--model", kind) or trains the weighty Llama
        return architectures[extra[1]] if extra[:1] == ["--model"] else weighty_model

    runs = [common + ["--model", model(extra), "--impl", impl, "--strategy", name,
                      "--max_steps", str(steps(impl, name)), "--output_dir", str(tmp_path / f"{i}-{impl}-{name}")]
            + (extra[2:] if extra[:1] == ["--model"] else extra) for i, (impl, name, extra) in enumerate(cases)]
    # One OpenMP thread per rank, on 1 rank too (`init_distributed` gives a lone rank every core): the
    # figures are bytes of tensors, which no thread count changes, and on CI's 2 shared cores a
    # second thread of these small operators mostly waits for the first.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launch(train_each, world_size, runs, timeout_s=600)
    for (impl, name, extra), argv in zip(cases, runs):
        shape = estimator.model_shape(model(extra))
        case = f"{impl}/{name} {' '.join(extra)} x{world_size}"
        records = [json.loads(line) for line in (tmp_path / argv[argv.index("--output_dir") + 1] / "metrics.jsonl").read_text().splitlines()]
        measured = records[-1]["memory_bytes"]
        assert len(measured["peak"]) == world_size and records[-1]["peak_memory_bytes"] == max(measured["peak"])
        options = {"bucket_cap_mb": float(flag(extra, "--bucket_cap_mb", 0))} if "--bucket_cap_mb" in extra else {}
        setup = estimator.setup(strategy=name, world_size=world_size, batch_size_per_device=BATCH, max_seq_length=SEQ,
                                mixed_precision=flag(extra, "--mixed_precision", "fp32"), impl=impl,
                                padded="--pack" in extra, packed="--pack" in extra,
                                layer_wrap_policy="--no_layer_wrap_policy" not in extra,
                                gradient_checkpointing="--gradient_checkpointing" in extra, backend="gloo",
                                gradient_accumulation_steps=int(flag(extra, "--gradient_accumulation_steps", 1)), **options)
        estimate = estimator.estimate(shape, setup)
        steady = [min(step) for step in zip(*(r["memory_bytes"]["peak"] for r in records[1:]))]  # per rank
        for got in steady:
            assert abs(got - estimate["peak"]) <= 0.05 * estimate["peak"], f"{case} whole-step peak: measured {got}, estimated {estimate['peak']}"
        for term in ("parameters", "gradients", "optimizer_states"):
            # The first rank holds the fullest shards: the estimate is its figure, and the others' bound.
            got, want = max(measured[term]), estimate[term]
            assert abs(got - want) <= 0.02 * want, f"{case} {term}: measured {got}, estimated {want}"
        for got in measured["activations"]:  # autocast's bf16 weight copies are saved tensors too
            want = estimate["activations"] + estimate["weight_copies"]
            assert abs(got - want) <= 0.05 * want, f"{case} activations: {got} vs {want}"


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """A wider tiny Llama (the layers, not the vocabulary, hold most activations) and one with
    grouped-query attention (2 key/value heads for 8 query heads), as config folders."""
    root = tmp_path_factory.mktemp("llamas")
    wide = write_tiny_llama(root / "wide", hidden_size=256, num_layers=2)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "gqa")
    return {"wide": str(wide), "gqa": str(root / "gqa")}


def measure_saved(folder, batch, seq, checkpointing, precision, padded, packed=False):
    """Forward and backward of the loop's own loss, under the saved-tensor tracker: the peak in bytes.

    precision: fp32; autocast (bf16 matmuls over fp32 weights, as DDP runs bf16); bf16 (bf16
    weights, as FSDP2's bf16 all-gather computes). packed: `--pack`'s rows, each of three games
    (`packing.collate_packed`: the mask, per-game position ids)."""
    model = load_model(folder)
    model.train()
    if checkpointing:  # as finetune.py does it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    strategy = TorchDDP(ParallelOptions(mixed_precision="bf16"), CPU()) if precision == "autocast" else Strategy(ParallelOptions(), CPU())
    if precision == "bf16":
        model.to(torch.bfloat16)
    torch.manual_seed(0)
    input_ids = torch.randint(5, 900, (batch, seq))
    attention_mask = torch.ones_like(input_ids)
    if padded:
        attention_mask[-1, seq // 2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    data = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if packed:
        lengths = (seq // 3, seq // 2, seq - seq // 3 - seq // 2)
        rows = [[torch.randint(5, 900, (n,)).tolist() for n in lengths] for _ in range(batch)]
        data = packing.collate_packed(rows, pad_token_id=0)
        del data["document_ids"]  # the loop's micro-batch carries it; the model does not take it
    tracker = measure.SavedActivations()
    with tracker:
        token_loss_sum(model, data, strategy).backward()
    assert tracker.current == 0  # backward let go of everything it saved
    return tracker.peak


ACTIVATION_CASES = [  # (model, batch, sequence length, checkpointing, precision, padded)
    *(("wide", batch, seq, checkpointing, "fp32", padded)  # each fp32 shape without, then with checkpointing
      for checkpointing in (False, True) for batch, seq, padded in ((1, 64, False), (4, 32, False), (2, 128, True))),
    ("wide", 2, 64, False, "autocast", True),
    ("wide", 2, 64, True, "autocast", False),
    ("wide", 2, 64, False, "bf16", True),
    ("wide", 2, 64, True, "bf16", False),
    ("gqa", 2, 64, False, "fp32", False),
    ("gqa", 2, 64, False, "bf16", True),
]


def test_live_tensors_count_what_memtracker_counts(llamas):
    """The hand-written whole-step peak (`measure.LiveTensors`) against PyTorch's MemTracker, on a
    step of the loop's own loss and AdamW after a first step made its states; a storage that
    shrinks and grows inside the step (as FSDP frees and gathers a unit) must be followed too."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = load_model(llamas["wide"])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    buffer = torch.zeros(2**20)  # 4 MB, held by the model between steps, like a gathered unit
    model.register_buffer("unit", buffer)
    input_ids = torch.randint(5, 900, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
    strategy = Strategy(ParallelOptions(), CPU())

    def step():
        buffer.untyped_storage().resize_(0)  # freed: 4 MB less through the peak
        token_loss_sum(model, batch, strategy).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        buffer.untyped_storage().resize_(2**22)  # gathered again, once the step is over

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with measure.LiveTensors(torch.device("cpu"), model, optimizer) as live:
        step()
    assert live.peak == theirs, (live.peak, theirs)
    def accumulate():  # two micro-batches: each module runs twice in the block
        token_loss_sum(model, batch, strategy).backward()
        step()

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with pytest.raises(NotImplementedError), tracker:  # MemTracker refuses a module that runs twice
        accumulate()
    optimizer.zero_grad(set_to_none=True)
    with measure.LiveTensors(torch.device("cpu"), model, optimizer) as twice:
        accumulate()
    assert twice.peak >= live.peak


@pytest.mark.parametrize("name,batch,seq,checkpointing,precision,padded", ACTIVATION_CASES)
def test_saved_activations_match_the_estimate(llamas, name, batch, seq, checkpointing, precision, padded):
    measured = measure_saved(llamas[name], batch, seq, checkpointing, precision, padded)
    setup = estimator.setup(strategy="ddp" if precision == "autocast" else "fsdp",
                            mixed_precision="fp32" if precision == "fp32" else "bf16", batch_size_per_device=batch,
                            max_seq_length=seq, gradient_checkpointing=checkpointing, padded=padded)
    estimate = estimator.activations(estimator.model_shape(llamas[name]), setup)
    # Under autocast the bf16 weight copies are saved by the linear layers: the hooks see them.
    want = estimate["saved"] + estimate["weight_copies"]
    assert abs(measured - want) <= 0.05 * want, f"measured {measured}, estimated {want:.0f}"


@pytest.mark.parametrize("batch,seq,checkpointing,precision", [(2, 64, False, "fp32"), (2, 64, False, "autocast"),
                                                               (2, 128, False, "bf16"), (4, 32, True, "fp32")])
def test_packed_activations_match_the_estimate(llamas, batch, seq, checkpointing, precision):
    """`--pack`'s rows (three games each) save the block-diagonal mask and per-row position ids
    (the rotary cos and sin are then per row too): `estimator.setup(packed=True)` traces them
    (`trace.packed_batch_for`, two games a row: where the games end changes no shape)."""
    measured = measure_saved(llamas["wide"], batch, seq, checkpointing, precision, padded=True, packed=True)
    setup = estimator.setup(strategy="ddp" if precision == "autocast" else "fsdp",
                            mixed_precision="fp32" if precision == "fp32" else "bf16", batch_size_per_device=batch,
                            max_seq_length=seq, gradient_checkpointing=checkpointing, packed=True)
    estimate = estimator.activations(estimator.model_shape(llamas["wide"]), setup)
    want = estimate["saved"] + estimate["weight_copies"]
    assert abs(measured - want) <= 0.05 * want, f"measured {measured}, estimated {want:.0f}"


def arch_config(kind: str, vocab_size: int, hidden: int = 128, layers: int = 2):
    """Tiny random configs of other architectures over `vocab_size` tokens (the chess tokenizer's)."""
    import transformers as T

    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    return {
        # a sliding window shorter than the sequences: a mask even without padding
        "mistral": lambda: T.MistralConfig(**common, intermediate_size=2 * hidden, num_key_value_heads=2, sliding_window=24),
        "gpt_neox": lambda: T.GPTNeoXConfig(**common, intermediate_size=2 * hidden),
        "mixtral": lambda: T.MixtralConfig(**common, intermediate_size=hidden, num_key_value_heads=2, num_local_experts=4),
        # every other layer sparse: layers of two sizes
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**common, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                                              shared_expert_intermediate_size=hidden, num_experts=4, num_experts_per_tok=2,
                                              decoder_sparse_step=2, num_key_value_heads=2),
        # GPT-2 with its dropout: SDPA's math path, which saves the T x T scores
        "gpt2": lambda: T.GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, vocab_size=vocab_size, n_positions=1024),
    }[kind]()


@pytest.fixture(scope="module")
def architectures(tmp_path_factory):
    """Model folders (weights and the chess tokenizer) the loop can train, one per architecture."""
    from transformers import AutoModelForCausalLM

    from minidist.hf.models import _write, build_chess_tokenizer

    tokenizer, root = build_chess_tokenizer(), tmp_path_factory.mktemp("architectures")
    torch.manual_seed(0)
    return {kind: str(_write(AutoModelForCausalLM.from_config(arch_config(kind, len(tokenizer))), tokenizer, root / kind))
            for kind in ("mistral", "gpt_neox", "mixtral", "qwen2_moe", "gpt2")}


@pytest.mark.parametrize("kind", ["mistral", "gpt_neox", "mixtral", "qwen2_moe", "gpt2"])
@pytest.mark.slow  # a forward of five more architectures
def test_every_architecture_saves_what_the_estimate_says(architectures, kind):
    """Not only Llama: the estimate's activations (traced on fake tensors at batch 1 and 2, taken to
    batch 3) against what the real forward saves, within 5%, in fp32 padded, bf16 checkpointed and
    under autocast. (The generic formula this replaced was 1.4-1.9x too high on these.)"""
    shape = estimator.model_shape(architectures[kind])
    for checkpointing, precision, padded in ((False, "fp32", True), (True, "bf16", False), (False, "autocast", False)):
        measured = measure_saved(architectures[kind], 3, 48, checkpointing, precision, padded)
        setup = estimator.setup(strategy="ddp" if precision == "autocast" else "fsdp", batch_size_per_device=3,
                                mixed_precision="fp32" if precision == "fp32" else "bf16", max_seq_length=48,
                                gradient_checkpointing=checkpointing, padded=padded)
        estimate = estimator.activations(shape, setup)
        want = estimate["saved"] + estimate["weight_copies"]
        assert abs(measured - want) <= 0.05 * want, f"{kind} {precision} ckpt={checkpointing}: measured {measured}, estimated {want}"
    assert "traced on fake tensors" in report.report(shape, estimator.setup())["traced"]


def test_layers_of_different_sizes_are_counted_each_for_itself(architectures):
    """Qwen2-MoE with every other layer sparse: the parameters are the sum of its layers and the
    rest (no negative terms, as "the largest layer times the layer count" gave), and FSDP's
    gathered units hold the largest."""
    shape = estimator.model_shape(architectures["qwen2_moe"])
    assert len(set(shape.layer_param_counts)) == 2 and shape.root_params > 0
    assert shape.root_params + sum(shape.layer_param_counts) == shape.num_params
    acts = estimator.activations(shape, estimator.setup(strategy="fsdp", batch_size_per_device=2, max_seq_length=32))
    assert len(acts["types"]) == 2 and len(set(acts["kept_by_layer"])) == 2
    terms = estimator.estimate(shape, estimator.setup(strategy="fsdp", world_size=4))
    assert min(terms.values()) >= 0


def test_codellama_numbers_to_know():
    """The bundled CodeLlama-7b config gives DESIGN.md's numbers: P = 6.74e9, DDP 16P = 108 GB, FSDP
    on 4 GPUs 27 GB of model states; DDP does not fit an 80 GB A100 at batch 1, FSDP does."""
    shape = estimator.model_shape("codellama/CodeLlama-7b-hf")
    assert shape.num_params == 6_738_546_688 and shape.layer_params == 202_383_360
    states = lambda setup: sum(estimator.model_states(shape, setup).values())
    assert round(states(estimator.setup(strategy="ddp")) / 1e9) == 108
    assert round(states(estimator.setup(strategy="fsdp", world_size=4)) / 1e9) == 27
    ddp = report.report(shape, estimator.setup(strategy="ddp", world_size=4), gpu_memory=80e9)
    assert not ddp["fits"] and ddp["largest_batch_per_device"] == 0
    fsdp = report.report(shape, estimator.setup(strategy="fsdp", world_size=4), gpu_memory=80e9)
    assert fsdp["fits"] and fsdp["largest_batch_per_device"] >= 1
    # The largest batch is the largest that fits: one more does not.
    more = estimator.setup(strategy="fsdp", world_size=4, batch_size_per_device=fsdp["largest_batch_per_device"] + 1)
    assert estimator.estimate(shape, more)["peak"] > 80e9
    # Checkpointing keeps one hidden state per layer instead of a layer's worth: far more fits.
    ckpt = report.report(shape, estimator.setup(strategy="fsdp", world_size=4, gradient_checkpointing=True), gpu_memory=80e9)
    assert ckpt["largest_batch_per_device"] > 3 * fsdp["largest_batch_per_device"]


def run_cli(*argv):
    # Offline with an empty cache, as on a compute node.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": tempfile.mkdtemp()}
    return subprocess.run([sys.executable, "-m", "minidist.memory", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.slow  # a fresh interpreter, transformers imported again
def test_the_command_works_offline_from_the_bundled_config():
    done = run_cli("codellama/CodeLlama-7b-hf", "--world_size", "4", "--strategy", "fsdp", "--batch_size_per_device", "1",
                   "--max_seq_length", "1024", "--gradient_checkpointing", "--gpu_memory", "80GB", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["num_params"] == 6_738_546_688 and result["fits"] and "32 x LlamaDecoderLayer" in result["traced"]
    assert result["bytes"]["peak"] > sum(result["bytes"][k] for k in ("parameters", "gradients", "optimizer_states"))
    assert result["others"]["deepspeed"] < result["bytes"]["peak"]  # model states only


@pytest.mark.slow  # a fresh interpreter, transformers imported again
def test_an_unknown_model_without_network_ends_with_one_line():
    done = run_cli("some-org/not-cached")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "could not load 'some-org/not-cached': it is not in the hub cache" in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,expected", [
    (["/no/such/model"], "could not read the config of '/no/such/model'"),
    (["codellama/CodeLlama-7b-hf", "--world_size", "0"], "--world_size must be at least 1"),
    (["codellama/CodeLlama-7b-hf", "--max_seq_length", "1"], "--max_seq_length must be at least 2"),
    (["codellama/CodeLlama-7b-hf", "--pack", "--no_padding"], "--pack and --no_padding name two kinds of batch"),
    (["codellama/CodeLlama-7b-hf", "--gpu_memory", "lots"], "--gpu_memory must look like 80GB"),
    (["codellama/CodeLlama-7b-hf", "--target_length", "128"], "--target_length is for encoder-decoders (T5, BART)"),
    (["google-t5/t5-base", "--target_length", "1"], "--target_length must be at least 2"),
])
def test_bad_input_ends_with_one_line(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit:
        memory_command.main(argv)
    assert exit.value.code == 2
    assert expected in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_table_prints_every_term(capsys):
    memory_command.main(["codellama/CodeLlama-7b-hf", "--strategy", "ddp", "--gpu_memory", "80GB"])
    out = capsys.readouterr().out
    for label in ("parameters", "gradients", "optimizer states", "gradient buckets", "activations saved",
                  "bf16 weight copies", "logits", "peak per rank", "fits in 80.00 GB: no"):
        assert label in out


def family_configs():
    """Tiny random configs of each family the estimator is checked on (tests/memory/test_trace.py traces them too)."""
    import transformers as T

    small = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return {
        "llama": T.LlamaConfig(**small, intermediate_size=128), "mistral": T.MistralConfig(**small, intermediate_size=128, sliding_window=16),
        "qwen2": T.Qwen2Config(**small, intermediate_size=128), "qwen3": T.Qwen3Config(**small, intermediate_size=128, head_dim=16),
        "gemma2": T.Gemma2Config(**small, intermediate_size=128, head_dim=16, sliding_window=16),
        "phi3": T.Phi3Config(**small, intermediate_size=128, pad_token_id=0),
        "mixtral": T.MixtralConfig(**small, intermediate_size=128, num_local_experts=4),
        "gpt_neox": T.GPTNeoXConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
        "opt": T.OPTConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                           word_embed_proj_dim=64, max_position_embeddings=128, pad_token_id=1, bos_token_id=2, eos_token_id=2),
        "gpt2": T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0),
        "t5": T.T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0),
        "bart": T.BartConfig(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128),
    }


@pytest.mark.slow  # every family's trace
def test_the_command_estimates_every_family_from_its_config_folder(tmp_path, capsys):
    """`python -m minidist.memory FOLDER` on a config.json alone, for each family: a table whose
    activations were traced, layer by layer; an encoder-decoder whole, with the line that the loop
    does not train it. (Before the trace, T5 ended in transformers' list of 190 config classes and
    BART was estimated as its decoder alone.)"""
    for family, config in family_configs().items():
        config.save_pretrained(tmp_path / family)
        memory_command.main([str(tmp_path / family), "--strategy", "fsdp", "--world_size", "2", "--max_seq_length", "64"])
        out = capsys.readouterr().out
        assert "activations traced on fake tensors" in out and "peak per rank" in out, family
        shape = estimator.model_shape(str(tmp_path / family))
        assert shape.num_params == sum(p.numel() for p in trace.model_class(config).from_config(config).parameters()), family
        assert ("encoder-decoder: minidist.finetune does not train it" in out) == (family in ("t5", "bart")), family
    assert estimator.model_shape(str(tmp_path / "bart")).num_layers == 4  # both stacks, not the decoder alone


def test_no_padding_drops_the_mask_and_pack_keeps_one_per_row(tmp_path, capsys):
    """Unpadded batches (`--no_padding`): no attention mask is saved, so less than padded. Packed rows
    (`--pack`): a block-diagonal mask of rows x s x s, and the rotary cos and sin per row (each row
    has its own position ids), so more than unpadded."""
    family_configs()["llama"].save_pretrained(tmp_path)
    argv = [str(tmp_path), "--max_seq_length", "256", "--batch_size_per_device", "4", "--json"]
    found = {}
    for kind, extra in (("padded", []), ("unpadded", ["--no_padding"]), ("packed", ["--pack"])):
        memory_command.main(argv + extra)
        found[kind] = json.loads(capsys.readouterr().out)["bytes"]["activations"]
    assert found["unpadded"] < found["padded"] and found["unpadded"] < found["packed"], found
    unpadded = found["unpadded"]
    shape = estimator.model_shape(str(tmp_path))
    assert unpadded == estimator.estimate(shape, estimator.setup(batch_size_per_device=4, max_seq_length=256, padded=False))["activations"]


@pytest.mark.slow  # training runs of two more models
def test_an_untraceable_architecture_and_an_encoder_decoder_in_the_loop_end_in_one_line(tmp_path, capsys):
    """CTRL names no repeated layer class, so nothing can say what a layer saves: one line, no
    guess. The loop, given T5, says it trains causal LMs only, and where its memory can be estimated."""
    import transformers as T

    from minidist.hf.models import build_chess_tokenizer

    T.CTRLConfig(vocab_size=100, n_embd=32, n_layer=1, n_head=2, dff=64).save_pretrained(tmp_path / "ctrl")
    with pytest.raises(SystemExit) as exit:
        memory_command.main([str(tmp_path / "ctrl")])
    assert exit.value.code == 2
    assert "cannot trace 'ctrl': it names no repeated layer class" in capsys.readouterr().err.strip().splitlines()[-1]
    t5 = family_configs()["t5"]
    T.T5ForConditionalGeneration(t5).save_pretrained(tmp_path / "t5")
    build_chess_tokenizer().save_pretrained(tmp_path / "t5")
    done = subprocess.run([sys.executable, "-m", "minidist.finetune", "--model", str(tmp_path / "t5"), "--impl",
                           "torch", "--max_steps", "1",
                           "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "is an encoder-decoder (t5); minidist.finetune trains causal" in done.stderr.strip().splitlines()[-1]


def test_a_trace_is_kept_on_disk_for_the_next_process(tmp_path, monkeypatch):
    """The lessons and tests estimate CodeLlama-7b in many processes: each trace (batch 1 and 2)
    is computed once and read back from `$MINIDIST_CACHE/trace` (`cache.py`)."""
    monkeypatch.setenv("MINIDIST_CACHE", str(tmp_path))
    family_configs()["llama"].save_pretrained(tmp_path / "llama")
    shape, setup = estimator.model_shape(str(tmp_path / "llama")), estimator.setup(batch_size_per_device=3, max_seq_length=64)
    first = estimator.estimate(shape, setup)
    assert len(list((tmp_path / "trace").glob("*.json"))) == 2
    estimator._traced.cache_clear()  # as a new process would start
    monkeypatch.setattr(trace, "trace", lambda *args, **kwargs: pytest.fail("traced again"))
    assert estimator.estimate(shape, setup) == first
