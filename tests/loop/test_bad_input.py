"""Bad input ends in one line and exit status 2, in every command; evaluation fits the model's context.

Each case is a mistake a learner makes (an empty games file, a model folder without weights, a
learning rate of 0, ...) and the sentence that must tell it. The commands run in this process
(`main(argv)`), which is what they do under `python -m`, except where the behaviour belongs to the
process: torchrun's output and its error file, and a hub client that reads its settings once, at
import.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from minidist import evaluate, finetune
from minidist.chess import games, jsonl, legal_moves
from minidist.chess.games import bundled_games
from minidist.hf import models
from minidist.bench import __main__ as bench_command
from minidist.memory import __main__ as memory_command
from in_process import said

ROOT = Path(__file__).resolve().parents[2]
GAME = "e2e4 e7e5 g1f3 b8c6 1-0"


@pytest.fixture(scope="module")
def bad(tiny_model, tmp_path_factory):
    """Every bad file and folder, written once: name -> path."""
    d = tmp_path_factory.mktemp("bad")
    files = {
        "empty.jsonl": "",
        "no_text.jsonl": json.dumps({"moves": GAME}) + "\n",
        "not_objects.jsonl": json.dumps({"text": GAME}) + "\n" + json.dumps([GAME]) + "\n",
        "broken.jsonl": '{"text": "e2e4 e7e5\n',
        "no_legal.jsonl": json.dumps({"text": "e2e4 e2e4 1-0"}) + "\n",
        "illegal.jsonl": json.dumps({"text": GAME}) + "\n" + json.dumps({"text": "e2e4 e7e5 e1e3 1-0"}) + "\n",
        "not_parquet.parquet": "not a parquet file",
    }
    files["not_chess.jsonl"] = json.dumps({"text": GAME}) + "\n" + json.dumps({"text": "the quick brown fox"}) + "\n"
    files["long_line.jsonl"] = json.dumps({"text": GAME}) + "\n" + json.dumps({"text": "e2e4 " * 400_000}) + "\n"
    files["nested.jsonl"] = "[" * 100_000 + "\n"
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "folder.jsonl").mkdir()  # a folder whose name looks like a games file
    pq.write_table(pa.table({"moves": [["e2e4"]]}), d / "other_parquet.parquet")
    no_weights, config_only = d / "no_weights", d / "config_only"
    shutil.copytree(tiny_model, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    config_only.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", config_only)
    for name, change in {"hidden_0": {"hidden_size": 0}, "heads_3": {"num_attention_heads": 3}}.items():
        shutil.copytree(tiny_model, d / name)
        config = json.loads((d / name / "config.json").read_text())
        (d / name / "config.json").write_text(json.dumps({**config, **change}))
    for name in ("config_not_json", "header_too_large", "weights_cut_short"):  # damaged files of a saved model
        shutil.copytree(tiny_model, d / name)
    (d / "config_not_json" / "config.json").write_text('{"model_type": "llama",')
    with open(d / "header_too_large" / "model.safetensors", "r+b") as f:
        f.write((10 ** 12).to_bytes(8, "little"))  # the header's length, in its first 8 bytes
    os.truncate(d / "weights_cut_short" / "model.safetensors", 20000)  # a copy or a download cut short
    paths = {p.name.split(".")[0]: str(p) for p in d.iterdir()}  # by name without suffix
    return {**paths, "tiny": tiny_model, "dir": str(d)}


FINETUNE = [  # (argv, with {name} for a path of `bad`; the line must contain this)
    (["--data", "{empty}"], "minidist.finetune: error: {empty} holds no games: each line must be"),
    (["--data", "{no_text}"], 'error: line 1 of {no_text} has no "text" string'),
    (["--data", "{not_objects}"], 'error: line 2 of {not_objects} has no "text" string'),
    (["--data", "{broken}"], "error: line 1 of {broken} is not JSON"),
    (["--data", "{folder}"], "error: {folder} is a folder, not a games file"),
    (["--data", "{illegal}", "--batch_size_per_device", "2"],
     "error: game 2 of {illegal} is not a legal chess game: its move 3, 'e1e3', is not a legal UCI move there; fix or "
     "remove it, or pass --illegal_games skip"),
    (["--data", "{not_chess}", "--batch_size_per_device", "2"],
     "error: game 2 of {not_chess} is not a legal chess game: it does not end in a result"),
    (["--illegal_games", "skip", "--data", "{no_legal}"],
     "error: {no_legal} holds no legal chess game (1 skipped with --illegal_games skip)"),
    (["--data", "{long_line}"], "error: line 2 of {long_line} is longer than 1,048,576 bytes, not a game"),
    (["--data", "{nested}"], "error: line 1 of {nested} is not a game (JSON nested too deeply)"),
    (["--eval_data", "{illegal}", "--eval_prefixes", "2"],
     "error: held-out game 2 is not a legal game: its move 3, 'e1e3', is not a legal UCI move there"),
    (["--learning_rate", "0"], "error: --learning_rate must be more than 0, got 0.0"),
    (["--learning_rate=-1e-3"], "error: --learning_rate must be more than 0"),
    (["--log_every", "0"], "error: --log_every must be at least 1"),
    (["--eval_prefixes", "-1"], "error: --eval_prefixes must be 0 or more"),
    (["--model", "{no_weights}"], "error: model folder '{no_weights}' has a config but no weights"),
    (["--model", "{config_only}"], "error: model folder '{config_only}' has no tokenizer"),
    (["--model", "{hidden_0}"], "error: the config of '{hidden_0}' says hidden_size: 0"),
    (["--model", "{heads_3}"], "error: the config of '{heads_3}' cannot be a model"),
    # Hybrid sharding: a shard size that cannot cut the ranks into copies, or a flag without hsdp.
    (["--strategy", "hsdp", "--hsdp_shard_size", "2"], "error: --hsdp_shard_size must divide the 1 ranks into equal "
                                                       "groups, got 2"),
    (["--strategy", "hsdp", "--hsdp_shard_size", "0"], "error: --hsdp_shard_size must be at least 1, got 0"),
    (["--strategy", "fsdp", "--hsdp_shard_size", "1"], "error: --hsdp_shard_size only applies to --impl minidist or "
                                                       "torch with --strategy hsdp, not torch/fsdp"),
    (["--strategy", "hsdp", "--hsdp_shard_size", "two"], "error: argument --hsdp_shard_size: invalid int value: 'two'"),
    (["--model", "{config_not_json}"], "error: {config_not_json}/config.json is not JSON (Expecting property name "
                                       "enclosed in double quotes, line 1): fix it, or write the model again"),
    (["--model", "{header_too_large}"], "error: {header_too_large}/model.safetensors is damaged (header too large): "
                                        "copy or download the model again"),
    (["--model", "{weights_cut_short}"], "error: {weights_cut_short}/model.safetensors is damaged (incomplete "
                                         "metadata, file not fully covered)"),
    # Numbers that parse but mean nothing: each was a traceback, or a run that trained nonsense in silence.
    (["--impl", "minidist", "--strategy", "ddp", "--bucket_cap_mb", "nan"],
     "error: --bucket_cap_mb must be a positive, finite number of MB, got nan"),
    (["--impl", "minidist", "--strategy", "ddp", "--bucket_cap_mb", "inf"],
     "error: --bucket_cap_mb must be a positive, finite number of MB, got inf"),
    (["--weight_decay", "nan"], "error: --weight_decay must be a finite number 0 or more, got nan"),
    (["--weight_decay=-1"], "error: --weight_decay must be a finite number 0 or more, got -1.0"),
    (["--learning_rate", "inf"], "error: --learning_rate must be finite, got inf"),
    (["--seed", str(2 ** 64)], f"error: --seed must be between 0 and {2 ** 32 - 1} (32 bits), got {2 ** 64}"),
    (["--max_grad_norm=-1"], "error: --max_grad_norm must be more than 0 (the largest gradient norm kept), got -1.0"),
    (["--max_grad_norm", "0"], "error: --max_grad_norm must be more than 0"),
    (["--max_grad_norm", "nan"], "error: --max_grad_norm must be more than 0"),
    (["--output_dir", ""], "error: --output_dir must name a folder, got ''"),
    (["--no_fsdp", "--strategy", "fsdp"], "error: --no_fsdp means --strategy ddp: give one or the other, not "
                                          "--strategy fsdp with it"),
    # Tensor parallelism (lesson 11): sizes that do not cut the model or the ranks evenly.
    (["--tp_size", "0"], "error: --tp_size must be at least 1, got 0"),
    (["--sequence_parallel"], "error: --sequence_parallel cuts the sequence over the tensor-parallel ranks: it needs "
                              "--tp_size 2 or more"),
    (["--impl", "minidist", "--strategy", "zero2", "--tp_size", "2"],
     "error: --tp_size composes with minidist/ddp or minidist/fsdp or torch/fsdp over the data-parallel ranks, not "
     "minidist/zero2"),
    (["--impl", "torch", "--strategy", "fsdp", "--tp_size", "2", "--sequence_parallel", "--eval_prefixes", "5"],
     "error: PyTorch's sequence parallelism cuts every sequence over the ranks, so it cannot generate a token at a "
     "time for the legal-move rate: pass --eval_prefixes 0, or use --impl minidist"),
    (["--impl", "minidist", "--strategy", "ddp", "--tp_size", "3"],
     "error: --tp_size 3 does not divide the model's 4 attention heads: each rank must get an equal share"),
    (["--impl", "minidist", "--strategy", "ddp", "--tp_size", "2"],
     "error: --tp_size 2 must divide the 1 ranks into equal tensor-parallel groups"),
    # Pipeline parallelism (lesson 12): stages the model or the ranks cannot hold, a schedule that does not exist.
    (["--pp_size", "0"], "error: --pp_size must be at least 1, got 0"),
    (["--pp_schedule", "gpipe"], "error: --pp_schedule orders the stages of a pipeline: it needs --pp_size 2 or more"),
    (["--pp_size", "2", "--pp_schedule", "zb"], "error: argument --pp_schedule: invalid choice: 'zb'"),
    (["--impl", "minidist", "--strategy", "ddp", "--pp_size", "8"],
     "error: --pp_size 8 is larger than the model's 2 decoder layers: every stage needs at least one"),
    (["--impl", "minidist", "--strategy", "ddp", "--pp_size", "2"],
     "error: --pp_size 2 must divide the 1 ranks into equal pipeline stages"),
    (["--impl", "minidist", "--strategy", "zero2", "--pp_size", "2"],
     "error: --pp_size composes with minidist/ddp or minidist/zero1 or minidist/fsdp or torch/fsdp over the "
     "data-parallel ranks, not minidist/zero2"),
    (["--impl", "torch", "--strategy", "fsdp", "--pp_size", "2", "--accumulate_sharded"],
     "error: --accumulate_sharded with --pp_size has not been built: use one or the other"),
    # PyTorch's pp x tp runs (tests/loop/test_finetune.py); sequence parallelism under a pipeline does not.
    (["--impl", "torch", "--strategy", "fsdp", "--pp_size", "2", "--tp_size", "2", "--sequence_parallel"],
     "error: --sequence_parallel with --pp_size has not been built: use one or the other"),
]


@pytest.mark.parametrize("argv,expected", FINETUNE, ids=[" ".join(a) for a, _ in FINETUNE])
def test_finetune(bad, tmp_path, capsys, argv, expected):
    base = ["--model", bad["tiny"], "--impl", "torch", "--output_dir", str(tmp_path), "--eval_prefixes", "0",
            "--max_steps", "1", "--no_save"]
    line = said(finetune.main, base + [a.format(**bad) for a in argv], capsys)
    assert expected.format(**bad) in line
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before training


def test_finetune_skips_illegal_games_when_asked_and_says_how_many(bad, tmp_path, capsys):
    finetune.main(["--model", bad["tiny"], "--impl", "torch", "--data", bad["not_chess"], "--illegal_games", "skip",
                   "--output_dir", str(tmp_path), "--eval_prefixes", "0", "--max_steps", "1", "--no_save",
                   "--batch_size_per_device", "1"])
    line = f"--illegal_games skip: skipped 1 of 2 games of {bad['not_chess']} (not legal chess)"
    assert line in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def gpt2_32(tmp_path_factory):
    """A tiny GPT-2 whose learned positions end at 32."""
    return str(models.write_tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "gpt2_32", n_positions=32))


def test_finetune_a_sequence_longer_than_the_context(gpt2_32, tmp_path, capsys):
    line = said(finetune.main, ["--model", gpt2_32, "--impl", "torch", "--max_seq_length", "64", "--output_dir",
                                str(tmp_path), "--eval_prefixes", "0", "--max_steps", "1", "--no_save"], capsys)
    assert f"error: --max_seq_length 64 is longer than the 32 positions of '{gpt2_32}'" in line


def test_tensor_parallelism_refuses_a_model_without_llama_projections(gpt2_32, tmp_path, capsys):
    line = said(finetune.main, ["--model", gpt2_32, "--impl", "minidist", "--strategy", "ddp", "--tp_size", "2",
                                "--max_seq_length", "32", "--output_dir", str(tmp_path), "--eval_prefixes", "0",
                                "--max_steps", "1", "--no_save"], capsys)
    assert ("error: tensor parallelism splits Llama-style decoder layers (self_attn.q_proj/k_proj/v_proj/o_proj, "
            "mlp.gate_proj/up_proj/down_proj), which GPT2LMHeadModel does not have") in line


EVALUATE = [
    ("{empty}", "minidist.evaluate: error: {empty} holds no games"),
    ("{broken}", "minidist.evaluate: error: line 1 of {broken} is not JSON"),
    ("{not_objects}", 'minidist.evaluate: error: line 2 of {not_objects} has no "text" string'),
    ("{illegal}", "minidist.evaluate: error: held-out game 2 is not a legal game"),
    ("{dir}", "minidist.evaluate: error: {dir} is a folder, not a games file"),
    ("{long_line}", "minidist.evaluate: error: line 2 of {long_line} is longer than 1,048,576 bytes"),
    ("{nested}", "minidist.evaluate: error: line 1 of {nested} is not a game (JSON nested too deeply)"),
]


@pytest.mark.parametrize("data_file,expected", EVALUATE, ids=[d for d, _ in EVALUATE])
def test_evaluate(bad, capsys, data_file, expected):
    line = said(evaluate.main, ["--model", bad["tiny"], "--data", data_file.format(**bad)], capsys)
    assert expected.format(**bad) in line


EVALUATE_MODELS = [
    ("{no_weights}", "minidist.evaluate: error: model folder '{no_weights}' has a config but no weights"),
    ("{config_not_json}", "minidist.evaluate: error: {config_not_json}/config.json is not JSON"),
    ("{header_too_large}", "minidist.evaluate: error: {header_too_large}/model.safetensors is damaged"),
]


@pytest.mark.parametrize("model,expected", EVALUATE_MODELS, ids=[m for m, _ in EVALUATE_MODELS])
def test_evaluate_a_damaged_model(bad, capsys, model, expected):
    line = said(evaluate.main, ["--model", model.format(**bad)], capsys)
    assert expected.format(**bad) in line


MEMORY = [
    (["{hidden_0}"], "minidist.memory: error: the config of '{hidden_0}' says hidden_size: 0"),
    (["{heads_3}"], "minidist.memory: error: the config of '{heads_3}' cannot be a model"),
    (["{config_not_json}"], "minidist.memory: error: {config_not_json}/config.json is not JSON (Expecting property "
                            "name enclosed in double quotes, line 1): fix it, or write the model again"),
    (["some-org/not-cached"], "minidist.memory: error: could not load 'some-org/not-cached': it is not in the hub cache"),
    (["tiny", "--strategy", "hsdp", "--world_size", "8", "--hsdp_shard_size", "3"],
     "minidist.memory: error: --hsdp_shard_size must divide the 8 ranks into equal groups, got 3"),
    (["tiny", "--strategy", "ddp", "--hsdp_shard_size", "2"],
     "minidist.memory: error: --hsdp_shard_size only applies to --impl minidist or torch with --strategy hsdp"),
]


@pytest.mark.parametrize("argv,expected", MEMORY, ids=[" ".join(a) for a, _ in MEMORY])
def test_memory(bad, capsys, monkeypatch, argv, expected):
    if "/" in argv[0] and not argv[0].startswith("{"):  # a hub name: as on a compute node, whatever this machine reaches
        monkeypatch.setattr("minidist.hf.hub.reachable", lambda: False)
    line = said(memory_command.main, [a.format(**bad) for a in argv], capsys)
    assert expected.format(**bad) in line


def test_memory_takes_tiny_as_finetune_does(bad, capsys, monkeypatch, tmp_path):
    shutil.copytree(bad["tiny"], tmp_path / "tiny-llama")  # where `tiny` lives (models.tiny_model_dir)
    monkeypatch.setenv("MINIDIST_CACHE", str(tmp_path))
    memory_command.main(["tiny", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["architecture"] == "LlamaForCausalLM" and result["num_params"] == models.num_parameters(
        models.load_model(bad["tiny"]))


MODELS = [
    (["tiny", "--out", "{empty}"], "minidist.hf.models: error: cannot write the model to {empty}"),
    (["tiny", "--out", "{dir}/m", "--hidden_size", "0"], "error: --hidden_size must be a positive multiple of 4"),
    (["tiny", "--out", "{dir}/m", "--hidden_size", "30"], "error: --hidden_size must be a positive multiple of 4"),
    (["tiny", "--out", "{dir}/m", "--num_layers", "0"], "error: --num_layers must be at least 1"),
    (["download", "some-org/some-model"], "minidist.hf.models: error: could not download some-org/some-model: the hub "
                                          "cannot be reached from here"),
]


@pytest.mark.parametrize("argv,expected", MODELS, ids=[" ".join(a) for a, _ in MODELS])
def test_models(bad, capsys, monkeypatch, argv, expected):
    if argv[0] == "download":
        monkeypatch.setattr("minidist.hf.hub.reachable", lambda: False)
    line = said(models.main, [a.format(**bad) for a in argv], capsys)
    assert expected.format(**bad) in line
    assert not Path(bad["dir"], "m").exists()


DATA = [
    (["generate", "--num_games", "0", "--out", "{dir}/g.jsonl"], "error: --num_games must be at least 1"),
    (["generate", "--num_games", "2", "--max_plies", "0", "--out", "{dir}/g.jsonl"],
     "error: --max_plies must be at least 10"),
    (["convert", "{not_parquet}", "--out", "{dir}/g.jsonl"], "minidist.chess.games: error: {not_parquet} is not a parquet file"),
    (["convert", "{other_parquet}", "--out", "{dir}/g.jsonl"],
     "minidist.chess.games: error: {other_parquet} has no Moves and Result columns"),
    (["download", "--out", "{dir}/dl", "--num_shards", "0"], "error: --num_shards must be at least 1"),
]


@pytest.mark.parametrize("argv,expected", DATA, ids=[" ".join(a[:3]) for a, _ in DATA])
def test_data(bad, capsys, argv, expected):
    line = said(games.main, [a.format(**bad) for a in argv], capsys)
    assert expected.format(**bad) in line
    assert not Path(bad["dir"], "g.jsonl").exists()  # nothing written


BENCH = [
    (["ddp", "--world_size", "0"], "error: --world_size must be at least 1"),
    (["fsdp", "--hidden_size", "200"], "error: --hidden_size 200 does not split into 3 heads"),
    (["ddp", "--steps", "0"], "error: --steps must be at least 1"),
    (["allreduce", "--factor", "1"], "error: --factor must be at least 2"),
    (["allreduce", "--min_bytes", "4K", "--max_bytes", "1K"], "error: --max_bytes (1024) must be at least --min_bytes"),
]


@pytest.mark.parametrize("argv,expected", BENCH, ids=[" ".join(a) for a, _ in BENCH])
def test_bench(capsys, argv, expected):
    assert expected in said(bench_command.main, argv, capsys)


# ---------------------------------------------------------------- in a process of its own
def test_an_uncached_name_fails_at_once_without_the_hub(tmp_path):
    # No HF_HUB_OFFLINE: the hub is simply not there (a refused port stands for a node without
    # internet, whatever this machine reaches). The hub client would retry for ~25 s, saying so.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=tempfile.mkdtemp())
    done = subprocess.run([sys.executable, "-m", "minidist.finetune", "--model", "some-org/not-cached", "--impl",
                           "torch", "--output_dir", str(tmp_path), "--eval_prefixes", "0"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "minidist.finetune: error: could not load 'some-org/not-cached': it is not in the hub cache and the hub "
        "cannot be reached from here; cache it first with `python -m minidist.hf.models download some-org/not-cached` "
        "where there is internet, or pass a local folder"]


def test_under_torchrun_the_line_comes_first_and_is_the_root_cause(bad, tmp_path):
    """torchrun prints a summary of its own when a rank fails; the learner's line must come before
    it, once, and be what the summary and torchrun's error file name as the root cause."""
    error_file = tmp_path / "error.json"
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(error_file), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                           "minidist.finetune", "--model", bad["tiny"], "--impl", "torch", "--strategy", "zero2",
                           "--output_dir", str(tmp_path), "--eval_prefixes", "0"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    # Told once the process group exists (the ranks then agree through its store), before the
    # expensive imports: the cheapest such mistake.
    line = "minidist.finetune: error: PyTorch has no zero2 of its own (its ZeroRedundancyOptimizer is ZeRO-1 for " \
           "DDP only): use --impl minidist --strategy zero2"
    lines = done.stderr.splitlines()
    first_error = next(x for x in lines if "error" in x.lower() or "Traceback" in x or x.startswith("E"))
    assert first_error == line, done.stderr
    assert lines.count(line) == 1, done.stderr  # rank 0 alone, not one per rank
    assert f"traceback : {line}" in done.stderr.split("Root Cause")[1], done.stderr
    assert json.loads(error_file.read_text())["message"]["message"] == line


# ---------------------------------------------------------------- evaluation within the context
def test_evaluation_keeps_the_last_tokens_that_fit_the_context(gpt2_32):
    """A GPT-2 with 32 learned positions, asked about games longer than that: the prompt keeps its
    last tokens, so prompt and answer fit in 32 positions, and the answer is the model's own
    greedy choice after exactly those tokens."""
    model, tokenizer = models.load_model(gpt2_32), models.load_tokenizer(gpt2_32)
    games = [g for g in jsonl.load_games(bundled_games("test")) if len(g.split()) > 60][:3]
    prefixes = [g.split()[:40 + 7 * i] for i, g in enumerate(games)]  # 41 to 55 tokens, of unequal lengths
    new = legal_moves.tokens_per_move(tokenizer) + 1
    assert legal_moves.context_length(model) == 32
    assert legal_moves.context_length(types.SimpleNamespace(module=model)) == 32  # through a wrapper's .module
    expected = []
    for prefix in prefixes:  # greedy decoding by hand, one prompt at a time, no padding
        ids = tokenizer(" ".join(prefix))["input_ids"][-(32 - new):]
        with torch.no_grad():
            for _ in range(new):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        expected.append(tokenizer.decode(ids[-new:], skip_special_tokens=True))
    prompts = [" ".join(p) for p in prefixes]
    assert legal_moves.greedy_continue(model, tokenizer, prompts, new, "cpu", max_length=32) == expected
    result = legal_moves.legal_move_rate(model, tokenizer, prefixes, "cpu")  # reads the context from the config
    assert result["total"] == 3
