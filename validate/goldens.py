"""Goldens: what a profile's acceptance and reference outputs were, measured, on one device class.

A golden is data (``validate/data/goldens/<profile>-<device class>-tp<N>.json``), written by
``nox -s calibrate`` from N real runs: the mean acceptance length and per-position rates with their
spread and the tolerance derived from it, the reference outputs with their top-k logprobs, the
divergences those runs saw, and everything the figures depend on (vLLM and torch versions, device
class, TP, model revisions, prompts). A golden applies to a run only when all of that matches; the
record always says which golden was used and why, or why none was. File I/O only: no vLLM, no
network (both sides use it).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from validate import contract, metrics
from validate.files import atomic_write

SCHEMA = 2  # 2: a summary first, one line per reference output (1 was one number per line)
DIR = Path(__file__).parent / "data" / "goldens"
MAX_BYTES = 300_000  # a recalibration must stay a reviewable diff (tests/test_goldens.py)

# What must be equal between a golden and a run for the golden to apply, beyond its file name.
PROFILE_KEYS = ("prompt_set", "num_prompts", "max_tokens", "num_speculative_tokens", "dtype",
                "enforce_eager")


class BadGolden(contract.BadInput):
    """A golden file that cannot be read; names the file and how to regenerate it."""


def filename(profile: str, device_class: str, tp: int) -> str:
    return f"{profile}-{device_class}-tp{tp}.json"


def regenerate_hint(profile: str, tp: int) -> str:
    return f"`nox -s calibrate -- --profile {profile} --tp {tp} --runs 5`"


def load(path: Path, *, regenerate: str = "`nox -s calibrate -- --profile P --tp N`") -> dict[str, Any]:
    """A golden file, checked for the fields the verdict reads; ``regenerate`` is the command the
    refusal names."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, this kit reads schema {SCHEMA}")
        for key in ("profile", "device_class", "tensor_parallel_size", "versions", "models",
                    "acceptance", "reference", "conditions", "runs", "created_at"):
            if key not in data:
                raise ValueError(f"no {key!r}")
        metrics.expectation("check", data["acceptance"])
        for o in data["reference"]:
            metrics.Output.from_dict(o)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadGolden(f"golden file {path} is unreadable ({exc}); delete it and regenerate it "
                        f"with {regenerate}") from exc
    return data


def mismatch(golden: dict[str, Any], *, profile: str, tp: int, device_class: str | None,
             conditions: dict[str, Any] | None = None) -> str | None:
    """What makes a golden another run's, said before anything runs (``--golden FILE``,
    ``compare --baseline-golden``): "its KEY is X, this one's is Y", or None. ``device_class``
    None: not known on this host (a GPU's), left to the engine side's ``select``."""
    checks = [("profile", golden["profile"], profile), ("tensor_parallel_size",
              golden["tensor_parallel_size"], tp)]
    if device_class is not None:
        checks.append(("device_class", golden["device_class"], device_class))
    checks += [(f"conditions.{k}", golden["conditions"].get(k), v)
               for k, v in (conditions or {}).items()]
    return next((f"its {k} is {have!r}, this one's is {want!r}" for k, have, want in checks
                 if have != want), None)


def select(path: Path, *, profile: dict[str, Any], device_class: str, versions: dict[str, Any],
           models: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(golden, why it applies) or (None, why it does not). Never applies one silently: every
    field the figures depend on is compared and the first difference is named."""
    tp = profile["tensor_parallel_size"]
    if not Path(path).is_file():
        return None, (f"no golden for profile {profile['name']} on {device_class} at TP={tp} "
                      f"({Path(path).name}); make one with {regenerate_hint(profile['name'], tp)}")
    g = load(path, regenerate=regenerate_hint(profile["name"], tp))
    want = {"profile": profile["name"], "device_class": device_class, "tensor_parallel_size": tp}
    have = {k: g[k] for k in want}
    checks = [(k, have[k], want[k]) for k in want]
    checks += [(f"versions.{k}", g["versions"].get(k), versions.get(k)) for k in ("vllm", "torch")]
    checks += [(f"models.{k}", g["models"].get(k), models.get(k))
               for k in ("target_revision", "draft_revision", "target_weights", "draft_weights")
               if g["models"].get(k) is not None]
    checks += [(k, g["conditions"].get(k), profile.get(k)) for k in PROFILE_KEYS]
    for key, golden_value, run_value in checks:
        if golden_value != run_value:
            return None, (f"golden {Path(path).name} does not apply: {key} is {golden_value!r} "
                          f"there, {run_value!r} here; recalibrate with "
                          f"{regenerate_hint(profile['name'], tp)}")
    return g, (f"golden {Path(path).name}: {g['runs']} runs on {device_class}, TP={tp}, vLLM "
               f"{g['versions'].get('vllm')}, torch {g['versions'].get('torch')}, "
               f"{g['created_at']}")


def make(records: list[dict[str, Any]], *, sigmas: float) -> dict[str, Any]:
    """A golden from N run records of the same profile, device class and TP.

    Refuses runs that disagree with their reference beyond near-ties (a golden must come from a
    sound vLLM) or that differ in anything the golden is keyed by.
    """
    if not records:
        raise ValueError("no runs to calibrate from")
    first = records[0]
    for r in records:
        if r.get("status") not in ("passed", "failed") or not r.get("acceptance"):
            raise ValueError(f"run {r.get('name')} ended {r.get('status')}: "
                             f"{(r.get('error') or {}).get('message', '')}")
        if (r.get("comparison") or {}).get("hard"):
            raise ValueError(f"run {r.get('name')} has hard divergences: this vLLM does not "
                             "reproduce its own target, so it cannot be a golden")
        for key in ("device_class",):
            if r["environment"].get(key) != first["environment"].get(key):
                raise ValueError(f"runs differ in {key}")
        if r["models"] != first["models"]:
            raise ValueError("runs differ in the models they used")
    runs = [metrics.Acceptance.from_dict(r["acceptance"]) for r in records]
    prof = first["profile"]
    env = first["environment"]
    gaps = sorted(d["gap"] for r in records for d in r["comparison"]["divergences"]
                  if d.get("gap") is not None)
    noise = [r["comparison"].get("logprob_noise", {}) for r in records]
    return {
        "schema": SCHEMA,
        "profile": prof["name"],
        "device_class": env["device_class"],
        "tensor_parallel_size": prof["tensor_parallel_size"],
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "runs": len(records),
        "versions": {"vllm": env.get("vllm"), "torch": env.get("torch"),
                     "transformers": env.get("transformers")},
        "hardware": {"cpu": env.get("cpu"), "gpus": env.get("gpus")},
        "models": {k: first["models"].get(k) for k in ("target_revision", "draft_revision",
                                                         "target_weights", "draft_weights")},
        "conditions": {k: prof.get(k) for k in PROFILE_KEYS},
        "acceptance": metrics.derive_tolerance(runs, sigmas),
        "exact_match": [r["comparison"]["matches"] for r in records],
        "divergence_gaps": gaps,
        "logprob_noise": noise,
        "reference": first["reference_outputs"],
    }


def summary(golden: dict[str, Any]) -> dict[str, Any]:
    """The figures a reviewer reads first, at the top of the file."""
    acc = golden["acceptance"]
    mal = acc["mean_acceptance_length"]
    return {"mean_acceptance_length": round(mal["mean"], 4), "tolerance": round(mal["tolerance"], 4),
            "per_position": [f"{p['mean']:.3f} - {p['tolerance']:.3f}"
                             for p in acc["per_position_rate"]],
            "runs": golden["runs"], "identical_outputs_per_run": golden.get("exact_match"),
            "largest_near_tie_gap": max(golden.get("divergence_gaps") or [0.0]),
            "largest_logprob_noise": max([float((n or {}).get("max") or 0.0)
                                          for n in golden.get("logprob_noise", [])] or [0.0])}


def dumps(golden: dict[str, Any]) -> str:
    """JSON in the order a reviewer reads it: the summary, the figures and their conditions, then
    the reference outputs one line each (a recalibration's diff is a few lines of figures and one
    line per prompt whose output moved, not 74,000 lines of numbers)."""
    head = {"schema": SCHEMA, "summary": summary(golden),
            **{k: v for k, v in golden.items() if k not in ("schema", "summary", "reference")}}
    text = json.dumps(head, indent=1)
    refs = ",\n".join("  " + json.dumps(o, separators=(",", ":")) for o in golden["reference"])
    return text[:-2] + ',\n "reference": [\n' + refs + "\n ]\n}\n"


def write(path: Path, golden: dict[str, Any]) -> None:
    atomic_write(Path(path), dumps(golden))
