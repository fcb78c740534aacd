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
import re
import shutil
import tempfile
import threading
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validate.contract import EnvironmentProblem
from validate.files import atomic_write

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS = ROOT / "containers"
PINS = CONTAINERS / "pins.toml"
KIT_FILES = ["pyproject.toml", "README.md", "requirements", "validate"]
IMAGE_REPO = "llama4-eagle-validate"


class ContainerError(EnvironmentProblem):
    """No engine, a failed build, a registry that gave no digest: the environment's fault."""


# What the end-to-end script's container gets: the run folder writable, each model folder
# read-only, no network, no token (weights are read from disk; the token stays on the host). It
# runs as the invoking user (the run folder's files are theirs), who has no home in the image:
# HOME and USER point torch's and vLLM's caches (inductor keys its folder by getpass.getuser())
# into the container's /tmp, which is gone with the container.
RUN_FOLDER = "/run-record"
E2E_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "HOME": "/tmp",
                   "USER": "kit", "LOGNAME": "kit"}
# Without GPUs the container keeps a private IPC namespace; vLLM's CPU workers exchange tensors
# through /dev/shm (64 MB by default in Docker: too small for TP=8), so it gets this much.
CPU_SHM_BYTES = 2 << 30


def invoking_user() -> str:
    """``uid:gid`` of whoever runs the kit: the container runs as them."""
    return f"{os.getuid()}:{os.getgid()}"


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


def pins(path: Path | None = None) -> dict[str, dict[str, Any]]:
    return tomllib.loads(Path(path or PINS).read_text())


def repository(reference: str) -> str:
    """``reference`` without its tag or digest (a registry's port is not a tag)."""
    name = reference.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def base_reference(kind: str, override: str | None = None) -> tuple[str, bool]:
    """(image reference to build FROM, pinned?). Never invents a digest."""
    if override:
        return override, "@sha256:" in override
    pin = pins()[kind]
    if pin.get("digest"):
        return f"{repository(pin['base'])}@{pin['digest']}", True
    return pin["base"], False


def apt_packages(kind: str, path: Path | None = None) -> str:
    """``pkg=version ...`` of the kind's pinned Debian packages ("" where it pins none)."""
    pin = pins(path).get(kind, {})
    return " ".join(f"{name}={version}" for name, version in pin.get("apt", {}).items())


def apt_candidates(engine: Engine, image: str, packages: list[str]) -> dict[str, str]:
    """The version apt would install of each package in ``image`` today (its archive's)."""
    script = f"apt-get update -qq >/dev/null && apt-cache policy {' '.join(packages)}"
    out = engine.client.containers.run(image, ["sh", "-c", script], network_mode="host",
                                       remove=True).decode()
    found = dict(re.findall(r"^(\S+):\n\s+Installed: .*\n\s+Candidate: (\S+)", out, re.M))
    missing = [p for p in packages if found.get(p) in (None, "(none)")]
    if missing:
        raise ContainerError(f"apt in {image} knows no version of {', '.join(missing)}")
    return {p: found[p] for p in packages}


def refresh_pins(engine: Engine, path: Path | None = None,
                 log: Callable[[str], None] = print) -> dict[str, tuple[str, str]]:
    """Ask the registry for each base's current digest and write it into the pins file.

    Returns {kind: (old digest, new digest)} of what changed; an unchanged file is not rewritten.
    tomlkit edits the document in place, so the file's comments and layout stay.
    """
    import docker
    import tomlkit

    path = Path(path or PINS)
    doc = tomlkit.parse(path.read_text())
    changed: dict[str, tuple[str, str]] = {}
    for kind, pin in doc.items():
        if not isinstance(pin, dict) or "base" not in pin:
            continue
        ref = str(pin["base"])
        try:
            digest = engine.client.images.get_registry_data(ref).id
        except docker.errors.APIError as exc:
            raise ContainerError(f"{kind}: the registry gave no digest for {ref} "
                                 f"({str(exc).splitlines()[0][:200]}); is it reachable from the "
                                 "Docker engine, and does the tag exist?") from exc
        old = str(pin.get("digest", ""))
        if old == digest:
            log(f"{kind}: {ref} unchanged ({digest})")
        else:
            pin["digest"] = digest
            changed[kind] = (old, digest)
            log(f"{kind}: {ref} {old or 'unpinned'} -> {digest}")
        if "apt" in pin:  # the Debian packages the Dockerfile installs, at the new base's versions
            apt = pin["apt"]
            for name, version in apt_candidates(engine, f"{repository(ref)}@{digest}",
                                                list(apt)).items():
                if str(apt[name]) != version:
                    log(f"{kind}: apt {name} {apt[name] or 'unpinned'} -> {version}")
                    changed[f"{kind}.apt.{name}"] = (str(apt[name]), version)
                    apt[name] = version
    if changed:
        atomic_write(path, tomlkit.dumps(doc))
        log(f"wrote {path}: {len(changed)} pin(s) changed")
    else:
        log(f"{path}: no change")
    return changed


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
    host_config: dict[str, Any]  # as the engine applied it (user, IPC, mounts), for the record
    user: str


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
        if apt := apt_packages(kind):
            buildargs["APT_PACKAGES"] = apt
        oci = {"org.opencontainers.image.title": f"{IMAGE_REPO}-{kind}",
               "org.opencontainers.image.version": labels.get("kit_version", "unknown"),
               "org.opencontainers.image.revision": labels.get("git_commit", "unknown"),
               "org.opencontainers.image.base.name": base,
               "org.opencontainers.image.base.digest": labels.get("base_digest", "unpinned"),
               "io.vllm.version": labels.get("vllm_version", "unknown")}
        extra = [p for p in (ca_bundle, wheelhouse) if p]
        # What the base reference resolves to here: a tag that moved makes a new image.
        resolved = {"BASE_IMAGE_ID": self._base_id(base, log)}
        tag = f"{IMAGE_REPO}/{kind}:{input_hash(kind, {**buildargs, **oci, **resolved}, extra)}"
        if self.image_exists(tag):
            log(f"image {tag} is up to date (inputs unchanged): not rebuilt")
            return tag
        with self._context(kind, ca_bundle, wheelhouse) as ctx:
            log(f"building {tag} from {base} (context {ctx})")
            self._stream_build(tag, log, path=str(ctx), dockerfile=f"containers/{kind}/Dockerfile",
                               buildargs=buildargs, labels=oci, network_mode=network)
        return tag

    def _stream_build(self, tag: str, log: Callable[[str], None], **kwargs: Any) -> None:
        stream = self.client.api.build(tag=tag, rm=True, forcerm=True, decode=True, **kwargs)
        for event in stream:
            if "stream" in event and event["stream"].strip():
                log(event["stream"].rstrip())
            if "error" in event:
                raise ContainerError(f"building {tag} failed: {event['error'].strip()}")

    def python_output(self, tag: str, code: str) -> str:
        """What ``python3 -c code`` prints in image ``tag`` (a container without network, removed
        after): how the host asks an image about its own vLLM without importing it."""
        import docker

        try:
            return self.client.containers.run(tag, ["python3", "-c", code], network_mode="none",
                                              remove=True).decode()
        except docker.errors.DockerException as exc:
            raise ContainerError(f"python3 in {tag} failed: {str(exc)[:300]}") from exc

    def copy_out(self, tag: str, package: str, files: list[str], tree: Path) -> None:
        """Copy ``files`` (``vllm/...``) of the image's vLLM ``package`` folder into ``tree``;
        files the image does not have are skipped (a change may add them)."""
        import io
        import tarfile

        import docker

        container = self.client.containers.create(tag, ["true"], network_mode="none")
        try:
            for f in files:
                inside = f"{package}/{f.removeprefix('vllm/')}"
                try:
                    chunks, _ = container.get_archive(inside)
                except docker.errors.NotFound:
                    continue
                with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
                    member = tar.getmembers()[0]
                    data = tar.extractfile(member)
                    if data is None:  # a folder or link where a file was expected
                        raise ContainerError(f"{inside} in {tag} is not a plain file")
                    dst = tree / f
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(data.read())
        finally:
            container.remove(force=True)

    def build_change(self, base_tag: str, layer: Any, package: str,
                     log: Callable[[str], None] = print) -> str:
        """A layer over ``base_tag`` that lays ``layer`` (vllm_change.Layer) over the image's vLLM
        ``package``; its tag is the base's plus the change's key. Skipped when it exists."""
        change = layer.change
        tag = f"{base_tag}-{change.key}"
        if self.image_exists(tag):
            log(f"image {tag} (the change as a layer) is up to date: not rebuilt")
            return tag
        lines = [f"FROM {base_tag}"]
        if layer.replace:  # a wheel: its whole package instead of the image's
            lines += ["COPY vllm/ /tmp/kit-change-vllm/",
                      f"RUN rm -rf {package} && mv /tmp/kit-change-vllm {package}"]
        else:
            if (layer.tree / "vllm").is_dir():
                lines.append(f"COPY vllm/ {package}/")
            if layer.deleted:
                gone = " ".join(f"{package}/{f.removeprefix('vllm/')}" for f in layer.deleted)
                lines.append(f"RUN rm -f {gone}")
        (layer.tree / "Dockerfile").write_text("\n".join(lines) + "\n")
        labels = {"io.vllm.change.kind": change.kind, "io.vllm.change.key": change.key,
                  "io.vllm.change.files": " ".join(change.files_changed)[:2000]}
        log(f"building {tag}: {change.describe()}")
        self._stream_build(tag, log, path=str(layer.tree), dockerfile="Dockerfile", labels=labels,
                           network_mode="none")
        return tag

    def _base_id(self, base: str, log: Callable[[str], None]) -> str:
        """The local image id of ``base``, pulled first if it is not here; "unresolved" when no
        registry answers (the build then fails naming the base)."""
        import docker

        try:
            return self.client.images.get(base).id
        except docker.errors.ImageNotFound:
            pass
        try:
            log(f"pulling the base {base}")
            return self.client.images.pull(base).id
        except docker.errors.APIError as exc:
            log(f"could not pull {base}: {str(exc).splitlines()[0][:200]}")
            return "unresolved"

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

    @staticmethod
    def _create_args(command: list[str], environment: dict[str, str], network: str, user: str,
                     mounts: dict[str, tuple[str, str]], name: str | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            command=command, environment=environment, network_mode=network, user=user,
            volumes={host: {"bind": dst, "mode": mode} for host, (dst, mode) in mounts.items()},
        )
        if name:
            kwargs.update(name=name, hostname=name)
        return kwargs

    def start_detached(self, tag: str, command: list[str], *, name: str, network: str,
                       mounts: dict[str, tuple[str, str]], environment: dict[str, str],
                       user: str) -> Any:
        """Start a CPU container that runs on its own (a cluster's worker node); the caller
        removes it. Same mounts, user and shared memory as ``run``."""
        kwargs = self._create_args(command, environment, network, user, mounts, name)
        container = self.client.containers.create(tag, shm_size=CPU_SHM_BYTES, **kwargs)
        try:
            container.start()
        except BaseException:
            container.remove(force=True)
            raise
        return container

    def run(self, tag: str, command: list[str], *, mounts: dict[str, tuple[str, str]],
            environment: dict[str, str], gpus: int = 0, timeout_s: float = 7200,
            network: str = "none", user: str | None = None, name: str | None = None,
            log: Callable[[str], None] = print) -> RunResult:
        """Run ``command`` in ``tag`` as ``user`` (default: the invoking user); stream its logs;
        remove the container whatever happens (Ctrl-C and SIGTERM included). ``name``: the
        container's name and hostname (a node of ``validate.cluster`` on its network)."""
        import docker
        from docker.types import DeviceRequest, Ulimit

        user = user or invoking_user()
        kwargs = self._create_args(command, environment, network, user, mounts, name)
        if not gpus:
            kwargs["shm_size"] = CPU_SHM_BYTES
        else:
            kwargs["ipc_mode"] = "host"  # NCCL between the GPUs' ranks shares memory through it
            kwargs["device_requests"] = [DeviceRequest(count=gpus, capabilities=[["gpu"]])]
            # what vLLM's docs ask of GPU containers (pinned memory for NCCL, deep stacks)
            kwargs["ulimits"] = [Ulimit(name="memlock", soft=-1, hard=-1),
                                 Ulimit(name="stack", soft=67108864, hard=67108864)]
        container = self.client.containers.create(tag, **kwargs)
        try:
            container.start()
            applied = {k: container.attrs["HostConfig"].get(k)
                       for k in ("IpcMode", "ShmSize", "NetworkMode", "Binds", "ReadonlyRootfs")}

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
            return RunResult(code, tag, container.image.id, applied, user)
        finally:
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass
