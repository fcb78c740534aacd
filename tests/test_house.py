"""The house rules the suite itself keeps: host code stays free of the engine, CI cannot go green by
skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

HOST_MODULES = ("validate.cli", "validate.commands", "validate.contract", "validate.hub",
                "validate.containers", "validate.preflight", "validate.record", "validate.goldens",
                "validate.metrics", "validate.profiles", "validate.compat", "validate.prompts",
                "validate.weights_lock", "validate.loopback_hub", "validate.vllm_change",
                "validate.compare", "validate.sensitivity", "validate.image_requirements")


def test_host_side_imports_leave_torch_and_vllm_out() -> None:
    """`nox -s validate_tp8` and `fetch` install no vLLM on the host: importing the host side must
    not need torch or vLLM (DESIGN.md: the engine side runs in the image)."""
    code = ("import importlib, sys\n"
            f"for m in {HOST_MODULES!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"host modules imported engine packages: {out.stdout}"


def _probe(tmp_path: Path, fail_on_skip: str | None) -> int:
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n\ndef test_needs_an_engine():\n    pytest.skip('no engine here')\n")
    env = {k: v for k, v in os.environ.items() if k != "KIT_FAIL_ON_SKIP"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if fail_on_skip is not None:
        env["KIT_FAIL_ON_SKIP"] = fail_on_skip
    # The suite's conftest as a plugin, over a folder holding one test that skips.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path).returncode


def test_a_skip_fails_the_run_in_ci(tmp_path: Path) -> None:
    assert _probe(tmp_path, "1") == 1, "with KIT_FAIL_ON_SKIP=1 (as .ci/run sets) a skip must fail"
    assert _probe(tmp_path, None) == 0, "outside CI a skip (no vLLM installed) stays a skip"
    assert "KIT_FAIL_ON_SKIP=1" in (TESTS.parent / ".ci" / "run").read_text()
