"""``calibrate``: run a profile N times, each judged by floors only with a live reference (an old
golden must never shape a new one), and write its golden (``goldens.make``, stored compactly by
``goldens.write``). Host side."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from validate import goldens, profiles, real_run, rehearsal, request, ui
from validate.contract import Exit
from validate.ui import console


def calibrate(req: request.Run, runs: int, out: str | None) -> Exit:
    profile = req.profile
    flow = rehearsal.rehearse if profile.generated else real_run.validate
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    base = Path(req.run_dir or Path("runs") / f"calibrate-{profile.name}-"
                f"tp{profile.tensor_parallel_size}-{stamp}").absolute()
    records = []
    for i in range(1, runs + 1):
        console.print(f"[bold]calibration run {i} of {runs}[/]")
        rec, code = flow(req.but(run_dir=str(base / f"run-{i}"), golden="none", reference="live"))
        if code not in (Exit.PASS, Exit.FAIL):
            if rec is not None and not isinstance(rec, list):
                ui.report(rec)
            console.print(f"[bold red]error:[/] calibration run {i} ended with exit {code}; "
                          "no golden written")
            return code
        records.append(rec.data)
    try:
        golden = goldens.make(records, sigmas=profiles.calibration_sigmas())
    except ValueError as exc:
        console.print(f"[bold red]error:[/] no golden written: {exc}")
        return Exit.FAIL
    path = Path(out) if out else goldens.DIR / goldens.filename(
        profile.name, golden["device_class"], profile.tensor_parallel_size)
    goldens.write(path, golden)
    mal = golden["acceptance"]["mean_acceptance_length"]
    console.print(f"[green]golden written[/] {path}: mean acceptance length {mal['mean']:.3f} "
                  f"(sd over runs {mal['sd_runs']:.4f}, standard error {mal['standard_error']:.4f}, "
                  f"tolerance {mal['tolerance']:.3f}); per position " + ", ".join(
                      f"{p['mean']:.3f}-{p['tolerance']:.3f}"
                      for p in golden["acceptance"]["per_position_rate"])
                  + f"; divergence gaps {golden['divergence_gaps']}")
    return Exit.PASS
