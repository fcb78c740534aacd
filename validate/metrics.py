"""Acceptance figures and the verdict, from raw counters and output texts.

Pure and fast (no vLLM, no I/O): the end-to-end script hands it what vLLM reported, the tests hand
it numbers. vLLM's counters (``LLM.get_metrics()`` with ``disable_log_stats=False``):
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and the
vector ``..._num_accepted_tokens_per_pos``. Mean acceptance length = 1 + accepted / drafts
(the target's own token plus the accepted draft tokens per verification step).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PREFIX = "vllm:spec_decode_"


@dataclass
class Acceptance:
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_rate": self.acceptance_rate,
                "per_position_rate": self.per_position_rate}


def acceptance_from_counters(counters: dict[str, Any], num_speculative_tokens: int) -> Acceptance:
    """``counters`` maps metric names (with or without the ``vllm:spec_decode_`` prefix) to a
    number, or to a list for the per-position vector. Absent counters mean nothing was drafted."""
    def get(name: str, default: Any = 0) -> Any:
        return counters.get(PREFIX + name, counters.get(name, default))

    per_pos = list(get("num_accepted_tokens_per_pos", []) or [])
    per_pos = [int(x) for x in per_pos] + [0] * (num_speculative_tokens - len(per_pos))
    return Acceptance(
        drafts=int(get("num_drafts")),
        draft_tokens=int(get("num_draft_tokens")),
        accepted_tokens=int(get("num_accepted_tokens")),
        accepted_per_position=per_pos[:num_speculative_tokens],
    )


@dataclass
class Comparison:
    total: int
    matches: int
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.matches / self.total if self.total else 0.0


def compare(prompts: list[str], reference: list[str], speculative: list[str]) -> Comparison:
    """Exact text comparison, prompt by prompt; keeps every diverging pair with its index."""
    if not (len(prompts) == len(reference) == len(speculative)):
        raise ValueError(f"length mismatch: {len(prompts)} prompts, {len(reference)} reference "
                         f"outputs, {len(speculative)} speculative outputs")
    mismatches = [
        {"index": i, "prompt": p, "reference": r, "speculative": s}
        for i, (p, r, s) in enumerate(zip(prompts, reference, speculative, strict=True))
        if r != s
    ]
    return Comparison(total=len(prompts), matches=len(prompts) - len(mismatches),
                      mismatches=mismatches)


@dataclass
class Verdict:
    passed: bool
    reasons: list[str]

    @property
    def word(self) -> str:
        return "PASS" if self.passed else "FAIL"


def verdict(comparison: Comparison, acceptance: Acceptance, *, min_exact_match: float,
            min_mean_acceptance_length: float) -> Verdict:
    """PASS only if outputs match often enough AND the head's drafts are accepted often enough.

    The reasons always say both figures against their floors, so a PASS is explained too.
    """
    reasons = []
    ok_match = comparison.ratio >= min_exact_match
    reasons.append(
        f"exact match {comparison.matches}/{comparison.total} = {comparison.ratio:.1%} "
        f"{'>=' if ok_match else '<'} floor {min_exact_match:.0%}"
    )
    mal = acceptance.mean_acceptance_length
    ok_acc = mal >= min_mean_acceptance_length
    reasons.append(
        f"acceptance: mean acceptance length {mal:.2f} {'>=' if ok_acc else '<'} floor "
        f"{min_mean_acceptance_length:.2f} ({acceptance.accepted_tokens} of "
        f"{acceptance.draft_tokens} drafted tokens accepted over {acceptance.drafts} drafts)"
    )
    if not ok_acc:
        reasons.append(
            "acceptance is too low: the speculative outputs may still match (greedy speculative "
            "decoding is lossless), but the head's drafts are rejected, so the head or the way "
            "vLLM feeds it is broken"
        )
    return Verdict(passed=ok_match and ok_acc, reasons=reasons)
