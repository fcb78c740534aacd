"""The kit's small file helpers, in one room that depends on nothing: writes that are never seen
half-done, and the folder where the kit keeps its own state (the tiny pair, verification records,
overlays of a vLLM under test, the ledger of runs in flight).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def atomic_write(path: Path, text: str | bytes) -> None:
    """Write via a temp file + rename so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        # mkstemp makes the file private; run folders and goldens are meant to be read by others
        # (a container's user, a CI artifact uploader).
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out``, filled by the block, that replaces ``out`` whole when
    the block ends and is removed if it fails: a reader finds all of a folder or none of it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def state_dir() -> Path:
    """``VALIDATE_CACHE``, else ``$XDG_CACHE_HOME/llama4-eagle-validate`` (``~/.cache``)."""
    base = os.environ.get("VALIDATE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llama4-eagle-validate")
    return Path(base)
