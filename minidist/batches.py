"""Tokens and batches: what a step of the loop feeds the model, and who computes which part of it.

`tokenize_games` (truncate at `max_seq_length`, always) and `collate` (right padding, labels
-100 where padded so padding never counts in the loss) turn texts into tensors.

The distributed part is `GlobalBatchSampler`. The rule that makes every strategy comparable to a
single process: the *global* batch of step k depends on the seed alone. The world size and the
micro-batch size only decide who computes which slice of it. So 1 GPU with 8 accumulation steps
and 4 GPUs with 2 see the same examples per optimizer step and, in fp32, take the same step.

Packing several whole games into each row instead of padding every game to the longest of its
micro-batch (`--pack`) is `packing.py`'s; a packed step takes the same global batches from this sampler.

Nothing here knows chess: any list of texts and any Hugging Face tokenizer will do.
"""

import torch


def tokenize_games(texts, tokenizer, max_seq_length):
    """Token ids per game: the tokenizer's (with its BOS, if any), then EOS, cut to max_seq_length.

    EOS teaches the model where a game stops. Truncation is not optional: one long game would
    otherwise set the padded length, and the memory, of its whole batch.
    """
    ids = tokenizer(list(texts))["input_ids"]
    return [(seq + [tokenizer.eos_token_id])[:max_seq_length] for seq in ids]


def collate(sequences, pad_token_id, multiple: int = 1):
    """Right-pad to the longest sequence; labels copy input_ids but are -100 (ignored) on padding.

    The loss shifts labels by one itself; -100 is the `ignore_index` of `cross_entropy`, so
    padding adds neither loss nor gradient, however many pad tokens a batch holds. `multiple`
    rounds the length up to a multiple of it (sequence parallelism cuts the sequence into equal
    chunks: `parallel/tensor/ops.py`).
    """
    length = -(-max(len(s) for s in sequences) // multiple) * multiple
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, :len(seq)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def left_padded(tokenizer, prompts: list[str], max_new_tokens: int, max_length: int | None):
    """The prompts' token ids, cut to fit the context and padded on the left, and their attention mask:
    generation's batch (`chess/legal_moves.py`, `parallel/pipeline/generate.py`), where every prompt
    must end at the last column, the one the next token is read from. With `max_length`, a prompt
    keeps its last `max_length - max_new_tokens` tokens."""
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    if max_length is not None:
        keep = max_length - max_new_tokens
        if keep < 1:
            raise ValueError(f"a context of {max_length} positions leaves no room for a prompt and "
                             f"{max_new_tokens} new tokens")
        encoded = [ids[-keep:] for ids in encoded]
    width = max(len(ids) for ids in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(encoded):
        ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    return ids, mask


class GlobalBatchSampler:
    """Which examples each rank uses at each step, with the data order set by the seed alone.

    The index stream is epoch 0's permutation, then epoch 1's, ...; global batch `step` is the
    slice [step*G, (step+1)*G) of it, and may straddle two epochs. Each global batch is cut into
    world_size * A micro-batches of b examples (A = accumulation steps): micro-batch a of rank r
    is slice a*world_size + r, so at every accumulation step the ranks hold neighbouring slices.
    """

    def __init__(self, num_examples, global_batch_size, seed):
        if global_batch_size > num_examples:
            raise ValueError(f"global_batch_size {global_batch_size} is larger than the "
                             f"{num_examples} examples: use more data or a smaller batch.")
        self.num_examples, self.global_batch_size, self.seed = num_examples, global_batch_size, seed
        self._perms = {}

    def _permutation(self, epoch):
        if epoch not in self._perms:
            # One generator per (seed, epoch): any epoch can be recomputed alone, e.g. on resume.
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}  # bound memory
            self._perms[epoch] = torch.randperm(self.num_examples, generator=g).tolist()
        return self._perms[epoch]

    def position(self, step):
        """(epoch, offset) where global batch `step` starts: what a checkpoint saves."""
        return divmod(step * self.global_batch_size, self.num_examples)

    def global_batch(self, step):
        epoch, offset = self.position(step)
        batch = []
        while len(batch) < self.global_batch_size:
            need = self.global_batch_size - len(batch)
            batch += self._permutation(epoch)[offset:offset + need]
            epoch, offset = epoch + 1, 0
        return batch

    def accumulation_steps(self, world_size, micro_batch_size):
        per_step = world_size * micro_batch_size
        if self.global_batch_size % per_step:
            raise ValueError(f"global batch {self.global_batch_size} is not divisible by "
                             f"world_size * micro_batch_size = {world_size} * {micro_batch_size}: "
                             f"pick sizes whose product divides it.")
        return self.global_batch_size // per_step

    def micro_batches(self, step, rank, world_size, micro_batch_size):
        """The A micro-batches rank `rank` runs, forward and backward, before the optimizer step."""
        accumulation = self.accumulation_steps(world_size, micro_batch_size)
        g, b = self.global_batch(step), micro_batch_size
        return [g[(a * world_size + rank) * b:(a * world_size + rank + 1) * b]
                for a in range(accumulation)]
