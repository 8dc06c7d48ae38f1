"""The traced activation memory (`memory/trace.py`) against real CPU forwards of tiny models.

For each architecture, a tiny random config is built twice: for real on the CPU, where a forward
and the loop's loss run under `trace.SavedByLayer`, and on fake tensors by `trace.trace`. The
bytes saved by each layer, shared between layers, outside the layers and (autocast) the
bf16 weight copies must agree exactly, with and without padding, in fp32, bf16 and autocast.
Encoder-decoders (T5, BART) are traced whole, both stacks' blocks as layers. Sliding windows
(Mistral, Gemma2: window 16 < 64 tokens) and MoE top-k (k = 1 and 2) are traced as they run.
The real run's attribution must also add up to what the project's own tracker
(`measure.SavedActivations`) counts. The hand-derived Llama layer must equal the trace."""

import functools

import pytest
import torch
import transformers as T

from minidist.memory import estimator, llama_layer, measure, trace
from tiny_configs import BATCH, CONFIGS, SEQ, SMALL, TARGET, assert_equal

# The full suite only: a forward traced for each of many architectures.
pytestmark = pytest.mark.slow

# In fp32 the experts' grouped matmul is traced through transformers' fallback op (PyTorch's meta rule
# for `_grouped_mm` takes bf16 only), which keeps the groups' offsets (int32, one per expert) out of
# the saved tensors: the trace is short by 4 bytes per expert per sparse layer.
MOE_OFFSETS = {"mixtral": 4 * 4, "qwen2_moe": 4 * 4}
# Every architecture in every precision, unpadded and padded (the padded path is one path in fp32 and
# bf16: only the element size differs; fp32 padded is the hand-derived Llama's test below).
CASES = [("fp32", False), ("bf16", True), ("autocast", False)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls on a busy machine: a second thread only spins (a real forward takes 0.8 s with
    2 threads on a loaded 2-core machine, 0.03 s with 1). The saved tensors do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def target(name):
    return TARGET if CONFIGS[name]().is_encoder_decoder else None


def real_forward(config, mode, padded, target_seq=None):
    torch.manual_seed(0)
    model = trace.build(config, mode)
    batch = trace.batch_for(BATCH, SEQ, padded, config.vocab_size, target_seq=target_seq)
    return model, batch, trace.run_and_record(model, batch, mode)


@functools.cache
def traced(name, mode, padded):
    """One trace per case for the whole module: several tests read the same one."""
    return trace.trace(CONFIGS[name](), BATCH, SEQ, mode, padded, target_seq=target(name))


@pytest.mark.parametrize("mode,padded", CASES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_trace_is_what_a_real_forward_saves(name, mode, padded):
    config = CONFIGS[name]()
    _, _, real = real_forward(config, mode, padded, target(name))
    assert len(real.layers) == (4 if config.is_encoder_decoder else 2)
    assert_equal(traced(name, mode, padded), real, f"{name} {mode} padded={padded}",
                 MOE_OFFSETS.get(name, 0) if mode != "bf16" else 0)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2_moe", "t5"])
def test_the_attribution_adds_up_to_what_the_tracker_counts(name):
    """Every saved storage is somewhere: layers + shared + outside + weight copies is the total
    that `measure.SavedActivations` (the loop's own tracker) holds at the end of forward."""
    from minidist.step import token_loss_sum

    config = CONFIGS[name]()
    model, batch, real = real_forward(config, "autocast", True, target(name))
    loss_sum = trace.seq2seq_loss_sum if config.is_encoder_decoder else token_loss_sum
    with measure.SavedActivations() as tracker:
        loss = loss_sum(model, batch, trace._Autocast("autocast"))
    assert tracker.current == real.saved + real.weight_copies
    del loss


@pytest.mark.parametrize("mode,padded", [("fp32", False), ("fp32", True), ("bf16", True), ("autocast", False)])
def test_the_hand_derived_llama_layer_is_the_trace(tmp_path, mode, padded):
    """The lesson's worked example (`llama_layer.layer_bytes_per_token`) equals the traced layer,
    grouped key/value heads included."""
    CONFIGS["llama"]().save_pretrained(tmp_path)
    shape = estimator.model_shape(str(tmp_path))
    derived = llama_layer.layer_bytes_per_token(shape, mode, SEQ, padded) * BATCH * SEQ
    assert set(traced("llama", mode, padded).layers) == {derived}


def test_layer_types_tell_a_non_uniform_model_apart():
    """Qwen2-MoE with every other layer sparse has two layer types of different sizes; Gemma2
    alternates sliding-window and full attention, which the type names. An encoder-decoder's
    layers are all its blocks, encoder's then decoder's, and a decoder block (it has cross-
    attention, over the source) is another type than an encoder block; T5's first block of each
    stack holds the relative position bias table, so it is a type of its own."""
    moe = traced("qwen2_moe", "fp32", False)
    assert len(moe.types) == 2 and moe.layers[0] != moe.layers[1]
    gemma = traced("gemma2", "fp32", False)
    assert {kind.split("(")[0] for kind in gemma.types} == {"Gemma2DecoderLayer[sliding_attention]",
                                                           "Gemma2DecoderLayer[full_attention]"}
    bart = traced("bart", "fp32", False)
    assert [kind.split("[")[0] for kind in bart.layer_types] == ["BartEncoderLayer"] * 2 + ["BartDecoderLayer"] * 2
    t5 = traced("t5", "fp32", False)
    assert len(t5.layers) == len(set(t5.layer_types)) == 4
    assert ["T5LayerCrossAttention" in kind for kind in t5.layer_types] == [False, False, True, True]
    assert ["Embedding" in kind for kind in t5.layer_types] == [True, False, True, False]  # the bias table


def test_an_encoder_decoder_saves_what_its_two_lengths_say():
    """A decoder block saves per target token and, for its cross-attention, per target x source
    pair; an encoder block only per source token. A longer target grows the decoder's blocks and
    leaves the encoder's as they were. T5's relative position bias is not saved as such (it is
    only added to the scores): what its first block keeps is the embedding's T x T int64 bucket
    indices, so the first encoder block is 8 x SEQ x SEQ bytes larger than the second."""
    for name in ("t5", "bart"):
        short = traced(name, "fp32", False)
        long = trace.trace(CONFIGS[name](), BATCH, SEQ, "fp32", False, target_seq=SEQ)
        assert long.layers[:2] == short.layers[:2] and all(a > b for a, b in zip(long.layers[2:], short.layers[2:]))
    t5 = traced("t5", "fp32", False)
    assert t5.layers[0] - t5.layers[1] == 8 * SEQ * SEQ and t5.layers[2] - t5.layers[3] == 8 * TARGET * TARGET


def test_a_sliding_window_shorter_than_the_sequence_is_traced_as_it_runs():
    """Mistral with a window of 16 over 64 tokens (the trace equals a real forward, padded and not:
    `test_the_trace_is_what_a_real_forward_saves`). Unpadded, a full causal Mistral gives SDPA no
    mask (`is_causal`); the window needs a band mask, and SDPA on the CPU then saves it per layer
    as an fp32 B x 1 x T x T tensor, and keeps keys and values expanded to every query head (no
    grouped-query attention with a mask). Padded, both need a mask: the window changes nothing.
    Gemma2 runs eager attention (its logit soft-capping): the scores are saved whatever the mask,
    so a sliding layer saves what a full one does."""
    config = CONFIGS["mistral"]()
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    for mode, padded in (("fp32", False), ("bf16", True)):
        windowed = traced("mistral", mode, padded)
        full = trace.trace(T.MistralConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, sliding_window=None),
                           BATCH, SEQ, mode, padded)
        mask = BATCH * SEQ * SEQ * 4
        expanded = 2 * BATCH * SEQ * (heads - kv_heads) * head_dim * 4  # keys and values for every query head
        per_layer = 0 if padded else mask + expanded
        assert [w - f for w, f in zip(windowed.layers, full.layers)] == [per_layer] * 2, f"padded={padded}"
        assert (windowed.shared, windowed.outside) == (full.shared, full.outside)
        gemma = traced("gemma2", mode, padded)
        assert gemma.attn_implementation == "eager" and gemma.layers[0] == gemma.layers[1]


def moe_with_top_k(name, k):
    config = CONFIGS[name]()
    config.num_experts_per_tok = k
    return config


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_saved_bytes_grow_as_tokens_times_top_k(name):
    """Top-1 routing equals a real forward too (top-2, the configs' own, is in the test above). Each
    routed (token, expert) pair saves the expert's input, its gate/up and activation outputs and its
    output, whichever expert it goes to: a sparse layer grows by the same bytes for every k added,
    and that growth is proportional to the tokens (half the sequence, half the growth)."""
    _, _, real = real_forward(moe_with_top_k(name, 1), "bf16", True)
    assert_equal(trace.trace(moe_with_top_k(name, 1), BATCH, SEQ, "bf16", True), real, f"{name} top-1")
    sparse = [i for i, kind in enumerate(real.layer_types) if "SparseMoe" in kind or "Experts" in kind]
    grown = {}
    for seq in (SEQ // 2, SEQ):
        by_k = [trace.trace(moe_with_top_k(name, k), BATCH, seq, "bf16", True) for k in (1, 2, 3)]
        steps = {by_k[k].layers[i] - by_k[k - 1].layers[i] for k in (1, 2) for i in sparse}
        assert len(steps) == 1 and all(by_k[0].layers[i] == by_k[2].layers[i] for i in range(2) if i not in sparse)
        grown[seq] = steps.pop()
    assert grown[SEQ] == 2 * grown[SEQ // 2] > 0 and grown[SEQ] % (BATCH * SEQ) == 0


def test_an_untraceable_architecture_fails_in_one_line_naming_it():
    with pytest.raises(ValueError) as err:  # a vision model: no language model to build
        trace.trace(T.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
                    BATCH, SEQ)
    assert "cannot trace 'vit'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError) as err:  # a T5 with no decoder start token: its decoder has no first input
        trace.trace(T.T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=1, num_heads=2), BATCH, SEQ)
    assert "cannot trace 't5'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="precision must be one of"):
        trace.trace(CONFIGS["llama"](), BATCH, SEQ, mode="fp16")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_an_attention_implementation_asked_for_is_traced_as_it_runs(name):
    """`eager` attention keeps the T x T scores (and their softmax) that SDPA's fused kernels do
    not: the trace follows the implementation asked for, and still equals the real forward. With
    attention dropout (GPT-2's default) SDPA on the CPU saves as much as eager."""
    config = CONFIGS[name]()
    torch.manual_seed(0)
    model = trace.build(config, "fp32", attn_implementation="eager")
    real = trace.run_and_record(model, trace.batch_for(BATCH, SEQ, True, config.vocab_size), "fp32")
    eager = trace.trace(config, BATCH, SEQ, "fp32", True, attn_implementation="eager")
    assert (eager.attn_implementation, eager.layers, eager.shared, eager.outside) == ("eager", real.layers, real.shared, real.outside)
    # Asking for eager must not change what the config itself gets next time (from_config writes it there).
    sdpa = trace.trace(config, BATCH, SEQ, "fp32", True)  # not the cached one: this config was traced eager
    assert sdpa.attn_implementation == "sdpa"
    if name == "gpt2":  # attention dropout 0.1: on the CPU, SDPA takes its math path, which saves what eager saves
        assert eager.layers == sdpa.layers
    else:  # no dropout: SDPA's fused kernel keeps no T x T scores
        assert eager.layers[0] > sdpa.layers[0]
