"""`nox -s sensitivity`: the kit's catalogue of breakages of vLLM's Llama-4 EAGLE path, each applied
through --vllm-patch to the pinned vLLM, must be caught by the verdict (FAIL, or ERROR where the
engine crashes), while the unpatched release and the controls PASS. A breakage that PASSes is a
miss: the verdict (or the tiny pair) is not sensitive enough, and this test fails."""

from __future__ import annotations

import json

import pytest
from helpers import TIER

from validate import sensitivity


@pytest.mark.e2e
def test_the_sensitivity_suite_catches_every_breakage(sensitivity_suite,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, output, run = sensitivity_suite
    table = (run / "sensitivity.md").read_text() if (run / "sensitivity.md").is_file() else ""
    with capsys.disabled():  # the CI log shows the table and its time
        print("\n" + (table or output[-3000:]))
    report = json.loads((run / "sensitivity.json").read_text())
    outcomes = {o["name"]: o for o in report["outcomes"]}
    expected = {b.name: b.expect for b in sensitivity.chosen(None, TIER)}
    # a quantized target's breakages run on tiny-fp8 (GPU only: docs/evidence/h200-fp8)
    classes = {b.kind for b in sensitivity.catalogue() if not b.quantized}
    ran = {b.kind for b in sensitivity.chosen(None, TIER)}
    # the CI tier's control: a comment-only patch as an image layer PASSes (test_containers.py,
    # --full); through `compare` in the nightly tier (test_vllm_change.py)
    assert ran | ({"control"} if TIER == "ci" else set()) == classes, "every class of fault runs"
    assert set(outcomes) == {"release (unpatched)", *expected}, sorted(outcomes)
    assert outcomes["release (unpatched)"]["verdict"] == "PASS", outcomes["release (unpatched)"]
    wrong = {name: (o["verdict"], o["mean_acceptance"], o["detail"]) for name, o in outcomes.items()
             if name in expected and (o["verdict"] == "PASS") != (expected[name] == "pass")}
    assert not wrong, f"judged other than expected (a missed breakage, or a control that cried wolf): {wrong}"
    assert all(o["verdict"] in ("PASS", "FAIL", "ERROR") for o in outcomes.values()), outcomes
    assert code == 0 and report["missed"] == [], output[-3000:]
    if TIER == "ci":  # at TP=1 (tests/conftest.py): each engine in its script's own process
        for folder in ("release", *expected):
            rec = json.loads((run / folder / "record.json").read_text())
            env_set = rec["environment"]["env_set"]
            assert env_set.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", (folder, env_set)
    caught = {part for o in outcomes.values() for part in o["caught_by"].split(", ") if part}
    assert caught >= {"acceptance", "divergences", "counters"}, (
        f"every part of the verdict caught a breakage: {caught}")
    lossy = [o for o in outcomes.values() if o["kind"] == "lossy"]
    assert lossy and all(o["caught_by"] and "divergences" in o["caught_by"] for o in lossy), (
        f"a lossy acceptance rule must be caught by its divergences, not only by chance: {lossy}")
