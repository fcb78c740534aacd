"""Every documented exit code, produced by its cause (validate/contract.py owns the table).

Nothing is renamed or faked: each code comes from a real run of ``python -m validate`` doing what
a user's run would do, and the record says the same as the exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from validate import cli, contract
from validate.contract import Exit

ROOT = Path(__file__).resolve().parent.parent


def _kit(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "validate", *args], capture_output=True, text=True,
                          timeout=900, check=False, **kw)


def _record(run: Path) -> dict:
    return json.loads((run / "record.json").read_text())


def test_readme_and_help_list_the_contracts_table() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", readme, re.M))
    assert {int(k) for k in rows} == {int(c) for c in Exit}, "README's exit-code table"
    for code in Exit:
        assert rows[str(int(code))] == code.meaning, code
    text = cli.build_parser().format_help()
    for code in Exit:
        assert re.search(rf"^\s+{int(code)}\s+{re.escape(code.meaning)}", text, re.M), code


def test_bad_input_2_unknown_profile() -> None:
    r = _kit("rehearse", "--profile", "maverick")
    assert r.returncode == Exit.BAD_INPUT, r.stderr


def test_bad_input_2_reused_run_folder(models, tmp_path: Path) -> None:
    """A run folder holding an earlier record is refused: an old PASS is never read as new."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "record.json").write_text(json.dumps({"status": "passed"}))
    r = _kit("rehearse", "--target", str(models.target), "--draft", str(models.head),
             "--run-dir", str(run))
    assert r.returncode == Exit.BAD_INPUT and "is not empty" in r.stderr, r.stderr
    assert json.loads((run / "record.json").read_text()) == {"status": "passed"}, "left as it was"


def test_environment_3_vllm_for_another_device(models, tmp_path: Path) -> None:
    """The CUDA profile on this CPU-only vLLM: the engine side says so before any engine."""
    pytest.importorskip("vllm", reason="needs the CPU engine environment (nox -s tests)")
    run = tmp_path / "run"
    r = _kit("rehearse", "--profile", "tiny-cuda", "--target", str(models.target), "--draft",
             str(models.head), "--run-dir", str(run))
    assert r.returncode == Exit.ENVIRONMENT, r.stderr[-2000:]
    rec = _record(run)
    assert rec["status"] == "error" and rec["error"]["kind"] == "environment", rec["error"]
    assert "nox -s validate_tp8" in rec["error"]["message"]
    assert '<error type="' in (run / "junit.xml").read_text()


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(p)
    return alive


def _start_and_wait_for(run: Path, phase: str) -> tuple[subprocess.Popen, set[int]]:
    """A real host rehearsal (TP=2: the script, its engine core and two workers), until ``phase``
    has begun; returns it and its processes then."""
    proc = subprocess.Popen([sys.executable, "-m", "validate", "rehearse", "--tp", "2",
                             "--num-prompts", "10", "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if phase in _record(run).get("phases", {}):
                break
        except (OSError, ValueError):
            pass
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    time.sleep(5)  # well inside the phase: engine processes started
    return proc, _descendants(proc.pid)


@pytest.mark.e2e
def test_broken_4_engine_killed_is_an_error_in_junit(pair, tmp_path: Path) -> None:
    """The script killed from outside (as the OOM killer does): no verdict, a record that says
    where it stopped, junit with an error, exit 4, no process left behind."""
    run = tmp_path / "run"
    proc, procs = _start_and_wait_for(run, "reference_engine_start")
    script = [p for p in procs if b"validate.e2e" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert script, "the end-to-end script runs in its own process"
    os.kill(script[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == Exit.BROKEN, out[-3000:]
    rec = _record(run)
    assert rec["status"] == "error" and rec["error"]["kind"] == "broken", rec["error"]
    assert "killed by signal 9" in rec["error"]["message"], rec["error"]
    assert rec["error"]["where"].startswith("reference_engine"), rec["error"]
    assert '<error type="' in (run / "junit.xml").read_text()
    assert "broken" in (run / "summary.md").read_text()
    assert not _alive(procs), f"processes left behind: {_alive(procs)}"


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.full)],
                         ids=["SIGINT", "SIGTERM"])
def test_interrupted_130_the_engine_records_it_and_stops(pair, tmp_path: Path, sig: int) -> None:
    """Ctrl-C (SIGINT) or a CI cancel (SIGTERM) sent to the host: the engine side records the
    interruption, its workers stop, the host exits 130. (The CI tier sends SIGINT here and
    SIGTERM to a container run: test_containers.)"""
    run = tmp_path / "run"
    proc, procs = _start_and_wait_for(run, "reference_engine_start")
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == Exit.INTERRUPTED, out[-3000:]
    rec = _record(run)
    assert rec["status"] == "interrupted" and rec["error"]["kind"] == "interrupted", rec["error"]
    assert rec["error"]["where"].startswith("reference_engine"), rec["error"]
    assert rec["error"]["traceback"], ("the engine side did not record it: the host ended the "
                                       f"run after its 60 s ({rec['error']['message']})")
    assert '<error type="' in (run / "junit.xml").read_text()
    assert not _alive(procs), f"processes left behind: {_alive(procs)}"


def test_preflight_9_and_contract_kinds_map_to_codes() -> None:
    """Preflight's 9 is produced in test_preflight (a real `validate` on this GPU-less host);
    PASS 0 and FAIL 1 by the rehearsals in test_rehearsal. Here: each error kind a record can
    carry maps to its documented code, and a record of another schema is refused."""
    for kind, code in contract.KIND_EXIT.items():
        rec = {"status": "interrupted" if kind == "interrupted" else "error", "error": {"kind": kind}}
        assert contract.exit_code(rec) == code
    assert contract.exit_code({"status": "passed"}) == Exit.PASS
    assert contract.exit_code({"status": "failed"}) == Exit.FAIL
    with pytest.raises(contract.BadRecord, match="schema_version 1"):
        contract.check_record({"schema_version": 1})


# ---- endings that got the wrong code or none (issue: lossless means lossless, item 4)


def test_bad_input_2_a_golden_of_another_tp_is_refused_before_anything_runs(models,
                                                                            tmp_path: Path) -> None:
    """`--golden FILE` of another TP (or profile, or machine class) fell back to `uncalibrated`
    after both engines ran; now it is refused before the run folder exists."""
    golden = next((ROOT / "validate" / "data" / "goldens").glob("tiny-*-tp8.json"))
    run = tmp_path / "run"
    t = time.monotonic()
    r = _kit("rehearse", "--tp", "1", "--golden", str(golden), "--target", str(models.target),
             "--draft", str(models.head), "--run-dir", str(run))
    assert r.returncode == Exit.BAD_INPUT, r.stderr[-2000:]
    assert "does not apply: its tensor_parallel_size is 8, this one's is 1" in r.stderr, r.stderr
    assert not run.exists() and time.monotonic() - t < 60, "refused before any engine"


def test_bad_input_2_a_missing_golden_is_refused(models, tmp_path: Path) -> None:
    r = _kit("rehearse", "--golden", str(tmp_path / "missing.json"), "--target", str(models.target),
             "--draft", str(models.head), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == Exit.BAD_INPUT, r.stderr[-2000:]
    assert "missing.json: no such file" in r.stderr and not (tmp_path / "run").exists(), r.stderr


def test_bad_input_2_compare_against_a_golden_of_another_tp(tmp_path: Path) -> None:
    """`compare --baseline-golden` with another TP's golden and a harmless patch said
    REGRESSION, exit 11, after a candidate run; now exit 2 naming the mismatch, nothing run."""
    golden = next((ROOT / "validate" / "data" / "goldens").glob("tiny-*-tp8.json"))
    patch = ROOT / "validate" / "data" / "breakages" / "comment-only.patch"
    run = tmp_path / "compare"
    r = _kit("compare", "--tp", "2", "--vllm-patch", str(patch), "--baseline-golden", str(golden),
             "--run-dir", str(run))
    assert r.returncode == Exit.BAD_INPUT, r.stderr[-2000:]
    assert "does not apply: its tensor_parallel_size is 8, this one's is 2" in r.stderr
    assert not (run / "candidate").exists(), "no candidate run"


def _fill(folder: Path) -> None:
    """Write into ``folder`` until its file system has no byte left."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (64 << 10, 4 << 10, 1):  # down to the last byte
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs (the tests run as root, like CI), unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.e2e
def test_broken_4_a_full_disk_under_the_run_folder(pair, small_disk: Path) -> None:
    """The disk fills while an engine starts: the run ends `broken` (exit 4) with a complete
    record naming the phase, not an ENOSPC traceback with exit 1 and `status: running`."""
    run = small_disk / "run"
    proc = subprocess.Popen([sys.executable, "-m", "validate", "rehearse", "--tp", "1",
                             "--num-prompts", "5", "--golden", "none", "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while "reference_engine_start" not in _phases(run):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    _fill(small_disk)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == Exit.BROKEN, out[-3000:]
    assert "Traceback" not in out.split("[e2e]")[0], out[-3000:]
    rec = _record(run)
    assert rec["status"] == "error" and rec["error"]["kind"] == "broken", rec["error"]
    assert rec["error"]["type"] == "DiskFull" and "no space left" in rec["error"]["message"]
    # the engine had started; the record's write at the end of that phase found no space
    assert rec["error"]["where"] in ("reference_engine_start", "after reference_engine_start")


def _phases(run: Path) -> dict:
    try:
        return _record(run).get("phases", {})
    except (OSError, ValueError):
        return {}


@pytest.mark.e2e
def test_sigkill_of_the_kit_leaves_nothing_running_and_the_next_run_says_so(
        pair, models, tmp_path: Path) -> None:
    """SIGKILL of the kit left its end-to-end child (its own session) running on, starting
    engines, and the record at `running`. Now the child dies with the kit, recording why, and the
    next run's record names the run that was cut off. That next run is also the broken ending
    (exit 4): stand-in shards that pass every config check and that vLLM cannot load."""
    run = tmp_path / "run"
    proc, procs = _start_and_wait_for(run, "reference_engine_start")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 90  # the script's grace (30 s) and vLLM's own shutdown
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _alive(procs), f"processes left behind: {_alive(procs)}"
    rec = _record(run)
    assert rec["status"] == "interrupted" and "is gone" in rec["error"]["message"], rec
    assert "did not stop within" not in rec["error"]["message"], (
        "the script's own code did not record it: its watcher ended it after the grace period")
    nxt = tmp_path / "next"
    r = _kit("rehearse", "--tp", "1", "--golden", "none", "--target", str(models.target),
             "--draft", str(models.head), "--run-dir", str(nxt))
    # stand-in shards pass every config check and vLLM cannot load them: broken, exit 4
    assert r.returncode == Exit.BROKEN, r.stderr[-2000:]
    rec = _record(nxt)
    assert rec["status"] == "error" and rec["error"]["kind"] == "broken", rec["error"]
    assert rec["error"]["where"] == "reference_engine_start", rec["error"]
    assert rec["phases"]["reference_engine_start"]["status"] == "failed"
    assert '<error type="' in (nxt / "junit.xml").read_text()
    cut = rec.get("previous_runs_cut_off") or []
    assert str(run) in [c["run_dir"] for c in cut], cut
    assert "a previous run was cut off" in r.stderr
