"""Preflight on real outputs: nvidia-smi captured on H200 hosts, `docker info` of a real engine."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from validate import preflight, profiles
from validate.contract import Exit

DATA = Path(__file__).parent / "data"
MAVERICK = profiles.get("maverick-tp8")


def _docker(with_nvidia: bool) -> dict:
    info = json.loads((DATA / "docker-info-vfs.json").read_text())
    if with_nvidia:  # what the NVIDIA Container Toolkit adds to `docker info`
        info = copy.deepcopy(info)
        info["Runtimes"]["nvidia"] = {"path": "nvidia-container-runtime"}
    return info


def _gpus(name: str, copies: int = 1) -> list[preflight.Gpu]:
    gpus = preflight.parse_nvidia_smi((DATA / name).read_text())
    return [preflight.Gpu(i, g.name, g.memory_mib, g.driver, g.compute_cap)
            for i, g in enumerate(gpus * copies)]


def _status(findings: list[preflight.Finding]) -> dict[str, str]:
    return {f.check: f.status for f in findings}


def test_parses_real_nvidia_smi() -> None:
    [gpu] = preflight.parse_nvidia_smi((DATA / "nvidia-smi-query-h200x1.csv").read_text())
    assert (gpu.name, gpu.memory_mib, gpu.driver, gpu.compute_cap) == \
        ("NVIDIA H200", 143771, "580.159.04", "9.0")


def test_eight_h200_with_the_nvidia_runtime_pass() -> None:
    facts = preflight.HostFacts(docker=_docker(True), gpus=_gpus("nvidia-smi-query-h200x1.csv", 8),
                                shm_bytes=64 << 30)
    findings = preflight.evaluate(MAVERICK, facts)
    assert preflight.verdict(findings), findings
    assert _status(findings) == {"docker": "ok", "nvidia runtime": "ok", "gpus": "ok",
                                 "gpu memory": "ok", "driver": "ok", "shared memory": "ok"}


def test_two_gpus_for_tp8_fail_with_the_numbers_and_the_fix() -> None:
    facts = preflight.HostFacts(docker=_docker(True), gpus=_gpus("nvidia-smi-query-h200x2.csv"))
    [gpus] = [f for f in preflight.evaluate(MAVERICK, facts) if f.check == "gpus"]
    assert gpus.status == "fail"
    assert gpus.detail == "2 GPU(s) visible, the profile needs 8 (TP=8)"
    assert "rehearse_tp8" in gpus.fix


def test_engine_without_nvidia_runtime_names_the_toolkit() -> None:
    facts = preflight.HostFacts(docker=_docker(False), gpus=_gpus("nvidia-smi-query-h200x1.csv", 8))
    [rt] = [f for f in preflight.evaluate(MAVERICK, facts) if f.check == "nvidia runtime"]
    assert rt.status == "fail" and "nvidia-ctk runtime configure" in rt.fix


def test_small_gpus_and_old_driver_fail() -> None:
    gpus = [preflight.Gpu(i, "NVIDIA A10", 23028, "535.104.05", "8.6") for i in range(8)]
    findings = preflight.evaluate(MAVERICK, preflight.HostFacts(docker=_docker(True), gpus=gpus))
    assert _status(findings)["gpu memory"] == "fail"
    assert _status(findings)["driver"] == "fail"


def test_validate_tp8_without_gpus_stops_at_preflight_with_the_table(tmp_path: Path) -> None:
    """Exit 9 with the table, before anything is fetched or built, and no run folder."""
    r = subprocess.run([sys.executable, "-m", "validate", "validate", "--profile", "maverick-tp8"],
                       capture_output=True, text=True, timeout=60, check=False,
                       env={"PATH": "/usr/bin:/bin", "DOCKER_HOST": "unix:///nonexistent.sock",
                            "COLUMNS": "200", "HF_HOME": str(tmp_path / "hf")}, cwd=tmp_path)
    assert r.returncode == Exit.PREFLIGHT, r.stderr
    assert "preflight" in r.stderr and "no NVIDIA GPU visible" in r.stderr
    assert "nox -s rehearse_tp8" in r.stderr
    assert not (tmp_path / "hf").exists() and not (tmp_path / "runs").exists(), "nothing fetched"


def test_a_cpu_profile_waives_the_gpu_checks_and_says_so() -> None:
    facts = preflight.HostFacts(docker=_docker(False), shm_bytes=8 << 30)
    [gpus] = [f for f in preflight.evaluate(profiles.get("tiny"), facts) if f.check == "gpus"]
    assert gpus.status == "ok" and "waived" in gpus.detail


def test_disk_check_measures_the_folder_the_weights_go_to(tmp_path: Path) -> None:
    """gather() measures the nearest existing folder above where weights go; too little is FAIL."""
    facts = preflight.gather(MAVERICK, docker_info=None, disk_path=tmp_path / "not" / "yet",
                             disk_needed_bytes=1 << 60)
    assert facts.extra["disk_path"] == str(tmp_path) and facts.disk_free_bytes > 0
    [disk] = [f for f in preflight.evaluate(MAVERICK, facts, container=False) if f.check == "disk"]
    assert disk.status == "fail" and str(tmp_path) in disk.detail and "--cache-dir" in disk.fix
    facts.disk_needed_bytes = 1
    [disk] = [f for f in preflight.evaluate(MAVERICK, facts, container=False) if f.check == "disk"]
    assert disk.status == "ok"
