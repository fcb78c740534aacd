"""The whole validation for real: vLLM's CPU build, the tiny pair, TP=8 (minutes each)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import rehearse

from validate import cli

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")


def test_rehearsal_at_tp8_passes_with_the_distilled_head(pair, host_rehearsal_tp8) -> None:
    code, rec = host_rehearsal_tp8
    assert code == cli.EXIT_PASS, rec.get("verdict") or rec.get("error")
    assert rec["verdict"]["result"] == "PASS"
    assert rec["profile"]["tensor_parallel_size"] == 8
    assert rec["comparison"]["ratio"] >= 0.95
    assert rec["acceptance"]["mean_acceptance_length"] >= 2.0
    assert set(rec["phases"]) >= {"reference_engine_start", "reference_generation",
                                  "speculative_engine_start", "speculative_generation"}
    assert rec["environment"]["vllm"] and rec["environment"]["torch"]
    assert rec["models"]["target_revision"] == f"generated:{pair.manifest['fingerprint']}"
    run = Path(rec["invocation"]["argv"].split("--run-dir ")[1].split()[0])
    assert (run / "junit.xml").is_file() and (run / "REPRODUCE.md").is_file()
    assert (run / "summary.md").read_text().startswith("# PASS")


def test_random_head_matches_but_fails_on_acceptance(pair, tmp_path: Path) -> None:
    """The seed's exact-match check alone would pass this head; the kit's verdict must not."""
    code, rec, _ = rehearse(tmp_path / "run", "--head", "random")
    assert rec["comparison"]["ratio"] >= 0.95, "greedy speculative decoding stays lossless"
    assert code == cli.EXIT_FAIL, rec.get("verdict") or rec.get("error")
    assert rec["verdict"]["result"] == "FAIL"
    assert any("acceptance is too low" in r for r in rec["verdict"]["reasons"]), rec["verdict"]
