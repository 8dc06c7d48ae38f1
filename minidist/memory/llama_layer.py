"""The worked example: what one Llama decoder layer saves for backward, derived by hand.

`trace.py` asks any model what it saves; the estimator uses that. This module is the same
count done with pencil and paper for one architecture, so that the numbers mean something: read
off `modeling_llama.py` as transformers runs it, after Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", section 4, the GPT layer), and tested equal
to the trace in tests/memory/test_trace.py, byte for byte.

Per token and per layer (h = hidden, I = MLP width, q = heads x head_dim, kv = key/value heads x
head_dim, n = heads, c = bytes of the compute dtype, r = bytes of the residual stream):
- each RMSNorm: its input upcast to fp32 (4h), x*rsqrt in the residual dtype (r h), rsqrt (4);
- the norm's output as read by the next linears (c h, once; under autocast each linear saves its
  own bf16 cast: 3 for q, k, v and 2 for gate, up); the weights themselves are parameters;
- attention through SDPA (flash or memory-efficient kernels save no T x T scores): q and k after
  the rotary embedding, v (c(q + 2 kv)), the output (c q), the log-sum-exp (4n); with padding SDPA
  also saves an additive mask, c T per token, and grouped key/value heads reach it repeated to
  q (`repeat_kv`; without a mask SDPA takes them as they are);
- the gated MLP: gate, silu(gate), up and their product (4 c I).
So a Llama layer saves (8 + 2r)h + (2 or, under autocast, 5)c h + c(2q + 2kv) + 4cI + 4n + 8 bytes
per token: in fp32 40h + 16I + 4n + 8, in bf16 24h + 8I + 4n + 8, autocast 34h + 8I + 4n + 8 (q = kv = h).
For CodeLlama-7b (h = 4096, I = 11008, n = 32) in bf16, one padded sequence of 1024 tokens:
188,552 bytes a token, 193,077,248 bytes a layer, 6.18 GB for its 32 layers.

Korthikanti et al.'s GPT layer, 34 h + 5 n T bytes per token in 16 bits, charges the T x T
attention scores that fused attention kernels never store: at Mistral-7B's shapes it is 3.6x too
high at 4k tokens. That is why the estimator traces instead of using a formula.
"""


def layer_bytes_per_token(s, mode: str, seq: int, padded: bool) -> float:
    """Bytes one Llama decoder layer saves for backward per token; `s` is an `estimator.Shape`,
    `mode` fp32, bf16 or autocast. For a Llama only: other architectures save other tensors."""
    if s.model_type != "llama":
        raise ValueError(f"the hand-derived layer is Llama's; {s.model_type!r} is traced (trace.py)")
    h, i, n = s.hidden_size, s.intermediate_size, s.num_heads
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    c = 4 if mode == "fp32" else 2
    r = 2 if mode == "bf16" else 4
    mask = c * seq if padded else 0
    norms = 2 * (4 * h + r * h + 4)
    linear_inputs = (5 if mode == "autocast" else 2) * c * h
    if padded:  # with a mask, transformers repeats grouped key/value heads for SDPA (repeat_kv): q-sized
        kv = q
    attention = c * (q + 2 * kv) + c * q + 4 * n
    mlp = 4 * c * i
    return norms + linear_inputs + attention + mlp + mask
