"""A Hugging Face hub on loopback, speaking the hub's HTTP protocol to huggingface_hub.

Host side. ``rehearse --full`` publishes the tiny pair on it and takes the real run's path (lock,
fetch into the Hugging Face cache, verify) through the same huggingface_hub calls as
huggingface.co; the fetch tests use it with their own repositories. Only ``HF_ENDPOINT`` differs.

Written by hand because no maintained package serves it offline: olah (a hub mirror) answered 401
for local mirrors in offline mode and gives no file sizes or sha256 (FACTS.md). This serves what
``snapshot_download`` / ``hf_hub_download`` / ``HfApi.auth_check`` ask for (huggingface_hub 2.x):

- ``GET /api/models/{repo}[/revision/{rev}]``: repo info with the commit ``sha``;
- ``GET /api/models/{repo}/tree/{rev}``: files with size, git blob oid and LFS sha256;
- ``GET /api/models/{repo}/auth-check``: 200, or 403 ``GatedRepo`` without an allowed token;
- ``HEAD|GET /{repo}/resolve/{rev}/{path}``: file bytes with ``X-Repo-Commit``, ``ETag``,
  ``X-Linked-Etag``/``X-Linked-Size`` for LFS files, and ``Range`` requests (resume);
- errors as the hub sends them: ``X-Error-Code`` RepoNotFound / RevisionNotFound / EntryNotFound /
  GatedRepo.

Repositories are folders on disk published at a made-up commit sha. Every file request is logged
(path, Range start, bytes sent) so tests can see what was (not) downloaded again; ``throttle``
slows one file down so a test can interrupt a download in the middle; ``drop_once`` breaks one
transfer of a file after some bytes, as a flaky network does; ``drop_always`` breaks every one,
``refuse`` answers every request for a repository with an HTTP error, ``announce`` claims
another size for a file than the bytes it sends.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin")


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    gated: bool = False
    allowed_tokens: set[str] = field(default_factory=set)


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)
    throttle: dict[str, float] = field(default_factory=dict)  # path -> seconds per 64 KiB chunk
    drop_once: dict[str, int] = field(default_factory=dict)  # path -> close the connection after N bytes
    drop_always: set[str] = field(default_factory=set)  # paths whose every transfer breaks at once
    refuse: dict[str, int] = field(default_factory=dict)  # repo -> HTTP status of every answer
    announce: dict[str, int] = field(default_factory=dict)  # path -> size the hub claims it has
    url: str = ""

    def publish(self, repo_id: str, folder: Path, *, gated: bool = False,
                allowed_tokens: set[str] | None = None,
                extra: dict[str, bytes] | None = None) -> str:
        """Serve ``folder``'s files (plus ``extra``: name -> bytes) as ``repo_id`` at a commit sha
        derived from their content; returns the sha."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        files.update(extra or {})
        h = hashlib.sha1(repo_id.encode())
        for name, data in files.items():
            h.update(name.encode() + hashlib.sha256(data).digest())
        sha = h.hexdigest()
        self.repos[repo_id] = Repo(files, sha, gated, allowed_tokens or set())
        return sha

    def file_requests(self, path: str, repo: str | None = None) -> list[dict[str, Any]]:
        """The GETs of one file (of one repository, or of any)."""
        return [e for e in self.log if e["method"] == "GET" and e["path"] == path
                and repo in (None, e["repo"])]


def _blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    # ---- helpers
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message})

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if status := self.hub.refuse.get(repo_id):
            self._error(status, "", f"refused with {status} (loopback hub's refuse)")
            return None
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated:
            auth = self.headers.get("Authorization", "")
            token = auth.removeprefix("Bearer ").strip()
            if token not in repo.allowed_tokens:
                self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are "
                            "not in the authorized list. Visit the repo page to ask for access.")
                return None
        return repo

    def _revision_ok(self, repo: Repo, rev: str) -> bool:
        if unquote(rev) in ("main", repo.sha):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
        return False

    # ---- routes
    API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?|/(auth-check))?$")
    RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if m := self.API.match(path):
            repo_id, kind, rev, _sub, auth = m.groups()
            repo = self._repo(repo_id)
            if repo is None:
                return
            if auth:
                return self._send(200, b"{}")
            if rev is not None and not self._revision_ok(repo, rev):
                return
            if kind == "tree":
                return self._tree(repo)
            info = {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                    "gated": "manual" if repo.gated else False,
                    "siblings": [{"rfilename": f} for f in repo.files]}
            return self._send(200, json.dumps(info).encode())
        if m := self.RESOLVE.match(path):
            repo_id, rev, file = m.groups()
            repo = self._repo(repo_id)
            if repo is None or not self._revision_ok(repo, rev):
                return
            file = unquote(file)
            if file not in repo.files:
                return self._error(404, "EntryNotFound", f"{file} does not exist on {rev}")
            return self._file(repo_id, repo, file)
        self._error(404, "RepoNotFound", "Not Found")

    def _tree(self, repo: Repo) -> None:
        entries = []
        for name, data in repo.files.items():
            e: dict[str, Any] = {"type": "file", "path": name, "size": len(data), "oid": _blob_oid(data)}
            if name.endswith(LFS_SUFFIXES):
                size = self.hub.announce.get(name, len(data))
                e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
            entries.append(e)
        self._send(200, json.dumps(entries).encode())

    def _file(self, repo_id: str, repo: Repo, name: str) -> None:
        data = repo.files[name]
        lfs = name.endswith(LFS_SUFFIXES)
        etag = hashlib.sha256(data).hexdigest() if lfs else _blob_oid(data)
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if lfs:
            size = self.hub.announce.get(name, len(data))
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(size)})
        start = 0
        if (rng := self.headers.get("Range")) and (m := re.match(r"bytes=(\d+)-", rng)):
            start = int(m.group(1))
        entry = {"method": self.command, "repo": repo_id, "path": name, "range_start": start,
                 "sent": 0, "size": len(data)}
        self.hub.log.append(entry)
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        delay = self.hub.throttle.get(name, 0.0)
        drop = 0 if name in self.hub.drop_always else self.hub.drop_once.pop(name, None)
        try:
            for i in range(0, len(body), 65536):
                if drop is not None and entry["sent"] >= drop:
                    self.close_connection = True
                    self.connection.shutdown(2)  # mid-body: the client sees a broken transfer
                    return
                self.wfile.write(body[i:i + 65536])
                entry["sent"] += len(body[i:i + 65536])
                if delay:
                    self.wfile.flush()
                    time.sleep(delay)
        except (BrokenPipeError, ConnectionResetError):
            pass


def serve(hub: Hub) -> tuple[ThreadingHTTPServer, threading.Thread]:
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@contextmanager
def serving(hub: Hub) -> Iterator[Hub]:
    """``hub`` served on a free loopback port (``hub.url``) for the block's duration."""
    server, thread = serve(hub)
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
