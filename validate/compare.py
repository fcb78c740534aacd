"""``compare``: did this change break or weaken Llama-4 EAGLE? The pinned release beside the change.

Host side (the runs are ``python -m validate rehearse`` subprocesses for a generated pair,
``python -m validate validate`` for hub models, here or in the image). Same profile, same machine:
the release runs first with a live reference, and its record becomes the golden both are judged
by (same conditions, no other machine's figures; its tolerance ``comparison_sigmas`` standard
errors, since prompts and reference outputs are shared); the change then runs through ``--vllm-patch``
against that golden's reference outputs (one target load). ``metrics.compare_change`` says
REGRESSION, OK or IMPROVED; the sensitivity suite is this over a catalogue of breakages.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from validate import device_class, goldens, metrics, profiles, request, vllm_change
from validate.contract import BadInput, BadRecord, Exit
from validate.files import atomic_write
from validate.record import RunRecord

PHASES = ("speculative_engine_start", "speculative_generation")


def one_run(run_dir: Path, sized: list[str], extra: list[str],
            log: Any) -> tuple[int, dict[str, Any] | None, float]:
    """One run of the profile in ``sized`` into ``run_dir`` (its output in ``<run_dir>.log``):
    ``rehearse`` for a generated pair, ``validate`` for hub models. (exit code, record or None,
    seconds)."""
    cmd = [sys.executable, "-m", "validate", *sized, "--run-dir", str(run_dir), *extra]
    logfile = run_dir.parent / f"{run_dir.name}.log"
    t = time.monotonic()
    with open(logfile, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    seconds = time.monotonic() - t
    try:  # checked against the contract: a damaged or foreign record is no run's result
        rec = RunRecord.load(run_dir).data
    except BadRecord:
        rec = None
    log(f"  exit {code} in {seconds:.0f} s (log {logfile})")
    return code, rec, seconds


def suite_folder(args: argparse.Namespace, kind: str, tp: int) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    base = Path(args.run_dir or Path("runs") / f"{kind}-tp{tp}-{stamp}")
    if base.exists() and any(base.iterdir()):
        raise BadInput(f"{base} is not empty; choose a new --run-dir")
    base.mkdir(parents=True, exist_ok=True)
    return base


def sized_profile(args: argparse.Namespace) -> tuple[profiles.Profile, list[str]]:
    """The profile at the options' size, and the command line that runs it (its subcommand, the
    profile, the sizes, and where it runs: ``--container`` or ``--no-container``, weights)."""
    get = vars(args).get
    profile = request.resolve(get("profile") or "tiny", tp=get("tp"),
                              num_prompts=get("num_prompts"), max_tokens=get("max_tokens"))
    if get("tp") is None and profile.device == "cpu":
        # CPU: TP=2 unless told (sharding breakages show at TP > 1; TP=8 takes 4x the engines' time)
        profile = profile.with_overrides(tensor_parallel_size=2)
    where: list[str] = []
    if profile.generated:
        where += ["--container"] if get("container") else []
    else:  # hub models: the real run's flow (fetched, verified, in the pinned image by default)
        where += ["--no-container"] if get("no_container") else []
        where += request.Weights(Path(get("lock_file")), get("cache_dir"), get("local_dir"),
                                 bool(get("offline"))).argv()
    command = "rehearse" if profile.generated else "validate"
    return profile, [command, "--profile", profile.name, "--tp",
                     str(profile.tensor_parallel_size), "--num-prompts", str(profile.num_prompts),
                     "--max-tokens", str(profile.max_tokens), *where]


def release_baseline(base: Path, sized: list[str],
                     log: Any) -> tuple[int, dict[str, Any] | None, float, Path | None]:
    """The unpatched release with a live reference, and the golden made from it (None unless it
    passed: a release that fails here is no baseline)."""
    log("baseline: the pinned release (unpatched, live reference)")
    code, rec, seconds = one_run(base / "release", sized, ["--golden", "none"], log)
    if code != Exit.PASS or rec is None:
        return code, rec, seconds, None
    golden = base / "golden.json"
    goldens.write(golden, goldens.make([rec], sigmas=profiles.comparison_sigmas()))
    return code, rec, seconds, golden


def candidate(base: Path, name: str, sized: list[str], change: list[str], golden: Path,
              log: Any) -> tuple[int, dict[str, Any] | None, float]:
    """The change (its option, e.g. ``["--vllm-patch", FILE]``) against the baseline's golden."""
    return one_run(base / name, sized, [*change, "--golden", str(golden), "--reference", "golden"],
                   log)


def baseline_golden(path: Path, profile: profiles.Profile) -> dict[str, Any]:
    """``--baseline-golden``, refused (exit 2) before any engine unless it is of this profile, TP
    and (on CPU, where the host can tell) device class: another's figures say nothing here."""
    golden = goldens.load(path, regenerate="`nox -s compare` (its golden.json) or `nox -s calibrate`")
    tp = profile.tensor_parallel_size
    problem = goldens.mismatch(golden, profile=profile.name, tp=tp,
                               device_class=device_class.cpu() if profile.device == "cpu" else None,
                               conditions={k: getattr(profile, k) for k in goldens.PROFILE_KEYS})
    if problem:
        raise BadInput(f"--baseline-golden {path} does not apply: {problem}; use a golden of "
                       f"profile {profile.name} at TP={tp} made on this machine class (`nox -s "
                       "compare` without --baseline-golden makes one)")
    return golden


# How a candidate run that gave no verdict ends compare: its own exit code, never REGRESSION (a
# bad input or a wrong environment says nothing about the change); a crash is the run breaking.
NOT_JUDGED = {Exit.BAD_INPUT: "NOT RUN", Exit.ENVIRONMENT: "NOT RUN", Exit.INTERRUPTED: "NOT RUN",
              Exit.PREFLIGHT: "NOT RUN"}


def run(args: argparse.Namespace, log: Any = print) -> tuple[dict[str, Any], Exit]:
    """Baseline and candidate, side by side; (report, exit code)."""
    profile, sized = sized_profile(args)
    given = baseline_golden(Path(args.baseline_golden), profile) if args.baseline_golden else None
    vllm_change.precheck(args)  # a change that cannot run: refused now
    # on this host: the overlay is made (and a patch applied) before the baseline's minutes;
    # in an image, the candidate's run checks it against the image's own vLLM
    here = (profile.generated and not getattr(args, "container", False)) or getattr(
        args, "no_container", False)
    change = vllm_change.from_args(args, sys.executable) if here else None
    base = suite_folder(args, "compare", profile.tensor_parallel_size)
    if given is not None:  # a golden of the release (calibrate, or an earlier compare's)
        golden, rec_b = Path(args.baseline_golden), None
        baseline = metrics.Figures.of_golden(given)
        log(f"baseline: the golden {golden}")
    else:
        code_b, rec_b, _, made = release_baseline(base, sized, log)
        if made is None or rec_b is None:
            raise BadInput(f"the pinned release does not PASS here (exit {code_b}; see "
                           f"{base / 'release.log'}): there is no baseline to compare with")
        golden = made
        baseline = metrics.Figures.of_run(rec_b["acceptance"], rec_b["comparison"])
    log(f"candidate: {change.describe() if change else ' '.join(vllm_change.passed_on(args))}")
    code_c, rec_c, _ = candidate(base, "candidate", sized, vllm_change.passed_on(args), golden, log)
    report: dict[str, Any] = {"profile": profile.to_dict(),
                              "baseline": str(golden if args.baseline_golden else base / "release"),
                              "candidate": str(base / "candidate"),
                              "vllm_under_test": (rec_c or {}).get("vllm_under_test")
                              or (change.to_dict() if change else None),
                              "times": _times(rec_b, rec_c)}
    ended = Exit.REGRESSION
    if rec_c is None or not rec_c.get("acceptance") or not rec_c.get("comparison"):
        err = (rec_c or {}).get("error") or {}
        ended = Exit(code_c) if code_c in NOT_JUDGED else Exit.BROKEN
        report.update(verdict=NOT_JUDGED.get(ended, "BROKEN"), rows=[], new_hard=None, reasons=[
            f"the candidate's run ended with exit {code_c} before a verdict "
            f"({err.get('kind', 'no record')}: {str(err.get('message', ''))[:300]}); see "
            f"{base / 'candidate.log'}"])
    else:
        v = metrics.compare_change(baseline, metrics.Figures.of_run(rec_c["acceptance"],
                                                                   rec_c["comparison"]),
                                   sigmas=profiles.comparison_sigmas())
        report.update(verdict=v.word, rows=v.rows, new_hard=v.new_hard, reasons=v.reasons)
        ended = Exit.REGRESSION if v.word == "REGRESSION" else Exit.PASS
    atomic_write(base / "compare.json", json.dumps(report, indent=1) + "\n")
    atomic_write(base / "compare.md", markdown(report))
    return report, ended


def _times(rec_b: dict[str, Any] | None, rec_c: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [{"phase": p, "baseline": ((rec_b or {}).get("phases", {}).get(p) or {}).get("seconds"),
             "candidate": ((rec_c or {}).get("phases", {}).get(p) or {}).get("seconds")}
            for p in PHASES]


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# compare: {report['verdict']}", "",
             *[f"- {r}" for r in report["reasons"]], "",
             "| figure | baseline | candidate | delta | tolerance |", "| --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['what']} | {r['baseline']:.3f} | {r['candidate']:.3f} | "
                     f"{r['delta']:+.3f} | {r['tolerance']:.3f} |")
    lines += ["", "| phase | baseline s | candidate s |", "| --- | --- | --- |"]
    for t in report["times"]:
        lines.append(f"| {t['phase']} | {t['baseline']} | {t['candidate']} |")
    return "\n".join(lines) + "\n"
