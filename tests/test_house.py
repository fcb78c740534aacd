"""The house rules the suite itself keeps: host code stays free of the engine, CI cannot go green by
skipping."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
ROOT = TESTS.parent
DESIGN = ROOT / "docs" / "design.md"


def _rooms() -> dict[str, tuple[str, set[str]]]:
    """docs/design.md's table: module -> (side, the rooms it may import)."""
    rooms = {}
    for line in DESIGN.read_text().splitlines():
        m = re.match(r"\| `(validate/[\w/]+)\.py` \| (\w+) \| [^|]+ \| [^|]+ \| ([^|]+) \|$", line)
        if m:
            name = m.group(1).replace("/", ".").removesuffix(".__init__")
            allowed = {f"validate.{a.strip()}" for a in m.group(3).split(",") if a.strip() != "-"}
            rooms[name] = (m.group(2), allowed)
    return rooms


def _imports() -> dict[str, set[str]]:
    """Every kit module (but packages' __init__) -> the kit modules it imports, at any depth of
    its code (a lazy import inside a function is a dependency too)."""
    graph = {}
    for path in sorted((ROOT / "validate").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "validate":
                deps |= {f"validate.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("validate."):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("validate.")}
        graph[name] = {d for d in deps if d != name and not d.startswith("validate.data")}
    return graph


def test_every_room_is_in_the_design_and_imports_only_what_it_may() -> None:
    rooms, graph = _rooms(), _imports()
    assert set(graph) == set(rooms), (f"not in docs/design.md: {sorted(set(graph) - set(rooms))}; "
                                      f"gone from the code: {sorted(set(rooms) - set(graph))}")
    wrong = {m: sorted(d - rooms[m][1]) for m, d in graph.items() if d - rooms[m][1]}
    assert not wrong, f"imports docs/design.md does not allow: {wrong}"
    engine = {m for m, (side, _) in rooms.items() if side == "engine"}
    host_to_engine = {m: sorted(d & engine) for m, d in graph.items()
                      if rooms[m][0] != "engine" and d & engine}
    assert not host_to_engine, f"host or shared rooms importing the engine side: {host_to_engine}"


def test_host_side_imports_leave_torch_and_vllm_out() -> None:
    """`nox -s validate_tp8` and `fetch` install no vLLM on the host: importing every room the
    design marks host or both must not need torch or vLLM (the engine side runs in the image)."""
    host = sorted(m for m, (side, _) in _rooms().items()
                  if side != "engine" and not m.endswith("__main__"))  # importing it runs it
    assert "validate.cli" in host and "validate.hub" in host, host
    code = ("import importlib, sys\n"
            f"for m in {host!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"host modules imported engine packages: {out.stdout}"


def _probe(tmp_path: Path, fail_on_skip: str | None) -> int:
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n\ndef test_needs_an_engine():\n    pytest.skip('no engine here')\n")
    env = {k: v for k, v in os.environ.items() if k != "KIT_FAIL_ON_SKIP"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if fail_on_skip is not None:
        env["KIT_FAIL_ON_SKIP"] = fail_on_skip
    # The suite's conftest as a plugin, over a folder holding one test that skips.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path).returncode


def test_a_skip_fails_the_run_in_ci(tmp_path: Path) -> None:
    assert _probe(tmp_path, "1") == 1, "with KIT_FAIL_ON_SKIP=1 (as .ci/run sets) a skip must fail"
    assert _probe(tmp_path, None) == 0, "outside CI a skip (no vLLM installed) stays a skip"
    assert "KIT_FAIL_ON_SKIP=1" in (TESTS.parent / ".ci" / "run").read_text()
