from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def pair():
    """The generated tiny pair (built once per machine and generator version, then cached)."""
    from validate import synth

    return synth.ensure()
