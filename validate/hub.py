"""Pinned, verified model acquisition: lock, fetch and verify weights with huggingface_hub.

Host side (no vLLM, no torch). A TP=8 validation starts with ~390 GB of gated weights, so this
module refuses early and clearly: no access to a gated repository (exit 5, with the license page),
not enough disk for what a dry run says will be downloaded (exit 6, both numbers), then downloads
only the files vLLM needs at the pinned commit (skipping files already present; huggingface_hub
resumes a broken transfer with a Range request, and since its 2.x restarts a file whose process
died while keeping every finished file), and verifies every file against the lock's sha256 (in
parallel; files already verified and unchanged are not hashed again). ``offline`` uses only what
is on disk and lists what is missing.

Pins are data: ``validate/data/weights.lock.json`` maps each repository to a commit and every
needed file's size and sha256. ``lock`` writes it where the hub is reachable. Nothing here invents a
pin: a repository without one is fetched at ``main`` and the run says so loudly.

The endpoint is huggingface_hub's own (``HF_ENDPOINT``), so the tests' loopback hub exercises the
same code paths as huggingface.co.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from validate import profiles, weights_lock
from validate.contract import Exit
from validate.files import atomic_write, state_dir
from validate.weights_lock import RepoLock, check_commit, check_repo, safe_name

console = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_NOT_FOUND, EXIT_ACCESS, EXIT_DISK = Exit.BAD_INPUT, Exit.NO_ACCESS, Exit.NO_DISK
EXIT_VERIFY, EXIT_OFFLINE, EXIT_HUB = Exit.VERIFY_FAILED, Exit.OFFLINE_MISSING, Exit.HUB_FAILED
DISK_MARGIN_FRACTION = 0.05
DISK_MARGIN_BYTES = 1 << 30
HASH_BLOCK = 8 << 20


class FetchError(Exception):
    """A refusal with the exit code that names its kind."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class FetchInterrupted(FetchError):
    """Ctrl-C (or SIGTERM) during a download. The transfers in flight still run in
    huggingface_hub's worker threads, which the interpreter would join before exiting (minutes
    for a 5 GB shard): the caller ends the process at once (``os._exit``) after saying this."""

    def __init__(self, message: str) -> None:
        super().__init__(message, Exit.INTERRUPTED)


def load_lock(path: Path) -> dict[str, RepoLock]:
    """The lock file's pins, checked (weights_lock.BadLock names the field and the fix)."""
    return weights_lock.load(path)[0]


save_lock = weights_lock.save


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _hub_errors(repo: str, revision: str | None, exc: Exception) -> FetchError:
    """Turn huggingface_hub's errors into refusals a contributor can act on."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = f"{_endpoint()}/{repo}"
    if isinstance(exc, GatedRepoError):  # a subclass of RepositoryNotFoundError: first
        who = "no Hugging Face token was found" if not _token() else \
            "the token's account has not been granted access"
        return FetchError(
            f"{repo} is gated and {who}. Accept the license at {page} with your account, then "
            "give the kit a token of that account: `export HF_TOKEN=hf_...` or `hf auth login`.",
            EXIT_ACCESS)
    if isinstance(exc, RevisionNotFoundError):
        return FetchError(f"{repo} has no revision {revision!r} (see {page}/commits/main); fix the "
                          "pin in the lock file or run `python -m validate lock`", EXIT_NOT_FOUND)
    if isinstance(exc, RepositoryNotFoundError):
        return FetchError(f"{repo} was not found on {_endpoint()} (or it is private and the token "
                          "cannot see it); check the repository id in validate/data/profiles.toml",
                          EXIT_NOT_FOUND)
    if isinstance(exc, LocalEntryNotFoundError):
        return FetchError(f"{repo}: the hub at {_endpoint()} could not be reached and the files "
                          f"are not on disk ({_first_line(exc)}); check the network or HF_ENDPOINT",
                          EXIT_OFFLINE)
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status in (401, 403):
            return FetchError(f"{repo}: the hub refused the token ({status}): it is invalid, "
                              f"expired or lacks read access; make a new one at {_endpoint()}/"
                              "settings/tokens and `export HF_TOKEN=hf_...`", EXIT_ACCESS)
        return FetchError(f"{repo}: the hub answered {status} ({_first_line(exc)}); try again "
                          "later", EXIT_HUB)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return FetchError(f"{repo}: the disk filled up during the download ({exc.filename or ''}); "
                          "free space and run the same command again (finished files are kept)",
                          EXIT_DISK)
    if "Consistency check failed" in str(exc):  # huggingface_hub: bytes != the size announced
        return FetchError(f"{repo}: a transfer did not match the size the hub announced "
                          f"({_first_line(exc)}); nothing was kept of it; run the same command "
                          "again", EXIT_VERIFY)
    # httpx's transport errors (refused, reset, timed out, broken mid-transfer), and anything
    # else huggingface_hub raises: one line, never a traceback
    return FetchError(f"{repo}: the hub at {_endpoint()} could not be reached or the transfer "
                      f"broke ({type(exc).__name__}: {_first_line(exc)}); check the network or "
                      "HF_ENDPOINT and run the same command again", EXIT_HUB)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def check_access(repo: str) -> None:
    from huggingface_hub import HfApi

    try:
        HfApi().auth_check(repo)
    except Exception as exc:
        raise _hub_errors(repo, None, exc) from exc


def resolve(repo: str, revision: str = "main") -> RepoLock:
    """Pin ``repo`` at ``revision``: the commit and every needed file's size and sha256.

    LFS files (the shards) carry their sha256 in the hub's tree listing; small files are
    downloaded (into the normal cache) and hashed.
    """
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi()
    allow, ignore = profiles.fetch_patterns()
    check_repo(repo, "repository")
    weights_lock.check_ref(revision)
    try:
        sha = api.repo_info(repo, revision=revision).sha
        tree = [f for f in api.list_repo_tree(repo, revision=sha, recursive=True)
                if isinstance(f, RepoFile)]
    except Exception as exc:
        raise _hub_errors(repo, revision, exc) from exc
    check_commit(sha, f"the hub's answer for {repo}@{revision}")
    for f in tree:  # a hostile or broken hub must not put a path outside the folder in the lock
        safe_name(f.path, f"the hub's file list of {repo}@{sha[:12]}")
    wanted = set(filter_repo_objects([f.path for f in tree], allow_patterns=allow,
                                     ignore_patterns=ignore))
    lock = RepoLock(revision=sha)
    for f in sorted(tree, key=lambda f: f.path):
        if f.path not in wanted:
            continue
        if f.lfs is not None:
            lock.files[f.path] = {"size": f.lfs.size, "sha256": f.lfs.sha256}
        else:
            try:
                local = hf_hub_download(repo, f.path, revision=sha)
            except Exception as exc:
                raise _hub_errors(repo, sha, exc) from exc
            lock.files[f.path] = {"size": f.size, "sha256": sha256_file(Path(local))}
    return lock


def sha256_file(path: Path) -> str:
    # hashlib.file_digest releases the GIL while hashing, so threads hash files in parallel.
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def free_bytes(path: Path) -> int:
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_disk(where: Path, needed: int) -> None:
    required = int(needed * (1 + DISK_MARGIN_FRACTION)) + DISK_MARGIN_BYTES if needed else 0
    free = free_bytes(where)
    if free < required:
        raise FetchError(
            f"not enough disk at {where}: the download needs {_gib(needed)} (plus a margin: "
            f"{_gib(required)}), {_gib(free)} are free. Free space there, or choose another place "
            "with --cache-dir / --local-dir (or HF_HOME).", EXIT_DISK)


def bytes_to_download(repos: list[str], *, lock_path: Path, cache_dir: Path | None,
                      local_dir: Path | None) -> int | None:
    """Bytes of the pinned files of ``repos`` not on disk yet, for preflight's disk check before
    anything is fetched; None when a repository is unpinned (its size is unknown until the hub's
    dry run, which ``download`` checks against the disk)."""
    locks = load_lock(lock_path)
    total = 0
    for repo in repos:
        lock = locks.get(repo)
        if lock is None or not lock.files:
            return None
        folder = local_snapshot(repo, lock.revision, cache_dir=cache_dir, local_dir=local_dir)
        total += sum(f["size"] for name, f in lock.files.items() if not (folder / name).is_file())
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def download_root(cache_dir: Path | None, local_dir: Path | None) -> Path:
    """Where weights go: --local-dir, else --cache-dir, else huggingface_hub's cache."""
    from huggingface_hub import constants

    return Path(local_dir or cache_dir or constants.HF_HUB_CACHE)


RESUME_CHUNK = 1 << 20  # bytes: what a dropped connection can cost (see download)


def download(repo: str, lock: RepoLock, *, cache_dir: Path | None, local_dir: Path | None) -> Path:
    """Dry run, disk check, then the download (huggingface_hub shows bytes, rate and time left,
    resumes ``.incomplete`` files and skips files already in place)."""
    from huggingface_hub import constants, snapshot_download

    # huggingface_hub resumes a broken transfer from the bytes it wrote, and it writes whole
    # chunks of DOWNLOAD_CHUNK_SIZE (10 MiB): a connection that drops 9 MiB into a chunk restarts
    # it, one that drops in a file's first 10 MiB restarts the file at byte 0. It takes no
    # parameter for this, so the module's constant is set: at most 1 MiB is fetched twice.
    constants.DOWNLOAD_CHUNK_SIZE = RESUME_CHUNK
    files = sorted(lock.files)
    kwargs: dict[str, Any] = dict(revision=lock.revision, allow_patterns=files,
                                  cache_dir=cache_dir, local_dir=local_dir)
    try:
        plan = snapshot_download(repo, dry_run=True, **kwargs)
        needed = sum(p.file_size or 0 for p in plan if p.will_download)
        check_disk(download_root(cache_dir, local_dir), needed)
        console.print(f"{repo}@{lock.revision[:12]}: {len(files)} files, {_gib(lock.total_bytes)}; "
                      f"{_gib(needed)} to download")
        try:
            return Path(_interruptible(snapshot_download, repo, max_workers=8, **kwargs))
        except KeyboardInterrupt:
            folder = local_snapshot(repo, lock.revision, cache_dir=cache_dir, local_dir=local_dir)
            kept = sum((folder / n).is_file() for n in files)
            raise FetchInterrupted(
                f"interrupted: {kept} of {len(files)} files of {repo} are complete and kept in "
                f"{folder}; the files in flight start again (from their beginning) when you run "
                "the same command") from None
    except FetchError:
        raise
    except Exception as exc:
        raise _hub_errors(repo, lock.revision, exc) from exc


def _interruptible(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn`` in a daemon thread, so the main thread sees Ctrl-C at once: huggingface_hub's own
    pool would otherwise wait for every running transfer before the interrupt is raised."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    t = threading.Thread(target=work, name="kit-download", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
    if "error" in box:
        raise box["error"]
    return box["value"]


def local_snapshot(repo: str, revision: str, *, cache_dir: Path | None,
                   local_dir: Path | None) -> Path:
    """Offline: where ``repo``@``revision`` lies on disk (the cache's layout), without any network
    call. The folder may be missing or incomplete: the caller lists what is missing."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    if local_dir:
        return Path(local_dir)
    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    return cache / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots" / revision


# ---------------------------------------------------------------------------------------------
# verification


def _state_path(repo: str, revision: str) -> Path:
    return state_dir() / "verified" / f"{repo.replace('/', '--')}@{revision}.json"


def _stat_key(path: Path) -> list[int]:
    st = path.stat()  # follows the cache's symlink to the blob
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def verify(repo: str, folder: Path, lock: RepoLock) -> dict[str, str]:
    """Check every locked file's size and sha256; returns problems by file (empty: all good).

    Files whose size, mtime and inode match the last successful check are not hashed again, so
    re-verifying 390 GB that did not change takes a second. Hashing runs in threads (one file per
    worker; hashlib releases the GIL), with a progress bar over bytes.
    """
    state_file = _state_path(repo, lock.revision)
    state = _verified_state(state_file)
    problems: dict[str, str] = {}
    todo: list[str] = []
    for name, want in lock.files.items():
        p = folder / name
        if (p.is_symlink() or p.exists()) and not _inside(folder, p):
            problems[name] = "a link that leaves the model folder (not read, not removed)"
        elif not p.is_file():
            problems[name] = "missing"
        elif p.stat().st_size != want["size"]:
            problems[name] = f"size {p.stat().st_size} != locked {want['size']}"
        elif state.get(name) == {"stat": _stat_key(p), "sha256": want["sha256"]}:
            continue
        else:
            todo.append(name)
    if todo:
        total = sum(lock.files[n]["size"] for n in todo)
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task(f"verifying {repo} ({len(todo)} files)", total=total)

            def check(name: str) -> tuple[str, str]:
                digest = sha256_file(folder / name)
                bar.advance(task, lock.files[name]["size"])
                return name, digest

            workers = min(len(todo), os.cpu_count() or 1)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for name, digest in pool.map(check, todo):
                    locked = lock.files[name]["sha256"]
                    if digest != locked:
                        problems[name] = f"sha256 {digest[:16]}... != locked {locked[:16]}..."
                    else:
                        state[name] = {"stat": _stat_key(folder / name), "sha256": digest}
    for name in problems:
        state.pop(name, None)
    atomic_write(state_file, json.dumps(state, indent=1))
    return problems


def _verified_state(path: Path) -> dict[str, Any]:
    """The record of files verified before (only a cache: what it says is re-checked against each
    file's stat, and a damaged one means hashing again, never a traceback)."""
    try:
        state = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError, RecursionError):
        state = None
    if not isinstance(state, dict):
        console.print(f"[yellow]ignoring a damaged verification record[/] {path}: every file is "
                      "hashed again")
        return {}
    return state


def _root(folder: Path) -> Path:
    """What a model folder's files may resolve into: the whole repository folder for a cache
    snapshot (its files are links into ../../blobs), else the folder itself."""
    folder = Path(folder).absolute()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.resolve()
    return folder.resolve()


def _inside(folder: Path, path: Path) -> bool:
    """``path`` (a lock file's name under ``folder``), links followed, stays in the folder."""
    return path.resolve().is_relative_to(_root(folder))


def discard(folder: Path, names: Iterable[str]) -> None:
    """Remove corrupted files (the cache's link and its blob) so nothing bad looks complete and
    the next fetch downloads them again. Only what lies inside the model folder is removed; a
    name that is not a path inside it is refused (lock names are checked on load already)."""
    for name in names:
        p = folder / safe_name(name, f"file to remove from {folder}")
        if not _inside(folder, p):
            continue  # a link out of the folder: its target is not ours to delete
        if p.is_symlink():
            target = p.resolve()
            p.unlink()
            if target.is_file():
                target.unlink()
        elif p.is_file():
            p.unlink()


# ---------------------------------------------------------------------------------------------
# the fetch flow


@dataclass
class Fetched:
    repo: str
    path: str
    revision: str
    pinned: bool
    files: int
    bytes: int


def fetch(repos: list[str], *, lock_path: Path, cache_dir: Path | None = None,
          local_dir: Path | None = None, offline: bool = False,
          only: tuple[str, ...] = ()) -> list[Fetched]:
    """Fetch and verify every repository in ``repos``; raises FetchError on any refusal.
    ``only``: just these files (the configs, checked before hundreds of GB are fetched)."""
    locks = load_lock(lock_path)
    out = []
    for repo in repos:
        check_repo(repo, "repository")
        sub = Path(local_dir) / repo.replace("/", "--") if local_dir else None
        lock = locks.get(repo)
        pinned = lock is not None
        if offline:
            lock = lock or _last_resolved(repo)
            if lock is None:
                raise FetchError(f"offline: {repo} has no pin in {lock_path} and was never fetched "
                                 "on this machine; fetch it once online", EXIT_OFFLINE)
            lock = _only(lock, only)
            folder = local_snapshot(repo, lock.revision, cache_dir=cache_dir, local_dir=sub)
            missing = [n for n in lock.files if not (folder / n).is_file()]
            if missing:
                raise FetchError(f"offline: {repo}@{lock.revision[:12]} lacks {len(missing)} of "
                                 f"{len(lock.files)} files on disk: {', '.join(missing)}; run "
                                 "`python -m validate fetch` where the hub is reachable", EXIT_OFFLINE)
        else:
            check_access(repo)
            if lock is None:
                lock = resolve(repo, "main")
                console.print(f"[bold yellow]UNPINNED[/]: {repo} has no pin in {lock_path}; fetched "
                              f"main = {lock.revision}. To pin it, run `python -m validate lock` and "
                              "commit the lock file.")
            _remember(repo, lock)
            lock = _only(lock, only)
            folder = download(repo, lock, cache_dir=cache_dir, local_dir=sub)
        problems = verify(repo, folder, lock)
        if problems:
            bad = [n for n, p in problems.items() if p != "missing" and not p.startswith("a link")]
            discard(folder, bad)
            raise FetchError(f"{repo}@{lock.revision[:12]} failed verification: " + "; ".join(
                f"{n}: {p}" for n, p in problems.items()) + (". The bad files were removed: run "
                "the same command again to download them." if bad else ""), EXIT_VERIFY)
        out.append(Fetched(repo, str(folder), lock.revision, pinned, len(lock.files), lock.total_bytes))
    return out


def _only(lock: RepoLock, names: tuple[str, ...]) -> RepoLock:
    if not names:
        return lock
    return RepoLock(lock.revision, {n: f for n, f in lock.files.items() if n in names})


def _remember(repo: str, lock: RepoLock) -> None:
    """What an online fetch resolved, so an offline run knows the file list."""
    path = state_dir() / "resolved" / f"{repo.replace('/', '--')}.json"
    atomic_write(path, json.dumps(asdict(lock), indent=1))


def _last_resolved(repo: str) -> RepoLock | None:
    """What the last online fetch resolved, checked as a lock entry is (its revision and file
    names become paths); a damaged record is refused naming the file and the way out."""
    path = state_dir() / "resolved" / f"{repo.replace('/', '--')}.json"
    if not path.is_file():
        return None
    try:
        return weights_lock.entry(repo, json.loads(path.read_text()), str(path))
    except (OSError, ValueError, RecursionError) as exc:
        raise weights_lock.BadLock(f"the kit's record of {repo} at {path} is damaged ({exc}); "
                                   "delete it and fetch once online, or pin the repository in the "
                                   "lock file (`nox -s lock`)") from None
