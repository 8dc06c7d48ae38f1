"""The single-process reference every strategy is held to, written without minidist's loop.

The textbook training loop: one process, the whole global batch as one batch, the mean token
loss, AdamW, gradient clipping at 1.0. Only the data order (`GlobalBatchSampler`) and AdamW's
betas (`ADAMW_BETAS`, written once for the whole project) come from minidist, so that both
sides see the same games in the same steps and use the same optimizer.
"""

import torch
import torch.nn.functional as F

from minidist import batches
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf import models
from minidist.strategy.options import ADAMW_BETAS


def train_reference(model_dir, *, steps, global_batch, seq_len, lr, seed=0, dtype=torch.float32, frozen=(),
                    lr_lambda=None, lora_config=None, data=None):
    """Return (losses per step, final state_dict, number of trainable parameters).

    data: the games file, as the loop's `--data` (the bundled training games by default).

    lora_config: a peft `LoraConfig`, applied with peft's own `get_peft_model` after seeding the
    RNG with `seed` (its A matrices are random)."""
    tokenizer, model = models.load_tokenizer(model_dir), models.load_model(model_dir, dtype=dtype)
    if lora_config is not None:
        from peft import get_peft_model

        torch.manual_seed(seed)
        model = get_peft_model(model, lora_config)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    sequences = batches.tokenize_games(jsonl.load_games(data or bundled_games("train")), tokenizer, seq_len)
    sampler = batches.GlobalBatchSampler(len(sequences), global_batch, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda or (lambda step: 1.0))
    losses = []
    for step in range(steps):
        batch = batches.collate([sequences[i] for i in sampler.global_batch(step)], tokenizer.pad_token_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, sum(p.numel() for p in params)
