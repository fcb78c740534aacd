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
import time
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from validate import compare
from validate.contract import BadInput, Exit
from validate.record import atomic_write


@dataclass(frozen=True)
class Breakage:
    name: str
    place: str
    what: str
    expect: str = "fail"  # "fail": FAIL or ERROR; "pass": a control that must PASS

    @property
    def patch(self) -> Path:
        return Path(str(resources.files("validate.data").joinpath("breakages", f"{self.name}.patch")))


def catalogue() -> list[Breakage]:
    data = tomllib.loads(resources.files("validate.data").joinpath("breakages.toml").read_text())
    return [Breakage(**b) for b in data["breakage"]]


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

    @property
    def ok(self) -> bool:
        return self.verdict == "PASS" if self.expect == "pass" else self.verdict in ("FAIL", "ERROR")


def _outcome(name: str, place: str, code: int, rec: dict | None, seconds: float,
             expect: str = "pass") -> Outcome:
    # ERROR: the run broke (an engine crashed on the breakage: caught). Anything else (a patch
    # that does not apply, a wrong environment, an interrupt) is NOT RUN: the suite's own fault.
    verdict = {Exit.PASS: "PASS", Exit.FAIL: "FAIL", Exit.BROKEN: "ERROR"}.get(code, "NOT RUN")
    acc = (rec or {}).get("acceptance") or {}
    cmp = (rec or {}).get("comparison") or {}
    if verdict in ("ERROR", "NOT RUN"):
        err = (rec or {}).get("error") or {}
        detail = f"exit {code}: {err.get('kind', 'no record')}: {str(err.get('message', ''))[:160]}"
    else:
        detail = "; ".join(((rec or {}).get("verdict") or {}).get("reasons", [])[1:2])[:200]
    return Outcome(name, place, code, verdict, acc.get("mean_acceptance_length"), cmp.get("hard"),
                   round(seconds, 1), detail, expect)


def run(args: argparse.Namespace, log: Any = print) -> tuple[list[Outcome], Exit]:
    """The suite; returns each run's outcome (the release first) and the suite's exit code."""
    chosen = catalogue()
    if args.only:
        unknown = set(args.only) - {b.name for b in chosen}
        if unknown:
            raise BadInput(f"no breakage named {', '.join(sorted(unknown))} in "
                           "validate/data/breakages.toml")
        chosen = [b for b in chosen if b.name in args.only]
    profile, sized = compare.sized_profile(args)
    base = compare.suite_folder(args, "sensitivity", profile.tensor_parallel_size)
    started = time.monotonic()
    code, rec, seconds, golden_path = compare.release_baseline(base, sized, log)
    outcomes = [_outcome("release (unpatched)", "", code, rec, seconds)]
    if golden_path is None:
        log("the unpatched release does not PASS here: the suite would prove nothing")
        return outcomes, Exit.BROKEN
    for i, b in enumerate(chosen, 1):
        log(f"[{i}/{len(chosen)}] {b.name} ({b.place}): {b.what}")
        code, rec, seconds = compare.candidate(base, b.name, sized, ["--vllm-patch", str(b.patch)],
                                               golden_path, log)
        outcomes.append(_outcome(b.name, b.place, code, rec, seconds, b.expect))
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
             "| change | place | expected | mean acceptance | hard divergences | verdict | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        acc = f"{o.mean_acceptance:.3f}" if o.mean_acceptance is not None else "-"
        hard = "-" if o.hard is None else str(o.hard)
        word = o.verdict + (" (engine crashed)" if o.verdict == "ERROR" else "")
        expected = "PASS" if o.expect == "pass" else "FAIL or ERROR"
        lines.append(f"| {o.name} | {o.place} | {expected} | {acc} | {hard} | {word} | "
                     f"{o.seconds:.0f} |")
    return "\n".join(lines) + "\n"
