"""The trace-event layout pathways_jax's traces share: ``pw.trace()``'s and the simulator's.

Chrome/Perfetto trace-event JSON: one process per track group (the
controller, then one per island), one thread per track (a controller
thread, a device, an island's transfers in), complete events (``"X"``)
for spans, and metadata events naming the tracks. Both the recorder
(``timeline``) and ``pw.sim`` write their traces with these functions, so
``pw.plot_timeline`` and Perfetto read either the same way.

Example:
  >>> doc = document([span("step", "execution", 0.0, 5.0, 1, 0, {})], {1: "island 0"}, {(1, 0): "device 0"}, {})
  >>> [e["name"] for e in doc["traceEvents"]]
  ['process_name', 'process_sort_index', 'thread_name', 'step']
"""

from __future__ import annotations

from typing import Any

CONTROLLER_PID = 0  # the controller's process; island i is process 1 + i
TRANSFER_TID = 1_000_000  # the transfers-in track of each island process


def span(name: str, cat: str, ts_us: float, dur_us: float, pid: int, tid: int, args: dict) -> dict:
    """A complete event: ``name`` on track (``pid``, ``tid``) from ``ts_us`` for ``dur_us`` microseconds."""
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": ts_us,
        "dur": dur_us,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def track_names(processes: dict[int, str], threads: dict[tuple[int, int], str]) -> list[dict]:
    """Metadata events naming (and ordering) ``processes`` by pid and ``threads`` by (pid, tid)."""
    meta: list[dict] = []
    for pid, name in sorted(processes.items()):
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        meta.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
    for (pid, tid), name in threads.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
    return meta


def document(
    events: list[dict], processes: dict[int, str], threads: dict[tuple[int, int], str], other: dict[str, Any]
) -> dict:
    """The trace-event JSON object: the tracks' names, then ``events``; ``other`` as ``otherData``."""
    return {
        "traceEvents": track_names(processes, threads) + events,
        "displayTimeUnit": "ms",
        "otherData": other,
    }
