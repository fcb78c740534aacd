"""The host's own pace during a serving bench: ``python -m validate.e2e.host_probe FILE``.

Engine side, started by ``bench.sweep`` on a CPU of its own (GPU hosts, beside the servers' and
the client's CPUs) and ended with its sweep (SIGTERM ends it cleanly too). A small target's decode
step is mostly host work (scheduler, sampler, detokenizer, HTTP), so where a point's repeats
differ, the question is whether the host changed pace (another guest on the same physical cores, a
lower clock) or vLLM did. The hypervisor's steal time does not answer it (a guest on the sibling
hyperthread, or a socket-wide clock change, steals nothing), so this process times the same piece
of pure-Python work (dict and integer operations, like the server's own per-step work) every
``PERIOD_S`` and reads the card's SM clock through NVML where there is a card. Each sample is one
line of FILE: ``epoch_s work_ms sm_mhz`` (``-`` where there is no card), appended and flushed, so
a sweep point reads the samples of its own window (``window``) while the probe goes on.
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PERIOD_S = 0.2
WORK_ITEMS = 20_000  # about 2-4 ms of work on a server CPU: 1-2% of the probe's own CPU


def work() -> None:
    """The fixed piece of work: the same operations every time, no allocation that grows."""
    table: dict[int, int] = {}
    for i in range(WORK_ITEMS):
        table[i % 1009] = table.get(i % 997, 0) + i


def _sm_clock() -> Any:
    """A function that reads GPU 0's SM clock in MHz, or None where NVML or a card is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no nvidia-ml-py, no driver, no card: the probe times the host alone
        return None
    return lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)


def main(path: str) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    clock = _sm_clock()
    with open(path, "a") as out:
        while True:
            started = time.perf_counter()
            work()
            took = (time.perf_counter() - started) * 1000
            out.write(f"{time.time():.3f} {took:.4f} {clock() if clock else '-'}\n")
            out.flush()
            time.sleep(max(0.0, PERIOD_S - took / 1000))


def window(path: Path, start: float, end: float) -> dict[str, float]:
    """The probe's figures over one window of epoch seconds: the median time of the work
    (``probe_ms``: higher is a slower host) and the median SM clock (``sm_clock_mhz``, where
    read); empty where the probe has no sample in the window."""
    work_ms, clocks = [], []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        fields = line.split()
        try:
            at, took = float(fields[0]), float(fields[1])
            clock = None if fields[2] == "-" else float(fields[2])
        except (IndexError, ValueError):
            continue  # a line the probe was still writing when this read it
        if start <= at <= end:
            work_ms.append(took)
            if clock is not None:
                clocks.append(clock)
    figures = {"probe_ms": round(statistics.median(work_ms), 3)} if work_ms else {}
    if clocks:
        figures["sm_clock_mhz"] = statistics.median(clocks)
    return figures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
