"""What the kit prints: the verdict panel, the preflight table, compare's and the sensitivity
suite's tables. Host side, rich only: every command's outcome is shown the same way, on stderr
(stdout stays free for what a command writes for a program, e.g. the pair's folder)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from validate import preflight
from validate.record import RunRecord

console = Console(stderr=True, highlight=False, soft_wrap=True)


def report(rec: RunRecord) -> None:
    """A run's verdict (or how it ended), its reasons, its phases and where its record is."""
    data = rec.data
    verdict = data.get("verdict") or {}
    word = verdict.get("result") or data["status"].upper()
    style = "green" if word == "PASS" else "red"
    if verdict.get("calibration"):
        word += f" ({verdict['calibration']})"
    body = [*verdict.get("reasons", [])]
    if data.get("error"):
        body.append(f"{data['error']['kind']}: {data['error']['message']}")
    phases = data.get("phases", {})
    if phases:
        body.append("phases: " + ", ".join(f"{k} {v.get('seconds', '?')}s" for k, v in phases.items()))
    body.append(f"record: {rec.dir}/record.json, summary: {rec.dir}/summary.md")
    console.print(Panel("\n".join(body), title=f"[bold {style}]{word}[/] {data['name']}",
                        border_style=style), soft_wrap=False)


def findings(rows: list[preflight.Finding]) -> None:
    table = Table(title="preflight", show_lines=False)
    for col in ("check", "result", "what was found", "how to fix"):
        table.add_column(col, overflow="fold")
    colors = {preflight.OK: "green", preflight.WARN: "yellow", preflight.FAIL: "red"}
    for f in rows:
        table.add_row(f.check, f"[{colors[f.status]}]{f.status.upper()}[/]", f.detail, f.fix)
    console.print(table)


def compare_table(report: dict[str, Any]) -> None:
    table = Table(title=f"compare: the release (baseline) and the change (candidate), TP="
                  f"{report['profile']['tensor_parallel_size']}")
    for col in ("figure", "baseline", "candidate", "delta", "tolerance", ""):
        table.add_column(col)
    for r in report["rows"]:
        table.add_row(r["what"], f"{r['baseline']:.3f}", f"{r['candidate']:.3f}",
                      f"{r['delta']:+.3f}", f"{r['tolerance']:.3f}", r["beyond"])
    for t in report["times"]:
        table.add_row(f"{t['phase']} (s)", str(t["baseline"]), str(t["candidate"]), "", "", "")
    console.print(table)
    style = {"REGRESSION": "bold red", "OK": "green", "IMPROVED": "bold green"}.get(
        report["verdict"], "bold red")
    console.print(f"[{style}]{report['verdict']}[/]: " + escape("; ".join(report["reasons"])))


def sensitivity_table(outcomes: list[Any], passed: bool) -> None:
    """``outcomes``: sensitivity.Outcome rows, the release first."""
    table = Table(title="sensitivity: every breakage must FAIL or ERROR; the release and the "
                  "controls PASS")
    for col in ("change", "class", "expected", "mean acceptance", "divergent", "hard", "verdict",
                "caught by", "seconds", "why"):
        table.add_column(col, overflow="fold")
    for o in outcomes:
        acc = "-" if o.mean_acceptance is None else f"{o.mean_acceptance:.3f}"
        table.add_row(o.name, o.kind or "-", "PASS" if o.expect == "pass" else "FAIL/ERROR", acc,
                      "-" if o.divergences is None else str(o.divergences),
                      "-" if o.hard is None else str(o.hard),
                      f"[{'green' if o.ok else 'bold red'}]{o.verdict}[/]", o.caught_by or "-",
                      f"{o.seconds:.0f}", escape(o.detail))
    console.print(table)
    wrong = [o.name for o in outcomes if not o.ok]
    if passed:
        console.print(f"[green]all {len(outcomes) - 1} changes judged as expected[/]")
    elif wrong:
        console.print(f"[bold red]not as expected[/]: {', '.join(wrong)}")
