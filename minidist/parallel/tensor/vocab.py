"""The vocabulary cut over the tensor-parallel ranks: the embedding, the head and the loss.

At 7B the vocabulary is the widest matrix there is: CodeLlama's head is 32,016 x 4,096, and its
logits for a batch of b sequences of s tokens are b x s x 32,016 floats, among the largest terms
the memory estimate reports. Megatron-LM (section 3) cuts the vocabulary over the ranks in all
three places it appears, so that no rank ever holds the whole of it:

- **The embedding** (`VocabParallelEmbedding`): rank r keeps the rows of tokens
  [r V/n, (r+1) V/n). A token of another rank's slice looks up zeros here, so summing the
  ranks' outputs (g, an all-reduce) gives every token its one row.
- **The head** is a column-parallel linear (`linear.py`): rank r computes the logits of its own
  slice of the vocabulary, b x s x V/n.
- **The loss** (`vocab_parallel_cross_entropy`): the softmax's normaliser sums over the whole
  vocabulary, but it needs only three numbers per token from each rank, not its logits: the
  largest logit (for a stable exponential), the sum of exponentials, and the target's logit,
  which only the rank holding the target has. Three all-reduces of b x s numbers replace a
  gather of b x s x V.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minidist.parallel import comm
from minidist.parallel.tensor import ops


def padded_vocab_size(vocab_size: int, n: int) -> int:
    """The vocabulary rounded up to a multiple of the `n` ranks, so that each gets an equal slice.
    The extra rows are zeros no token looks up, and the loss leaves their logits out (Megatron-LM
    pads the same way, `--make-vocab-size-divisible-by`)."""
    return -(-vocab_size // n) * n


def vocab_range(vocab_size: int, group) -> tuple[int, int]:
    """[start, end) of the (padded) token ids this rank holds: an equal slice, in rank order."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = padded_vocab_size(vocab_size, n) // n
    return rank * per_rank, (rank + 1) * per_rank


def _my_rows(weight: torch.Tensor, group) -> torch.Tensor:
    """This rank's rows of a (vocabulary x hidden) matrix, zeros past the real vocabulary."""
    start, end = vocab_range(weight.shape[0], group)
    rows = weight.new_zeros((end - start, weight.shape[1]))
    real = weight[start:end]
    rows[:len(real)] = real
    return rows


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; the ranks' lookups summed into every token's row.
    The output is whole on every rank, as the model's first layer expects it."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.start, self.end = vocab_range(embedding.num_embeddings, group)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx  # kept as HF's model reads it; the row trains as it does there
        self.weight = nn.Parameter(_my_rows(embedding.weight.data, group), embedding.weight.requires_grad)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)  # any row: it is zeroed below
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1)
        return ops.reduce_from_tp(rows, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, this rank's tokens [{self.start}, {self.end})"


class VocabParallelHead(nn.Module):
    """The output layer, column-parallel over the vocabulary: this rank's slice of the logits,
    b x s x V/n (`linear.ColumnParallelLinear`'s arithmetic, on padded rows). The logits of
    padding rows are zeros here; the loss leaves them out.

    In eval mode the slices are gathered into the whole vocabulary's logits, padding cut off, on
    every rank: generation picks the next token from all of them. Training never needs them."""

    def __init__(self, head: nn.Linear, group):
        super().__init__()
        if head.bias is not None:
            raise ValueError("a vocabulary-parallel head without a bias is all this knows (Llama has none)")
        self.group = group
        self.vocab_size = head.out_features
        self.start, self.end = vocab_range(head.out_features, group)
        self.weight = nn.Parameter(_my_rows(head.weight.data, group), head.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        return logits if self.training else self._whole_vocabulary(logits)

    def _whole_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        n = dist.get_world_size(self.group)
        gathered = logits.new_empty((n, *logits.shape))
        comm.all_gather(gathered.view(-1), logits.contiguous().view(-1), group=self.group)
        return torch.cat(gathered.unbind(0), dim=-1)[..., :self.vocab_size]

    def extra_repr(self) -> str:
        return f"vocabulary {self.vocab_size}, this rank's tokens [{self.start}, {self.end})"


class VocabParallelCrossEntropy(torch.autograd.Function):
    """-log softmax(z)[t] for each token, where z is cut over the ranks by vocabulary.

    loss = log(sum over v of exp(z_v - m)) - (z_t - m), for any constant m (the largest logit).
    Its gradient with respect to this rank's logits is softmax(z) - onehot(t), restricted to this
    rank's slice: the softmax needs the global sum of exponentials, which forward already has,
    and the one-hot is non-zero only on the rank holding t. Backward sends nothing."""

    @staticmethod
    def forward(ctx, logits, targets, start, vocab_size, group, ignore_index):
        if start + logits.shape[-1] > vocab_size:  # padding rows (the last ranks'): out of the softmax
            logits = logits.clone()
            logits[..., max(vocab_size - start, 0):] = float("-inf")
        largest = logits.max(dim=-1).values  # no gradient flows through m: it cancels
        comm.all_reduce(largest, group=group, op=dist.ReduceOp.MAX)
        shifted = logits - largest.unsqueeze(-1)
        mine = (targets >= start) & (targets < start + logits.shape[-1])
        local = torch.where(mine, targets - start, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp_()  # shifted is not needed again: one buffer the size of the logits, not two
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([target_logit, sum_exp])  # one all-reduce for the two sums
        comm.all_reduce(both, group=group)
        target_logit, sum_exp = both
        kept = targets != ignore_index
        loss = (sum_exp.log() - target_logit) * kept
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # exp is not needed again: in place
        ctx.save_for_backward(softmax, local, mine & kept, kept)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine, kept = ctx.saved_tensors
        grad = softmax * (grad_loss * kept).unsqueeze(-1)
        grad.scatter_add_(-1, local.unsqueeze(-1), -(grad_loss * mine).unsqueeze(-1).to(grad.dtype))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int,
                                 group, ignore_index: int = -100) -> torch.Tensor:
    """The cross-entropy of each token (0 where the target is `ignore_index`), from this rank's
    slice of the logits, the (padded) vocabulary's [start, start + logits.shape[-1]), of which
    ids from `vocab_size` on are padding. The same on every rank of `group`, as
    `F.cross_entropy(..., reduction="none")` of the whole logits would be."""
    return VocabParallelCrossEntropy.apply(logits, targets, start, vocab_size, group, ignore_index)
