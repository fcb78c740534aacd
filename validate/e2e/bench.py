"""The serving path: the verdict and the speed-up of ``vllm serve``, with vLLM's own load.

Engine side (vLLM installed; never docker or the hub). Two servers (``serving.Server``) with the
same arguments but ``--speculative-config``, one after the other (the box has room for one): each
answers the verdict's greedy chats (the profile's prompt set, judged as the offline path is
judged) and the bench set's chats by category (acceptance per MT-Bench category, the table EAGLE
papers print, from the server's ``/metrics`` before and after each category), then takes the
concurrency sweep from ``vllm bench serve`` (vLLM's benchmark client, run as a subprocess by
``bench_client``: the kit writes no load generator). Each sweep point is repeated; a point that
fails is recorded as failed and the others kept. On a GPU host the servers and the client run on
CPUs of their own: a small target's decode step is mostly host work, and a client that shares the
server's CPUs moves its figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from validate import contract, metrics, prompt_sets
from validate.e2e import engines, host_probe
from validate.e2e.serving import Server, server_args
from validate.metrics import Output
from validate.profiles import Profile

# What a sweep point reports, from ``vllm bench serve --save-result``'s JSON.
POINT_FIGURES = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "median_itl_ms",
                 "request_throughput", "completed", "duration", "spec_decode_acceptance_length",
                 "spec_decode_per_position_acceptance_rates")
CHAT_THREADS = 32  # concurrent greedy chats (batched by the server); the outputs do not depend on it
# A GPU host with fewer CPUs than this keeps one set for all (nothing to split).
MIN_CPUS_TO_SPLIT = 8

Phase = Callable[[str], contextlib.AbstractContextManager[Any]]


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the server counted between two ``/metrics`` reads (lists position by position)."""
    out: dict[str, Any] = {}
    for name, value in after.items():
        prev = before.get(name)
        if isinstance(value, list):
            prev = list(prev or [])
            prev += [0.0] * (len(value) - len(prev))
            out[name] = [a - b for a, b in zip(value, prev, strict=False)]
        else:
            out[name] = value - (prev or 0.0)
    return out


def greedy_chats(server: Server, chats: list[list[dict[str, Any]]], max_tokens: int,
                 top_logprobs: int) -> list[Output]:
    """Every chat's greedy answer, in the chats' order."""
    with ThreadPoolExecutor(CHAT_THREADS) as pool:
        return list(pool.map(lambda c: server.chat(c, max_tokens, top_logprobs), chats))


def bench_prompts(profile: Profile, fits: Callable[[str], bool]) -> tuple[list[prompt_sets.Prompt],
                                                                           list[str]]:
    """The bench set's prompts this run uses: all, or ``bench_prompts`` of them taken round the
    categories in the file's order (every category as evenly as the count allows); a prompt that
    does not fit the profile's context with its answer is left out and named. Returns (prompts,
    ids left out)."""
    every = prompt_sets.load(profile.bench_set)
    left_out = [p.id for p in every if not fits(p.text)]
    usable = [p for p in every if p.id not in left_out]
    if not profile.bench_prompts or profile.bench_prompts >= len(usable):
        return usable, left_out
    by_category: dict[str, list[prompt_sets.Prompt]] = {}
    for p in usable:
        by_category.setdefault(p.category, []).append(p)
    chosen: list[prompt_sets.Prompt] = []
    queues = [iter(ps) for ps in by_category.values()]
    while len(chosen) < profile.bench_prompts:
        for q in queues:
            if (p := next(q, None)) is not None and len(chosen) < profile.bench_prompts:
                chosen.append(p)
    order = {p.id: i for i, p in enumerate(usable)}
    return sorted(chosen, key=lambda p: order[p.id]), left_out


def fits_context(profile: Profile, target: str) -> Callable[[str], bool]:
    """Whether a user turn, in the target's chat template, leaves room for its answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    room = profile.max_model_len - max(profile.max_tokens, profile.bench_output_len)

    def fits(text: str) -> bool:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        return len(tok(chat, add_special_tokens=False)["input_ids"]) <= room
    return fits


def dataset_file(prompts: list[prompt_sets.Prompt], path: Path, lines: int = 0) -> Path:
    """The prompts as ``vllm bench serve``'s custom dataset (one ``{"prompt": ...}`` a line),
    repeated in their order up to ``lines`` lines where more are asked for than the set has (a
    point takes the file's first N lines: ``--disable-shuffle``; vLLM's own oversampling would
    draw at random, some prompts more often than others)."""
    rows = [json.dumps({"prompt": p.text}) + "\n" for p in prompts]
    path.write_text("".join(rows[i % len(rows)] for i in range(max(lines, len(rows)))))
    return path


@dataclass(frozen=True)
class Load:
    """What ``vllm bench serve`` sends at each concurrency of a sweep, and where it runs."""

    dataset: Path
    output_len: int
    requests: dict[int, int]  # concurrency -> requests a point
    warmups: dict[int, int]  # concurrency -> warm-up requests before it
    repeats: int
    cpus: CpuSplit | None = None

    @property
    def concurrency(self) -> tuple[int, ...]:
        return tuple(self.requests)


def load_for(profile: Profile, prompts: list[prompt_sets.Prompt], concurrency: tuple[int, ...],
             repeats: int, folder: Path, cpus: CpuSplit | None = None) -> Load:
    """The sweep's load: the set once a point, or at least ``bench_min_waves`` waves of requests
    at each concurrency after one wave of warm-up (``Profile.bench_min_waves`` says why)."""
    waves = profile.bench_min_waves
    requests = {c: max(len(prompts), c * waves) for c in concurrency}
    dataset = dataset_file(prompts, folder / f"{profile.bench_set}.jsonl", max(requests.values()))
    return Load(dataset, profile.bench_output_len, requests,
                {c: c if waves else 1 for c in concurrency}, repeats, cpus)


class CpuSplit(NamedTuple):
    """A GPU host's CPUs for the bench: the servers', the client's, and the host probe's (one
    CPU, or None where the client's share is too small to give one up)."""

    servers: frozenset[int]
    client: frozenset[int]
    probe: int | None


def cpu_split(profile: Profile, available: set[int] | None = None) -> CpuSplit | None:
    """The CPUs of a GPU host with CPUs to spare: the client gets the last quarter (at least 2),
    the last of them going to the host probe where the quarter has 3 or more, the servers the
    rest; None on CPU profiles (the engine computes on every CPU there, and a probe beside it
    would time the engine, not the host) and on hosts with fewer than ``MIN_CPUS_TO_SPLIT``.
    ``available``: the CPUs this process may use (its affinity, by default)."""
    cpus = sorted(os.sched_getaffinity(0) if available is None else available)
    if profile.device != "cuda" or len(cpus) < MIN_CPUS_TO_SPLIT:
        return None
    k = max(2, len(cpus) // 4)
    probe = cpus[-1] if k >= 3 else None
    return CpuSplit(frozenset(cpus[:-k]), frozenset(cpus[-k:]) - {probe}, probe)


def bench_argv(url: str, model: str, dataset: Path, concurrency: int, num_prompts: int,
               output_len: int, result: Path, warmups: int = 1) -> list[str]:
    """``vllm bench serve``'s arguments for one sweep point: the chat endpoint (what Maverick's
    users call), the pinned prompts as they are (the server applies the chat template), greedy,
    every answer ``output_len`` tokens long (``--ignore-eos``: equal work for both servers)."""
    return ["--backend=openai-chat", "--endpoint=/v1/chat/completions", f"--base-url={url}",
            f"--model={model}", "--dataset-name=custom", f"--dataset-path={dataset}",
            "--skip-chat-template", "--disable-shuffle", f"--num-prompts={num_prompts}",
            f"--custom-output-len={output_len}", "--ignore-eos", "--temperature=0",
            f"--max-concurrency={concurrency}", f"--num-warmups={warmups}", "--seed=0",
            "--percentile-metrics=ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result",
            f"--result-dir={result.parent}", f"--result-filename={result.name}"]


def _point(concurrency: int, ending: dict[str, Any], result: Path, log: Path,
           probe: Path | None = None) -> dict[str, Any]:
    """One sweep point from the client's report of it and its result file: the figures, or
    ``failed`` with why; with the host probe's figures over the point's window where it ran."""
    point: dict[str, Any] = {"concurrency": concurrency, "wall_s": ending["wall_s"]}
    if ending.get("host_steal") is not None:  # the host's CPU time taken by other guests
        point["host_steal"] = ending["host_steal"]
    if probe is not None and "start" in ending:
        point.update(host_probe.window(probe, ending["start"], ending["end"]))
    if ending["error"] or not result.is_file():
        return {**point, "failed": f"vllm bench serve: {ending['error'] or 'no result file'} "
                                   f"(its output: {log})"}
    data = json.loads(result.read_text())
    figures = {k: data[k] for k in POINT_FIGURES if data.get(k) is not None}
    if not data.get("completed"):
        return {**point, **figures, "failed": "no request completed"}
    return {**point, **figures}


def sweep(server: Server, label: str, load: Load, folder: Path) -> list[dict[str, Any]]:
    """Every (concurrency, repeat) point against one server, through one ``bench_client``
    process, each said as it ends; points the client never reached (it died) are failed."""
    repeats = load.repeats
    plan = [(c, r, folder / f"{label}-c{c}-r{r}.json") for c in load.concurrency
            for r in range(1, repeats + 1)]
    log = folder / f"{label}.log"
    plan_file = folder / f"{label}-plan.json"
    plan_file.write_text(json.dumps({"log": str(log), "points": [
        bench_argv(server.url, server.model, load.dataset, c, load.requests[c], load.output_len,
                   result, load.warmups[c]) for c, _, result in plan]}))
    points: list[dict[str, Any]] = []
    cpus = load.cpus.client if load.cpus else None
    probe_file = probe_proc = None
    with open(log, "ab") as err:
        if load.cpus and load.cpus.probe is not None:
            probe_file, probe_cpu = folder / f"{label}-host-probe.txt", {load.cpus.probe}
            probe_proc = subprocess.Popen([sys.executable, "-m", "validate.e2e.host_probe",
                                           str(probe_file)], stderr=err,
                                          preexec_fn=lambda: os.sched_setaffinity(0, probe_cpu))
        proc = subprocess.Popen([sys.executable, "-m", "validate.e2e.bench_client",
                                 str(plan_file)], stdout=subprocess.PIPE, stderr=err, text=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus
                                else None)
    # A client that hangs is ended (an hour a point, as each point had when it was a process of
    # its own); the points it never reported are then recorded as failed.
    watchdog = threading.Timer(3600.0 * len(plan), proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for (c, r, result), line in zip(plan, proc.stdout, strict=False):
            point = {"server": label, "repeat": r,
                     **_point(c, json.loads(line), result, log, probe_file)}
            points.append(point)
            said = point.get("failed") or (f"{point['output_throughput']:.1f} output tok/s, "
                                           f"TPOT {point['median_tpot_ms']:.1f} ms")
            engines.log(f"bench {label}: concurrency {c}, repeat {r}/{repeats}: {said} "
                        f"({point['wall_s']:.0f} s)")
        code = proc.wait()
    finally:
        watchdog.cancel()
        for p in (proc, probe_proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    for c, r, _ in plan[len(points):]:
        points.append({"server": label, "repeat": r, "concurrency": c, "wall_s": 0.0,
                       "failed": f"the bench client exited {code} before this point (its "
                                 f"output: {log})"})
    return points


def _spread(values: list[float]) -> float:
    """(max - min) / median: the figure's spread over the repeats."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else 0.0


def summarize(points: list[dict[str, Any]], max_spread: float = 0.05) -> list[dict[str, Any]]:
    """Per concurrency: each server's medians and spreads over its repeats that completed, the
    speed-up (speculative / reference output tokens per second, and reference / speculative
    TPOT: per-user speed), and ``steady``: both servers' throughput spread within
    ``max_spread`` (else those figures and their speed-up hold only to within that
    spread)."""
    rows = []
    for c in sorted({p["concurrency"] for p in points}):
        row: dict[str, Any] = {"concurrency": c}
        for label in ("reference", "speculative"):
            ok = [p for p in points if p["concurrency"] == c and p["server"] == label
                  and "failed" not in p]
            row[label] = {"repeats": len(ok)}
            for fig in ("output_throughput", "median_tpot_ms", "median_ttft_ms", "probe_ms",
                        "sm_clock_mhz"):
                vals = [float(p[fig]) for p in ok if fig in p]
                if vals:
                    row[label][fig] = statistics.median(vals)
                    row[label][f"{fig}_spread"] = round(_spread(vals), 4)
        ref, spec = row["reference"], row["speculative"]
        if ref.get("output_throughput") and spec.get("output_throughput"):
            row["speedup"] = round(spec["output_throughput"] / ref["output_throughput"], 4)
        if ref.get("median_tpot_ms") and spec.get("median_tpot_ms"):
            row["tpot_speedup"] = round(ref["median_tpot_ms"] / spec["median_tpot_ms"], 4)
        spreads = [s.get("output_throughput_spread") for s in (ref, spec)]
        row["steady"] = None not in spreads and max(spreads) <= max_spread
        acc = [float(p["spec_decode_acceptance_length"]) for p in points
               if p["concurrency"] == c and p["server"] == "speculative"
               and p.get("spec_decode_acceptance_length") is not None]
        if acc:
            row["acceptance_length"] = round(statistics.median(acc), 4)
        per_pos = [p["spec_decode_per_position_acceptance_rates"] for p in points
                   if p["concurrency"] == c and p["server"] == "speculative"
                   and p.get("spec_decode_per_position_acceptance_rates")]
        if per_pos:
            row["per_position"] = [round(statistics.median(v), 4) for v in zip(*per_pos,
                                                                                strict=False)]
        rows.append(row)
    return rows


def _by_category(server: Server, prompts: list[prompt_sets.Prompt], profile: Profile
                 ) -> dict[str, dict[str, Any]]:
    """Acceptance per category of the bench set: greedy chats of one category at a time, the
    server's counters read before and after."""
    out = {}
    for category in dict.fromkeys(p.category for p in prompts):
        chats = [[{"role": "user", "content": p.text}] for p in prompts if p.category == category]
        before = server.metrics()
        greedy_chats(server, chats, profile.max_tokens, 1)
        acc = metrics.acceptance_from_counters(counter_delta(before, server.metrics()),
                                               profile.num_speculative_tokens)
        out[category] = {"prompts": len(chats),
                         "mean_acceptance_length": round(acc.mean_acceptance_length, 4),
                         "per_position_rate": [round(r, 4) for r in acc.per_position_rate]}
    return out


def run(profile: Profile, target: str, speculative: dict[str, Any],
        chats: list[list[dict[str, Any]]], run_dir: Path, phase: Phase,
        concurrency: tuple[int, ...], repeats: int
        ) -> tuple[list[Output], list[Output], dict[str, Any], dict[str, Any]]:
    """Both servers, one after the other: (reference outputs, speculative outputs, the
    speculative server's counters over the verdict's chats, the record's ``bench`` section)."""
    folder = run_dir / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    prompts, left_out = bench_prompts(profile, fits_context(profile, target))
    split = cpu_split(profile)
    load = load_for(profile, prompts, concurrency, repeats, folder, split)
    points: list[dict[str, Any]] = []
    outputs: dict[str, list[Output]] = {}
    counters: dict[str, Any] = {}
    categories: dict[str, Any] = {}
    for label, spec in (("reference", None), ("speculative", speculative)):
        args = server_args(profile, target, spec)
        with contextlib.ExitStack() as stack:  # the server stops on every ending
            with phase(f"{label}_server_start"):
                server = stack.enter_context(Server(args, folder / f"{label}-server.log", label,
                                                    cpus=split.servers if split else None))
            with phase(f"{label}_generation"):
                before = server.metrics()
                engines.log(f"{label} server: {len(chats)} greedy chats x {profile.max_tokens} "
                            "tokens (the verdict's)")
                outputs[label] = greedy_chats(server, chats, profile.max_tokens,
                                              profile.top_logprobs)
                if spec:
                    counters = counter_delta(before, server.metrics())
                    engines.log(f"{label} server: acceptance per {profile.bench_set} category")
                    categories = _by_category(server, prompts, profile)
            with phase(f"{label}_bench"):
                points += sweep(server, label, load, folder)
    section = {"set": profile.bench_set, "prompts": len(prompts), "left_out": left_out,
               "output_len": profile.bench_output_len, "concurrency": list(concurrency),
               "repeats": repeats,
               "requests": {str(c): n for c, n in load.requests.items()},
               "warmups": {str(c): n for c, n in load.warmups.items()},
               "cpus": {"servers": sorted(split.servers), "client": sorted(split.client),
                        "probe": split.probe} if split else None,
               "max_spread": profile.bench_max_spread,
               "client": "vllm bench serve (vllm.benchmarks.serve)",
               "server": "vllm.entrypoints.openai.api_server (what `vllm serve` runs)",
               "server_args": server_args(profile, "<target>", None),
               "speculative_config": speculative | {"model": "<draft>"},
               "points": points, "summary": summarize(points, profile.bench_max_spread),
               "categories": categories}
    return outputs["reference"], outputs["speculative"], counters, section


class NoFigures(contract.KitError):
    """Every sweep point of a server failed: the bench gave no figures (exit 4, the run broke);
    the record keeps each point's failure."""

    kind = contract.ErrorKind.BROKEN


def require_figures(section: dict[str, Any], folder: Path) -> None:
    """Raises ``NoFigures`` where a server has no sweep point that completed."""
    for label in ("reference", "speculative"):
        if not any(p["server"] == label and "failed" not in p for p in section["points"]):
            raise NoFigures(f"every sweep point of the {label} server failed (the first: "
                            f"{next(p['failed'] for p in section['points'] if p['server'] == label)}"
                            f"); `vllm bench serve`'s output: {folder / (label + '.log')}")
