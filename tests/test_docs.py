"""The Buildkite pipeline and the docs are tested like code: schema, names, links, runnable blocks."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DOCS, ROOT, WALKTHROUGH_RUN, runnable_blocks

from validate import cli, contract

PIPELINE = ROOT / ".buildkite" / "pipeline.yml"
SESSION_TO_COMMAND = {"rehearse_tp8": "rehearse", "validate_tp8": "validate", "fetch": "fetch",
                      "lock": "lock", "refresh_pins": "refresh-pins", "compare": "compare",
                      "sensitivity": "sensitivity", "lock_requirements": "lock-requirements",
                      "bench_tp8": "bench", "rehearse_bench": "bench"}


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    return subprocess.run([exe, "--builtin-schema", "vendor.buildkite", str(path)],
                          capture_output=True, text=True, check=False)


def test_pipeline_matches_buildkites_schema() -> None:
    r = _check_jsonschema(PIPELINE)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_broken_pipeline_fails_the_schema(tmp_path: Path) -> None:
    broken = tmp_path / "pipeline.yml"
    broken.write_text(PIPELINE.read_text().replace("timeout_in_minutes: 240",
                                                   'timeout_in_minutes: "four hours"'))
    r = _check_jsonschema(broken)
    assert r.returncode == 1, r.stdout
    assert "timeout_in_minutes" in r.stdout


def _sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any("session" in ast.unparse(d) for d in f.decorator_list)}


def _texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in [*DOCS, PIPELINE]}


KIT_COMMAND = re.compile(r"(nox -s [\w-]+(?: -- [^`|#\n]*)?"
                         r"|python3? -m validate(?:\.e2e)?(?: [^`|#\n]*)?)")


def _commands(text: str) -> list[str]:
    """Command lines that invoke the kit, from code blocks, inline code and YAML."""
    found = []
    for line in re.findall(r"`([^`\n]+)`", text) + text.splitlines():
        for m in re.finditer(KIT_COMMAND, line):
            found.append(m.group(1).split("||")[0].strip().rstrip("\\").strip())
    return found


def test_every_session_and_option_named_in_docs_and_pipeline_exists() -> None:
    sessions = _sessions()
    parser = cli.build_parser()
    e2e_options = set(contract.E2E_FLAGS)
    checked = 0
    for name, text in _texts().items():
        for command in _commands(text):
            words = shlex.split(command.replace("...", "x"))
            if words[0] == "nox":
                session = words[2]
                assert session in sessions, f"{name}: `{command}` names no nox session"
                rest = words[4:] if "--" in words[3:4] else []
                if session in SESSION_TO_COMMAND and rest:
                    try:
                        parser.parse_args([SESSION_TO_COMMAND[session], *rest])
                    except SystemExit:
                        pytest.fail(f"{name}: `{command}`: options the CLI does not take")
            elif words[2] == "validate.e2e":
                for opt in (w for w in words[3:] if w.startswith("--")):
                    assert opt in e2e_options, f"{name}: `{command}`: no option {opt}"
            elif words[3:] != ["--help"]:
                try:
                    parser.parse_args(words[3:])
                except SystemExit:
                    pytest.fail(f"{name}: `{command}` is not a valid CLI call")
            checked += 1
    assert checked >= 15, "the docs name the kit's commands"


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_inside_docs_resolve() -> None:
    """Relative links and #anchors (external links are not fetched: no network here)."""
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.name}: link to missing {target}"
            if anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                assert anchor in slugs, f"{doc.name}: no heading for #{anchor} in {dest.name}"


def test_docs_have_runnable_blocks() -> None:
    assert runnable_blocks(), "the walkthrough's CPU section is marked runnable"


@pytest.mark.e2e
@pytest.mark.parametrize(("doc", "block"), runnable_blocks(), ids=lambda v: str(v)[:30])
def test_runnable_block(doc: str, block: str, request: pytest.FixtureRequest) -> None:
    """Run as a newcomer would: in the repository root, with bash, on the tiny profile. The
    walkthrough's rehearsal block is the suite's shared host rehearsal (run once, read here)."""
    if f"--run-dir {WALKTHROUGH_RUN}" in block:
        code, rec, out = request.getfixturevalue("host_rehearsal_tp8")
        assert code == 0, f"{doc}: block failed:\n{block}\n{out[-3000:]}"
        assert rec["verdict"]["result"] == "PASS", rec["verdict"]
        assert rec["verdict"]["result"] in out, "the block prints the summary"
        return
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, capture_output=True,
                       text=True, timeout=3600, check=False, env={**os.environ})
    assert r.returncode == 0, f"{doc}: block failed:\n{block}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for run in re.findall(r"--run-dir (\S+)", block):
        rec = json.loads((ROOT / run / "record.json").read_text())
        assert rec["verdict"]["result"] == "PASS", rec["verdict"]
