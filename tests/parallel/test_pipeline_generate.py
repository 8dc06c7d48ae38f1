"""Generation through a pipeline (`minidist/parallel/pipeline/generate.py`): a tiny Llama cut over 2
and 4 CPU ranks writes, on every stage, the text Hugging Face's `generate` writes with the whole
model in one process (`legal_moves.greedy_continue`), for left-padded prompts of different lengths,
whole or cut to a context; the legal-move rate through the pipeline, alone and beside another
pipeline (pp 2 x dp 2), is the one-process rate; nothing is counted as training traffic.

Every case of a world size runs in one launch (`pipeline_generate_workers.cases`), shared with the
other pipeline modules (`pipeline_launches`): starting ranks costs more than a case. The one-process reference runs once, here."""

import pipeline_generate_workers as workers
import pipeline_launches
import pytest
import torch

from minidist.batches import left_padded
from minidist.chess import legal_moves
from minidist.parallel.pipeline import generate

# The full suite only: generation through the stages, on 2 and 4 ranks.
pytestmark = pytest.mark.slow

TWO = [("text", 2), ("cut", 2), ("rate", 2), ("text", 2, "zeros"), ("misplaced", 2)]
FOUR = [("text", 4), ("cut", 4), ("rate", 4), ("rate", 2)]  # the last: 2 pipelines of 2 stages, side by side


# In the launch of each world size that the pipeline modules share (tests/pipeline_launches.py).
PLANNED = {world: pipeline_launches.plan(world, workers.cases, [dict(zip(("what", "pp", "sabotage"), spec))
                                                                  for spec in specs])
           for world, specs in ((2, TWO), (4, FOUR))}


@pytest.fixture(scope="module")
def results():
    """Every case's results by rank, keyed as in TWO and FOUR by (world, what, pp[, sabotage])."""
    out = {}
    for world, specs in ((2, TWO), (4, FOUR)):
        by_rank = pipeline_launches.results(PLANNED[world])
        out.update({(world, *spec): [rank[i] for rank in by_rank] for i, spec in enumerate(specs)})
    return out


@pytest.fixture(scope="module")
def reference():
    return workers.reference()


@pytest.mark.parametrize("world, what, pp", [(2, "text", 2), (2, "cut", 2), (4, "text", 4), (4, "cut", 4)])
def test_every_stage_writes_the_text_of_generate_on_the_whole_model(results, reference, world, what, pp):
    assert len(set(map(len, workers.prompts()))) > 1  # prompts of different lengths: left padding
    if what == "cut":
        assert reference["cut"] != reference["text"]  # the context cuts some prompts, and it shows
    for rank, result in enumerate(results[world, what, pp]):
        assert result["result"] == reference[what], rank
        assert result["counted"] == 0, rank  # generation is not a training step's traffic


@pytest.mark.parametrize("world, pp", [(2, 2), (4, 4), (4, 2)])
def test_the_legal_move_rate_through_the_pipeline_is_the_one_process_rate(results, reference, world, pp):
    expected = reference["rate"]
    assert 0 < expected["legal"] < expected["total"]  # a rate that a wrong continuation would change
    for rank, result in enumerate(results[world, "rate", pp]):
        rate = result["result"]
        assert (rate["legal"], rate["total"], rate["legal_move_rate"]) == \
            (expected["legal"], expected["total"], expected["legal_move_rate"]), rank
        if world == pp:  # one pipeline: it judges every prefix, the same first three as one process
            assert rate["samples"] == expected["samples"], rank


def test_the_hidden_states_sent_between_stages_are_needed(results, reference):
    for rank, result in enumerate(results[2, "text", 2, "zeros"]):
        assert result["result"] != reference["text"], rank


def test_a_stage_at_another_rank_of_the_group_is_refused_in_one_line(results):
    messages = [result["result"] for result in results[2, "misplaced", 2]]
    assert messages == ["stage 1 sits at rank 0 of the pipeline's group: the group's ranks must be in stage order",
                        "stage 0 sits at rank 1 of the pipeline's group: the group's ranks must be in stage order"]


def test_positions_are_those_generate_gives_a_left_padded_prompt():
    """What `generate` hands the whole model's rotary embedding, on the prompt's forward and on the
    next token's, against `generate.position_ids`, on the real tokens (the padding's are never seen).
    Through the pipeline the text alone could not tell: rotary positions are relative, and a padded
    row numbered from 0 is only shifted by its padding, so its attention scores do not change."""
    whole, tokenizer = workers.model(), workers.tokenizer()
    seen = []
    hook = whole.model.rotary_emb.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        legal_moves.greedy_continue(whole, tokenizer, workers.prompts(), 2, "cpu")
    finally:
        hook.remove()  # the model is the module's, shared with the other tests
    _, mask = left_padded(tokenizer, workers.prompts(), 2, None)
    real = mask == 1
    assert torch.equal(seen[0][real], generate.position_ids(mask)[real])
    grown = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    assert torch.equal(seen[1][:, -1], generate.position_ids(grown)[:, -1])
    counted_from_zero = torch.arange(mask.shape[1]).expand(mask.shape)  # what the stages do by default
    assert not torch.equal(seen[0][real], counted_from_zero[real])
