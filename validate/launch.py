"""One run, host side: a fresh run folder, the end-to-end script here or in the image, the record
back. Never imports vLLM or torch (an 8-GPU box's host may have neither).

The engine side is launched as a subprocess (the tiny pair's generator, then the end-to-end
script), on this host or in a container, and the run folder it fills is read back. The host
creates that folder fresh and chooses the run's id; it accepts only a record carrying that id, and
every ending (a verdict, a crash, a killed engine, a container that never ran, an interrupt)
leaves a record that says which.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from rich.markup import escape

from validate import build, files, profiles, record, request, vllm_change
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
from validate.interrupts import signals_as_interrupt
from validate.record import DiskFull, RunRecord
from validate.ui import console

HEADS = {"trained": "generated:head", "random": "generated:random-head"}


def cached_pair() -> Path | None:
    """The tiny pair's folder if it is already generated here, else None; found without torch.

    ``validate.synth`` names the folder by its fingerprint (``synth.fingerprint``: the pair's data
    files, synth.py's own bytes and torch's version), but asking it means a process that imports
    torch: about 1.6 CPU-seconds on the AVX-512 EPYC for each of the ~20 runs of a CI tier. This
    recomputes the same hash from the same files and torch's installed version (its package
    metadata), so a run whose pair is there starts no such process. It is written twice on
    purpose: synth.py's own bytes are part of the fingerprint, which every golden pins as the
    models' revision, so moving the hash out of synth.py would orphan every golden, the GPU ones
    among them. ``tests/test_synth.py`` checks that both name the same folder."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:  # a host without torch: the generator says
        return None
    h = hashlib.sha256()
    for name in ("tiny_pair.toml", "prompts.toml"):
        h.update(resources.files("validate.data").joinpath(name).read_bytes())
    h.update(resources.files("validate").joinpath("synth.py").read_bytes())
    h.update(torch_version.split("+")[0].encode())
    folder = files.state_dir() / "tiny-pair" / h.hexdigest()[:16]
    return folder if (folder / "pair.json").is_file() else None


def generated_pair(fp8: str | None = None) -> Path:
    """Build (or reuse) the tiny pair in the engine environment, with FP8 target variant ``fp8``
    if asked (``validate.quantize``); returns the pair's folder."""
    if not fp8 and (pair := cached_pair()):
        return pair
    cmd = ["-m", "validate.quantize", "--variant", fp8] if fp8 else ["-m", "validate.synth"]
    proc = subprocess.run([sys.executable, *cmd], stdout=subprocess.PIPE, text=True, check=False)
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
        pair = generated_pair(fp8=profiles.fp8_variant(target) or profiles.fp8_variant(draft))
        target, draft = (str(pair / m.removeprefix(profiles.GENERATED))
                         if m.startswith(profiles.GENERATED) else m for m in (target, draft))
    for path, what in ((target, "target"), (draft, "draft")):
        if not Path(path).is_dir():
            raise BadInput(f"{what} {path!r} is not a folder on this machine; for hub models run "
                           f"`nox -s validate_tp8` (it fetches them), or pass --{what} PATH")
    return target, draft


def run_folder(req: request.Run, kind: str = "") -> Path:
    """The run's folder: ``--run-dir``, else ``runs/<profile>-tp<N>[-<kind>]-<time>``. One that
    already holds anything is refused: an old record must never be read as this run's."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    kind = kind or (f"{req.head}-head" if req.head else "")
    name = f"{req.profile.name}-tp{req.profile.tensor_parallel_size}" + (f"-{kind}" if kind else "")
    run_dir = Path(req.run_dir or Path("runs") / f"{name}-{stamp}").absolute()
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise BadInput(f"run folder {run_dir} is not empty; choose a new --run-dir (or move that "
                       "one aside): its record must not be mistaken for this run's")
    return run_dir


def new_run(req: request.Run) -> RunRecord:
    """A fresh run folder with the host's record in it (status running, a new run id)."""
    run_dir = run_folder(req)
    profile = req.profile
    name = f"{profile.name}-tp{profile.tensor_parallel_size}"
    try:
        return RunRecord.create(run_dir, profile=profile.to_dict(), name=name,
                                run_id=uuid.uuid4().hex[:12])
    except OSError as exc:
        raise BadInput(f"run folder {run_dir} cannot be written ({exc})") from exc


def _e2e_values(req: request.Run, target: str, draft: str, run_dir: str,
                run_id: str) -> dict[str, Any]:
    profile = req.profile
    return {"--profile": profile.name, "--tp": profile.tensor_parallel_size,
            "--pp": profile.pipeline_parallel_size, "--nodes": profile.nodes, "--target": target,
            "--draft": draft, "--run-dir": run_dir, "--num-prompts": profile.num_prompts,
            "--max-tokens": profile.max_tokens, "--golden": req.golden,
            "--reference": req.reference, "--run-id": run_id,
            **({"--path": "serving", "--concurrency": req.concurrency, "--repeats": req.repeats}
               if req.path == "serving" else {})}


def on_host(rec: RunRecord, req: request.Run, target: str, draft: str) -> str:
    """Run the end-to-end script here; returns how it ended, for the record if it wrote none."""
    argv = e2e_argv(_e2e_values(req, target, draft, str(rec.dir), rec.data["run_id"]))
    change = req.vllm_under_test or _release()
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


def in_container(rec: RunRecord, req: request.Run, target: str, draft: str) -> str:
    """Build the profile's image (skipped when its inputs are unchanged) and run the end-to-end
    script in it with the container policy of ``containers`` (models read-only, the run folder
    writable, no network, no token)."""
    from validate import cluster, containers

    engine = containers.Engine()
    profile = req.profile
    try:
        tag, base, pinned = build.image(engine, req.image, profile.device)
    except containers.ContainerError as exc:  # a failed build: said, recorded, no engine started
        return f"the image could not be built: {str(exc)[:600]}"
    environment = dict(containers.E2E_ENVIRONMENT)
    change = None
    if req.change:
        try:
            tag, change = build.change_layer(engine, tag, req.change)
        except KitError as exc:  # a patch that does not apply to the image's vLLM, ...
            rec.end(exc.kind, f"the vLLM under test: {exc}", where="image")
            console.print(f"[bold red]error:[/] {escape(str(exc))}")
            return "refused before starting any engine"
        console.print(f"[bold]vLLM under test[/]: {escape(change.describe())}; image {tag}")
        environment.update(VLLM_CACHE_ROOT=change.cache_root,
                           TORCHINDUCTOR_CACHE_DIR=f"{change.cache_root}/inductor")
    mounts, inside = containers.e2e_mounts(rec.dir, {"target": target, "draft": draft})
    argv = e2e_argv(_e2e_values(req, inside["target"], inside["draft"], containers.RUN_FOLDER,
                                rec.data["run_id"]))
    rec.update(container={"image": tag, "base": base, "base_pinned": pinned, "exit_code": None})
    command = ["python3", "-m", "validate.e2e", *argv]
    say = lambda line: console.print(line, markup=False)  # noqa: E731
    with contextlib.ExitStack() as stack:
        network, name, node = "none", None, None
        if profile.nodes > 1:  # one container a node on a network of their own, Ray across them
            environment["KIT_IMAGE_ID"] = engine.client.images.get(tag).id
            try:
                node = stack.enter_context(cluster.Cluster(
                    engine, tag, profile.nodes, rec.data["run_id"], mounts=mounts,
                    environment=environment, user=containers.invoking_user(),
                    cpus=os.cpu_count() or 1, log=say))
            except Exception as exc:  # no bridge network on this engine, ...
                return f"the cluster's containers could not be started: {str(exc)[:600]}"
            network, name, command = node.network, node.head, node.head_command(command)
        try:
            result = engine.run(tag, command, mounts=mounts, environment=environment,
                                gpus=profile.tensor_parallel_size if profile.device == "cuda" else 0,
                                timeout_s=req.image.timeout, network=network, name=name, log=say)
        except Exception as exc:  # the engine refused to start it (docker.errors.APIError, ...)
            return f"the container did not run: {str(exc)[:600]}"
        if node is not None:
            _merge(rec.dir, cluster=node.describe())
            if node.lost:
                return node.lost
    container = {"image": tag, "image_id": result.image_id, "base": base, "base_pinned": pinned,
                 "exit_code": result.exit_code, "timed_out": result.exit_code is None,
                 "user": result.user, "ipc": result.host_config["IpcMode"],
                 "mounts": result.host_config["Binds"]}
    _merge(rec.dir, container=container,
           **({"vllm_under_test": {**change.to_dict(), "image": tag}} if change else {}))
    if result.exit_code is None:
        return f"the container ran past --timeout {req.image.timeout:.0f} s and was stopped"
    return f"the container exited {result.exit_code}"


def _merge(run_dir: Path, **fields: Any) -> None:
    try:
        RunRecord.load(run_dir).update(**fields)
    except BadRecord:
        pass  # finish() says what is wrong with it


def invocation() -> str:
    return " ".join(["python -m validate", *(shlex.quote(a) for a in sys.argv[1:])])


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
    if isinstance(rec.data.get("bench"), dict):  # the serving bench's plot, drawn here
        from validate import bench_plot

        try:
            rec.data["bench"]["plot"] = bench_plot.write(rec.dir, rec.data["bench"])
        except Exception as exc:  # a report that cannot be drawn must not cost the verdict
            console.print(f"[yellow]warning[/]: the bench plot could not be drawn ({exc}); the "
                          "figures are in record.json and summary.md")
            rec.data["bench"]["plot"] = None
    try:
        rec.update(invocation={"argv": invocation(), "kit_commit": build.git_commit(),
                               "kit_version": build.kit_version()},
                   **({"previous_runs_cut_off": host.data["previous_runs_cut_off"]}
                      if host.data.get("previous_runs_cut_off") else {}))
        rec.write_reports()
    except DiskFull as exc:  # the lean record on disk says it: the run broke (exit 4)
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
    return rec, exit_code(rec.data)


def run(req: request.Run, target: str, draft: str) -> tuple[RunRecord, Exit]:
    """One run: fresh folder, the end-to-end script (here or in the image), the record back."""
    if req.container:  # no Docker engine, no run folder: said before anything is started
        from validate import containers

        containers.Engine()
    previous = record.cut_off_runs()
    host = new_run(req)
    if previous:
        host.update(previous_runs_cut_off=previous)
        for p in previous:
            console.print(f"[bold yellow]a previous run was cut off[/]: {p['run_dir']} (kit "
                          f"process {p['pid']} gone, record {p['status']}"
                          + (f", ended broken at {p['where']}" if p.get("ended_as") else "") + ")")
    entry = record.enter_ledger(host.dir)
    launch = in_container if req.container else on_host
    try:
        with signals_as_interrupt():
            try:
                how = launch(host, req, target, draft)
            except KeyboardInterrupt:
                return finish(host, "Ctrl-C or SIGTERM", interrupted=True)
        return finish(host, how)
    finally:
        record.leave_ledger(entry)


def child(argv: list[str], env: dict[str, str]) -> int:
    """Run a step of a flow; Ctrl-C or SIGTERM here is passed on to it once (it records the
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
