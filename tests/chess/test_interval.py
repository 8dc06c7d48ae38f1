"""The 95% interval a legal-move rate carries (`legal_moves.wilson_interval`), against published values."""

import pytest

from minidist.chess import legal_moves


@pytest.mark.parametrize("successes, trials, low, high", [
    # Newcombe 1998, "Two-sided confidence intervals for the single proportion", Table I,
    # method 3 (Wilson score)
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
])
def test_wilson_interval_matches_newcombe(successes, trials, low, high):
    got = legal_moves.wilson_interval(successes, trials)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_the_interval_holds_the_rate_and_narrows_with_more_trials():
    low, high = legal_moves.wilson_interval(45, 200)
    assert low < 45 / 200 < high
    wider, narrower = legal_moves.wilson_interval(9, 40), legal_moves.wilson_interval(450, 2000)
    assert wider[1] - wider[0] > high - low > narrower[1] - narrower[0]
    assert legal_moves.wilson_interval(20, 20)[1] == 1.0 and legal_moves.wilson_interval(20, 20)[0] < 1.0
    assert legal_moves.wilson_interval(45, 200, confidence=0.99)[0] < low


@pytest.mark.parametrize("successes, trials, confidence", [(3, 0, 0.95), (5, 4, 0.95), (-1, 4, 0.95), (2, 4, 95)])
def test_bad_counts_are_one_clear_error(successes, trials, confidence):
    with pytest.raises(ValueError, match="trial|successes|confidence"):
        legal_moves.wilson_interval(successes, trials, confidence)
