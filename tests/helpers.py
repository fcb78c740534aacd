"""Helpers shared by the tests (not fixtures)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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
