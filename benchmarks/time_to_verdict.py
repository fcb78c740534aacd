"""Time-to-verdict of the CPU rehearsal, two engines against one (prints figures; asserts nothing).

    nox -s bench_rehearsal            # or, in an environment with vLLM's CPU build:
    python benchmarks/time_to_verdict.py --tp 8

The tiny pair is generated first (untimed: it is cached across runs). Then, as a user runs them
(`python -m validate rehearse`), in the same benchmark run:

1. the two-engine rehearsal (`--reference live`: reference engine + speculative engine);
2. the one-engine rehearsal (`--reference golden`): a golden made from run 1's record supplies the
   reference outputs, so only the speculative engine starts.

Each wall time is split into the record's phases; what no phase covers is process start-up,
imports and pytest. Baseline, measured in the same run: a bare `python -c "import vllm"`, the fixed
cost every engine process pays. Ratio: one-engine time / two-engine time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from validate import goldens, profiles


def timed(cmd: list[str]) -> tuple[float, int]:
    t = time.monotonic()
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode
    return time.monotonic() - t, rc


def rehearsal(args: argparse.Namespace, run: Path, *extra: str) -> tuple[float, int, dict]:
    cmd = [sys.executable, "-m", "validate", "rehearse", "--tp", str(args.tp), "--run-dir", str(run),
           *extra]
    if args.head:
        cmd += ["--head", args.head]
    total_s, rc = timed(cmd)
    return total_s, rc, json.loads((run / "record.json").read_text())


def breakdown(title: str, total_s: float, rc: int, rec: dict) -> None:
    phases = {k: v.get("seconds", 0.0) for k, v in rec["phases"].items()}
    other = total_s - sum(phases.values())
    verdict = rec.get("verdict") or {}
    print(f"\n{title}: verdict {verdict.get('result', rec['status'])} "
          f"({verdict.get('calibration', '')}, exit {rc})")
    print(f"{'phase':<32}{'seconds':>10}{'share':>9}")
    for name, s in [*phases.items(), ("process start, imports, pytest", other)]:
        print(f"{name:<32}{s:>10.1f}{s / total_s:>9.1%}")
    print(f"{'total (wall)':<32}{total_s:>10.1f}{1:>9.0%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--head", default=None, choices=["trained", "random"])
    args = ap.parse_args()

    subprocess.run([sys.executable, "-m", "validate.synth"], stdout=subprocess.DEVNULL, check=True)
    import_s, _ = timed([sys.executable, "-c", "import vllm"])
    work = Path(tempfile.mkdtemp(prefix="bench-rehearsal-"))
    live_s, live_rc, live = rehearsal(args, work / "live")
    golden = work / "golden.json"
    goldens.write(golden, goldens.make([live], sigmas=profiles.calibration_sigmas()))
    one_s, one_rc, one = rehearsal(args, work / "golden-reference", "--golden", str(golden),
                                   "--reference", "golden")

    print(f"time-to-verdict, rehearse_tp8 (tiny pair, TP={args.tp}, "
          f"{live['profile']['num_prompts']} prompts x {live['profile']['max_tokens']} tokens); "
          f"cpu: {live['environment'].get('cpu')} x {live['environment'].get('cpu_count')}")
    breakdown("two engines (--reference live)", live_s, live_rc, live)
    breakdown("one engine (--reference golden)", one_s, one_rc, one)
    print(f"\nbaseline `import vllm`: {import_s:.1f}s")
    print(f"two engines {live_s:.1f}s = {live_s / import_s:.1f}x baseline; one engine {one_s:.1f}s "
          f"= {one_s / import_s:.1f}x baseline; one / two = {one_s / live_s:.2f}")
    print("target: <= 240 s wall for the two-engine run on a 2-core machine once the environments "
          "exist; the one-engine run about half of it")
    print(f"records: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
