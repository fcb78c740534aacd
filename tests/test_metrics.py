from __future__ import annotations

import math

import pytest

from validate import metrics, profiles
from validate.metrics import Output


def _counters(drafts: int, accepted_per_pos: list[int], k: int = 3) -> dict[str, object]:
    return {
        "vllm:spec_decode_num_drafts": drafts,
        "vllm:spec_decode_num_draft_tokens": drafts * k,
        "vllm:spec_decode_num_accepted_tokens": sum(accepted_per_pos),
        "vllm:spec_decode_num_accepted_tokens_per_pos": accepted_per_pos,
    }


def _acc(drafts: int, per_pos: list[int]) -> metrics.Acceptance:
    return metrics.acceptance_from_counters(_counters(drafts, per_pos), len(per_pos))


def _out(tokens: list[int], tops: list[list[tuple[int, float]]] | None = None) -> Output:
    return Output(text=" ".join(map(str, tokens)), token_ids=tokens,
                  top=tops if tops is not None else [[(t, -0.1)] for t in tokens])


def test_mean_acceptance_length_is_one_plus_accepted_per_draft() -> None:
    acc = _acc(100, [90, 70, 40])
    assert acc.mean_acceptance_length == pytest.approx(3.0)
    assert acc.acceptance_rate == pytest.approx(200 / 300)
    assert acc.per_position_rate == pytest.approx([0.9, 0.7, 0.4])


def test_no_drafts_means_length_one() -> None:
    acc = metrics.acceptance_from_counters({}, 3)
    assert (acc.drafts, acc.mean_acceptance_length, acc.accepted_per_position) == (0, 1.0, [0, 0, 0])


def test_standard_error_matches_the_per_draft_distribution() -> None:
    """X = accepted tokens per draft; 100 drafts: 10 with X=0, 20 with 1, 30 with 2, 40 with 3."""
    acc = _acc(100, [90, 70, 40])
    xs = [0] * 10 + [1] * 20 + [2] * 30 + [3] * 40
    mean = sum(xs) / 100
    var = sum((x - mean) ** 2 for x in xs) / 100
    assert acc.standard_error == pytest.approx(math.sqrt(var / 100))


def test_identical_outputs_have_no_divergence() -> None:
    cmp = metrics.compare([_out([1, 2, 3])], [_out([1, 2, 3])], delta=0.5)
    assert (cmp.matches, cmp.divergences, cmp.ratio) == (1, [], 1.0)


def test_a_flip_between_two_almost_equal_tokens_is_a_near_tie() -> None:
    ref = _out([1, 2, 3], [[(1, -0.1)], [(2, -0.70), (9, -0.72)], [(3, -0.1)]])
    spec = _out([1, 9, 4])
    cmp = metrics.compare([ref], [spec], delta=0.5)
    (d,) = cmp.divergences
    assert (d.position, d.reference_token, d.speculative_token, d.kind) == (1, 2, 9, metrics.NEAR_TIE)
    assert d.gap == pytest.approx(0.02)
    assert cmp.hard == [] and cmp.matches == 0


def test_a_token_the_target_did_not_prefer_is_hard() -> None:
    ref = _out([1, 2], [[(1, -0.1)], [(2, -0.05), (9, -3.2)]])
    cmp = metrics.compare([ref], [_out([1, 9])], delta=0.5)
    (d,) = cmp.hard
    assert d.gap == pytest.approx(3.15) and not d.gap_is_lower_bound


def test_a_token_outside_the_reference_top_k_is_hard_with_a_bound() -> None:
    ref = _out([1, 2], [[(1, -0.1)], [(2, -0.05), (5, -0.3)]])
    (d,) = metrics.compare([ref], [_out([1, 7])], delta=0.5).hard
    assert d.gap_is_lower_bound and d.gap == pytest.approx(0.25)


def test_an_output_that_stops_early_is_hard() -> None:
    (d,) = metrics.compare([_out([1, 2, 3])], [_out([1, 2])], delta=0.5).hard
    assert d.position == 2 and d.gap is None


def test_delta_is_the_boundary() -> None:
    ref = _out([1], [[(1, -0.1), (4, -0.6)]])
    assert metrics.compare([ref], [_out([4])], delta=0.5).divergences[0].kind == metrics.NEAR_TIE
    assert metrics.compare([ref], [_out([4])], delta=0.49).divergences[0].kind == metrics.HARD


def test_logprob_noise_compares_the_same_token_before_the_divergence() -> None:
    ref = _out([1, 2, 3], [[(1, -0.10)], [(2, -0.50)], [(3, -0.2)]])
    spec = _out([1, 2, 4], [[(1, -0.13)], [(2, -0.40)], [(4, -9.0)]])
    noise = metrics.logprob_noise([ref], [spec])
    assert noise["positions"] == 2 and noise["max"] == pytest.approx(0.10)


def test_length_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="length mismatch"):
        metrics.compare([_out([1])], [], delta=0.5)


def test_tolerance_combines_run_spread_and_standard_error() -> None:
    runs = [_acc(1000, [900, 700, 400]), _acc(1000, [880, 690, 410]), _acc(1000, [910, 720, 420])]
    fig = metrics.derive_tolerance(runs, sigmas=3.0)
    lengths = [r.mean_acceptance_length for r in runs]
    sd = (sum((x - sum(lengths) / 3) ** 2 for x in lengths) / 2) ** 0.5
    se = sum(r.standard_error for r in runs) / 3
    assert fig["mean_acceptance_length"]["mean"] == pytest.approx(sum(lengths) / 3)
    assert fig["mean_acceptance_length"]["tolerance"] == pytest.approx(3 * math.hypot(sd, se))
    # one run: no spread, the standard error alone; more drafts: a tighter tolerance
    one = metrics.derive_tolerance(runs[:1], sigmas=3.0)["mean_acceptance_length"]
    assert one["sd_runs"] == 0 and one["tolerance"] == pytest.approx(3 * runs[0].standard_error)
    big = metrics.derive_tolerance([_acc(100_000, [90_000, 70_000, 40_000])], sigmas=3.0)
    assert big["mean_acceptance_length"]["tolerance"] < one["tolerance"] / 5
    pos = fig["per_position_rate"][0]
    assert pos["mean"] == pytest.approx((0.9 + 0.88 + 0.91) / 3) and pos["tolerance"] > 0


def _golden(mean_pos: list[int], drafts: int = 1000) -> metrics.Expectation:
    return metrics.expectation("golden test", metrics.derive_tolerance([_acc(drafts, mean_pos)], 3.0))


def _clean(n: int = 10) -> metrics.Comparison:
    return metrics.compare([_out([1, 2])] * n, [_out([1, 2])] * n, delta=0.5)


def test_calibrated_pass_and_a_five_percent_drop_fails() -> None:
    golden = _golden([900, 800, 700])
    ok = metrics.verdict(_clean(), _acc(1000, [895, 790, 700]), min_mean_acceptance_length=2.0,
                         golden=golden)
    assert ok.passed and ok.calibrated and ok.calibration == "calibrated", ok.reasons
    # 5% below the golden: far above the floor of 2.0, but the golden catches it
    low = _acc(1000, [860, 750, 650])
    assert low.mean_acceptance_length > 2.0
    bad = metrics.verdict(_clean(), low, min_mean_acceptance_length=2.0, golden=golden)
    assert not bad.passed and any("acceptance is too low" in r for r in bad.reasons), bad.reasons


def test_one_position_below_its_golden_fails() -> None:
    """Overall length within tolerance, but the third position collapsed."""
    golden = _golden([900, 800, 500], drafts=1000)
    run = _acc(1000, [960, 860, 400])
    v = metrics.verdict(_clean(), run, min_mean_acceptance_length=2.0, golden=golden)
    assert run.mean_acceptance_length >= golden.minimum
    assert not v.passed and any("position 3 too low" in r for r in v.reasons), v.reasons


def test_uncalibrated_says_so_and_uses_the_floor() -> None:
    v = metrics.verdict(_clean(), _acc(100, [90, 80, 70]), min_mean_acceptance_length=2.0,
                        uncalibrated_because="no golden for tiny on cpu-avx2 at TP=8")
    assert v.passed and not v.calibrated
    assert any(r.startswith("uncalibrated (no golden for tiny on cpu-avx2") for r in v.reasons)


def test_random_head_matches_but_fails_on_acceptance() -> None:
    """The seed's check alone (>66% exact match) passes a head that predicts nothing."""
    acc = _acc(1764 // 3, [0, 0, 0])
    v = metrics.verdict(_clean(100), acc, min_mean_acceptance_length=1.5)
    assert not v.passed and v.word == "FAIL"
    assert any("acceptance is too low" in r for r in v.reasons), v.reasons


def test_near_ties_pass_and_one_hard_divergence_fails() -> None:
    good = _acc(100, [90, 80, 70])
    ref = _out([1, 2], [[(1, -0.1)], [(2, -0.3), (9, -0.35), (8, -4.0)]])
    ties = metrics.compare([ref] * 11 + [_out([1, 2])] * 89, [_out([1, 9])] * 11 + [_out([1, 2])] * 89,
                           delta=0.5)
    v = metrics.verdict(ties, good, min_mean_acceptance_length=2.0)
    assert ties.ratio == pytest.approx(0.89) and v.passed, v.reasons
    hard = metrics.compare([ref], [_out([1, 8])], delta=0.5)
    v = metrics.verdict(hard, good, min_mean_acceptance_length=2.0)
    assert not v.passed and any(r.startswith("hard divergence") for r in v.reasons), v.reasons


def test_tp_invariance_reports_a_sharded_run_below_the_tp1_golden() -> None:
    """Reported with both tolerances (golden's and the run's own), not gated (docs/verdict.md)."""
    tp1 = _golden([900, 800, 700])
    tp8_golden = _golden([700, 500, 300])  # a TP=8 golden calibrated on an already-broken build
    run = _acc(1000, [700, 500, 300])
    v = metrics.verdict(_clean(), run, min_mean_acceptance_length=2.0, golden=tp8_golden,
                        tp_reference=tp1)
    assert any("sharding bug" in r for r in v.reasons), v.reasons
    assert v.passed, "not gated: the same-TP golden decides"
    # 3% below TP=1 (what CPU TP=8 measured): within the two-sample tolerance, nothing reported
    near = metrics.verdict(_clean(), _acc(1000, [880, 775, 680]), min_mean_acceptance_length=2.0,
                           golden=tp8_golden, tp_reference=tp1)
    assert not any("sharding bug" in r for r in near.reasons), near.reasons
    assert any(r.startswith("TP invariance (reported, not gated): mean") for r in near.reasons)


def _figures(mean: float, rates: list[float], se: float = 0.02, hard: int = 0,
             divergences: int = 0, prompts: int = 100):
    from validate.metrics import Figures

    return Figures(mean, se, rates, [0.01] * len(rates), hard, divergences, prompts)


def test_compare_change_regression_ok_improved() -> None:
    """The change beside the release: below by more than 3 combined standard errors anywhere is
    REGRESSION, a new hard divergence too; within is OK; above overall is IMPROVED."""
    from validate.metrics import compare_change

    base = _figures(3.0, [0.8, 0.7, 0.5])
    assert compare_change(base, _figures(3.0, [0.8, 0.7, 0.5]), sigmas=3).word == "OK"
    assert compare_change(base, _figures(2.95, [0.79, 0.69, 0.47]), sigmas=3).word == "OK"
    low = compare_change(base, _figures(2.8, [0.8, 0.7, 0.5]), sigmas=3)
    assert low.word == "REGRESSION" and "mean acceptance length 2.800" in low.reasons[0]
    late = compare_change(base, _figures(3.0, [0.8, 0.7, 0.4]), sigmas=3)  # one position only
    assert late.word == "REGRESSION" and "position 3 rate" in late.reasons[0]
    hard = compare_change(base, _figures(3.0, [0.8, 0.7, 0.5], hard=2), sigmas=3)
    assert hard.word == "REGRESSION" and hard.new_hard == 2
    assert compare_change(base, _figures(3.2, [0.85, 0.75, 0.6]), sigmas=3).word == "IMPROVED"
    tol = compare_change(base, base, sigmas=3).rows[0]["tolerance"]
    assert abs(tol - 3 * (2 * 0.02 ** 2) ** 0.5) < 1e-12


def test_a_lossy_change_that_raises_acceptance_is_never_improved() -> None:
    """What the issue found: keeping the target's second choice raised acceptance 3.19 -> 3.51
    and was called IMPROVED. More divergent outputs than the baseline is a REGRESSION, exit 11."""
    from validate.metrics import compare_change

    base = _figures(3.19, [0.86, 0.74, 0.55], divergences=0)
    lossy = compare_change(base, _figures(3.51, [0.95, 0.85, 0.70], divergences=86), sigmas=1)
    assert lossy.word == "REGRESSION", lossy
    assert any("86 of 100 outputs leave the reference" in r for r in lossy.reasons), lossy.reasons
    # one more divergent output than the baseline is already not OK: same machine, same prompts
    one = compare_change(base, _figures(3.19, [0.86, 0.74, 0.55], divergences=1), sigmas=1)
    assert one.word == "REGRESSION", one
    # as many as the baseline had (its rate, scaled to the candidate's prompts): OK
    same = compare_change(_figures(3.19, [0.86, 0.74, 0.55], divergences=4, prompts=200),
                          _figures(3.19, [0.86, 0.74, 0.55], divergences=2), sigmas=1)
    assert same.word == "OK", same


RULE = metrics.NearTieRule(noise_margin=8.0, gap_margin=2.0, known_gap=0.039, alpha=0.001,
                           uncalibrated_share=0.2)
DISPERSED = metrics.NearTieRule(**profiles.near_tie_rule())  # the profile's, overdispersion 3


def _golden_data(matches: list[int], gaps: list[float], noise_max: float, n: int = 100) -> dict:
    return {"conditions": {"num_prompts": n}, "exact_match": matches, "divergence_gaps": gaps,
            "logprob_noise": [{"positions": 3200, "max": noise_max}] * len(matches)}


def test_the_near_tie_bound_is_measured_not_fixed() -> None:
    """Noise x 8 or clean gaps x 2, whichever is larger, capped by the profile; 0 where the
    engines agreed to the last bit and the golden never diverged."""
    quiet = metrics.near_tie_bound(RULE, 0.5, {"max": 0.0}, _golden_data([100] * 3, [], 0.0))
    assert quiet.value == 0.0
    amx = metrics.near_tie_bound(RULE, 0.5, {"max": 0.0}, _golden_data([95, 100], [0.039], 0.0079))
    assert amx.value == pytest.approx(max(8 * 0.0079, 2 * 0.039))
    uncal = metrics.near_tie_bound(RULE, 0.5, {"max": 0.0}, None)
    assert uncal.value == pytest.approx(2 * 0.039) and "no golden" in uncal.source
    noisy = metrics.near_tie_bound(RULE, 0.05, {"max": 0.3}, None)
    assert noisy.value == 0.05, "the profile's cap lowers it, never the other way"
    # a change that perturbs the target raises its run's noise: with a golden it is not used
    perturbed = metrics.near_tie_bound(RULE, 0.5, {"max": 0.15}, _golden_data([100] * 3, [], 0.0))
    assert perturbed.value == 0.0 and "0.15" in perturbed.source, perturbed


def _second_choice_outputs(n: int, diverging: int, gap: float) -> tuple[list, list]:
    ref = [_out([1, 2], [[(1, -0.1)], [(2, -0.6), (9, -0.6 - gap)]]) for _ in range(n)]
    # the engines agree on every shared token's logprob (-0.1 for token 1): no numerical noise
    spec = ([_out([1, 9], [[(1, -0.1)], [(9, -0.6)]]) for _ in range(diverging)]
            + [_out([1, 2], [[(1, -0.1)], [(2, -0.6)]]) for _ in range(n - diverging)])
    return ref, spec


def test_many_small_divergences_fail_the_count_test() -> None:
    """86 of 100 outputs diverging, each by a gap under the bound: every one a near-tie, and the
    run still FAILs, naming the count."""
    ref, spec = _second_choice_outputs(100, 86, gap=0.02)
    golden = _golden_data([100, 100, 100], [], 0.0)
    cmp = metrics.judge_outputs(ref, spec, rule=RULE, cap=0.5, golden=None)
    assert len(cmp.near_ties) == 86 and not cmp.hard
    v = metrics.verdict(cmp, _acc(1000, [950, 850, 700]), min_mean_acceptance_length=2.0)
    assert not v.passed and any(r.startswith("too many divergences") for r in v.reasons), v.reasons
    # against a golden whose three runs never diverged: 4 of 100 pass, 5 do not
    for k, passed in ((4, True), (5, False)):
        ref, spec = _second_choice_outputs(100, k, gap=0.02)
        cmp = metrics.judge_outputs(ref, spec, rule=RULE, cap=0.5, golden=golden, golden_name="g")
        assert cmp.count is not None and cmp.count.passed is passed, cmp.count
        assert cmp.hard, "bound 0 on a bit-exact machine: each of them is hard too"


def test_the_count_test_allows_what_the_golden_saw() -> None:
    """A machine whose golden runs flipped 5 of 300 near-ties may flip a few; the AVX2 machine's
    11 of 100 pass uncalibrated (20%)."""
    t = metrics.count_test(6, 100, RULE, (5, 300), "g")
    assert t.passed and t.allowed == 9 and 0.001 < t.p_value < 1, t
    assert not metrics.count_test(10, 100, RULE, (5, 300), "g").passed
    assert metrics.count_test(11, 100, RULE, None, "").passed
    assert not metrics.count_test(21, 100, RULE, None, "").passed
    assert metrics.divergence_tail(0, 100, 0, 300) == pytest.approx(1.0)


def test_the_count_test_allows_the_spread_between_runs_that_was_measured() -> None:
    """The AVX2 machine at TP=8: calibration runs with 9 divergent outputs each (27 of 300),
    then sound rehearsals with 21, 11 and 11. With one shared rate 21 is the edge (allowed 21);
    the measured overdispersion leaves room, and a kept second choice (73 of 100) still FAILs."""
    assert metrics.count_test(21, 100, RULE, (27, 300), "g").allowed == 21
    t = metrics.count_test(21, 100, DISPERSED, (27, 300), "g")
    assert t.passed and t.allowed == 25 and "overdispersion 3" in t.describe(), t
    assert not metrics.count_test(73, 100, DISPERSED, (27, 300), "g").passed
    assert not metrics.count_test(8, 100, DISPERSED, (0, 300), "g").passed


def test_counters_that_overstate_acceptance_fail() -> None:
    """Measured on the H200 (docs/evidence/h200-sensitivity): the release's counters leave 104
    tokens computed past the ends of 100 outputs of 32 tokens (at most 3 each); a scheduler that
    counts one rejected draft too few left the outputs identical and its counters 514: FAIL."""
    sound = metrics.CounterCheck(100, 3200, 977, 2227, 3)
    assert sound.residual == 104 and sound.passed
    bad = metrics.CounterCheck(100, 3200, 977, 2637, 3)
    v = metrics.verdict(_clean(100), _acc(977, [900, 900, 837]), min_mean_acceptance_length=2.0,
                        counters=bad)
    assert not bad.passed and not v.passed, v.reasons
    assert any(r.startswith("acceptance counters overstate") for r in v.reasons), v.reasons
    assert not any("acceptance is too low" in r for r in v.reasons), "overstated, not too low"
