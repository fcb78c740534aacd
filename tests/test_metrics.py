from __future__ import annotations

import pytest

from validate import metrics


def _counters(drafts: int, accepted_per_pos: list[int], k: int = 3) -> dict[str, object]:
    return {
        "vllm:spec_decode_num_drafts": drafts,
        "vllm:spec_decode_num_draft_tokens": drafts * k,
        "vllm:spec_decode_num_accepted_tokens": sum(accepted_per_pos),
        "vllm:spec_decode_num_accepted_tokens_per_pos": accepted_per_pos,
    }


def test_mean_acceptance_length_is_one_plus_accepted_per_draft() -> None:
    acc = metrics.acceptance_from_counters(_counters(100, [90, 70, 40]), 3)
    assert acc.mean_acceptance_length == pytest.approx(3.0)
    assert acc.acceptance_rate == pytest.approx(200 / 300)
    assert acc.per_position_rate == pytest.approx([0.9, 0.7, 0.4])


def test_no_drafts_means_length_one() -> None:
    acc = metrics.acceptance_from_counters({}, 3)
    assert (acc.drafts, acc.mean_acceptance_length, acc.accepted_per_position) == (0, 1.0, [0, 0, 0])


def test_compare_keeps_diverging_pairs() -> None:
    cmp = metrics.compare(["a", "b", "c"], ["x", "y", "z"], ["x", "Y", "z"])
    assert (cmp.matches, cmp.total) == (2, 3)
    assert cmp.mismatches == [{"index": 1, "prompt": "b", "reference": "y", "speculative": "Y"}]
    with pytest.raises(ValueError, match="length mismatch"):
        metrics.compare(["a"], ["x"], [])


def test_random_head_matches_but_fails_on_acceptance() -> None:
    """The seed's check alone (>66% exact match) passes a head that predicts nothing."""
    cmp = metrics.compare(["p"] * 100, ["same"] * 100, ["same"] * 100)
    acc = metrics.acceptance_from_counters(_counters(1764 // 3, [0, 0, 0]), 3)
    v = metrics.verdict(cmp, acc, min_exact_match=0.66, min_mean_acceptance_length=1.5)
    assert not v.passed and v.word == "FAIL"
    assert any("acceptance is too low" in r for r in v.reasons), v.reasons


def test_pass_needs_both_floors() -> None:
    good = metrics.acceptance_from_counters(_counters(100, [90, 80, 70]), 3)
    half = metrics.compare(["p"] * 10, ["a"] * 10, ["a"] * 5 + ["b"] * 5)
    v = metrics.verdict(half, good, min_exact_match=0.95, min_mean_acceptance_length=2.0)
    assert not v.passed and "exact match 5/10 = 50.0% < floor 95%" in v.reasons[0]
    full = metrics.compare(["p"] * 10, ["a"] * 10, ["a"] * 10)
    v = metrics.verdict(full, good, min_exact_match=0.95, min_mean_acceptance_length=2.0)
    assert v.passed, v.reasons
