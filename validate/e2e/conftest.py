"""Options of the end-to-end script (see the header of test_llama4_eagle_tp8.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from validate.goldens import OPTIONS


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("llama4-eagle", "Llama-4 EAGLE end-to-end validation")
    g.addoption("--profile", action="append", default=None,
                help="profile name from validate/data/profiles.toml (repeatable; default: tiny)")
    g.addoption("--tp", type=int, default=None, help="tensor parallel size (default: the profile's)")
    g.addoption("--target", default=None, help="target model folder (default: from the profile)")
    g.addoption("--draft", default=None, help="EAGLE head folder (default: from the profile)")
    g.addoption("--run-dir", type=Path, default=None,
                help="folder for record.json / junit.xml / summary.md (default: runs/<name>-<time>)")
    g.addoption("--num-prompts", type=int, default=None, help="override the profile's prompt count")
    g.addoption("--max-tokens", type=int, default=None, help="override the profile's max_tokens")
    for flag, kwargs in OPTIONS:
        g.addoption(flag, **kwargs)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "profile_name" in metafunc.fixturenames:
        names = metafunc.config.getoption("--profile") or ["tiny"]
        metafunc.parametrize("profile_name", names)
