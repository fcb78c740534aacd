"""Helpers shared by the tests (not fixtures)."""

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

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The walkthrough's CPU block is also the suite's shared TP=8 host rehearsal (tests/conftest.py).
WALKTHROUGH_RUN = "runs/walkthrough"
# Which tier runs: ci (`nox -s tests`, also plain pytest) or full (`nox -s tests_full`).
TIER = os.environ.get("KIT_TEST_TIER", "ci")


def runnable_blocks() -> list[tuple[str, str]]:
    """(doc name, bash) of every ```bash runnable block in the docs."""
    return [(doc.name, block) for doc in DOCS
            for block in re.findall(r"```bash runnable\n(.*?)```", doc.read_text(), re.S)]


def rehearse(run: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    """`python -m validate rehearse --tp 8 ...` as a user runs it: (exit code, record, output)."""
    r = subprocess.run([sys.executable, "-m", "validate", "rehearse", "--tp", "8",
                        "--run-dir", str(run), *extra], capture_output=True, text=True,
                       timeout=3600, check=False, env=env)
    assert (run / "record.json").is_file(), (r.stdout + r.stderr)[-4000:]
    return r.returncode, json.loads((run / "record.json").read_text()), r.stdout + r.stderr


CA = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELHOUSE = Path("/opt/wheels")  # a machine's CPU torch wheel (not on PyPI), where it has one


def image_args(base: str) -> list[str]:
    """The image options the container tests build with: the registry's base by digest, this
    machine's CA bundle and wheelhouse where it has them."""
    args = ["--base-image", base, "--build-network", "host"]
    if CA.is_file():
        args += ["--ca-bundle", str(CA)]
    if WHEELHOUSE.is_dir():
        args += ["--wheelhouse", str(WHEELHOUSE)]
    return args


def docker(host: str, *args: str) -> str:
    return subprocess.run(["docker", "-H", host, *args], capture_output=True, text=True,
                          check=True).stdout


def push(docker_host: str, local: str, remote: str) -> str:
    """Push ``local`` as ``remote`` (name:tag); returns ``name@digest`` as the registry has it."""
    from validate import containers

    docker(docker_host, "tag", local, remote)
    docker(docker_host, "push", remote)
    name = containers.repository(remote)
    [ref] = [d for d in json.loads(docker(docker_host, "image", "inspect", remote))[0]["RepoDigests"]
             if d.startswith(name + "@")]
    return ref


def registry_base(docker_host: str, local: str, registry: str) -> str:
    """The local Debian base as the test registry serves it, by digest: builds are FROM a digest."""
    return push(docker_host, local, f"{registry}/kit-base/bookworm:local")


def stop(pidfile: Path, timeout_s: float = 30) -> None:
    """SIGTERM the process a start script recorded, and wait for it to be gone."""
    try:
        pid = int(pidfile.read_text().strip())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.2)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def wait_for_phase(run: Path, proc: subprocess.Popen[str], phase: str,
                   timeout: float = 900) -> None:
    """Until the engine side's record in ``run`` has entered ``phase`` (the kit still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if phase in json.loads((run / "record.json").read_text())["phases"]:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else proc.returncode
        time.sleep(0.5)
    raise AssertionError(f"no {phase} phase in {run}/record.json after {timeout:.0f} s")


if __name__ == "__main__":
    # `.ci/run` builds the container tests' CPU image while the engine environment installs (pip
    # keeps one core busy there, the build the other): `python tests/helpers.py image-args LOCAL
    # REGISTRY` pushes the base and prints the tests' own image options for `nox -s image`.
    _, command, local_base, registry = sys.argv
    if command != "image-args":
        raise SystemExit(f"unknown command {command}: image-args LOCAL REGISTRY")
    print(" ".join(image_args(registry_base(os.environ["DOCKER_HOST"], local_base, registry))))
