"""Per-thread context: the stack of ``with slice:`` blocks and the active program trace."""

from __future__ import annotations

import threading
from typing import Protocol


class Slice(Protocol):
    """A slice entered with ``with slice:`` (a ``VirtualSlice``, which imports this module)."""

    @property
    def id(self) -> int: ...


class ActiveTrace(Protocol):
    """What the runtime asks of the ``@pw.program`` being traced on a thread (the API's ``TraceState``)."""

    def note_slice(self, slice_: Slice) -> None:
        """``with slice_:`` was entered inside the traced function: the program uses that slice."""
        ...


class _State(threading.local):
    def __init__(self) -> None:
        self.slices: list[Slice] = []  # the runtime's VirtualSlices (slices.current_slice)
        # The trace of the @pw.program being traced on this thread, if any (set by the API).
        self.trace: ActiveTrace | None = None


state = _State()

# Set by pathways_jax's exit hook: an exit hook that runs after it (registered
# before pathways_jax was imported) and calls a program gets it run as jax.jit, in
# the caller, instead of starting a cluster nothing would stop.
exiting = False

# How long park_at_exit holds a thread (an exit hook that waits for it gets it back then).
EXIT_PARK_S = 10.0
_never = threading.Event()


def park_at_exit() -> None:
    """Holds a thread other than the main one that calls a program once the exit hook ran.

    Only daemon threads still run then (Python joins the others before the exit
    hooks). One that is inside XLA when the interpreter finalises aborts the
    process (as it does under plain ``jax.jit``); waiting here, in a plain lock
    wait, it is stopped cleanly by the finalisation instead. Bounded: an exit
    hook that waits for such a thread gets it back after ``EXIT_PARK_S``, and its
    call then runs in place as ``jax.jit`` would.
    """
    if threading.current_thread() is not threading.main_thread():
        _never.wait(EXIT_PARK_S)


def current_slice() -> Slice | None:
    """The innermost slice entered with ``with slice:`` on this thread, if any (as a
    ``VirtualSlice``: ``slices.current_slice``)."""
    return state.slices[-1] if state.slices else None
