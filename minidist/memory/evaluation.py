"""Evaluation's memory: what `Seq2SeqTrainer.evaluate` adds to a training run's peak (`trainer_peaks`).

The estimator (`estimator.py`) traces one training step. A fine-tune under the Trainer also
evaluates, every epoch with `eval_strategy="epoch"`, and evaluation allocates things a training
step never does. With `predict_with_generate`, `Seq2SeqTrainer.prediction_step` (transformers
5.x, `trainer_seq2seq.py`) does, for each eval batch of `per_device_eval_batch_size` (default 8):

1. **`model.generate`**: greedy by default (`num_beams` 1), up to `max_length` tokens (the
   `generation_max_length` argument; unset, 20 new tokens after the start token, 21 in all). An
   encoder-decoder keeps, per decoder layer and per sequence (batch x beams), the keys and values
   of its self-attention for every token fed so far (up to `max_length - 1`: the last token is
   never fed back) and of its cross-attention for the whole encoder output: `kv_cache_bytes`. The
   encoder output itself stays alive for the whole call.
2. **A forward with the labels, for the eval loss**, under `no_grad`: nothing is saved for
   backward, but the logits of the whole eval batch (b x target x vocab) and the loss's fp32
   log-probabilities exist at once: `eval_forward_bytes` by formula, `eval_forward_peak` with all
   the rest, measured by PyTorch's `MemTracker`. (Training's logits term, `estimator.activations`,
   is two fp32 tensors the logits' size beside the saved log-probabilities, the loss's gradients as
   backward starts; under `no_grad` no gradient is made, and the logits stay in the forward's dtype.)
3. **Accumulation** (`Trainer.evaluation_loop`): each batch's predictions and labels are
   concatenated onto what came before, *on the GPU*, for the whole eval set, unless
   `eval_accumulation_steps` moves them to the CPU every that many batches. With
   `predict_with_generate` the predictions are token ids (int64, padded to at least 20); without
   it they are the logits, b x target x vocab each, plus T5's encoder output:
   `accumulated_bytes`. `torch.cat` holds the old and the new tensor at once while it grows.

What `nvidia-smi` shows is none of these sums exactly: PyTorch's caching allocator keeps the
blocks it frees *reserved* for reuse (PyTorch docs, "CUDA semantics", memory management), so
after training the activations' blocks stay reserved when evaluation starts, and evaluation's
differently sized blocks fit in them only in part. `reserved_bounds` gives the bracket this
implies; where in it a run lands is the allocator's fragmentation, which only a GPU can measure
(`torch.cuda.max_memory_reserved()` beside `torch.cuda.max_memory_allocated()`).

Sizes are bytes; tests/memory/test_evaluation.py holds the cache formula to a tiny T5's
`generate`, the accumulated bytes to a real `Seq2SeqTrainer.prediction_step`, and the fake
trace of the eval forward to real tensors. Lesson 00 (its T5 diary) and notebook 00's section 2c
use them.
"""

import contextlib

from minidist.memory import cache

INT64 = 8  # token ids and labels, as the tokenizer and `generate` return them
FP32 = 4
# GenerationConfig's default max_length. Unset, `generate` on an encoder-decoder makes 20 tokens after
# the decoder's start token: sequences of DEFAULT_GENERATED_LENGTH (transformers 5.24, measured).
GENERATION_CONFIG_MAX_LENGTH = 20
DEFAULT_GENERATED_LENGTH = 21


def kv_cache_bytes(config, sequences: int, source_length: int, cached_length: int, dtype_bytes: int) -> dict:
    """An encoder-decoder's KV cache: self-attention over `cached_length` tokens, cross over the source.

    `sequences` is the eval batch times the beams. Each decoder layer keeps a key and a value of
    `num_heads x d_kv` per token (T5's inner width, which need not be `d_model`). After
    generating a sequence of n tokens, n - 1 have been fed back: pass `cached_length = n - 1`."""
    per_token = 2 * config.num_heads * config.d_kv * dtype_bytes  # K and V
    layers = config.num_decoder_layers
    return {"self_attention": layers * sequences * cached_length * per_token,
            "cross_attention": layers * sequences * source_length * per_token}


def generation_bytes(config, batch: int, source_length: int, max_length: int, dtype_bytes: int,
                     num_beams: int = 1) -> dict:
    """What one `generate` call holds at its last step: the full KV cache and the encoder output."""
    sequences = batch * num_beams
    cache = kv_cache_bytes(config, sequences, source_length, max_length - 1, dtype_bytes)
    return {**cache, "encoder_output": sequences * source_length * config.d_model * dtype_bytes}


def eval_forward_bytes(config, batch: int, target_length: int, logits_bytes: int) -> dict:
    """The eval loss's forward under `no_grad`: the batch's logits and the loss's fp32 log-probabilities."""
    elements = batch * target_length * config.vocab_size
    return {"logits": elements * logits_bytes, "log_probs": elements * FP32}


def eval_forward_peak(config, batch: int, source_length: int, target_length: int, mode: str = "bf16",
                      fake: bool = True) -> dict:
    """The eval loss's forward, measured: PyTorch's `MemTracker` (as `tracker.py`) around T5's own forward
    with labels, under `no_grad` and, for `mode="bf16"`, CPU autocast, as `prediction_step` runs it.

    Under `FakeTensorMode` (`fake=True`) nothing is allocated, so t5-base at batch 8 x 512 is
    traced on a laptop; `fake=False` runs the same with real tensors (the test's check). The
    peak holds the weights (4 bytes each: fp32 masters), the logits and the loss's fp32
    log-probabilities (`eval_forward_bytes`), and what the formula leaves out: T5's position
    biases (b x heads x T x T, alive for the whole stack), the hidden states and, under autocast,
    the bf16 weight copies. Returns bytes: the peak, and its split into weights and the rest.
    A fake trace takes seconds to a minute, so it is kept on disk (`cache.py`) like the estimator's."""
    if fake:
        key = {"config": config.to_json_string(), "sizes": [batch, source_length, target_length], "mode": mode}
        return cache.cached("eval_forward", key, lambda: _eval_forward_peak(config, batch, source_length,
                                                                             target_length, mode, fake))
    return _eval_forward_peak(config, batch, source_length, target_length, mode, fake)


def _eval_forward_peak(config, batch: int, source_length: int, target_length: int, mode: str, fake: bool) -> dict:
    import torch
    import transformers as T
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from minidist.memory.trace import batch_for

    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = T.T5ForConditionalGeneration(config).eval()
        # The loop's shapes (`trace.batch_for`): the last pair right-padded from half its lengths.
        inputs = batch_for(batch, source_length, padded=True, vocab_size=config.vocab_size, target_seq=target_length)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker, torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=mode == "bf16"):
            model(**inputs).loss.detach()
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()  # one device: the CPU
    split = {getattr(kind, "value", kind): int(size) for kind, size in snapshot.items()}
    return {"peak": split["Total"], "weights": split["Parameter"], "rest": split["Total"] - split["Parameter"]}


def accumulated_bytes(config, examples: int, *, predict_with_generate: bool, max_length: int,
                      source_length: int, target_length: int, logits_bytes: int,
                      config_max_length: int = GENERATION_CONFIG_MAX_LENGTH) -> dict:
    """What `evaluation_loop` keeps on the GPU for `examples` eval examples (no `eval_accumulation_steps`).

    With `predict_with_generate`: the generated ids (`max_length` of them per example) and the
    labels, each padded up to the model's generation config's `max_length` when shorter
    (`prediction_step` pads to that one, 20 by default, even when `generation_max_length` asked
    for fewer). Without: T5's outputs other than the loss and the cache, the logits and the
    encoder's last hidden state, in the dtype the forward produced (`logits_bytes`)."""
    losses = examples * FP32  # the batch's mean loss, repeated per example
    if predict_with_generate:
        predictions = examples * max(max_length, config_max_length) * INT64
        labels = examples * max(target_length, config_max_length) * INT64
    else:
        predictions = examples * (target_length * config.vocab_size + source_length * config.d_model) * logits_bytes
        labels = examples * target_length * INT64
    return {"predictions": predictions, "labels": labels, "losses": losses}


def trainer_peaks(shape, setup, eval_forward: dict, *, eval_batch: int = 8, examples: int = 1000,
                  max_length: int = DEFAULT_GENERATED_LENGTH, num_beams: int = 1,
                  predict_with_generate: bool = True) -> dict:
    """One GPU's allocated peaks for a Trainer run that trains (`setup`, DDP) and evaluates as `Seq2SeqTrainer`.

    Training is the estimator's traced step (`estimator.estimate`), less DDP's buckets on one GPU:
    the Trainer wraps a model in DDP only when several processes run. Evaluation runs between
    steps, after `zero_grad(set_to_none=True)`: the weights, AdamW's moments and DDP's buckets stay
    (`resident`); on top, the accumulated predictions of the whole eval set, and the larger of
    the eval forward's own tensors (`eval_forward`, from `eval_forward_peak` at the eval batch)
    and one `generate` call's cache and encoder output; or, if larger, the last concatenation,
    old and grown predictions at once. Bytes, by term, with both peaks."""
    from minidist.memory import estimator

    train = estimator.estimate(shape, setup)
    buckets = train["buckets"] if setup.world_size > 1 else 0
    resident = train["parameters"] + train["optimizer_states"] + buckets
    length, dtype_bytes = setup.max_seq_length, 4 if setup.options.mixed_precision == "fp32" else 2
    target = setup.target_length or length
    generation = sum(generation_bytes(shape.config, eval_batch, length, max_length, dtype_bytes, num_beams).values())

    def kept(count: int) -> int:
        return sum(accumulated_bytes(shape.config, count, predict_with_generate=predict_with_generate,
                                     max_length=max_length, source_length=length, target_length=target,
                                     logits_bytes=dtype_bytes).values())

    accumulated = kept(examples)
    # The last batch's `torch.cat` (`nested_concat`) makes the grown tensor while the old one still exists.
    concatenating = kept(examples - eval_batch) + accumulated
    eval_peak = resident + max(accumulated + max(eval_forward["rest"], generation), concatenating)
    return {"train_peak": train["peak"] - train["buckets"] + buckets, "resident": resident,
            "eval_forward": eval_forward["rest"], "generation": generation, "accumulated": accumulated,
            "eval_peak": eval_peak}


def reserved_bounds(train_peak: float, eval_peak: float, resident: float) -> tuple[float, float]:
    """What `nvidia-smi` can show for a run that trains and evaluates, tensors alone (no CUDA context).

    At least the larger of the two allocated peaks: reserved memory never drops below what is
    allocated. About the training peak plus evaluation's own tensors (its peak less the `resident`
    states both share) at worst: the case where none of the blocks training freed (and the
    allocator keeps) fits what evaluation asks for, so every eval tensor takes a new block. A
    rough bound, not a hard one: fragmentation inside one phase can add to it too."""
    return max(train_peak, eval_peak), train_peak + eval_peak - resident
