from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from validate import contract
from validate.record import RunRecord


def test_passed_run_writes_three_files(tmp_path: Path) -> None:
    rec = RunRecord.create(tmp_path, profile={"name": "tiny"}, name="tiny-tp8")
    with rec.phase("reference_engine_start"):
        pass
    rec.finish(passed=True, reasons=["outputs: 100/100 identical", "acceptance fine"],
               calibration="calibrated")
    data = json.loads((tmp_path / "record.json").read_text())
    assert data["status"] == "passed" and data["verdict"]["result"] == "PASS"
    assert data["phases"]["reference_engine_start"]["status"] == "ok"
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    assert data["verdict"]["calibration"] == "calibrated"
    assert (tmp_path / "summary.md").read_text().startswith("# PASS (calibrated): tiny-tp8")


def test_failure_halfway_leaves_a_complete_record(tmp_path: Path) -> None:
    rec = RunRecord.create(tmp_path, profile={"name": "tiny"}, name="tiny-tp8")
    with rec.phase("reference_engine_start"):
        pass
    with pytest.raises(RuntimeError), rec.phase("speculative_engine_start"):
        # what a dead worker looks like from the test's side
        raise RuntimeError("EngineCore encountered an issue")
    # before the run is closed, record.json already says where it stopped
    mid = json.loads((tmp_path / "record.json").read_text())
    assert mid["phases"]["speculative_engine_start"]["status"] == "failed"
    rec.fail(RuntimeError("EngineCore encountered an issue"), where="speculative_engine_start")
    data = json.loads((tmp_path / "record.json").read_text())
    assert data["status"] == "error" and data["finished_at"]
    assert data["error"]["where"] == "speculative_engine_start"
    case = ET.parse(tmp_path / "junit.xml").getroot().find("testcase")
    assert case is not None and case.find("error") is not None
    assert "speculative_engine_start | failed" in (tmp_path / "summary.md").read_text()


def test_failed_verdict_is_a_junit_failure(tmp_path: Path) -> None:
    rec = RunRecord.create(tmp_path, profile={"name": "tiny"}, name="tiny-tp8")
    rec.finish(passed=False, reasons=["exact match ok", "acceptance: 1.00 < 2.00"])
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.get("failures") == "1"
    assert "acceptance" in suite.find("testcase/failure").get("message")


def test_summary_names_the_models_actually_used(tmp_path: Path) -> None:
    rec = RunRecord.create(tmp_path, profile={"name": "tiny", "target": "generated:target",
                                              "draft": "generated:head"}, name="tiny-tp8")
    rec.update(models={"target": "/m/target", "draft": "/m/head", "target_revision": "a" * 40})
    rec.finish(passed=True, reasons=[])
    text = (tmp_path / "summary.md").read_text()
    assert f"- target: `/m/target` (revision {'a' * 40})" in text
    assert "- draft: `/m/head` (revision unknown)" in text


def test_reproduce_names_commands_and_pins(tmp_path: Path) -> None:
    rec = RunRecord.create(tmp_path, profile={"name": "maverick-tp8", "tensor_parallel_size": 8,
                                              "target": "meta-llama/M", "draft": "r/E"}, name="m-tp8")
    rec.update(models={"target_revision": "a" * 40, "draft_revision": "b" * 40},
               environment={"vllm": "0.25.0"},
               invocation={"argv": "python -m validate validate --profile maverick-tp8",
                           "kit_commit": "c" * 40})
    rec.finish(passed=True, reasons=[])
    text = (tmp_path / "REPRODUCE.md").read_text()
    assert f"`meta-llama/M` at `{'a' * 40}`" in text and f"`r/E` at `{'b' * 40}`" in text
    assert f"git checkout {'c' * 40}\npython -m validate validate --profile maverick-tp8" in text
    assert "vLLM 0.25.0" in text


def test_an_error_a_library_raises_in_place_of_ctrl_c_still_ends_the_run_interrupted(
        tmp_path: Path) -> None:
    """Ctrl-C while pydantic-core built a schema for vLLM's config came out of it as a SchemaError,
    and the run read as broken (exit 4). Once a signal has reached the run, it ends interrupted
    (exit 130) whatever error surfaces. (A child process: the handler's memory is per process.)"""
    script = f"""
import os, signal, time
from pathlib import Path
from validate import contract
from validate import contract
from validate.record import RunRecord
signal.signal(signal.SIGINT, contract.interrupt)
rec = RunRecord.create(Path({str(tmp_path)!r}), profile={{"name": "tiny"}}, name="tiny-tp8")
try:
    with rec.phase("reference_engine_start"):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        except KeyboardInterrupt:  # what pydantic-core did with it
            raise RuntimeError("Error building `definitions` serializer") from None
except BaseException as exc:
    rec.fail(exc)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "record.json").read_text())
    assert data["status"] == "interrupted", data["error"]
    assert data["phases"]["reference_engine_start"]["status"] == "interrupted"
    assert contract.exit_code(data) == contract.Exit.INTERRUPTED
