"""Host checks before anything heavy: do this machine's facts meet the profile's needs?

Each finding is ok, warn or fail, with the fix. Evaluation is pure (facts in, findings out), so it
is tested on real outputs captured from H200 hosts and a real Docker engine; ``gather`` collects the
facts (``nvidia-smi``, the Docker engine's info through a callable the caller hands in, /dev/shm,
free disk), each probe bounded to seconds.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from validate.profiles import Profile

OK, WARN, FAIL = "ok", "warn", "fail"
# The Maverick FP8 run needs about 50 GB of weights per GPU at TP=8 plus KV cache and graphs.
MIN_GPU_MEMORY_MIB = {"cuda": 79 * 1024}
MIN_DRIVER_MAJOR = 575  # CUDA 12.9+ images (vLLM releases of 2025-2026) need a driver this new
MIN_SHM_BYTES = 1 << 30  # NCCL between TP ranks; ipc=host gives the host's whole /dev/shm
NVIDIA_TOOLKIT = "https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/install-guide.html"
DOCKER_INSTALL = "https://docs.docker.com/engine/install/"


@dataclass
class Finding:
    check: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Gpu:
    index: int
    name: str
    memory_mib: int
    driver: str
    compute_cap: str


@dataclass
class HostFacts:
    """What the host offers. ``None`` means the probe could not run (with the reason beside it)."""

    docker: dict[str, Any] | None = None  # `docker info` as the engine API returns it
    docker_error: str = ""
    gpus: list[Gpu] | None = None
    gpu_error: str = ""
    shm_bytes: int | None = None
    disk_free_bytes: int | None = None
    disk_needed_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version,compute_cap",
                    "--format=csv,noheader,nounits"]


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of ``NVIDIA_SMI_QUERY``'s output."""
    gpus = []
    for row in csv.reader(io.StringIO(text)):
        if not row or not row[0].strip():
            continue
        idx, name, mem, driver, cap = (c.strip() for c in row)
        gpus.append(Gpu(int(idx), name, int(float(mem)), driver, cap))
    return gpus


def gather(profile: Profile, *, docker_info: Callable[[], dict[str, Any]] | None,
           disk_path: Path | None = None, disk_needed_bytes: int | None = None) -> HostFacts:
    """What this host offers. ``docker_info`` None: no container is wanted, the engine is not asked.
    ``disk_path``: where the weights go (the nearest existing folder above it is measured)."""
    facts = HostFacts(disk_needed_bytes=disk_needed_bytes)
    if docker_info is not None:
        try:
            facts.docker = docker_info()
        except Exception as exc:  # no engine, permission denied, ...: the finding says which
            facts.docker_error = str(exc).splitlines()[0][:300]
    if profile.device == "cuda":
        try:
            out = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=20,
                                 check=True).stdout
            facts.gpus = parse_nvidia_smi(out)
        except FileNotFoundError:
            facts.gpu_error = "nvidia-smi is not installed (no NVIDIA driver on this host)"
        except (subprocess.SubprocessError, ValueError) as exc:
            facts.gpu_error = f"nvidia-smi failed: {exc}"
    try:
        facts.shm_bytes = shutil.disk_usage("/dev/shm").total
    except OSError:
        pass
    if disk_path is not None:
        probe = Path(disk_path).absolute()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        facts.disk_free_bytes = shutil.disk_usage(probe).free
        facts.extra["disk_path"] = str(probe)
    return facts


def evaluate(profile: Profile, facts: HostFacts, *, container: bool = True) -> list[Finding]:
    tp = profile.tensor_parallel_size
    out: list[Finding] = []
    if container:
        if facts.docker is None:
            out.append(Finding("docker", FAIL, f"no Docker engine answered: {facts.docker_error}",
                               f"install and start Docker ({DOCKER_INSTALL}), or run without "
                               "a container: `nox -s validate_tp8 -- --no-container`"))
        else:
            out.append(Finding("docker", OK, f"Docker {facts.docker.get('ServerVersion', '?')}"))
            runtimes = facts.docker.get("Runtimes") or {}
            if profile.device == "cuda":
                if "nvidia" in runtimes or _has_cdi_nvidia(facts.docker):
                    out.append(Finding("nvidia runtime", OK, "the engine knows the NVIDIA runtime"))
                else:
                    out.append(Finding(
                        "nvidia runtime", FAIL,
                        f"the engine knows runtimes {sorted(runtimes) or 'none'}, not nvidia",
                        f"install the NVIDIA Container Toolkit ({NVIDIA_TOOLKIT}), then "
                        "`sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl "
                        "restart docker`"))
    if profile.device == "cuda":
        out += _gpu_findings(profile, facts, tp)
    else:
        out.append(Finding("gpus", OK, f"not needed: profile {profile.name} runs on "
                           f"{profile.device} (GPU checks waived)"))
    if facts.shm_bytes is not None:
        if facts.shm_bytes >= MIN_SHM_BYTES or container:
            note = ("" if not container else " (the GPU container shares it: ipc=host)"
                    if profile.device == "cuda" else " (the container gets a /dev/shm of its own)")
            out.append(Finding("shared memory", OK, f"/dev/shm {facts.shm_bytes / 2**30:.1f} GiB{note}"))
        else:
            out.append(Finding("shared memory", WARN, f"/dev/shm is {facts.shm_bytes / 2**20:.0f} MiB",
                               "NCCL between TP ranks may fail; enlarge /dev/shm"))
    if facts.disk_needed_bytes is not None and facts.disk_free_bytes is not None:
        need, free = facts.disk_needed_bytes, facts.disk_free_bytes
        status = OK if free >= need else FAIL
        where = facts.extra.get("disk_path", "the model folder")
        out.append(Finding("disk", status, f"{free / 2**30:.1f} GiB free at {where}, "
                           f"{need / 2**30:.1f} GiB needed for the weights", "" if status == OK else
                           "free space or point --cache-dir / HF_HOME elsewhere"))
    return out


def _has_cdi_nvidia(info: dict[str, Any]) -> bool:
    return any("nvidia.com/gpu" in str(d) for d in info.get("DiscoveredDevices") or [])


def _gpu_findings(profile: Profile, facts: HostFacts, tp: int) -> list[Finding]:
    if facts.gpus is None:
        return [Finding("gpus", FAIL, f"no NVIDIA GPU visible: {facts.gpu_error}",
                        "this profile needs GPUs; without them, rehearse on CPU: `nox -s rehearse_tp8`")]
    out = []
    n = len(facts.gpus)
    if n < tp:
        out.append(Finding("gpus", FAIL, f"{n} GPU(s) visible, the profile needs {tp} (TP={tp})",
                           "use a machine with enough GPUs, or `nox -s rehearse_tp8` on CPU"))
    else:
        names = sorted({g.name for g in facts.gpus})
        out.append(Finding("gpus", OK, f"{n} x {', '.join(names)} (TP={tp} uses {tp})"))
    need = MIN_GPU_MEMORY_MIB.get(profile.device, 0)
    small = [g for g in facts.gpus[:tp] if g.memory_mib < need] if profile.generated is False else []
    if small:
        out.append(Finding("gpu memory", FAIL,
                           f"GPU {small[0].index} has {small[0].memory_mib / 1024:.0f} GiB; "
                           f"{profile.name} needs about {need / 1024:.0f} GiB per GPU",
                           "use 80 GB-class GPUs (H100, H200, B200)"))
    elif facts.gpus:
        least = min(g.memory_mib for g in facts.gpus) / 1024
        out.append(Finding("gpu memory", OK, f"{least:.0f} GiB per GPU"))
    drivers = sorted({g.driver for g in facts.gpus})
    if drivers:
        major = int(drivers[0].split(".")[0])
        out.append(Finding("driver", OK if major >= MIN_DRIVER_MAJOR else FAIL,
                           f"NVIDIA driver {', '.join(drivers)}",
                           "" if major >= MIN_DRIVER_MAJOR else
                           f"the pinned image needs driver >= {MIN_DRIVER_MAJOR}; update the driver"))
    return out


def verdict(findings: list[Finding]) -> bool:
    return not any(f.status == FAIL for f in findings)
