"""The sensitivity suite: what breakage of vLLM's Llama-4 EAGLE path the verdict catches.

Host side (the runs are ``python -m validate rehearse`` subprocesses). First the unpatched
release runs with a live reference and must PASS; its record becomes this suite's golden (same
machine, same conditions, its tolerance ``comparison_sigmas`` x the run's own standard error).
Then each breakage of the catalogue (``data/breakages.toml``, patches in ``data/breakages/``) runs through
``--vllm-patch`` against that golden with ``--reference golden``: one target load per verdict.
Every breakage must end FAIL, or ERROR (an engine that crashes counts, and says so); one that
PASSes is a miss and fails the suite. Controls (changes that must not matter) must PASS: a
verdict that fails them cries wolf.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from validate import compare, vllm_change
from validate.contract import BadInput, Exit
from validate.files import atomic_write


@dataclass(frozen=True)
class Breakage:
    name: str
    kind: str  # the class of fault (breakages.toml's ``class``): head, sharing, drafting, lossy, ...
    place: str
    what: str
    expect: str = "fail"  # "fail": FAIL or ERROR; "pass": a control that must PASS
    ci: bool = False  # in the CI tier's subset
    # Which quantized modules the target must have for the code this breaks to run: "" (none),
    # "any" (a quantization config at all), or a module kind of profiles.toml's
    # ``quantized_modules`` ("experts", "attention").
    quantized: str = ""
    # The smallest tensor-parallel size at which the code this breaks runs (a gather across TP
    # ranks is the identity at TP=1: the breakage would PASS there and read as a miss).
    min_tp: int = 1

    def fits(self, quantized_modules: tuple[str, ...]) -> bool:
        """Whether the code this breaks runs on a target quantized in ``quantized_modules``."""
        if not self.quantized:
            return True
        return bool(quantized_modules) and self.quantized in ("any", *quantized_modules)

    @property
    def patch(self) -> Path:
        return Path(str(resources.files("validate.data").joinpath("breakages", f"{self.name}.patch")))


def catalogue() -> list[Breakage]:
    data = tomllib.loads(resources.files("validate.data").joinpath("breakages.toml").read_text())
    return [Breakage(kind=b.pop("class"), **b) for b in data["breakage"]]


def chosen(only: list[str] | None, tier: str = "full",
           quantized: tuple[str, ...] = (), tp: int = 1) -> list[Breakage]:
    """The breakages a suite runs: ``--only`` names (each must exist), else the tier's; those of
    a quantized target's path only where the profile's target has those modules quantized, those
    of TP sharding only at a TP they need (elsewhere the code they break never runs, and their
    PASS would read as a miss)."""
    every = catalogue()
    if only:
        unknown = set(only) - {b.name for b in every}
        if unknown:
            raise BadInput(f"no breakage named {', '.join(sorted(unknown))} in "
                           "validate/data/breakages.toml")
        small = [b for b in every if b.name in only and tp < b.min_tp]
        if small:
            b = small[0]
            raise BadInput(f"{b.name} breaks code that runs only at TP >= {b.min_tp} (at TP={tp} "
                           f"it changes nothing); run it with --tp {b.min_tp} or more")
        unfit = [b for b in every if b.name in only and not b.fits(quantized)]
        if unfit:
            b = unfit[0]
            where = "tiny-fp8-attn" if b.quantized == "attention" else "tiny-fp8 or tiny-fp8-attn"
            has = ", ".join(quantized) or "nothing"
            raise BadInput(f"{b.name} breaks a quantized target's path ({b.quantized} quantized), "
                           f"and this profile's target has {has} quantized; run it with "
                           f"--profile {where} (on a GPU)")
        return [b for b in every if b.name in only]
    return [b for b in _of_tier(tier, quantized) if tp >= b.min_tp]


def _of_tier(tier: str, quantized: tuple[str, ...]) -> list[Breakage]:
    fit = [b for b in catalogue() if b.fits(quantized)]
    return [b for b in fit if b.ci] if tier == "ci" else fit


def left_out(tier: str, quantized: tuple[str, ...], tp: int) -> list[str]:
    """The tier's breakages that ``tp`` is too small for: the suite says so instead of running
    them (a suite at --tp 1 that counted them as misses would cry wolf)."""
    return [b.name for b in _of_tier(tier, quantized) if tp < b.min_tp]


@dataclass
class Outcome:
    name: str
    place: str
    code: int
    verdict: str  # PASS, FAIL, ERROR, NOT RUN
    mean_acceptance: float | None
    hard: int | None
    seconds: float
    detail: str
    expect: str = "pass"  # the release and controls must PASS, breakages FAIL or ERROR
    kind: str = ""  # the breakage's class of fault
    divergences: int | None = None  # outputs that left the reference
    caught_by: str = ""  # which part of the verdict failed it: divergences, hard, acceptance

    @property
    def ok(self) -> bool:
        return self.verdict == "PASS" if self.expect == "pass" else self.verdict in ("FAIL", "ERROR")


# The verdict's reasons that say why a run failed, by the part of the verdict that failed it.
CAUGHT_BY = (("too many divergences", "divergences"), ("hard divergence", "hard"),
             ("acceptance is too low", "acceptance"), ("acceptance counters overstate", "counters"))


def _outcome(name: str, place: str, code: int, rec: dict | None, seconds: float,
             expect: str = "pass", kind: str = "") -> Outcome:
    # ERROR: the run broke (an engine crashed on the breakage: caught). Anything else (a patch
    # that does not apply, a wrong environment, an interrupt) is NOT RUN: the suite's own fault.
    verdict = {Exit.PASS: "PASS", Exit.FAIL: "FAIL", Exit.BROKEN: "ERROR"}.get(code, "NOT RUN")
    acc = (rec or {}).get("acceptance") or {}
    cmp = (rec or {}).get("comparison") or {}
    if verdict in ("ERROR", "NOT RUN"):
        err = (rec or {}).get("error") or {}
        detail = f"exit {code}: {err.get('kind', 'no record')}: {str(err.get('message', ''))[:160]}"
    caught = ""
    if verdict not in ("ERROR", "NOT RUN"):
        reasons = ((rec or {}).get("verdict") or {}).get("reasons", [])
        caught = ", ".join(part for start, part in CAUGHT_BY
                           if any(r.startswith(start) for r in reasons))
        why = [r for r in reasons if r.startswith(("divergence count", "hard divergence",
                                                   "acceptance: mean"))]
        detail = "; ".join(why)[:300]
    divergences = cmp["total"] - cmp["matches"] if cmp else None
    return Outcome(name, place, code, verdict, acc.get("mean_acceptance_length"), cmp.get("hard"),
                   round(seconds, 1), detail, expect, kind, divergences, caught)


def run(args: argparse.Namespace, log: Any = print) -> tuple[list[Outcome], Exit]:
    """The suite; returns each run's outcome (the release first) and the suite's exit code."""
    profile, sized = compare.sized_profile(args)
    tp, tier = profile.tensor_parallel_size, getattr(args, "tier", "full")
    breakages = chosen(args.only, tier, profile.quantized_modules, tp)
    left = [] if args.only else left_out(tier, profile.quantized_modules, tp)
    if left:
        log(f"at TP={tp}, left out (they break code that runs at TP > 1 only): {', '.join(left)}")
    if profile.generated and not getattr(args, "container", False):
        for b in breakages:  # on this host: a stale patch is refused before the release's minutes
            vllm_change.check_applies(b.patch, sys.executable)
    base = compare.suite_folder(args, "sensitivity", profile.tensor_parallel_size)
    started = time.monotonic()
    code, rec, seconds, golden_path = compare.release_baseline(base, sized, log)
    outcomes = [_outcome("release (unpatched)", "", code, rec, seconds)]
    if golden_path is None:
        log("the unpatched release does not PASS here: the suite would prove nothing")
        return outcomes, Exit.BROKEN
    for i, b in enumerate(breakages, 1):
        log(f"[{i}/{len(breakages)}] {b.name} ({b.kind}, {b.place}): {b.what}")
        code, rec, seconds = compare.candidate(base, b.name, sized, ["--vllm-patch", str(b.patch)],
                                               golden_path, log)
        outcomes.append(_outcome(b.name, b.place, code, rec, seconds, b.expect, b.kind))
    total = time.monotonic() - started
    missed = [o.name for o in outcomes if not o.ok]
    report = {"profile": profile.to_dict(), "seconds": round(total, 1), "missed": missed,
              "golden": str(golden_path), "outcomes": [vars(o) for o in outcomes]}
    atomic_write(base / "sensitivity.json", json.dumps(report, indent=1) + "\n")
    atomic_write(base / "sensitivity.md", markdown(outcomes, total, golden_path))
    return outcomes, Exit.FAIL if missed else Exit.PASS


def markdown(outcomes: list[Outcome], seconds: float, golden: Path) -> str:
    release = outcomes[0]
    lines = ["# Sensitivity suite", "",
             f"Golden: the unpatched release of this run ({golden.name}), mean acceptance length "
             f"{release.mean_acceptance:.3f}. {len(outcomes) - 1} changes, "
             f"{sum(o.ok for o in outcomes[1:])} as expected, {seconds:.0f} s in all.", "",
             "| change | class | place | expected | mean acceptance | divergent outputs | hard | "
             "verdict | caught by | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        acc = f"{o.mean_acceptance:.3f}" if o.mean_acceptance is not None else "-"
        hard = "-" if o.hard is None else str(o.hard)
        div = "-" if o.divergences is None else str(o.divergences)
        word = o.verdict + (" (engine crashed)" if o.verdict == "ERROR" else "")
        expected = "PASS" if o.expect == "pass" else "FAIL or ERROR"
        lines.append(f"| {o.name} | {o.kind or '-'} | {o.place or '-'} | {expected} | {acc} | "
                     f"{div} | {hard} | {word} | {o.caught_by or '-'} | {o.seconds:.0f} |")
    return "\n".join(lines) + "\n"
