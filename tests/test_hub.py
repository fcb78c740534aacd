"""Fetch against a real HTTP server on loopback that speaks the hub's protocol (validate/loopback_hub.py):
the same huggingface_hub code paths as huggingface.co, only HF_ENDPOINT differs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from validate import hub as kit_hub
from validate.contract import Exit
from validate.loopback_hub import Hub, serve

TARGET, HEAD = "kit-test/tiny-llama4", "kit-test/tiny-llama4-eagle"
SHARD = "model.safetensors"


@pytest.fixture
def loopback(models) -> Iterator[Hub]:
    h = Hub()
    server, _ = serve(h)
    h.publish(TARGET, models.target)
    h.publish(HEAD, models.head)
    yield h
    server.shutdown()


@pytest.fixture
def env(loopback: Hub, tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    e.update(HF_ENDPOINT=loopback.url, HF_HOME=str(tmp_path / "hf"),
             VALIDATE_CACHE=str(tmp_path / "state"), HF_HUB_DISABLE_XET="1")
    return e


def kit(env: dict[str, str], *args: str, lock: Path | None = None, **popen: object):
    cmd = [sys.executable, "-m", "validate", *args, "--target-repo", TARGET, "--draft-repo", HEAD]
    if lock is not None:
        cmd += ["--lock-file", str(lock)]
    if popen:
        return subprocess.Popen(cmd, env=env, **popen)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def lock(env: dict[str, str], tmp_path: Path) -> Path:
    path = tmp_path / "weights.lock.json"
    r = kit(env, "lock", lock=path)
    assert r.returncode == 0, r.stderr
    return path


def _shard_path(tmp_path: Path, lock: Path) -> Path:
    rev = json.loads(lock.read_text())["repos"][TARGET]["revision"]
    return tmp_path / "hf" / "hub" / f"models--{TARGET.replace('/', '--')}" / "snapshots" / rev / SHARD


def test_lock_pins_commit_sizes_and_sha256(lock: Path, loopback: Hub, models) -> None:
    import hashlib

    repos = json.loads(lock.read_text())["repos"]
    assert repos[TARGET]["revision"] == loopback.repos[TARGET].sha
    shard = repos[TARGET]["files"][SHARD]
    data = (models.target / SHARD).read_bytes()
    assert shard == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert "config.json" in repos[HEAD]["files"]


def test_fetch_downloads_verifies_and_never_downloads_twice(env, lock: Path, loopback: Hub,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "fetched.json"
    r = kit(env, "fetch", "--json", str(out), lock=lock)
    assert r.returncode == 0, r.stderr
    got = {g["repo"]: g for g in json.loads(out.read_text())}
    assert got[TARGET]["pinned"] and got[TARGET]["revision"] == loopback.repos[TARGET].sha
    assert (Path(got[HEAD]["path"]) / "config.json").is_file()
    from validate.e2e.test_llama4_eagle_tp8 import _revision

    assert _revision(got[TARGET]["path"]) == loopback.repos[TARGET].sha, "run records name the commit"
    assert len(loopback.file_requests(SHARD, TARGET)) == 1
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == 0, r.stderr
    assert len(loopback.file_requests(SHARD, TARGET)) == 1, "finished files are not downloaded again"


def test_unpinned_fetch_says_so_and_records_main(env, loopback: Hub, tmp_path: Path) -> None:
    empty = tmp_path / "empty.lock.json"
    empty.write_text('{"schema": 1, "repos": {}}')
    r = kit(env, "fetch", lock=empty)
    assert r.returncode == 0, r.stderr
    assert "UNPINNED" in r.stderr and loopback.repos[TARGET].sha in r.stderr


def test_gated_repo_without_access_names_the_license_page(env, lock: Path, loopback: Hub,
                                                          models) -> None:
    loopback.publish(HEAD, models.head, gated=True, allowed_tokens={"hf_granted"})
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == kit_hub.EXIT_ACCESS, r.stderr
    assert f"{HEAD} is gated and no Hugging Face token was found" in r.stderr
    assert f"{loopback.url}/{HEAD}" in r.stderr and "HF_TOKEN" in r.stderr
    r = kit({**env, "HF_TOKEN": "hf_other"}, "fetch", lock=lock)
    assert r.returncode == kit_hub.EXIT_ACCESS
    assert "has not been granted access" in r.stderr
    assert "hf_other" not in r.stderr, "a token never appears in output"
    r = kit({**env, "HF_TOKEN": "hf_granted"}, "fetch", lock=lock)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("command", [["fetch"], ["validate", "--profile", "tiny", "--no-container"]],
                         ids=["fetch", "validate"])
def test_a_tp_size_the_config_rules_out_is_refused_before_any_shard(env, lock: Path, loopback: Hub,
                                                                     command: list[str],
                                                                     tmp_path: Path) -> None:
    """TP=3 against 8 attention heads: the configs come first, the refusal before any weights
    (`validate` goes through preflight first, then the same configs-first fetch)."""
    run = ["--run-dir", str(tmp_path / "run")] if command[0] == "validate" else []
    r = kit(env, *command, "--tp", "3", *run, lock=lock)
    assert r.returncode == kit_hub.EXIT_NOT_FOUND, r.stderr  # bad input: 2
    assert "refused before downloading the weights" in r.stderr
    assert "not divisible by tensor parallel size 3" in r.stderr
    assert loopback.file_requests(SHARD) == [], "no shard was requested"


def test_unknown_repository(env, lock: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "validate", "fetch", "--target-repo", "kit-test/nope",
                        "--draft-repo", HEAD, "--lock-file", str(lock)], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == kit_hub.EXIT_NOT_FOUND, r.stderr
    assert "kit-test/nope was not found" in r.stderr


def test_unknown_revision(env, lock: Path) -> None:
    data = json.loads(lock.read_text())
    data["repos"][TARGET]["revision"] = "0" * 40
    lock.write_text(json.dumps(data))
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == kit_hub.EXIT_NOT_FOUND, r.stderr
    assert f"{TARGET} has no revision '{'0' * 40}'" in r.stderr


def test_corrupted_file_is_caught_removed_and_fetched_again(env, lock: Path, tmp_path: Path,
                                                            loopback: Hub) -> None:
    assert kit(env, "fetch", lock=lock).returncode == 0
    shard = _shard_path(tmp_path, lock)
    blob = shard.resolve()
    with open(blob, "r+b") as f:  # one flipped byte in the middle of the shard
        f.seek(blob.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == kit_hub.EXIT_VERIFY, r.stderr
    assert f"{SHARD}: sha256" in r.stderr and "run the same command again" in r.stderr
    assert not shard.exists() and not blob.exists(), "a corrupted file must not look complete"
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == 0, r.stderr
    assert len(loopback.file_requests(SHARD, TARGET)) == 2


def test_broken_connection_resumes_where_it_stopped(env, lock: Path, loopback: Hub) -> None:
    loopback.drop_once[SHARD] = 20 << 20  # the connection breaks after 20 MiB of the 27 MB shard
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == 0, r.stderr
    first, second = loopback.file_requests(SHARD, TARGET)
    assert first["sent"] >= 20 << 20 and first["sent"] < first["size"]
    # the kit has the client write 1 MiB chunks: it resumes after the last whole one it received
    assert first["sent"] - (1 << 20) <= second["range_start"] <= first["sent"], "resumed"


def test_a_connection_dropped_in_the_first_chunk_resumes_too(env, lock: Path, loopback: Hub) -> None:
    """huggingface_hub resumes from the whole chunks it wrote (10 MiB by default): a drop 5 MiB
    into the shard restarted it at byte 0. The kit fetches in 1 MiB chunks."""
    loopback.drop_once[SHARD] = 5 << 20
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == 0, r.stderr
    first, second = loopback.file_requests(SHARD, TARGET)
    assert first["sent"] >= 5 << 20
    assert second["range_start"] >= (5 << 20) - (1 << 20), f"restarted at {second['range_start']}"


def test_killed_fetch_keeps_finished_files_and_refetches_only_the_partial_one(
        env, lock: Path, loopback: Hub, tmp_path: Path) -> None:
    """huggingface_hub >= 2 discards a partial file whose process died (each download writes a
    process-unique temp file, huggingface_hub PR 4228), so the unit of resumption is the file:
    finished files stay, the file in flight starts again."""
    loopback.throttle[SHARD] = 0.01  # 64 KiB per 10 ms: the shard takes a few seconds
    proc = kit(env, "fetch", lock=lock, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(e["sent"] > 4 << 20 for e in loopback.file_requests(SHARD, TARGET)):
        assert time.monotonic() < deadline and proc.poll() is None, "download never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # as hard as an interruption gets
    proc.wait()
    first = loopback.file_requests(SHARD, TARGET)[0]
    assert first["sent"] < first["size"]
    assert not _shard_path(tmp_path, lock).exists(), "a partial shard must not look complete"
    finished = {(e["repo"], e["path"]) for e in loopback.log
                if e["method"] == "GET" and e["sent"] == e["size"]}
    assert finished, "the small files finished before the interruption"
    n_log = len(loopback.log)
    loopback.throttle.clear()
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == 0, r.stderr
    again = {(e["repo"], e["path"]) for e in loopback.log[n_log:] if e["method"] == "GET"}
    assert (TARGET, SHARD) in again
    assert not again & finished, "finished files are not fetched again"


def test_disk_check_refuses_before_downloading(env, lock: Path, loopback: Hub,
                                               tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)],
                             capture_output=True, check=False)
    assert mounted.returncode == 0, f"this test mounts a small tmpfs (as root): {mounted.stderr!r}"
    try:
        r = kit(env, "fetch", "--cache-dir", str(small), lock=lock)
        assert r.returncode == kit_hub.EXIT_DISK, r.stderr
        assert "not enough disk" in r.stderr and "MiB are free" in r.stderr
        assert loopback.file_requests(SHARD) == [], "nothing was downloaded"
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_offline_uses_only_the_disk_and_lists_what_is_missing(env, lock: Path, loopback: Hub,
                                                              models, tmp_path: Path) -> None:
    # `lock` downloaded the small files to hash them; the shard was never fetched
    r = kit(env, "fetch", "--offline", lock=lock)
    assert r.returncode == kit_hub.EXIT_OFFLINE, r.stderr
    files = len(list(models.target.iterdir()))
    assert f"{TARGET}@" in r.stderr and f"lacks 1 of {files} files on disk: {SHARD}" in r.stderr
    assert kit(env, "fetch", lock=lock).returncode == 0
    n_log = len(loopback.log)
    dead = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    r = kit(dead, "fetch", "--offline", lock=lock)
    assert r.returncode == 0, r.stderr
    assert len(loopback.log) == n_log, "offline made no request"
    _shard_path(tmp_path, lock).unlink()
    r = kit(dead, "fetch", "--offline", lock=lock)
    assert r.returncode == kit_hub.EXIT_OFFLINE, r.stderr
    assert "lacks 1 of" in r.stderr and SHARD in r.stderr


def test_local_dir_holds_plain_folders_and_works_offline(env, lock: Path, loopback: Hub,
                                                         tmp_path: Path) -> None:
    from validate.e2e.test_llama4_eagle_tp8 import _revision

    models = tmp_path / "models"
    r = kit(env, "fetch", "--local-dir", str(models), lock=lock)
    assert r.returncode == 0, r.stderr
    target = models / TARGET.replace("/", "--")
    assert (target / SHARD).is_file() and not (target / SHARD).is_symlink()
    assert _revision(str(target)) == loopback.repos[TARGET].sha
    dead = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}
    r = kit(dead, "fetch", "--offline", "--local-dir", str(models), lock=lock)
    assert r.returncode == 0, r.stderr


# ---- hostile and careless inputs: nothing outside the model folder is read, written or removed


def _tree_digest(folder: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A folder outside every model folder, with a file a hostile lock aims at."""
    folder = tmp_path / "outside"
    (folder / "x").mkdir(parents=True)
    (folder / "x" / "rel.txt").write_text("do not touch")
    return folder


def _sha(path: Path) -> dict[str, object]:
    import hashlib

    return {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _hostile_locks(lock: Path, sentinel: Path) -> dict[str, tuple[str, str]]:
    """name -> (lock file text, what the refusal names)."""
    good = json.loads(lock.read_text())
    target = sentinel / "x" / "rel.txt"

    def with_target(**change: object) -> str:
        data = json.loads(json.dumps(good))
        data["repos"][TARGET].update(change)
        return json.dumps(data)

    files = good["repos"][TARGET]["files"]
    no_sha = {n: {"size": f["size"]} for n, f in files.items()}
    return {
        # the sentinel's own size and sha256: before the fix these "verified" (and a mismatch
        # deleted them)
        "traversal": (with_target(files={**files, "../../../outside/x/rel.txt": _sha(target)}),
                      "is not a path inside the repository"),
        "absolute": (with_target(files={**files, str(target): _sha(target)}),
                     "is not a path inside the repository"),
        "bad-revision": (with_target(revision="../../../outside/x"), "is not a 40-hex commit"),
        "not-json": ("{repos: ", "is not JSON"),
        "repos-a-list": (json.dumps({"schema": 1, "repos": [TARGET]}), "'repos' (an object"),
        "no-revision": (json.dumps({"schema": 1, "repos": {TARGET: {"files": files}}}),
                        "revision None is not a 40-hex commit"),
        "no-sha256": (with_target(files=no_sha), ".sha256: None is not a sha256"),
        "no-files": (with_target(files={}), "a repository pinned with no files is no pin"),
        # valid JSON nested deeper than Python's parser goes: a RecursionError traceback, exit 1
        "nested-100000-deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    }


HOSTILE = ["traversal", "absolute", "bad-revision", "not-json", "repos-a-list", "no-revision",
           "no-sha256", "no-files", "nested-100000-deep"]


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_or_broken_lock_is_refused_and_lock_repairs_it(env, lock: Path, loopback: Hub,
                                                                  sentinel: Path, case: str) -> None:
    text, says = _hostile_locks(lock, sentinel)[case]
    before = _tree_digest(sentinel)
    lock.write_text(text)
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == Exit.BAD_INPUT, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert loopback.file_requests(SHARD) == [], "refused before any download"
    assert _tree_digest(sentinel) == before, "something outside the model folder was touched"
    # the documented repair works on the same file: good pins kept, the broken ones rewritten
    r = kit(env, "lock", lock=lock)
    assert r.returncode == 0, r.stderr
    assert kit(env, "fetch", lock=lock).returncode == 0
    assert _tree_digest(sentinel) == before


def test_a_hub_listing_a_name_outside_the_repository_is_refused(env, loopback: Hub, models,
                                                                sentinel: Path,
                                                                tmp_path: Path) -> None:
    loopback.publish(HEAD, models.head, extra={"../../x/rel.txt": b"\0" * 64,
                                               "../x.safetensors": b"\0" * 64})
    before = _tree_digest(sentinel)
    path = tmp_path / "weights.lock.json"
    r = kit(env, "lock", lock=path)
    assert r.returncode == Exit.BAD_INPUT, r.stderr
    assert "is not a path inside the repository" in r.stderr and "Traceback" not in r.stderr
    assert not path.exists(), "nothing written into the lock"
    assert _tree_digest(sentinel) == before and not list(tmp_path.rglob("x.safetensors"))


def test_a_link_that_leaves_the_model_folder_is_neither_read_nor_removed(
        env, lock: Path, loopback: Hub, sentinel: Path, tmp_path: Path) -> None:
    """A --local-dir file replaced by a link to a file outside, whose size and sha256 the lock
    carries: not verified, not deleted, named."""
    models = tmp_path / "models"
    assert kit(env, "fetch", "--local-dir", str(models), lock=lock).returncode == 0
    outside = sentinel / "x" / "rel.txt"
    config = models / TARGET.replace("/", "--") / "config.json"
    config.unlink()
    config.symlink_to(outside)
    data = json.loads(lock.read_text())
    data["repos"][TARGET]["files"]["config.json"] = _sha(outside)
    lock.write_text(json.dumps(data))
    before = _tree_digest(sentinel)
    r = kit(env, "fetch", "--offline", "--local-dir", str(models), lock=lock)
    assert r.returncode == Exit.VERIFY_FAILED, r.stderr
    assert "config.json: a link that leaves the model folder" in r.stderr, r.stderr
    assert _tree_digest(sentinel) == before and config.is_symlink()


@pytest.mark.parametrize("revision", ["../../../outside/x", "/etc", "main/../../x"])
def test_lock_refuses_a_revision_that_is_not_a_ref(env, tmp_path: Path, sentinel: Path,
                                                   revision: str) -> None:
    before = _tree_digest(sentinel)
    path = tmp_path / "weights.lock.json"
    r = kit(env, "lock", "--revision", revision, lock=path)
    assert r.returncode == Exit.BAD_INPUT and "is not a branch, tag or commit name" in r.stderr
    assert not path.exists() and _tree_digest(sentinel) == before


def test_a_lock_file_that_cannot_be_written_is_bad_input(env, tmp_path: Path) -> None:
    """`lock --lock-file /proc/x` ended in an OSError traceback (exit 1)."""
    r = kit(env, "lock", lock=Path("/proc/kit-lock/weights.lock.json"))
    assert r.returncode == Exit.BAD_INPUT, r.stderr
    assert "cannot be written" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_damaged_kit_state_is_never_a_traceback(env, lock: Path, loopback: Hub,
                                                sentinel: Path) -> None:
    """The kit's own records under VALIDATE_CACHE are not trusted either: a damaged verification
    record means hashing again; a resolved revision of `../../x` is refused (exit 2), never used
    as a path."""
    state = Path(env["VALIDATE_CACHE"])
    assert kit(env, "fetch", lock=lock).returncode == 0
    for f in (state / "verified").glob("*.json"):
        f.write_text("[" * 50_000)
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == 0 and "ignoring a damaged verification record" in r.stderr, r.stderr
    before = _tree_digest(sentinel)
    resolved = state / "resolved" / f"{TARGET.replace('/', '--')}.json"
    data = json.loads(resolved.read_text())
    resolved.write_text(json.dumps({**data, "revision": "../../../outside/x"}))
    r = kit(env, "fetch", "--offline")  # unpinned: the offline fetch reads what was resolved
    assert r.returncode == Exit.BAD_INPUT, r.stderr
    assert "is damaged" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _tree_digest(sentinel) == before


def test_an_explicit_lock_file_that_does_not_exist_is_an_error(env, tmp_path: Path) -> None:
    r = kit(env, "fetch", lock=tmp_path / "weigths.lock.json")  # a typo, not "unpinned"
    assert r.returncode == Exit.BAD_INPUT and "cannot be read" in r.stderr, r.stderr


# ---- every hub failure: one line, its documented code, no traceback


@pytest.mark.parametrize(("failure", "code", "says"), [
    ("unreachable", Exit.HUB_FAILED, "could not be reached"),
    ("401", Exit.NO_ACCESS, "the hub refused the token (401)"),
    ("500", Exit.HUB_FAILED, "the hub answered 500"),
    ("size-mismatch", Exit.VERIFY_FAILED, "did not match the size the hub announced"),
    ("truncated", Exit.HUB_FAILED, "the transfer broke"),
])
def test_a_hub_failure_ends_with_one_line_and_its_code(env, lock: Path, loopback: Hub, failure: str,
                                                       code: Exit, says: str, models) -> None:
    if failure == "unreachable":
        env = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there
    elif failure in ("401", "500"):
        loopback.refuse[TARGET] = int(failure)
    elif failure == "size-mismatch":  # the hub claims a smaller shard than it sends
        loopback.announce[SHARD] = (models.target / SHARD).stat().st_size - 1000
    else:
        loopback.drop_always.add(SHARD)
    r = kit(env, "fetch", lock=lock)
    assert r.returncode == code, r.stderr[-3000:]
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]


def test_ctrl_c_during_a_download_stops_within_seconds_and_says_what_is_kept(
        env, lock: Path, loopback: Hub) -> None:
    loopback.throttle[SHARD] = 0.2  # 64 KiB per 200 ms: the shard would take about 90 s
    proc = kit(env, "fetch", lock=lock, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(e["sent"] > 0 for e in loopback.file_requests(SHARD, TARGET)):
        assert time.monotonic() < deadline and proc.poll() is None, "download never started"
        time.sleep(0.05)
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - t
    assert proc.returncode == Exit.INTERRUPTED, err[-3000:]
    assert seconds < 10, f"took {seconds:.1f} s to stop"
    assert "files of kit-test/tiny-llama4 are complete and kept in" in err and "Traceback" not in err
