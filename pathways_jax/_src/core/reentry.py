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
