"""The run folder: ``record.json`` (machine-readable), ``junit.xml`` (for CI), ``summary.md`` (people).

Pure file writing, no vLLM, no network. The record is rewritten atomically after every phase, so a
run that is killed or fails halfway still leaves a complete, valid record of what ran, what failed
and why; ``junit.xml`` and ``summary.md`` are written whenever the run ends, however it ends.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from validate import contract
from validate.files import atomic_write, state_dir

RECORD = "record.json"
JUNIT = "junit.xml"
SUMMARY = "summary.md"
REPRODUCE = "REPRODUCE.md"
SCHEMA_VERSION = contract.RECORD_SCHEMA_VERSION


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


RESERVE = ".space-reserve"
RESERVE_BYTES = 512 << 10  # what a record without its bulky fields and its three reports need
BULKY = ("reference_outputs", "outputs", "raw_counters")  # dropped when the disk is full
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(contract.KitError):
    """No space left under the run folder: the run broke (exit 4), where it was is said."""

    kind = contract.ErrorKind.BROKEN

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


class RunRecord:
    """One run's folder. Create it first, fill it as the run goes, finish it once.

    A full disk must not cost the record: the folder keeps a reserve file from its creation, and a
    write that finds no space releases it, drops the record's bulky fields (outputs, reference
    outputs; the divergences and counters stay) and ends the run ``broken`` naming the phase."""

    def __init__(self, run_dir: Path, data: dict[str, Any]) -> None:
        self.dir = Path(run_dir)
        self.data = data
        self._lean = False  # True once the disk was found full: bulky fields stay out

    @classmethod
    def create(cls, run_dir: Path, *, profile: dict[str, Any], name: str,
               run_id: str | None = None) -> RunRecord:
        data = {
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id,
            "name": name,
            "status": "running",
            "started_at": _now(),
            "finished_at": None,
            "profile": profile,
            "environment": {},
            "phases": {},
            "comparison": None,
            "acceptance": None,
            "verdict": None,
            "error": None,
        }
        rec = cls(run_dir, data)
        rec.save()
        with contextlib.suppress(OSError):  # no room even for the reserve: the saves say so
            with open(rec.dir / RESERVE, "wb") as f:
                f.write(b"\0" * RESERVE_BYTES)
        return rec

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        """The folder's record, checked against the contract (contract.BadRecord if it is not
        one this kit wrote)."""
        path = Path(run_dir) / RECORD
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise contract.BadRecord(f"{path}: unreadable ({exc})") from exc
        return cls(run_dir, contract.check_record(data, path))

    def save(self) -> None:
        if self._lean:
            self._drop_bulk()
        try:
            atomic_write(self.dir / RECORD, json.dumps(self.data, indent=2, default=str) + "\n")
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            self._out_of_space(exc)

    def _drop_bulk(self) -> None:
        for key in BULKY:
            if self.data.get(key) is not None:
                self.data[key] = f"dropped: no space left on device in {self.dir}"

    def where(self) -> str:
        """The phase running now, else the one after which the run stands."""
        phases = self.data["phases"]
        running = [n for n, p in phases.items() if p.get("status") == "running"]
        return running[-1] if running else f"after {list(phases)[-1]}" if phases else "start"

    def _out_of_space(self, exc: OSError) -> None:
        """The disk is full: free the reserve, write the record lean and ended ``broken`` (the
        first time), and raise DiskFull so the run stops here. Later saves that still find no
        space leave the lean record as it is on disk."""
        if self._lean:
            print(f"record: no space left to update {self.dir / RECORD}; it says how the run "
                  "ended", file=sys.stderr)
            return
        self._lean = True
        with contextlib.suppress(OSError):
            os.unlink(self.dir / RESERVE)
        where = self.where()
        message = (f"no space left on device under {self.dir} during {where} ({exc.strerror}); "
                   "free space there (or pass --run-dir on another disk) and run again; the "
                   "record's outputs were dropped to fit")
        if self.data.get("status") == "running" or self.data.get("status") is None:
            self.data["status"] = "error"
            self.data["error"] = {"kind": str(contract.ErrorKind.BROKEN), "type": "DiskFull",
                                  "message": message, "where": where, "traceback": ""}
        self._drop_bulk()
        self.save()
        raise DiskFull(message, where) from exc

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.save()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        """Time a phase; its entry says ok / failed / interrupted even if the run dies in it."""
        entry: dict[str, Any] = {"status": "running", "started_at": _now()}
        self.data["phases"][name] = entry
        self.save()
        t0 = time.monotonic()
        try:
            yield entry
        except BaseException as exc:
            entry["status"] = "interrupted" if contract.is_interrupt(exc) else "failed"
            entry["error"] = f"{type(exc).__name__}: {exc}"
            raise
        else:
            entry["status"] = "ok"
        finally:
            entry["seconds"] = round(time.monotonic() - t0, 3)
            self.save()

    def finish(self, *, passed: bool, reasons: list[str], calibration: str = "uncalibrated") -> None:
        self.data["verdict"] = {"result": "PASS" if passed else "FAIL", "calibration": calibration,
                                "reasons": reasons}
        self.data["status"] = "passed" if passed else "failed"
        self._close()

    def fail(self, exc: BaseException, *, where: str = "") -> None:
        """End the run on an error (not a verdict): its kind (the contract's), what failed, where,
        and the traceback."""
        kind, where = contract.error_kind(exc), getattr(exc, "where", None) or where
        message = f"{exc}" or (f"interrupted during {where or 'the run'} (Ctrl-C or SIGTERM)"
                               if kind == contract.ErrorKind.INTERRUPTED else type(exc).__name__)
        self.end(kind, message, where=where, type_=type(exc).__name__,
                 trace="".join(traceback.format_exception(exc))[-8000:])

    def end(self, kind: contract.ErrorKind, message: str, *, where: str = "",
            type_: str = "", trace: str = "") -> None:
        """End the run with an error of ``kind``; also for endings no exception describes (an
        engine process killed, a container that never started), written by the host."""
        self.data["status"] = "interrupted" if kind == contract.ErrorKind.INTERRUPTED else "error"
        self.data["error"] = {"kind": str(kind), "type": type_ or str(kind), "message": message,
                              "where": where, "traceback": trace}
        for phase in self.data["phases"].values():  # a phase still running ended with the run
            if phase.get("status") == "running":
                phase["status"] = "interrupted" if self.data["status"] == "interrupted" else "failed"
        self._close()

    def _close(self) -> None:
        self.data["finished_at"] = _now()
        self.save()
        self.write_reports()
        with contextlib.suppress(OSError):  # the run has ended: its reserve is no longer needed
            os.unlink(self.dir / RESERVE)

    def write_reports(self) -> None:
        """junit.xml, summary.md and REPRODUCE.md from the record as it stands (a full disk
        leaves them out, never the record: it is written first)."""
        for name, text in ((JUNIT, junit_xml), (SUMMARY, summary_md), (REPRODUCE, reproduce_md)):
            try:
                atomic_write(self.dir / name, text(self.data))
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise
                print(f"record: no space left for {self.dir / name}", file=sys.stderr)


def junit_xml(data: dict[str, Any]) -> str:
    """One test case per run, named after the profile, with the verdict as its outcome."""
    seconds = sum(p.get("seconds", 0) for p in data["phases"].values())
    suite = ET.Element("testsuite", name="llama4-eagle-validation", tests="1",
                       failures=str(int(data["status"] == "failed")),
                       errors=str(int(data["status"] in ("error", "interrupted"))),
                       time=f"{seconds:.3f}", timestamp=data["started_at"])
    case = ET.SubElement(suite, "testcase", classname="validate.e2e", name=data["name"],
                         time=f"{seconds:.3f}")
    if data["status"] == "failed":
        fail = ET.SubElement(case, "failure", message="; ".join(data["verdict"]["reasons"][:2]))
        fail.text = "\n".join(data["verdict"]["reasons"])
    elif data["status"] in ("error", "interrupted"):
        err = data["error"] or {}
        node = ET.SubElement(case, "error", type=err.get("type", ""), message=err.get("message", ""))
        node.text = err.get("traceback", "")
    out = ET.SubElement(case, "system-out")
    out.text = summary_md(data)
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def summary_md(data: dict[str, Any]) -> str:
    """A short page a person reads first: verdict, why, figures, where the time went."""
    prof = data["profile"]
    models = data.get("models") or {}  # the folders actually used, when options overrode the profile
    verdict = data.get("verdict") or {}
    head = verdict.get("result") or data["status"].upper()
    if verdict.get("calibration"):
        head += f" ({verdict['calibration']})"
    lines = [f"# {head}: {data['name']}", ""]
    lines += [f"- {r}" for r in verdict.get("reasons", [])]
    if data.get("error"):
        err = data["error"]
        lines += [f"- run ended with {err['type']} during {err.get('where') or 'the run'}: "
                  f"{err['message']}"]
    lines += ["", "## Run", "",
              f"- profile: `{prof.get('name')}` (TP={prof.get('tensor_parallel_size')}, "
              f"{prof.get('num_speculative_tokens')} speculative tokens, "
              f"{prof.get('num_prompts')} prompts x {prof.get('max_tokens')} tokens, "
              f"device {prof.get('device')})",
              f"- target: `{models.get('target', prof.get('target'))}` "
              f"(revision {models.get('target_revision') or 'unknown'})",
              f"- draft: `{models.get('draft', prof.get('draft'))}` "
              f"(revision {models.get('draft_revision') or 'unknown'})"]
    env = data.get("environment") or {}
    for key in ("vllm", "torch", "transformers", "cpu", "gpus"):
        if key in env:
            lines.append(f"- {key}: {env[key]}")
    acc = data.get("acceptance")
    if acc:
        per = ", ".join(f"{a}" for a in acc["accepted_per_position"])
        lines += ["", "## Acceptance", "",
                  f"- mean acceptance length: {acc['mean_acceptance_length']:.2f}",
                  f"- drafts: {acc['drafts']}, drafted tokens: {acc['draft_tokens']}, "
                  f"accepted: {acc['accepted_tokens']} ({acc['acceptance_rate']:.1%})",
                  f"- accepted per position: {per}"]
    cmp_ = data.get("comparison")
    if cmp_:
        ref = (data.get("reference") or {}).get("kind", "live")
        lines += ["", "## Outputs", "",
                  f"- reference: {'the golden' if ref == 'golden' else 'a reference engine'}",
                  f"- identical to the reference: {cmp_['matches']}/{cmp_['total']} (the seed's "
                  f"exact-match figure); near-ties: {cmp_.get('near_ties', 0)}, hard divergences: "
                  f"{cmp_.get('hard', 0)} (delta {cmp_.get('delta')} nats)"]
        divs = cmp_.get("divergences", [])
        if divs:
            lines += ["", "| prompt | token | reference | speculative | gap (nats) | class |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for d in divs:
                gap = "" if d["gap"] is None else (">" if d["gap_is_lower_bound"] else "") + \
                    f"{d['gap']:.3f}"
                lines.append(f"| {d['index']} | {d['position']} | {d['reference_token']} | "
                             f"{d['speculative_token']} | {gap} | {d['kind']} |")
    lines += bench_md(data.get("bench"))
    if data["phases"]:
        lines += ["", "## Phases", "", "| phase | status | seconds |", "| --- | --- | --- |"]
        for name, p in data["phases"].items():
            lines.append(f"| {name} | {p['status']} | {p.get('seconds', '')} |")
    return "\n".join(lines) + "\n"


def _fig(row: dict[str, Any], fig: str, fmt: str) -> str:
    if fig not in row:
        return "failed"
    return f"{row[fig]:{fmt}} ±{row.get(fig + '_spread', 0):.0%}"


def _host_pace(row: dict[str, Any]) -> str:
    """What the host probe saw over a point's repeats (validate/e2e/host_probe.py): how far the
    host's own pace and the card's SM clock moved, beside the throughput's spread."""
    said = []
    for label in ("reference", "speculative"):
        s = row[label]
        if "probe_ms_spread" in s:
            clock = (f", the SM clock {s['sm_clock_mhz_spread']:.0%}"
                     if "sm_clock_mhz_spread" in s else "")
            said.append(f"{label} throughput {s.get('output_throughput_spread', 0):.0%} apart, "
                        f"the host's pace {s['probe_ms_spread']:.0%}{clock}")
    return "; ".join(said)


def bench_md(bench: dict[str, Any] | None) -> list[str]:
    """The serving bench's table (medians over the repeats, ± their spread: (max - min) /
    median), acceptance per category, the failed points, the plot."""
    if not bench:
        return []
    requests = bench.get("requests") or {}
    sent = (f" (requests a point: {', '.join(f'{n} at {c}' for c, n in requests.items())})"
            if requests and set(requests.values()) != {bench["prompts"]} else "")
    lines = ["", "## Serving bench", "",
             f"`vllm bench serve` on {bench['prompts']} prompts of `{bench['set']}`{sent}, "
             f"{bench['output_len']} tokens an answer, {bench['repeats']} repeats a point; the "
             "figures are medians ± the spread between repeats (max - min over the median).", "",
             "| concurrency | output tok/s reference | output tok/s speculative | speed-up | "
             "TPOT ms reference | TPOT ms speculative | TTFT ms speculative | acceptance length |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in bench["summary"]:
        ref, spec = row["reference"], row["speculative"]
        lines.append(f"| {row['concurrency']} | {_fig(ref, 'output_throughput', '.1f')} | "
                     f"{_fig(spec, 'output_throughput', '.1f')} | "
                     f"{row.get('speedup', 'n/a')}{'x' if 'speedup' in row else ''} | "
                     f"{_fig(ref, 'median_tpot_ms', '.1f')} | {_fig(spec, 'median_tpot_ms', '.1f')} "
                     f"| {_fig(spec, 'median_ttft_ms', '.0f')} | "
                     f"{row.get('acceptance_length', 'n/a')} |")
    if bench["categories"]:
        lines += ["", f"Acceptance per `{bench['set']}` category (greedy chats):", "",
                  "| category | prompts | mean acceptance length | per position |",
                  "| --- | --- | --- | --- |"]
        for name, c in bench["categories"].items():
            lines.append(f"| {name} | {c['prompts']} | {c['mean_acceptance_length']:.2f} | "
                         f"{', '.join(f'{r:.2f}' for r in c['per_position_rate'])} |")
    notes = []
    unsteady = [row for row in bench["summary"] if row.get("steady") is False]
    if unsteady:
        notes.append(f"- throughput spread above {bench.get('max_spread', 0.05):.0%} between "
                     f"repeats at concurrency {', '.join(str(r['concurrency']) for r in unsteady)}"
                     ": those figures and their speed-up hold only to within that spread")
        notes += [f"  - at {row['concurrency']}: {_host_pace(row)}" for row in unsteady
                  if _host_pace(row)]
    notes += [f"- failed point: {p['server']} at concurrency {p['concurrency']}, repeat "
              f"{p['repeat']}: {p['failed'][:300]}" for p in bench["points"] if "failed" in p]
    if bench.get("left_out"):
        notes.append(f"- left out (longer than the context with an answer): "
                     f"{', '.join(bench['left_out'])}")
    lines += [""] * bool(notes) + notes
    if bench.get("plot"):
        lines += ["", f"![speed-up and acceptance]({bench['plot']})"]
    return lines


def reproduce_md(data: dict[str, Any]) -> str:
    """The exact commands and pins that reproduce this run."""
    prof = data["profile"]
    models = data.get("models") or {}
    env = data.get("environment") or {}
    cont = data.get("container") or {}
    inv = data.get("invocation") or {}
    lines = [f"# Reproduce {data['name']}", "",
             f"Result: {(data.get('verdict') or {}).get('result') or data['status']}, "
             f"{data.get('finished_at') or data['started_at']}.", "", "## Pins", "",
             f"- kit: commit `{inv.get('kit_commit', 'unknown')}`",
             f"- profile `{prof.get('name')}`: TP={prof.get('tensor_parallel_size')}, "
             f"{prof.get('num_prompts')} prompts x {prof.get('max_tokens')} tokens, "
             f"{prof.get('num_speculative_tokens')} speculative tokens, prompt set "
             f"`{prof.get('prompt_set')}`",
             f"- target: `{prof.get('target')}` at `{models.get('target_revision') or 'unknown'}`",
             f"- draft: `{prof.get('draft')}` at `{models.get('draft_revision') or 'unknown'}`",
             f"- vLLM {env.get('vllm', 'unknown')}, torch {env.get('torch', 'unknown')}, "
             f"transformers {env.get('transformers', 'unknown')}"]
    if cont:
        lines.append(f"- image: `{cont.get('image')}` ({cont.get('image_id', '')}), base "
                     f"`{cont.get('base')}`{'' if cont.get('base_pinned') else ' (unpinned)'}")
    lines += ["", "## Commands", "", "```bash", f"git checkout {inv.get('kit_commit', '<kit commit>')}"]
    if inv.get("argv"):
        lines.append(inv["argv"])
    else:
        lines.append(f"python -m validate.e2e --profile {prof.get('name')} "
                     f"--tp {prof.get('tensor_parallel_size')} --target {models.get('target')} "
                     f"--draft {models.get('draft')}")
    lines += ["```", ""]
    if str(models.get("target_revision", "")).startswith("generated:"):
        lines.append("The tiny pair is regenerated bit for bit from its fingerprint "
                     "(validate/data/tiny_pair.toml and the generator at that commit).")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# runs in flight: a kit killed with SIGKILL (or a machine that went down) cannot end its record,
# so each host process that runs one leaves an entry here; the next run ends the record of any
# entry whose process is gone and says so in its own record.

LEDGER = "runs-in-flight"


def _start_time(pid: int) -> str | None:
    """The process's start time (/proc/PID/stat field 22): a reused pid is another process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def enter_ledger(run_dir: Path) -> Path:
    """This process runs ``run_dir``: an entry the next run reads if this one is cut off."""
    entry = state_dir() / LEDGER / f"{os.getpid()}.json"
    atomic_write(entry, json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid()),
                                    "run_dir": str(Path(run_dir).absolute()), "started_at": _now()}))
    return entry


def leave_ledger(entry: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(entry)


def cut_off_runs() -> list[dict[str, Any]]:
    """Runs whose kit process is gone without ending them: each record still ``running`` is ended
    ``broken`` here (where it stopped, and why it could not say so itself); returns what was found."""
    found = []
    for entry in sorted((state_dir() / LEDGER).glob("*.json")):
        try:
            e = json.loads(entry.read_text())
            pid, run_dir = int(e["pid"]), Path(e["run_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            leave_ledger(entry)
            continue
        if e.get("start") is not None and _start_time(pid) == e.get("start"):
            continue  # that kit is still running its run
        note = {"run_dir": str(run_dir), "pid": pid, "started_at": e.get("started_at")}
        try:
            rec = RunRecord.load(run_dir)
            status = rec.data["status"]
            if status == "running":
                where = rec.where()
                rec.end(contract.ErrorKind.BROKEN,
                        f"cut off: the kit's process {pid} ended without finishing this run "
                        f"during {where} (killed with SIGKILL, out of memory, or the machine went "
                        "down); found by the next run", where=where)
                note.update(status="running", ended_as="broken", where=where)
            else:
                note.update(status=status, where=(rec.data.get("error") or {}).get("where", ""))
        except contract.BadRecord as exc:
            note.update(status="unreadable", detail=str(exc)[:200])
        found.append(note)
        leave_ledger(entry)
    return found
