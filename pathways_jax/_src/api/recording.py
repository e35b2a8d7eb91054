"""Timeline traces: what the controller and the devices did, as Chrome/Perfetto trace events.

``with pw.trace("run.json"):`` records controller events (trace, lower,
compile, submit, dispatch), each node's execution on each device, transfers
(ICI or DCN, with bytes), waits, failures and the client each run belongs to,
then writes the trace-event JSON that ui.perfetto.dev and chrome://tracing open.

The runtime tells what it does as typed events of plain values
(``core.events``); while a trace is recorded the :class:`Recorder` is their
sink, and lays them out with ``core.trace_format`` (the layout ``pw.sim``
shares). Tracing off costs the hot path one global load and one comparison.
End times of device work come from a watcher thread that polls the outputs'
readiness: the controller thread never waits for the recorder.

Layout of the trace: process 0 is the controller (one track per Python thread
that traced, lowered, submitted or dispatched); process ``1 + k`` is island
``k``, with one track per device and one track of transfers into the island.
A node's execution on a device spans from its dispatch (or from the end of the
previous work on that device, whichever is later: a device runs one thing at a
time) until its outputs are ready; ``args.dispatched_us`` keeps the dispatch time.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from absl import logging

from pathways_jax._src.core import errors, events, readiness, reentry, trace_format
from pathways_jax._src.runtime import clusters

__all__ = ["ACTIVE", "Recorder", "start_trace", "stop_trace", "trace"]

# The recorder in use, or None; its record method is events.SINK meanwhile.
ACTIVE: Recorder | None = None
_active_lock = threading.Lock()

DEFAULT_CLIENT = "default"
CONTROLLER_PID = trace_format.CONTROLLER_PID
TRANSFER_TID = trace_format.TRANSFER_TID
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3
_STOP = object()
_ENDED = 1 << 62  # a run's dispatched-steps count once it can dispatch no more


class _Work:
    """A dispatched node or transfer the watcher waits on."""

    __slots__ = ("args", "arrays", "cat", "end", "name", "pid", "start", "tids")

    def __init__(
        self, name: str, cat: str, pid: int, tids: tuple[int, ...], arrays: list, start: int, args: dict
    ):
        self.name = name
        self.cat = cat
        self.pid = pid
        self.tids = tids
        self.arrays = arrays
        self.start = start
        self.end: int | None = None
        self.args = args

    def ready(self) -> bool:
        if not all(readiness.settled(array) for array in self.arrays):
            return False
        for array in self.arrays:  # all settled: surface an execution error, if any
            try:
                readiness.block(array)  # a donated output was consumed: not an error
            except Exception as exc:
                self.args["error"] = f"{type(exc).__name__}: {exc}"[:500]
        self.arrays = []
        return True


class Recorder:
    """Lays out the runtime's events (``core.events``) as a trace, with a watcher thread for device work.

    Made by :func:`start_trace` / :func:`trace`; its :meth:`record` is the
    events' sink while it is :data:`ACTIVE`.

    Attributes:
      path: where :meth:`stop` writes the JSON (``None``: kept in memory only).
      events: the trace events recorded so far.
    """

    now = staticmethod(events.now)
    MIN_WAIT_NS = 20_000  # shorter waits are not worth a slice

    def __init__(self, path: str | os.PathLike | None = None, *, drain_timeout: float = 60.0):
        self.path = None if path is None else os.fspath(path)
        self.events: list[dict] = []
        self._drain_timeout = drain_timeout
        self._t0 = events.now()
        self._cond = threading.Condition()
        self._closed = False
        self._draining = False
        self._expected: dict[int, int] = {}  # run id -> steps still to dispatch
        self._seen: collections.Counter[int] = collections.Counter()
        self._threads: dict[int, tuple[int, str]] = {}  # ident -> (tid, name)
        self._tids = itertools.count(1)
        self._table: tuple[events.Device, ...] | None = None  # a cluster's devices, not yet drawn
        self._tracks: dict[tuple[int, int], str] = {}
        self._processes: dict[int, str] = {CONTROLLER_PID: "controller"}
        self._devices: dict[int, dict] = {}
        self._island_of: dict[int, int] = {}
        self._clients: set[str] = set()
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._busy_until: dict[tuple[int, int], int] = {}
        self._deadline: float | None = None
        self._unfinished = 0
        self._watcher = reentry.runtime_thread(self._watch, name="pathways-trace-watcher")
        self._watcher.start()

    def record(self, event: events.Event) -> None:
        """Records one event of the runtime (called on the thread that emitted it)."""
        if self._closed:
            return
        match event:
            case events.Dispatched():
                self._dispatched(event)
            case events.Moved():
                self._moved(event)
            case events.Sent():
                self._sent(event)
            case events.Submitted(run, program, client, reports, start, end):
                self._span(
                    f"submit {program}", "submit", start, end, client, {"program": program, "run": run}
                )
                self._expect(run, reports)
            case events.Traced(program, source, start, end):
                self._span(
                    f"trace {program}", "trace", start, end, None, {"program": program, "source": source}
                )
            case events.Lowered(program, nodes, start, end):
                self._span(
                    f"lower {program}", "lower", start, end, None, {"program": program, "nodes": nodes}
                )
            case events.Compiled(node, source, slice_id, start, end):
                args = {"node": node, "source": source, "slice": slice_id}
                self._span(f"compile {node}", "compile", start, end, None, args)
            case events.Remapped(program, moved, at):
                self._instant(
                    f"remap {program}", "remap", at, None, {"program": program, "moved": str(moved)}
                )
            case events.Waited():
                self._waited(event)
            case events.RunFailed(run, client, message, at):
                self._instant("run failed", "failure", at, client, {"run": run, "message": message})
                self._run_ended(run)
            case events.Devices(devices):
                self._table = devices

    # --- time and tracks -------------------------------------------------------------

    def _us(self, t: int) -> float:
        return (t - self._t0) / 1e3

    def _thread_tid(self) -> int:
        ident = threading.get_ident()
        known = self._threads.get(ident)
        if known is None:
            known = (next(self._tids), threading.current_thread().name)
            self._threads[ident] = known
        return known[0]

    def _learn_devices(self) -> None:
        """Names the tracks of the devices of the cluster that runs the work (once something runs)."""
        table, self._table = self._table, None
        for device in table or ():
            island = device.island
            self._processes.setdefault(1 + island, f"island {island}")
            if device.id in self._island_of:
                continue
            self._island_of[device.id] = island
            self._devices[device.id] = {
                "id": device.id,
                "island": island,
                "kind": device.kind,
                "host": device.host,
            }
            self._tracks[(1 + island, device.id)] = f"device {device.id} ({device.kind}, host {device.host})"

    # --- controller-side events ------------------------------------------------------

    def _span(self, name: str, cat: str, start: int, end: int, client: str | None, args: dict) -> None:
        """A span on the calling thread's controller track, from ``start`` to ``end``."""
        self._controller_event(
            name, cat, client, args, ph="X", ts=self._us(start), dur=max(end - start, 0) / 1e3
        )

    def _instant(self, name: str, cat: str, at: int, client: str | None, args: dict) -> None:
        """A point in time on the calling thread's controller track."""
        self._controller_event(name, cat, client, args, ph="i", s="t", ts=self._us(at))

    def _controller_event(self, name: str, cat: str, client: str | None, args: dict, **fields: Any) -> None:
        if client is not None:
            args["client"] = client
            self._clients.add(client)
        self.events.append(
            {
                "name": name,
                "cat": cat,
                **fields,
                "pid": CONTROLLER_PID,
                "tid": self._thread_tid(),
                "args": args,
            }
        )

    def _waited(self, event: events.Waited) -> None:
        """A wait of the calling thread; waits shorter than ``MIN_WAIT_NS`` (20 µs) are dropped."""
        if event.end - event.start < self.MIN_WAIT_NS:
            return
        island = event.island
        where = f" (island {island})" if island is not None else ""
        args: dict[str, Any] = {"island": island}
        if event.bytes is not None:
            args["bytes"] = event.bytes
        self._span(f"wait: {event.reason}{where}", "wait", event.start, event.end, event.client, args)

    # --- runs: the dispatches the trace waits for -----------------------------------------

    def _expect(self, run_id: int, steps: int) -> None:
        """A run was queued: its ``steps`` dispatches are waited for before the trace is written."""
        with self._cond:
            if self._closed or self._draining or steps == 0:
                return
            left = steps - self._seen.pop(run_id, 0)
            if left > 0:
                self._expected[run_id] = left

    def _dispatched_step(self, run_id: int) -> None:
        with self._cond:
            left = self._expected.get(run_id)
            if left is None:
                self._seen[run_id] += 1
                return
            if left <= 1:
                del self._expected[run_id]
                self._cond.notify_all()
            else:
                self._expected[run_id] = left - 1

    def _run_ended(self, run_id: int) -> None:
        """The controller will dispatch nothing more of this run (it failed)."""
        with self._cond:
            if self._expected.pop(run_id, None) is not None:
                self._cond.notify_all()
            else:  # it may fail (inline) before it is submitted: expect nothing then
                self._seen[run_id] = _ENDED

    # --- device work -----------------------------------------------------------------

    def _dispatch(self, name: str, event: events.Dispatched | events.Sent | events.Moved) -> None:
        """The controller-track span of dispatching ``event``'s work."""
        self._span(f"dispatch {name}", "dispatch", event.start, event.end, event.client, {"run": event.run})

    def _executed(self, name: str, event: events.Dispatched | events.Sent, args: dict) -> None:
        """``event``'s execution on its island's devices, watched until its outputs are ready."""
        self._learn_devices()
        self._dispatch(name, event)
        args["dispatched_us"] = self._us(event.start)
        pid = 1 + event.island
        self._inbox.put(_Work(name, "execution", pid, event.devices, list(event.watch), event.start, args))
        self._dispatched_step(event.run)

    def _dispatched(self, event: events.Dispatched) -> None:
        args = {
            "program": event.program,
            "node": event.node,
            "kind": event.kind,
            "source": event.source,
            "slice": event.slice,
            "island": event.island,
            "run": event.run,
            "client": event.client,
        }
        self._executed(f"{event.program}/{event.node}", event, args)

    def _sent(self, event: events.Sent) -> None:
        args = {
            "program": event.program,
            "run": event.run,
            "client": event.client,
            "host": event.host,
            "island": event.island,
        }
        self._executed(f"{event.program} on host {event.host}", event, args)

    def _moved(self, event: events.Moved) -> None:
        self._learn_devices()
        kind = event.kind
        dst = event.dst_devices
        island = self._island_of.get(dst[0], 0) if dst else 0
        self._dispatch(f"{kind} transfer", event)
        args = {
            "program": event.program,
            "run": event.run,
            "client": event.client,
            "kind": kind,
            "bytes": event.bytes,
            "value": event.value,
            "src_devices": list(event.src_devices),
            "dst_devices": list(dst),
            "dispatched_us": self._us(event.start),
        }
        self._processes.setdefault(1 + island, f"island {island}")
        self._tracks[(1 + island, TRANSFER_TID)] = f"transfers into island {island}"
        name = f"{kind} {event.bytes} B"
        work = _Work(name, "transfer", 1 + island, (TRANSFER_TID,), list(event.watch), event.start, args)
        self._inbox.put(work)
        self._dispatched_step(event.run)

    # --- the watcher -----------------------------------------------------------------

    def _emit(self, work: _Work, unfinished: bool = False) -> None:
        end = work.end if work.end is not None else events.now()
        keys = [(work.pid, tid) for tid in work.tids]
        start = max([work.start, *(self._busy_until.get(k, 0) for k in keys)])
        end = max(end, start)
        args = work.args
        args["queued_us"] = (start - work.start) / 1e3
        if unfinished:
            args["unfinished"] = True
            self._unfinished += 1
        self._clients.add(args.get("client", DEFAULT_CLIENT))
        name = work.name if "error" not in args else f"{work.name} (failed)"
        for key in keys:
            self._busy_until[key] = end
            event_args = dict(args, device=key[1]) if work.cat == "execution" else args
            self.events.append(
                trace_format.span(
                    name, work.cat, self._us(start), (end - start) / 1e3, key[0], key[1], event_args
                )
            )

    def _watch(self) -> None:
        pending: collections.deque[_Work] = collections.deque()
        pause = _POLL_MIN_S
        stopping = False
        while True:
            try:
                if pending or stopping:
                    while True:
                        item = self._inbox.get_nowait()
                        if item is _STOP:
                            stopping = True
                        else:
                            pending.append(item)
                else:
                    item = self._inbox.get(timeout=1.0)
                    if item is _STOP:
                        stopping = True
                    else:
                        pending.append(item)
                    continue
            except queue.Empty:
                pass
            progressed = False
            t = events.now()
            for work in pending:
                if work.end is None and work.ready():
                    work.end = t
                    progressed = True
            # Emit in dispatch order: a device's works then follow each other.
            while pending and pending[0].end is not None:
                self._emit(pending.popleft())
            if stopping:
                if not pending:
                    return
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    while pending:
                        self._emit(pending.popleft(), unfinished=True)
                    return
            if pending:
                pause = _POLL_MIN_S if progressed else min(pause * 2, _POLL_MAX_S)
                time.sleep(pause)

    # --- finishing -------------------------------------------------------------------

    def stop(self, timeout: float | None = None) -> dict:
        """Waits for the work submitted while tracing, then returns (and writes) the trace.

        Args:
          timeout: seconds to wait for that work to be dispatched and finished
            (default: ``drain_timeout``); what is still running then is
            written with ``args.unfinished``.

        Returns:
          The trace-event JSON object.
        """
        timeout = self._drain_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            self._draining = True
            while self._expected and (remaining := deadline - time.monotonic()) > 0:
                self._cond.wait(remaining)
            undispatched = len(self._expected)
            self._closed = True
        self._deadline = deadline
        self._inbox.put(_STOP)
        self._watcher.join(max(deadline - time.monotonic(), 0) + 5.0)
        if undispatched or self._unfinished:
            logging.warning(
                "pw.stop_trace: %d runs were not dispatched and %d works had not finished within %.1fs; "
                "the trace marks them unfinished.",
                undispatched,
                self._unfinished,
                timeout,
            )
        data = self.to_json()
        if self.path is not None:
            with open(self.path, "w") as f:
                json.dump(data, f)
        return data

    def to_json(self) -> dict:
        """The trace-event JSON object of the events so far (with track names)."""
        threads = {(CONTROLLER_PID, tid): name for tid, name in self._threads.values()}
        threads.update(sorted(self._tracks.items()))
        other = {
            "producer": "pathways_jax",
            "clients": sorted(self._clients),
            "devices": [self._devices[k] for k in sorted(self._devices)],
        }
        return trace_format.document(list(self.events), self._processes, threads, other)


def start_trace(path: str | os.PathLike | None = None, *, drain_timeout: float = 60.0) -> Recorder:
    """Starts recording a timeline trace of everything the runtime does.

    Args:
      path: where :func:`stop_trace` writes the Chrome/Perfetto trace-event
        JSON (open it in ui.perfetto.dev or chrome://tracing); ``None`` keeps
        the trace in memory only.
      drain_timeout: how long :func:`stop_trace` waits for work submitted
        while tracing to finish.

    Returns:
      The :class:`Recorder`.

    Raises:
      TimelineError: a trace is already being recorded, or ``path``'s folder
        does not exist.

    Example:
      >>> import pathways_jax as pw
      >>> rec = pw.start_trace()
      >>> trace = pw.stop_trace()
      >>> "traceEvents" in trace
      True
    """
    global ACTIVE
    if path is not None:
        folder = os.path.dirname(os.path.abspath(os.fspath(path)))
        if not os.path.isdir(folder):
            raise errors.TimelineError(
                f"cannot write a trace to {os.fspath(path)!r}: the folder {folder!r} does not exist. "
                "Create it first, or pass another path."
            )
    with _active_lock:
        if ACTIVE is not None:
            where = ACTIVE.path or "memory"
            raise errors.TimelineError(
                f"a trace is already being recorded (to {where}); call pw.stop_trace() "
                "before starting another one. Traces do not nest."
            )
        rec = ACTIVE = Recorder(path, drain_timeout=drain_timeout)
        events.SINK = rec.record
    # A cluster that starts from now on tells its devices itself; one running already is read.
    running = clusters.running()
    if running is not None:
        rec.record(events.Devices(running.device_places()))
    return rec


def stop_trace(timeout: float | None = None) -> dict:
    """Stops recording: waits for traced work to finish, writes the file, returns the trace.

    Args:
      timeout: seconds to wait for the work submitted while tracing (default:
        ``drain_timeout`` of :func:`start_trace`).

    Returns:
      The trace-event JSON object (``{"traceEvents": [...], ...}``).

    Raises:
      TimelineError: no trace is being recorded.
    """
    global ACTIVE
    with _active_lock:
        rec = ACTIVE
        if rec is None:
            raise errors.TimelineError(
                "pw.stop_trace() was called, but no trace is being recorded; call pw.start_trace(path) first."
            )
    try:
        return rec.stop(timeout)
    finally:
        with _active_lock:
            events.SINK = None
            ACTIVE = None


@contextlib.contextmanager
def trace(path: str | os.PathLike | None = None, *, drain_timeout: float = 60.0) -> Iterator[Recorder]:
    """Records a timeline trace of the code inside the ``with`` block.

    On exit it waits for the work submitted inside the block to finish, then
    writes ``path`` (see :func:`start_trace`). The recorder's ``events`` hold
    the trace afterwards.

    Example:
      >>> import os, tempfile, json
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> double = pw.jit(lambda v: v * 2, devices=s)
      >>> path = os.path.join(tempfile.mkdtemp(), "run.json")
      >>> with pw.trace(path):
      ...     out = double(jnp.ones(2))
      >>> with open(path) as f:
      ...     events = json.load(f)["traceEvents"]
      >>> {"submit", "dispatch", "execution"} <= {e["cat"] for e in events if e["ph"] == "X"}
      True
      >>> s.release()
    """
    rec = start_trace(path, drain_timeout=drain_timeout)
    try:
        yield rec
    finally:
        stop_trace()
