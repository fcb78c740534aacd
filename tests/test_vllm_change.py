"""The vLLM under test: a patch to the pinned release is what runs, or is refused before any
engine starts; its record names it; its caches are its own."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from validate import vllm_change
from validate.contract import BadInput, Exit
from validate.files import state_dir

BREAKAGES = Path(vllm_change.__file__).parent / "data" / "breakages"  # the sensitivity catalogue
BREAKING = BREAKAGES / "head-input-order.patch"  # the head's fc gets [hidden, embeds] swapped
HARMLESS = BREAKAGES / "comment-only.patch"  # a control: a comment in llama4_eagle.py


def _kit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "validate", "rehearse", *args],
                          capture_output=True, text=True, timeout=1200, check=False)


@pytest.fixture
def vllm_here() -> None:
    pytest.importorskip("vllm", reason="needs the CPU engine environment (nox -s tests)")


def _bad_patches(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    text = BREAKING.read_text()
    stale = tmp_path / "stale.patch"  # its context is not in the release's file
    stale.write_text(text.replace("inputs_embeds = self.embed_input_ids(input_ids)",
                                  "inputs_embeds = self.embed(input_ids)"))
    compiled = tmp_path / "kernel.patch"
    compiled.write_text("--- a/csrc/cpu/attention.cpp\n+++ b/csrc/cpu/attention.cpp\n"
                        "@@ -1 +1 @@\n-a\n+b\n")
    outside = tmp_path / "outside.patch"
    outside.write_text("--- a/setup.cfg\n+++ b/setup.cfg\n@@ -1 +1 @@\n-a\n+b\n")
    prose = tmp_path / "notes.txt"
    prose.write_text("I changed the EAGLE head\n")
    return {"does-not-apply": (stale, "does not apply to vLLM 0.32.0: error: patch failed: "
                               "vllm/model_executor/models/llama4_eagle.py:132"),
            "compiled-code": (compiled, "csrc/cpu/attention.cpp. An overlay on the pinned build "
                              "cannot carry them: build a wheel"),
            "outside-vllm": (outside, "changes files outside vllm/: setup.cfg"),
            "not-a-diff": (prose, "is not a unified diff"),
            "missing": (tmp_path / "nope.patch", "no such file")}


@pytest.mark.parametrize("case", ["does-not-apply", "compiled-code", "outside-vllm", "not-a-diff",
                                  "missing"])
def test_a_change_that_cannot_run_is_refused_before_any_engine(vllm_here, tmp_path: Path,
                                                               case: str) -> None:
    patch, says = _bad_patches(tmp_path)[case]
    run = tmp_path / "run"
    r = _kit("--tp", "1", "--vllm-patch", str(patch), "--run-dir", str(run))
    assert r.returncode == Exit.BAD_INPUT and says in r.stderr, r.stderr[-2000:]
    assert not run.exists(), "refused before a run folder, a pair or an engine"


def test_a_stale_patch_is_refused_in_seconds_without_an_overlay(vllm_here, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sensitivity suite checks of every breakage before its release's minutes: the
    same refusal as a run's, and no mirror of vLLM made for it (in a state folder of its own:
    the shared one's overlays are made by other tests at the same time under -n 2)."""
    patch, says = _bad_patches(tmp_path)["does-not-apply"]
    monkeypatch.setenv("VALIDATE_CACHE", str(tmp_path / "state"))
    with pytest.raises(BadInput, match=re.escape(says)):
        vllm_change.check_applies(patch, sys.executable)
    assert vllm_change.check_applies(BREAKING, sys.executable) == [
        "vllm/model_executor/models/llama4_eagle.py"]
    assert not (state_dir() / "vllm-overlays").exists(), "an overlay was made to check a patch"


def test_a_patch_becomes_an_overlay_and_the_release_is_untouched(vllm_here) -> None:
    package, version = vllm_change.installed(sys.executable)
    change = vllm_change.from_patch(BREAKING, sys.executable)
    assert change.base_version == version and change.kind == "patch"
    assert change.files_changed == ["vllm/model_executor/models/llama4_eagle.py"]
    patched = Path(change.overlay) / change.files_changed[0]
    assert "torch.cat((hidden_states, inputs_embeds)" in patched.read_text()
    assert "torch.cat((inputs_embeds, hidden_states)" in (
        package / "model_executor" / "models" / "llama4_eagle.py").read_text(), "release untouched"
    release = vllm_change.release(sys.executable)
    assert release.cache_root != change.cache_root, "caches keyed by the vLLM under test"
    env = vllm_change.cache_env(change)
    assert env["PYTHONPATH"].split(":")[0] == change.overlay
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(change.cache_root)


@pytest.mark.e2e
@pytest.mark.full  # three torch.compile'd engine loads, minutes on 2 cores: the nightly tier
def test_a_breaking_change_to_a_compiled_forward_right_after_a_clean_run_is_a_regression(
        pair, tmp_path: Path) -> None:
    """`compare` with torch.compile on (profile tiny-compiled, vLLM's default outside the eager
    rehearsal): the release runs clean and leaves its compiled graphs in its cache; right after,
    on the same machine, the head's input order swapped in llama4_eagle.py's forward is a
    REGRESSION, compiled into a cache of its own (on an H200 a shared cache once served the clean
    graph to such a change: PASS)."""
    first = tmp_path / "first"
    small = ["--profile", "tiny-compiled", "--tp", "1", "--num-prompts", "20"]
    r = _compare("--vllm-patch", str(BREAKING), *small, "--run-dir", str(first))
    assert r.returncode == Exit.REGRESSION and "REGRESSION" in r.stderr, r.stderr[-3000:]
    report = json.loads((first / "compare.json").read_text())
    assert report["verdict"] == "REGRESSION" and report["rows"][0]["candidate"] < 1.5, report
    clean = json.loads((first / "release" / "record.json").read_text())
    assert clean["verdict"]["result"] == "PASS" and clean["profile"]["enforce_eager"] is False
    rec = json.loads((first / "candidate" / "record.json").read_text())
    assert rec["verdict"]["result"] == "FAIL", rec["verdict"]
    under = rec["vllm_under_test"]
    assert under["kind"] == "patch" and under["files_changed"] == [
        "vllm/model_executor/models/llama4_eagle.py"]
    assert rec["environment"]["vllm_location"] == str(Path(under["overlay"]) / "vllm")
    assert rec["reference"]["kind"] == "golden", rec["reference"]
    caches = [Path(x["vllm_under_test"]["cache_root"]) for x in (clean, rec)]
    assert caches[0] != caches[1], "compiled graphs are keyed by the vLLM under test"
    for cache in caches:  # both engines compiled, each into its own folder
        assert any((cache / "torch_compile_cache").rglob("*")), f"nothing compiled into {cache}"



@pytest.mark.e2e
@pytest.mark.full  # one more TP=2 engine run (80 s on 2 cores): the CI tier's compare is its
# refusals (test_exit_codes), the verdict's table (test_metrics) and the suite's runs; a
# comment-only patch runs as an image layer there (test_containers, --full) and PASSes
def test_compare_says_ok_for_a_comment(sensitivity_suite, tmp_path: Path) -> None:
    """`compare` beside a patch that only adds a comment, judged against the release's golden
    (the sensitivity suite's, measured in this test run on this machine, TP=2): OK, exit 0.
    The nightly tier's control class through `compare`."""
    _, _, suite = sensitivity_suite
    run = tmp_path / "compare"
    r = _compare("--vllm-patch", str(HARMLESS), "--baseline-golden", str(suite / "golden.json"),
                 "--run-dir", str(run))
    assert r.returncode == Exit.PASS and "OK" in r.stderr, r.stderr[-3000:]
    report = json.loads((run / "compare.json").read_text())
    assert report["verdict"] == "OK" and report["new_hard"] == 0, report
    assert not (run / "release").exists(), "the golden stood in for the release run"
    assert report["vllm_under_test"]["patch_sha256"] == hashlib.sha256(
        HARMLESS.read_bytes()).hexdigest()


def _compare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "validate", "compare", *args],
                          capture_output=True, text=True, timeout=1800, check=False)


def test_every_breakage_of_the_catalogue_applies_to_the_pinned_vllm(vllm_here) -> None:
    """The sensitivity suite's patches (validate/data/breakages/) apply to the installed release,
    cover the places the suite claims, and each changes a distinct place."""
    from validate import sensitivity

    catalogue = sensitivity.catalogue()
    assert len(catalogue) >= 8
    places = {b.place for b in catalogue}
    assert {"what the head receives", "weight loading", "positions", "norms",
            "what it shares with the target", "tensor-parallel sharding",
            "the drafting loop"} <= places
    assert {b.kind for b in catalogue} == {"head", "sharing", "drafting", "lossy", "bookkeeping",
                                           "quantization", "control"}, (
        "every class of fault, the acceptance rule's and a quantized target's too")
    assert {b.name for b in catalogue if b.quantized} == {
        b.name for b in catalogue if b.kind == "quantization"}, "quantized-path breakages say so"
    hunks = set()
    for b in catalogue:
        files = vllm_change.check_applies(b.patch, sys.executable)  # runs build their overlays
        assert files and all(f.startswith("vllm/") for f in files)
        hunks.add(b.patch.read_text().split("@@", 2)[2])
    assert len(hunks) == len(catalogue), "two breakages change the same lines"


def test_sensitivity_refuses_an_unknown_breakage(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "validate", "sensitivity", "--only", "nope",
                        "--run-dir", str(tmp_path / "s")], capture_output=True, text=True,
                       check=False)
    assert r.returncode == Exit.BAD_INPUT and "no breakage named nope" in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()


def test_a_breakage_of_tp_sharding_is_left_out_or_refused_at_tp_1(tmp_path: Path) -> None:
    """At TP=1 the gather head-logits-not-gathered breaks is the identity: it would PASS and read
    as a miss. The suite leaves it out at TP=1 and refuses it when named."""
    from validate import sensitivity

    assert "head-logits-not-gathered" not in {b.name for b in sensitivity.chosen(None, "full", (), 1)}
    assert "head-logits-not-gathered" in {b.name for b in sensitivity.chosen(None, "full", (), 2)}
    assert sensitivity.left_out("full", (), 1) == ["head-logits-not-gathered"]
    assert sensitivity.left_out("full", (), 2) == []
    r = subprocess.run([sys.executable, "-m", "validate", "sensitivity", "--tp", "1", "--only",
                        "head-logits-not-gathered", "--run-dir", str(tmp_path / "s")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == Exit.BAD_INPUT and "--tp 2" in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()


def _wheel(tmp_path: Path, name: str, members: dict[str, str]) -> Path:
    import zipfile

    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in members.items():
            zf.writestr(member, text)
    return path


@pytest.mark.parametrize("case", ["missing", "not-a-checkout", "compiled-change", "wheel-missing",
                                  "wheel-name", "wheel-other-python", "wheel-other-package"])
def test_a_source_or_wheel_that_cannot_run_is_refused_before_any_engine(vllm_here, tmp_path: Path,
                                                                        case: str) -> None:
    tree = tmp_path / "checkout"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "csrc").mkdir()
    (tree / "csrc" / "my_kernel.cu").write_text("__global__ void k() {}\n")
    args, says = {
        "missing": (["--vllm-source", str(tmp_path / "nope")], "no such folder"),
        "not-a-checkout": (["--vllm-source", str(tmp_path)], "is not a vLLM checkout"),
        "compiled-change": (["--vllm-source", str(tree)], "changes compiled code relative to vLLM "
                            "0.32.0 (changed or added: csrc/my_kernel.cu; missing: "),
        "wheel-missing": (["--vllm-wheel", str(tmp_path / "vllm-0.32.0-py3-none-any.whl")],
                          "no such file"),
        "wheel-name": (["--vllm-wheel", str(_wheel(tmp_path, "vllm.zip", {}))],
                       "is not a wheel's file name"),
        "wheel-other-python": (["--vllm-wheel", str(_wheel(
            tmp_path, "vllm-0.32.0-cp39-cp39-macosx_11_0_arm64.whl", {"vllm/__init__.py": ""}))],
            "which this environment's Python cannot install"),
        "wheel-other-package": (["--vllm-wheel", str(_wheel(
            tmp_path, "torch-2.0-py3-none-any.whl", {"torch/__init__.py": ""}))], "not of vLLM"),
    }[case]
    run = tmp_path / "run"
    r = _kit("--tp", "1", *args, "--run-dir", str(run))
    assert r.returncode == Exit.BAD_INPUT and says in r.stderr, r.stderr[-2000:]
    assert not run.exists()


def test_a_wheel_becomes_an_overlay_of_its_own_package(vllm_here, tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "vllm-0.32.0-py3-none-any.whl",
                   {"vllm/__init__.py": "MARK = 1\n", "vllm-0.32.0.dist-info/METADATA": ""})
    change = vllm_change.from_wheel(wheel, sys.executable)
    assert change.kind == "wheel" and change.wheel == wheel.name and len(change.wheel_sha256) == 64
    assert (Path(change.overlay) / "vllm" / "__init__.py").read_text() == "MARK = 1\n"
    assert not (Path(change.overlay) / "vllm-0.32.0.dist-info").exists()


def test_compare_runs_hub_profiles_through_validate_with_their_weights_options() -> None:
    """`compare --profile maverick-tp8`: both runs go through `validate` (fetch, verify, the image
    with the change as a layer, or --no-container), at the profile's TP, with the weights options
    given; a generated pair goes through `rehearse`, at TP=2 on CPU unless told."""
    from validate import cli, compare

    parser = cli.build_parser()
    args = parser.parse_args(["compare", "--vllm-patch", str(BREAKING), "--profile", "maverick-tp8",
                              "--no-container", "--local-dir", "/models", "--offline"])
    profile, command = compare.sized_profile(args)
    assert command[:3] == ["validate", "--profile", "maverick-tp8"], command
    assert command[command.index("--tp") + 1] == "8" and profile.tensor_parallel_size == 8
    assert {"--no-container", "--local-dir=/models", "--offline"} <= set(command), command
    assert any(c.startswith("--lock-file=") for c in command), "the lock the user named (or the kit's)"
    args = parser.parse_args(["compare", "--vllm-patch", str(BREAKING), "--container"])
    profile, command = compare.sized_profile(args)
    assert command[:3] == ["rehearse", "--profile", "tiny"] and "--container" in command
    assert profile.tensor_parallel_size == 2 and not any(c.startswith("--lock") for c in command)
