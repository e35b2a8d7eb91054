"""Cheap counters of the runtime's machinery, read by tests and benchmarks."""

from __future__ import annotations

import collections
import threading

_NAMES = (
    "traces",
    "lowerings",
    "compiles",
    "runs",
    "dispatches",
    "transfers_ici",
    "transfers_dcn",
    "failed_runs",
)

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()


def bump(name: str, n: int = 1) -> None:
    # A Counter update under the GIL is one bytecode-level dict op; the lock
    # keeps read-modify-write exact across the controller and user threads.
    with _lock:
        _counts[name] += n


def counters() -> dict[str, int]:
    """Returns a snapshot of the runtime's counters.

    Keys: ``traces`` (programs traced into graphs), ``lowerings`` (graphs
    lowered into plans), ``compiles`` (executables compiled), ``runs``
    (program runs submitted), ``dispatches`` (executables dispatched),
    ``transfers_ici`` / ``transfers_dcn`` (values moved between slices within
    / across islands), ``failed_runs`` (runs that failed at dispatch, or
    whose execution error the controller met while bounding the in-flight
    window; an error seen only by ``Future.result()`` is not counted).

    Example:
      >>> import pathways_jax as pw
      >>> sorted(pw.counters())[:3]
      ['compiles', 'dispatches', 'failed_runs']
    """
    with _lock:
        return {name: _counts[name] for name in _NAMES}


def reset_counters() -> None:
    """Sets every counter back to zero."""
    with _lock:
        _counts.clear()
