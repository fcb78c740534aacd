"""The serving bench (validate/e2e/bench.py): what it reports and refuses without a server (fast
tier), and end to end through two real `vllm serve` processes and `vllm bench serve` (e2e)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from helpers import ROOT

from validate import contract, profiles, prompt_sets, record
from validate.e2e import bench, bench_client, host_probe, serving


def _point(server: str, c: int, repeat: int, tok_s: float, tpot: float, **extra) -> dict:
    return {"server": server, "concurrency": c, "repeat": repeat, "wall_s": 1.0,
            "output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": 20.0, **extra}


def test_the_summary_is_the_median_of_the_repeats_with_their_spread_and_the_speedup() -> None:
    points = [_point("reference", 4, r, v, 10.0) for r, v in ((1, 90.0), (2, 100.0), (3, 110.0))]
    points += [_point("speculative", 4, r, v, 5.0, spec_decode_acceptance_length=a,
                      spec_decode_per_position_acceptance_rates=[0.8, 0.6, 0.4])
               for r, v, a in ((1, 250.0, 2.7), (2, 200.0, 2.8), (3, 240.0, 2.9))]
    points.append({"server": "speculative", "concurrency": 4, "repeat": 4, "wall_s": 3.0,
                   "failed": "vllm bench serve exited 1"})
    [row] = bench.summarize(points)
    assert row["reference"]["output_throughput"] == 100.0, "the median, not the mean"
    assert row["reference"]["output_throughput_spread"] == 0.2, "(max - min) / median"
    assert row["speculative"]["repeats"] == 3, "a failed point is not a figure"
    assert row["speedup"] == 2.4 and row["tpot_speedup"] == 2.0, row
    assert row["acceptance_length"] == 2.8 and row["per_position"] == [0.8, 0.6, 0.4], row


def test_a_server_without_any_figure_breaks_the_run_naming_the_failure(tmp_path: Path) -> None:
    section = {"points": [_point("reference", 1, 1, 100.0, 5.0),
                          {"server": "speculative", "concurrency": 1, "repeat": 1, "wall_s": 1.0,
                           "failed": "vllm bench serve exited 1: ModuleNotFoundError pandas"}]}
    with pytest.raises(bench.NoFigures, match=r"every sweep point of the speculative server "
                       r"failed.*pandas") as err:
        bench.require_figures(section, tmp_path)
    assert contract.KIND_EXIT[err.value.kind] == contract.Exit.BROKEN
    bench.require_figures({"points": [*section["points"][:1],
                                      _point("speculative", 1, 1, 150.0, 4.0)]}, tmp_path)


def test_counters_between_two_reads_are_their_difference_position_by_position() -> None:
    before = {"vllm:spec_decode_num_drafts": 10.0,
              "vllm:spec_decode_num_accepted_tokens_per_pos": [5.0, 2.0]}
    after = {"vllm:spec_decode_num_drafts": 25.0,
             "vllm:spec_decode_num_accepted_tokens_per_pos": [12.0, 6.0, 1.0]}
    assert bench.counter_delta(before, after) == {
        "vllm:spec_decode_num_drafts": 15.0,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [7.0, 4.0, 1.0]}


def test_the_bench_prompts_go_round_the_categories_and_leave_out_what_cannot_fit() -> None:
    profile = profiles.get("tiny")
    every = prompt_sets.load("mt-bench")
    longest = max(every, key=lambda p: len(p.text))
    chosen, left_out = bench.bench_prompts(profile, lambda text: text != longest.text)
    assert left_out == [longest.id]
    assert len(chosen) == profile.bench_prompts == 16
    per_category = {c: sum(p.category == c for p in chosen) for c in {p.category for p in every}}
    assert set(per_category.values()) == {2}, per_category
    assert longest not in chosen
    everything, _ = bench.bench_prompts(profile.with_overrides(bench_prompts=0), lambda t: True)
    assert everything == every


def test_vllm_bench_serve_is_asked_for_greedy_fixed_length_answers_at_one_concurrency(
        tmp_path: Path) -> None:
    argv = bench.bench_argv("http://127.0.0.1:8000", "/models/t", tmp_path / "set.jsonl", 16, 80,
                            128, tmp_path / "r.json")
    for arg in ("--backend=openai-chat", "--dataset-name=custom", "--temperature=0",
                "--ignore-eos", "--max-concurrency=16", "--custom-output-len=128",
                "--num-prompts=80", "--skip-chat-template", "--save-result"):
        assert arg in argv, (arg, argv)


def test_a_gpu_sweep_point_sends_16_waves_after_one_wave_of_warm_up_and_the_cpu_one_the_set_once(
        tmp_path: Path) -> None:
    """Short points measure their own ramp-up and tail: on GPU profiles each point sends at least
    16 waves (the set repeated in its order, every prompt as often as the others), on the CPU
    rehearsal the set once (its CI minutes)."""
    prompts = [prompt_sets.Prompt(f"q{i}", "writing", f"question {i}") for i in range(78)]
    gpu = bench.load_for(profiles.get("tiny-cuda"), prompts, (1, 4, 16, 64), 3, tmp_path)
    assert gpu.requests == {1: 78, 4: 78, 16: 256, 64: 1024}, gpu.requests
    assert gpu.warmups == {1: 1, 4: 4, 16: 16, 64: 64}, gpu.warmups
    lines = [json.loads(line)["prompt"] for line in gpu.dataset.read_text().splitlines()]
    assert len(lines) == 1024 and lines[:78] == lines[78:156] == [p.text for p in prompts]
    cpu = bench.load_for(profiles.get("tiny"), prompts[:16], (1, 4), 3, tmp_path)
    assert (cpu.requests, cpu.warmups) == ({1: 16, 4: 16}, {1: 1, 4: 1})
    assert len(cpu.dataset.read_text().splitlines()) == 16
    argv = bench.bench_argv("http://127.0.0.1:8000", "/m", gpu.dataset, 64, 1024, 128,
                            tmp_path / "r.json", 64)
    assert {"--num-prompts=1024", "--num-warmups=64", "--disable-shuffle"} <= set(argv), argv


def test_on_a_gpu_host_the_servers_the_client_and_the_host_probe_get_cpus_of_their_own() -> None:
    cuda, cpu = profiles.get("tiny-cuda"), profiles.get("tiny")
    assert bench.cpu_split(cuda, set(range(16))) == (frozenset(range(12)), frozenset(range(12, 15)),
                                                     15)
    assert bench.cpu_split(cuda, set(range(8))) == (frozenset(range(6)), frozenset({6, 7}), None)
    assert bench.cpu_split(cuda, set(range(4))) is None  # too few to split
    assert bench.cpu_split(cpu, set(range(64))) is None  # the CPU engine computes on all


def test_a_server_started_on_given_cpus_runs_on_them_only() -> None:
    """What the server's process does before vLLM starts (``serving._before_exec``), run for
    real in a child: its CPU affinity is the set given (vLLM's engine core inherits it)."""
    one = frozenset({min(os.sched_getaffinity(0))})
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         preexec_fn=serving._before_exec(one), capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == str(sorted(one)), out


def test_a_point_whose_repeats_spread_more_than_the_profile_allows_is_shown_as_noise_bound() -> None:
    points = [_point("reference", 1, r, v, 5.0) for r, v in ((1, 100.0), (2, 104.0), (3, 101.0))]
    points += [_point("speculative", 1, r, v, 4.0) for r, v in ((1, 150.0), (2, 151.0), (3, 150.0))]
    points += [_point("reference", 4, r, v, 5.0) for r, v in ((1, 300.0), (2, 330.0), (3, 310.0))]
    points += [_point("speculative", 4, r, v, 4.0) for r, v in ((1, 400.0), (2, 401.0), (3, 400.0))]
    rows = bench.summarize(points, max_spread=0.05)
    assert [row["steady"] for row in rows] == [True, False], rows
    text = "\n".join(record.bench_md({**SECTION, "points": points, "summary": rows,
                                      "max_spread": 0.05}))
    assert "spread above 5% between repeats at concurrency 4: those figures" in text, text


def test_the_host_probe_times_its_work_and_each_point_reads_its_own_window(tmp_path: Path) -> None:
    """The probe for real (a process of its own, as on a GPU host, ended with SIGTERM), then a
    point's figures from the samples inside its window only."""
    samples = tmp_path / "probe.txt"
    probe = subprocess.Popen([sys.executable, "-m", "validate.e2e.host_probe", str(samples)])
    try:
        deadline = time.monotonic() + 60
        while len(samples.read_text().splitlines() if samples.exists() else []) < 3:
            assert probe.poll() is None and time.monotonic() < deadline, "the probe wrote nothing"
            time.sleep(0.1)
    finally:
        probe.terminate()
        assert probe.wait(timeout=30) == 0, "SIGTERM ends the probe cleanly"
    at, work_ms, clock = samples.read_text().splitlines()[0].split()
    assert float(at) > 0 and float(work_ms) > 0, "epoch seconds and the work's milliseconds"
    assert clock == "-", "no card here: the host's pace alone"
    (tmp_path / "w.txt").write_text("10.0 2.0 1980\n11.0 4.0 1755\n12.0 3.0 1980\n20.0 9.0 900\n21.0 9")
    window = host_probe.window(tmp_path / "w.txt", 10.0, 12.5)
    assert window == {"probe_ms": 3.0, "sm_clock_mhz": 1980.0}, "medians of the window's samples"
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"output_throughput": 100.0, "completed": 4}))
    point = bench._point(1, {"wall_s": 2.5, "start": 19.5, "end": 22.0, "error": None}, result,
                         tmp_path / "log", tmp_path / "w.txt")
    assert point["probe_ms"] == 9.0 and point["sm_clock_mhz"] == 900.0, "a cut line is skipped"


def test_a_noisy_point_says_whether_the_host_moved_with_it() -> None:
    points = [_point("reference", 4, r, v, 5.0, probe_ms=p)
              for r, v, p in ((1, 300.0, 2.0), (2, 330.0, 2.2), (3, 310.0, 2.1))]
    points += [_point("speculative", 4, r, v, 4.0, probe_ms=2.0) for r, v in ((1, 400.0), (2, 401.0))]
    rows = bench.summarize(points, max_spread=0.05)
    text = "\n".join(record.bench_md({**SECTION, "points": points, "summary": rows}))
    assert "at 4: reference throughput 10% apart, the host's pace 10%; speculative throughput 0% " \
           "apart, the host's pace 0%" in text, text


def test_the_client_reports_the_share_of_cpu_time_the_host_stole() -> None:
    assert bench_client.steal_share((10, 1000), (30, 2000)) == 0.02
    assert bench_client.steal_share(None, (30, 2000)) is None
    now = bench_client.cpu_times()
    assert now is not None and 0 <= now[0] <= now[1], now


def _record(bench_section: dict) -> dict:
    return {"schema_version": contract.RECORD_SCHEMA_VERSION, "name": "tiny-tp2",
            "status": "passed", "started_at": "now", "profile": {}, "environment": {},
            "phases": {}, "bench": bench_section}


SECTION = {"set": "mt-bench", "prompts": 16, "output_len": 32, "concurrency": [1], "repeats": 1,
           "points": [_point("reference", 1, 1, 100.0, 5.0), _point("speculative", 1, 1, 150.0,
                                                                    4.0)],
           "summary": [], "categories": {"writing": {"prompts": 2, "mean_acceptance_length": 2.5,
                                                     "per_position_rate": [0.7, 0.5, 0.3]}}}


@pytest.mark.e2e  # vLLM's client, not an engine, but 20 s: kept out of the fast tier
def test_every_sweep_point_runs_in_one_client_and_a_failed_one_is_kept_as_failed(
        tmp_path: Path) -> None:
    """vLLM's client, imported once for a server's sweep: a point that fails (here, a model that
    is not there, so no tokenizer) is recorded with why, and the next point still runs."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")
    server = types.SimpleNamespace(url="http://127.0.0.1:9", model=str(tmp_path / "no-model"))
    dataset = bench.dataset_file([prompt_sets.Prompt("q", "writing", "Hello")], tmp_path / "d.jsonl")
    load = bench.Load(dataset, 8, {1: 1, 4: 1}, {1: 1, 4: 1}, 1)
    points = bench.sweep(server, "reference", load, tmp_path)
    assert [(p["concurrency"], p["repeat"]) for p in points] == [(1, 1), (4, 1)], points
    assert all("no-model" in p["failed"] for p in points), points
    log = (tmp_path / "reference.log").read_text()
    assert log.count("$ vllm bench serve") == 2, log[-2000:]


def test_a_record_with_a_damaged_bench_section_is_refused() -> None:
    contract.check_record(_record(SECTION))
    for damage in ({"points": "many"}, {"points": [{"server": "reference"}]},
                   {"points": [{**SECTION["points"][0], "output_throughput": None}]}):
        with pytest.raises(contract.BadRecord, match="bench"):
            contract.check_record(_record({**SECTION, **damage}))


def test_the_summary_shows_the_sweep_the_categories_and_each_failed_point() -> None:
    section = {**SECTION, "summary": bench.summarize(SECTION["points"]), "plot": "bench.png",
               "points": SECTION["points"] + [{"server": "speculative", "concurrency": 1,
                                               "repeat": 2, "wall_s": 1.0,
                                               "failed": "no request completed"}]}
    text = "\n".join(record.bench_md(section))
    assert "| 1 | 100.0 ±0% | 150.0 ±0% | 1.5x |" in text, text
    assert "| writing | 2 | 2.50 | 0.70, 0.50, 0.30 |" in text, text
    assert "failed point: speculative at concurrency 1, repeat 2: no request completed" in text
    assert "![speed-up and acceptance](bench.png)" in text


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "validate", "bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(("args", "said"), [
    (("--profile", "tiny-compiled"), "names no bench_set"),
    (("--concurrency", "1,zero"), "--concurrency 1,zero"),
    (("--repeats", "0"), "--repeats 0"),
    (("--reference", "golden"), "drop --full, --reference golden"),
])
def test_a_bench_that_cannot_run_is_refused_before_any_server_starts(
        args: tuple[str, ...], said: str, tmp_path: Path) -> None:
    r = _cli(*args, "--run-dir", str(tmp_path / "run"))
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and said in out, (r.returncode, out[-1500:])
    assert not (tmp_path / "run").exists(), "refused before a run folder"


# --------------------------------------------------------------------------------------------
# end to end: two real `vllm serve` processes of vLLM's CPU build and `vllm bench serve`


def _servers_left(job: str | None = None) -> list[str]:
    """vLLM servers (and their engine processes) still running on this machine: those of the
    suite-wide run ``job`` (tests/conftest.py marks its processes), else any."""
    import psutil

    left = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "vllm.entrypoints.openai.api_server" in cmd and proc.info["status"] != "zombie":
            with contextlib.suppress(psutil.Error):
                if job is None or proc.environ().get("KIT_TEST_JOB") == job:
                    left.append(cmd[:200])
    return left


def _bench(run: Path, *extra: str) -> tuple[int, dict, str]:
    """`python -m validate bench --profile tiny ...` as README gives it: (exit, record, output)."""
    r = subprocess.run([sys.executable, "-m", "validate", "bench", "--profile", "tiny",
                        "--run-dir", str(run), *extra], cwd=ROOT, capture_output=True, text=True,
                       timeout=3600, check=False)
    assert (run / "record.json").is_file(), (r.stdout + r.stderr)[-4000:]
    return r.returncode, json.loads((run / "record.json").read_text()), r.stdout + r.stderr


def _check_bench_run(code: int, rec: dict, out: str, run: Path, tp: int,
                     concurrency: tuple[int, ...] = (1, 4), job: str | None = None,
                     repeats: int = 3) -> None:
    assert code == 0 and rec["status"] == "passed", (code, rec.get("verdict"), out[-3000:])
    contract.check_record(rec)
    assert rec["path"] == "serving" and rec["profile"]["tensor_parallel_size"] == tp
    b = rec["bench"]
    assert b["concurrency"] == list(concurrency) and b["repeats"] == repeats, b["concurrency"]
    done = [p for p in b["points"] if "failed" not in p]
    assert len(done) == 2 * len(concurrency) * repeats, [p.get("failed") for p in b["points"]]
    assert {p["server"] for p in done} == {"reference", "speculative"}
    assert all(p["output_throughput"] > 0 and p["median_tpot_ms"] > 0 for p in done)
    spec = [p for p in done if p["server"] == "speculative"]
    assert all(p["spec_decode_acceptance_length"] >= 1.0 for p in spec), spec
    assert all(len(p["spec_decode_per_position_acceptance_rates"]) == 3 for p in spec)
    assert [row["concurrency"] for row in b["summary"]] == list(concurrency)
    assert all(row["speedup"] > 0 for row in b["summary"]), b["summary"]
    assert len(b["categories"]) == 8, "acceptance for every MT-Bench category"
    # the verdict of the serving path: the servers' greedy chats, judged as the offline path's
    assert rec["comparison"]["total"] == rec["profile"]["num_prompts"]
    assert rec["acceptance"]["drafts"] > 0 and rec["counter_check"]
    summary = (run / "summary.md").read_text()
    assert "## Serving bench" in summary and "| 4 |" in summary, summary
    assert (run / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and b["plot"] == "bench.png"
    for phase in ("reference_server_start", "reference_bench", "speculative_server_start",
                  "speculative_generation", "speculative_bench"):
        assert rec["phases"][phase]["status"] == "ok", rec["phases"]
    assert not _servers_left(job), _servers_left(job)


@pytest.mark.e2e
def test_the_bench_at_tp2_serves_both_models_sweeps_and_passes(bench_tp2) -> None:
    """The CI tier's bench (tests/conftest.py runs it beside the other tests: 10 of the 100
    verdict prompts, concurrency 4, 2 repeats)."""
    code, rec, out, run = bench_tp2
    _check_bench_run(code, rec, out, run, 2, (4,), job="bench_tp2", repeats=2)


@pytest.mark.e2e
@pytest.mark.full
def test_the_bench_at_tp8_serves_both_models_sweeps_and_passes(pair, tmp_path: Path) -> None:
    run = tmp_path / "bench-tp8"
    _check_bench_run(*_bench(run, "--tp", "8"), run, 8)


@pytest.mark.e2e
@pytest.mark.full  # a second case of the serving path (CI runs it once, the TP=2 bench); the CI
# tier's breakages of every class are judged on the offline path by the same verdict code
def test_a_head_breakage_fails_on_the_serving_path_too(pair, tmp_path: Path) -> None:
    """The head fed [hidden state, embedding] instead of [embedding, hidden state]: the servers'
    greedy outputs still match (lossless), the drafts are never accepted."""
    patch = ROOT / "validate" / "data" / "breakages" / "head-input-order.patch"
    code, rec, out = _bench(tmp_path / "broken", "--tp", "1", "--num-prompts", "10",
                            "--concurrency", "4", "--repeats", "1", "--vllm-patch", str(patch))
    assert code == 1 and rec["status"] == "failed", (code, out[-3000:])
    assert rec["path"] == "serving" and rec["vllm_under_test"]["kind"] == "patch"
    assert any("acceptance" in r for r in rec["verdict"]["reasons"]), rec["verdict"]
    assert rec["acceptance"]["mean_acceptance_length"] < 1.5, rec["acceptance"]
    assert not _servers_left(), _servers_left()
