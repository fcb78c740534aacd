"""The contract between the host side and the engine side, written down in one room.

The two sides share nothing at run time but the run folder. What they agree on is here, and only
here: the record's schema version and the fields every record carries (checked on load), the error
kinds the engine side writes into a record, the exit-code table (README's table and ``--help`` are
tested against it), and the end-to-end script's options (the host builds its command line from
them, the script's pytest options are declared from them). Imports nothing of the kit, so either
side can read it without pulling in the other.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------
# exit codes


class Exit(enum.IntEnum):
    """Every exit code ``python -m validate`` returns, and what each means."""

    PASS = 0
    FAIL = 1
    BAD_INPUT = 2
    ENVIRONMENT = 3
    BROKEN = 4
    NO_ACCESS = 5
    NO_DISK = 6
    VERIFY_FAILED = 7
    OFFLINE_MISSING = 8
    PREFLIGHT = 9
    HUB_FAILED = 10
    REGRESSION = 11
    INTERRUPTED = 130

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    Exit.PASS: "PASS: the verdict passed",
    Exit.FAIL: "FAIL: the verdict failed (hard divergences or acceptance too low)",
    Exit.BAD_INPUT: "bad input: unknown profile, repository or revision, a TP size or head config "
                    "vLLM would reject, an unreadable golden",
    Exit.ENVIRONMENT: "wrong environment: vLLM missing or built for another device",
    Exit.BROKEN: "the run broke: an engine crashed, or no record came back",
    Exit.NO_ACCESS: "fetch: no access to a gated repository (accept its license)",
    Exit.NO_DISK: "fetch: not enough disk for the weights",
    Exit.VERIFY_FAILED: "a file is not its pinned bytes (fetch: the weights lock; prompt-sets: a prompt set)",
    Exit.OFFLINE_MISSING: "fetch: offline and files are missing",
    Exit.PREFLIGHT: "preflight failed: the host does not meet the profile's needs",
    Exit.HUB_FAILED: "fetch: the hub could not be reached, or it answered with an error",
    Exit.REGRESSION: "compare: REGRESSION (the change lowers acceptance beyond tolerance or adds "
                     "hard divergences)",
    Exit.INTERRUPTED: "interrupted (Ctrl-C or SIGTERM)",
}


def exit_table() -> str:
    """The exit codes as the lines ``--help`` prints."""
    return "\n".join(f"  {int(code):>3}  {code.meaning}" for code in Exit)


# --------------------------------------------------------------------------------------------
# error kinds: what the engine side says went wrong, so the host needs no class names


class ErrorKind(enum.StrEnum):
    BAD_INPUT = "bad-input"  # the models, options or golden cannot work; said before engines start
    ENVIRONMENT = "environment"  # vLLM missing or the wrong build
    BROKEN = "broken"  # anything else: an engine crashed, a bug
    INTERRUPTED = "interrupted"  # Ctrl-C / SIGTERM reached the run
    NOT_PINNED = "not-pinned"  # a file is not its pinned bytes (a prompt set)


KIND_EXIT = {ErrorKind.BAD_INPUT: Exit.BAD_INPUT, ErrorKind.ENVIRONMENT: Exit.ENVIRONMENT,
             ErrorKind.BROKEN: Exit.BROKEN, ErrorKind.INTERRUPTED: Exit.INTERRUPTED,
             ErrorKind.NOT_PINNED: Exit.VERIFY_FAILED}


class KitError(Exception):
    """An error whose kind the record carries. Subclasses set ``kind``."""

    kind: ErrorKind = ErrorKind.BROKEN


class BadInput(KitError, ValueError):
    kind = ErrorKind.BAD_INPUT


class EnvironmentProblem(KitError, RuntimeError):
    kind = ErrorKind.ENVIRONMENT


# Set by the signal handlers of either side (``interrupt``). A KeyboardInterrupt raised inside a
# library can come out as that library's own error: pydantic-core, building a schema while vLLM
# sets up its config, was seen to turn a Ctrl-C into a SchemaError, and the run then read as
# broken (exit 4) instead of interrupted (exit 130).
_signalled: list[int] = []
_why: list[str] = []  # what the first interruption said, where it said more than Ctrl-C


def interrupt(signum: int, frame: object = None) -> None:
    """Signal handler of a run for SIGINT and SIGTERM: remembers the signal, then raises
    KeyboardInterrupt (Ctrl-C's path), saying why where ``interrupt_because`` was told."""
    _signalled.append(signum)
    raise KeyboardInterrupt(*_why[:1])


def interrupt_because(signum: int, why: str) -> None:
    """``interrupt`` with its reason, kept for the same signal aimed again (the end-to-end
    script's main thread, until its own code has the interruption)."""
    _why.append(why)
    interrupt(signum)


# Set once the run's own code has the interruption (``is_interrupt`` said so): until then a
# library may have swallowed it (vLLM's zmq_socket_ctx catches KeyboardInterrupt during an engine's
# start at TP > 1, then waits up to 600 s for the engine core that the same Ctrl-C ended).
_taken: list[bool] = []


def signalled() -> bool:
    """Whether a signal has reached the run's handler (``interrupt``) yet."""
    return bool(_signalled)


def interrupt_pending() -> bool:
    """A signal reached the handler, but no code of the run has handled the interruption yet."""
    return bool(_signalled) and not _taken


def is_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` ends the run as interrupted: a KeyboardInterrupt, or any error raised after
    a signal reached the run (``interrupt``)."""
    if isinstance(exc, KeyboardInterrupt) or _signalled:
        _taken.append(True)
        return True
    return False


def error_kind(exc: BaseException) -> ErrorKind:
    if is_interrupt(exc):
        return ErrorKind.INTERRUPTED
    return getattr(exc, "kind", ErrorKind.BROKEN)


def exit_code(record: dict[str, Any]) -> Exit:
    """The exit code a finished record stands for."""
    status = record.get("status")
    if status == "passed":
        return Exit.PASS
    if status == "failed":
        return Exit.FAIL
    if status == "interrupted":
        return Exit.INTERRUPTED
    kind = (record.get("error") or {}).get("kind", ErrorKind.BROKEN)
    try:
        return KIND_EXIT[ErrorKind(kind)]
    except ValueError:
        return Exit.BROKEN


# --------------------------------------------------------------------------------------------
# the record


RECORD_SCHEMA_VERSION = 2  # 2: error.kind (ErrorKind) replaces reading error.type
STATUSES = ("running", "passed", "failed", "error", "interrupted")
RECORD_FIELDS: dict[str, type | tuple[type, ...]] = {
    "schema_version": int, "name": str, "status": str, "started_at": str, "profile": dict,
    "environment": dict, "phases": dict,
}


# The serving path's ``bench`` section (validate/e2e/bench.py) and each of its sweep points.
BENCH_FIELDS: dict[str, type | tuple[type, ...]] = {
    "set": str, "prompts": int, "output_len": int, "concurrency": list, "repeats": int,
    "points": list, "summary": list, "categories": dict,
}
POINT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "server": str, "concurrency": int, "repeat": int, "wall_s": (int, float),
}


class BadRecord(ValueError):
    """A run folder's record this kit cannot read (another schema, a damaged file)."""


def check_record(data: Any, where: Path | str = "record.json") -> dict[str, Any]:
    """``data`` if it is a record of this schema; else BadRecord naming the field."""
    if not isinstance(data, dict):
        raise BadRecord(f"{where}: not a JSON object")
    version = data.get("schema_version")
    if version != RECORD_SCHEMA_VERSION:
        raise BadRecord(f"{where}: schema_version {version!r}, this kit reads "
                        f"{RECORD_SCHEMA_VERSION}; it was written by another kit version (run it "
                        "again with this one)")
    for key, kind in RECORD_FIELDS.items():
        if not isinstance(data.get(key), kind):
            raise BadRecord(f"{where}: field {key!r} is missing or not a {kind.__name__}")
    if data["status"] not in STATUSES:
        raise BadRecord(f"{where}: status {data['status']!r} is none of {', '.join(STATUSES)}")
    if data.get("bench") is not None:
        _check_bench(data["bench"], where)
    if data["status"] in ("error", "interrupted"):
        err = data.get("error")
        if not isinstance(err, dict) or err.get("kind") not in {k.value for k in ErrorKind}:
            raise BadRecord(f"{where}: status {data['status']} without an error kind")
    return data


def _check_bench(bench: Any, where: Path | str) -> None:
    if not isinstance(bench, dict):
        raise BadRecord(f"{where}: field 'bench' is not a JSON object")
    for key, kind in BENCH_FIELDS.items():
        if not isinstance(bench.get(key), kind):
            raise BadRecord(f"{where}: bench field {key!r} is missing or of the wrong type")
    for i, point in enumerate(bench["points"]):
        for key, kind in POINT_FIELDS.items():
            if not isinstance(point, dict) or not isinstance(point.get(key), kind):
                raise BadRecord(f"{where}: bench point {i}: field {key!r} is missing or of the "
                                "wrong type")
        if "failed" not in point and not isinstance(point.get("output_throughput"), (int, float)):
            raise BadRecord(f"{where}: bench point {i} neither failed nor has output_throughput")


# --------------------------------------------------------------------------------------------
# the end-to-end script's options (host: command line; engine: pytest options)


def concurrency_list(given: str) -> tuple[int, ...]:
    """``--concurrency 1,4,16``: the sweep's concurrencies, each 1 or more (an argparse type, so
    the host's command line and the script's pytest option refuse the same values the same way)."""
    try:
        values = tuple(int(v) for v in given.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency {given}: give concurrencies of 1 or more, "
                                         "comma-separated (e.g. 1,4,16,64)")
    return values


def repeat_count(given: str) -> int:
    """``--repeats N``: runs per sweep point, 1 or more (an argparse type)."""
    try:
        value = int(given)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--repeats {given}: each sweep point runs at least once")
    return value


# (flag, pytest/argparse keywords). Values the host always passes have no default here.
E2E_OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--profile", {"action": "append", "default": None,
                   "help": "profile name from validate/data/profiles.toml (repeatable; default: tiny)"}),
    ("--tp", {"type": int, "default": None, "help": "tensor parallel size (default: the profile's)"}),
    ("--pp", {"type": int, "default": None, "help": "pipeline parallel size (default: the profile's)"}),
    ("--nodes", {"type": int, "default": None, "help": "nodes the engines span (default: the profile's)"}),
    ("--target", {"default": None, "help": "target model folder (default: from the profile)"}),
    ("--draft", {"default": None, "help": "EAGLE head folder (default: from the profile)"}),
    ("--run-dir", {"type": Path, "default": None,
                   "help": "folder for record.json / junit.xml / summary.md"}),
    ("--num-prompts", {"type": int, "default": None, "help": "override the profile's prompt count"}),
    ("--max-tokens", {"type": int, "default": None, "help": "override the profile's max_tokens"}),
    ("--golden", {"default": "auto",
                  "help": "auto: the calibrated golden for this profile, device class and TP "
                          "(validate/data/goldens/); none: the profile's floors; or a golden file"}),
    ("--reference", {"choices": ("live", "golden"), "default": "live",
                     "help": "live: run a reference engine; golden: take the golden's reference "
                             "outputs and start only the speculative engine (about half the time; "
                             "needs a golden that applies)"}),
    ("--path", {"choices": ("offline", "serving"), "default": "offline",
                "help": "offline: the engines through LLM.chat; serving: two `vllm serve` servers, "
                        "the verdict on their greedy chats, then the bench sweep (vllm bench serve)"}),
    ("--concurrency", {"type": concurrency_list, "default": None,
                       "help": "serving: the sweep's concurrencies, comma-separated (default: the "
                               "profile's bench_concurrency)"}),
    ("--repeats", {"type": repeat_count, "default": None,
                   "help": "serving: repeats per sweep point (default: the profile's bench_repeats)"}),
    ("--run-id", {"default": None,
                  "help": "the id the host chose for this run, written into the record (the host "
                          "accepts only a record that carries it)"}),
)
E2E_FLAGS = tuple(flag for flag, _ in E2E_OPTIONS)
VERDICT_FLAGS = ("--golden", "--reference")


def e2e_argv(values: dict[str, Any]) -> list[str]:
    """The end-to-end script's command line from ``{flag: value}``; None values are left out, and
    an unknown flag is a bug on the host side, refused here rather than by pytest in an image."""
    unknown = set(values) - set(E2E_FLAGS)
    if unknown:
        raise KeyError(f"not options of the end-to-end script: {sorted(unknown)}")
    argv: list[str] = []
    for flag in E2E_FLAGS:
        value = values.get(flag)
        if isinstance(value, tuple | list):
            value = ",".join(str(v) for v in value)
        if value is not None:
            argv += [flag, str(value)]
    return argv


def options(flags: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
    """The declarations of ``flags``, for argparse or pytest's addoption."""
    by_flag = dict(E2E_OPTIONS)
    return [(f, by_flag[f]) for f in flags]
