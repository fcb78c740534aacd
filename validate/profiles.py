"""Named validation profiles, read from ``data/profiles.toml``.

Pure data access: no other module of the kit, no network, no vLLM. Both sides use it: the host to
decide what to fetch and launch, the end-to-end script to know what to run and what to demand.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any

GENERATED = "generated:"
# The tiny pair's FP8 targets (validate/quantize.py writes each beside the pair's BF16 target;
# data/fp8_target.toml names them): ``generated:target-fp8`` (Maverick's set), ``...-attn``.
GENERATED_FP8 = GENERATED + "target-fp8"


def fp8_variant(model: str) -> str | None:
    """The FP8 variant's folder a model string names (``generated:target-fp8*``), else None."""
    return model.removeprefix(GENERATED) if model.startswith(GENERATED_FP8) else None


class UnknownProfile(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    target: str
    draft: str
    tensor_parallel_size: int
    max_model_len: int
    num_speculative_tokens: int
    prompt_set: str
    num_prompts: int
    max_tokens: int
    dtype: str
    enforce_eager: bool
    device: str
    near_tie_cap: float
    top_logprobs: int
    min_mean_acceptance_length: float
    # Why the profile runs on ``device`` only, said where another device is asked to run it.
    device_note: str = ""
    # The target's quantization ("fp8"), where it has one, and which of its modules it covers
    # ("experts", "attention"): a quantized-path breakage runs only where the code it breaks does.
    quantization: str = ""
    quantized_modules: tuple[str, ...] = ()
    # The standard prompt set its serving bench reports on (data/prompt_sets.toml), if any.
    bench_set: str = ""
    # The serving bench's sweep (issue 24): how many of the set's prompts (0: all), the
    # concurrencies ``vllm bench serve`` is run at, and how often each point is repeated.
    bench_prompts: int = 0
    bench_output_len: int = 256  # tokens per answer under load (every answer that long)
    bench_concurrency: tuple[int, ...] = (1, 4, 16, 64)
    bench_repeats: int = 3
    # Each point sends at least concurrency x bench_min_waves requests (the set repeated in its
    # order) after one wave of warm-up requests: a point of one wave measures its own ramp-up and
    # tail (on one H100, concurrency 64 over MT-Bench's 78 prompts lasted 1.3 s and its repeats
    # spread 27%). 0: the set once, one warm-up request (the CPU rehearsal, minutes on 2 cores).
    bench_min_waves: int = 16
    # The spread between repeats (max - min over the median) above which a point's throughput is
    # shown as noise-bound in the summary (issue 24 asks for under 5%).
    bench_max_spread: float = 0.05
    # Beyond one node (issue 25): how many nodes the engines span and the pipeline parallel size
    # (TP inside a node, PP across nodes, as vLLM's multi-node docs lay it out). On GPUs the
    # engines use vLLM's Ray executor on the cluster the kit joins; vLLM's CPU build has neither
    # Ray nor PP (docs/vllm-cpu-findings.md), so a CPU profile spans nodes with TP alone, through
    # vLLM's own multi-node launcher (a headless vLLM on each other node, placed there by Ray).
    nodes: int = 1
    pipeline_parallel_size: int = 1

    @property
    def generated(self) -> bool:
        """True for the tiny pair the kit builds itself (no download)."""
        return self.target.startswith(GENERATED)

    def with_overrides(self, **changes: Any) -> Profile:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def problems(self) -> list[str]:
        """What makes this profile (with its overrides) unable to give a verdict: said before
        any engine starts, instead of a FAIL that would blame the head."""
        out = []
        if self.tensor_parallel_size < 1:
            out.append(f"--tp {self.tensor_parallel_size}: the tensor parallel size is at least 1")
        if self.num_prompts < 1:
            out.append(f"--num-prompts {self.num_prompts}: a verdict needs at least one prompt")
        if self.max_tokens < 1:
            out.append(f"--max-tokens {self.max_tokens}: a verdict needs at least one token")
        elif self.max_tokens >= self.max_model_len:
            out.append(f"--max-tokens {self.max_tokens} leaves no room for the prompt in the "
                       f"profile's max_model_len {self.max_model_len}")
        if self.nodes < 1 or self.pipeline_parallel_size < 1:
            out.append(f"--nodes {self.nodes} --pp {self.pipeline_parallel_size}: each is at "
                       "least 1")
        elif (self.tensor_parallel_size * self.pipeline_parallel_size) % self.nodes:
            out.append(f"TP={self.tensor_parallel_size} x PP={self.pipeline_parallel_size} ranks "
                       f"do not split evenly over {self.nodes} nodes")
        elif self.device == "cpu" and self.pipeline_parallel_size > 1:
            out.append(f"--pp {self.pipeline_parallel_size} on CPU: vLLM's CPU build fails on "
                       "pipeline parallelism's first step (docs/vllm-cpu-findings.md); run PP on "
                       "GPUs, or span nodes with TP alone (--pp 1)")
        return out

    @property
    def ranks_per_node(self) -> int:
        """The engine's ranks on each node (TP x PP over the nodes)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size // max(self.nodes, 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _data() -> dict[str, Any]:
    return tomllib.loads(resources.files("validate.data").joinpath("profiles.toml").read_text())


def _table() -> dict[str, dict[str, Any]]:
    return _data()["profiles"]


def fetch_patterns() -> tuple[list[str], list[str]]:
    """(allow, ignore) patterns of the files a run needs from a model repository."""
    f = _data()["fetch"]
    return list(f["allow_patterns"]), list(f["ignore_patterns"])


def calibration_sigmas() -> float:
    """How many combined standard deviations below a golden's mean a run may fall."""
    return float(_data()["calibration"]["sigmas"])


def near_tie_rule() -> dict[str, float]:
    """``[near_tie]``: the margins of the measured near-tie bound and the count test's levels
    (``metrics.NearTieRule``'s fields)."""
    return {k: float(v) for k, v in _data()["near_tie"].items()}


def comparison_sigmas() -> float:
    """The same, for a change judged beside the release measured on the same machine, prompts and
    reference outputs (``compare``, the sensitivity suite): see ``[calibration]``."""
    return float(_data()["calibration"]["comparison_sigmas"])


def names() -> list[str]:
    return list(_table())


def get(name: str) -> Profile:
    table = _table()
    if name not in table:
        raise UnknownProfile(
            f"unknown profile {name!r}; known profiles: {', '.join(table)} "
            "(defined in validate/data/profiles.toml)"
        )
    fields = dict(table[name])
    fields["quantized_modules"] = tuple(fields.get("quantized_modules", ()))
    if "bench_concurrency" in fields:
        fields["bench_concurrency"] = tuple(fields["bench_concurrency"])
    return Profile(name=name, **fields)
