"""Bad input is refused early, with what is wrong and what fixes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from validate.contract import Exit

SCRIPT = Path(__file__).resolve().parent.parent / "validate" / "e2e" / "test_llama4_eagle_tp8.py"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "validate", *args], capture_output=True, text=True,
                          timeout=600, check=False)


def test_unknown_profile_lists_known_ones() -> None:
    r = _cli("rehearse", "--profile", "maverick")
    assert r.returncode == Exit.BAD_INPUT, r.stderr
    assert "unknown profile 'maverick'" in r.stderr and "maverick-tp8" in r.stderr


def test_tp_that_does_not_divide_is_refused_before_any_engine(models, tmp_path: Path) -> None:
    r = _cli("rehearse", "--tp", "3", "--target", str(models.target), "--draft", str(models.head),
             "--run-dir", str(tmp_path / "run"))
    assert r.returncode == Exit.BAD_INPUT, r.stderr
    assert "8 attention heads are not divisible by tensor parallel size 3" in r.stderr
    assert not (tmp_path / "run").exists(), "no engine, no run"


@pytest.fixture
def head_without_key(models, tmp_path: Path) -> Path:
    head = tmp_path / "head"
    shutil.copytree(models.head, head)
    cfg = json.loads((head / "config.json").read_text())
    del cfg["yoco_local_kv_layer"]
    (head / "config.json").write_text(json.dumps(cfg))
    return head


def test_head_missing_a_loader_key_is_refused_naming_it(models, head_without_key: Path) -> None:
    r = _cli("rehearse", "--target", str(models.target), "--draft", str(head_without_key))
    assert r.returncode == Exit.BAD_INPUT, r.stderr
    assert "'yoco_local_kv_layer'" in r.stderr
    assert "vllm/model_executor/models/llama4_eagle.py" in r.stderr


def test_e2e_script_on_its_own_refuses_it_too_and_records_why(models, head_without_key: Path,
                                                              tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "pytest", str(SCRIPT), "-q", "-p",
                        "no:cacheprovider", "--target", str(models.target),
                        "--draft", str(head_without_key), "--run-dir", str(run)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 1, r.stdout[-2000:]
    rec = json.loads((run / "record.json").read_text())
    assert rec["error"]["type"] == "IncompatibleModel" and rec["error"]["kind"] == "bad-input"
    assert "yoco_local_kv_layer" in rec["error"]["message"]
    assert list(rec["phases"]) == ["checks"], "no engine was started"


def test_vllm_built_for_another_device_names_the_session() -> None:
    pytest.importorskip("vllm", reason="needs the CPU engine environment (nox -s tests)")
    from validate.e2e import engines

    with pytest.raises(engines.EnvironmentProblem, match="nox -s validate_tp8") as err:
        engines.require_vllm("cuda")
    assert "runs on 'cpu'" in str(err.value)


def test_vllm_missing_names_the_session() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"  # makes `import vllm` fail as if absent
            "from validate.e2e import engines\n"
            "try:\n    engines.require_vllm('cpu')\n"
            "except engines.EnvironmentProblem as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "vLLM is not importable" in out.stdout and "nox -s rehearse_tp8" in out.stdout


def test_corrupt_golden_is_refused_before_any_engine(models, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="needs the CPU engine environment (nox -s tests)")
    golden = tmp_path / "tiny-cpu-x-tp8.json"
    golden.write_text('{"schema": 1, "profile": "tiny"')
    r = _cli("rehearse", "--golden", str(golden), "--target", str(models.target), "--draft",
             str(models.head), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == Exit.BAD_INPUT, r.stderr[-2000:]
    message = " ".join(r.stderr.split())  # rich folds long lines
    assert str(golden) in message and "nox -s calibrate -- --profile tiny --tp 8" in message, message
    assert not (tmp_path / "run").exists(), "refused on the host, before any run folder or engine"


def test_reference_golden_without_a_golden_is_refused(models, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="needs the CPU engine environment (nox -s tests)")
    r = _cli("rehearse", "--golden", "none", "--reference", "golden", "--target",
             str(models.target), "--draft", str(models.head), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == Exit.BAD_INPUT, r.stderr[-2000:]
    rec = json.loads((tmp_path / "run" / "record.json").read_text())
    assert "--reference golden needs a golden" in rec["error"]["message"]
    assert list(rec["phases"]) == ["checks"]


@pytest.mark.parametrize(("extra", "says"), [
    (["--profile", "maverick-tp8"], "`nox -s validate_tp8 -- --profile maverick-tp8` runs it"),
    (["--head", "random"], "drop --head/--target/--draft"),
], ids=["hub-profile", "head-option"])
def test_full_rehearsal_refuses_what_it_cannot_publish(extra: list[str], says: str,
                                                       tmp_path: Path) -> None:
    """`rehearse --full` publishes the generated pair as it is: said before anything starts."""
    r = _cli("rehearse", "--full", *extra, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == Exit.BAD_INPUT and says in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()



@pytest.mark.parametrize(("extra", "says"), [
    (["--num-prompts", "0"], "a verdict needs at least one prompt"),
    (["--max-tokens", "0"], "a verdict needs at least one token"),
    (["--max-tokens", "4096"], "leaves no room for the prompt in the profile's max_model_len 1024"),
    (["--tp", "0"], "the tensor parallel size is at least 1"),
], ids=["no-prompts", "no-tokens", "tokens-beyond-model-len", "tp-0"])
def test_sizes_that_cannot_give_a_verdict_are_refused_before_any_engine(
        extra: list[str], says: str, tmp_path: Path) -> None:
    """Before: --num-prompts 0 started two engines and FAILed, blaming the head."""
    r = _cli("rehearse", *extra, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == Exit.BAD_INPUT and says in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
