from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT, TIER, WALKTHROUGH_RUN, image_args, registry_base, runnable_blocks, stop

FIXTURE_MODELS = Path(__file__).parent / "data" / "fixture-models"


@dataclass
class Models:
    """Model folders as the host side sees them: real configs, shards of random bytes."""

    target: Path
    head: Path


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """The tiny pair's configs with stand-in shards (tests/data/README.md): for host-side tests,
    which check configs and move files, without torch or the generated pair."""
    root = tmp_path_factory.mktemp("fixture-models")
    rng = random.Random(0)
    for role, size in (("target", 27 << 20), ("head", 6 << 20)):
        shutil.copytree(FIXTURE_MODELS / role, root / role)
        (root / role / "model.safetensors").write_bytes(rng.randbytes(size))
    return Models(root / "target", root / "head")


@pytest.fixture(scope="session", autouse=True)
def _pair_generation(request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.Popen, Path] | None:
    """Starts the tiny pair's generation (minutes, when it is not cached) at the session's start,
    in a process of its own, when a selected test needs the pair: the tests without an engine,
    which run first and single-threaded, leave a core to it."""
    if not any("pair" in getattr(item, "fixturenames", ()) for item in request.session.items):
        return None
    log = tmp_path_factory.mktemp("pair") / "synth.log"
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "validate.synth"], stdout=out,
                                stderr=subprocess.STDOUT), log


@pytest.fixture(scope="session")
def pair(_pair_generation: tuple[subprocess.Popen, Path] | None):
    """The generated tiny pair (built once per machine and generator version, then cached)."""
    from validate import synth

    if _pair_generation is not None:
        proc, log = _pair_generation
        assert proc.wait(timeout=3600) == 0, f"the tiny pair's generation failed:\n{log.read_text()[-3000:]}"
    return synth.ensure()


@pytest.fixture(scope="session")
def host_rehearsal_tp8(pair) -> tuple[int, dict, str]:
    """The walkthrough's runnable block (docs/walkthrough.md: `nox -s rehearse_tp8 -- --run-dir
    runs/walkthrough`), run in the repository as a newcomer runs it: the one CPU rehearsal at TP=8
    on the host, shared by every test that reads its record (the docs test included).
    (exit code of the block, record, output)."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    [block] = [b for _, b in runnable_blocks() if f"--run-dir {WALKTHROUGH_RUN}" in b]
    run = ROOT / WALKTHROUGH_RUN
    shutil.rmtree(run, ignore_errors=True)  # this fixture's own output of an earlier suite run
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, capture_output=True,
                       text=True, timeout=3600, check=False)
    assert (run / "record.json").is_file(), (r.stdout + r.stderr)[-4000:]
    return r.returncode, json.loads((run / "record.json").read_text()), r.stdout + r.stderr


@pytest.fixture(scope="session")
def sensitivity_suite(pair, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """`nox -s sensitivity` as a user runs it (the release, then the breakages of the tier, TP=2),
    once per test run: its golden also serves `compare --baseline-golden`. The tier is
    ``KIT_TEST_TIER`` (`nox -s tests`: ci, the catalogue's CI subset; `nox -s tests_full`: full).
    (exit code, output, the suite's folder)."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    run = tmp_path_factory.mktemp("sensitivity") / "suite"
    # The CI tier judges 50 prompts a run (CI's 30 minutes; every breakage of its subset still
    # FAILs on them, the closest, head-qk-not-permuted, at 2.6 tolerances below its golden); the full
    # tier the profile's 100.
    fewer = ["--num-prompts", "50"] if TIER == "ci" else []
    r = subprocess.run(["nox", "-s", "sensitivity", "--", "--run-dir", str(run), "--tier", TIER,
                        *fewer],
                       cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False)
    assert (run / "sensitivity.json").is_file(), (r.stdout + r.stderr)[-4000:]
    return r.returncode, r.stdout + r.stderr, run


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A reachable engine: DOCKER_HOST's, else a private dockerd started for the tests."""
    from validate import containers

    host = os.environ.get("DOCKER_HOST")
    if host:
        try:
            containers.Engine(host)
        except containers.ContainerError:
            pass
        else:
            yield host  # one that answers (CI's own): not this fixture's to stop
            return
    root = Path(os.environ.get("KIT_DOCKER_DIR") or tmp_path_factory.mktemp("docker"))
    r = subprocess.run([str(ROOT / "containers" / "start-dockerd.sh"), str(root)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"could not start a Docker engine (needs root): {r.stderr}"
    host = r.stdout.strip().splitlines()[-1]
    os.environ["DOCKER_HOST"] = host
    yield host
    del os.environ["DOCKER_HOST"]
    if not os.environ.get("KIT_DOCKER_DIR"):  # a folder of the user's: their engine, kept
        stop(root / "docker.pid")  # what the tests started, they stop


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A container registry on loopback (Debian's docker-registry), started for the tests."""
    root = Path(os.environ.get("KIT_REGISTRY_DIR") or tmp_path_factory.mktemp("registry"))
    r = subprocess.run([str(ROOT / "containers" / "start-registry.sh"), str(root)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"could not start a registry: {r.stderr}"
    yield r.stdout.strip().splitlines()[-1]
    if not os.environ.get("KIT_REGISTRY_DIR"):
        stop(root / "registry.pid")


@pytest.fixture(scope="session")
def local_base(docker_host: str) -> str:
    """A Debian base made here (no registry outside is reachable)."""
    name = os.environ.get("KIT_BASE_IMAGE", "kit-base/bookworm:local")
    r = subprocess.run([str(ROOT / "containers" / "make-local-base.sh"), name],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    return name


@pytest.fixture(scope="session")
def base_image(docker_host: str, local_base: str, registry: str) -> str:
    """The local base as a real registry serves it, by digest: builds are FROM a digest."""
    return registry_base(docker_host, local_base, registry)


class _Prebuild:
    """The CPU image, built in a thread from the start of the session (the docker engine does
    the work: pip inside the build, layer commits), while the tests before the Docker ones run:
    the build costs the CI tier minutes it would otherwise wait for. Same code and options as a
    run's own build (``build.image``), so the run finds it by its input hash and builds nothing."""

    def __init__(self, base: str, log: Path) -> None:
        self.base, self.log, self.tag, self.error = base, log, "", ""
        self.thread = threading.Thread(target=self._build, name="cpu-image-build", daemon=True)
        self.thread.start()

    def _build(self) -> None:
        from validate import build, cli, containers, request

        # `.ci/run` starts this build with the same options while the engine environment
        # installs, and writes its exit status to KIT_PREBUILT_IMAGE when it ends: wait for it,
        # then find the image by its inputs (or build it here if that build failed).
        prebuilt = os.environ.get("KIT_PREBUILT_IMAGE")
        deadline = time.monotonic() + 3600
        while prebuilt and not Path(prebuilt).is_file() and time.monotonic() < deadline:
            time.sleep(2)
        args = cli.build_parser().parse_args(["rehearse", "--container", *image_args(self.base)])
        try:
            with open(self.log, "w") as out:
                self.tag, _, _ = build.image(containers.Engine(), request.of(args).image, "cpu",
                                             log=lambda line: print(line, file=out, flush=True))
        except Exception as exc:  # said by the tests that need the image
            self.error = f"{type(exc).__name__}: {exc}"


def _needs_image(items: list[pytest.Item]) -> bool:
    return any("cpu_image" in getattr(item, "fixturenames", ()) for item in items)


@pytest.fixture(scope="session", autouse=True)
def _prebuild(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> _Prebuild | None:
    """Starts the CPU image's build at the session's start when a selected test needs it."""
    if not _needs_image(request.session.items):
        return None
    base = request.getfixturevalue("base_image")
    return _Prebuild(base, tmp_path_factory.mktemp("cpu-image") / "build.log")


@pytest.fixture(scope="session")
def cpu_image(_prebuild: _Prebuild | None, base_image: str) -> str:
    """The CPU image's tag, once its build (started at the session's start) is done."""
    assert _prebuild is not None
    _prebuild.thread.join(timeout=3600)
    log = _prebuild.log.read_text() if _prebuild.log.is_file() else ""
    assert _prebuild.tag and not _prebuild.error, (
        f"the CPU image was not built: {_prebuild.error}\n{log[-3000:]}")
    return _prebuild.tag


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The CI tier leaves out the full tier's cases (deselected, not skipped: CI fails on a skip).
    Order: the tests without an engine first (a broken verdict or record fails in minutes, and
    they are single-threaded while the tiny pair is generated beside them, and, outside CI, the
    CPU image builds in the background: CI's .ci/run builds it while the engine environment
    installs), then the engine tests, then the Docker tests (the image is there by then)."""
    if TIER != "full":
        full = [item for item in items if item.get_closest_marker("full")]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if not item.get_closest_marker("full")]
    items.sort(key=lambda item: ("base_image" in getattr(item, "fixturenames", ()),
                                 item.get_closest_marker("e2e") is not None))


# Wall time per test file, printed at the end of every run: CI's budget (30 minutes on 2 cores) is
# kept by knowing which file spends it. pytest's --durations lists single tests only.
_FILE_SECONDS: dict[str, float] = {}
# In CI (`.ci/run` sets KIT_FAIL_ON_SKIP=1) a skipped test is a failure: a missing vLLM or Docker
# engine must turn CI red, not into a green run that tested nothing.
_SKIPPED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    if report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("KIT_FAIL_ON_SKIP") == "1" and _SKIPPED and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _FILE_SECONDS:
        return
    terminalreporter.section("seconds per test file (setup + call + teardown)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  total")
    if _SKIPPED and os.environ.get("KIT_FAIL_ON_SKIP") == "1":
        terminalreporter.section("skipped tests fail this run (KIT_FAIL_ON_SKIP=1)", red=True)
        for nodeid in _SKIPPED:
            terminalreporter.write_line(nodeid)
