"""``validate`` (the real run: preflight, fetch, image, the end-to-end script, verdict) and the
acquire stage's own commands, ``fetch`` and ``lock``. Host side."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.markup import escape

from validate import checks, hub, launch, preflight, profiles, request, ui, vllm_change, weights_lock
from validate.contract import BadInput, Exit
from validate.record import RunRecord
from validate.ui import console


def host_facts(req: request.Run) -> preflight.HostFacts:
    def docker_info() -> dict[str, Any]:
        from validate import containers

        return containers.Engine().info()

    profile, w = req.profile, req.weights
    needed = None if profile.generated else hub.bytes_to_download(
        [profile.target, profile.draft], lock_path=w.lock_file, cache_dir=w.cache_dir,
        local_dir=w.local_dir)
    where = hub.download_root(w.cache_dir, w.local_dir)
    return preflight.gather(profile, docker_info=docker_info if req.container else None,
                            disk_path=None if profile.generated else where,
                            disk_needed_bytes=needed)


def validate(req: request.Run) -> tuple[RunRecord, Exit] | tuple[list[preflight.Finding], Exit]:
    """The real run: preflight, fetch (pinned, verified), image, the end-to-end script, verdict.
    Returns the preflight findings instead of a record when preflight fails."""
    profile = req.profile
    console.print(f"[bold]profile[/] {profile.name}: {profile.description}")
    checks.golden(req.golden, profile)
    checks.nodes(req)
    checks.serving(req)
    vllm_change.precheck(req.change)  # before preflight, fetch or build: a change that cannot work
    if not req.container and (change := vllm_change.from_args(req.change, sys.executable)):
        req = req.but(vllm_under_test=change)
        console.print(f"[bold]vLLM under test[/]: {escape(change.describe())}; overlay "
                      f"{change.overlay}")
    findings = preflight.evaluate(profile, host_facts(req), container=req.container)
    if not preflight.verdict(findings):
        return findings, Exit.PREFLIGHT
    ui.findings(findings)
    if profile.generated:
        target, draft = launch.resolve_models(profile, None, None)
        checks.models(profile, target, draft)
    else:  # fetch_checked refuses what vLLM would reject from the configs, before the weights
        got = fetch_checked(req)
        say_fetched(got)
        target, draft = got[0].path, got[1].path
    return launch.run(req, target, draft)


def repos(req: request.Run) -> tuple[str, str]:
    profile = req.profile
    if profile.generated or profile.draft.startswith(profiles.GENERATED):
        raise BadInput(f"profile {profile.name} uses the generated tiny pair: nothing to fetch "
                       "(`nox -s rehearse_tp8` builds it)")
    return profile.target, profile.draft


def fetch_checked(req: request.Run) -> list[hub.Fetched]:
    """Fetch target and head, verified; their configs first, so that a TP size or head vLLM
    would reject is refused before hundreds of GB are downloaded."""
    target, draft = repos(req)
    w = req.weights
    fetch_args = dict(lock_path=w.lock_file, cache_dir=w.cache_dir, local_dir=w.local_dir,
                      offline=w.offline)
    got = hub.fetch([target, draft], only=("config.json",), **fetch_args)
    checks.models(req.profile, got[0].path, got[1].path,
                  refused="refused before downloading the weights")
    return hub.fetch([target, draft], **fetch_args)


def say_fetched(got: list[hub.Fetched]) -> None:
    for g in got:
        pin = "pinned" if g.pinned else "[bold yellow]UNPINNED (main)[/]"
        console.print(f"[green]verified[/] {g.repo}@{g.revision} ({pin}): {g.files} files, "
                      f"{g.bytes / 2**30:.2f} GiB at {g.path}")


def fetch(req: request.Run, json_out: str | None) -> Exit:
    """Download (or, offline, find) the profile's target and head at their pins, and verify them."""
    got = fetch_checked(req)
    say_fetched(got)
    if json_out:
        Path(json_out).write_text(json.dumps([vars(g) for g in got], indent=2, default=str) + "\n")
    return Exit.PASS


def lock(req: request.Run, revision: str) -> Exit:
    """Resolve the profile's repositories at a revision and write their pins to the lock file."""
    path = req.weights.lock_file
    # A broken lock must never stop its own repair: good pins are kept, broken ones rewritten.
    locks, problems = weights_lock.load(path, strict=False) if path.exists() else ({}, [])
    for problem in problems:
        console.print(f"[bold yellow]dropping a broken pin[/]: {problem}")
    for repo in repos(req):
        hub.check_access(repo)
        locks[repo] = hub.resolve(repo, revision)
        console.print(f"locked {repo}@{locks[repo].revision}: {len(locks[repo].files)} files, "
                      f"{locks[repo].total_bytes / 2**30:.2f} GiB")
    hub.save_lock(path, locks)
    console.print(f"wrote {path}")
    return Exit.PASS
