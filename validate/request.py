"""A command's options, declared once and parsed once into typed values every command passes on.

Host side. ``cli`` builds its parser from the ``add_*`` groups here; ``of()`` then turns the
namespace into a ``Run`` (the profile resolved once, with its sizes and repository overrides), and
nothing after it reads the namespace again. Where a command runs another as a subprocess exactly
as a user would (``rehearse --full`` runs ``lock`` and ``validate``; ``compare`` and
``sensitivity`` run ``rehearse``), the flags come from the same values' ``argv()``: each flag is
spelled in this one room.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validate import contract, profiles, weights_lock
from validate.contract import BadInput


@dataclass(frozen=True)
class Image:
    """How the image is built and the container run (``--base-image`` ... ``--timeout``)."""

    base_image: str | None = None
    ca_bundle: Path | None = None
    wheelhouse: Path | None = None
    build_network: str | None = None
    timeout: float = 7200

    def argv(self) -> list[str]:
        given = [("--base-image", self.base_image), ("--ca-bundle", self.ca_bundle),
                 ("--wheelhouse", self.wheelhouse), ("--build-network", self.build_network),
                 ("--timeout", self.timeout)]
        return [f"{flag}={value}" for flag, value in given if value is not None]


@dataclass(frozen=True)
class Weights:
    """Where hub models are pinned and kept (``--lock-file`` ... ``--offline``)."""

    lock_file: Path = dataclasses.field(default_factory=weights_lock.default_path)
    cache_dir: Path | None = None
    local_dir: Path | None = None
    offline: bool = False

    def argv(self) -> list[str]:
        out = [f"--lock-file={self.lock_file}"]
        out += [f"{flag}={value}" for flag, value in (("--cache-dir", self.cache_dir),
                                                      ("--local-dir", self.local_dir)) if value]
        return out + (["--offline"] if self.offline else [])


@dataclass(frozen=True)
class Change:
    """The vLLM under test as asked for: at most one of a patch, a checkout, a wheel
    (``vllm_change`` reads these three names)."""

    vllm_patch: str | None = None
    vllm_source: str | None = None
    vllm_wheel: str | None = None

    def __bool__(self) -> bool:
        return bool(self.vllm_patch or self.vllm_source or self.vllm_wheel)

    def argv(self) -> list[str]:
        for flag, value in (("--vllm-patch", self.vllm_patch), ("--vllm-source", self.vllm_source),
                            ("--vllm-wheel", self.vllm_wheel)):
            if value:
                return [flag, str(value)]
        return []


@dataclass(frozen=True)
class Run:
    """One command's request: what to run, where, judged how."""

    command: str
    profile: profiles.Profile  # with the sizes and repository overrides applied
    sizes: dict[str, int]  # the sizes asked for on the command line (tp, num-prompts, max-tokens)
    run_dir: str | None = None
    golden: str | None = "auto"
    reference: str = "live"
    head: str | None = None
    target: str | None = None
    draft: str | None = None
    container: bool = False  # rehearse: --container; validate: unless --no-container
    full: bool = False
    image: Image = Image()
    weights: Weights = Weights()
    change: Change = Change()
    path: str = "offline"  # bench: "serving" (two `vllm serve` servers and the sweep)
    concurrency: tuple[int, ...] | None = None  # bench: the sweep's concurrencies
    repeats: int | None = None  # bench: repeats per sweep point
    vllm_under_test: Any = None  # vllm_change.VllmUnderTest, once the overlay is made here

    def but(self, **changes: Any) -> Run:
        return dataclasses.replace(self, **changes)

    def sized_argv(self) -> list[str]:
        """The sizes as they were asked for (the steps resolve the profile the same way)."""
        return [f"--{k}={v}" for k, v in self.sizes.items()]


SIZES = ("tp", "pp", "nodes", "num_prompts", "max_tokens")


def resolve(name: str, *, tp: int | None = None, pp: int | None = None,
            nodes: int | None = None, num_prompts: int | None = None,
            max_tokens: int | None = None, target: str | None = None,
            draft: str | None = None) -> profiles.Profile:
    """The named profile with what the options change, refused (exit 2) if it cannot give a
    verdict: the one place a profile is resolved."""
    try:
        profile = profiles.get(name)
    except profiles.UnknownProfile as exc:
        raise BadInput(str(exc)) from exc
    profile = profile.with_overrides(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                     nodes=nodes, num_prompts=num_prompts,
                                     max_tokens=max_tokens, target=target, draft=draft)
    if problems := profile.problems():
        raise BadInput("; ".join(problems))
    return profile


def of(args: argparse.Namespace) -> Run:
    """The namespace of a run command (rehearse, validate, calibrate, fetch, lock) as a ``Run``."""
    get = vars(args).get
    sizes = {k.replace("_", "-"): get(k) for k in SIZES if get(k) is not None}
    profile = resolve(get("profile") or "tiny", tp=get("tp"), pp=get("pp"), nodes=get("nodes"),
                      num_prompts=get("num_prompts"),
                      max_tokens=get("max_tokens"), target=get("target_repo"),
                      draft=get("draft_repo"))
    command = get("command") or "rehearse"
    if command == "rehearse" or (command == "bench" and profile.generated):
        container = bool(get("container"))
    else:  # validate runs in the pinned image unless told; calibrate does so for hub models
        container = not get("no_container") and (command != "calibrate" or not profile.generated)
    return Run(command=command, profile=profile, sizes=sizes, run_dir=get("run_dir"),
               golden=get("golden"), reference=get("reference") or "live", head=get("head"),
               target=get("target"), draft=get("draft"), container=container,
               full=bool(get("full")),
               image=Image(get("base_image"), get("ca_bundle"), get("wheelhouse"),
                           get("build_network"), get("timeout") or 7200),
               weights=Weights(Path(get("lock_file") or weights_lock.default_path()),
                               get("cache_dir"), get("local_dir"), bool(get("offline"))),
               change=Change(get("vllm_patch"), get("vllm_source"), get("vllm_wheel")),
               path="serving" if command == "bench" else "offline",
               concurrency=get("concurrency"), repeats=get("repeats"))


# --------------------------------------------------------------------------------------------
# the option groups, each declared once


def add_profile(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--profile", default=default, help=f"one of: {', '.join(profiles.names())}")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: profile's)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline parallel size, across nodes (default: profile's)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes the engines span (default: profile's; docs/multi-node.md)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)


def add_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lock-file", default=str(weights_lock.default_path()),
                   help="pins: commit and sha256 of every file (default: the kit's lock file)")
    p.add_argument("--cache-dir", type=Path, default=None, help="Hugging Face cache (default: HF_HOME's)")
    p.add_argument("--local-dir", type=Path, default=None, help="plain folders instead of the cache")
    p.add_argument("--offline", action="store_true", help="use only what is on disk; list what is missing")


def add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None,
                   help="run folder, new or empty (default: runs/<profile>-tp<N>-<time>)")
    g = p.add_argument_group("verdict")
    for flag, kwargs in contract.options(contract.VERDICT_FLAGS):
        g.add_argument(flag, **kwargs)
    add_image(p)


def add_image(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("image")
    g.add_argument("--base-image", default=None,
                   help="build on this base instead of the pinned one (recorded as unpinned)")
    g.add_argument("--ca-bundle", type=Path, default=None,
                   help="CA bundle for downloads during the build (TLS-intercepting proxies)")
    g.add_argument("--wheelhouse", type=Path, default=None,
                   help="folder of wheels the build may install from (air-gapped builds)")
    g.add_argument("--build-network", default=None, help="network of the build, e.g. host")
    g.add_argument("--timeout", type=float, default=7200, help="seconds before the run is stopped")


def add_change(p: argparse.ArgumentParser, required: bool = False) -> None:
    g = p.add_argument_group("the vLLM under test (default: the installed release)")
    x = g.add_mutually_exclusive_group(required=required)
    x.add_argument("--vllm-patch", default=None, metavar="FILE",
                   help="a unified diff of vLLM's Python files (`git diff`), applied as an overlay "
                   "on the installed build")
    x.add_argument("--vllm-source", default=None, metavar="PATH",
                   help="a vLLM checkout: its Python changes against the pinned release, overlaid "
                   "on the installed build (a change to compiled code is refused)")
    x.add_argument("--vllm-wheel", default=None, metavar="PATH",
                   help="a vLLM wheel built elsewhere, for this Python and platform")


def add_bench(p: argparse.ArgumentParser) -> None:
    """bench: the serving path's sweep, and what a run takes (hub profiles: in the pinned image,
    their weights fetched; a generated pair: here)."""
    g = p.add_argument_group("serving bench")
    for flag, kwargs in contract.options(("--concurrency", "--repeats")):
        g.add_argument(flag, **kwargs)
    g.add_argument("--no-container", action="store_true",
                   help="hub profiles: run on this host (an environment with vLLM)")
    add_repos(p)
    add_change(p)
    add_weights(p)
    add_run(p)


def add_suite(p: argparse.ArgumentParser) -> None:
    """compare and sensitivity: several runs of one profile on this machine."""
    p.add_argument("--profile", default="tiny", help="a generated pair runs through `rehearse`, "
                   f"hub models through `validate`; one of: {', '.join(profiles.names())}")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: 2 for "
                   "a CPU profile, so sharding breakages show; else the profile's)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--run-dir", default=None, help="folder for the runs")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--container", action="store_true",
                       help="a generated pair: run in the CPU image (the change as an image layer)")
    where.add_argument("--no-container", action="store_true",
                       help="hub models: run on this host instead of the pinned image")
    add_weights(p)


def add_repos(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-repo", default=None, help="override the profile's target repository")
    p.add_argument("--draft-repo", default=None, help="override the profile's EAGLE head repository")


HEAD_CHOICES = ("random", "trained")


def add_rehearse(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", choices=HEAD_CHOICES, default=None,
                   help="with a generated pair: the distilled head (default) or a random one")
    p.add_argument("--target", default=None, help="target model folder (overrides the profile)")
    p.add_argument("--draft", default=None, help="EAGLE head folder (overrides the profile)")
    p.add_argument("--container", action="store_true",
                   help="run inside the CPU image (built through the Docker SDK) instead of here")
    add_change(p)
    p.add_argument("--full", action="store_true",
                   help="the real run's whole path on the tiny pair: a hub on loopback, lock, "
                   "fetch into a Hugging Face cache, preflight, the CPU image, the container")
