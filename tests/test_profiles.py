from __future__ import annotations

import pytest

from validate import profiles


def test_the_three_profiles_carry_the_seed_settings() -> None:
    mav = profiles.get("maverick-tp8")
    assert (mav.target, mav.draft) == ("meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8",
                                       "ronaldbxu/EAGLE-Llama-4-Maverick-17B-128E-Instruct")
    assert (mav.tensor_parallel_size, mav.max_model_len, mav.num_speculative_tokens) == (8, 2048, 3)
    assert (mav.num_prompts, mav.max_tokens) == (100, 10)
    scout = profiles.get("scout-tp4")
    assert scout.tensor_parallel_size == 4
    assert scout.draft == "morgendave/EAGLE-Llama-4-Scout-17B-16E-Instruct"
    tiny = profiles.get("tiny")
    assert tiny.generated and tiny.tensor_parallel_size == 8 and tiny.device == "cpu"
    for p in map(profiles.get, profiles.names()):
        assert p.min_mean_acceptance_length > 1.0, f"{p.name}: a head accepting nothing would pass"
        assert 0 < p.near_tie_cap < 1.0 and p.top_logprobs >= 2, p.name
    assert profiles.calibration_sigmas() >= 2
    assert 0 < profiles.comparison_sigmas() <= profiles.calibration_sigmas()


def test_unknown_profile_lists_the_known_ones() -> None:
    with pytest.raises(profiles.UnknownProfile) as err:
        profiles.get("maverick")
    assert "tiny" in str(err.value) and "maverick-tp8" in str(err.value)


def test_overrides_ignore_none() -> None:
    p = profiles.get("tiny").with_overrides(tensor_parallel_size=1, max_tokens=None)
    assert p.tensor_parallel_size == 1 and p.max_tokens == profiles.get("tiny").max_tokens
