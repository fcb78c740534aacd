"""The engine environment that `nox` installs (noxfile.py: engine_python): torch through pip,
the rest through uv, every module compiled."""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.mark.parametrize("package", ["torch", "torch._dynamo", "vllm", "vllm.v1.worker", "transformers"])
def test_the_engine_environment_is_compiled(package: str) -> None:
    """Every vLLM process (at TP=8, nine per engine) imports these; where the environment holds
    no bytecode for them and PYTHONDONTWRITEBYTECODE is set (CI machines), each one compiles
    them again: about 3 CPU-seconds a process for torch alone (noxfile.py: engine_python)."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin, f"{package} is not installed here"
    cached = importlib.util.cache_from_source(spec.origin)
    assert os.path.isfile(cached), (
        f"{spec.origin} has no bytecode ({cached}): the engine environment was installed "
        "without compiling it; `rm -r .nox/engine` and run `nox -s tests --install-only`")
