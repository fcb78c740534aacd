"""Build and run the kit's images through the Docker SDK: one small class owns the engine.

Host side. The image tag is a hash of every build input (Dockerfile, the kit's sources, the
requirements, build arguments), so an unchanged kit is never rebuilt. Runs mount the model folders
read-only and the run folder writable, stream the logs, enforce a timeout, and always remove the
container (Ctrl-C included). The engine side reads weights from disk only, so no Hugging Face token
ever enters an image or a container: it stays on the host, where fetching happens.

docker-py speaks to the engine's API (no BuildKit: the legacy builder's events are streamed).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS = ROOT / "containers"
PINS = CONTAINERS / "pins.toml"
KIT_FILES = ["pyproject.toml", "README.md", "requirements", "validate"]
IMAGE_REPO = "llama4-eagle-validate"


class ContainerError(RuntimeError):
    pass


# What the end-to-end script's container gets: the run folder writable, each model folder
# read-only, no network, no token (weights are read from disk; the token stays on the host).
RUN_FOLDER = "/run-record"
E2E_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def model_mount(path: str | Path, role: str) -> tuple[str, str, str]:
    """(host folder to mount, where it goes, the model's path inside) for a model folder.

    A Hugging Face cache snapshot (``models--org--name/snapshots/<commit>``) holds relative links
    into ``../../blobs``: mounting the snapshot alone leaves every file a dangling link, so the
    whole repository folder is mounted and the snapshot is addressed inside it (its commit stays
    in the path, where the record reads it). A generated pair is mounted whole (its manifest
    beside the models names its fingerprint). Anything else is mounted as it is, links resolved.
    """
    p = Path(path).absolute()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        repo = p.parent.parent
        return str(repo), f"/models/{role}", f"/models/{role}/snapshots/{p.name}"
    if (p.parent / "pair.json").is_file():
        return str(p.parent), "/models/pair", f"/models/pair/{p.name}"
    return str(p.resolve()), f"/models/{role}", f"/models/{role}"


def e2e_mounts(run_dir: Path, models: dict[str, str]) -> tuple[dict[str, tuple[str, str]],
                                                                dict[str, str]]:
    """(mounts, model paths inside) for a run: ``models`` maps role (target, draft) to folder."""
    mounts = {str(Path(run_dir).absolute()): (RUN_FOLDER, "rw")}
    inside = {}
    for role, path in models.items():
        host, dst, model = model_mount(path, role)
        mounts[host] = (dst, "ro")
        inside[role] = model
    return mounts, inside


def pins() -> dict[str, dict[str, str]]:
    return tomllib.loads(PINS.read_text())


def base_reference(kind: str, override: str | None = None) -> tuple[str, bool]:
    """(image reference to build FROM, pinned?). Never invents a digest."""
    if override:
        return override, "@sha256:" in override
    pin = pins()[kind]
    if pin.get("digest"):
        return f"{pin['base'].split(':')[0]}@{pin['digest']}", True
    return pin["base"], False


def refresh_pins(engine: Engine, log: Callable[[str], None] = print) -> dict[str, str]:
    """Ask the registry for each base's current digest and write it into ``pins.toml``.

    Needs a registry (Docker Hub); written by hand as a text edit so the file's comments stay.
    """
    import re

    text = PINS.read_text()
    got = {}
    for kind, pin in pins().items():
        digest = engine.client.images.get_registry_data(pin["base"]).id
        got[kind] = digest
        section = re.compile(rf"(\[{kind}\][^\[]*?digest = )\"[^\"]*\"", re.S)
        text = section.sub(lambda m, d=digest: f'{m.group(1)}"{d}"', text, count=1)
        log(f"{kind}: {pin['base']} -> {digest}")
    PINS.write_text(text)
    return got


def _files(paths: list[Path]) -> Iterator[Path]:
    for p in paths:
        if p.is_dir():
            yield from sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
        elif p.is_file():
            yield p


def input_hash(kind: str, buildargs: dict[str, str], extra: list[Path]) -> str:
    """Hash of everything that goes into the image: an unchanged kit maps to the same tag."""
    h = hashlib.sha256()
    for k in sorted(buildargs):
        h.update(f"{k}={buildargs[k]}\n".encode())
    for f in _files([CONTAINERS / kind, *(ROOT / n for n in KIT_FILES), *extra]):
        h.update(str(f.relative_to(f.anchor)).encode() if f.is_absolute() and not f.is_relative_to(ROOT)
                 else str(f.relative_to(ROOT)).encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


@dataclass
class RunResult:
    exit_code: int | None  # None: timed out
    image: str
    image_id: str


class Engine:
    """The Docker engine: facts for preflight, builds, runs."""

    def __init__(self, base_url: str | None = None) -> None:
        import docker

        try:
            self.client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
            self.client.ping()
        except Exception as exc:  # docker.errors.DockerException, connection errors
            where = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
            cause = "no socket there" if "FileNotFoundError" in str(exc) else str(exc)[:160]
            raise ContainerError(f"no Docker engine at {where} ({cause}); is the daemon running? "
                                 "set DOCKER_HOST if it listens elsewhere") from exc

    def info(self) -> dict[str, Any]:
        return self.client.info()

    def image_exists(self, tag: str) -> bool:
        import docker

        try:
            self.client.images.get(tag)
            return True
        except docker.errors.ImageNotFound:
            return False

    def build(self, kind: str, *, base: str, labels: dict[str, str], ca_bundle: Path | None = None,
              wheelhouse: Path | None = None, network: str | None = None,
              log: Callable[[str], None] = print) -> str:
        """Build ``containers/<kind>/Dockerfile`` on ``base``; return the tag. Skipped (a few ms) when
        an image with the same input hash exists."""
        buildargs = {"BASE_IMAGE": base}
        oci = {"org.opencontainers.image.title": f"{IMAGE_REPO}-{kind}",
               "org.opencontainers.image.version": labels.get("kit_version", "unknown"),
               "org.opencontainers.image.revision": labels.get("git_commit", "unknown"),
               "org.opencontainers.image.base.name": base,
               "org.opencontainers.image.base.digest": labels.get("base_digest", "unpinned"),
               "io.vllm.version": labels.get("vllm_version", "unknown")}
        extra = [p for p in (ca_bundle, wheelhouse) if p]
        tag = f"{IMAGE_REPO}/{kind}:{input_hash(kind, {**buildargs, **oci}, extra)}"
        if self.image_exists(tag):
            log(f"image {tag} is up to date (inputs unchanged): not rebuilt")
            return tag
        with self._context(kind, ca_bundle, wheelhouse) as ctx:
            log(f"building {tag} from {base} (context {ctx})")
            stream = self.client.api.build(path=str(ctx), dockerfile=f"containers/{kind}/Dockerfile",
                                           tag=tag, buildargs=buildargs, labels=oci, rm=True,
                                           forcerm=True,
                                           network_mode=network, decode=True)
            for event in stream:
                if "stream" in event and event["stream"].strip():
                    log(event["stream"].rstrip())
                if "error" in event:
                    raise ContainerError(f"building {tag} failed: {event['error'].strip()}")
        return tag

    @contextmanager
    def _context(self, kind: str, ca_bundle: Path | None, wheelhouse: Path | None) -> Iterator[Path]:
        """A minimal build context: the kit, the Dockerfile, optional CA bundle and wheelhouse."""
        ctx = Path(tempfile.mkdtemp(prefix="kit-build-"))
        (ctx / "kit").mkdir()
        try:
            for name in KIT_FILES:  # under kit/, so one COPY brings it (each layer costs a copy
                src = ROOT / name  # of the whole filesystem on the vfs storage driver)
                if src.is_dir():
                    shutil.copytree(src, ctx / "kit" / name, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(src, ctx / "kit" / name)
            shutil.copytree(CONTAINERS / kind, ctx / "containers" / kind)
            (ctx / "build-extras" / "wheelhouse").mkdir(parents=True)
            (ctx / "build-extras" / "ca").mkdir(parents=True)
            if ca_bundle:
                shutil.copy2(ca_bundle, ctx / "build-extras" / "ca" / "ca-bundle.crt")
            if wheelhouse:
                for whl in Path(wheelhouse).glob("*.whl"):
                    shutil.copy2(whl, ctx / "build-extras" / "wheelhouse" / whl.name)
            yield ctx
        finally:
            shutil.rmtree(ctx, ignore_errors=True)

    def run(self, tag: str, command: list[str], *, mounts: dict[str, tuple[str, str]],
            environment: dict[str, str], gpus: int = 0, timeout_s: float = 7200,
            network: str = "none", log: Callable[[str], None] = print) -> RunResult:
        """Run ``command`` in ``tag``; stream its logs; remove the container whatever happens."""
        import docker
        from docker.types import DeviceRequest, Ulimit

        kwargs: dict[str, Any] = dict(
            command=command, environment=environment, network_mode=network,
            volumes={host: {"bind": dst, "mode": mode} for host, (dst, mode) in mounts.items()},
            ipc_mode="host",  # NCCL / vLLM's TP workers share memory through /dev/shm
        )
        if gpus:
            kwargs["device_requests"] = [DeviceRequest(count=gpus, capabilities=[["gpu"]])]
            # what vLLM's docs ask of GPU containers (pinned memory for NCCL, deep stacks)
            kwargs["ulimits"] = [Ulimit(name="memlock", soft=-1, hard=-1),
                                 Ulimit(name="stack", soft=67108864, hard=67108864)]
        container = self.client.containers.create(tag, **kwargs)
        try:
            container.start()

            def pump() -> None:
                for chunk in container.logs(stream=True, follow=True):
                    log(chunk.decode(errors="replace").rstrip("\n"))

            t = threading.Thread(target=pump, daemon=True)
            t.start()
            try:
                status = container.wait(timeout=timeout_s)
                code: int | None = int(status.get("StatusCode", -1))
            except KeyboardInterrupt:
                # SIGTERM first: the engine side records the interruption and stops its workers
                log("interrupted: stopping the container (30 s to shut down, then killed)")
                container.stop(timeout=30)
                raise
            except Exception as exc:  # requests' ReadTimeout when the run outlives timeout_s
                if "timed out" not in str(exc).lower() and "timeout" not in type(exc).__name__.lower():
                    raise
                log(f"container ran past {timeout_s:.0f}s: stopping it")
                container.stop(timeout=30)
                code = None
            t.join(timeout=10)
            return RunResult(code, tag, container.image.id)
        finally:
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass
