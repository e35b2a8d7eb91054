"""Per-thread context: the stack of ``with slice:`` blocks and the active program trace."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
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

# Threads other than the main one lowering a program now (XLA compiles), by thread id: how deep.
_lowering: dict[int, int] = {}
_lowered = threading.Condition()


@contextlib.contextmanager
def lowering() -> Iterator[None]:
    """Marks a program's lowering (its XLA compiles) on a thread other than the main one.

    A daemon thread inside XLA's compiler as the interpreter finalises aborts the
    process ("terminate called after throwing an instance of ''"): a daemon thread
    calling a new program (a background evaluator) as the main thread ended took the
    whole exit down. The exit hook waits for the lowerings marked here
    (:func:`begin_exit`); one that would start after it is held (:func:`park_at_exit`).
    """
    if threading.current_thread() is threading.main_thread():
        yield
        return
    ident = threading.get_ident()
    with _lowered:
        held = exiting
        if not held:
            _lowering[ident] = _lowering.get(ident, 0) + 1
    if held:
        park_at_exit()
        yield
        return
    try:
        yield
    finally:
        with _lowered:
            depth = _lowering.pop(ident) - 1
            if depth:
                _lowering[ident] = depth
            _lowered.notify_all()


def begin_exit(timeout: float) -> float:
    """Marks the process as exiting, then waits (up to ``timeout`` s) for the lowerings other threads
    are in (:func:`lowering`); returns the seconds left."""
    global exiting
    deadline = time.monotonic() + timeout
    with _lowered:
        exiting = True
        while _lowering and (left := deadline - time.monotonic()) > 0:
            _lowered.wait(left)
    return max(0.0, deadline - time.monotonic())


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
