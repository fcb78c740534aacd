"""Where a command's CPU time goes, by what each process was doing: the CI tier's budget on 2 cores.

    python3 benchmarks/cpu_by_process.py --out cpu.txt -- bash .ci/run

Runs the command and samples every process on the machine once a second (utime + stime from
/proc), then prints CPU-seconds by category: a suite-wide test run (``KIT_TEST_JOB`` in the
process's environment), the test that started it (``PYTEST_CURRENT_TEST``, which the engines and
servers a test starts inherit), the tiny pair's generation, Docker's processes, pip, or the
program's name. The CI tier is CPU-bound on 2 cores (about 98% busy): its wall time is this total
over two, so this table says what a cut would save where the time table per test file cannot (the
suite-wide runs overlap the tests).

Hand-written on /proc (no psutil): it wraps `.ci/run` on a bare machine, before anything is
installed. Processes that live less than a second are missed (a few seconds in all). Below the
table, the cores busy minute by minute (the whole machine, from /proc/stat): where idle remains.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")


def category(pid: str) -> str | None:
    """What a process is part of, from its environment and command line (None: it is gone)."""
    try:
        raw_env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    env = dict(e.split(b"=", 1) for e in raw_env if b"=" in e)
    if b"KIT_TEST_JOB" in env:
        return "suite-wide run: " + env[b"KIT_TEST_JOB"].decode()
    if "validate.synth" in cmd:
        return "the tiny pair's generation"
    if b"PYTEST_CURRENT_TEST" in env:
        test = env[b"PYTEST_CURRENT_TEST"].decode().split("::")[0]
        if test.endswith("e2e/test_llama4_eagle_tp8.py"):  # the end-to-end script's own session
            where = "in a container" if test.startswith("opt/") else "on the host"
            return f"end-to-end runs {where} (engines, workers)"
        return "test: " + test
    program = os.path.basename(cmd.split(" ")[0]) if cmd else ""
    if program in ("dockerd", "containerd", "containerd-shim-runc-v2", "runc", "docker-untar",
                   "docker-proxy", "docker-registry"):
        return "docker: " + program
    if " pip " in f" {cmd} " or "/pip " in cmd or cmd.startswith("pip"):
        return "pip"
    return "other: " + (program or "?")[:24]


def sample(seen: dict[tuple[str, str], list]) -> None:
    """One pass over /proc: each process's CPU so far, keyed by (pid, start time)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / HZ
        key = (pid, fields[19])
        if key in seen:
            seen[key][0] = cpu
            if seen[key][1].startswith("other: "):  # a spawned child before its exec: look again
                seen[key][1] = category(pid) or seen[key][1]
        else:
            what = category(pid)
            if what is not None:
                seen[key] = [cpu, what]


def busy_jiffies() -> int:
    """The machine's busy CPU time so far (/proc/stat: all but idle and iowait), in ticks."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def timeline(minutes: list[float]) -> str:
    """Cores busy per minute: where the run leaves CPU idle (a wait that nothing overlaps)."""
    lines = ["", f"cores busy per minute (of {os.cpu_count() or 1}):"]
    for i in range(0, len(minutes), 10):
        row = " ".join(f"{m:4.2f}" for m in minutes[i:i + 10])
        lines.append(f"{i:4d}-{min(i + 10, len(minutes)):<4d} {row}")
    return "\n".join(lines) + "\n"


def table(seen: dict[tuple[str, str], list], wall: float) -> str:
    totals: dict[str, float] = {}
    for cpu, what in seen.values():
        totals[what] = totals.get(what, 0.0) + cpu
    lines = [f"{s:8.1f}  {what}" for what, s in sorted(totals.items(), key=lambda kv: -kv[1])
             if s >= 0.5]
    total = sum(totals.values())
    lines.append(f"{total:8.1f}  CPU-seconds in all, over {wall:.0f} s of wall time "
                 f"({total / wall:.2f} cores busy on average of {os.cpu_count()})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where the table goes (also printed)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    seen: dict[tuple[str, str], list] = {}
    sample(seen)
    before = {key: cpu for key, (cpu, _) in seen.items()}  # what ran before it is not its cost
    started = time.monotonic()
    proc = subprocess.Popen(command)
    minutes: list[float] = []
    mark, mark_busy = started, busy_jiffies()
    try:
        while proc.poll() is None:
            sample(seen)
            time.sleep(1)
            if time.monotonic() - mark >= 60:
                busy, now = busy_jiffies(), time.monotonic()
                minutes.append((busy - mark_busy) / HZ / (now - mark))
                mark, mark_busy = now, busy
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
    for key, cpu in before.items():
        seen[key][0] -= cpu
    text = table(seen, time.monotonic() - started) + timeline(minutes)
    args.out.write_text(text)
    sys.stdout.write(text)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
