"""Time-to-verdict of the CPU rehearsal, with its phase breakdown (prints figures; asserts nothing).

    nox -s bench_rehearsal            # or, in an environment with vLLM's CPU build:
    python benchmarks/time_to_verdict.py --tp 8

The tiny pair is generated first (untimed: it is cached across runs). Then one rehearsal runs as a
user runs it (`python -m validate rehearse`) and the wall time is split into the record's phases;
what no phase covers is process start-up, imports and pytest. Baseline, measured in the same run:
a bare `python -c "import vllm"`, the fixed cost every engine process pays.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str]) -> tuple[float, int]:
    t = time.monotonic()
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode
    return time.monotonic() - t, rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--head", default=None, choices=["trained", "random"])
    args = ap.parse_args()

    subprocess.run([sys.executable, "-m", "validate.synth"], stdout=subprocess.DEVNULL, check=True)
    import_s, _ = timed([sys.executable, "-c", "import vllm"])
    run = Path(tempfile.mkdtemp(prefix="bench-rehearsal-")) / "run"
    cmd = [sys.executable, "-m", "validate", "rehearse", "--tp", str(args.tp), "--run-dir", str(run)]
    if args.head:
        cmd += ["--head", args.head]
    total_s, rc = timed(cmd)
    rec = json.loads((run / "record.json").read_text())
    phases = {k: v.get("seconds", 0.0) for k, v in rec["phases"].items()}
    other = total_s - sum(phases.values())

    print(f"time-to-verdict, rehearse_tp8 (tiny pair, TP={args.tp}, "
          f"{rec['profile']['num_prompts']} prompts x {rec['profile']['max_tokens']} tokens)")
    print(f"verdict {(rec.get('verdict') or {}).get('result', rec['status'])} (exit {rc}); "
          f"cpu: {rec['environment'].get('cpu')} x {rec['environment'].get('cpu_count')}")
    print(f"{'phase':<28}{'seconds':>10}{'share':>9}")
    for name, s in [*phases.items(), ("process start, imports, pytest", other)]:
        print(f"{name:<28}{s:>10.1f}{s / total_s:>9.1%}")
    print(f"{'total (wall)':<28}{total_s:>10.1f}{1:>9.0%}")
    engine_start = phases.get("reference_engine_start", 0) + phases.get("speculative_engine_start", 0)
    print(f"baseline `import vllm`: {import_s:.1f}s; total / baseline = {total_s / import_s:.1f}x; "
          f"engine starts are {engine_start / total_s:.0%} of the total")
    print("target: <= 240 s wall on a 2-core machine once the environments exist")
    print(f"record: {run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
