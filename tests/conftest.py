from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT, TIER, WALKTHROUGH_RUN, runnable_blocks

FIXTURE_MODELS = Path(__file__).parent / "data" / "fixture-models"


@dataclass
class Models:
    """Model folders as the host side sees them: real configs, shards of random bytes."""

    target: Path
    head: Path


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """The tiny pair's configs with stand-in shards (tests/data/README.md): for host-side tests,
    which check configs and move files, without torch or the generated pair."""
    root = tmp_path_factory.mktemp("fixture-models")
    rng = random.Random(0)
    for role, size in (("target", 27 << 20), ("head", 6 << 20)):
        shutil.copytree(FIXTURE_MODELS / role, root / role)
        (root / role / "model.safetensors").write_bytes(rng.randbytes(size))
    return Models(root / "target", root / "head")


@pytest.fixture(scope="session")
def pair():
    """The generated tiny pair (built once per machine and generator version, then cached)."""
    from validate import synth

    return synth.ensure()


@pytest.fixture(scope="session")
def host_rehearsal_tp8(pair) -> tuple[int, dict, str]:
    """The walkthrough's runnable block (docs/walkthrough.md: `nox -s rehearse_tp8 -- --run-dir
    runs/walkthrough`), run in the repository as a newcomer runs it: the one CPU rehearsal at TP=8
    on the host, shared by every test that reads its record (the docs test included).
    (exit code of the block, record, output)."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    [block] = [b for _, b in runnable_blocks() if f"--run-dir {WALKTHROUGH_RUN}" in b]
    run = ROOT / WALKTHROUGH_RUN
    shutil.rmtree(run, ignore_errors=True)  # this fixture's own output of an earlier suite run
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, capture_output=True,
                       text=True, timeout=3600, check=False)
    assert (run / "record.json").is_file(), (r.stdout + r.stderr)[-4000:]
    return r.returncode, json.loads((run / "record.json").read_text()), r.stdout + r.stderr


@pytest.fixture(scope="session")
def sensitivity_suite(pair, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """`nox -s sensitivity` as a user runs it (the release, then the breakages of the tier, TP=2),
    once per test run: its golden also serves `compare --baseline-golden`. The tier is
    ``KIT_TEST_TIER`` (`nox -s tests`: ci, the catalogue's CI subset; `nox -s tests_full`: full).
    (exit code, output, the suite's folder)."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    run = tmp_path_factory.mktemp("sensitivity") / "suite"
    r = subprocess.run(["nox", "-s", "sensitivity", "--", "--run-dir", str(run), "--tier", TIER],
                       cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False)
    assert (run / "sensitivity.json").is_file(), (r.stdout + r.stderr)[-4000:]
    return r.returncode, r.stdout + r.stderr, run


# Wall time per test file, printed at the end of every run: CI's budget (30 minutes on 2 cores) is
# kept by knowing which file spends it. pytest's --durations lists single tests only.
_FILE_SECONDS: dict[str, float] = {}
# In CI (`.ci/run` sets KIT_FAIL_ON_SKIP=1) a skipped test is a failure: a missing vLLM or Docker
# engine must turn CI red, not into a green run that tested nothing.
_SKIPPED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    if report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("KIT_FAIL_ON_SKIP") == "1" and _SKIPPED and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _FILE_SECONDS:
        return
    terminalreporter.section("seconds per test file (setup + call + teardown)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  total")
    if _SKIPPED and os.environ.get("KIT_FAIL_ON_SKIP") == "1":
        terminalreporter.section("skipped tests fail this run (KIT_FAIL_ON_SKIP=1)", red=True)
        for nodeid in _SKIPPED:
            terminalreporter.write_line(nodeid)
