"""Llama-4 EAGLE speculative decoding, end to end, at tensor parallel 8 (the seed PR's separate test).

Compares greedy chat outputs of a reference engine with those of a speculative engine (method
``eagle``, a Llama-4 EAGLE head), reads vLLM's acceptance counters, and gives one verdict: PASS
only if enough outputs match exactly AND the head's drafts are accepted often enough (an
exact-match check alone passes a head that predicts nothing). Every run writes a folder with
record.json, junit.xml and summary.md, also when it fails halfway.

It is not part of vLLM's regular CI: Maverick needs 8 GPUs. Run it by hand:

    # the kit does everything (pinned image, pinned weights, preflight):
    nox -s validate_tp8
    # or plain pytest, in an environment with vLLM and the weights already on disk:
    pytest validate/e2e/test_llama4_eagle_tp8.py --profile maverick-tp8 \\
        --target /models/Llama-4-Maverick-17B-128E-Instruct-FP8 \\
        --draft /models/EAGLE-Llama-4-Maverick-17B-128E-Instruct --run-dir runs/maverick
    # the same script on the generated tiny pair, on CPU, at TP=8 (vLLM's CPU build):
    pytest validate/e2e/test_llama4_eagle_tp8.py --profile tiny

Options: --profile (repeatable), --tp, --target, --draft, --run-dir, --num-prompts, --max-tokens.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from validate import compat, metrics, profiles, prompts
from validate.e2e import engines
from validate.record import RunRecord


class IncompatibleModel(ValueError):
    """The model folders cannot work with this vLLM at this TP size; said before engines start."""


def _resolve(profile: profiles.Profile, option: str | None, field: str) -> str:
    """A model folder: the option, else the profile's; ``generated:*`` names a part of the tiny
    pair, which is generated here (engine side) if it is not cached yet."""
    value = option or getattr(profile, field)
    if value.startswith(profiles.GENERATED):
        from validate import synth

        return str(synth.ensure().root / value.removeprefix(profiles.GENERATED))
    return value


def _revision(model_dir: str) -> str | None:
    """The commit a model folder holds: from the Hugging Face cache layout (``snapshots/<sha>``),
    from huggingface_hub's ``--local-dir`` metadata, or the tiny pair's fingerprint."""
    path = Path(model_dir).resolve()
    if m := re.search(r"/snapshots/([0-9a-f]{40})(/|$)", str(Path(model_dir).absolute())):
        return m.group(1)
    meta = path / ".cache" / "huggingface" / "download" / "config.json.metadata"
    if meta.is_file():
        return meta.read_text().splitlines()[0].strip()
    pair = path.parent / "pair.json"
    if pair.is_file():
        return "generated:" + json.loads(pair.read_text())["fingerprint"]
    return None


def _explain(cmp: metrics.Comparison, acc: metrics.Acceptance, verdict: metrics.Verdict) -> str:
    lines = [f"{verdict.word}:", *[f"  {r}" for r in verdict.reasons],
             f"  accepted per position: {acc.accepted_per_position} of {acc.drafts} drafts"]
    for m in cmp.mismatches[:5]:
        lines.append(f"  prompt {m['index']} diverges: reference {m['reference']!r} "
                     f"!= speculative {m['speculative']!r}")
    return "\n".join(lines)


def test_llama4_eagle_tp8(profile_name: str, request: pytest.FixtureRequest) -> None:
    opt = request.config.getoption
    profile = profiles.get(profile_name).with_overrides(
        tensor_parallel_size=opt("--tp"), num_prompts=opt("--num-prompts"),
        max_tokens=opt("--max-tokens"))
    name = f"{profile.name}-tp{profile.tensor_parallel_size}"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = opt("--run-dir") or Path("runs") / f"{name}-{stamp}"
    rec = RunRecord.create(run_dir, profile=profile.to_dict(), name=name)
    engines.log(f"run folder: {run_dir}")
    try:
        with rec.phase("checks"):
            target = _resolve(profile, opt("--target"), "target")
            draft = _resolve(profile, opt("--draft"), "draft")
            rec.update(models={"target": target, "draft": draft,
                               "target_revision": _revision(target),
                               "draft_revision": _revision(draft)})
            problems = compat.head_problems(Path(draft)) + compat.tp_problems(
                Path(target), profile.tensor_parallel_size)
            if problems:
                raise IncompatibleModel("; ".join(problems))
            rec.update(environment={**engines.environment(),
                                    "vllm": engines.require_vllm(profile.device),
                                    "env_set": engines.prepare_process_env(profile)})

        chats = prompts.chat_prompts(profile.prompt_set, profile.num_prompts)
        texts = [c[0]["content"] for c in chats]
        t0 = time.monotonic()
        ref = engines.run_engine(profile, target, chats, None, rec.phase, "reference")
        spec = engines.run_engine(
            profile, target, chats,
            {"method": "eagle", "model": draft,
             "num_speculative_tokens": profile.num_speculative_tokens},
            rec.phase, "speculative")
        engines.log(f"both engines done in {time.monotonic() - t0:.1f}s")

        cmp = metrics.compare(texts, ref.texts, spec.texts)
        acc = metrics.acceptance_from_counters(spec.counters, profile.num_speculative_tokens)
        verdict = metrics.verdict(cmp, acc, min_exact_match=profile.min_exact_match,
                                  min_mean_acceptance_length=profile.min_mean_acceptance_length)
        rec.update(
            comparison={"total": cmp.total, "matches": cmp.matches, "ratio": cmp.ratio,
                        "mismatches": cmp.mismatches},
            acceptance=acc.to_dict(),
            raw_counters=spec.counters,
            outputs=[{"prompt": p, "reference": r, "speculative": s}
                     for p, r, s in zip(texts, ref.texts, spec.texts, strict=True)],
        )
        rec.finish(passed=verdict.passed, reasons=verdict.reasons)
    except BaseException as exc:
        running = [n for n, p in rec.data["phases"].items() if p["status"] != "ok"]
        rec.fail(exc, where=running[-1] if running else "")
        raise
    engines.log(f"{verdict.word}; record: {run_dir}")
    assert verdict.passed, _explain(cmp, acc, verdict)
