"""``python -m validate``: the host side of a run: decide, prepare, launch, collect, exit with the verdict.

Host side: never imports vLLM or torch (an 8-GPU box's host may have neither). The engine side is
launched as a subprocess (the tiny pair's generator, then the end-to-end pytest script) and the
run folder it fills is read back.

Exit codes: 0 PASS, 1 FAIL (the verdict), 2 bad input (unknown profile, repository or revision, TP
size or head config vLLM would reject), 3 environment (vLLM missing or the wrong build), 4 the run
broke (an engine crashed); fetch: 5 no access to a gated repository, 6 not enough disk, 7 a file
failed verification, 8 offline and files missing; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.panel import Panel

from validate import compat, hub, profiles
from validate.record import RunRecord

EXIT_PASS, EXIT_FAIL, EXIT_INPUT, EXIT_ENVIRONMENT, EXIT_BROKEN = 0, 1, 2, 3, 4
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
    if err == "IncompatibleModel":
        return EXIT_INPUT
    if err == "EnvironmentProblem":
        return EXIT_ENVIRONMENT
    return EXIT_BROKEN


def _report(rec: RunRecord, run_dir: Path) -> None:
    data = rec.data
    verdict = data.get("verdict") or {}
    word = verdict.get("result") or data["status"].upper()
    style = "green" if word == "PASS" else "red"
    body = [*verdict.get("reasons", [])]
    if data.get("error"):
        body.append(f"{data['error']['type']}: {data['error']['message']}")
    phases = data.get("phases", {})
    if phases:
        body.append("phases: " + ", ".join(f"{k} {v.get('seconds', '?')}s" for k, v in phases.items()))
    body.append(f"record: {run_dir}/record.json, summary: {run_dir}/summary.md")
    console.print(Panel("\n".join(body), title=f"[bold {style}]{word}[/] {data['name']}",
                        border_style=style))


def rehearse(args: argparse.Namespace) -> int:
    """The whole validation on the engine environment at hand (no container): CPU rehearsal."""
    profile = _profile(args)
    console.print(f"[bold]profile[/] {profile.name}: {profile.description}; "
                  f"TP={profile.tensor_parallel_size}")
    target, draft = _model_dirs(profile, args)
    _check(profile, target, draft)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = Path(args.run_dir or Path("runs") / f"{profile.name}-tp{profile.tensor_parallel_size}"
                   f"{'-' + args.head + '-head' if args.head else ''}-{stamp}")
    cmd = [sys.executable, "-m", "pytest", str(E2E_SCRIPT), "-p", "no:cacheprovider", "-s",
           "-q", "--profile", profile.name, "--tp", str(profile.tensor_parallel_size),
           "--target", target, "--draft", draft, "--run-dir", str(run_dir),
           "--num-prompts", str(profile.num_prompts), "--max-tokens", str(profile.max_tokens)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        subprocess.run(cmd, env=env, check=False)
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]; the record says how far the run got")
    if not (run_dir / "record.json").is_file():
        console.print(f"[red]the end-to-end script wrote no record in {run_dir}[/]")
        return EXIT_BROKEN
    rec = RunRecord.load(run_dir)
    _report(rec, run_dir)
    return _exit_code(rec)


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
    r.set_defaults(func=rehearse)

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
