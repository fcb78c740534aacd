"""The weights lock file: its schema, and the safety of every name and revision that enters it.

Host side, pure (no network). ``validate/data/weights.lock.json`` maps each repository to a commit
and every needed file's size and sha256. What it holds decides which files the kit writes, hashes
and deletes, so nothing in it is trusted: a file name must be a path inside the repository (no
``..``, not absolute), a revision a 40-hex commit, a sha256 64 hex, a size a count of bytes, and a
repository pinned with no files is no pin at all. Each problem is refused naming the field and
the fix (``lock`` regenerates the file from the hub). The same checks apply to names a hub lists
and to the revision a user asks ``lock`` for, wherever they enter.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from validate.contract import BadInput
from validate.files import atomic_write


def default_path() -> Path:
    """The kit's own lock file (``validate/data/weights.lock.json``), shipped in the package."""
    return Path(str(resources.files("validate.data").joinpath("weights.lock.json")))


SCHEMA = 1
COMMIT = re.compile(r"[0-9a-f]{40}")
SHA256 = re.compile(r"[0-9a-f]{64}")
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# What ``lock --revision`` may ask the hub for: a branch, a tag or a commit (git's ref rules,
# enough of them to keep a path out: no "..", no leading "/", no backslash or control characters).
REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")


class BadLock(BadInput):
    """A lock file (or an entry of one) the kit refuses to act on."""


class UnsafeName(BadInput):
    """A file name or revision that would reach outside the model folder."""


@dataclass
class RepoLock:
    revision: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> {size, sha256}

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())


def safe_name(name: object, where: str) -> str:
    """``name`` if it is a relative path inside a repository, else UnsafeName naming ``where``."""
    if not isinstance(name, str) or not name:
        raise UnsafeName(f"{where}: {name!r} is not a file name")
    parts = name.split("/")
    if (PurePosixPath(name).is_absolute() or "\\" in name or any(ord(c) < 32 for c in name)
            or any(p in ("", ".", "..") for p in parts)):
        raise UnsafeName(f"{where}: {name!r} is not a path inside the repository (absolute, "
                         "'..', '.', an empty part, a backslash or a control character)")
    return name


def check_commit(revision: object, where: str) -> str:
    if not isinstance(revision, str) or not COMMIT.fullmatch(revision):
        raise UnsafeName(f"{where}: revision {revision!r} is not a 40-hex commit")
    return revision


def check_ref(revision: str) -> str:
    """A revision a user asks for (branch, tag or commit): resolved to a commit by the hub."""
    if not REF.fullmatch(revision) or ".." in revision or revision.endswith(("/", ".lock")):
        raise UnsafeName(f"--revision {revision!r} is not a branch, tag or commit name")
    return revision


def check_repo(repo: object, where: str) -> str:
    if not isinstance(repo, str) or not REPO_ID.fullmatch(repo) or ".." in repo:
        raise BadLock(f"{where}: {repo!r} is not a repository id (owner/name)")
    return repo


def _entry(repo: str, entry: object, where: str) -> RepoLock:
    if not isinstance(entry, dict):
        raise BadLock(f"{where}: an object with revision and files was expected")
    revision = check_commit(entry.get("revision"), where)
    files = entry.get("files")
    if not isinstance(files, dict) or not files:
        raise BadLock(f"{where}.files: a repository pinned with no files is no pin (every file "
                      "the run needs is listed with its size and sha256)")
    checked: dict[str, dict[str, Any]] = {}
    for name, meta in files.items():
        at = f"{where}.files[{name!r}]"
        safe_name(name, at)
        if not isinstance(meta, dict):
            raise BadLock(f"{at}: an object with size and sha256 was expected")
        size, sha = meta.get("size"), meta.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadLock(f"{at}.size: {size!r} is not a size in bytes")
        if not isinstance(sha, str) or not SHA256.fullmatch(sha):
            raise BadLock(f"{at}.sha256: {sha!r} is not a sha256 (64 hex)")
        checked[name] = {"size": size, "sha256": sha}
    return RepoLock(revision, checked)


def parse(data: object, path: Path, *, strict: bool = True) -> tuple[dict[str, RepoLock], list[str]]:
    """(entries, problems). Strict: the first problem is raised; else bad entries are dropped
    and listed (``lock`` keeps the good pins and regenerates the rest)."""
    if not isinstance(data, dict) or not isinstance(data.get("repos"), dict):
        raise BadLock(f"{path}: a lock file is an object with 'schema' and 'repos' (an object "
                      "mapping each repository to its pin)")
    if data.get("schema", SCHEMA) != SCHEMA:
        raise BadLock(f"{path}: schema {data.get('schema')!r}; this kit reads schema {SCHEMA}")
    locks, problems = {}, []
    for repo, entry in data["repos"].items():
        where = f"{path}: repos[{repo!r}]"
        try:
            locks[check_repo(repo, where)] = _entry(repo, entry, where)
        except BadInput as exc:
            if strict:
                raise BadLock(f"{exc}. Regenerate the pins: `nox -s lock -- --profile "
                              "<profile> --lock-file <this file>` (or remove the entry)") from exc
            problems.append(str(exc))
    return locks, problems


def load(path: Path, *, strict: bool = True) -> tuple[dict[str, RepoLock], list[str]]:
    """The lock at ``path`` (which must exist), checked; see ``parse``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise BadLock(f"lock file {path} cannot be read ({exc.strerror or exc}); pass an existing "
                      "--lock-file, or leave it out for the kit's own") from exc
    try:
        data = json.loads(text)
    except RecursionError:  # valid JSON nested deeper than Python's parser goes: no lock file
        if strict:
            raise BadLock(f"{path} is nested too deeply to be a lock file; regenerate it: `nox -s "
                          "lock -- --profile <profile> --lock-file <this file>`") from None
        return {}, [f"{path} is nested too deeply to be a lock file"]
    except ValueError as exc:
        if strict:
            raise BadLock(f"{path} is not JSON ({exc}); regenerate it: `nox -s lock -- --profile "
                          "<profile> --lock-file <this file>`") from exc
        return {}, [f"{path} is not JSON ({exc})"]
    try:
        return parse(data, Path(path), strict=strict)
    except BadLock:
        if strict:
            raise
        return {}, [f"{path} is not a lock file this kit reads"]


def save(path: Path, locks: dict[str, RepoLock]) -> None:
    for repo, lock in locks.items():  # never write what load would refuse
        _entry(repo, asdict(lock), f"repos[{repo!r}]")
    data = {"schema": SCHEMA, "repos": {r: asdict(lock) for r, lock in sorted(locks.items())}}
    try:
        atomic_write(Path(path), json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise BadLock(f"lock file {path} cannot be written ({exc.strerror or exc}); pass a "
                      "--lock-file in a folder you can write") from exc


def entry(repo: str, data: object, where: str) -> RepoLock:
    """One repository's pin as the kit stored it for itself (``hub``'s record of what an online
    fetch resolved), checked as a lock file's entry is: its revision becomes a path."""
    return _entry(repo, data, where)
