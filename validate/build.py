"""The build stage, host side: the profile's image (found again when its inputs are unchanged)
and the vLLM under test as a layer over it. The docker SDK work is ``containers``'; this room
decides what to build from a request and says it."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from validate import containers, request, vllm_change
from validate.contract import EnvironmentProblem
from validate.ui import console


def image(engine: containers.Engine, opts: request.Image, kind: str,
          log: Callable[[str], None] | None = None) -> tuple[str, str, bool]:
    """Build (or find, when its inputs are unchanged) the ``kind`` image: (tag, base, pinned).
    The build's lines go to ``log`` (default: the console)."""
    log = log or (lambda line: console.print(line, markup=False))
    base, pinned = containers.base_reference(kind, opts.base_image)
    if not pinned:
        console.print(f"[bold yellow]UNPINNED base image[/] {base}: no digest in "
                      f"{containers.PINS.relative_to(containers.ROOT)}; `nox -s refresh_pins` pins it")
    labels = {"kit_version": kit_version(), "git_commit": git_commit(),
              "base_digest": base.split("@")[1] if pinned else "unpinned",
              "vllm_version": containers.pins()[kind]["vllm"]}
    tag = engine.build(kind, base=base, labels=labels, ca_bundle=opts.ca_bundle,
                       wheelhouse=opts.wheelhouse, network=opts.build_network, log=log)
    return tag, base, pinned


def change_layer(engine: containers.Engine, tag: str,
                 change: request.Change) -> tuple[str, vllm_change.VllmUnderTest]:
    """The change as a layer over image ``tag``'s own vLLM (a patch is applied to exactly the
    files the image holds): (the layer's tag, the vLLM under test)."""
    package, version, accepted = json.loads(
        engine.python_output(tag, vllm_change.PROBE).strip().splitlines()[-1])
    if not package or not version:
        raise EnvironmentProblem(f"image {tag} holds no vLLM (its python3 finds no vllm package)")
    with tempfile.TemporaryDirectory(prefix="kit-change-") as tmp:
        layer = vllm_change.for_image(
            change, version, accepted,
            lambda files, tree: engine.copy_out(tag, package, files, tree), Path(tmp))
        assert layer is not None  # called only where a change option is given
        new_tag = engine.build_change(tag, layer, package,
                                      log=lambda line: console.print(line, markup=False))
    return new_tag, layer.change


def kit_version() -> str:
    try:
        from importlib.metadata import version

        return version("llama4-eagle-validate")
    except Exception:
        return "unknown"


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                       text=True, check=False)
    return r.stdout.strip() or "unknown"

