from __future__ import annotations

import pytest
from helpers import rehearse


@pytest.fixture(scope="session")
def pair():
    """The generated tiny pair (built once per machine and generator version, then cached)."""
    from validate import synth

    return synth.ensure()


@pytest.fixture(scope="session")
def host_rehearsal_tp8(pair, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    """One CPU rehearsal at TP=8 on the host, shared by the tests that need its record."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    code, rec, _ = rehearse(tmp_path_factory.mktemp("host-rehearsal") / "run")
    return code, rec
