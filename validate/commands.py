"""What each ``python -m validate`` command does, host side: decide, prepare, launch, collect.

Never imports vLLM or torch (an 8-GPU box's host may have neither). The engine side is launched as
a subprocess (the tiny pair's generator, then the end-to-end script), on this host or in a
container, and the run folder it fills is read back. The host creates that folder fresh and
chooses the run's id; it accepts only a record carrying that id, and every ending (a verdict, a
crash, a killed engine, a container that never ran, an interrupt) leaves a record that says which.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from validate import compat, files, hub, preflight, profiles, record, vllm_change, weights_lock
from validate.contract import (
    BadInput,
    BadRecord,
    EnvironmentProblem,
    ErrorKind,
    Exit,
    KitError,
    e2e_argv,
    exit_code,
)
from validate.record import DiskFull, RunRecord

HEADS = {"trained": "generated:head", "random": "generated:random-head"}
console = Console(stderr=True, highlight=False, soft_wrap=True)


def profile_for(args: argparse.Namespace) -> profiles.Profile:
    try:
        profile = profiles.get(args.profile)
    except profiles.UnknownProfile as exc:
        raise BadInput(str(exc)) from exc
    profile = profile.with_overrides(tensor_parallel_size=args.tp, num_prompts=args.num_prompts,
                                     max_tokens=args.max_tokens)
    if problems := profile.problems():
        raise BadInput("; ".join(problems))
    return profile


def check_golden(golden: str | None, profile: profiles.Profile) -> None:
    """``--golden FILE`` refused (exit 2) before anything is generated, built or started unless it
    can be read and is of this profile, TP and (on CPU, where the host can tell) device class:
    falling back to the floors would hide that the golden asked for was never used."""
    if golden in (None, "auto", "none"):
        return
    from validate import device_class, goldens

    path = Path(golden)
    hint = goldens.regenerate_hint(profile.name, profile.tensor_parallel_size)
    if not path.is_file():
        raise BadInput(f"--golden {golden}: no such file; pass a golden from "
                       f"validate/data/goldens/, `--golden auto` (the one for this machine), or "
                       f"make one with {hint}")
    problem = goldens.mismatch(goldens.load(path, regenerate=hint), profile=profile.name,
                               tp=profile.tensor_parallel_size,
                               device_class=device_class.cpu() if profile.device == "cpu" else None)
    if problem:
        raise BadInput(f"--golden {golden} does not apply: {problem}; use `--golden auto`, or make "
                       f"one with {hint}")


def _generated_pair() -> Path:
    """Build (or reuse) the tiny pair in the engine environment; returns its folder."""
    proc = subprocess.run([sys.executable, "-m", "validate.synth"], stdout=subprocess.PIPE,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"generating the tiny pair failed (exit {proc.returncode}); "
                           "see the [synth] lines above")
    return Path(json.loads(proc.stdout)["pair"])


def resolve_models(profile: profiles.Profile, target: str | None, draft: str | None,
                   head: str | None = None) -> tuple[str, str]:
    """The target and head folders of a run, for every mode (host or container): the options,
    else the profile's; ``generated:*`` is the tiny pair, generated here once and cached."""
    draft = draft or HEADS.get(head or "") or profile.draft
    target = target or profile.target
    if target.startswith(profiles.GENERATED) or draft.startswith(profiles.GENERATED):
        pair = _generated_pair()
        target, draft = (str(pair / m.removeprefix(profiles.GENERATED))
                         if m.startswith(profiles.GENERATED) else m for m in (target, draft))
    for path, what in ((target, "target"), (draft, "draft")):
        if not Path(path).is_dir():
            raise BadInput(f"{what} {path!r} is not a folder on this machine; for hub models run "
                           f"`nox -s validate_tp8` (it fetches them), or pass --{what} PATH")
    return target, draft


def check(profile: profiles.Profile, target: str, draft: str,
          refused: str = "refused before starting any engine") -> None:
    """What vLLM would fail on at this TP size (compat), said before anything costly."""
    problems = compat.head_problems(Path(draft)) + compat.tp_problems(
        Path(target), profile.tensor_parallel_size)
    if problems:
        raise BadInput(f"{refused}:\n  - " + "\n  - ".join(problems))


def run_folder(args: argparse.Namespace, profile: profiles.Profile, kind: str = "") -> Path:
    """The run's folder: ``--run-dir``, else ``runs/<profile>-tp<N>[-<kind>]-<time>``. One that
    already holds anything is refused: an old record must never be read as this run's."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    kind = kind or (f"{args.head}-head" if getattr(args, "head", None) else "")
    name = f"{profile.name}-tp{profile.tensor_parallel_size}" + (f"-{kind}" if kind else "")
    run_dir = Path(args.run_dir or Path("runs") / f"{name}-{stamp}").absolute()
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise BadInput(f"run folder {run_dir} is not empty; choose a new --run-dir (or move that "
                       "one aside): its record must not be mistaken for this run's")
    return run_dir


def new_run(args: argparse.Namespace, profile: profiles.Profile) -> RunRecord:
    """A fresh run folder with the host's record in it (status running, a new run id)."""
    run_dir = run_folder(args, profile)
    name = f"{profile.name}-tp{profile.tensor_parallel_size}"
    try:
        return RunRecord.create(run_dir, profile=profile.to_dict(), name=name,
                                run_id=uuid.uuid4().hex[:12])
    except OSError as exc:
        raise BadInput(f"run folder {run_dir} cannot be written ({exc})") from exc


def _e2e_values(profile: profiles.Profile, target: str, draft: str, run_dir: str,
                args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    return {"--profile": profile.name, "--tp": profile.tensor_parallel_size, "--target": target,
            "--draft": draft, "--run-dir": run_dir, "--num-prompts": profile.num_prompts,
            "--max-tokens": profile.max_tokens, "--golden": args.golden,
            "--reference": args.reference, "--run-id": run_id}


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI cancel, `docker stop`, `kill`) takes the same path as Ctrl-C; and SIGINT
    interrupts even where it was inherited as ignored (jobs started in the background by a
    non-interactive shell, `nohup`), where Python would otherwise never see it."""
    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, raise_interrupt)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def on_host(rec: RunRecord, profile: profiles.Profile, target: str, draft: str,
            args: argparse.Namespace) -> str:
    """Run the end-to-end script here; returns how it ended, for the record if it wrote none."""
    argv = e2e_argv(_e2e_values(profile, target, draft, str(rec.dir), args, rec.data["run_id"]))
    change = getattr(args, "vllm_under_test", None) or _release()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(vllm_change.cache_env(change) if change else {})}
    # Its own process group: a signal meant for the run reaches the script and vLLM's workers
    # together, and whatever is left of the group when the script ends is ended with it.
    # (its own session keeps a terminal's Ctrl-C, which the kit forwards, from reaching it twice;
    # if the kit dies, the script notices and stops itself: validate/e2e/__main__.py)
    proc = subprocess.Popen([sys.executable, "-m", "validate.e2e", *argv], env=env,
                            start_new_session=True)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: the engine gets 60 s to record it and stop its workers")
        _signal_group(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # orphaned workers of a killed script
        if change:
            _merge(rec.dir, vllm_under_test=change.to_dict())
    return f"the end-to-end script exited {code}" + (
        f" (killed by signal {-code}: out of memory, or killed from outside?)" if code < 0 else "")


def _release() -> vllm_change.VllmUnderTest | None:
    """The release installed here (None where vLLM is missing: the engine side says so)."""
    try:
        return vllm_change.release(sys.executable)
    except EnvironmentProblem:
        return None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def in_container(rec: RunRecord, profile: profiles.Profile, target: str, draft: str,
                 args: argparse.Namespace) -> str:
    """Build the profile's image (skipped when its inputs are unchanged) and run the end-to-end
    script in it with the container policy of ``containers`` (models read-only, the run folder
    writable, no network, no token)."""
    from validate import containers

    engine = containers.Engine()
    try:
        tag, base, pinned = image(engine, args, profile.device)
    except containers.ContainerError as exc:  # a failed build: said, recorded, no engine started
        return f"the image could not be built: {str(exc)[:600]}"
    environment = dict(containers.E2E_ENVIRONMENT)
    change = None
    if vllm_change.passed_on(args):
        try:
            tag, change = change_layer(engine, tag, args)
        except KitError as exc:  # a patch that does not apply to the image's vLLM, ...
            rec.end(exc.kind, f"the vLLM under test: {exc}", where="image")
            console.print(f"[bold red]error:[/] {escape(str(exc))}")
            return "refused before starting any engine"
        console.print(f"[bold]vLLM under test[/]: {escape(change.describe())}; image {tag}")
        environment.update(VLLM_CACHE_ROOT=change.cache_root,
                           TORCHINDUCTOR_CACHE_DIR=f"{change.cache_root}/inductor")
    mounts, inside = containers.e2e_mounts(rec.dir, {"target": target, "draft": draft})
    argv = e2e_argv(_e2e_values(profile, inside["target"], inside["draft"], containers.RUN_FOLDER,
                                args, rec.data["run_id"]))
    rec.update(container={"image": tag, "base": base, "base_pinned": pinned, "exit_code": None})
    try:
        result = engine.run(tag, ["python3", "-m", "validate.e2e", *argv], mounts=mounts,
                            environment=environment,
                            gpus=profile.tensor_parallel_size if profile.device == "cuda" else 0,
                            timeout_s=args.timeout, log=lambda line: console.print(line, markup=False))
    except Exception as exc:  # the engine refused to start it (docker.errors.APIError, ...)
        return f"the container did not run: {str(exc)[:600]}"
    container = {"image": tag, "image_id": result.image_id, "base": base, "base_pinned": pinned,
                 "exit_code": result.exit_code, "timed_out": result.exit_code is None,
                 "user": result.user, "ipc": result.host_config["IpcMode"],
                 "mounts": result.host_config["Binds"]}
    _merge(rec.dir, container=container,
           **({"vllm_under_test": {**change.to_dict(), "image": tag}} if change else {}))
    if result.exit_code is None:
        return f"the container ran past --timeout {args.timeout:.0f} s and was stopped"
    return f"the container exited {result.exit_code}"


def change_layer(engine: Any, tag: str,
                 args: argparse.Namespace) -> tuple[str, vllm_change.VllmUnderTest]:
    """The change the options name as a layer over image ``tag``'s own vLLM (a patch is applied
    to exactly the files the image holds): (the layer's tag, the vLLM under test)."""
    import tempfile

    package, version, accepted = json.loads(
        engine.python_output(tag, vllm_change.PROBE).strip().splitlines()[-1])
    if not package or not version:
        raise EnvironmentProblem(f"image {tag} holds no vLLM (its python3 finds no vllm package)")
    with tempfile.TemporaryDirectory(prefix="kit-change-") as tmp:
        layer = vllm_change.for_image(
            args, version, accepted, lambda files, tree: engine.copy_out(tag, package, files, tree),
            Path(tmp))
        assert layer is not None  # called only where a change option is given
        new_tag = engine.build_change(tag, layer, package,
                                      log=lambda line: console.print(line, markup=False))
    return new_tag, layer.change


def _merge(run_dir: Path, **fields: Any) -> None:
    try:
        RunRecord.load(run_dir).update(**fields)
    except BadRecord:
        pass  # finish() says what is wrong with it


def image(engine: Any, args: argparse.Namespace, kind: str) -> tuple[str, str, bool]:
    """Build (or find, when its inputs are unchanged) the ``kind`` image: (tag, base, pinned)."""
    from validate import containers

    base, pinned = containers.base_reference(kind, args.base_image)
    if not pinned:
        console.print(f"[bold yellow]UNPINNED base image[/] {base}: no digest in "
                      f"{containers.PINS.relative_to(containers.ROOT)}; `nox -s refresh_pins` pins it")
    labels = {"kit_version": kit_version(), "git_commit": git_commit(),
              "base_digest": base.split("@")[1] if pinned else "unpinned",
              "vllm_version": containers.pins()[kind]["vllm"]}
    tag = engine.build(kind, base=base, labels=labels, ca_bundle=args.ca_bundle,
                       wheelhouse=args.wheelhouse, network=args.build_network,
                       log=lambda line: console.print(line, markup=False))
    return tag, base, pinned


def kit_version() -> str:
    try:
        from importlib.metadata import version

        return version("llama4-eagle-validate")
    except Exception:
        return "unknown"


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                       text=True, check=False)
    return r.stdout.strip() or "unknown"


def finish(host: RunRecord, how: str, interrupted: bool = False) -> tuple[RunRecord, Exit]:
    """The run's record as the engine side left it, accepted only if it carries this run's id;
    a missing, foreign or unfinished one is ended here with what happened (exit 4, or 130)."""
    run_id = host.data["run_id"]
    try:
        rec = RunRecord.load(host.dir)
        problem = "" if rec.data.get("run_id") == run_id else (
            f"the record in {host.dir} carries run id {rec.data.get('run_id')!r}, not this run's "
            f"{run_id!r}: it is not this run's record")
    except BadRecord as exc:
        rec, problem = host, f"the record the engine side left is unusable: {exc}"
    if problem:
        rec = RunRecord.create(host.dir, profile=host.data["profile"], name=host.data["name"],
                               run_id=run_id)
        rec.end(ErrorKind.BROKEN, f"{problem} ({how})", where="collect")
    elif rec.data["status"] == "running":
        where = rec.where()
        if interrupted:
            rec.end(ErrorKind.INTERRUPTED, f"interrupted during {where} ({how})", where=where)
        elif rec is host:
            rec.end(ErrorKind.BROKEN, f"the end-to-end script never started the run ({how})",
                    where="start")
        else:
            rec.end(ErrorKind.BROKEN, f"the engine side stopped during {where} without finishing "
                    f"the record ({how})", where=where)
    argv = " ".join(["python -m validate", *(shlex.quote(a) for a in sys.argv[1:])])
    try:
        rec.update(invocation={"argv": argv, "kit_commit": git_commit(),
                               "kit_version": kit_version()},
                   **({"previous_runs_cut_off": host.data["previous_runs_cut_off"]}
                      if host.data.get("previous_runs_cut_off") else {}))
        rec.write_reports()
    except DiskFull as exc:  # the lean record on disk says it: the run broke (exit 4)
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
    return rec, exit_code(rec.data)


def run(args: argparse.Namespace, profile: profiles.Profile, target: str, draft: str,
        container: bool) -> tuple[RunRecord, Exit]:
    """One run: fresh folder, the end-to-end script (here or in the image), the record back."""
    if container:  # no Docker engine, no run folder: said before anything is started
        from validate import containers

        containers.Engine()
    previous = record.cut_off_runs()
    host = new_run(args, profile)
    if previous:
        host.update(previous_runs_cut_off=previous)
        for p in previous:
            console.print(f"[bold yellow]a previous run was cut off[/]: {p['run_dir']} (kit "
                          f"process {p['pid']} gone, record {p['status']}"
                          + (f", ended broken at {p['where']}" if p.get("ended_as") else "") + ")")
    entry = record.enter_ledger(host.dir)
    launch = in_container if container else on_host
    try:
        with signals_as_interrupt():
            try:
                how = launch(host, profile, target, draft, args)
            except KeyboardInterrupt:
                return finish(host, "Ctrl-C or SIGTERM", interrupted=True)
        return finish(host, how)
    finally:
        record.leave_ledger(entry)


def rehearse(args: argparse.Namespace) -> tuple[RunRecord, Exit]:
    """The whole validation with the engine environment at hand (the tiny pair on CPU by
    default), or in the CPU image with --container."""
    profile = profile_for(args)
    console.print(f"[bold]profile[/] {profile.name}: {profile.description}; "
                  f"TP={profile.tensor_parallel_size}")
    check_golden(args.golden, profile)
    if args.full:
        return rehearse_full(args)
    # before anything is generated or started: a change that cannot work is refused here (in a
    # container, what needs the image's vLLM is checked once the image is there)
    vllm_change.precheck(args)
    if not args.container and (change := vllm_change.from_args(args, sys.executable)):
        args.vllm_under_test = change
        console.print(f"[bold]vLLM under test[/]: {escape(change.describe())}; overlay "
                      f"{change.overlay}")
    target, draft = resolve_models(profile, args.target, args.draft, args.head)
    check(profile, target, draft)
    return run(args, profile, target, draft, args.container)


# The tiny pair as ``rehearse --full`` publishes it on the loopback hub.
FULL_REPOS = {"target": "kit-rehearsal/tiny-llama4", "head": "kit-rehearsal/tiny-llama4-eagle"}


def rehearse_full(args: argparse.Namespace) -> tuple[RunRecord | None, Exit]:
    """The real run's flow on the tiny pair: every step of ``validate`` except the device.

    The pair is published as two gated repositories on a Hugging Face hub on loopback, started
    here; then, exactly as a user runs them, ``python -m validate lock`` pins them and ``python -m
    validate validate`` takes them through preflight, the configs-first fetch into a Hugging Face
    cache (its symlinked layout), verification, the CPU image and the container run, and reports
    the verdict. The token (HF_TOKEN, else one made for this run) is the only one the hub
    accepts; it stays on the host. Returns the run's record (None where none was written).
    """
    import secrets
    import shutil
    import tempfile

    from validate import loopback_hub

    profile = profile_for(args)
    if not profile.generated:
        raise BadInput(f"--full rehearses the real run on the generated tiny pair; profile "
                       f"{profile.name} has hub models: `nox -s validate_tp8 -- --profile "
                       f"{profile.name}` runs it")
    if args.head or args.target or args.draft:
        raise BadInput("--full publishes the generated pair as it is: drop --head/--target/--draft")
    run_dir = run_folder(args, profile, kind="full")
    vllm_change.precheck(args)  # the rest is checked against the image's vLLM, in the validate step
    pair = _generated_pair()
    check(profile, str(pair / "target"), str(pair / "head"))
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
        sized = [f"--{k}={v}" for k, v in (("tp", args.tp), ("num-prompts", args.num_prompts),
                                            ("max-tokens", args.max_tokens)) if v is not None]
        steps = [["lock", "--profile", profile.name, *repos],
                 ["validate", "--profile", profile.name, *sized, *repos, "--run-dir", str(run_dir),
                  *_passed_on(args), *vllm_change.passed_on(args)]]
        try:
            for step in steps:
                console.print(f"[bold]$ python -m validate {shlex.join(step)}[/]")
                code = _child([sys.executable, "-m", "validate", *step], env)
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
    argv = " ".join(["python -m validate", *(shlex.quote(a) for a in sys.argv[1:])])
    rec.update(invocation={**rec.data.get("invocation", {}), "argv": argv,
                           "steps": ["python -m validate " + shlex.join(s) for s in steps]})
    rec.write_reports()
    return rec, ended


def _passed_on(args: argparse.Namespace) -> list[str]:
    """The verdict and image options of this command, for ``validate``."""
    out = []
    for flag in ("--golden", "--reference", "--base-image", "--ca-bundle", "--wheelhouse",
                 "--build-network", "--timeout"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out.append(f"{flag}={value}")
    return out


def _child(argv: list[str], env: dict[str, str]) -> int:
    """Run a step of the flow; Ctrl-C or SIGTERM here is passed on to it once (it records the
    interruption and stops its container), and its exit code is the step's. Its own session: a
    terminal's Ctrl-C reaches it only through here, never twice."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    with signals_as_interrupt():
        try:
            return proc.wait()
        except KeyboardInterrupt:
            console.print("[red]interrupted[/]: passing it on to the running step")
            proc.send_signal(signal.SIGINT)
            try:
                return proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return Exit.INTERRUPTED


def host_facts(profile: profiles.Profile, args: argparse.Namespace,
               container: bool) -> preflight.HostFacts:
    def docker_info() -> dict[str, Any]:
        from validate import containers

        return containers.Engine().info()

    needed = None if profile.generated else hub.bytes_to_download(
        [profile.target, profile.draft], lock_path=Path(args.lock_file), cache_dir=args.cache_dir,
        local_dir=args.local_dir)
    where = hub.download_root(args.cache_dir, args.local_dir)
    return preflight.gather(profile, docker_info=docker_info if container else None,
                            disk_path=None if profile.generated else where,
                            disk_needed_bytes=needed)


def calibration_runs(args: argparse.Namespace, profile: profiles.Profile,
                     run: Any) -> Iterator[tuple[int, RunRecord, Exit]]:
    """The ``--runs`` runs of a calibration, each judged by floors only and with a live reference
    (an old golden must never shape a new one)."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    base = Path(args.run_dir or Path("runs") / f"calibrate-{profile.name}-"
                f"tp{profile.tensor_parallel_size}-{stamp}").absolute()
    for i in range(1, args.runs + 1):
        console.print(f"[bold]calibration run {i} of {args.runs}[/]")
        ns = argparse.Namespace(**{**vars(args), "run_dir": str(base / f"run-{i}"), "golden": "none",
                                   "reference": "live"})
        rec, code = run(ns)
        yield i, rec, code


def validate(args: argparse.Namespace) -> tuple[RunRecord, Exit] | tuple[list[preflight.Finding], Exit]:
    """The real run: preflight, fetch (pinned, verified), image, the end-to-end script, verdict.
    Returns the preflight findings instead of a record when preflight fails."""
    profile = profile_for(args)
    if getattr(args, "target_repo", None) or getattr(args, "draft_repo", None):
        profile = profile.with_overrides(target=args.target_repo, draft=args.draft_repo)
    container = not args.no_container
    console.print(f"[bold]profile[/] {profile.name}: {profile.description}")
    check_golden(args.golden, profile)
    vllm_change.precheck(args)  # before preflight, fetch or build: a change that cannot work
    if not container and (change := vllm_change.from_args(args, sys.executable)):
        args.vllm_under_test = change
        console.print(f"[bold]vLLM under test[/]: {escape(change.describe())}; overlay "
                      f"{change.overlay}")
    findings = preflight.evaluate(profile, host_facts(profile, args, container), container=container)
    if not preflight.verdict(findings):
        return findings, Exit.PREFLIGHT
    print_findings(findings)
    if profile.generated:
        target, draft = resolve_models(profile, None, None)
        check(profile, target, draft)
    else:  # fetch_checked refuses what vLLM would reject from the configs, before the weights
        got = fetch_checked(profile, profile.target, profile.draft, args)
        say_fetched(got)
        target, draft = got[0].path, got[1].path
    return run(args, profile, target, draft, container)


def print_findings(findings: list[preflight.Finding]) -> None:
    from rich.table import Table

    table = Table(title="preflight", show_lines=False)
    for col in ("check", "result", "what was found", "how to fix"):
        table.add_column(col, overflow="fold")
    colors = {preflight.OK: "green", preflight.WARN: "yellow", preflight.FAIL: "red"}
    for f in findings:
        table.add_row(f.check, f"[{colors[f.status]}]{f.status.upper()}[/]", f.detail, f.fix)
    console.print(table)


def repos(args: argparse.Namespace) -> tuple[str, str]:
    profile = profile_for(args)
    target = args.target_repo or profile.target
    draft = args.draft_repo or profile.draft
    if target.startswith(profiles.GENERATED) or draft.startswith(profiles.GENERATED):
        raise BadInput(f"profile {profile.name} uses the generated tiny pair: nothing to fetch "
                       "(`nox -s rehearse_tp8` builds it)")
    return target, draft


def fetch_checked(profile: profiles.Profile, target: str, draft: str,
                  args: argparse.Namespace) -> list[hub.Fetched]:
    """Fetch target and head, verified; their configs first, so that a TP size or head vLLM
    would reject is refused before hundreds of GB are downloaded."""
    fetch_args = dict(lock_path=Path(args.lock_file), cache_dir=args.cache_dir,
                      local_dir=args.local_dir, offline=args.offline)
    got = hub.fetch([target, draft], only=("config.json",), **fetch_args)
    check(profile, got[0].path, got[1].path, refused="refused before downloading the weights")
    return hub.fetch([target, draft], **fetch_args)


def say_fetched(got: list[hub.Fetched]) -> None:
    for g in got:
        pin = "pinned" if g.pinned else "[bold yellow]UNPINNED (main)[/]"
        console.print(f"[green]verified[/] {g.repo}@{g.revision} ({pin}): {g.files} files, "
                      f"{g.bytes / 2**30:.2f} GiB at {g.path}")


def fetch(args: argparse.Namespace) -> Exit:
    """Download (or, offline, find) the profile's target and head at their pins, and verify them."""
    target, draft = repos(args)
    got = fetch_checked(profile_for(args), target, draft, args)
    say_fetched(got)
    if args.json:
        Path(args.json).write_text(json.dumps([vars(g) for g in got], indent=2, default=str) + "\n")
    return Exit.PASS


def lock(args: argparse.Namespace) -> Exit:
    """Resolve the profile's repositories at a revision and write their pins to the lock file."""
    path = Path(args.lock_file)
    # A broken lock must never stop its own repair: good pins are kept, broken ones rewritten.
    locks, problems = weights_lock.load(path, strict=False) if path.exists() else ({}, [])
    for problem in problems:
        console.print(f"[bold yellow]dropping a broken pin[/]: {problem}")
    for repo in repos(args):
        hub.check_access(repo)
        locks[repo] = hub.resolve(repo, args.revision)
        console.print(f"locked {repo}@{locks[repo].revision}: {len(locks[repo].files)} files, "
                      f"{locks[repo].total_bytes / 2**30:.2f} GiB")
    hub.save_lock(path, locks)
    console.print(f"wrote {path}")
    return Exit.PASS
