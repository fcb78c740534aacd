"""``python -m validate.e2e [options]``: the end-to-end script wherever the kit is installed (inside
an image the file lives in site-packages). Options as in test_llama4_eagle_tp8.py's header.

SIGTERM (``docker stop``, a CI cancel reaching the container) is turned into KeyboardInterrupt, so
the script records the run as interrupted and shuts its engine's workers down, as on Ctrl-C; and
SIGINT is handled even where it was inherited as ignored (a job started in the background by a
non-interactive shell), so the host's forwarded Ctrl-C always reaches the script. And if the kit
that started it dies (SIGKILL, a crash), the script stops itself, recording why.
"""

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from validate import contract
from validate.contract import ErrorKind, Exit
from validate.record import RunRecord

SCRIPT = Path(__file__).with_name("test_llama4_eagle_tp8.py")


PARENT = os.getppid()
GRACE_S = 30  # for the script to record the interruption and stop its engine, once the kit is gone


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one would cut the cleanup
    if os.getppid() != PARENT:
        raise KeyboardInterrupt(f"the kit that started this run (process {PARENT}) is gone "
                                "(killed with SIGKILL, or it crashed): the run stops here")
    contract.interrupt(signum, frame)


def _orphaned_workers_stop() -> None:
    """With the kit gone nobody ends what is left of this run's process group: vLLM's workers of
    an engine that was still starting. Stop them before exiting (no process left behind)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def _watch_the_kit() -> None:
    """The kit runs this script in its own session (so a terminal's Ctrl-C, which the kit
    forwards, does not arrive twice); a kit killed with SIGKILL then left it running on, starting
    engines. This thread notices the kit is gone and interrupts the main thread with a signal
    aimed at it (a process-wide signal may land on one of vLLM's threads and leave the main
    thread blocked); if the script has not ended within GRACE_S, it ends it (the next run's
    record then says this one was cut off)."""
    while os.getppid() == PARENT:
        time.sleep(0.5)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    time.sleep(GRACE_S)
    # Still here: the main thread is blocked where no signal reaches Python (vLLM waiting for its
    # engine processes at TP > 1 was seen to be such a place). End the record, then everything.
    _end_record(f"the kit that started this run (process {PARENT}) is gone (killed with SIGKILL, "
                f"or it crashed), and the script did not stop within {GRACE_S} s: ended")
    _orphaned_workers_stop()
    os._exit(int(Exit.INTERRUPTED))


def _end_record(message: str) -> None:
    """End this run's record as interrupted, if it is still running (the run folder from argv)."""
    argv = sys.argv[1:]
    if "--run-dir" not in argv or argv.index("--run-dir") + 1 >= len(argv):
        return
    with contextlib.suppress(Exception):  # best effort: the next run marks a run left running
        rec = RunRecord.load(Path(argv[argv.index("--run-dir") + 1]))
        if rec.data["status"] == "running":
            rec.end(ErrorKind.INTERRUPTED, message, where=rec.where())


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, contract.interrupt)
    threading.Thread(target=_watch_the_kit, name="kit-watch", daemon=True).start()
    code = pytest.main([str(SCRIPT), "-p", "no:cacheprovider", "-s", "-q", *sys.argv[1:]])
    if os.getppid() != PARENT:
        _orphaned_workers_stop()
    sys.exit(code)
