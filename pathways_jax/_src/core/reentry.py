"""Threads inside pathways_jax's own work: Python code run there must not wait on the runtime.

Python runs code of the user's in the middle of the runtime's: a garbage-collector
finalizer (``__del__``, ``weakref.finalize``) at whatever allocation triggers a
collection, a signal handler between two bytecodes, a host callback inside an
executable. On a thread that holds the controller's locks (dispatching a run,
settling a window) or that is one of the runtime's own, a program called there
runs as ``jax.jit``, in place, and waiting there for a value not computed yet
raises: the run that computes it would need that thread or those locks.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


class _Inside(threading.local):
    depth = 0  # above 0 while this thread is inside the runtime's work


inside = _Inside()


def runtime_thread(target: Callable[..., Any], *, name: str, args: tuple = ()) -> threading.Thread:
    """A daemon thread of the runtime's: inside its work for all its life."""

    def run() -> None:
        inside.depth = 1
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


def from_signal_handler(exc: BaseException) -> bool:
    """True if ``exc`` was raised by a Python signal handler (or code it called) on this thread.

    A handler runs between two bytecodes of whatever the main thread was doing,
    pathways_jax's own dispatch included: what it raises (``TimeoutError`` from
    a time budget's ``SIGALRM``) is the user's, to be raised on as an interrupt
    is, not taken for a failure of the run or of the runtime. Asked only once
    something was raised: it looks at the traceback's frames for the code of a
    handler installed now.
    """
    if threading.current_thread() is not threading.main_thread():
        return False  # handlers run on the main thread only
    tb = exc.__traceback__
    if tb is None or tb.tb_next is None:
        return False  # raised where it was caught (by a call into C): no handler's frame below it
    handlers = _handler_codes()
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


def _handler_codes() -> set[Any]:
    """The code objects of the Python signal handlers installed now."""
    codes = set()
    for signum in signal.valid_signals():
        try:
            code = _code_of(signal.getsignal(signum))
        except (OSError, ValueError):  # pragma: no cover - a number this platform cannot ask about
            continue
        if code is not None:
            codes.add(code)
    return codes


def _code_of(handler: Any) -> Any:
    """The code a handler runs: a function's, a method's, a partial's, or an object's ``__call__``."""
    for _ in range(4):  # a few wrappers deep at most (a partial of a method)
        if handler is None or isinstance(handler, int):  # SIG_DFL, SIG_IGN, or none installed from Python
            return None
        code = getattr(handler, "__code__", None)
        if code is not None:
            return code
        inner = getattr(handler, "__func__", None) or getattr(handler, "func", None)
        handler = inner if inner is not None else type(handler).__call__
    return None
