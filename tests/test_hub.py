"""Fetch against a real HTTP server on loopback that speaks the hub's protocol (tests/hubserver.py):
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
from hubserver import Hub, serve

from validate import hub as kit_hub

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
    r = kit(env, "fetch", lock=tmp_path / "empty.lock.json")
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


def test_a_tp_size_the_config_rules_out_is_refused_before_any_shard(env, lock: Path,
                                                                     loopback: Hub) -> None:
    """TP=3 against 8 attention heads: the configs come first, the refusal before any weights."""
    r = kit(env, "fetch", "--tp", "3", lock=lock)
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
    # the client writes 10 MiB chunks: it resumes after the last whole chunk it received
    assert 10 << 20 <= second["range_start"] <= first["sent"], "resumed, not restarted"


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
