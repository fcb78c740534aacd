"""Where the offline engine runs: in the end-to-end script's own process only for one CPU rank.

On CPU at TP=1 the kit starts vLLM's uniprocess executor instead of an engine-core and a worker
process (validate/e2e/engines.py: half the time on 2 cores, the same outputs). Anything with
more than one rank, a GPU, another node or the serving path must keep vLLM's processes: the
multi-rank code paths are what the walkthrough and Maverick's run exercise."""

from __future__ import annotations

import os

import pytest

from validate import profiles
from validate.e2e import engines, serving

FLAG = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """prepare_process_env writes os.environ: a copy of it, so that nothing leaks into other tests."""
    copy = {k: v for k, v in os.environ.items() if k != FLAG}
    monkeypatch.setattr(os, "environ", copy)
    return copy


def test_only_one_cpu_rank_on_one_node_runs_in_the_scripts_process() -> None:
    tiny = profiles.get("tiny")
    assert engines.in_process(tiny.with_overrides(tensor_parallel_size=1))
    assert not engines.in_process(tiny), "TP=8 keeps its engine core and 8 workers"
    assert not engines.in_process(tiny.with_overrides(tensor_parallel_size=2))
    assert not engines.in_process(profiles.get("tiny-cuda")), "GPUs keep vLLM's processes"
    assert not engines.in_process(profiles.get("tiny-2node").with_overrides(tensor_parallel_size=1))


def test_the_offline_path_at_tp1_asks_vllm_for_no_processes_and_the_serving_path_does_not(
        environ: dict[str, str]) -> None:
    one = profiles.get("tiny").with_overrides(tensor_parallel_size=1)
    assert FLAG not in engines.prepare_process_env(one, serving=True) and FLAG not in environ
    assert engines.prepare_process_env(one)[FLAG] == "0" and environ[FLAG] == "0"
    assert FLAG not in engines.prepare_process_env(profiles.get("tiny").with_overrides(
        tensor_parallel_size=2))


def test_a_users_own_setting_is_kept(environ: dict[str, str]) -> None:
    environ[FLAG] = "1"
    one = profiles.get("tiny").with_overrides(tensor_parallel_size=1)
    assert FLAG not in engines.prepare_process_env(one) and environ[FLAG] == "1"


def test_a_cpu_engine_holds_the_same_kv_tokens_at_every_tp(environ: dict[str, str]) -> None:
    """1 GiB over the ranks: the walkthrough's TP=8 allocated 8 GiB (12 s of each engine start
    on 2 cores) where TP=1's 1 GiB holds every prompt at full length; GPUs size their own."""
    environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # this machine's own setting would win
    tiny = profiles.get("tiny")
    per_rank = {tp: serving.cpu_kv_cache_bytes(tiny.with_overrides(tensor_parallel_size=tp))
                for tp in (1, 2, 8)}
    assert per_rank == {1: 1 << 30, 2: 1 << 29, 8: 1 << 27}, per_rank
    two_stages = profiles.get("tiny-2node")
    assert serving.cpu_kv_cache_bytes(two_stages) == (1 << 30) // (
        two_stages.tensor_parallel_size * two_stages.pipeline_parallel_size)
    assert serving.cpu_kv_cache_bytes(profiles.get("tiny-cuda")) is None
    assert f"--kv-cache-memory-bytes={1 << 27}" in serving.server_args(tiny, "m", None), \
        "the serving bench's servers hold what the offline engines hold"
    environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
    assert serving.cpu_kv_cache_bytes(tiny) is None, "a user's own setting is vLLM's to apply"
