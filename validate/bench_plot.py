"""The serving bench's plot: speed-up against concurrency (with the spread between repeats as
bars) beside the acceptance rate per draft position, written as ``bench.png`` in the run folder.

Host side (matplotlib, no vLLM): the host draws it from the record the engine side left, so a
run in the pinned image gets the same plot as one on the host.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

PLOT = "bench.png"


def _speedup_band(row: dict[str, Any]) -> tuple[float, float] | None:
    """The speed-up's low and high ends, from each server's median throughput and spread."""
    ref, spec = row["reference"], row["speculative"]
    if "speedup" not in row:
        return None
    r, s = ref["output_throughput"], spec["output_throughput"]
    r_spread, s_spread = ref.get("output_throughput_spread", 0), spec.get(
        "output_throughput_spread", 0)
    return (s * (1 - s_spread / 2)) / (r * (1 + r_spread / 2)), \
        (s * (1 + s_spread / 2)) / (r * (1 - r_spread / 2))


def write(run_dir: Path, bench: dict[str, Any]) -> str | None:
    """Draw the plot; returns its file name in ``run_dir`` (None where there is nothing to draw:
    no sweep point completed on both servers)."""
    rows = [r for r in bench["summary"] if "speedup" in r]
    if not rows:
        return None
    os.environ.setdefault("MPLBACKEND", "Agg")  # no display on a GPU host or in CI
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    xs = [r["concurrency"] for r in rows]
    ys = [r["speedup"] for r in rows]
    bands = [_speedup_band(r) for r in rows]
    # the medians' ratio is rounded in the record: a band of zero width must not come out negative
    low = [max(y - b[0], 0.0) for y, b in zip(ys, bands, strict=True) if b]
    high = [max(b[1] - y, 0.0) for y, b in zip(ys, bands, strict=True) if b]
    left.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=4, label="speculative / reference")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [str(x) for x in xs])
    left.set_xlabel("concurrency (vllm bench serve --max-concurrency)")
    left.set_ylabel("output tokens/s speed-up")
    left.set_title(f"{bench['set']}: speed-up (bars: spread of {bench['repeats']} repeats)")
    left.legend(loc="best")
    for r in rows:
        rates = r.get("per_position")
        if rates:
            right.plot(range(1, len(rates) + 1), rates, marker="o",
                       label=f"concurrency {r['concurrency']}")
    for name, c in (bench.get("categories") or {}).items():
        right.plot(range(1, len(c["per_position_rate"]) + 1), c["per_position_rate"],
                   linestyle=":", alpha=0.6, label=name)
    positions = len(rows[0].get("per_position") or []) or 1
    right.set_xticks(range(1, positions + 1))
    right.set_ylim(0, 1)
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance rate")
    right.set_title("acceptance per position")
    right.legend(fontsize=7, loc="best")
    tmp = run_dir / f".{PLOT}.tmp"
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, run_dir / PLOT)
    finally:
        plt.close(fig)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return PLOT

