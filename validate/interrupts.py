"""SIGTERM takes Ctrl-C's path. Host side, depends on the contract only (its handler, which
also remembers that a signal came): the command line, a run and the steps of a flow all end the
same way on either signal (a record that says where it stopped, exit 130)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from validate import contract


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI cancel, `docker stop`, `kill`) takes the same path as Ctrl-C; and SIGINT
    interrupts even where it was inherited as ignored (jobs started in the background by a
    non-interactive shell, `nohup`), where Python would otherwise never see it."""
    old_term = signal.signal(signal.SIGTERM, contract.interrupt)
    old_int = signal.signal(signal.SIGINT, contract.interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
