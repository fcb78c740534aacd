"""The multi-node rehearsal's cluster on one Docker engine (issue 25): one container per node of
the same image on a bridge network the kit creates, a Ray head on node 0, Ray workers on the
others; every container and the network removed at the end, Ctrl-C and a lost node included.

Host side. vLLM's own CI emulates nodes this way (one container per node on a Docker bridge
network, a Ray head and workers: `.buildkite/scripts/run-multi-node-test.sh` upstream). The
end-to-end script runs on node 0 (the head): it checks every node through Ray and starts the
engines across them (validate/e2e/nodes.py). A worker container that stops while the run goes on
is a lost node: node 0 is killed at once (an engine whose peer is gone can wait on it for a long
time), and the run ends broken (exit 4) with the phase it was in.

Ray is started with its own command (`ray start`), not a hand-written launcher.
"""

from __future__ import annotations

import contextlib
import shlex
import threading
from collections.abc import Callable
from typing import Any

from validate.containers import ContainerError, Engine

RAY_PORT = 6379
# How often the worker containers are looked at while the run goes on.
WATCH_S = 2.0


def ray_start(head: str | None, cpus: int) -> str:
    """The ``ray start`` line of a node: the head's (``head`` None) or a worker's joining it."""
    common = f"--num-cpus={cpus} --disable-usage-stats"
    if head is None:  # no dashboard: nothing reads it, and it costs a process and a port
        return f"ray start --head --port={RAY_PORT} --include-dashboard=false {common}"
    return f"ray start --address={head}:{RAY_PORT} {common}"


class Cluster:
    """``nodes`` containers of ``tag``: ``head_command`` is node 0's, to run with
    ``Engine.run(..., network=cluster.network, name=cluster.head)``; the workers are started here.
    Use as a context manager: the workers and the network are removed on leaving it."""

    def __init__(self, engine: Engine, tag: str, nodes: int, run_id: str, *,
                 mounts: dict[str, tuple[str, str]], environment: dict[str, str], user: str,
                 cpus: int, log: Callable[[str], None] = print) -> None:
        self.engine, self.tag, self.nodes = engine, tag, nodes
        self.network = f"kit-{run_id}"
        self.head = f"kit-{run_id}-node0"
        self.workers = [f"kit-{run_id}-node{i}" for i in range(1, nodes)]
        self.mounts, self.environment, self.user, self.cpus = mounts, environment, user, cpus
        self.log = log
        self.lost: str | None = None
        self._containers: list[Any] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def head_command(self, e2e: list[str]) -> list[str]:
        """Node 0: the Ray head, then the end-to-end script in its place (signals reach it)."""
        return ["bash", "-c", f"{ray_start(None, self.cpus)} >/tmp/ray-start.log 2>&1 || "
                f"{{ cat /tmp/ray-start.log; exit 3; }}; exec {shlex.join(e2e)}"]

    def __enter__(self) -> Cluster:
        client = self.engine.client
        client.networks.create(self.network, driver="bridge", labels={"kit.run": self.network})
        self.log(f"[cluster] network {self.network}: node 0 {self.head} (Ray head, the "
                 f"end-to-end script), workers {', '.join(self.workers)}")
        try:
            for name in self.workers:
                # a worker joins once the head answers (it starts with node 0's container)
                join = (f"until {ray_start(self.head, self.cpus)} >/tmp/ray-start.log 2>&1; "
                        "do sleep 2; done; echo joined; exec sleep infinity")
                self._containers.append(self.engine.start_detached(
                    self.tag, ["bash", "-c", join], name=name, network=self.network,
                    mounts=self.mounts, environment=self.environment, user=self.user))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        """A worker that stops is a lost node: kill node 0 (the run ends there, broken)."""
        import docker

        while not self._stop.wait(WATCH_S):
            for c in self._containers:
                try:
                    c.reload()
                    state = c.attrs["State"]
                    gone = state.get("Status") != "running"
                    why = f"its container {state.get('Status')}, exit code {state.get('ExitCode')}"
                except docker.errors.NotFound:
                    gone, why = True, "its container was removed"
                if gone and self.lost is None:
                    self.lost = f"node {c.name} was lost ({why})"
                    self.log(f"[cluster] {self.lost}: stopping the run")
                    with contextlib.suppress(docker.errors.APIError):
                        self.engine.client.containers.get(self.head).kill()
                    return

    def describe(self) -> dict[str, Any]:
        """For the record: the network and each node's container."""
        return {"network": self.network, "nodes": [self.head, *self.workers],
                "lost": self.lost}

    def __exit__(self, *exc: object) -> None:
        import docker

        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        for c in self._containers:
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                c.remove(force=True)
        try:
            self.engine.client.networks.get(self.network).remove()
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:  # a container still attached: said, not hidden
            raise ContainerError(f"the network {self.network} could not be removed: {exc}") \
                from exc
