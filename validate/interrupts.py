"""SIGTERM takes Ctrl-C's path. Host side, depends on nothing: the command line, a run and the
steps of a flow all end the same way on either signal (a record that says where it stopped,
exit 130)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI cancel, `docker stop`, `kill`) takes the same path as Ctrl-C; and SIGINT
    interrupts even where it was inherited as ignored (jobs started in the background by a
    non-interactive shell, `nohup`), where Python would otherwise never see it."""
    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, raise_interrupt)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
