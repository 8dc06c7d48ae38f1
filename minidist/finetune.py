"""Fine-tune a causal language model on chess games, with any strategy, on 1 to N ranks.

    torchrun --nproc_per_node 2 -m minidist.finetune          # laptop: tiny Llama, 2 CPU ranks
    python -m minidist.finetune --max_steps 5                  # one process
    torchrun ... -m minidist.finetune --save_steps 50 --resume # checkpoints; go on after a kill (state.py)
    torchrun ... -m minidist.finetune --pack                   # whole games packed into rows, no padding between (packing.py)
    sbatch slurm/chess_finetune.sh                             # CodeLlama-7b on 4 A100s

One loop for every strategy: the strategy (`strategy/`: a data-parallel choice plus the tensor
and pipeline axes) loads and wraps the model, builds the optimizer, decides what communication a
backward pass does, clips, and saves; the loop checks the input, builds the batches, runs the steps,
records each, evaluates and hands checkpoints to the session. The parallel flags are
`ParallelOptions`' (`strategy/options.py`), and the ranks' layout is `parallel/mesh.py`'s: every
data-parallel rank gets its own micro-batches.

Read it top to bottom: `parse_args` (the options), `train` (the run claims its output folder),
`_train` (strategy, model, optimizer, the step loop with one record per step, the end), then the
helpers `_train` calls, in the order it calls them. One step is `step.py`'s; its record is
`runtime/metrics.py`'s; checkpoints and stop signals are one object, `checkpoint/session.py`'s.

The global batch is `batch_size_per_device x world_size x gradient_accumulation_steps`
sequences. Which sequences form global batch k depends on the seed alone, so 1 rank with
batch 4, 2 ranks with batch 2, and 2 ranks with batch 1 and 2 accumulation steps all see the
same data. They also compute the same gradient, because the loss is normalised by the number of
target tokens in the whole global batch, not per micro-batch: chess games have different
lengths, and averaging per micro-batch would weigh a token in a short batch more than one in a
long batch, differently for every split. With `--pack` the global batch is the same games, dealt
out to the ranks by tokens and packed into rows (`packing.py`), so the loss is the same too.
"""

import argparse
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from minidist import batches, packing
from minidist.checkpoint import final_model, preemption, state
from minidist.checkpoint.session import Session
from minidist.chess import jsonl, legal_moves
from minidist.chess.games import bundled_games
from minidist.hf import lora, model_folder, models
from minidist.runtime import divergence, metrics, tensorboard, torch_features
from minidist.runtime.distributed import cleanup, init_distributed, use_cores_for_offload
from minidist.runtime.errors import ArgumentParser, UsageError, one_line_errors
from minidist.memory import measure
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy
from minidist.step import (Packing, assemble_micro_batches, follow_schedule, lr_schedule, rescale_peak,
                           step_token_counts, train_step)


LEARNING_RATE = 3e-3  # the peak, reached after --warmup_steps


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m minidist.finetune", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=models.TINY, help="hub name, local folder, or `tiny` (the offline tiny Llama)")
    p.add_argument("--data", default=str(bundled_games("train")), help="training games, jsonl with a `text` field")
    p.add_argument("--eval_data", default=str(bundled_games("test")), help="held-out games for the legal-move rate")
    p.add_argument("--eval_prefixes", type=int, default=200, help="held-out prefixes to judge (0: skip evaluation)")
    p.add_argument("--illegal_games", choices=("refuse", "skip"), default="refuse",
                   help="a training game that is not legal chess: refuse the run (the games it trains on are checked), "
                        "or skip it and say how many were skipped (every game is checked)")
    ParallelOptions.add_arguments(p)  # --strategy, --impl, --mixed_precision, ... (strategy/options.py)
    # The course's own code trains from the first command; PyTorch's is one flag away, as the reference.
    p.set_defaults(impl="minidist")
    p.add_argument("--no_fsdp", action="store_true", help="the same as --strategy ddp")
    lora.add_arguments(p)  # --lora_rank, --lora_alpha, ... (lora.py)
    p.add_argument("--batch_size_per_device", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    # None until parsed: a rate given on the command line rescales a resumed schedule, the default does not
    p.add_argument("--learning_rate", type=float, default=None,
                   help=f"the peak learning rate (default {LEARNING_RATE:g}); given with --resume, it rescales the "
                        f"saved schedule")
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_steps", type=int, default=10)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--max_steps", type=int, default=150)
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--pack", action="store_true",
                   help="pack whole games into rows of --max_seq_length tokens, each game attending to itself alone "
                        "(packing.py), instead of padding every game to the longest of its micro-batch; a step still "
                        "trains on the same global batch of games, dealt out to the ranks by tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/chess")
    p.add_argument("--log_every", type=int, default=1)
    p.add_argument("--report_to", type=tensorboard.report_to, choices=tensorboard.CHOICES, default="none",
                   help="tensorboard: rank 0 also writes metrics.jsonl's records to OUTPUT_DIR/tensorboard")
    p.add_argument("--trace_memory_every", type=int, default=0, metavar="N",
                   help="on CPU, count the whole step's peak of live tensors (memory/measure.py, up to about 3x slower) on "
                        "the first step and every Nth after it (0: the first only); a GPU counts every step")
    p.add_argument("--no_save", action="store_true", help="do not write the fine-tuned model")
    p.add_argument("--save_dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="the saved model's dtype; auto: the one its config names (CodeLlama-7b: bf16), else fp32")
    p.add_argument("--save_steps", type=int, default=0,
                   help="write a checkpoint every N steps (0: only when SIGTERM or SIGUSR1 stops the run)")
    p.add_argument("--save_total_limit", type=int, default=2, help="keep the newest K checkpoints (0: keep all)")
    p.add_argument("--checkpoint_format", choices=("sharded", "full"), default="sharded",
                   help="sharded: each rank writes its shard (DCP); full: a from_pretrained folder + optimizer.pt")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue from the latest checkpoint in --output_dir, or from the checkpoint folder given")
    p.add_argument("--overwrite_output_dir", action="store_true", help="delete another run's checkpoints there first")
    args = p.parse_args(argv)
    args.learning_rate_given = args.learning_rate is not None
    if not args.learning_rate_given:
        args.learning_rate = LEARNING_RATE
    if args.no_fsdp:
        if args.strategy != "ddp" and _given("--strategy", sys.argv[1:] if argv is None else argv):
            p.error(f"--no_fsdp means --strategy ddp: give one or the other, not --strategy {args.strategy} with it")
        args.strategy = "ddp"
    for name in ("batch_size_per_device", "gradient_accumulation_steps", "max_steps", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    for name in ("save_steps", "save_total_limit", "trace_memory_every", "eval_prefixes", "warmup_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be 0 or more")
    if not args.learning_rate > 0:  # (also NaN) 0 would train nothing; a negative rate climbs the loss
        p.error(f"--learning_rate must be more than 0, got {args.learning_rate}")
    _check_numbers(p, args)
    if args.max_seq_length < 2:
        p.error("--max_seq_length must be at least 2 (a token and the one that follows it)")
    return args


def _given(flag: str, argv: list[str]) -> bool:
    """Was `flag` on the command line (argparse takes any unambiguous start of it, `--strat` too)?"""
    return any(len(a.split("=")[0]) > 4 and flag.startswith(a.split("=")[0]) for a in argv if a.startswith("--"))


def _check_numbers(p: ArgumentParser, args: argparse.Namespace) -> None:
    """Values argparse accepts that mean nothing: each once ended in a traceback deep in the run,
    or trained nonsense in silence (a negative clipping norm flips every gradient and climbs the loss)."""
    if math.isinf(args.learning_rate):
        p.error(f"--learning_rate must be finite, got {args.learning_rate}")
    if not (args.weight_decay >= 0 and math.isfinite(args.weight_decay)):  # NaN fails both
        p.error(f"--weight_decay must be a finite number 0 or more, got {args.weight_decay}")
    if not args.max_grad_norm > 0:  # 0 scales every gradient to nothing; NaN makes every weight NaN
        p.error(f"--max_grad_norm must be more than 0 (the largest gradient norm kept), got {args.max_grad_norm}")
    if not 0 <= args.seed < 2 ** 32:  # seed + rank seeds torch and the batch order
        p.error(f"--seed must be between 0 and {2 ** 32 - 1} (32 bits), got {args.seed}")
    if not args.output_dir.strip():  # "" would write checkpoints and the model into the current folder
        p.error(f"--output_dir must name a folder, got {args.output_dir!r}")


def train(args, around_train_step=None, around_step=None) -> dict:
    """Run the whole job on this rank; return what it measured (the tests compare these).

    Code that only measures subscribes through `around_train_step`: a function called once per
    step that returns a context manager, which the loop enters around `train_step` (the step's
    forward and backward). `notebooks/workers_06.py` counts CPU seconds there; the loop does not
    know what is measured. `around_step` is the same around the whole step, from its batches to its
    record and stop vote: `tests/loop/test_host_syncs.py` counts the step's host syncs there."""
    env = init_distributed()
    if args.cpu_offload:  # AdamW steps on the host: this rank's share of the CPU cores, not torchrun's one thread
        line = use_cores_for_offload(env)  # every rank sets its threads; rank 0 says how many
        if env.is_main:
            print(line)
    session = Session(args.output_dir, env, resume=args.resume, overwrite=args.overwrite_output_dir,
                      save_steps=args.save_steps, keep=args.save_total_limit, form=args.checkpoint_format)
    with session:  # this run's output folder alone, and the signal handlers put back after it (session.py)
        return _train(args, env, session, around_train_step or nullcontext, around_step or nullcontext)


def _train(args, env, session: Session, around_train_step, around_step) -> dict:
    """The run, in the order a learner reads it: options, strategy, model, optimizer, the steps."""
    torch.manual_seed(args.seed + env.rank)  # ranks differ on purpose: wrapping must make them agree
    if not env.is_main:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    strategy, lora_options, games = _check(args, env, session)  # before the expensive model load
    mesh = strategy.mesh  # every rank is a data-parallel rank; hsdp: shard x replicate groups (mesh.py)
    session.catch_stop_signals()  # from here SIGTERM/SIGUSR1/SIGINT mean: save after this step, stop

    model, config, num_params, model_name, model_bytes = _model(args, env, strategy, lora_options)
    games.pack = _packing(args, config, env, games, strategy)  # how the batches are packed; None without --pack
    optimizer = strategy.build_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_schedule(step, args.warmup_steps, args.max_steps))
    session.follow(strategy, model, optimizer, scheduler, games.tokenizer, args.max_steps, model_bytes)  # and the room
    say = print if env.is_main else _silent
    micro_bs, pad_token_id = args.batch_size_per_device, games.tokenizer.pad_token_id
    say(f"{model_name}: {num_params / 1e6:.1f}M parameters | {args.impl}/{args.strategy}{strategy.describe()} on "
        f"{env.world_size} x {env.device.type} | global batch {games.sampler.global_batch_size} = {micro_bs} x "
        f"{mesh.dp_size} ranks x {args.gradient_accumulation_steps} accumulation | {len(games.sequences)} games")

    log = metrics.MetricsLog(session.metrics_path, args.report_to) if env.is_main else None
    restored = _resumed(session, log, scheduler, args, say)  # with --resume: where to go on from, what came before
    if restored:
        start, results = restored
    else:
        start, results = 0, {"rate_before": _legal_rate("before training", model, games, strategy, env, say),
                             "losses": []}
    strategy.take_comm_bytes()  # count from here: the first step's total starts at zero
    meter = measure.MemoryMeter(env.device, args.trace_memory_every)
    recorder = metrics.StepRecorder(num_params, config, env.device, env.world_size)
    watch = divergence.Watch(config.vocab_size, args.warmup_steps, results["losses"])  # nan, stuck, or a spike
    bar = tqdm(total=args.max_steps, initial=start, desc="training", disable=not (env.is_main and sys.stderr.isatty()))
    for step in range(start, args.max_steps):
        with around_step():  # whatever a caller measures of the whole step (see `train`); nothing by default
            t0 = time.perf_counter()
            micro_batches, num_targets = assemble_micro_batches(games.sampler, games.sequences, step, mesh.dp_rank,
                                                                mesh.dp_size, micro_bs, pad_token_id, env.device,
                                                                strategy.sequence_multiple, games.pack)
            lr = scheduler.get_last_lr()[0]
            with meter.step(model, optimizer):  # the whole step's peak, and what forward saves for backward
                with around_train_step():  # whatever a caller measures (see `train`); nothing by default
                    loss_sum = train_step(model, strategy, micro_batches, num_targets, mesh.dp_size)
                grad_norm = strategy.clip_grad_norm_(model, args.max_grad_norm)
                optimizer.step()
            memory = meter.read(model, optimizer)  # before zero_grad: the gradients are still held
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss_sum.clone()
            dist.all_reduce(total, group=mesh.group)  # the loss over the whole global batch, for the log
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            step_time = time.perf_counter() - t0
            summed, norm = torch.stack([total, grad_norm.to(total)]).tolist()  # the step's figures, in one read
            memory = measure.gather(memory, env.device)  # outside the timed step: every rank's figures
            lengths = [len(games.sequences[i]) for i in games.sampler.global_batch(step)]
            record = recorder.record(step + 1, summed / num_targets, lr, norm, step_time, lengths, memory,
                                     strategy.take_comm_bytes(split=True), _token_counts(games, step, strategy, micro_bs))
            results["losses"].append(record["loss"])
            if log:
                log.write(record)
                if step % args.log_every == 0 or step + 1 == args.max_steps:
                    tqdm.write(metrics.format_step(record, args.max_steps))
                bar.update()
                bar.set_postfix(loss=f"{record['loss']:.3f}")
            kept = {"rate_before": results["rate_before"]}  # in the checkpoint beside the training state
            diverged = watch.see(step + 1, record["loss"], norm)  # the figures read above: no wait for the device
            # votes on a stop (or a divergence: one line, the last good checkpoint kept), saves
            if session.after_step(step + 1, record, games.sampler.position(step + 1), kept, diverged):
                results["stopped"] = session.stopped
                break
    bar.close()
    if log:
        log.close()
    if "stopped" not in results:  # the steps are done: evaluate and write the model, a stop still heard
        _finish(args, env, session, model, strategy, games, say, results)
    session.stop_catching()
    if "stopped" in results:  # not finished: the checkpoint has it all
        session.say_stopped()
    return results


@dataclass
class Games:
    """The chess games as the loop uses them: tokenized, dealt out by step, and the held-out prefixes."""

    tokenizer: object
    sequences: list[list[int]]  # token ids per game (batches.tokenize_games)
    sampler: batches.GlobalBatchSampler  # which games form global batch k, and who computes which
    prefixes: list  # held-out game prefixes for the legal-move rate ([]: --eval_prefixes 0)
    pack: Packing | None = None  # --pack: games packed whole into rows (packing.py), set once the model is loaded


def _check(args, env, session: Session):
    """Everything a learner can get wrong, checked before the expensive model load: the strategy
    and LoRA's flags, the model's folder, the data, and the checkpoint `--resume` names (in
    `session`). A mistake ends the run in one line (a UsageError)."""
    micro_bs, accum = args.batch_size_per_device, args.gradient_accumulation_steps
    try:
        strategy = get_strategy(ParallelOptions.from_args(args), env)
        lora_options = lora.LoraOptions.from_args(args)  # no --lora_rank: a full fine-tune
        args.model = models.resolve(args.model)
        model_folder.check_folder(args.model, max_seq_length=args.max_seq_length)  # tokenizer, weights, config
        strategy.check_model(args.model)  # --tp_size: can its heads and MLP be cut that many ways?
        lora.check(lora_options, args.model)  # its flags, and target modules this model has
        tokenizer = models.load_tokenizer(args.model)
        texts = jsonl.load_games(args.data)
        if args.illegal_games == "skip":
            texts, skipped = legal_moves.check_training_games(texts, args.data, "skip")
            if skipped and env.is_main:
                print(f"--illegal_games skip: skipped {skipped} of {skipped + len(texts)} games of {args.data} "
                      f"(not legal chess)")
        if args.pp_size > 1:
            _check_pipeline(args, lora_options)
        if args.pack:
            _check_pack(args)
        if args.impl == "torch" and args.sequence_parallel and args.eval_prefixes:
            raise ValueError("PyTorch's sequence parallelism cuts every sequence over the ranks, so it cannot generate "
                             "a token at a time for the legal-move rate: pass --eval_prefixes 0, or use --impl minidist")
        sequences = batches.tokenize_games(texts, tokenizer, args.max_seq_length)
        sampler = batches.GlobalBatchSampler(len(sequences), micro_bs * strategy.mesh.dp_size * accum, args.seed)
        if args.illegal_games == "refuse":  # the games the steps draw, as the sampler deals them
            used = {i for step in range(args.max_steps) for i in sampler.global_batch(step)}
            legal_moves.check_training_games(texts, args.data, "refuse", used)
        prefixes = legal_moves.game_prefixes(jsonl.load_games(args.eval_data), args.eval_prefixes, args.seed)
        # What a checkpoint must share with this run for the resume to be exact (state.verify).
        session.check_resume({"model": state.model_fingerprint(args.model),
                              # LoRA's flags too: lora.py
                              "strategy": f"{args.impl}/{args.strategy}{lora.fingerprint(lora_options)}",
                              "global_batch_size": sampler.global_batch_size, "seed": args.seed,
                              "num_examples": len(sequences), "data": state.data_fingerprint(texts),
                              # the batches' length, and the schedule's shape (its peak may change: _resumed)
                              "max_seq_length": args.max_seq_length, "warmup_steps": args.warmup_steps,
                              "max_steps": args.max_steps})
    except (FileNotFoundError, NotImplementedError, ValueError) as err:
        raise UsageError(err) from err
    return strategy, lora_options, Games(tokenizer, sequences, sampler, prefixes)


def _check_pack(args) -> None:
    """What `--pack` cannot do, in one line (a ValueError): an attention that cannot take the mask
    (eager adds it to its scores as numbers)."""
    packing.attention_path(models.build_on_meta(args.model).config._attn_implementation)


def _packing(args, config, env, games: "Games", strategy) -> Packing | None:
    """With `--pack`: how the batches are packed, and two lines at the start (rank 0): the attention
    path (`packing.choose_attention`: flash-attention's varlen on a GPU that has it) and how many
    games `tokenize_games` cut to --max_seq_length (a row holds whole games of at most that many
    tokens, so those are packed as cut). What an axis cannot take is refused in one line
    (`strategy.check_packing`: PyTorch's pipeline, with flash-attention's varlen rows)."""
    if not args.pack:
        return None
    implementation = packing.choose_attention(config, env.device, half=args.mixed_precision != "fp32")
    varlen = packing.ATTENTION_PATHS[implementation] == "varlen"
    try:
        strategy.check_packing(varlen)
    except ValueError as err:
        raise UsageError(err) from err
    eos = games.tokenizer.eos_token_id
    cut = sum(1 for seq in games.sequences if seq[-1] != eos)  # an uncut game ends with EOS (tokenize_games)
    if env.is_main:
        print(packing.describe_attention(implementation))
        print(f"--pack: {cut} of {len(games.sequences)} games are longer than --max_seq_length {args.max_seq_length} "
              f"tokens and are truncated to it (tokenize_games), then packed whole")
    return Packing(args.max_seq_length, varlen=varlen)


def _token_counts(games: Games, step: int, strategy, micro_bs: int) -> dict:
    """The real and padded tokens the data-parallel ranks compute at `step`, for its record."""
    return step_token_counts(games.sampler, games.sequences, step, strategy.mesh.dp_size, micro_bs,
                             strategy.sequence_multiple, games.pack)


def _check_pipeline(args, lora_options: lora.LoraOptions) -> None:
    """What pipeline parallelism does not do yet, each in one line (a ValueError)."""
    if lora.enabled(lora_options):
        raise ValueError("LoRA with --pp_size has not been built: use one or the other")
    if args.impl == "torch" and args.gradient_accumulation_steps < args.pp_size:  # GPipe with m < p (reference.py)
        torch_features.require("pipeline_fewer_microbatches")
    # checkpoints: every strategy a pipeline composes with, in both forms (strategy/state/pipeline.py)


def _model(args, env, strategy, lora_options: lora.LoraOptions):
    """The model as the strategy trains it, and what the log says of it: its config, its number of
    parameters (LoRA's adapters not counted) and its class name; and the bytes of the fine-tuned
    model the run writes at the end (`_model_bytes`), for the disk check after the first step."""
    model = strategy.load_model(args.model)  # minidist FSDP: rank 0 only; the others get shapes
    config, num_params, model_name = model.config, models.num_parameters(model), type(model).__name__
    written = num_params
    if lora.enabled(lora_options):  # the base frozen, adapters beside it, the same on every rank (lora.py)
        model = lora.apply(model, lora_options, args.seed)
        written = sum(p.numel() for p in model.parameters() if p.requires_grad)  # meta tensors count too
        if env.is_main:
            print(lora.describe(model))
    if args.gradient_checkpointing:
        strategy.checkpoint_activations(model)
    model = strategy.wrap(model)
    # from_pretrained hands back a model in eval mode. Training mode matters: transformers
    # recomputes layers (--gradient_checkpointing) only in it, and dropout, where a model has any.
    model.train()
    return model, config, num_params, model_name, _model_bytes(args, written)


def _model_bytes(args, parameters: int) -> int:
    """The fine-tuned model's bytes on disk: its parameters (with LoRA, the adapters alone:
    `final_model.py`) in the dtype it is written in; 0 with --no_save."""
    if args.no_save:
        return 0
    return parameters * final_model.saved_dtype(args.save_dtype, args.model).itemsize


def _resumed(session: Session, log, scheduler, args, say) -> tuple[int, dict] | None:
    """With `--resume`: the step to go on from, and the results of the steps before it; the
    weights, Adam moments, LR step, RNGs and the metrics of steps 1..start come back. Else None.

    The learning-rate schedule comes back too, with the peak it was saved with, unless the command
    line gives `--learning_rate`: then the user asked for another rate (say, a lower one after a
    divergence), and the schedule keeps its shape, scaled to the new peak, in a line that says so.
    Another `--max_steps` than the checkpoint's run had is honoured the same way, in a line: the
    run trains on to it (or stops sooner), and since the cosine decays towards max_steps, the rate
    from the resumed step on is the new schedule's; a checkpoint already past it is refused."""
    restored = session.resume()
    if restored is None:
        return None
    saved_steps = restored["run"].get("max_steps")
    if saved_steps is not None and saved_steps != args.max_steps:
        if restored["step"] > args.max_steps:
            raise UsageError(f"--max_steps {args.max_steps}: the checkpoint {session.resume_path} is already at step "
                             f"{restored['step']}; pass a --max_steps of at least {restored['step']}")
        follow_schedule(scheduler)  # the next step's rate from the new schedule, not the saved one
        say(f"--max_steps {args.max_steps} on resume (the checkpoint's run had {saved_steps}): training goes on to step "
            f"{args.max_steps}, the learning rate following a schedule of {args.max_steps} steps from here "
            f"(this step's rate: {scheduler.get_last_lr()[0]:.3g})")
    if args.learning_rate_given and scheduler.base_lrs[0] != args.learning_rate:
        old = rescale_peak(scheduler, args.learning_rate)
        say(f"--learning_rate {args.learning_rate:g} on resume: the saved schedule's peak {old:g} is rescaled to it "
            f"(this step's rate: {scheduler.get_last_lr()[0]:.3g})")
    if log:  # metrics.jsonl becomes steps 1..start: what a killed run logged after them goes
        for record in restored["records"]:
            log.write(record)
    return restored["step"], {"rate_before": restored["extra"]["rate_before"],
                              "losses": [record["loss"] for record in restored["records"]]}


def _legal_rate(when: str, model, games: Games, strategy, env, say) -> float | None:
    """The share of legal next moves the model generates on the held-out prefixes (None without any)."""
    if not games.prefixes:
        return None
    with strategy.autocast():  # the data-parallel ranks share the prefixes: tensor-parallel ranks judge the same ones
        result = legal_moves.legal_move_rate(model, games.tokenizer, games.prefixes, env.device, group=strategy.mesh.group,
                                             continue_fn=strategy.continue_fn())  # a pipeline: through its stages
    say(f"legal-move rate {when}: {result['legal_move_rate']:.1%} ({result['legal']}/{result['total']})")
    return result["legal_move_rate"]


def _finish(args, env, session: Session, model, strategy, games, say, results: dict) -> None:
    """After the last step: the legal-move rate, then the fine-tuned model (`results` gets both).

    The stop signals still hold. A stop asked during the evaluation or the write ends the run at
    the boundary after it, as after a step (`session.stopped_at_end`: a checkpoint of the last step,
    status 75), and `--resume` then does only this: no step is left to train."""
    preemption.pause_if_asked("eval", session.last["step"])  # a test hook, idle unless MINIDIST_PAUSE_AT says so
    results["rate_after"] = _legal_rate("after training", model, games, strategy, env, say)
    if session.stopped_at_end("the evaluation"):
        results["stopped"] = session.stopped
        return
    results["parameters"] = None if args.no_save else strategy.full_state_dict(model)
    session.write_final_model(strategy.model_to_save(model, args.model), results["parameters"], args.save_dtype, args.model,
                              games.tokenizer, {k: results[k] for k in ("rate_before", "rate_after")})
    if session.stopped_at_end("the final model write"):
        results["stopped"] = session.stopped


def _silent(*args, **kwargs) -> None:
    """`print` on the other ranks: rank 0 alone speaks."""


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        with one_line_errors("minidist.finetune"):  # once, first, and named by torchrun (errors.py)
            if "stopped" in train(args):
                sys.exit(preemption.EXIT_STOPPED)  # "try again later": the batch script or the learner resumes
    finally:
        cleanup()


if __name__ == "__main__":
    main()
