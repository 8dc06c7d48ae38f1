"""Worker functions for tests/parallel/test_tensor.py, run in each rank by `launch`.

Every rank of the tensor-parallel group sees the same batch, and computes the single-process
reference itself: the same Llama, whole, on the same batch, in this process without any group.
A "sabotage" takes one operator's collective away (its local stand-in instead), to show that the
parity the test asserts depends on it."""

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.batches import collate
from minidist.parallel.tensor import llama, ops, vocab
from minidist.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear


def tiny_llama(num_heads=8, num_kv_heads=4, hidden_size=128, num_layers=2, tie=False):
    from transformers import LlamaForCausalLM

    from minidist.hf import models

    config = models.tiny_llama_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                                      tie_word_embeddings=tie)
    config.num_key_value_heads = num_kv_heads  # grouped-query attention: 2 query heads per key/value head
    config.attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()  # float64: parity is the algorithm's, not rounding's


def batch(vocab_size, lengths=(16, 11, 7)):
    """Sequences of different lengths, right-padded to 16 (a multiple of 2 and 4: sequence parallelism)."""
    generator = torch.Generator().manual_seed(1)
    return collate([torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths], 0)


def loss_sum(model, b, tp_group=None):
    """The summed next-token loss, as the training loop's `token_loss_sum`; vocabulary-parallel with a group."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
    targets = b["labels"][:, 1:].flatten()
    logits = logits[:, :-1].flatten(0, 1)
    if tp_group is None:
        return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    return vocab.vocab_parallel_cross_entropy(logits, targets, model.lm_head.start, model.config.vocab_size,
                                              tp_group).sum()


def my_slice(module, name: str, full: torch.Tensor, group) -> torch.Tensor:
    """The part of a whole model's tensor `full` that this rank's `module.name` holds."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if isinstance(module, ColumnParallelLinear) or (isinstance(module, RowParallelLinear) and name == "bias"):
        return full.chunk(n, 0)[rank] if isinstance(module, ColumnParallelLinear) else full
    if isinstance(module, RowParallelLinear):
        return full.chunk(n, 1)[rank]
    if isinstance(module, (vocab.VocabParallelEmbedding, vocab.VocabParallelHead)):
        return vocab._my_rows(full, group)
    return full


def _own_chunk_repeated(x, group):
    """A gather without the others' chunks: this rank's, n times over."""
    return torch.cat([x] * dist.get_world_size(group), dim=ops.SEQUENCE_DIM)


def _own_chunk(x, group):
    """A reduce-scatter without the sum: this rank's chunk of its own tensor."""
    return x.chunk(dist.get_world_size(group), dim=ops.SEQUENCE_DIM)[dist.get_rank(group)].contiguous()


class _NoCollectives:
    """`comm` for the vocabulary loss, with its all-reduces left out."""

    @staticmethod
    def all_reduce(tensor, group=None, op=None):
        return None


def _split_backward_without_gather(ctx, g):
    """This rank's chunk's gradient in place, zeros where the other ranks' chunks go."""
    n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
    return torch.cat([g if r == rank else torch.zeros_like(g) for r in range(n)], dim=ops.SEQUENCE_DIM), None


def _keeping_group(fn):
    """A forward stand-in that records the group for its backward, as the real one does."""
    def forward(ctx, x, group):
        ctx.group = group
        return fn(x, group)
    return forward


# One operator's collective in one direction taken away, everything else intact: (owner, attribute,
# stand-in). Autograd functions' methods are static.
SABOTAGE = {
    "f backward": (ops.CopyToTensorParallel, "backward", staticmethod(lambda ctx, g: (g, None))),
    "g forward": (ops.ReduceFromTensorParallel, "forward", staticmethod(lambda ctx, x, group: x.view_as(x))),
    "vocabulary loss": (vocab, "comm", _NoCollectives),
    "gather forward": (ops.GatherSequence, "forward", staticmethod(_keeping_group(_own_chunk_repeated))),
    "gather backward": (ops.GatherSequence, "backward", staticmethod(lambda ctx, g: (_own_chunk(g, ctx.group), None))),
    "reduce-scatter forward": (ops.ReduceScatterSequence, "forward", staticmethod(_keeping_group(_own_chunk))),
    "reduce-scatter backward": (ops.ReduceScatterSequence, "backward",
                                staticmethod(lambda ctx, g: (_own_chunk_repeated(g, ctx.group), None))),
    "split backward": (ops.SplitSequence, "backward", staticmethod(_split_backward_without_gather)),
}


@contextmanager
def sabotaged(name: str | None):
    """Inside, the operator `name` runs without its collective (nothing changes for None)."""
    if name is None:
        yield
        return
    owner, attribute, stand_in = SABOTAGE[name]
    original = owner.__dict__[attribute]
    setattr(owner, attribute, stand_in)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def eval_mode_after_cut(sequence_parallel: bool = True) -> dict:
    """A model cut while in eval mode (as `from_pretrained` hands it over): its modules' modes, and
    its whole-vocabulary logits against the whole model's, on a sequence not cut evenly."""
    reference = tiny_llama().eval()
    model = copy.deepcopy(reference)
    llama.parallelize_llama(model, dist.group.WORLD, sequence_parallel)
    ids = batch(reference.config.vocab_size, lengths=(7,))["input_ids"]  # 7 tokens: no even cut
    with torch.no_grad():
        mine, whole = (m(input_ids=ids, use_cache=False).logits for m in (model, reference))
    return {"modes": {m.training for m in model.modules()}, "worst": (mine - whole).abs().max().item()}


def cases(arguments: list[dict]) -> list[dict]:
    """`parity(**a)` for each of `arguments`, in this one launch (a launch costs more than a case);
    a case that refuses (ValueError) gives its message instead."""
    results = []
    for a in arguments:
        if a == "eval mode":
            results.append(eval_mode_after_cut())
            continue
        try:
            results.append(parity(**a))
        except ValueError as error:
            results.append({"refused": str(error)})
    return results


def parity(tp_args: dict, steps: int = 3, sabotage: str | None = None) -> dict:
    """`steps` AdamW steps of the whole model here and of its tensor-parallel copy over every rank:
    the losses of both, and the largest relative difference of every parameter (this rank's slice)
    after them."""
    with sabotaged(sabotage):
        return _parity(dict(tp_args), steps)


def _parity(tp_args: dict, steps: int) -> dict:
    group = dist.group.WORLD
    sequence_parallel = tp_args.pop("sequence_parallel", False)
    reference = tiny_llama(**tp_args)
    model = copy.deepcopy(reference)
    said = llama.parallelize_llama(model, group, sequence_parallel)
    b = batch(reference.config.vocab_size)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    losses = {"reference": [], "tp": []}
    for _ in range(steps):
        for key, m, opt, g in (("reference", reference, optimizers[0], None), ("tp", model, optimizers[1], group)):
            loss = loss_sum(m, b, g)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.item())
    modules = dict(model.named_modules())
    full = dict(reference.named_parameters())
    worst = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        expected = my_slice(modules[module_name], leaf, full[name].detach(), group)
        worst[name] = ((param.detach() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    return {"losses": losses, "worst": worst, "said": said,
            "shapes": {name: tuple(p.shape) for name, p in model.named_parameters()}}
