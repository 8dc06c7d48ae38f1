"""Rank bodies for test_fsdp_peak.py: one training step's peak of live tensors, the hand-written
FSDP beside FSDP2, on a model whose layer units dominate it."""

import torch
from transformers import LlamaForCausalLM

from minidist.hf import models
from minidist.memory.measure import step_peak
from minidist.strategy.options import ParallelOptions
from minidist.strategy import get_strategy
from minidist.runtime.distributed import get_env


def peaks(hidden_size: int, num_layers: int) -> dict:
    """{impl: this rank's whole-step peak} for a steady step (after two that create AdamW's states)."""
    env = get_env()
    config = models.tiny_llama_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=hidden_size // 64)
    input_ids = torch.randint(4, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(env.rank))
    out = {}
    for impl in ("minidist", "torch"):
        strategy = get_strategy(ParallelOptions(strategy="fsdp", impl=impl), env)
        torch.manual_seed(0)
        model = strategy.wrap(LlamaForCausalLM(config))
        optimizer = strategy.build_optimizer(model, lr=1e-4)

        step = _step(model, optimizer, input_ids)
        step(), step()
        out[impl] = step_peak(step, model, optimizer, env.device)
    return out


def _step(model, optimizer, input_ids):
    def step():
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step
