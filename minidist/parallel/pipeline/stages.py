"""A Hugging Face `LlamaForCausalLM` cut by depth into `pp` contiguous stages.

Stage 0 holds the token embedding and the first decoder layers; the last stage holds the last
layers, the final norm, the head and the loss; the stages between hold decoder layers only. A
`Stage` takes its modules from the loaded model (the same `nn.Module` objects, so the weights are
the model's) and keeps them under the names they had there: stage 1 of 2 on a 4-layer Llama holds
`model.layers.2.…`, `model.layers.3.…`, `model.norm.weight` and `lm_head.weight`. So a stage's
state dict, its optimizer state and its checkpoint shards are keyed as the whole model's, and the
stages' dicts together are the whole model's (`strategy/pipeline.py` joins them for the final model
and a full checkpoint, which then loads at any pp size). The caller then drops the model, and the
other stages' layers go with it.

**The balance rule: equal layers, the remainder to the middle stages, then to the first.** With
L layers on p stages every stage gets L // p, and the L % p left over go one each to the middle
stages (1, 2, ...), which carry neither the embedding nor the head; if there are more left over
than middle stages (p = 2 with L odd, or L % p = p - 1), the next one goes to the first stage.
Never to the last: it also computes the head and the loss, 2·h·V FLOPs per token on top of its
layers (for CodeLlama-7b, h = 4,096 and V = 32,016, about two thirds of a decoder layer's 24·h²),
while the first stage's embedding is a lookup, no FLOPs. A pipeline runs at its slowest stage's
pace, so the extra layer goes where it is cheapest.

**What each stage computes for itself.** Hugging Face's `LlamaModel.forward` makes two things
once, before the first layer, that every layer needs: the rotary position embeddings (cos and
sin, from `model.rotary_emb` on position ids 0..s-1) and the causal mask (from the batch's
attention mask, by `create_causal_mask`). Neither has weights to learn nor depends on the hidden
states beyond their shape, so instead of sending them along, every stage computes them again from
its own copy of the micro-batch (every stage of a pipeline reads the same micro-batches: token
ids are a few bytes next to the hidden states). Only the hidden states cross a cut (`p2p.py`).

Tied input and output embeddings would put one matrix on the first and the last stage, whose
two gradients must be summed every step; this module refuses them (CodeLlama's are untied).
"""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn


def balance(num_layers: int, pp: int) -> list[range]:
    """The layers of each stage, by the rule in the module doc: equal, the remainder to the middle
    stages, then to the first."""
    if pp > num_layers:
        raise ValueError(f"--pp_size {pp} is larger than the model's {num_layers} decoder layers: "
                         f"every stage needs at least one")
    if pp < 1:
        raise ValueError(f"--pp_size must be at least 1, not {pp}")
    sizes = [num_layers // pp] * pp
    takers = list(range(1, pp - 1)) + [0]  # the middle stages first, then the first; never the last
    for stage in takers[:num_layers % pp]:
        sizes[stage] += 1
    starts = [sum(sizes[:stage]) for stage in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


class Stage(nn.Module):
    """Stage `rank` of `pp`: the modules of `model` (a `LlamaForCausalLM`) this rank runs.

    `forward(hidden, batch)`: the first stage ignores `hidden` and embeds `batch["input_ids"]`;
    every stage runs its layers; the last returns the micro-batch's summed next-token loss (as the
    loop's `step.token_loss_sum`; `loss_sum` computes it, replaced under tensor parallelism), or its
    logits when the batch has no labels (generation), the others their output hidden states.
    PyTorch's `PipelineStage` calls it as `forward(crossing, attention_mask=..., labels=...,
    position_ids=...)` instead: what crosses a cut positional (the first stage's token ids), the
    rest as keywords (`reference.py`). The stage takes both, so that PyTorch's schedule runs the
    stage itself, FSDP2's module when FSDP2 shards it, and not a module around it."""

    def __init__(self, model: nn.Module, rank: int, pp: int):
        super().__init__()
        config = model.config
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError("pipeline parallelism needs untied embeddings: a tied matrix would sit on the first "
                             "and the last stage at once")
        self.rank, self.pp, self.config = rank, pp, config
        self.is_first, self.is_last = rank == 0, rank == pp - 1
        self.layer_ids = balance(config.num_hidden_layers, pp)[rank]
        self._no_split_modules = getattr(model, "_no_split_modules", None)  # the FSDPs' unit classes
        # The whole model's names (module doc): `model.layers.<i>` keyed by the layer's index in the
        # whole model, not in the stage.
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in self.layer_ids})
        self.model.rotary_emb = model.model.rotary_emb  # no weights (a buffer of frequencies): every stage has one
        if self.is_first:
            self.model.embed_tokens = model.model.embed_tokens
        if self.is_last:
            self.model.norm, self.lm_head = model.model.norm, model.lm_head
        self.loss_sum = _cross_entropy_sum  # tensor parallelism: the loss from the vocabulary's slices
        self.autocast = nullcontext  # the strategy's mixed precision, where the weights stay fp32 (DDP)

    @property
    def layers(self) -> list[nn.Module]:
        """This stage's decoder layers, in order."""
        return list(self.model.layers.values())

    def names(self, model: nn.Module) -> dict:
        """This stage's parameters by their names in `model`, the model it was cut from: the names
        they have in the stage too (module doc)."""
        mine = {id(p) for p in self.parameters()}
        return {name: p for name, p in model.named_parameters() if id(p) in mine}

    def forward(self, hidden: torch.Tensor | None, batch: dict | None = None, **keywords) -> torch.Tensor:
        if batch is None:  # PyTorch's call (class doc): the first stage's crossing is its token ids
            batch = keywords
            if self.is_first:
                hidden, batch = None, {"input_ids": hidden, **keywords}
        with self.autocast():  # as step.token_loss_sum runs the whole model's forward, the loss outside
            logits_or_hidden = self._layers(hidden, batch)
        if not self.is_last or "labels" not in batch:  # generation (`pipeline/generate.py`): the logits themselves
            return logits_or_hidden
        # As step.token_loss_sum: position t predicts token t+1, -100 is ignored, the softmax in fp32 at least.
        logits = logits_or_hidden.to(torch.promote_types(logits_or_hidden.dtype, torch.float32))
        return self.loss_sum(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def _layers(self, hidden: torch.Tensor | None, batch: dict) -> torch.Tensor:
        """The embedding (first stage), this stage's layers, the final norm and head (last stage)."""
        from transformers.masking_utils import create_causal_mask

        if self.is_first:
            hidden = self.model.embed_tokens(batch["input_ids"])
        # What LlamaModel.forward computes before its first layer, from the batch alone (module doc).
        # Training numbers the positions 0..s-1, as LlamaModel does; generation's left-padded prompts
        # bring their own (`pipeline/generate.py`), as Hugging Face's `generate` numbers them.
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # A packed micro-batch's mask is 4-D already (`packing.document_mask`), and transformers takes it as it is.
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=batch.get("attention_mask"),
                                  cache=None, position_ids=position_ids)
        position_embeddings = self.model.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids)
        return self.lm_head(self.model.norm(hidden)) if self.is_last else hidden


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy over the whole vocabulary, -100 ignored (as `step.cross_entropy_sum`)."""
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
