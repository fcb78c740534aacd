"""``python -m validate``: parse the options, dispatch to ``commands``, print the outcome, exit.

Host side: never imports vLLM or torch. What each command does lives in ``validate/commands.py``;
the exit codes and the end-to-end options are the contract's (``validate/contract.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.panel import Panel

from validate import commands, contract, hub, profiles
from validate.commands import HEADS, console
from validate.contract import BadInput, Exit
from validate.record import NO_SPACE, RunRecord


def report(rec: RunRecord) -> None:
    data = rec.data
    verdict = data.get("verdict") or {}
    word = verdict.get("result") or data["status"].upper()
    style = "green" if word == "PASS" else "red"
    if verdict.get("calibration"):
        word += f" ({verdict['calibration']})"
    body = [*verdict.get("reasons", [])]
    if data.get("error"):
        body.append(f"{data['error']['kind']}: {data['error']['message']}")
    phases = data.get("phases", {})
    if phases:
        body.append("phases: " + ", ".join(f"{k} {v.get('seconds', '?')}s" for k, v in phases.items()))
    body.append(f"record: {rec.dir}/record.json, summary: {rec.dir}/summary.md")
    console.print(Panel("\n".join(body), title=f"[bold {style}]{word}[/] {data['name']}",
                        border_style=style), soft_wrap=False)


def _run_command(fn: Any) -> Any:
    """A command that ends in a run record: report it, exit with its code."""
    def run(args: argparse.Namespace) -> Exit:
        rec, code = fn(args)
        if isinstance(rec, RunRecord) and getattr(args, "full", False):  # its step reported it
            console.print(f"full rehearsal: {rec.data['status']} (the verdict above), exit "
                          f"{int(code)}; record {rec.dir}/record.json")
        elif isinstance(rec, RunRecord):
            report(rec)
        elif rec is None:  # a step ended before any run record: it said why above
            console.print(f"[bold red]no run record[/]: the step above ended with exit {int(code)}")
        else:  # preflight findings
            commands.print_findings(rec)
            console.print("[bold red]preflight failed[/]: fix the rows marked FAIL above. Without "
                          "the profile's GPUs, rehearse the whole validation on CPU: "
                          "`nox -s rehearse_tp8`")
        return code
    return run


def calibrate(args: argparse.Namespace) -> Exit:
    """Run the profile ``--runs`` times (judged by floors only) and write its golden."""
    from validate import goldens

    profile = commands.profile_for(args)
    flow = commands.rehearse if profile.generated else commands.validate
    records = []
    for i, rec, code in commands.calibration_runs(args, profile, flow):
        if code not in (Exit.PASS, Exit.FAIL):
            report(rec)
            console.print(f"[bold red]error:[/] calibration run {i} ended with exit {code}; "
                          "no golden written")
            return code
        records.append(rec.data)
    try:
        golden = goldens.make(records, sigmas=profiles.calibration_sigmas())
    except ValueError as exc:
        console.print(f"[bold red]error:[/] no golden written: {exc}")
        return Exit.FAIL
    out = Path(args.out) if args.out else goldens.DIR / goldens.filename(
        profile.name, golden["device_class"], profile.tensor_parallel_size)
    goldens.write(out, golden)
    mal = golden["acceptance"]["mean_acceptance_length"]
    console.print(f"[green]golden written[/] {out}: mean acceptance length {mal['mean']:.3f} "
                  f"(sd over runs {mal['sd_runs']:.4f}, standard error {mal['standard_error']:.4f}, "
                  f"tolerance {mal['tolerance']:.3f}); per position " + ", ".join(
                      f"{p['mean']:.3f}-{p['tolerance']:.3f}"
                      for p in golden["acceptance"]["per_position_rate"])
                  + f"; divergence gaps {golden['divergence_gaps']}")
    return Exit.PASS


def refresh_pins(args: argparse.Namespace) -> Exit:
    """Pin each base image to its registry digest (containers/pins.toml)."""
    from validate import containers

    containers.refresh_pins(containers.Engine(), args.pins, log=console.print)
    return Exit.PASS


def compare(args: argparse.Namespace) -> Exit:
    """The pinned release beside a change: REGRESSION, OK or IMPROVED."""
    from rich.table import Table

    from validate import compare as flow

    report, code = flow.run(args, log=lambda line: console.print(line, markup=False))
    table = Table(title=f"compare: the release (baseline) and the change (candidate), TP="
                  f"{report['profile']['tensor_parallel_size']}")
    for col in ("figure", "baseline", "candidate", "delta", "tolerance", ""):
        table.add_column(col)
    for r in report["rows"]:
        table.add_row(r["what"], f"{r['baseline']:.3f}", f"{r['candidate']:.3f}",
                      f"{r['delta']:+.3f}", f"{r['tolerance']:.3f}", r["beyond"])
    for t in report["times"]:
        table.add_row(f"{t['phase']} (s)", str(t["baseline"]), str(t["candidate"]), "", "", "")
    console.print(table)
    style = {"REGRESSION": "bold red", "OK": "green", "IMPROVED": "bold green"}.get(
        report["verdict"], "bold red")
    console.print(f"[{style}]{report['verdict']}[/]: " + escape("; ".join(report["reasons"])))
    return code


def sensitivity(args: argparse.Namespace) -> Exit:
    """The catalogue of breakages of vLLM's Llama-4 EAGLE path, each through --vllm-patch."""
    from rich.table import Table

    from validate import sensitivity as suite

    outcomes, code = suite.run(args, log=lambda line: console.print(line, markup=False))
    table = Table(title="sensitivity: every breakage must FAIL or ERROR; the release and the "
                  "controls PASS")
    for col in ("change", "class", "expected", "mean acceptance", "divergent", "hard", "verdict",
                "caught by", "seconds", "why"):
        table.add_column(col, overflow="fold")
    for o in outcomes:
        acc = "-" if o.mean_acceptance is None else f"{o.mean_acceptance:.3f}"
        table.add_row(o.name, o.kind or "-", "PASS" if o.expect == "pass" else "FAIL/ERROR", acc,
                      "-" if o.divergences is None else str(o.divergences),
                      "-" if o.hard is None else str(o.hard),
                      f"[{'green' if o.ok else 'bold red'}]{o.verdict}[/]", o.caught_by or "-",
                      f"{o.seconds:.0f}", escape(o.detail))
    console.print(table)
    wrong = [o.name for o in outcomes if not o.ok]
    if code == Exit.PASS:
        console.print(f"[green]all {len(outcomes) - 1} changes judged as expected[/]")
    elif wrong:
        console.print(f"[bold red]not as expected[/]: {', '.join(wrong)}")
    return code


def lock_requirements(args: argparse.Namespace) -> Exit:
    """Resolve the CPU image's requirement files into requirements/cpu-image.lock.txt."""
    from validate import image_requirements

    image_requirements.lock(args.wheelhouse, log=console.print)
    return Exit.PASS


# --------------------------------------------------------------------------------------------
# options


def _profile_option(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--profile", default=default, help=f"one of: {', '.join(profiles.names())}")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: profile's)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)


def _weights_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lock-file", default=str(hub.default_lock_path()),
                   help="pins: commit and sha256 of every file (default: the kit's lock file)")
    p.add_argument("--cache-dir", type=Path, default=None, help="Hugging Face cache (default: HF_HOME's)")
    p.add_argument("--local-dir", type=Path, default=None, help="plain folders instead of the cache")
    p.add_argument("--offline", action="store_true", help="use only what is on disk; list what is missing")


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None,
                   help="run folder, new or empty (default: runs/<profile>-tp<N>-<time>)")
    g = p.add_argument_group("verdict")
    for flag, kwargs in contract.options(contract.VERDICT_FLAGS):
        g.add_argument(flag, **kwargs)
    _image_options(p)


def _image_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("image")
    g.add_argument("--base-image", default=None,
                   help="build on this base instead of the pinned one (recorded as unpinned)")
    g.add_argument("--ca-bundle", type=Path, default=None,
                   help="CA bundle for downloads during the build (TLS-intercepting proxies)")
    g.add_argument("--wheelhouse", type=Path, default=None,
                   help="folder of wheels the build may install from (air-gapped builds)")
    g.add_argument("--build-network", default=None, help="network of the build, e.g. host")
    g.add_argument("--timeout", type=float, default=7200, help="seconds before the run is stopped")


def _change_options(p: argparse.ArgumentParser, required: bool = False) -> None:
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


def _suite_options(p: argparse.ArgumentParser) -> None:
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
    _weights_options(p)


def _repo_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-repo", default=None, help="override the profile's target repository")
    p.add_argument("--draft-repo", default=None, help="override the profile's EAGLE head repository")


def _rehearse_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", choices=sorted(HEADS), default=None,
                   help="with a generated pair: the distilled head (default) or a random one")
    p.add_argument("--target", default=None, help="target model folder (overrides the profile)")
    p.add_argument("--draft", default=None, help="EAGLE head folder (overrides the profile)")
    p.add_argument("--container", action="store_true",
                   help="run inside the CPU image (built through the Docker SDK) instead of here")
    _change_options(p)
    p.add_argument("--full", action="store_true",
                   help="the real run's whole path on the tiny pair: a hub on loopback, lock, "
                   "fetch into a Hugging Face cache, preflight, the CPU image, the container")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m validate", description=__doc__.split("\n")[0],
                                 epilog="exit codes:\n" + contract.exit_table(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rehearse", help="run the validation here, without a container "
                       "(the tiny pair on CPU by default)")
    _profile_option(r, "tiny")
    _rehearse_options(r)
    _run_options(r)
    r.set_defaults(func=_run_command(commands.rehearse))

    c = sub.add_parser("calibrate", help="run a profile N times and write its golden")
    _profile_option(c, "tiny")
    c.add_argument("--runs", type=int, default=5, help="number of runs (default: 5)")
    c.add_argument("--out", default=None, help="golden file (default: validate/data/goldens/...)")
    c.add_argument("--run-dir", default=None, help="folder for the runs' records")
    c.add_argument("--no-container", action="store_true",
                   help="hub profiles: run on this host instead of the pinned image")
    _weights_options(c)
    _image_options(c)
    c.set_defaults(func=calibrate, head=None, target=None, draft=None, container=False,
                   full=False, vllm_patch=None, vllm_source=None, vllm_wheel=None)

    v = sub.add_parser("validate", help="the real run: preflight, fetch, image, end-to-end, verdict")
    _profile_option(v, "maverick-tp8")
    _repo_options(v)
    v.add_argument("--no-container", action="store_true",
                   help="run the end-to-end script on this host (an environment with vLLM)")
    _change_options(v)
    _weights_options(v)
    _run_options(v)
    v.set_defaults(func=_run_command(commands.validate), head=None)

    pn = sub.add_parser("refresh-pins", help="pin the base images to their registry digests")
    cm = sub.add_parser("compare", help="the pinned release beside a change to vLLM, same "
                        "machine and profile: REGRESSION, OK or IMPROVED")
    _change_options(cm, required=True)
    _suite_options(cm)
    cm.add_argument("--baseline-golden", default=None, metavar="FILE",
                    help="take the release's figures and reference outputs from this golden "
                    "(an earlier compare's golden.json, or calibrate's) instead of running it")
    cm.set_defaults(func=compare)
    se = sub.add_parser("sensitivity", help="apply each breakage of vLLM's Llama-4 EAGLE path "
                        "(validate/data/breakages/) and show the verdict catches it")
    _suite_options(se)
    se.add_argument("--only", action="append", default=None, metavar="NAME",
                    help="run only this breakage (repeatable)")
    se.add_argument("--tier", choices=("full", "ci"), default="full",
                    help="full: the whole catalogue; ci: the CI subset (`ci = true` in "
                    "validate/data/breakages.toml: every class of fault, the hardest first)")
    se.set_defaults(func=sensitivity)
    lr = sub.add_parser("lock-requirements",
                        help="lock the CPU image's Python packages with hashes (needs uv)")
    lr.add_argument("--wheelhouse", type=Path, default=None,
                    help="resolve torch from this folder of wheels (PyTorch's index unreachable)")
    lr.set_defaults(func=lock_requirements)
    pn.add_argument("--pins", type=Path, default=None,
                    help="pins file to refresh (default: containers/pins.toml)")
    pn.set_defaults(func=refresh_pins)

    for name, fn, what in (("fetch", commands.fetch, "download the profile's target and head at "
                            "their pins, verified"),
                           ("lock", commands.lock, "pin the profile's repositories (needs the hub)")):
        p = sub.add_parser(name, help=what)
        _profile_option(p, "maverick-tp8")
        _repo_options(p)
        _weights_options(p)
        p.set_defaults(func=fn)
    sub.choices["fetch"].add_argument("--json", default=None,
                                      help="write what was fetched (paths, commits) to this file")
    sub.choices["lock"].add_argument("--revision", default="main",
                                     help="branch, tag or commit to pin (default: main)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with commands.signals_as_interrupt():
            return int(args.func(args))
    except BadInput as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return Exit.BAD_INPUT
    except contract.EnvironmentProblem as exc:  # no Docker engine, a registry that did not answer
        console.print(f"[bold red]error:[/] {exc}")
        return Exit.ENVIRONMENT
    except hub.FetchInterrupted as exc:
        console.print(f"[red]{exc}[/]")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.exit_code)  # why: hub.FetchInterrupted (transfers still run in threads)
    except hub.FetchError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return exc.exit_code
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        console.print(f"[bold red]the run broke:[/] no space left on device ({exc.filename or exc}); "
                      "free space there and run again")
        return Exit.BROKEN
    except contract.KitError as exc:  # the record already says it (a full disk under a run folder)
        console.print(f"[bold red]the run broke:[/] {exc}")
        return contract.KIND_EXIT[exc.kind]
    except KeyboardInterrupt:
        console.print("[red]interrupted[/] (Ctrl-C or SIGTERM): a run's record says where it stopped; "
                      "a fetch keeps every finished file; run the same command again to go on")
        return Exit.INTERRUPTED
