"""sha256 verification rate of `validate.hub.verify` against `sha256sum`, one process per file.

    nox -s bench_verify                # or: python benchmarks/verify_throughput.py --gib 2

Writes N shards of random data (2 GiB in all by default) into a temp folder, reads them once so
both contenders hash from the page cache, then times, alternately and twice each:
  - baseline: `sha256sum` on every file at once (one process per file, in parallel);
  - the kit: `hub.verify` on a fresh state (threads, hashlib);
and finally the kit's re-verification of the unchanged files (the fast path). Prints figures and
the ratio kit / baseline; asserts nothing. Targets: ratio >= 0.80, re-verification <= 1 s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="total size of the shards")
    ap.add_argument("--shards", type=int, default=8)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    os.environ["VALIDATE_CACHE"] = str(root / "state")
    from validate import hub

    try:
        size = int(args.gib * 2**30) // args.shards
        lock = hub.RepoLock(revision="0" * 40)
        block = os.urandom(16 << 20)
        for i in range(args.shards):
            name = f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"
            h = hashlib.sha256()
            with open(root / name, "wb") as f:
                left = size
                while left:
                    chunk = block[: min(left, len(block))]
                    chunk = bytes([i]) + chunk[1:]  # shards differ
                    f.write(chunk)
                    h.update(chunk)
                    left -= len(chunk)
            lock.files[name] = {"size": size, "sha256": h.hexdigest()}
        files = [str(root / n) for n in lock.files]
        for p in files:  # page cache: both read from memory
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
        total = size * args.shards

        def baseline() -> float:
            t = time.monotonic()
            procs = [subprocess.Popen(["sha256sum", p], stdout=subprocess.DEVNULL) for p in files]
            assert all(p.wait() == 0 for p in procs)
            return time.monotonic() - t

        def kit() -> float:
            state = hub._state_path("bench/shards", lock.revision)
            state.unlink(missing_ok=True)
            t = time.monotonic()
            problems = hub.verify("bench/shards", root, lock)
            assert not problems, problems
            return time.monotonic() - t

        runs = {"baseline": [], "kit": []}
        for _ in range(2):
            runs["baseline"].append(baseline())
            runs["kit"].append(kit())
        t = time.monotonic()
        assert not hub.verify("bench/shards", root, lock)
        again = time.monotonic() - t

        b, k = min(runs["baseline"]), min(runs["kit"])
        gib = total / 2**30
        print(f"verify {gib:.2f} GiB in {args.shards} shards on {os.cpu_count()} cores (best of 2)")
        print(f"  sha256sum, one process per file: {b:6.2f} s  {gib / b:6.2f} GiB/s")
        print(f"  validate.hub.verify:             {k:6.2f} s  {gib / k:6.2f} GiB/s")
        print(f"  ratio kit / sha256sum: {b / k:.2f} (target >= 0.80)")
        print(f"  re-verification of unchanged files: {again:.3f} s (target <= 1 s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
