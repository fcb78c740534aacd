"""vLLM's OpenAI server as the serving path starts it: real servers of vLLM's CPU build, on the
tiny pair (validate/e2e/serving.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (nox -s tests installs it)")

from validate import profiles
from validate.e2e import engines, serving

pytestmark = pytest.mark.e2e


def _gone(pgid: int) -> bool:
    """No process of the group is left running (zombies, dead and waiting for init to reap
    them, are not running)."""
    import psutil

    live = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                live.append(proc.pid)
    return not live


# The full tier until the serving bench (issue 24) runs a server in CI: one more server start
# (about 55 s) would take the CI tier past its 30 minutes (1762 s on 2026-12-04 without it).
@pytest.mark.full
def test_a_speculative_server_answers_greedy_chats_with_token_ids_and_leaves_nothing(
        pair, tmp_path: Path) -> None:
    profile = profiles.get("tiny").with_overrides(tensor_parallel_size=1)
    engines.prepare_process_env(profile)
    spec = {"method": "eagle", "model": str(pair.root / "head"), "num_speculative_tokens": 3}
    args = serving.server_args(profile, str(pair.root / "target"), spec)
    ref_args = serving.server_args(profile, str(pair.root / "target"), None)
    assert [a for a in args if a not in ref_args] == [a for a in args if "speculative" in a], \
        "the two servers differ only in the speculative config"
    with socket.socket() as taken:  # a port something else already listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        interrupted = False
        try:
            with serving.Server(args, tmp_path / "spec.log", "speculative", first_port=port) as s:
                assert s.port != port, "started again on another port"
                out = s.chat([{"role": "user", "content": "Tell me about the sea."}], 16, 2)
                counters = s.metrics()
                pgid = s.proc.pid
                signal.raise_signal(signal.SIGINT)  # Ctrl-C while it is up
        except KeyboardInterrupt:
            interrupted = True
    assert interrupted, "Ctrl-C reached the test"
    assert len(out.token_ids) == 16 and all(isinstance(t, int) for t in out.token_ids), out
    assert len(out.top) == 16 and all(len(p) == 2 for p in out.top), out.top
    assert out.top[0][0][0] == out.token_ids[0], "greedy: the first choice is the token taken"
    assert counters.get("vllm:spec_decode_num_drafts", 0) > 0, counters
    assert counters["vllm:spec_decode_num_draft_tokens"] == 3 * counters[
        "vllm:spec_decode_num_drafts"], counters
    assert len(counters["vllm:spec_decode_num_accepted_tokens_per_pos"]) == 3, counters
    assert _gone(pgid), "the server's process group outlived it"
    assert "address already in use" in (tmp_path / "spec.log").read_text().lower()


def test_a_server_that_cannot_start_breaks_the_run_with_its_log_tail(pair, tmp_path: Path) -> None:
    profile = profiles.get("tiny").with_overrides(tensor_parallel_size=1, dtype="float7")
    args = serving.server_args(profile, str(pair.root / "target"), None)
    with pytest.raises(serving.ServerDied) as err, \
            serving.Server(args, tmp_path / "bad.log", "reference"):
        pass
    said = str(err.value)
    assert "the reference server exited before it was healthy" in said and "float7" in said, said
    assert err.value.kind == "broken", "exit 4: the run broke"
