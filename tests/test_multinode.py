"""Beyond one node (issue 25): the profiles' checks, the nodes' comparison, and the rehearsal on two
containers of the CPU image on a bridge network with a Ray head and a worker (full tier: about
4 minutes on 2 cores once the CPU image is built, README says why it is not in CI), and such a
run cut short by a lost node or by Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import docker, image_args, wait_for_phase

from validate import profiles
from validate.contract import Exit
from validate.e2e import nodes

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "validate", *args], cwd=ROOT, capture_output=True,
                          text=True, check=False)


@pytest.mark.parametrize(("args", "said"), [
    (["rehearse", "--profile", "tiny-2node"], "rehearse it with --container"),
    (["rehearse", "--profile", "tiny", "--tp", "2", "--pp", "2", "--nodes", "2"],
     "vLLM's CPU build fails on pipeline parallelism"),
    (["rehearse", "--profile", "tiny", "--tp", "3", "--nodes", "2"], "do not split evenly over 2 nodes"),
    (["bench", "--profile", "tiny-2node"], "the serving bench runs on one node"),
], ids=["no-containers", "pp-on-cpu", "uneven", "serving"])
def test_a_multi_node_request_that_cannot_run_is_refused_before_anything_starts(
        args: list[str], said: str) -> None:
    r = _run(*args)
    assert r.returncode == Exit.BAD_INPUT and said in r.stderr, r.stdout[-800:] + r.stderr[-800:]


def test_a_gpu_cluster_profile_is_run_from_the_head_node_not_in_a_container_here() -> None:
    r = _run("validate", "--profile", "maverick-bf16-tp8pp2")
    assert r.returncode == Exit.BAD_INPUT and "--no-container" in r.stderr, r.stderr[-800:]


def test_the_cluster_profiles_split_their_ranks_over_their_nodes() -> None:
    mav = profiles.get("maverick-bf16-tp8pp2")
    assert (mav.nodes, mav.tensor_parallel_size, mav.pipeline_parallel_size) == (2, 8, 2)
    assert mav.ranks_per_node == 8 and not mav.problems()
    tiny = profiles.get("tiny-2node")
    assert tiny.ranks_per_node == 1 and not tiny.problems()
    assert nodes.engine_kwargs(mav) == {"distributed_executor_backend": "ray",
                                        "pipeline_parallel_size": 2}
    assert nodes.engine_kwargs(tiny) == {"nnodes": 2, "node_rank": 0}


def _facts(name: str, **changes: object) -> dict[str, object]:
    return {"hostname": name, "kit": "0.1", "vllm": "0.32.0", "image": "sha256:aa",
            "models": {"target": "t1", "draft": "d1"}, **changes}


@pytest.mark.parametrize(("other", "said"), [
    (_facts("b", image="sha256:bb"), "image: a=sha256:aa, b=sha256:bb"),
    (_facts("b", models={"target": "t2", "draft": "d1"}), "models:"),
    (_facts("b", models={"target": "missing", "draft": "d1"}), "b has no target folder"),
    (_facts("b", vllm="0.31.0"), "vllm: a=0.32.0, b=0.31.0"),
], ids=["image", "weights", "no-weights", "vllm"])
def test_nodes_that_differ_in_image_weights_or_vllm_are_named(other: dict, said: str) -> None:
    assert nodes.differences([_facts("a"), _facts("b")]) == []
    found = nodes.differences([_facts("a"), other])
    assert any(said in f for f in found), found


def test_a_models_digest_changes_with_a_file_and_not_with_its_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"x": 1}')
        (d / "model.safetensors").write_bytes(b"0" * 10)
    assert nodes.model_digest(str(a)) == nodes.model_digest(str(b))
    (b / "model.safetensors").write_bytes(b"0" * 11)
    assert nodes.model_digest(str(a)) != nodes.model_digest(str(b))


def _kit_leftovers(docker_host: str) -> str:
    return (docker(docker_host, "ps", "-a", "--filter", "name=kit-", "--format", "{{.Names}}")
            + docker(docker_host, "network", "ls", "--filter", "name=kit-",
                     "--format", "{{.Name}}")).strip()


@pytest.mark.e2e
@pytest.mark.full
def test_two_node_rehearsal_on_a_ray_cluster_of_two_containers_passes(
        docker_host: str, base_image: str, cpu_image: str, pair, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "validate", "rehearse", "--profile", "tiny-2node",
                        "--container", "--run-dir", str(run), *image_args(base_image)],
                       cwd=ROOT, env={**os.environ, "DOCKER_HOST": docker_host},
                       capture_output=True, text=True, check=False)
    assert r.returncode == Exit.PASS, r.stdout[-4000:] + r.stderr[-2000:]
    rec = json.loads((run / "record.json").read_text())
    names = [n["hostname"] for n in rec["nodes"]]
    assert len(set(names)) == 2 and names == rec["cluster"]["nodes"], (names, rec["cluster"])
    assert len({n["address"] for n in rec["nodes"]}) == 2, rec["nodes"]
    assert rec["acceptance"]["mean_acceptance_length"] >= 2.0, rec["acceptance"]
    assert _kit_leftovers(docker_host) == "", "the cluster's containers and network are removed"


def _two_node_run_in_its_engine_start(run: Path, base_image: str,
                                      docker_host: str) -> subprocess.Popen[str]:
    """A two-node rehearsal (10 prompts), once its reference engine is starting on both nodes."""
    proc = subprocess.Popen([sys.executable, "-m", "validate", "rehearse", "--profile",
                             "tiny-2node", "--container", "--num-prompts", "10", "--run-dir",
                             str(run), *image_args(base_image)],
                            cwd=ROOT, env={**os.environ, "DOCKER_HOST": docker_host},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_phase(run, proc, "reference_engine_start")
    time.sleep(5)
    return proc


@pytest.mark.e2e
@pytest.mark.full
@pytest.mark.parametrize(("ending", "code", "status", "said"), [
    ("node1 lost", Exit.BROKEN, "error", "node1 was lost"),
    ("ctrl-c", Exit.INTERRUPTED, "interrupted", ""),
])
def test_a_two_node_run_cut_short_says_how_and_where_and_leaves_nothing(
        docker_host: str, base_image: str, cpu_image: str, pair, tmp_path: Path, ending: str,
        code: Exit, status: str, said: str) -> None:
    """A worker container killed mid-run is a lost node (exit 4); Ctrl-C is an interrupted run
    (exit 130). Either way the record says where, and no container or network is left."""
    run = tmp_path / "run"
    proc = _two_node_run_in_its_engine_start(run, base_image, docker_host)
    if ending == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    else:
        worker = [n for n in docker(docker_host, "ps", "--format", "{{.Names}}").split()
                  if n.endswith("-node1")]
        assert worker, "the worker node's container runs"
        docker(docker_host, "kill", worker[0])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == code, out[-3000:]
    rec = json.loads((run / "record.json").read_text())
    assert rec["status"] == status and said in rec["error"]["message"], rec["error"]
    assert rec["error"]["where"].startswith("reference_engine"), rec["error"]
    assert _kit_leftovers(docker_host) == "", "the cluster's containers and network are removed"
