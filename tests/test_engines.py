"""Where the offline engine runs: in the end-to-end script's own process only for one CPU rank.

On CPU at TP=1 the kit starts vLLM's uniprocess executor instead of an engine-core and a worker
process (validate/e2e/engines.py: half the time on 2 cores, the same outputs). Anything with
more than one rank, a GPU, another node or the serving path must keep vLLM's processes: the
multi-rank code paths are what the walkthrough and Maverick's run exercise."""

from __future__ import annotations

import os

import pytest

from validate import profiles
from validate.e2e import engines

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

