"""`zero.ShardedOptimizer` as a drop-in for the `torch.optim` optimizer it wraps.

PyTorch's own tests of its `ZeroRedundancyOptimizer` show what a user of such a wrapper expects:
parameters without a gradient left alone, parameter groups given as dicts (the usual way to
exempt norms and biases from weight decay) with frozen parameters among them, `add_param_group`,
`step(closure)` with keyword arguments, `zero_grad`, and state dicts keyed as the wrapped
optimizer's. Each behaviour is a scenario run twice, on identical models and batches: with the
plain optimizer and with `ShardedOptimizer` around it. On one process (a gloo group of one) the
two must agree exactly; on 2 ranks (one launch, every scenario, each rank with the same batches,
as after DDP's averaging) each rank must give what one process gives with the plain optimizer.

Odd layer sizes pad the flat shards. The sharded runs take a bucket cap of 400 bytes (every layer
its own bucket or two), of 25 MB (everything in one bucket, so that parameters with and without a
gradient share one), and of 0 (a bucket per parameter).
"""

import copy
import functools

import pytest
import torch
from torch import nn

from minidist.parallel.zero import ShardedOptimizer
from minidist.runtime.distributed import cleanup, init_distributed
from minidist.runtime.launch import launch

# The full suite only: ZeRO-1's optimizer cases and a launch.
pytestmark = pytest.mark.slow

STEPS = 3
CAPS_MB = {"small buckets": 400 / 2**20, "one bucket": 25.0, "a bucket per parameter": 0.0}
SGD_OPTIONS = dict(lr=0.1, momentum=0.9)
ADAMW_OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
GROUP_OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95))  # with decay_groups' weight decay per group


class ScaledSGD(torch.optim.SGD):
    """SGD whose `step` takes a keyword argument: `scale`, of the learning rate."""

    def step(self, closure=None, scale: float = 1.0):
        for group in self.param_groups:
            group["lr"] *= scale
        loss = super().step(closure)
        for group in self.param_groups:
            group["lr"] /= scale
        return loss


# ---------------------------------------------------------------------------------- the scenarios
def plain(params, optimizer_class, **options):
    return optimizer_class(params, **options)


def sharded(cap_mb, params, optimizer_class, **options):
    return ShardedOptimizer(params, optimizer_class, bucket_cap_mb=cap_mb, **options)


def small_model() -> nn.Module:
    torch.manual_seed(0)  # the same weights in every run and on every rank
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))


def batches(steps=STEPS) -> list[torch.Tensor]:
    data = torch.Generator().manual_seed(1)  # the same batches in every run and on every rank
    return [torch.randn(8, 7, generator=data) for _ in range(steps)]


def train(model, optimizer, xs) -> None:
    for x in xs:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def weights(model: nn.Module, *extra) -> list[torch.Tensor]:
    return [p.detach().clone() for p in [*model.parameters(), *extra]]


def decay_groups(model: nn.Module, *extra) -> list[dict]:
    """Weight decay on the matrices, none on biases and norms (and `extra`), which also take
    another learning rate; the first layer's bias frozen, left in its group."""
    model[0].bias.requires_grad_(False)
    named = list(model.named_parameters())
    matrices = [p for n, p in named if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in named if not (n.endswith("weight") and p.dim() == 2)] + list(extra)
    return [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]


def without_gradient(build):
    """Beside a model that has a gradient at every step, a weight of ones whose gradient is ones at
    the first step only, and one that never has a gradient. `torch.optim` leaves each alone while
    it has none: under SGD (lr 0.1, momentum 0.9) the first stays at 0.9 after four steps."""
    out = {}
    for name, optimizer_class, options in (("SGD", torch.optim.SGD, SGD_OPTIONS),
                                           ("AdamW", torch.optim.AdamW, ADAMW_OPTIONS)):
        model, once, never = small_model(), nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(5))
        optimizer = build([*model.parameters(), once, never], optimizer_class, **options)
        for step, x in enumerate(batches(4)):
            optimizer.zero_grad()
            (model(x).pow(2).mean() + (once.sum() if step == 0 else 0)).backward()
            optimizer.step()
        out[name] = weights(model, once, never)
    return out


def sitting_out(build):
    """AdamW, a weight with a gradient at the first and the last of four steps only: `torch.optim`
    counts two steps for it (Adam's bias correction), two fewer than for the model beside it."""
    model, twice = small_model(), nn.Parameter(torch.ones(3))
    optimizer = build([*model.parameters(), twice], torch.optim.AdamW, **ADAMW_OPTIONS)
    for step, x in enumerate(batches(4)):
        optimizer.zero_grad()
        (model(x).pow(2).mean() + (twice.pow(2).sum() if step in (0, 3) else 0)).backward()
        optimizer.step()
    return weights(model, twice)


def groups_and_frozen(build):
    """AdamW over `decay_groups`: the weights, and each group's options as the optimizer holds them."""
    model = small_model()
    optimizer = build(decay_groups(model), torch.optim.AdamW, **GROUP_OPTIONS)
    train(model, optimizer, batches())
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"weights": weights(model), "options": options}


def frozen_then_unfrozen(build):
    """AdamW built while the last layer is frozen, which is unfrozen after the first step: torch.optim
    steps a parameter whenever it has a gradient, whatever it was when the optimizer was built."""
    model = small_model()
    last = list(model.parameters())[-2:]
    for p in last:
        p.requires_grad_(False)
    optimizer = build(model.parameters(), torch.optim.AdamW, **ADAMW_OPTIONS)
    xs = batches()
    train(model, optimizer, xs[:1])
    for p in last:
        p.requires_grad_(True)
    train(model, optimizer, xs[1:])
    return weights(model)


def added_group(build):
    """Two steps of the first layer alone, then the last layer added as a group with a learning
    rate of its own, and two more steps. Where its parameters went (into buckets of this rank's
    optimizer?) and how many state elements the rank holds."""
    model, xs = small_model(), batches(4)
    optimizer = build(model[0].parameters(), torch.optim.AdamW, **ADAMW_OPTIONS)
    train(model, optimizer, xs[:2])
    optimizer.add_param_group({"params": list(model[3].parameters()), "lr": 3e-3})
    train(model, optimizer, xs[2:])
    in_buckets = {id(p) for b in getattr(optimizer, "buckets", []) for p in b.params}
    trained = [*model[0].parameters(), *model[3].parameters()]
    return {"weights": weights(model), "added_in_buckets": all(id(p) in in_buckets for p in model[3].parameters()),
            "state_numel": sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim() > 0),
            "numel": sum(p.numel() for p in trained)}


def closure_and_keywords(build):
    """`step(closure, scale=0.5)`, the closure computing the loss and its gradients: the losses
    `step` returns, and the weights."""
    model = small_model()
    optimizer = build(model.parameters(), ScaledSGD, **SGD_OPTIONS)
    losses = []
    for x in batches():
        def closure(x=x):
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss
        losses.append(optimizer.step(closure, scale=0.5).item())
    return {"weights": weights(model), "losses": losses}


def zero_grad_in_place(build):
    """`zero_grad(set_to_none=False)` before each backward: the gradients are zeroed, not summed."""
    model = small_model()
    optimizer = build(model.parameters(), torch.optim.SGD, **SGD_OPTIONS)
    for x in batches():
        optimizer.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        optimizer.step()
    return weights(model)


def three_steps_then_two(build):
    """AdamW over `decay_groups`, with a parameter that never has a gradient (so no state in
    `torch.optim`): the weights and the state dict after three steps (consolidated on rank 0; what
    the other ranks' `state_dict()` says), and the weights after two more."""
    import torch.distributed as dist

    model, never = small_model(), nn.Parameter(torch.ones(5))
    optimizer = build(decay_groups(model, never), torch.optim.AdamW, **GROUP_OPTIONS)
    xs = batches(STEPS + 2)
    train(model, optimizer, xs[:STEPS])
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.consolidate_state_dict(to=0)
    try:
        state = copy.deepcopy(optimizer.state_dict())
    except RuntimeError as error:  # on ranks other than 0
        state = str(error) if dist.get_rank() else None
    at_three = weights(model, never)
    train(model, optimizer, xs[STEPS:])
    return {"state_dict": state, "at_three": at_three, "at_five": weights(model, never)}


def resumed(build, state: dict, at_three: list) -> list[torch.Tensor]:
    """`three_steps_then_two`'s last two steps, from its weights at three and a state dict loaded."""
    model, never = small_model(), nn.Parameter(torch.ones(5))
    with torch.no_grad():
        for p, saved in zip([*model.parameters(), never], at_three):
            p.copy_(saved)
    optimizer = build(decay_groups(model, never), torch.optim.AdamW, **GROUP_OPTIONS)
    optimizer.load_state_dict(copy.deepcopy(state))
    train(model, optimizer, batches(STEPS + 2)[STEPS:])
    return weights(model, never)


SCENARIOS = {f.__name__: f for f in (without_gradient, sitting_out, groups_and_frozen, frozen_then_unfrozen, added_group,
                                     closure_and_keywords, zero_grad_in_place, three_steps_then_two)}


def sharded_on_every_rank(plain_state: dict, plain_at_three: list) -> dict:
    """On each of the launched ranks: every scenario with ShardedOptimizer, at both bucket caps,
    and the resume from the plain optimizer's state dict."""
    out = {}
    for cap_name, cap in CAPS_MB.items():
        build = functools.partial(sharded, cap)
        out[cap_name] = {name: scenario(build) for name, scenario in SCENARIOS.items()}
        out[cap_name]["resumed"] = resumed(build, plain_state, plain_at_three)
    return out


# ---------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def expected() -> dict:
    """Every scenario with the plain optimizer, in this process."""
    return {name: scenario(plain) for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module")
def two_ranks(expected) -> list[dict]:
    state = expected["three_steps_then_two"]
    return launch(sharded_on_every_rank, 2, state["state_dict"], state["at_three"], timeout_s=180)


@pytest.fixture
def group_of_one():
    init_distributed()
    yield
    cleanup()


def runs(name, world, cap, request) -> list:
    """Scenario `name` with ShardedOptimizer: one result per rank."""
    if world == 2:
        return [rank[cap][name] for rank in request.getfixturevalue("two_ranks")]
    request.getfixturevalue("group_of_one")
    return [SCENARIOS[name](functools.partial(sharded, CAPS_MB[cap]))]


def same(got, want, world: int) -> None:
    """Exact on one process. The launched ranks compute the same gradients in other processes,
    whose matrix products may round otherwise (another thread count): a few ulps, which AdamW's
    division by the root of the second moment can grow a little."""
    tight = dict(rtol=0, atol=0) if world == 1 else dict(rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(got, want, **tight)


WORLDS = pytest.mark.parametrize("world", [1, 2], ids=["1 process", "2 ranks"])
CAPS = pytest.mark.parametrize("cap", ["small buckets", "one bucket"])


@WORLDS
@CAPS
def test_a_parameter_without_a_gradient_is_not_stepped(expected, world, cap, request):
    """Momentum, Adam's moments and weight decay must not move a weight while it has no gradient,
    whether its bucket's other parameters have one or not."""
    want = expected["without_gradient"]
    assert want["SGD"][-2].tolist() == pytest.approx([0.9] * 3) and want["SGD"][-1].tolist() == [1.0] * 5
    for got in runs("without_gradient", world, cap, request):
        assert got["SGD"][-2].tolist() == pytest.approx([0.9] * 3), "SGD moved a weight without a gradient"
        same(got, want, world)


def matches_the_plain_optimizer(expected, case: str, world: int, cap: str, request) -> None:
    """Every rank's run of `case` (weights, states, losses) is the plain optimizer's on one process."""
    want = expected[case]
    for got in runs(case, world, cap, request):
        same(got, want, world)


@WORLDS
def test_a_parameter_that_sits_out_steps_in_a_bucket_of_its_own_counts_only_its_own(expected, world, request):
    """The one thing a bucket's parameters share is a count per tensor, such as Adam's `step`:
    with a bucket per parameter (`bucket_cap_mb=0`) each has its own, as in `torch.optim`."""
    matches_the_plain_optimizer(expected, "sitting_out", world, "a bucket per parameter", request)


@WORLDS
@CAPS
def test_parameter_groups_with_options_of_their_own_and_frozen_parameters(expected, world, cap, request):
    """The usual AdamW set-up, no weight decay on biases and norms, as dicts; a frozen parameter in
    the list stays as it is; the groups' options are those the plain optimizer fills in."""
    want = expected["groups_and_frozen"]
    for got in runs("groups_and_frozen", world, cap, request):
        same(got, want, world)
        assert torch.equal(got["weights"][1], small_model()[0].bias.detach())  # the frozen bias


@WORLDS
@CAPS
def test_add_param_group_shards_the_new_group(expected, world, cap, request):
    """A group added after some steps trains as in the plain optimizer, and is sharded: its
    parameters go into buckets, and each of 2 ranks keeps about half of the states."""
    want = expected["added_group"]
    for got in runs("added_group", world, cap, request):
        same(got["weights"], want["weights"], world)
        assert got["added_in_buckets"]
        assert got["state_numel"] <= 2 * (got["numel"] / world + 6), got  # AdamW's m and v, padding aside


@WORLDS
def test_step_takes_a_closure_and_keyword_arguments(expected, world, request):
    """`step(closure, **kwargs)`: the closure computes the loss and gradients, `step` returns its
    loss, and the keyword arguments reach the wrapped optimizer's `step`."""
    matches_the_plain_optimizer(expected, "closure_and_keywords", world, "small buckets", request)


@WORLDS
def test_zero_grad_without_set_to_none_zeroes_the_gradients(expected, world, request):
    """With `set_to_none=False` the gradients are zeroed in place; backward must not add to the last step's."""
    matches_the_plain_optimizer(expected, "zero_grad_in_place", world, "small buckets", request)


@WORLDS
@CAPS
def test_state_dict_is_the_wrapped_optimizers_after_consolidate_state_dict(expected, world, cap, request):
    """After `consolidate_state_dict(to=0)`, rank 0's `state_dict()` equals the plain optimizer's:
    the same indices (frozen parameters and the one without a state counted), states in the
    parameters' shapes, the same groups. Another rank's says how to get one."""
    want = expected["three_steps_then_two"]
    assert len(want["state_dict"]["state"]) == len(want["at_three"]) - 2  # the frozen bias and `never` have none
    ranks = runs("three_steps_then_two", world, cap, request)
    same(ranks[0]["state_dict"], want["state_dict"], world)
    for rank, got in enumerate(ranks[1:], 1):
        assert "call consolidate_state_dict(to=1) on every rank" in got["state_dict"]
    for got in ranks:
        same(got["at_five"], want["at_five"], world)


@WORLDS
@CAPS
def test_load_state_dict_takes_the_wrapped_optimizers_or_its_own(expected, world, cap, request, group_of_one):
    """A resume from the plain optimizer's state dict (on every rank), and the plain optimizer's
    resume from ShardedOptimizer's (rank 0's), both give the uninterrupted run's weights."""
    want = expected["three_steps_then_two"]
    build = functools.partial(sharded, CAPS_MB[cap])
    if world == 2:
        from_plain = [rank[cap]["resumed"] for rank in request.getfixturevalue("two_ranks")]
        ours = request.getfixturevalue("two_ranks")[0][cap]["three_steps_then_two"]["state_dict"]
    else:
        from_plain = [resumed(build, want["state_dict"], want["at_three"])]
        ours = three_steps_then_two(build)["state_dict"]
    for got in from_plain:
        same(got, want["at_five"], world)
    same(resumed(plain, ours, want["at_three"]), want["at_five"], world)


@WORLDS
@pytest.mark.parametrize("cap", ["small buckets", "a bucket per parameter"])
def test_a_parameter_frozen_when_the_optimizer_is_built_is_stepped_once_unfrozen(expected, world, cap, request):
    """Frozen at the start, unfrozen after a step: stepped from then on, as torch.optim steps it. In
    buckets of their own (in one bucket with the others, Adam's step count is the bucket's, and the
    bias correction of its first step is not torch's: see the class docstring)."""
    want = expected["frozen_then_unfrozen"]
    assert not torch.equal(want[-1], small_model()[-1].bias.detach())  # torch.optim stepped it
    for got in runs("frozen_then_unfrozen", world, cap, request):
        same(got, want, world)


def test_params_is_checked_as_torch_optim_checks_it(group_of_one):
    """A bare tensor is not an iterable of parameters: torch.optim raises TypeError, and so must the
    drop-in (iterating it would make its rows the parameters)."""
    weight = nn.Parameter(torch.ones(3, 2))
    with pytest.raises(TypeError, match="iterable of Tensors"):
        torch.optim.AdamW(weight)
    with pytest.raises(TypeError, match="iterable of Tensors"):
        ShardedOptimizer(weight, torch.optim.AdamW)


# Two ranks started as separate processes, as torchrun starts them, each with its own hash seed:
# 0 and 1 iterate {"exp_avg", "exp_avg_sq"} in opposite orders (Python's str hash is seeded).
SEEDED_RANK = """
import sys, torch
from torch import nn
from minidist.parallel.zero import ShardedOptimizer
from minidist.runtime.distributed import cleanup, init_distributed
env = init_distributed()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
reference = [p.detach().clone() for p in model.parameters()]
data = torch.Generator().manual_seed(1)
xs = [torch.randn(8, 7, generator=data) for _ in range(3)]
optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
for x in xs:
    optimizer.zero_grad(); model(x).pow(2).mean().backward(); optimizer.step()
optimizer.consolidate_state_dict(to=0)
if env.rank == 0:
    torch.save({"state_dict": optimizer.state_dict(), "reference": reference, "xs": xs}, sys.argv[1])
cleanup()
"""


def test_consolidation_agrees_across_ranks_of_different_hash_seeds(tmp_path):
    import os
    import subprocess
    import sys

    from minidist.runtime.distributed import find_free_port

    assert [subprocess.run([sys.executable, "-c", 'print(list({"exp_avg", "exp_avg_sq"}))'], capture_output=True,
                           text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in "01"] == \
        ["['exp_avg', 'exp_avg_sq']\n", "['exp_avg_sq', 'exp_avg']\n"], "pick two seeds of opposite orders"
    port, out = str(find_free_port()), tmp_path / "state.pt"
    ranks = [subprocess.Popen([sys.executable, "-c", SEEDED_RANK, str(out)],
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port, "PYTHONHASHSEED": str(rank), "OMP_NUM_THREADS": "1"})
             for rank in range(2)]
    assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    saved = torch.load(out, weights_only=True)
    model = small_model_without_norm(saved["reference"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, saved["xs"])
    want = optimizer.state_dict()["state"]
    got = saved["state_dict"]["state"]
    assert got.keys() == want.keys()
    for index in want:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[index][key], want[index][key], rtol=1e-5, atol=1e-8)
        assert (got[index]["exp_avg_sq"] >= 0).all()


def small_model_without_norm(reference: list) -> nn.Module:
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    with torch.no_grad():
        for p, saved in zip(model.parameters(), reference):
            p.copy_(saved)
    return model
