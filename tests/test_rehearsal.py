"""The whole validation for real: vLLM's CPU build, the tiny pair, TP=8 (minutes each)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from validate import cli

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")


def _rehearse(run: Path, *extra: str) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "validate", "rehearse", "--tp", "8",
                        "--run-dir", str(run), *extra], capture_output=True, text=True,
                       timeout=1800, check=False)
    assert (run / "record.json").is_file(), r.stderr[-4000:]
    return r.returncode, json.loads((run / "record.json").read_text())


def test_rehearsal_at_tp8_passes_with_the_distilled_head(pair, tmp_path: Path) -> None:
    code, rec = _rehearse(tmp_path / "run")
    assert code == cli.EXIT_PASS, rec.get("verdict") or rec.get("error")
    assert rec["verdict"]["result"] == "PASS"
    assert rec["profile"]["tensor_parallel_size"] == 8
    assert rec["comparison"]["ratio"] >= 0.95
    assert rec["acceptance"]["mean_acceptance_length"] >= 2.0
    assert set(rec["phases"]) >= {"reference_engine_start", "reference_generation",
                                  "speculative_engine_start", "speculative_generation"}
    assert rec["environment"]["vllm"] and rec["environment"]["torch"]
    assert rec["models"]["target_revision"] == f"generated:{pair.manifest['fingerprint']}"
    assert (tmp_path / "run" / "junit.xml").is_file()
    assert (tmp_path / "run" / "summary.md").read_text().startswith("# PASS")


def test_random_head_matches_but_fails_on_acceptance(pair, tmp_path: Path) -> None:
    """The seed's exact-match check alone would pass this head; the kit's verdict must not."""
    code, rec = _rehearse(tmp_path / "run", "--head", "random")
    assert rec["comparison"]["ratio"] >= 0.95, "greedy speculative decoding stays lossless"
    assert code == cli.EXIT_FAIL, rec.get("verdict") or rec.get("error")
    assert rec["verdict"]["result"] == "FAIL"
    assert any("acceptance is too low" in r for r in rec["verdict"]["reasons"]), rec["verdict"]
