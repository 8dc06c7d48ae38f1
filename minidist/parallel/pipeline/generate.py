"""Greedy generation through a pipeline: what the legal-move rate (`chess/legal_moves.py`) needs
when each rank holds one stage of the model, and Hugging Face's `generate`, which wants the whole
model in one process, cannot run.

`greedy_continue` has `legal_moves.greedy_continue`'s contract and writes the same text: the same
left-padded prompts (`batches.left_padded`, cut to `max_length`), exactly `max_new_tokens` new tokens,
each the argmax of the last position's logits (in float32, as `generate` takes them), the end of
sequence not stopping a row, and the text read with special tokens skipped. For each new token:

- every stage builds the same batch: the token ids so far, their attention mask, and the position
  ids `generate` gives a left-padded prompt, counted from its first real token (`position_ids`);
- the first stage embeds the tokens and runs its layers, and each stage sends its output hidden
  states to the next (`dist.send` / `dist.recv`), as a training forward does;
- the last stage takes the argmax of the last position and broadcasts the new token ids over the
  pipeline's group (a few bytes: one int64 per prompt), so that every stage appends the same
  token and builds the same next batch.

Every stage therefore returns the same text, and the legal-move rate comes out the same on every
stage of a pipeline: the loop can log it from any of them.

**Not counted in `comm.counter`.** `p2p.send` counts every byte it sends, because the lessons set
a training step's traffic against the formulas. Generation is not a training step: it sends with
plain `dist.send`, which counts nothing, so an evaluation between steps does not change the next
step's bytes.

**Why no key/value cache, and what it costs.** `generate` keeps each layer's keys and values, so
that a new token costs one position's forward. Here each new token runs the whole sequence through
every stage again: with a prompt of S tokens and N new ones, N forwards of S to S + N - 1
positions instead of one of S and N - 1 of one position, about N times the compute, and each cut
carries (batch, S + n, hidden) hidden states per token instead of (batch, 1, hidden). The
legal-move rate writes a move and a space (N = 2 tokens for the tiny model's one-token moves,
about 6 for CodeLlama's): a few prompt-length forwards, small next to a training run's steps. The
stages also run one after another (a single batch, no micro-batches), so each stage idles
(p - 1)/p of the time; cutting the batch into micro-batches would fill the pipeline, as training's
schedules do.

A cache per stage is possible: each stage keeps a Hugging Face `DynamicCache` for its own layers
(indexed by their `layer_idx`, their place in the whole model), passes it with the cache positions
to `create_causal_mask` and to every layer, as `LlamaModel.forward` does; after the prompt's
forward only the new position's hidden states cross each cut, (batch, 1, hidden), and the stages'
caches grow in step because every stage appends the same broadcast token. `stages.Stage.forward`
takes no cache today: that is the change it would need.
"""

import torch
import torch.distributed as dist

from minidist.batches import left_padded


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """The positions `generate` gives a left-padded batch: each row counts from its first real
    token (the cumulative sum of the attention mask, minus one). The padding's own positions do
    not matter, since no real token attends to it: they are set to 0, as transformers 5 does
    (older versions set 1)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


@torch.no_grad()
def greedy_continue(module, stage, tokenizer, prompts: list[str], max_new_tokens: int, device,
                    max_length: int | None = None, group=None, dtype: torch.dtype | None = None) -> list[str]:
    """`legal_moves.greedy_continue` through a pipeline (module doc): the same text, on every stage.

    `module`: what to call for this rank's forward, `module(hidden, batch)`: the `stage` itself or a
    data-parallel wrapper around it. `stage`: the `stages.Stage` (its rank, pp and config). `group`:
    the pipeline's process group, its ranks in stage order (None: the world). `dtype`: of the hidden
    states crossing a cut (None: the stage's parameters'); each stage sends its output in it, so both
    sides of a cut agree on the bytes whatever dtype the layers compute in."""
    rank = dist.get_rank(group) if stage.pp > 1 else 0
    if rank != stage.rank:
        raise ValueError(f"stage {stage.rank} sits at rank {rank} of the pipeline's group: the group's ranks must "
                         f"be in stage order")
    dtype = dtype or next(stage.parameters()).dtype
    ids, mask = left_padded(tokenizer, prompts, max_new_tokens, max_length)
    ids, mask = ids.to(device), mask.to(device)
    width = ids.shape[1]
    was_training = module.training
    module.eval()
    try:
        for _ in range(max_new_tokens):
            token = _next_token(module, stage, ids, mask, device, group, dtype)
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=1)
    finally:
        module.train(was_training)
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in ids.tolist()]


def _next_token(module, stage, ids, mask, device, group, dtype) -> torch.Tensor:
    """One forward of the whole sequence through the pipeline; every stage gets the new token ids."""
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask)}
    hidden = None
    if not stage.is_first:
        hidden = torch.empty((*ids.shape, stage.config.hidden_size), dtype=dtype, device=device)
        dist.recv(hidden, group=group, group_src=stage.rank - 1)
    output = module(hidden, batch)
    token = torch.empty(ids.shape[0], dtype=torch.long, device=device)
    if stage.is_last:
        token.copy_(output[:, -1].float().argmax(-1))  # float32, as `generate` reads the logits
    else:
        dist.send(output.to(dtype).contiguous(), group=group, group_dst=stage.rank + 1)
    if stage.pp > 1:
        dist.broadcast(token, group=group, group_src=stage.pp - 1)
    return token


def continue_fn(stage, group=None, dtype: torch.dtype | None = None):
    """`greedy_continue` bound to `stage` and its pipeline's `group`, taking `legal_moves.greedy_continue`'s
    arguments: what `legal_moves.legal_move_rate(..., continue_fn=...)` calls for each batch of prompts."""
    def continue_(module, tokenizer, prompts, max_new_tokens, device, max_length=None):
        return greedy_continue(module, stage, tokenizer, prompts, max_new_tokens, device, max_length, group, dtype)
    return continue_
