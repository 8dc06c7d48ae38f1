"""Evaluation's terms (`memory/evaluation.py`) against what transformers really allocates.

A tiny T5 whose attention width (num_heads x d_kv = 24) is not its d_model (32), so a formula
that uses the wrong width fails; sources and targets of different lengths, so one that swaps
them fails. The cache is the one `generate` returns; the accumulated bytes are what a real
`Seq2SeqTrainer.prediction_step` hands to `evaluation_loop` for one batch."""

import pytest
import torch
import transformers as T

from minidist.memory import evaluation

# The full suite only: evaluation peaks measured through generate and a Trainer.
pytestmark = pytest.mark.slow

BATCH, SOURCE, TARGET, MAX_LENGTH = 3, 11, 5, 7


@pytest.fixture(scope="module")
def tiny_t5():
    torch.manual_seed(0)
    config = T.T5Config(vocab_size=64, d_model=32, d_kv=6, num_heads=4, d_ff=64, num_layers=2,
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T.T5ForConditionalGeneration(config).eval()


def batch():
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(2, 64, (BATCH, SOURCE), generator=generator),
            "attention_mask": torch.ones(BATCH, SOURCE, dtype=torch.long),
            "labels": torch.randint(2, 64, (BATCH, TARGET), generator=generator)}


def cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_kv_cache_is_generates_own(tiny_t5, num_beams):
    inputs = batch()
    out = tiny_t5.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                           max_length=MAX_LENGTH, min_length=MAX_LENGTH, num_beams=num_beams,
                           do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape[1] == MAX_LENGTH  # min_length: no early end, so the cache is full
    cache = out.past_key_values
    terms = evaluation.generation_bytes(tiny_t5.config, BATCH, SOURCE, MAX_LENGTH, dtype_bytes=4,
                                        num_beams=num_beams)
    assert terms["self_attention"] == cache_bytes(cache.self_attention_cache)
    assert terms["cross_attention"] == cache_bytes(cache.cross_attention_cache)
    encoder_output = tiny_t5.get_encoder()(input_ids=inputs["input_ids"]).last_hidden_state
    assert terms["encoder_output"] == num_beams * encoder_output.nbytes


def trainer(model, tmp_path, predict_with_generate):
    args = T.Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=predict_with_generate,
                                      report_to=[], use_cpu=True)
    return T.Seq2SeqTrainer(model=model, args=args)


@pytest.mark.parametrize("predict_with_generate", [True, False])
def test_accumulated_bytes_are_prediction_steps(tiny_t5, tmp_path, predict_with_generate):
    """One batch's (loss, predictions, labels), as `evaluation_loop` concatenates them on the device."""
    loss, predictions, labels = trainer(tiny_t5, tmp_path, predict_with_generate).prediction_step(
        tiny_t5, batch(), prediction_loss_only=False, max_length=MAX_LENGTH)  # evaluate()'s generation_max_length
    kept = predictions if isinstance(predictions, tuple) else (predictions,)
    terms = evaluation.accumulated_bytes(tiny_t5.config, BATCH, predict_with_generate=predict_with_generate,
                                         max_length=MAX_LENGTH, source_length=SOURCE, target_length=TARGET,
                                         logits_bytes=4)
    assert terms["predictions"] == sum(tensor.nbytes for tensor in kept)
    assert terms["labels"] == labels.nbytes
    assert terms["losses"] == loss.repeat(BATCH).nbytes  # evaluation_loop repeats the mean per example


def test_eval_forward_logits(tiny_t5):
    with torch.no_grad():
        logits = tiny_t5(**batch()).logits
    terms = evaluation.eval_forward_bytes(tiny_t5.config, BATCH, TARGET, logits_bytes=4)
    assert terms["logits"] == logits.nbytes
    assert terms["log_probs"] == torch.log_softmax(logits.float(), -1).nbytes


def test_reserved_bounds():
    assert evaluation.reserved_bounds(5.0, 3.0, resident=1.0) == (5.0, 7.0)
    assert evaluation.reserved_bounds(2.0, 3.0, resident=1.0) == (3.0, 4.0)


def test_eval_forward_peak_fake_is_real_and_mostly_the_vocabulary():
    """MemTracker under fake tensors gives the real tensors' figures; with a vocabulary far wider than
    the model, the rest of the peak is the logits and the fp32 log-probabilities (a missing term fails)."""
    config = T.T5Config(vocab_size=4096, d_model=16, d_kv=4, num_heads=2, d_ff=32, num_layers=1,
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    fake = evaluation.eval_forward_peak(config, BATCH, SOURCE, TARGET, mode="fp32")
    torch.manual_seed(0)
    assert evaluation.eval_forward_peak(config, BATCH, SOURCE, TARGET, mode="fp32", fake=False) == fake
    vocabulary = sum(evaluation.eval_forward_bytes(config, BATCH, TARGET, logits_bytes=4).values())
    assert vocabulary <= fake["rest"] < 1.1 * vocabulary


def test_trainer_peaks_wiring(tiny_t5, tmp_path):
    """The Trainer's run on one GPU and on two: DDP's buckets only with two, eval terms at the eval batch
    (8, not the training batch) in the compute dtype, the eval peak at the last concatenation of kept logits."""
    from dataclasses import replace

    from minidist.memory import estimator

    tiny_t5.config.save_pretrained(tmp_path)
    shape = estimator.model_shape(str(tmp_path))
    one = estimator.setup(strategy="ddp", impl="torch", mixed_precision="bf16", batch_size_per_device=1,
                          max_seq_length=SOURCE, target_length=TARGET)
    forward = {"rest": 0}
    for setup in (one, replace(one, world_size=2)):
        train = estimator.estimate(shape, setup)
        peaks = evaluation.trainer_peaks(shape, setup, forward, examples=100, predict_with_generate=False)
        buckets = train["buckets"] if setup.world_size == 2 else 0
        assert peaks["resident"] == train["parameters"] + train["optimizer_states"] + buckets
        assert peaks["train_peak"] == train["peak"] - train["buckets"] + buckets
        generation = evaluation.generation_bytes(shape.config, 8, SOURCE, evaluation.DEFAULT_GENERATED_LENGTH, 2)
        assert peaks["generation"] == sum(generation.values())
        accumulated = evaluation.accumulated_bytes(shape.config, 100, predict_with_generate=False, max_length=21,
                                                   source_length=SOURCE, target_length=TARGET, logits_bytes=2)
        assert peaks["accumulated"] == sum(accumulated.values())
        before_last = evaluation.accumulated_bytes(shape.config, 100 - 8, predict_with_generate=False, max_length=21,
                                                   source_length=SOURCE, target_length=TARGET, logits_bytes=2)
        concatenating = sum(before_last.values()) + peaks["accumulated"]  # torch.cat's old and new at once
        assert concatenating > peaks["accumulated"] + peaks["generation"]  # here the larger: the case tested
        assert peaks["eval_peak"] == peaks["resident"] + concatenating
