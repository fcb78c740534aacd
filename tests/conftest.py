from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT, TIER, WALKTHROUGH_RUN, image_args, registry_base, runnable_blocks, stop

# The suite runs the tiny pair's training, engines and tests side by side on CI's 2 cores, where
# OpenMP's default (torch's libgomp) keeps a waiting thread spinning on its core, taken from the
# process beside it: a TP=1 rehearsal beside one busy process took 58.7 s (25.7 s with PASSIVE:
# a waiting thread sleeps), alone 26.2 s (23.3 s), the same outputs and counters each time. Set
# before anything here imports torch; every process the suite starts inherits it (a user's own
# setting wins; the containers' environment is the image's own).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
    needs = ("pair", *JOBS)  # the suite-wide runs wait for it too
    if not any(n in needs for item in request.session.items
               for n in getattr(item, "fixturenames", ())):
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


class _Job:
    """One suite-wide run (a subprocess of the kit, as a user types it) that starts beside the
    tests instead of in its test's time. On 2 cores an engine run leaves about a third of the CPU
    idle (single-threaded imports, waits): a second run beside it finishes both in about 70% of
    their time one after the other (127 s alone, 180 s for two, measured on the AVX2 EPYC)."""

    def __init__(self, name: str, argv: list[str], folder: Path) -> None:
        self.name, self.argv, self.folder = name, argv, folder
        self.log = folder.parent / f"{folder.name}.log"
        self.done = threading.Event()
        self.returncode: int | None = None
        self.why_not = ""  # set when the job never started (its pair failed)
        self.proc: subprocess.Popen | None = None
        self.seconds: float | None = None  # its wall time, once it has ended

    def run(self) -> None:
        # KIT_TEST_JOB marks every process of the run (the kit passes its environment on to the
        # engines and servers): a test asking what a run left behind asks about this one only.
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        _SUITE_RUNS.append(self)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "KIT_TEST_JOB": self.name},
                                         start_new_session=True)
            started = time.monotonic()
            self.returncode = self.proc.wait()
            self.seconds = time.monotonic() - started

    def result(self) -> tuple[int, str]:
        """(exit code, output) once the run has ended."""
        assert self.done.wait(timeout=7200), f"{self.name} did not end within 2 hours"
        assert not self.why_not, self.why_not
        assert self.returncode is not None
        return self.returncode, self.log.read_text()

    def stop(self) -> None:
        """SIGTERM to the run's process group (the kit stops its engines and records it), then
        SIGKILL: a test session that ends early leaves nothing running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)


JOBS = ("sensitivity_suite", "bench_tp2")
_SUITE_RUNS: list[_Job] = []  # for the time table at the end


def _jobs(tmp: Path) -> dict[str, _Job]:
    """The suite-wide runs, by the name of the fixture that hands out each one's result."""
    sensitivity = tmp / "sensitivity" / "suite"
    # The CI tier judges its subset at TP=1 on 50 prompts a run (CI's 30 minutes on 2 cores: per
    # run one vLLM process fewer to start, and no TP=2 ranks spinning for each other beside the
    # other tests; every breakage of the subset FAILs far from its bound, data/breakages.toml);
    # the full tier the whole catalogue at TP=2 on the profile's 100.
    fewer = ["--tp", "1", "--num-prompts", "50"] if TIER == "ci" else []
    bench = tmp / "bench" / "bench-tp2"
    return {
        # `nox -s sensitivity` as a user runs it: the release, then the tier's breakages
        "sensitivity_suite": _Job("sensitivity_suite", [
            "nox", "-s", "sensitivity", "--", "--run-dir", str(sensitivity), "--tier", TIER,
            *fewer], sensitivity),
        # the serving bench as README gives it, at TP=2 for CI's 30 minutes: 10 of the 100
        # verdict prompts, one point (concurrency 4) twice, so that medians and spreads are
        # computed from repeats (the full tier's TP=8 bench sweeps the profile's 1 and 4, 3
        # repeats; at 2 and 4 x 3 here the sweep took 261 s of the bench's 459 on the AVX2 EPYC)
        "bench_tp2": _Job("bench_tp2", [
            sys.executable, "-m", "validate", "bench", "--profile", "tiny", "--run-dir", str(bench),
            "--tp", "2", "--num-prompts", "10", "--concurrency", "4", "--repeats", "2"], bench),
    }


@pytest.fixture(scope="session", autouse=True)
def _background(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                _pair_generation: tuple[subprocess.Popen, Path] | None) -> Iterator[dict[str, _Job]]:
    """Starts the suite-wide runs that selected tests need, one after the other in a thread of
    their own, as soon as the tiny pair is there; the tests that read them run last among the
    engine tests (pytest_collection_modifyitems), while the others run beside them."""
    names = {n for item in request.session.items for n in getattr(item, "fixturenames", ())}
    jobs = {name: job for name, job in _jobs(tmp_path_factory.mktemp("jobs")).items()
            if name in names}

    ending = threading.Event()  # the session ends: start nothing more

    def work() -> None:
        failed = _pair_generation is not None and _pair_generation[0].wait() != 0
        for job in jobs.values():
            try:
                if failed or ending.is_set():
                    job.why_not = (f"{job.name} did not start: "
                                   + ("the tiny pair's generation failed" if failed else
                                      "the session ended first"))
                else:
                    job.run()
            except OSError as exc:
                job.why_not = f"{job.name} could not start: {exc}"
            finally:
                job.done.set()

    if jobs:
        threading.Thread(target=work, name="suite-runs", daemon=True).start()
    yield jobs
    ending.set()
    for job in jobs.values():
        job.stop()


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
def sensitivity_suite(_background: dict[str, _Job]) -> tuple[int, str, Path]:
    """`nox -s sensitivity` as a user runs it (the release, then the breakages of the tier, TP=2),
    once per test run, beside the other tests: its golden also serves `compare
    --baseline-golden`. The tier is ``KIT_TEST_TIER`` (`nox -s tests`: ci, the catalogue's CI
    subset; `nox -s tests_full`: full). (exit code, output, the suite's folder)."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    job = _background["sensitivity_suite"]
    code, out = job.result()
    assert (job.folder / "sensitivity.json").is_file(), out[-4000:]
    return code, out, job.folder


@pytest.fixture(scope="session")
def bench_tp2(_background: dict[str, _Job]) -> tuple[int, dict, str, Path]:
    """`python -m validate bench --profile tiny --tp 2`, beside the other tests:
    (exit code, record, output, run folder)."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    job = _background["bench_tp2"]
    code, out = job.result()
    assert (job.folder / "record.json").is_file(), out[-4000:]
    return code, json.loads((job.folder / "record.json").read_text()), out, job.folder


def _wait_for_ci_docker() -> None:
    """`.ci/run` starts its Docker engine and makes the base image beside the tests (the Docker
    tests come last): it touches KIT_DOCKER_READY when both are there, or writes its setup's
    status to KIT_PREBUILT_IMAGE when the setup ended without them."""
    ready, status = os.environ.get("KIT_DOCKER_READY"), os.environ.get("KIT_PREBUILT_IMAGE")
    if not ready:
        return
    deadline = time.monotonic() + 1800
    while not Path(ready).is_file() and time.monotonic() < deadline:
        assert not (status and Path(status).is_file()), (
            f"the Docker engine or the base image could not be made (exit "
            f"{Path(status).read_text().strip()}): see .nox/docker-setup.log")
        time.sleep(1)
    assert Path(ready).is_file(), "the Docker engine was not ready after 30 minutes"


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A reachable engine: DOCKER_HOST's, else a private dockerd started for the tests."""
    from validate import containers

    _wait_for_ci_docker()
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
    if not _needs_image(request.session.items) or os.environ.get("KIT_PREBUILT_IMAGE"):
        return None  # CI: `.ci/run` builds it beside the tests, cpu_image finds it
    base = request.getfixturevalue("base_image")
    return _Prebuild(base, tmp_path_factory.mktemp("cpu-image") / "build.log")


@pytest.fixture(scope="session")
def cpu_image(_prebuild: _Prebuild | None, base_image: str,
              tmp_path_factory: pytest.TempPathFactory) -> str:
    """The CPU image's tag, once its build (started at the session's start, or by `.ci/run`)
    is done."""
    if _prebuild is None:  # waits for .ci/run's build, then finds the image by its inputs
        _prebuild = _Prebuild(base_image, tmp_path_factory.mktemp("cpu-image") / "build.log")
    _prebuild.thread.join(timeout=3600)
    log = _prebuild.log.read_text() if _prebuild.log.is_file() else ""
    assert _prebuild.tag and not _prebuild.error, (
        f"the CPU image was not built: {_prebuild.error}\n{log[-3000:]}")
    return _prebuild.tag


def _order(item: pytest.Item) -> tuple[int, bool]:
    """Where a test runs in the session (see pytest_collection_modifyitems)."""
    names = getattr(item, "fixturenames", ())
    e2e = item.get_closest_marker("e2e") is not None
    if any(job in names for job in JOBS):
        return 3, False
    if "docker_host" in names:  # Docker: the image builds beside everything before
        return 2, e2e
    if e2e:
        return 1, "pair" not in names
    return 0, False


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"pytest ended by signal {signal.Signals(signum).name}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a cancelled CI job, `timeout`, `kill`) ends the suite as Ctrl-C does: through
    the fixtures' teardown. The suite-wide runs run in sessions of their own (so that their
    teardown can stop each whole group), where a signal to pytest's group does not reach them,
    and the Docker engine and registry outlive a pytest that a signal to it alone ends; left to
    Python's default, SIGTERM ends pytest without its teardown and they run on, taking the
    machine's cores. A handler someone else installed is kept."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupted)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The CI tier leaves out the full tier's cases (deselected, not skipped: CI fails on a skip).
    Order, for CI's 30 minutes on 2 cores: the tests without an engine first, while the tiny pair
    is generated beside them (single-threaded, most of them waiting on a subprocess or a socket,
    they leave the pair most of the CPU); then the engine tests, those that need the pair first,
    beside the suite-wide runs (_background) that start once the pair is there; the Docker tests
    (their CPU image builds beside everything before, in `.ci/run` or in _prebuild); the tests
    that read the suite-wide runs last. What runs while the pair trains is work the tests would
    otherwise do alone once the suite-wide runs have ended: 3 of the last 7 minutes of a run on
    the AVX2 EPYC had one core idle."""
    if TIER != "full":
        full = [item for item in items if item.get_closest_marker("full")]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if not item.get_closest_marker("full")]
    items.sort(key=_order)


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
    for job in _SUITE_RUNS:  # their tests only read them: their time is not in a file's
        ran = f"{job.seconds:8.1f}" if job.seconds is not None else "   (cut)"
        terminalreporter.write_line(f"{ran}  {job.name}: beside the tests above, exit "
                                    f"{job.returncode} ({job.log})")
    if _SKIPPED and os.environ.get("KIT_FAIL_ON_SKIP") == "1":
        terminalreporter.section("skipped tests fail this run (KIT_FAIL_ON_SKIP=1)", red=True)
        for nodeid in _SKIPPED:
            terminalreporter.write_line(nodeid)
