"""Llama-4 EAGLE speculative decoding, end to end, at tensor parallel 8 (the seed PR's separate test).

Compares greedy chat outputs of a reference engine (or a calibrated golden's reference outputs)
with those of a speculative engine (method ``eagle``, a Llama-4 EAGLE head), token by token, and
reads vLLM's acceptance counters. One verdict: PASS only if every divergence from the reference is
a near-tie (the two tokens within the near-tie bound measured for this run, under the reference's
logprobs), no more outputs diverge than the golden's runs allow, AND the
head's drafts are accepted as often as the calibrated golden says (overall and per position), or
above the profile's floor where no golden applies (``uncalibrated``). An exact-match check alone
passes a head that predicts nothing and fails a sound vLLM on bf16 near-ties. Every run writes a
folder with record.json, junit.xml and summary.md, also when it fails halfway.

It is not part of vLLM's regular CI: Maverick needs 8 GPUs. Run it by hand:

    # the kit does everything (pinned image, pinned weights, preflight):
    nox -s validate_tp8
    # or plain pytest, in an environment with vLLM and the weights already on disk:
    pytest validate/e2e/test_llama4_eagle_tp8.py --profile maverick-tp8 \\
        --target /models/Llama-4-Maverick-17B-128E-Instruct-FP8 \\
        --draft /models/EAGLE-Llama-4-Maverick-17B-128E-Instruct --run-dir runs/maverick
    # the same script on the generated tiny pair, on CPU, at TP=8 (vLLM's CPU build):
    pytest validate/e2e/test_llama4_eagle_tp8.py --profile tiny

Options (validate/contract.py, E2E_OPTIONS): --profile (repeatable), --tp, --target, --draft,
--run-dir, --num-prompts, --max-tokens, --golden (auto | none | FILE), --reference (live | golden:
skip the reference engine), --run-id (the host's id for this run, written into the record).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from validate import compat, contract, goldens, metrics, profiles, prompts
from validate.e2e import engines
from validate.e2e.serving import cpu_kv_cache_bytes
from validate.record import RunRecord


class IncompatibleModel(contract.BadInput):
    """The model folders cannot work with this vLLM at this TP size; said before engines start."""


def _resolve(profile: profiles.Profile, option: str | None, field: str) -> str:
    """A model folder: the option, else the profile's; ``generated:*`` names a part of the tiny
    pair, which is generated here (engine side) if it is not cached yet."""
    value = option or getattr(profile, field)
    if value.startswith(profiles.GENERATED):
        from validate import synth

        root = synth.ensure().root
        variant = profiles.fp8_variant(value)
        if variant:
            from validate import quantize

            return str(quantize.ensure(root, variant))
        return str(root / value.removeprefix(profiles.GENERATED))
    return value


def _pair_manifest(model_dir: str) -> Path | None:
    """The tiny pair's manifest for one of its models: beside it where the kit generated it,
    inside it where ``rehearse --full`` published the model on its loopback hub and fetched it."""
    path = Path(model_dir)
    for manifest in (path.parent / "pair.json", path / "pair.json"):
        if manifest.is_file():
            return manifest
    return None


def _revision(model_dir: str) -> str | None:
    """What a model folder holds: the tiny pair's fingerprint (its weights' identity, wherever
    they were copied or fetched to), else the commit from the Hugging Face cache layout
    (``snapshots/<sha>``) or from huggingface_hub's ``--local-dir`` metadata."""
    path = Path(model_dir).resolve()
    if manifest := _pair_manifest(model_dir):
        return "generated:" + json.loads(manifest.read_text())["fingerprint"]
    if m := re.search(r"/snapshots/([0-9a-f]{40})(/|$)", str(Path(model_dir).absolute())):
        return m.group(1)
    meta = path / ".cache" / "huggingface" / "download" / "config.json.metadata"
    if meta.is_file():
        return meta.read_text().splitlines()[0].strip()
    return None


def _snapshot(model_dir: str) -> str | None:
    """The hub commit of a model folder in the Hugging Face cache layout, if it is one."""
    m = re.search(r"/snapshots/([0-9a-f]{40})(/|$)", str(Path(model_dir).absolute()))
    return m.group(1) if m else None


def _explain(cmp: metrics.Comparison, acc: metrics.Acceptance, verdict: metrics.Verdict) -> str:
    lines = [f"{verdict.word} ({verdict.calibration}):", *[f"  {r}" for r in verdict.reasons],
             f"  accepted per position: {acc.accepted_per_position} of {acc.drafts} drafts"]
    for d in cmp.divergences[:5]:
        lines.append(f"  {d.describe()}: reference {d.reference_text!r} vs speculative "
                     f"{d.speculative_text!r}")
    return "\n".join(lines)


def _weights_digest(model_dir: str) -> str | None:
    """sha256 (16 hex) of a generated model's weights: the tiny pair is trained on this machine,
    and another CPU can round it differently, so a golden names the exact weights it measured.
    Hub models are pinned by their commit (and verified by ``fetch``) instead."""
    path = Path(model_dir)
    if _pair_manifest(model_dir) is None:
        return None
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _goldens(profile: profiles.Profile, option: str, environment: dict[str, Any],
             models: dict[str, Any]) -> tuple[dict[str, Any] | None, str, dict[str, Any] | None, str]:
    """(golden, why, TP=1 golden, why) for this run; ``option`` is auto, none or a file."""
    if option == "none":
        return None, "--golden none", None, ""
    folder = goldens.DIR if option == "auto" else Path(option).parent
    cls, tp = environment["device_class"], profile.tensor_parallel_size
    path = folder / goldens.filename(profile.name, cls, tp) if option == "auto" else Path(option)
    versions = {"vllm": environment["vllm"], "torch": environment["torch"]}
    golden, why = goldens.select(path, profile=profile.to_dict(), device_class=cls,
                                 versions=versions, models=models)
    tp1, why1 = None, ""
    if tp > 1:
        tp1, why1 = goldens.select(folder / goldens.filename(profile.name, cls, 1),
                                   profile={**profile.to_dict(), "tensor_parallel_size": 1},
                                   device_class=cls, versions=versions, models=models)
    return golden, why, tp1, why1


def test_llama4_eagle_tp8(profile_name: str, request: pytest.FixtureRequest) -> None:
    opt = request.config.getoption
    profile = profiles.get(profile_name).with_overrides(
        tensor_parallel_size=opt("--tp"), pipeline_parallel_size=opt("--pp"),
        nodes=opt("--nodes"), num_prompts=opt("--num-prompts"),
        max_tokens=opt("--max-tokens"))
    name = f"{profile.name}-tp{profile.tensor_parallel_size}"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = opt("--run-dir") or Path("runs") / f"{name}-{stamp}"
    reference = opt("--reference")
    serving = opt("--path") == "serving"
    rec = RunRecord.create(run_dir, profile=profile.to_dict(), name=name, run_id=opt("--run-id"))
    engines.log(f"run folder: {run_dir}")
    try:
        with rec.phase("checks"):
            target = _resolve(profile, opt("--target"), "target")
            draft = _resolve(profile, opt("--draft"), "draft")
            models = {"target": target, "draft": draft,
                      "target_revision": _revision(target), "draft_revision": _revision(draft),
                      "target_weights": _weights_digest(target),
                      "draft_weights": _weights_digest(draft),
                      "target_snapshot": _snapshot(target), "draft_snapshot": _snapshot(draft)}
            rec.update(models=models)
            problems = compat.head_problems(Path(draft)) + compat.tp_problems(
                Path(target), profile.tensor_parallel_size)
            if problems:
                raise IncompatibleModel("; ".join(problems))
            env = {**engines.environment(profile.device),
                   "vllm": engines.require_vllm(profile.device, profile.device_note),
                   "env_set": engines.prepare_process_env(profile, serving),
                   "cpu_kv_cache_bytes": cpu_kv_cache_bytes(profile)}
            rec.update(environment=env)
            if profile.nodes > 1:  # every node checked before anything heavy
                from validate.e2e import nodes

                rec.update(nodes=nodes.check(profile, {"target": target, "draft": draft}))
            if serving:
                # Goldens are calibrated on the offline path; the serving path has its own
                # scheduler and batching, so its acceptance is judged against the profile's floor
                # until a golden is calibrated for it (`nox -s calibrate` does the offline path).
                golden, why, tp1, why1 = None, "the serving path has no calibrated golden yet", \
                    None, ""
                concurrency = opt("--concurrency") or profile.bench_concurrency
                repeats = opt("--repeats") or profile.bench_repeats
                if not profile.bench_set or reference == "golden":
                    raise contract.BadInput(
                        f"--path serving needs a profile with a bench_set (profile "
                        f"{profile.name}: {profile.bench_set or 'none'}) and --reference live")
            else:
                golden, why, tp1, why1 = _goldens(profile, opt("--golden"), env, models)
            rec.update(golden={"applied": golden is not None, "why": why,
                               "tp1_applied": tp1 is not None, "tp1_why": why1},
                       reference={"kind": reference})
            if reference == "golden" and golden is None:
                raise goldens.BadGolden(f"--reference golden needs a golden that applies here: "
                                        f"{why}; or run with --reference live")

        chats = prompts.chat_prompts(profile.prompt_set, profile.num_prompts)
        speculative = {"method": "eagle", "model": draft,
                       "num_speculative_tokens": profile.num_speculative_tokens}
        texts = [c[0]["content"] for c in chats]
        t0 = time.monotonic()
        if serving:
            from validate.e2e import bench

            ref_outputs, spec_outputs, counters, section = bench.run(
                profile, target, speculative, chats, Path(run_dir), rec.phase, concurrency,
                repeats)
            spec = engines.EngineRun(outputs=spec_outputs, counters=counters)
            rec.update(path="serving", bench=section)
            bench.require_figures(section, Path(run_dir) / "bench")
        elif golden is not None and reference == "golden":
            engines.log(f"reference: the golden's outputs ({why}); no reference engine")
            ref_outputs = [metrics.Output.from_dict(o) for o in golden["reference"]]
        else:
            ref_outputs = engines.run_engine(profile, target, chats, None, rec.phase,
                                             "reference", run_dir).outputs
        if not serving:
            spec = engines.run_engine(profile, target, chats, speculative, rec.phase,
                                      "speculative", run_dir)
        engines.log(f"engines done in {time.monotonic() - t0:.1f}s")

        cmp = metrics.judge_outputs(ref_outputs, spec.outputs,
                                    rule=metrics.NearTieRule(**profiles.near_tie_rule()),
                                    cap=profile.near_tie_cap, golden=golden,
                                    golden_name=why.split(":")[0].removeprefix("golden "))
        acc = metrics.acceptance_from_counters(spec.counters, profile.num_speculative_tokens)
        counted = metrics.CounterCheck(len(spec.outputs), sum(len(o.token_ids) for o in spec.outputs),
                                       acc.drafts, acc.accepted_tokens, profile.num_speculative_tokens)
        verdict = metrics.verdict(
            cmp, acc, min_mean_acceptance_length=profile.min_mean_acceptance_length,
            golden=metrics.expectation(why, golden["acceptance"]) if golden else None,
            uncalibrated_because=why,
            tp_reference=metrics.expectation(why1, tp1["acceptance"]) if tp1 else None,
            counters=counted)
        rec.update(
            comparison=cmp.to_dict(),
            acceptance=acc.to_dict(),
            counter_check=counted.to_dict(),
            raw_counters=spec.counters,
            outputs=[{"prompt": p, "reference": r.text, "speculative": s.text}
                     for p, r, s in zip(texts, ref_outputs, spec.outputs, strict=True)],
            reference_outputs=[o.to_dict() for o in ref_outputs] if reference == "live" else None,
        )
        rec.finish(passed=verdict.passed, reasons=verdict.reasons, calibration=verdict.calibration)
    except BaseException as exc:
        running = [n for n, p in rec.data["phases"].items() if p["status"] != "ok"]
        rec.fail(exc, where=running[-1] if running else "")
        raise
    engines.log(f"{verdict.word} ({verdict.calibration}); record: {run_dir}")
    assert verdict.passed, _explain(cmp, acc, verdict)
