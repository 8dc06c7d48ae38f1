"""The exercises that check themselves (`lessons/exercises/`), and the proof that each check works.

A learner fills a skeleton and runs one command:

    MINIDIST_EXERCISE=lessons/exercises/01_ring_all_reduce.py python -m pytest -q tests/course/test_exercises.py

which collects one test, `test_your_solution`: it passes, or fails with a few lines that say
which rank, which tensor, what was expected and what came, and a hint.

Without the variable (CI), every check is proved both ways, nothing skipped: it passes against
minidist's own implementation, fails against the committed blank skeleton (the blank's
NotImplementedError, with the skeleton's line), and fails, with the message a learner needs,
against plausible wrong solutions written below. All the sources of one exercise run in one
launch of its ranks (`exercise_workers.check`), which keeps the file to a few launches; the
packing mask's check needs no ranks and runs in this process.
"""

import os
import textwrap
from pathlib import Path

import pytest

from exercise_workers import EXERCISES, CheckError, check, exercise_of, skeleton

# The full suite only: every exercise's check, each but one launching its ranks.
pytestmark = pytest.mark.slow

YOURS = os.environ.get("MINIDIST_EXERCISE")

# ---------------------------------------------------------------------------------- plausible wrong solutions
RING_HEADER = """
import torch
import torch.distributed as dist

def exchange(chunks, send, recv, n, rank, add):
    incoming = torch.empty_like(chunks[recv])
    requests = [dist.isend(chunks[send], (rank + 1) % n), dist.irecv(incoming, (rank - 1) % n)]
    for request in requests:
        request.wait()
    if add:
        chunks[recv].add_(incoming)
    else:
        chunks[recv].copy_(incoming)
"""
# f as exercise 11's skeleton has it, its backward left open: each wrong solution below adds its body.
F_HEADER = """
import torch
import torch.distributed as dist
from minidist.parallel import comm

class CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):"""
# document_mask as exercise 03's packing skeleton names it, the conditions built: each wrong solution
# below returns its own combination of them.
MASK_HEADER = """
import torch

def document_mask(document_ids):
    s = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    real = (document_ids != 0)[:, :, None]
    itself = torch.eye(s, dtype=torch.bool)"""
WRONG = {
    "01_ring_all_reduce": {
        # Stops after the reduce-scatter: each rank holds one finished chunk.
        "halfway": (RING_HEADER + """
def ring_all_reduce(tensor, group=None):
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    for s in range(n - 1):
        exchange(chunks, (rank - s) % n, (rank - s - 1) % n, n, rank, add=True)
    return tensor
""", ["only chunk", "all-gather phase"]),
        # Adds in the all-gather phase too.
        "adds_twice": (RING_HEADER + """
def ring_all_reduce(tensor, group=None):
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    for s in range(n - 1):
        exchange(chunks, (rank - s) % n, (rank - s - 1) % n, n, rank, add=True)
    for s in range(n - 1):
        exchange(chunks, (rank + 1 - s) % n, (rank - s) % n, n, rank, add=True)
    return tensor
""", ["only chunk", "not adding it"]),
        # Right sums, but every rank sends its whole tensor to every other: (N-1) x the bytes.
        "send_everything": ("""
import torch
import torch.distributed as dist

def ring_all_reduce(tensor, group=None):
    n, rank = dist.get_world_size(), dist.get_rank()
    total = tensor.clone()
    for k in range(1, n):
        incoming = torch.empty_like(tensor)
        requests = [dist.isend(tensor, (rank + k) % n), dist.irecv(incoming, (rank - k) % n)]
        for request in requests:
            request.wait()
        total += incoming
    tensor.copy_(total)
    return tensor
""", ["sent", "a ring sends 2(N-1)/N"]),
        # The library call the exercise replaces.
        "library": ("""
import torch.distributed as dist

def ring_all_reduce(tensor, group=None):
    dist.all_reduce(tensor)
    return tensor
""", ["torch.distributed.all_reduce was called", "dist.isend"]),
    },
    "02_bucket_hook": {
        # Forgets to divide: the sum over ranks, not the average.
        "no_divide": ("""
from minidist.parallel import comm, ddp

class BucketedDDP(ddp.BucketedDDP):
    def _on_grad_ready(self, param):
        if not self.require_sync:
            return
        b, i = self._bucket_of[id(param)]
        bucket = self.buckets[b]
        bucket.buffer[bucket.offsets[i]:bucket.offsets[i] + param.numel()].copy_(param.grad.view(-1))
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.sent = bucket.buffer
            bucket.handle = comm.all_reduce(bucket.sent, group=self.group, async_op=True)
        if self.count.add(param):
            self._finish()
""", ["without dividing by world_size", "2 x the expected"]),
        # Off by one: launches with one gradient still to come (and again when it comes).
        "early": ("""
from minidist.parallel import comm, ddp

class BucketedDDP(ddp.BucketedDDP):
    def _on_grad_ready(self, param):
        if not self.require_sync:
            return
        b, i = self._bucket_of[id(param)]
        bucket = self.buckets[b]
        bucket.buffer[bucket.offsets[i]:bucket.offsets[i] + param.numel()].copy_(param.grad.view(-1))
        bucket.pending -= 1
        if bucket.pending <= 1:
            bucket.sent = bucket.buffer.div(self.world_size)
            bucket.handle = comm.all_reduce(bucket.sent, group=self.group, async_op=True)
        if self.count.add(param):
            self._finish()
""", ["fired before the bucket was full"]),
        # Right gradients, no overlap: every bucket launched once backward is over (the naive DDP).
        "at_the_end": ("""
from minidist.parallel import comm, ddp

class BucketedDDP(ddp.BucketedDDP):
    def _on_grad_ready(self, param):
        if not self.require_sync:
            return
        b, i = self._bucket_of[id(param)]
        bucket = self.buckets[b]
        bucket.buffer[bucket.offsets[i]:bucket.offsets[i] + param.numel()].copy_(param.grad.view(-1))
        bucket.pending -= 1
        if self.count.add(param):
            for bucket in self.buckets:
                bucket.sent = bucket.buffer.div_(self.world_size)
                bucket.handle = comm.all_reduce(bucket.sent, group=self.group, async_op=True)
            self._finish()
""", ["its all-reduce started only after gradient", "overlaps the rest of"]),
    },
    "03_accumulation": {
        # Right gradients, but every micro-batch all-reduces: no no_sync.
        "no_no_sync": ("""
from minidist.step import token_loss_sum

def train_step(model, strategy, micro_batches, num_targets, world_size):
    loss_sum = 0.0
    for batch in micro_batches:
        loss = token_loss_sum(model, batch, strategy)
        (loss * world_size / num_targets).backward()
        loss_sum = loss_sum + loss.detach()
    return loss_sum
""", ["3 all-reduces", "strategy.no_sync(model)"]),
        # The mean per micro-batch, then the mean of the micro-batches (transformers before October 2024).
        "mean_per_micro_batch": ("""
from contextlib import nullcontext
from minidist.step import token_loss_sum

def train_step(model, strategy, micro_batches, num_targets, world_size):
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else strategy.no_sync(model):
            loss = token_loss_sum(model, batch, strategy)
            targets = (batch["labels"][:, 1:] != -100).sum()
            (loss / targets / len(micro_batches)).backward()
        loss_sum = loss_sum + loss.detach()
    return loss_sum
""", ["not by one factor", "divide by num_targets"]),
        # Forgets the world size: the wrapper's average over ranks divides once too often.
        "no_world_size": ("""
from contextlib import nullcontext
from minidist.step import token_loss_sum

def train_step(model, strategy, micro_batches, num_targets, world_size):
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        with nullcontext() if i == len(micro_batches) - 1 else strategy.no_sync(model):
            loss = token_loss_sum(model, batch, strategy)
            (loss / num_targets).backward()
        loss_sum = loss_sum + loss.detach()
    return loss_sum
""", ["1/2 of the whole batch's", "world_size / num_targets"]),
    },
    "03_packing_mask": {
        # The same-game test without the causal one: a token sees the later tokens of its game.
        "no_causality": (MASK_HEADER + """
    return ((same & real) | itself).unsqueeze(1)
""", ["key 1 (game 1, its token 1): expected False, got True", "key j <= query i",
      "differ from the same game alone"]),
        # Padding left out altogether: its query rows see nothing.
        "padding_sees_nothing": (MASK_HEADER + """
    return (same & causal & real).unsqueeze(1)
""", ["query 7 (padding) and key 7 (padding): expected True, got False", "softmax over nothing"]),
        # The position ids alone: one causal mask over the whole row, no same-game test.
        "position_ids_alone": (MASK_HEADER + """
    return ((causal & real) | itself).unsqueeze(1)
""", ["query 3 (game 2, its token 0) and key 0 (game 1, its token 0)", "resetting the position ids is not enough",
      "changing game 1's tokens changed the output"]),
        # j < i: a token does not see itself (padding given its diagonal apart).
        "diagonal_off_by_one": (MASK_HEADER + """
    strict = torch.ones(s, s, dtype=torch.bool).tril(-1)
    return ((same & strict & real) | (itself & ~real)).unsqueeze(1)
""", ["query 0 (game 1, its token 0) and key 0 (game 1, its token 0): expected True, got False", "tril(-1)"]),
        # No heads' dimension: [rows, s, s], which SDPA would line up with the heads.
        "no_heads_dimension": (MASK_HEADER + """
    return (same & causal & real) | itself
""", ["shape (1, 5, 5), expected (rows, 1, s, s) = (1, 1, 5, 5)", "heads' dimension"]),
    },
    "04_zero2_step": {
        # Steps its shard, never all-gathers: each rank sees only its own shard move.
        "no_all_gather": ("""
import torch
from minidist.parallel import zero

class ShardedOptimizer(zero.ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None):
        for bucket in self.buckets:
            bucket.master.grad = bucket.own_gradient().float()
        self.optimizer.step()
        for bucket in self.buckets:
            bucket.master.grad = None
            bucket.weights[bucket.layout.shard_slice].copy_(bucket.master)
""", ["unchanged by the step on this rank", "all-gather"]),
        # All-gathers the weights as they are: the master is a view in fp32 (passes), a copy in bf16.
        "no_copy_of_the_master": ("""
import torch
from minidist.parallel import comm, zero

class ShardedOptimizer(zero.ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None):
        for bucket in self.buckets:
            bucket.master.grad = bucket.own_gradient().float()
        self.optimizer.step()
        for bucket in self.buckets:
            bucket.master.grad = None
            comm.all_gather(bucket.weights, bucket.weights[bucket.layout.shard_slice].clone(), group=self.group)
""", ["bfloat16", "copy the updated master"]),
        # Updates the whole flat tensor, as DDP would, from the shard's gradient alone: no sharding.
        "whole_tensor": ("""
import torch
from minidist.parallel import zero

class ShardedOptimizer(zero.ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None):
        for bucket in self.buckets:
            bucket.master.grad = bucket.own_gradient().float()
        self.optimizer.step()
        for bucket in self.buckets:
            bucket.master.grad = None
            bucket.weights.copy_(bucket.master.repeat(bucket.layout.padded_numel // bucket.layout.shard_numel))
""", ["rank 1's shard", "sent 0 bytes", "its own rank's updated master"]),
    },
    "05_fsdp_gather_free": {
        # free forgets the memory: every unit stays gathered, FSDP holds the model like DDP.
        "keeps_memory": ("""
from minidist.parallel import comm, fsdp

class Unit(fsdp.Unit):
    def gather(self):
        if self.state != "sharded":
            return
        self._data.untyped_storage().resize_(self.layout.padded_numel * self._data.element_size())
        self._send = self.flat_param.detach().to(self.fsdp.mp.param_dtype)
        self.handle = comm.all_gather(self._data, self._send, group=self.fsdp.group, async_op=True)
        self.state = "gathering"
        self.fsdp._count_unsharded(+1)

    def free(self):
        if self.state != "sharded":
            self.wait()
            self.state = "sharded"
            self.fsdp._count_unsharded(-1)
""", ["still holds", "resize_(0)"]),
        # gather without the guard: a unit the prefetch started is gathered a second time.
        "gathers_twice": ("""
from minidist.parallel import comm, fsdp

class Unit(fsdp.Unit):
    def gather(self):
        if self.state == "gathering":
            self.wait()
        self._data.untyped_storage().resize_(self.layout.padded_numel * self._data.element_size())
        self._send = self.flat_param.detach().to(self.fsdp.mp.param_dtype)
        self.handle = comm.all_gather(self._data, self._send, group=self.fsdp.group, async_op=True)
        self.state = "gathering"
        self.fsdp._count_unsharded(+1)

    def free(self):
        if self.state != "sharded":
            self.wait()
            self._data.untyped_storage().resize_(0)
            self.state = "sharded"
            self.fsdp._count_unsharded(-1)
""", ["minidist's FSDP sends", "nothing unless the unit is sharded"]),
    },
    "11_tensor_parallel": {
        # g's backward in f's place: the identity, each rank keeps only its own slice's term.
        "identity": (F_HEADER + """
        return grad, None
""", ["only this rank's part of the sum", "all-reduce it", "sent 0 bytes"]),
        # Averages, as DDP does with its gradients.
        "average": (F_HEADER + """
        out = grad.clone()
        comm.all_reduce(out, group=ctx.group)
        return out / dist.get_world_size(ctx.group), None
""", ["1/2 of the right one", "sum, not average"]),
        # The right sum, past minidist's counter: the lesson's bytes would not see it.
        "uncounted": (F_HEADER + """
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None
""", ["sent 0 bytes through minidist.parallel.comm", "no byte count sees it"]),
        # One gradient for two inputs: autograd wants one per argument of forward.
        "one_gradient": (F_HEADER + """
        out = grad.clone()
        comm.all_reduce(out, group=ctx.group)
        return out
""", ["incorrect number of gradients", "None for the group"]),
    },
    "12_pipeline_parallel": {
        # GPipe's order: right gradients, every micro-batch held.
        "gpipe": ("""
def one_f_one_b(m, pp, rank):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
""", ["held 8 micro-batches' activations", "your list is GPipe's"]),
        # A warm-up of p - rank forwards: one micro-batch more held on every stage.
        "warmup_p_minus_rank": ("""
def one_f_one_b(m, pp, rank):
    warmup = min(pp - rank, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]
""", ["1F1B holds min(m, p - rank)", "one forward too many"]),
        # The cool-down's backwards newest first.
        "cooldown_reversed": ("""
def one_f_one_b(m, pp, rank):
    warmup = min(pp - 1 - rank, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in reversed(range(m - warmup, m))]
""", ["executor.check refuses the table: schedule out of order", "in micro-batch order"]),
        # The warm-up not capped at m: forwards of micro-batches that do not exist.
        "uncapped": ("""
def one_f_one_b(m, pp, rank):
    warmup = pp - 1 - rank
    actions = [("F", i) for i in range(warmup)]
    for i in range(max(m - warmup, 0)):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(max(m - warmup, 0), m)]
""", ["with m = 2 micro-batches", "cap the warm-up at m"]),
    },
}


# ---------------------------------------------------------------------------------- the learner's command
if YOURS:
    def test_your_solution():
        """The learner's file, checked: pass, or a few lines that say what to fix."""
        path = Path(YOURS)
        if not path.is_file():
            pytest.fail(f"MINIDIST_EXERCISE={YOURS}: no such file (give the path of your copy of a skeleton in "
                        "lessons/exercises/, from the repository root)", pytrace=False)
        try:
            exercise = exercise_of(path)
        except CheckError as e:
            pytest.fail(str(e), pytrace=False)
        verdict = check(exercise, [str(path)])[0]
        what = EXERCISES[exercise][1]
        if verdict:
            pytest.fail(f"{YOURS} does not pass the check of {what}:\n{verdict}", pytrace=False)
        print(f"PASS: {YOURS} passes the check of {what}")

else:
    class Verdicts:
        """Each exercise's sources run in one launch, on first use, written under a temporary folder."""

        def __init__(self, folder: Path):
            self.folder, self.done = folder, {}

        def __call__(self, exercise: str) -> dict[str, str | None]:
            if exercise not in self.done:
                names, sources = ["minidist", "blank"], ["minidist", str(skeleton(exercise))]
                for name, (source, _) in WRONG.get(exercise, {}).items():
                    path = self.folder / f"{exercise}_{name}.py"
                    path.write_text(textwrap.dedent(source))
                    names.append(name)
                    sources.append(str(path))
                self.done[exercise] = dict(zip(names, check(exercise, sources)))
            return self.done[exercise]

    @pytest.fixture(scope="module")
    def verdicts(tmp_path_factory):
        return Verdicts(tmp_path_factory.mktemp("exercises"))

    @pytest.mark.parametrize("exercise", list(EXERCISES))
    def test_the_check_passes_minidists_own_implementation(verdicts, exercise):
        assert verdicts(exercise)["minidist"] is None, verdicts(exercise)["minidist"]

    @pytest.mark.parametrize("exercise", list(EXERCISES))
    def test_the_check_fails_the_blank_skeleton_with_its_line(verdicts, exercise):
        verdict = verdicts(exercise)["blank"]
        where = f"lessons/exercises/{exercise}.py, line"
        assert verdict is not None and "NotImplementedError" in verdict and where in verdict, (
            f"lessons/exercises/{exercise}.py is not blank any more, or fails otherwise "
            f"(`git checkout lessons/exercises/` restores it): {verdict}")

    @pytest.mark.parametrize("exercise, wrong", [(e, w) for e, ws in WRONG.items() for w in ws])
    def test_the_check_fails_a_plausible_wrong_solution_and_says_why(verdicts, exercise, wrong):
        verdict = verdicts(exercise)[wrong]
        assert verdict is not None, f"the wrong solution {wrong!r} passed the check of {exercise}"
        for words in WRONG[exercise][wrong][1]:
            assert words in verdict, f"{words!r} is not in the message:\n{verdict}"

    def test_a_copy_of_a_skeleton_is_known_by_its_exercise_line(tmp_path):
        """A learner's copy is checked by its EXERCISE line, wherever it lives and whatever its name."""
        for exercise in EXERCISES:
            copy = tmp_path / "my_solution.py"
            copy.write_text(skeleton(exercise).read_text())
            assert exercise_of(copy) == exercise
        copy.write_text("def ring_all_reduce(tensor, group=None):\n    pass\n")
        with pytest.raises(CheckError, match="no EXERCISE"):
            exercise_of(copy)
