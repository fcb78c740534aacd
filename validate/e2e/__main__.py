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
        contract.interrupt_because(signum, f"the kit that started this run (process {PARENT}) is "
                                   "gone (killed with SIGKILL, or it crashed): the run stops here")
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


def _signals_reach_the_main_thread() -> None:
    """Ctrl-C must reach the run's own code, which records it. Two things stood in its way:
    - The kernel delivers a process's signal to any of its threads, and Python runs the handler
      on the main thread only, once that thread runs Python again: a signal that lands on one of
      vLLM's threads while the main thread waits in a system call is not seen.
    - vLLM's ``zmq_socket_ctx`` catches KeyboardInterrupt (it logs it at debug level and goes on):
      at TP > 1, a Ctrl-C during an engine's start was swallowed there, and the main thread then
      waited up to VLLM_ENGINE_READY_TIMEOUT_S (600 s) for the engine core that the same Ctrl-C
      had ended (seen with py-spy and strace; the kit ended the script after its 60 s).
    Python's C-level handler writes each signal's number to the wakeup fd on whatever thread it
    lands. This thread reads it and aims the signal at the main thread until the handler has run
    (``contract.signalled``), then SIGINT once a second until the run's own code has the
    interruption (``contract.interrupt_pending``). The aimed signals write to the fd too: they
    are read and found handled."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    main = threading.main_thread().ident
    assert main is not None

    def forward() -> None:
        while got := os.read(read, 64):
            time.sleep(0.2)  # the main thread's own chance to run the handler
            if not contract.signalled() and callable(signal.getsignal(got[-1])):
                signal.pthread_kill(main, got[-1])
                time.sleep(0.2)
            while contract.interrupt_pending():
                signal.pthread_kill(main, signal.SIGINT)
                time.sleep(1.0)

    threading.Thread(target=forward, name="signal-forward", daemon=True).start()


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
    _signals_reach_the_main_thread()
    threading.Thread(target=_watch_the_kit, name="kit-watch", daemon=True).start()
    code = pytest.main([str(SCRIPT), "-p", "no:cacheprovider", "-s", "-q", *sys.argv[1:]])
    if os.getppid() != PARENT:
        _orphaned_workers_stop()
    sys.exit(code)
