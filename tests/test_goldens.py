"""Goldens: made from run records, selected only when everything they depend on matches."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from validate import goldens, metrics, profiles

PROFILE = profiles.get("tiny").to_dict()
ENV = {"device_class": "cpu-avx2", "vllm": "0.32.0", "torch": "2.13.0+cpu", "cpu": "EPYC"}
MODELS = {"target": "/p/target", "draft": "/p/head", "target_revision": "generated:abc",
          "draft_revision": "generated:abc", "target_weights": "1111", "draft_weights": "2222"}


def _record(per_pos: list[int], drafts: int = 900, hard: int = 0) -> dict[str, Any]:
    acc = metrics.Acceptance(drafts, drafts * 3, sum(per_pos), per_pos)
    out = metrics.Output("a b", [1, 2], [[(1, -0.1)], [(2, -0.2), (3, -0.4)]])
    divs = [{"gap": 0.2}] + [{"gap": 4.0}] * hard
    return {"name": "tiny-tp8", "status": "passed", "profile": PROFILE, "environment": ENV,
            "models": MODELS, "acceptance": acc.to_dict(),
            "comparison": {"matches": 99, "hard": hard, "divergences": divs,
                           "logprob_noise": {"max": 0.05}},
            "reference_outputs": [out.to_dict()] * PROFILE["num_prompts"]}


def _select(path: Path, **changes: Any) -> tuple[dict[str, Any] | None, str]:
    args: dict[str, Any] = {"profile": PROFILE, "device_class": "cpu-avx2",
                            "versions": {"vllm": "0.32.0", "torch": "2.13.0+cpu"}, "models": MODELS}
    args.update(changes)
    return goldens.select(path, **args)


@pytest.fixture
def golden_file(tmp_path: Path) -> Path:
    g = goldens.make([_record([800, 650, 550]), _record([810, 640, 560])], sigmas=3.0)
    path = tmp_path / goldens.filename("tiny", "cpu-avx2", 8)
    goldens.write(path, g)
    return path


def test_golden_from_runs_keeps_figures_and_reference(golden_file: Path) -> None:
    g = goldens.load(golden_file)
    assert g["runs"] == 2 and g["device_class"] == "cpu-avx2" and g["tensor_parallel_size"] == 8
    assert g["versions"]["vllm"] == "0.32.0"
    assert g["acceptance"]["mean_acceptance_length"]["mean"] == pytest.approx(1 + 2005 / 900)
    assert g["divergence_gaps"] == [0.2, 0.2]
    assert metrics.Output.from_dict(g["reference"][0]).token_ids == [1, 2]


def test_golden_applies_when_everything_matches(golden_file: Path) -> None:
    g, why = _select(golden_file)
    assert g is not None and why.startswith(f"golden {golden_file.name}: 2 runs on cpu-avx2")


@pytest.mark.parametrize(("change", "named"), [
    ({"device_class": "cpu-amx"}, "device_class"),
    ({"versions": {"vllm": "0.33.0", "torch": "2.13.0+cpu"}}, "versions.vllm"),
    ({"versions": {"vllm": "0.32.0", "torch": "2.14.0"}}, "versions.torch"),
    ({"models": {**MODELS, "draft_weights": "9999"}}, "models.draft_weights"),
    ({"profile": {**PROFILE, "num_prompts": 10}}, "num_prompts"),
    ({"profile": {**PROFILE, "tensor_parallel_size": 1}}, "tensor_parallel_size"),
])
def test_golden_from_elsewhere_is_never_applied_silently(golden_file: Path, change: dict[str, Any],
                                                         named: str) -> None:
    g, why = _select(golden_file, **change)
    assert g is None and f"does not apply: {named} is" in why and "nox -s calibrate" in why


def test_missing_golden_says_how_to_make_one(tmp_path: Path) -> None:
    g, why = _select(tmp_path / "absent.json")
    assert g is None and "no golden for profile tiny on cpu-avx2 at TP=8" in why
    assert "nox -s calibrate -- --profile tiny --tp 8" in why


@pytest.mark.parametrize("text", ["{not json", '{"schema": 2}', '{"schema": 99}', "[]"])
def test_corrupt_golden_is_refused_naming_file_and_command(golden_file: Path, text: str) -> None:
    golden_file.write_text(text)
    with pytest.raises(goldens.BadGolden) as exc:
        _select(golden_file)
    assert str(golden_file) in str(exc.value)
    assert "nox -s calibrate -- --profile tiny --tp 8" in str(exc.value)


def test_runs_with_hard_divergences_make_no_golden() -> None:
    with pytest.raises(ValueError, match="hard divergences"):
        goldens.make([_record([800, 650, 550]), _record([800, 650, 550], hard=1)], sigmas=3.0)


def test_runs_on_different_models_make_no_golden() -> None:
    other = _record([800, 650, 550])
    other["models"] = {**MODELS, "target_weights": "ffff"}
    with pytest.raises(ValueError, match="models"):
        goldens.make([_record([800, 650, 550]), other], sigmas=3.0)


def test_crashed_run_makes_no_golden() -> None:
    broken = copy.deepcopy(_record([800, 650, 550]))
    broken.update(status="error", acceptance=None, error={"message": "EngineCore died"})
    with pytest.raises(ValueError, match="EngineCore died"):
        goldens.make([broken], sigmas=3.0)


# The goldens docs/verdict.md lists: a test that loads "every golden" must fail when they are gone.
SHIPPED = ("tiny-cpu-amx-tp1", "tiny-cpu-amx-tp8", "tiny-cpu-avx512bf16-tp1",
           "tiny-cpu-avx512bf16-tp8", "tiny-cuda-h200-tp1")


def test_committed_goldens_are_readable_and_reviewable() -> None:
    """Every golden shipped with the kit loads (a broken one would refuse every run), is named
    after what it is of, and stays small enough to review: summary first, a line per output."""
    found = {p.stem: p for p in goldens.DIR.glob("*.json")}
    assert set(SHIPPED) <= set(found), f"shipped goldens missing: {set(SHIPPED) - set(found)}"
    for path in found.values():
        g = goldens.load(path)
        assert path.name == goldens.filename(g["profile"], g["device_class"],
                                             g["tensor_parallel_size"])
        text = path.read_text()
        assert len(text.encode()) <= goldens.MAX_BYTES, f"{path.name}: {len(text)} bytes"
        assert text.splitlines()[2].startswith(' "summary"'), "the summary comes first"
        assert len(text.splitlines()) < 200 + len(g["reference"]), "one line per reference output"
        assert text == goldens.dumps(g), "written by goldens.write (calibrate's form)"


@pytest.mark.parametrize(("name", "cls"), [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA L40S", "l40s"), ("Tesla V100-SXM2-16GB", "v100")])
def test_gpu_class_is_the_model_not_a_memory_word(name: str, cls: str) -> None:
    """torch names an H100 'NVIDIA H100 80GB HBM3': its goldens must be keyed h100, not hbm3."""
    from validate.device_class import of_gpu_name

    assert of_gpu_name(name) == cls, f"{name!r} keyed as {of_gpu_name(name)!r}, expected {cls!r}"
