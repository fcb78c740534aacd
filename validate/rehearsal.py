"""``rehearse``: the whole validation with the engine environment at hand (the tiny pair on CPU by
default), in the CPU image with ``--container``, or the real run's whole flow with ``--full``.
Host side."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from rich.markup import escape

from validate import checks, files, launch, loopback_hub, request, vllm_change
from validate.contract import BadInput, BadRecord, Exit
from validate.record import RunRecord
from validate.ui import console


def rehearse(req: request.Run) -> tuple[RunRecord | None, Exit]:
    profile = req.profile
    console.print(f"[bold]profile[/] {profile.name}: {profile.description}; "
                  f"TP={profile.tensor_parallel_size}")
    checks.golden(req.golden, profile)
    checks.nodes(req)
    checks.serving(req)
    if req.full:
        return rehearse_full(req)
    # before anything is generated or started: a change that cannot work is refused here (in a
    # container, what needs the image's vLLM is checked once the image is there)
    vllm_change.precheck(req.change)
    if not req.container and (change := vllm_change.from_args(req.change, sys.executable)):
        req = req.but(vllm_under_test=change)
        console.print(f"[bold]vLLM under test[/]: {escape(change.describe())}; overlay "
                      f"{change.overlay}")
    target, draft = launch.resolve_models(profile, req.target, req.draft, req.head)
    checks.models(profile, target, draft)
    return launch.run(req, target, draft)


# The tiny pair as ``rehearse --full`` publishes it on the loopback hub.
FULL_REPOS = {"target": "kit-rehearsal/tiny-llama4", "head": "kit-rehearsal/tiny-llama4-eagle"}


def rehearse_full(req: request.Run) -> tuple[RunRecord | None, Exit]:
    """The real run's flow on the tiny pair: every step of ``validate`` except the device.

    The pair is published as two gated repositories on a Hugging Face hub on loopback, started
    here; then, exactly as a user runs them, ``python -m validate lock`` pins them and ``python -m
    validate validate`` takes them through preflight, the configs-first fetch into a Hugging Face
    cache (its symlinked layout), verification, the CPU image and the container run, and reports
    the verdict. The token (HF_TOKEN, else one made for this run) is the only one the hub
    accepts; it stays on the host. Returns the run's record (None where none was written).
    """
    profile = req.profile
    if not profile.generated:
        raise BadInput(f"--full rehearses the real run on the generated tiny pair; profile "
                       f"{profile.name} has hub models: `nox -s validate_tp8 -- --profile "
                       f"{profile.name}` runs it")
    if req.head or req.target or req.draft:
        raise BadInput("--full publishes the generated pair as it is: drop --head/--target/--draft")
    run_dir = launch.run_folder(req, kind="full")
    vllm_change.precheck(req.change)  # the rest is checked against the image's vLLM, in validate
    pair = launch.generated_pair()
    checks.models(profile, str(pair / "target"), str(pair / "head"))
    token = os.environ.get("HF_TOKEN") or f"hf_rehearsal{secrets.token_hex(16)}"
    manifest = (pair / "pair.json").read_bytes()  # the weights' identity, for the goldens
    work = Path(tempfile.mkdtemp(prefix="full-rehearsal-", dir=files.state_dir()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    with loopback_hub.serving(loopback_hub.Hub()) as fake:
        for role, repo in FULL_REPOS.items():
            fake.publish(repo, pair / role, gated=True, allowed_tokens={token},
                         extra={"pair.json": manifest})
        env.update(HF_ENDPOINT=fake.url, HF_HOME=str(work / "hf"), HF_TOKEN=token,
                   HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
        console.print(f"[bold]full rehearsal[/]: the tiny pair published at {fake.url} as "
                      f"{FULL_REPOS['target']} and {FULL_REPOS['head']} (gated); cache {work / 'hf'}")
        repos = ["--target-repo", FULL_REPOS["target"], "--draft-repo", FULL_REPOS["head"],
                 "--lock-file", str(work / "weights.lock.json")]
        verdict = [f"--golden={req.golden}", f"--reference={req.reference}"] if req.golden else []
        steps = [["lock", "--profile", profile.name, *repos],
                 ["validate", "--profile", profile.name, *req.sized_argv(), *repos,
                  "--run-dir", str(run_dir), *verdict, *req.image.argv(), *req.change.argv()]]
        try:
            for step in steps:
                console.print(f"[bold]$ python -m validate {shlex.join(step)}[/]")
                code = launch.child([sys.executable, "-m", "validate", *step], env)
                if code != Exit.PASS:
                    break
        finally:
            shutil.rmtree(work, ignore_errors=True)
    ended = Exit(code) if code in {int(c) for c in Exit} else Exit.BROKEN
    try:
        rec = RunRecord.load(run_dir)
    except BadRecord:
        return None, ended
    # REPRODUCE.md names this command: the steps' lock file and cache were this run's own
    rec.update(invocation={**rec.data.get("invocation", {}), "argv": launch.invocation(),
                           "steps": ["python -m validate " + shlex.join(s) for s in steps]})
    rec.write_reports()
    return rec, ended
