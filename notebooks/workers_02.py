"""Worker functions for lesson 02 (DDP), launched by `minidist.runtime.launch.launch`.

They live in a `.py` file because every rank is a fresh process that imports its worker by
name; a function defined in a notebook cell cannot be imported. Nothing here re-implements
minidist: `train` runs the real training loop, `minidist.finetune.train`, with the flags a
learner would type; `backward_timeline` runs the loop's own pieces (`get_strategy`, `wrap`,
`token_loss_sum`) one step at a time, and only *watches* them: it notes when each gradient is
ready and when each all-reduce starts and finishes (and, for the bucketed DDP, which bucket it
carries), without changing what is computed or sent, and records one step of each under
`torch.profiler`.
"""

import contextlib
import time

import torch.distributed as dist
from torch.autograd.profiler import record_function

from minidist import batches
from minidist.chess import jsonl
from minidist.hf import models
from minidist.step import token_loss_sum
from minidist.bench import timeline
from minidist.runtime.distributed import init_distributed
from minidist.parallel import comm
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy

import training


def _setup_rank() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars, one per rank and run: noise here
    training.share_cores()


@contextlib.contextmanager
def watch_all_reduces(calls: list):
    """Note (start, finish, bytes, address) of every `comm.all_reduce` while inside, in `calls`.

    `minidist.parallel.ddp` calls `comm.all_reduce` through the module, so replacing the module's
    function for a while sees every call. The call itself is unchanged. An asynchronous one
    returns at once; its finish is when gloo completes it, which the work's future reports
    (the callback runs in gloo's own thread). The address of the tensor's data (`data_ptr`)
    says which buffer was sent, without keeping the tensor alive."""
    real = comm.all_reduce

    def noted(tensor, group=None, async_op=False):
        call = {"start": time.perf_counter(), "finish": None, "bytes": tensor.numel() * tensor.element_size(),
                "data_ptr": tensor.data_ptr()}
        calls.append(call)
        work = real(tensor, group=group, async_op=async_op)
        if async_op:
            work.get_future().then(lambda _: call.update(finish=time.perf_counter()))
        else:
            call["finish"] = time.perf_counter()
        return work

    comm.all_reduce = noted
    try:
        yield
    finally:
        comm.all_reduce = real


def bucket_launches(calls: list, buffers: list[int]) -> list[tuple[str, int, float]]:
    """("launch", bucket, when the call began) for each all-reduce in `calls`, in launch order. The
    bucket is the one whose buffer's address (`buffers`: `model.buckets[i].buffer.data_ptr()`) the
    call was given. A bucketed DDP that reduces in another dtype (`--reduce_dtype bf16`) sends a
    cast copy instead; then the i-th call of the step is taken to be bucket i (buckets are packed,
    and so fill, in the order backward produces the gradients)."""
    return [("launch", buffers.index(c["data_ptr"]) if c["data_ptr"] in buffers else i, c["start"])
            for i, c in enumerate(calls)]


def backward_timeline(model_dir: str, data_path: str, bucket_cap_mb: float, batch: int, seq_len: int,
                      steps: int, warmup: int = 2, trace_dir: str | None = None) -> dict:
    """For the naive and the bucketed DDP: time each training step's forward, backward and
    all-reduces on this rank, and return every timed step's figures and the last step's events
    (seconds from forward's start).

    The two variants take turns, step by step (naive, bucketed, naive, ...), each its own model
    from the same weights, so a slow moment of a shared machine hits both alike. The first
    `warmup` steps of each are not kept (and the bucketed DDP re-packs its buckets after its
    first backward, in the order the gradients really came). With `trace_dir`, one more step of
    each runs under `torch.profiler` and rank 0 writes its Chrome trace there."""
    env = init_distributed()
    _setup_rank()
    tokenizer = models.load_tokenizer(model_dir)
    sequences = batches.tokenize_games(jsonl.load_games(data_path), tokenizer, seq_len)
    sampler = batches.GlobalBatchSampler(len(sequences), batch * env.world_size, seed=0)
    variants = {}
    for variant in ("naive", "bucketed"):
        options = ParallelOptions(strategy="ddp", impl="minidist", ddp_variant=variant, bucket_cap_mb=bucket_cap_mb)
        strategy = get_strategy(options, env)
        model = models.load_model(model_dir)
        ready = {}  # parameter -> when autograd finished its gradient (hooks registered before DDP's run first)
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda _, name=name, ready=ready: ready.__setitem__(name, time.perf_counter()))
        model = strategy.wrap(model)
        variants[variant] = (strategy, model, strategy.build_optimizer(model, lr=1e-3), ready)
    out = {v: {"steps": []} for v in variants}
    for step in range(warmup + steps):
        ids, = sampler.micro_batches(step, env.rank, env.world_size, batch)
        micro = batches.collate([sequences[i] for i in ids], tokenizer.pad_token_id)
        num_targets = sum(len(sequences[i]) - 1 for i in sampler.global_batch(step))
        for variant, (strategy, model, optimizer, ready) in variants.items():
            calls = []
            # The buckets this backward fills (the bucketed DDP re-packs them after its first one).
            buffers = [b.buffer.data_ptr() for b in getattr(model, "buckets", [])]
            dist.barrier()  # start together, so the picture shows this rank's work, not a late peer
            with watch_all_reduces(calls):
                t0 = time.perf_counter()
                loss = token_loss_sum(model, micro, strategy) * env.world_size / num_targets
                t1 = time.perf_counter()
                loss.backward()  # the DDP hooks run inside: launches, and the wait for every bucket
                t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step < warmup:
                continue

            def since_start(when):  # seconds from this step's forward start
                return when - t0

            last = since_start(max(ready.values()))  # after this, backward only waits for the network
            out[variant]["steps"].append({"backward": t2 - t1, "waited": since_start(t2) - last,
                                          "launched_before_last": sum(since_start(c["start"]) < last for c in calls),
                                          "all_reduces": len(calls)})
            out[variant].update({
                "forward": (0.0, since_start(t1)),
                "backward": (since_start(t1), since_start(t2)),
                "last_gradient": last,
                "all_reduces": [(since_start(c["start"]), since_start(c["finish"]), c["bytes"]) for c in calls],
                "timeline": [(event, bucket, since_start(when))
                             for event, bucket, when in bucket_launches(calls, buffers)] if buffers else [],
                "buckets": [sum(p.numel() * p.element_size() for p in b.params) for b in getattr(model, "buckets", [])],
                "num_params": len(model.params),
            })
    if trace_dir is not None:
        for variant, (strategy, model, optimizer, _) in variants.items():
            path = f"{trace_dir}/02_{variant}_ddp.json"
            trace = _profile_step(env, strategy, model, optimizer, micro, num_targets, path)
            if trace:
                out[variant]["trace"] = trace
    return out


def _profile_step(env, strategy, model, optimizer, micro, num_targets, path: str) -> str | None:
    """One more training step, recorded under `torch.profiler` on rank 0 (its Chrome trace written
    to `path`, which is returned); the other ranks run it unrecorded."""
    def step():
        with record_function("forward"):
            loss = token_loss_sum(model, micro, strategy) * env.world_size / num_targets
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    if env.rank == 0:
        with training.without_profiler_notices():
            return str(timeline.record(step, env.device, path))
    step()  # the same step, unrecorded: rank 0's all-reduces need a partner
    return None


def train(model_dir: str, data_path: str, steps: int, seq_len: int, total_batch: int, variant: str = "bucketed",
          lr: float = 3e-3) -> dict:
    """Train with the hand-written DDP, the global batch fixed at `total_batch` sequences split
    evenly over the ranks (`--batch_size_per_device total_batch / world_size`); return rank 0's
    records of every step, the loop's log, and (rank 0) the trained weights.

    Works in a world of one too: called in the notebook's own process, `init_distributed`
    makes it a process group of one rank, exactly like `python -m minidist.finetune`."""
    env = init_distributed()
    _setup_rank()
    done = training.run([  # without --no_save: the full weights come back on rank 0
        "--model", model_dir, "--data", data_path, "--impl", "minidist", "--strategy", "ddp",
        "--ddp_variant", variant, "--max_steps", str(steps), "--max_seq_length", str(seq_len),
        "--batch_size_per_device", str(total_batch // env.world_size), "--learning_rate", str(lr),
        "--warmup_steps", "1", "--eval_prefixes", "0",
    ])
    return {"world_size": env.world_size, "records": done["records"], "log": done["log"],
            "parameters": done["result"]["parameters"]}


def lesson(model_dir: str, data_path: str, timeline: dict | None, training: dict) -> dict:
    """One launch does both parts of the notebook (each launch costs seconds of start-up):
    the timeline (if asked) and the training run on this world size."""
    out = {"timeline": backward_timeline(model_dir, data_path, **timeline) if timeline else None}
    out["training"] = train(model_dir, data_path, **training)
    return out
