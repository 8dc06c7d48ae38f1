"""The single-process reference every strategy is held to, written without minidist's loop.

The textbook training loop: one process, the whole global batch as one batch, the mean token
loss, AdamW, gradient clipping at 1.0. Only the data order (`GlobalBatchSampler`) and AdamW's
betas (`ADAMW_BETAS`, written once for the whole project) come from minidist, so that both
sides see the same games in the same steps and use the same optimizer.

How a run's weights are held to the reference's (`assert_parameters_match`). A data-parallel run
adds the same gradients in another order (per rank, then across ranks), so in fp32 its gradients
differ from the reference's in the last bits: at most about 1e-7 on the tiny Llama's embedding,
whose largest gradient is about 1e-2. AdamW's step is lr * m / (sqrt(v) + eps), eps = 1e-8. Where
sqrt(v) is far above eps the step is a ratio of the element's own gradients, and last-bit noise
stays last-bit noise. Where sqrt(v) is near eps (an element whose gradient nearly cancels), the
step grows with the gradient itself, up to lr * m / eps: at step 3 a gradient of 2.3e-8 gets a
step of 0.360 lr, the same gradient rounded to 2.0e-8 one of 0.339 lr (2% of a step apart, where
an element far from eps would not move apart at all), and a gradient of the size of its noise
gets a step of either sign. That is arithmetic,
not a bug, and no tolerance on all elements both admits it and still means something. So the
weights are compared in three classes, each as tight as what AdamW does to it allows:

- elements that never had a gradient (the embedding rows of tokens no batch holds): AdamW leaves
  them exactly where they started, in every run, so they must be equal bit for bit;
- elements in AdamW's eps regime (their denominator sqrt(v_hat) + eps below `EPS_REGIME` x eps at
  some step): within what AdamW can move an element in the run (`Reference.max_move`), counted
  for both runs: the size and direction of their steps depend on the rounding of their gradients;
- all the others: the caller's tolerance (rtol 1e-5, atol 1% of one step in the parity tests).

Seen with `tests/parallel/test_hsdp.py`'s reference (4 steps, the untied 64-wide Llama, 350,400
elements): 92,096 untouched, 902 in the eps regime (533 of them in the output layer's rows of
tokens no batch predicts). One of those, embedding element [510, 10], has a gradient of 2.3e-8 at
the only step that touched it; every data-parallel run (DDP, FSDP, HSDP, on 4 ranks) ends 2e-5 to
3.6e-5 from the reference there (atol is 3e-5), and the fp32 reference itself ends 9.2e-5 from
the fp64 one; every other embedding element is within 3e-7 of the reference, a hundredth of atol,
and every element of the other weights within 8.6e-6.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minidist import batches, packing
from minidist.chess import jsonl
from minidist.chess.games import bundled_games
from minidist.hf import models
from minidist.strategy.options import ADAMW_BETAS


# An element is in AdamW's eps regime when its denominator sqrt(v_hat) + eps fell below this many
# eps at some step: there its step follows the gradient's own size, and so its rounding (module doc).
# Above it, eps changes the step by less than 1%.
EPS_REGIME = 100


@dataclass
class Reference:
    """What the reference run ends with, and what the comparison needs to know about its AdamW.

    untouched, eps_regime: per state_dict name of a trainable parameter, a boolean mask of its
    elements that never had a gradient, and of those in AdamW's eps regime (module doc).
    max_move: how far AdamW can move one element over the whole run, the sum over steps of
    lr_t x bound_t (`adamw_step_bound`)."""
    losses: list
    parameters: dict
    trainable: int
    grad_norms: list  # the gradient's norm at each step, before clipping
    untouched: dict
    eps_regime: dict
    max_move: float


def train_reference(model_dir, **kwargs):
    """Return (losses per step, final state_dict, number of trainable parameters): `run_reference`'s
    first three, for the callers that compare with one tolerance."""
    ref = run_reference(model_dir, **kwargs)
    return ref.losses, ref.parameters, ref.trainable


def run_reference(model_dir, *, steps, global_batch, seq_len, lr, seed=0, dtype=torch.float32, frozen=(),
                  lr_lambda=None, lora_config=None, data=None, pack=False) -> Reference:
    """Train the reference; return its `Reference`.

    data: the games file, as the loop's `--data` (the bundled training games by default).

    pack: the whole global batch packed into rows of `seq_len` tokens (`minidist/packing.py`), the
    model given the block-diagonal mask and the position ids: the single-process run `--pack` is held to.

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
    losses, norms, max_move = [], [], 0.0
    small = {p: torch.zeros_like(p, dtype=torch.bool) for p in params}  # in the eps regime at some step
    for step in range(steps):
        games = [sequences[i] for i in sampler.global_batch(step)]
        if pack:
            rows = packing.pack_rows([len(game) for game in games], seq_len)
            batch = packing.collate_packed([[games[i] for i in row] for row in rows], tokenizer.pad_token_id)
        else:
            batch = batches.collate(games, tokenizer.pad_token_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch.get("position_ids")).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0).item())
        max_move += optimizer.param_groups[0]["lr"] * adamw_step_bound(step + 1)
        optimizer.step()
        _mark_eps_regime(optimizer, small)
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    untouched, eps_regime = {}, {}
    for name in model.state_dict():
        p = _trainable(model, name)
        if p is not None:
            v = optimizer.state.get(p, {}).get("exp_avg_sq", torch.zeros_like(p))  # no state: never a gradient
            untouched[name], eps_regime[name] = v == 0, small[p]
    return Reference(losses, {k: v.detach().clone() for k, v in model.state_dict().items()},
                     sum(p.numel() for p in params), norms, untouched, eps_regime, max_move)


def adamw_step_bound(t: int) -> float:
    """The largest |m_hat / (sqrt(v_hat) + eps)| AdamW can take at step t, whatever the gradients.

    m_hat = sum_s w_s g_s and v_hat = sum_s u_s g_s^2, with w_s = (1 - b1) b1^(t-s) / (1 - b1^t)
    and u_s = (1 - b2) b2^(t-s) / (1 - b2^t); by Cauchy-Schwarz |m_hat| <= sqrt(sum_s w_s^2 / u_s)
    sqrt(v_hat). With the project's betas (0.9, 0.95) that is 1 at step 1, 1.003 at step 5 and
    at most 1.17: one step moves an element by about lr at most."""
    b1, b2 = ADAMW_BETAS
    return math.sqrt(sum(((1 - b1) * b1 ** k / (1 - b1 ** t)) ** 2 / ((1 - b2) * b2 ** k / (1 - b2 ** t))
                         for k in range(t)))


def _mark_eps_regime(optimizer, small: dict) -> None:
    """After a step: mark the elements whose AdamW denominator sqrt(v_hat) + eps, as torch's AdamW
    computes it, is below EPS_REGIME x eps while they have a gradient history (v > 0)."""
    group = optimizer.param_groups[0]
    eps, (_, b2) = group["eps"], group["betas"]
    for p, state in optimizer.state.items():
        v, t = state["exp_avg_sq"], float(state["step"])
        denominator = v.sqrt() / math.sqrt(1 - b2 ** t) + eps
        small[p] |= (v > 0) & (denominator < EPS_REGIME * eps)


def _trainable(model, name: str):
    """The trainable parameter a state_dict entry names (tied names give the same one), or None."""
    try:
        p = model.get_parameter(name)
    except AttributeError:  # a buffer
        return None
    return p if p.requires_grad else None


def assert_close_named(actual, expected, name: str, **tolerance) -> None:
    """`torch.testing.assert_close`, its own report (how many elements, the largest difference and
    where) prefixed with `name`."""
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{name}: {m}", **tolerance)


def assert_parameters_match(got: dict, reference: Reference, *, rtol: float, atol: float, where: str = "") -> None:
    """A run's weights against the reference's, by name, in the three classes of the module doc:
    untouched elements bit for bit, the eps regime within 2 x `max_move` (each run moves them by
    at most that), every other element within (rtol, atol). Each report names the parameter and the
    class, and keeps the element indices of the whole tensor."""
    assert got.keys() == reference.parameters.keys()
    for name, ref in reference.parameters.items():
        mine, label = got[name], f"{where}{name}"
        untouched = reference.untouched.get(name, torch.zeros_like(ref, dtype=torch.bool))
        eps_regime = reference.eps_regime.get(name, torch.zeros_like(ref, dtype=torch.bool))
        assert_close_named(torch.where(untouched, mine, ref), ref, f"{label} (elements that never had a gradient)",
                           rtol=0, atol=0)
        assert_close_named(torch.where(eps_regime, mine, ref), ref,
                           f"{label} ({int(eps_regime.sum())} elements in AdamW's eps regime)",
                           rtol=0, atol=2 * reference.max_move)
        assert_close_named(torch.where(untouched | eps_regime, ref, mine), ref, label, rtol=rtol, atol=atol)
