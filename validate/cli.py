"""``python -m validate``: the host side of a run: decide, prepare, launch, collect, exit with the verdict.

Host side: never imports vLLM or torch (an 8-GPU box's host may have neither). The engine side is
launched as a subprocess (the tiny pair's generator, then the end-to-end pytest script) and the
run folder it fills is read back.

Exit codes: 0 PASS, 1 FAIL (the verdict), 2 bad input (unknown profile, repository or revision, TP
size or head config vLLM would reject), 3 environment (vLLM missing or the wrong build), 4 the run
broke (an engine crashed); fetch: 5 no access to a gated repository, 6 not enough disk, 7 a file
failed verification, 8 offline and files missing; 9 preflight failed; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from validate import compat, hub, preflight, profiles
from validate.record import RunRecord

EXIT_PASS, EXIT_FAIL, EXIT_INPUT, EXIT_ENVIRONMENT, EXIT_BROKEN = 0, 1, 2, 3, 4
EXIT_PREFLIGHT = 9
EXIT_INTERRUPTED = 130
E2E_SCRIPT = Path(__file__).parent / "e2e" / "test_llama4_eagle_tp8.py"
HEADS = {"trained": "generated:head", "random": "generated:random-head"}

console = Console(stderr=True, highlight=False, soft_wrap=True)


class BadInput(Exception):
    pass


def _profile(args: argparse.Namespace) -> profiles.Profile:
    try:
        profile = profiles.get(args.profile)
    except profiles.UnknownProfile as exc:
        raise BadInput(str(exc)) from exc
    return profile.with_overrides(tensor_parallel_size=args.tp, num_prompts=args.num_prompts,
                                  max_tokens=args.max_tokens)


def _generated_pair() -> Path:
    """Build (or reuse) the tiny pair in the engine environment; returns its folder."""
    proc = subprocess.run([sys.executable, "-m", "validate.synth"], stdout=subprocess.PIPE,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"generating the tiny pair failed (exit {proc.returncode}); "
                           "see the [synth] lines above")
    return Path(json.loads(proc.stdout)["pair"])


def _model_dirs(profile: profiles.Profile, args: argparse.Namespace) -> tuple[str, str]:
    target, draft = args.target, args.draft
    if args.head:
        draft = draft or HEADS[args.head]
    draft = draft or profile.draft
    target = target or profile.target
    if target.startswith(profiles.GENERATED) or draft.startswith(profiles.GENERATED):
        pair = _generated_pair()
        target = str(pair / target.removeprefix(profiles.GENERATED)) \
            if target.startswith(profiles.GENERATED) else target
        draft = str(pair / draft.removeprefix(profiles.GENERATED)) \
            if draft.startswith(profiles.GENERATED) else draft
    for path, what in ((target, "target"), (draft, "draft")):
        if not Path(path).is_dir():
            raise BadInput(f"{what} {path!r} is not a folder on this machine; for hub models run "
                           f"`nox -s validate_tp8` (it fetches them), or pass --{what} PATH")
    return target, draft


def _check(profile: profiles.Profile, target: str, draft: str) -> None:
    problems = compat.head_problems(Path(draft)) + compat.tp_problems(
        Path(target), profile.tensor_parallel_size)
    if problems:
        raise BadInput("refused before starting any engine:\n  - " + "\n  - ".join(problems))


def _exit_code(rec: RunRecord) -> int:
    status = rec.data["status"]
    if status == "passed":
        return EXIT_PASS
    if status == "failed":
        return EXIT_FAIL
    err = (rec.data.get("error") or {}).get("type", "")
    if err in ("IncompatibleModel", "BadGolden"):
        return EXIT_INPUT
    if err == "EnvironmentProblem":
        return EXIT_ENVIRONMENT
    return EXIT_BROKEN


def _report(rec: RunRecord, run_dir: Path) -> None:
    data = rec.data
    verdict = data.get("verdict") or {}
    word = verdict.get("result") or data["status"].upper()
    style = "green" if word == "PASS" else "red"
    if verdict.get("calibration"):
        word += f" ({verdict['calibration']})"
    body = [*verdict.get("reasons", [])]
    if data.get("error"):
        body.append(f"{data['error']['type']}: {data['error']['message']}")
    phases = data.get("phases", {})
    if phases:
        body.append("phases: " + ", ".join(f"{k} {v.get('seconds', '?')}s" for k, v in phases.items()))
    body.append(f"record: {run_dir}/record.json, summary: {run_dir}/summary.md")
    console.print(Panel("\n".join(body), title=f"[bold {style}]{word}[/] {data['name']}",
                        border_style=style), soft_wrap=False)


def _run_dir(args: argparse.Namespace, profile: profiles.Profile) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    head = f"-{args.head}-head" if getattr(args, "head", None) else ""
    default = Path("runs") / f"{profile.name}-tp{profile.tensor_parallel_size}{head}-{stamp}"
    return Path(args.run_dir or default).absolute()


def _e2e_args(profile: profiles.Profile, target: str, draft: str, run_dir: str,
              args: argparse.Namespace) -> list[str]:
    """Options of the end-to-end script (``python -m validate.e2e``), the same on host and in images."""
    return ["--profile", profile.name, "--tp", str(profile.tensor_parallel_size), "--target", target,
            "--draft", draft, "--run-dir", run_dir, "--num-prompts", str(profile.num_prompts),
            "--max-tokens", str(profile.max_tokens), "--golden", args.golden,
            "--reference", args.reference]


def _on_host(profile: profiles.Profile, target: str, draft: str, run_dir: Path,
             args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "validate.e2e",
           *_e2e_args(profile, target, draft, str(run_dir), args)]
    try:
        subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]; the record says how far the run got")


def image(engine: Any, args: argparse.Namespace, kind: str) -> tuple[str, str, bool]:
    """Build (or find, when its inputs are unchanged) the ``kind`` image: (tag, base, pinned)."""
    from validate import containers

    base, pinned = containers.base_reference(kind, args.base_image)
    if not pinned:
        console.print(f"[bold yellow]UNPINNED base image[/] {base}: no digest in "
                      f"{containers.PINS.relative_to(containers.ROOT)}; `nox -s refresh_pins` pins it")
    labels = {"kit_version": _kit_version(), "git_commit": _git_commit(),
              "base_digest": base.split("@")[1] if pinned else "unpinned",
              "vllm_version": containers.pins()[kind]["vllm"]}
    tag = engine.build(kind, base=base, labels=labels, ca_bundle=args.ca_bundle,
                       wheelhouse=args.wheelhouse, network=args.build_network,
                       log=lambda line: console.print(line, markup=False))
    return tag, base, pinned


def _in_container(args: argparse.Namespace, profile: profiles.Profile, target: str, draft: str,
                  run_dir: Path) -> None:
    """Build the profile's image (skipped when its inputs are unchanged) and run the end-to-end
    script in it: models read-only, the run folder writable, no network, no token."""
    from validate import containers

    kind = profile.device
    engine = containers.Engine()
    tag, base, pinned = image(engine, args, kind)
    run_dir.mkdir(parents=True, exist_ok=True)
    mounts = {str(run_dir): ("/run-record", "rw")}
    cache = hub.state_dir()
    cache.mkdir(parents=True, exist_ok=True)
    mounts[str(cache)] = ("/cache", "rw")  # the tiny pair, generated once and reused
    inside = {}
    for role, path in (("target", target), ("draft", draft)):
        if path.startswith(profiles.GENERATED):
            inside[role] = path
        else:
            inside[role] = f"/models/{role}"
            mounts[str(Path(path).resolve())] = (inside[role], "ro")
    cmd = ["python3", "-m", "validate.e2e",
           *_e2e_args(profile, inside["target"], inside["draft"], "/run-record", args)]
    env = {"VALIDATE_CACHE": "/cache", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    try:
        result = engine.run(tag, cmd, mounts=mounts, environment=env,
                            gpus=profile.tensor_parallel_size if kind == "cuda" else 0,
                            timeout_s=args.timeout, log=lambda line: console.print(line, markup=False))
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: the container was removed; the record says how far it got")
        return
    except Exception as exc:  # the engine refused to start it (docker.errors.APIError, ...)
        console.print(f"[bold red]error:[/] the container did not run: {str(exc)[:600]}")
        return
    if (run_dir / "record.json").is_file():
        rec = RunRecord.load(run_dir)
        rec.update(container={"image": tag, "image_id": result.image_id, "base": base,
                              "base_pinned": pinned, "exit_code": result.exit_code,
                              "timed_out": result.exit_code is None})


def _kit_version() -> str:
    try:
        from importlib.metadata import version

        return version("llama4-eagle-validate")
    except Exception:
        return "unknown"


def _git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                       text=True, check=False)
    return r.stdout.strip() or "unknown"


def _finish(run_dir: Path) -> int:
    if not (run_dir / "record.json").is_file():
        console.print(f"[red]the end-to-end script wrote no record in {run_dir}[/]")
        return EXIT_BROKEN
    rec = RunRecord.load(run_dir)
    argv = " ".join(["python -m validate", *(shlex.quote(a) for a in sys.argv[1:])])
    rec.update(invocation={"argv": argv, "kit_commit": _git_commit(), "kit_version": _kit_version()})
    rec.write_reports()
    _report(rec, run_dir)
    return _exit_code(rec)


def rehearse(args: argparse.Namespace) -> int:
    """The whole validation on the engine environment at hand (CPU rehearsal by default), or in
    the CPU image with --container."""
    profile = _profile(args)
    console.print(f"[bold]profile[/] {profile.name}: {profile.description}; "
                  f"TP={profile.tensor_parallel_size}")
    run_dir = _run_dir(args, profile)
    if args.container:
        draft = args.draft or HEADS.get(args.head or "", "") or profile.draft
        _in_container(args, profile, args.target or profile.target, draft, run_dir)
    else:
        target, draft = _model_dirs(profile, args)
        _check(profile, target, draft)
        _on_host(profile, target, draft, run_dir, args)
    return _finish(run_dir)


def calibrate(args: argparse.Namespace) -> int:
    """Run the profile ``--runs`` times (judged by floors only) and write its golden."""
    from validate import goldens

    profile = _profile(args)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    base = Path(args.run_dir or Path("runs") / f"calibrate-{profile.name}-"
                f"tp{profile.tensor_parallel_size}-{stamp}").absolute()
    run = rehearse if profile.generated else validate
    records = []
    for i in range(1, args.runs + 1):
        console.print(f"[bold]calibration run {i} of {args.runs}[/]")
        ns = argparse.Namespace(**{**vars(args), "run_dir": str(base / f"run-{i}"), "golden": "none",
                                   "reference": "live"})
        code = run(ns)
        rec = RunRecord.load(base / f"run-{i}").data
        if code not in (EXIT_PASS, EXIT_FAIL):
            console.print(f"[bold red]error:[/] calibration run {i} ended with exit {code}; "
                          "no golden written")
            return code
        records.append(rec)
    try:
        golden = goldens.make(records, sigmas=profiles.calibration_sigmas())
    except ValueError as exc:
        console.print(f"[bold red]error:[/] no golden written: {exc}")
        return EXIT_FAIL
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
    return EXIT_PASS


def _facts(profile: profiles.Profile, container: bool) -> preflight.HostFacts:
    """What this host offers, gathered quickly (each probe bounded to a few seconds)."""
    facts = preflight.HostFacts()
    if container:
        try:
            from validate import containers

            facts.docker = containers.Engine().info()
        except Exception as exc:
            facts.docker_error = str(exc).splitlines()[0][:300]
    if profile.device == "cuda":
        try:
            out = subprocess.run(preflight.NVIDIA_SMI_QUERY, capture_output=True, text=True,
                                 timeout=20, check=True).stdout
            facts.gpus = preflight.parse_nvidia_smi(out)
        except FileNotFoundError:
            facts.gpu_error = "nvidia-smi is not installed (no NVIDIA driver on this host)"
        except (subprocess.SubprocessError, ValueError) as exc:
            facts.gpu_error = f"nvidia-smi failed: {exc}"
    try:
        facts.shm_bytes = shutil.disk_usage("/dev/shm").total
    except OSError:
        pass
    return facts


def _print_findings(findings: list[preflight.Finding]) -> None:
    table = Table(title="preflight", show_lines=False)
    for col in ("check", "result", "what was found", "how to fix"):
        table.add_column(col, overflow="fold")
    colors = {preflight.OK: "green", preflight.WARN: "yellow", preflight.FAIL: "red"}
    for f in findings:
        table.add_row(f.check, f"[{colors[f.status]}]{f.status.upper()}[/]", f.detail, f.fix)
    console.print(table)


def validate(args: argparse.Namespace) -> int:
    """The real run: preflight, fetch (pinned, verified), image, the end-to-end script, verdict."""
    profile = _profile(args)
    container = not args.no_container
    console.print(f"[bold]profile[/] {profile.name}: {profile.description}")
    findings = preflight.evaluate(profile, _facts(profile, container), container=container)
    _print_findings(findings)
    if not preflight.verdict(findings):
        console.print("[bold red]preflight failed[/]: fix the rows marked FAIL above. Without "
                      f"{profile.tensor_parallel_size} GPUs, rehearse the whole validation on CPU: "
                      "`nox -s rehearse_tp8`")
        return EXIT_PREFLIGHT
    if profile.generated:
        target, draft = profile.target, profile.draft
    else:
        try:
            got = hub.fetch([profile.target, profile.draft], lock_path=Path(args.lock_file),
                            cache_dir=args.cache_dir, local_dir=args.local_dir,
                            offline=args.offline)
        except hub.FetchError as exc:
            console.print(f"[bold red]error:[/] {exc}")
            return exc.exit_code
        target, draft = got[0].path, got[1].path
        _check(profile, target, draft)
    run_dir = _run_dir(args, profile)
    if container:
        _in_container(args, profile, target, draft, run_dir)
    else:
        _on_host(profile, target, draft, run_dir, args)
    return _finish(run_dir)


def _repos(args: argparse.Namespace) -> tuple[str, str]:
    profile = _profile(args)
    target = args.target_repo or profile.target
    draft = args.draft_repo or profile.draft
    if target.startswith(profiles.GENERATED) or draft.startswith(profiles.GENERATED):
        raise BadInput(f"profile {profile.name} uses the generated tiny pair: nothing to fetch "
                       "(`nox -s rehearse_tp8` builds it)")
    return target, draft


def fetch(args: argparse.Namespace) -> int:
    """Download (or, offline, find) the profile's target and head at their pins, and verify them."""
    target, draft = _repos(args)
    try:
        got = hub.fetch([target, draft], lock_path=Path(args.lock_file), cache_dir=args.cache_dir,
                        local_dir=args.local_dir, offline=args.offline)
    except hub.FetchError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: run the same command again; finished files are kept "
                      "and the partial one resumes")
        return EXIT_INTERRUPTED
    by_repo = {g.repo: g for g in got}
    problems = compat.head_problems(Path(by_repo[draft].path)) + compat.tp_problems(
        Path(by_repo[target].path), _profile(args).tensor_parallel_size)
    for g in got:
        pin = "pinned" if g.pinned else "[bold yellow]UNPINNED (main)[/]"
        console.print(f"[green]verified[/] {g.repo}@{g.revision} ({pin}): {g.files} files, "
                      f"{g.bytes / 2**30:.2f} GiB at {g.path}")
    if args.json:
        Path(args.json).write_text(json.dumps([vars(g) for g in got], indent=2) + "\n")
    if problems:
        console.print("[bold red]error:[/] the downloaded models would be refused:\n  - "
                      + "\n  - ".join(problems))
        return EXIT_INPUT
    return EXIT_PASS


def lock(args: argparse.Namespace) -> int:
    """Resolve the profile's repositories at a revision and write their pins to the lock file."""
    repos = _repos(args)
    path = Path(args.lock_file)
    locks = hub.load_lock(path)
    try:
        for repo in repos:
            hub.check_access(repo)
            locks[repo] = hub.resolve(repo, args.revision)
            console.print(f"locked {repo}@{locks[repo].revision}: {len(locks[repo].files)} files, "
                          f"{locks[repo].total_bytes / 2**30:.2f} GiB")
    except hub.FetchError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return exc.exit_code
    hub.save_lock(path, locks)
    console.print(f"wrote {path}")
    return EXIT_PASS


def _add_repo_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="maverick-tp8", help=f"one of: {', '.join(profiles.names())}")
    p.add_argument("--target-repo", default=None, help="override the profile's target repository")
    p.add_argument("--draft-repo", default=None, help="override the profile's EAGLE head repository")
    p.add_argument("--lock-file", default=str(hub.default_lock_path()),
                   help="pins: commit and sha256 of every file (default: the kit's lock file)")
    p.add_argument("--tp", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-prompts", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=None, help=argparse.SUPPRESS)


def refresh_pins(args: argparse.Namespace) -> int:
    """Pin each base image to its registry digest (containers/pins.toml)."""
    from validate import containers

    containers.refresh_pins(containers.Engine(), log=console.print)
    return EXIT_PASS


def _add_verdict_options(p: argparse.ArgumentParser) -> None:
    from validate.goldens import OPTIONS

    g = p.add_argument_group("verdict")
    for flag, kwargs in OPTIONS:
        g.add_argument(flag, **kwargs)


def _add_image_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("image")
    g.add_argument("--base-image", default=None,
                   help="build on this base instead of the pinned one (recorded as unpinned)")
    g.add_argument("--ca-bundle", type=Path, default=None,
                   help="CA bundle for downloads during the build (TLS-intercepting proxies)")
    g.add_argument("--wheelhouse", type=Path, default=None,
                   help="folder of wheels the build may install from (air-gapped builds)")
    g.add_argument("--build-network", default=None, help="network of the build, e.g. host")
    g.add_argument("--timeout", type=float, default=7200, help="seconds before the run is stopped")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m validate", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rehearse", help="run the validation here, without a container "
                       "(the tiny pair on CPU by default)")
    r.add_argument("--profile", default="tiny", help=f"one of: {', '.join(profiles.names())}")
    r.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: profile's)")
    r.add_argument("--head", choices=sorted(HEADS), default=None,
                   help="with a generated pair: the distilled head (default) or a random one")
    r.add_argument("--target", default=None, help="target model folder (overrides the profile)")
    r.add_argument("--draft", default=None, help="EAGLE head folder (overrides the profile)")
    r.add_argument("--run-dir", default=None, help="run folder (default: runs/<profile>-tp<N>-<time>)")
    r.add_argument("--num-prompts", type=int, default=None)
    r.add_argument("--max-tokens", type=int, default=None)
    r.add_argument("--container", action="store_true",
                   help="run inside the CPU image (built through the Docker SDK) instead of here")
    _add_verdict_options(r)
    _add_image_options(r)
    r.set_defaults(func=rehearse)

    c = sub.add_parser("calibrate", help="run a profile N times and write its golden")
    c.add_argument("--profile", default="tiny", help=f"one of: {', '.join(profiles.names())}")
    c.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: profile's)")
    c.add_argument("--runs", type=int, default=5, help="number of runs (default: 5)")
    c.add_argument("--out", default=None, help="golden file (default: validate/data/goldens/...)")
    c.add_argument("--run-dir", default=None, help="folder for the runs' records")
    c.add_argument("--num-prompts", type=int, default=None)
    c.add_argument("--max-tokens", type=int, default=None)
    c.add_argument("--no-container", action="store_true",
                   help="hub profiles: run on this host instead of the pinned image")
    _add_image_options(c)
    c.set_defaults(func=calibrate, head=None, target=None, draft=None, container=False,
                   lock_file=str(hub.default_lock_path()), cache_dir=None, local_dir=None,
                   offline=False)

    v = sub.add_parser("validate", help="the real run: preflight, fetch, image, end-to-end, verdict")
    v.add_argument("--profile", default="maverick-tp8", help=f"one of: {', '.join(profiles.names())}")
    v.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: profile's)")
    v.add_argument("--no-container", action="store_true",
                   help="run the end-to-end script on this host (an environment with vLLM)")
    v.add_argument("--run-dir", default=None, help="run folder (default: runs/<profile>-tp<N>-<time>)")
    v.add_argument("--lock-file", default=str(hub.default_lock_path()), help="weight pins")
    v.add_argument("--cache-dir", type=Path, default=None, help="Hugging Face cache (default: HF_HOME's)")
    v.add_argument("--local-dir", type=Path, default=None, help="plain folders instead of the cache")
    v.add_argument("--offline", action="store_true", help="use only weights already on disk")
    v.add_argument("--num-prompts", type=int, default=None)
    v.add_argument("--max-tokens", type=int, default=None)
    _add_verdict_options(v)
    _add_image_options(v)
    v.set_defaults(func=validate, head=None)

    pn = sub.add_parser("refresh-pins", help="pin the base images to their registry digests")
    pn.set_defaults(func=refresh_pins)

    f = sub.add_parser("fetch", help="download the profile's target and head at their pins, verified")
    _add_repo_options(f)
    f.add_argument("--cache-dir", type=Path, default=None, help="Hugging Face cache (default: HF_HOME's)")
    f.add_argument("--local-dir", type=Path, default=None, help="plain folders instead of the cache")
    f.add_argument("--offline", action="store_true", help="use only what is on disk; list what is missing")
    f.add_argument("--json", default=None, help="write what was fetched (paths, commits) to this file")
    f.set_defaults(func=fetch)

    lk = sub.add_parser("lock", help="pin the profile's repositories (needs the hub)")
    _add_repo_options(lk)
    lk.add_argument("--revision", default="main", help="branch, tag or commit to pin (default: main)")
    lk.set_defaults(func=lock)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BadInput as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return EXIT_INPUT
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]")
        return EXIT_BROKEN
