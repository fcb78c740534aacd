from __future__ import annotations

import os

import pytest
from helpers import rehearse


@pytest.fixture(scope="session")
def pair():
    """The generated tiny pair (built once per machine and generator version, then cached)."""
    from validate import synth

    return synth.ensure()


@pytest.fixture(scope="session")
def host_rehearsal_tp8(pair, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    """One CPU rehearsal at TP=8 on the host, shared by the tests that need its record."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    code, rec, _ = rehearse(tmp_path_factory.mktemp("host-rehearsal") / "run")
    return code, rec


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
