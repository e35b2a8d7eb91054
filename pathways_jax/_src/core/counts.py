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
    "fetches",  # values brought from a remote host to the controller (Ray backend)
    "host_pulls",  # values pulled host to host through the transfer servers (Ray backend)
    "host_saves",  # checkpoint saves written by the hosts (compat.host_checkpoints), completed
    "host_save_failures",  # ... that failed (a host lost, a write that failed)
    "host_restores",  # values read from a checkpoint by the hosts
)

# Each thread counts into its own Counter (no lock on the hot path); reads sum
# them. A Counter is registered once per thread and kept after the thread ends
# so that its counts are not lost.
_lock = threading.Lock()
_all: list[collections.Counter[str]] = []
_local = threading.local()


def _mine() -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    with _lock:
        _all.append(counts)
    _local.counts = counts
    return counts


def bump(name: str, n: int = 1) -> None:
    try:
        counts = _local.counts
    except AttributeError:
        counts = _mine()
    counts[name] += n


def counters() -> dict[str, int]:
    """Returns a snapshot of the runtime's counters.

    Keys: ``traces`` (programs traced into graphs), ``lowerings`` (graphs
    lowered into plans), ``compiles`` (executables compiled), ``runs``
    (program runs submitted), ``dispatches`` (executables dispatched),
    ``transfers_ici`` / ``transfers_dcn`` (values moved between slices within
    / across islands), ``host_pulls`` (Ray backend: values a host pulled
    from another host's transfer server, whatever the kind of move),
    ``failed_runs`` (runs that failed at dispatch, or
    whose execution error the controller met while bounding the in-flight
    window; an error seen only by ``Future.result()`` is not counted).

    Example:
      >>> import pathways_jax as pw
      >>> sorted(pw.counters())[:3]
      ['compiles', 'dispatches', 'failed_runs']
    """
    with _lock:
        return {name: sum(c[name] for c in _all) for name in _NAMES}


def reset_counters() -> None:
    """Sets every counter back to zero."""
    with _lock:
        for counts in _all:
            counts.clear()
