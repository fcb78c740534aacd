"""Options of the end-to-end script: the contract's (validate/contract.py), declared once for the
host's command line and for pytest here."""

from __future__ import annotations

import pytest

from validate.contract import E2E_OPTIONS


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("llama4-eagle", "Llama-4 EAGLE end-to-end validation")
    for flag, kwargs in E2E_OPTIONS:
        g.addoption(flag, **kwargs)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "profile_name" in metafunc.fixturenames:
        names = metafunc.config.getoption("--profile") or ["tiny"]
        metafunc.parametrize("profile_name", names)
