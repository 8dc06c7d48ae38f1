"""Tiny random configs of each family the estimator is checked on, the batch they are traced at, and
how a traced record of saved activations is compared with a real forward's: used by
tests/memory/test_trace.py and by LoRA's traced activations in tests/parallel/test_lora.py."""

import transformers as T

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
    # encoder-decoders, with their default dropout; 2 encoder + 2 decoder blocks
    "t5": lambda: T.T5Config(vocab_size=1000, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                             decoder_start_token_id=0),
    "bart": lambda: T.BartConfig(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2,
                                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                 decoder_ffn_dim=128, max_position_embeddings=128),
}
BATCH, SEQ, TARGET = 2, 64, 32  # an encoder-decoder's target is shorter than its source, as in a summary


def assert_equal(traced, real, what, short=0):
    """Every term, layer by layer; `short`: bytes per sparse layer the fp32 MoE fallback does not save."""
    assert traced.attn_implementation == real.attn_implementation
    assert traced.layer_types == real.layer_types
    for layer, (got, want) in enumerate(zip(traced.layers, real.layers, strict=True)):
        sparse = "SparseMoe" in real.layer_types[layer] or "Experts" in real.layer_types[layer]
        assert got == want - (short if sparse else 0), f"{what} layer {layer}: traced {got}, real {want}"
    assert (traced.shared, traced.outside, traced.weight_copies) == (real.shared, real.outside, real.weight_copies), what
