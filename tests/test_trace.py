"""The traced activation memory (`memory/trace.py`) against real CPU forwards of tiny models.

For each architecture, a tiny random config is built twice: for real on the CPU, where a forward
and the loop's loss run under `trace.SavedByLayer`, and on fake tensors by `trace.trace`. The
bytes saved by each decoder layer, shared between layers, outside the layers and (autocast) the
bf16 weight copies must agree exactly, with and without padding, in fp32, bf16 and autocast.
The real run's attribution must also add up to what the project's own tracker
(`measure.SavedActivations`) counts. The hand-derived Llama layer must equal the trace."""

import pytest
import torch
import transformers as T

from minidist.memory import estimator, measure, trace

SMALL = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**SMALL, intermediate_size=128, num_key_value_heads=2),
    "mistral": lambda: T.MistralConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, sliding_window=16),
    "qwen2": lambda: T.Qwen2Config(**SMALL, intermediate_size=128, num_key_value_heads=2),
    "qwen3": lambda: T.Qwen3Config(**SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16),
    "gemma2": lambda: T.Gemma2Config(**SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                     sliding_window=16),
    "phi3": lambda: T.Phi3Config(**SMALL, intermediate_size=128, num_key_value_heads=2, pad_token_id=0),
    "gpt_neox": lambda: T.GPTNeoXConfig(**SMALL, intermediate_size=128),
    "opt": lambda: T.OPTConfig(**SMALL, ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=128,
                               pad_token_id=1, bos_token_id=2, eos_token_id=2),
    "mixtral": lambda: T.MixtralConfig(**SMALL, intermediate_size=128, num_key_value_heads=2, num_local_experts=4),
    "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=128,
                                 bos_token_id=0, eos_token_id=0),  # with its default dropout: eager-like SDPA math
    # every other layer sparse (decoder_sparse_step=2): a non-uniform model
    "qwen2_moe": lambda: T.Qwen2MoeConfig(**SMALL, intermediate_size=128, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                          decoder_sparse_step=2, num_key_value_heads=2),
}
# In fp32 the experts' grouped matmul is traced through transformers' fallback op (PyTorch's meta rule
# for `_grouped_mm` takes bf16 only), which keeps the groups' offsets (int32, one per expert) out of
# the saved tensors: the trace is short by 4 bytes per expert per sparse layer.
MOE_OFFSETS = {"mixtral": 4 * 4, "qwen2_moe": 4 * 4}
CASES = [("fp32", False), ("fp32", True), ("bf16", True), ("autocast", False)]
BATCH, SEQ = 2, 64


def real_forward(config, mode, padded):
    torch.manual_seed(0)
    model = trace.build(config, mode)
    batch = trace.batch_for(BATCH, SEQ, padded, config.vocab_size)
    return model, batch, trace.run_and_record(model, batch, mode)


@pytest.mark.parametrize("mode,padded", CASES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_trace_is_what_a_real_forward_saves(name, mode, padded):
    config = CONFIGS[name]()
    _, _, real = real_forward(config, mode, padded)
    traced = trace.trace(config, BATCH, SEQ, mode, padded)
    assert traced.attn_implementation == real.attn_implementation
    assert traced.layer_types == real.layer_types and len(real.layers) == 2
    short = MOE_OFFSETS.get(name, 0) if mode != "bf16" else 0
    for layer, (got, want) in enumerate(zip(traced.layers, real.layers)):
        sparse = "SparseMoe" in real.layer_types[layer] or "Experts" in real.layer_types[layer]
        assert got == want - (short if sparse else 0), f"{name} {mode} padded={padded} layer {layer}: traced {got}, real {want}"
    assert (traced.shared, traced.outside, traced.weight_copies) == (real.shared, real.outside, real.weight_copies)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2_moe"])
def test_the_attribution_adds_up_to_what_the_tracker_counts(name):
    """Every saved storage is somewhere: layers + shared + outside + weight copies is the total
    that `measure.SavedActivations` (the loop's own tracker) holds at the end of forward."""
    from minidist.finetune import token_loss_sum

    config = CONFIGS[name]()
    model, batch, real = real_forward(config, "autocast", True)
    with measure.SavedActivations() as tracker:
        loss = token_loss_sum(model, batch, trace._Autocast("autocast"))
    assert tracker.current == real.saved + real.weight_copies
    del loss


@pytest.mark.parametrize("mode,padded", [("fp32", False), ("fp32", True), ("bf16", True), ("autocast", True)])
def test_the_hand_derived_llama_layer_is_the_trace(tmp_path, mode, padded):
    """The lesson's worked example (`estimator.layer_bytes_per_token`) equals the traced layer,
    grouped key/value heads included."""
    config = CONFIGS["llama"]()
    config.save_pretrained(tmp_path)
    shape = estimator.model_shape(str(tmp_path))
    traced = trace.trace(config, BATCH, SEQ, mode, padded)
    assert set(traced.layers) == {estimator.layer_bytes_per_token(shape, mode, SEQ, padded) * BATCH * SEQ}


def test_layer_types_tell_a_non_uniform_model_apart():
    """Qwen2-MoE with every other layer sparse has two layer types of different sizes; Gemma2
    alternates sliding-window and full attention, which the type names."""
    moe = trace.trace(CONFIGS["qwen2_moe"](), BATCH, SEQ)
    assert len(moe.types) == 2 and moe.layers[0] != moe.layers[1]
    gemma = trace.trace(CONFIGS["gemma2"](), BATCH, SEQ)
    assert {kind.split("(")[0] for kind in gemma.types} == {"Gemma2DecoderLayer[sliding_attention]",
                                                           "Gemma2DecoderLayer[full_attention]"}


def test_an_untraceable_architecture_fails_in_one_line_naming_it():
    with pytest.raises(ValueError) as err:
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
    sdpa = trace.trace(config, BATCH, SEQ, "fp32", True)
    assert sdpa.attn_implementation == "sdpa"
    if name == "gpt2":  # attention dropout 0.1: on the CPU, SDPA takes its math path, which saves what eager saves
        assert eager.layers == sdpa.layers
    else:  # no dropout: SDPA's fused kernel keeps no T x T scores
        assert eager.layers[0] > sdpa.layers[0]
