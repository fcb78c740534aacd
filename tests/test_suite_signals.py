"""The kit's own test suite, ended by a signal, stops what its fixtures started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT

# A session fixture that starts a process in a session of its own (as the suite-wide runs and
# the Docker engines are started) and stops it in its teardown; the test then waits.
PROBE = '''
import os, subprocess, sys, time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()
    Path(os.environ["PROBE_TORN_DOWN"]).write_text(str(proc.pid))


def test_waits(child):
    Path(os.environ["PROBE_READY"]).write_text(str(child.pid))
    time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_suite_runs_its_teardown(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    ready, torn_down = tmp_path / "ready", tmp_path / "torn-down"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "PROBE_READY": str(ready),
           "PROBE_TORN_DOWN": str(torn_down)}
    # the suite's conftest as a plugin, on a test file of its own
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                             "no:cacheprovider", "-q", "test_probe.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, f"the probe suite ended early:\n{proc.communicate()[0]}"
            assert time.monotonic() < deadline, "the probe suite's test did not start in 120 s"
            time.sleep(0.2)
        child = int(ready.read_text())
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    left = _alive(child)
    if left:
        os.kill(child, signal.SIGKILL)
    assert torn_down.exists() and not left, (
        f"SIGTERM ended pytest (exit {proc.returncode}) without its fixtures' teardown: the "
        f"process the session fixture started is {'still running' if left else 'gone'}; "
        f"tests/conftest.py's pytest_configure should turn SIGTERM into KeyboardInterrupt.\n"
        f"{output}")
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, (
        f"pytest ended by SIGTERM exited {proc.returncode}, not {int(pytest.ExitCode.INTERRUPTED)} "
        f"(interrupted):\n{output}")
