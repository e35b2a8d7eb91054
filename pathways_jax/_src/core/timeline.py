"""Timeline traces: what the controller and the devices did, as Chrome/Perfetto trace events.

``with pw.trace("run.json"):`` records controller events (trace, lower,
compile, submit, dispatch), each node's execution on each device, transfers
(ICI or DCN, with bytes), waits, failures and the client each run belongs to,
then writes the trace-event JSON that ui.perfetto.dev and chrome://tracing open.

The hot path reads :data:`ACTIVE` once and calls the recorder only when it is
set, so tracing off costs one global load and one comparison. End times of
device work come from a watcher thread that polls the outputs' readiness: the
controller thread never waits for the recorder.

Layout of the trace: process 0 is the controller (one track per Python thread
that traced, lowered, submitted or dispatched); process ``1 + k`` is island
``k``, with one track per device and one track of transfers into the island.
A node's execution on a device spans from its dispatch (or from the end of the
previous work on that device, whichever is later: a device runs one thing at a
time) until its outputs are ready; ``args.dispatched_us`` keeps the dispatch time.

This module also logs, through ``absl.logging``, what is worth a line whether or
not a trace is recorded: compiles and lowerings (INFO), remaps (INFO) and failed
runs (WARNING). INFO is hidden by default (``absl.logging.set_verbosity("info")``
shows it).
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
import weakref
from collections.abc import Iterator
from typing import Any

from absl import logging

from pathways_jax._src.core import errors, readiness, reentry, trace_format
from pathways_jax._src.core.formatting import aval_text

__all__ = ["ACTIVE", "Recorder", "start_trace", "stop_trace", "trace"]

# The recorder in use, or None. Read (never written) by the hot path.
ACTIVE: Recorder | None = None
_active_lock = threading.Lock()

DEFAULT_CLIENT = "default"
CONTROLLER_PID = trace_format.CONTROLLER_PID
TRANSFER_TID = trace_format.TRANSFER_TID
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3
_STOP = object()
_ENDED = 1 << 62  # a run's dispatched-steps count once it can dispatch no more

now = time.perf_counter_ns


def client_of(run: Any) -> str:
    """The client a run belongs to: ``run.client``'s name, else its outputs' owner, else "default"."""
    client = getattr(run, "client", None)
    client = getattr(client, "name", client)
    if client is None:
        outputs = getattr(run, "outputs", None)
        owner = getattr(outputs[0], "owner", None) if outputs else None
        client = getattr(owner, "client", None)
    return client if client is not None else DEFAULT_CLIENT


def _device_ids(sharding: Any) -> tuple[int, ...]:
    try:
        return tuple(sorted(d.id for d in sharding.device_set))
    except Exception:
        return ()


class _Work:
    """A dispatched node or transfer the watcher waits on."""

    __slots__ = ("args", "arrays", "cat", "end", "name", "pid", "start", "tids")

    def __init__(self, name: str, cat: str, pid_tids: tuple, arrays: list, start: int, args: dict):
        self.name = name
        self.cat = cat
        self.pid, self.tids = pid_tids
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
    """Collects trace events from the controller, the watcher and user threads.

    Made by :func:`start_trace` / :func:`trace`; hooks in the runtime call its
    methods while it is :data:`ACTIVE`. Methods that take a ``client`` record it
    on the event (``"default"`` until clients exist), and :meth:`waited` records
    back-pressure waits, so later work only has to call them.

    Attributes:
      path: where :meth:`stop` writes the JSON (``None``: kept in memory only).
      events: the trace events recorded so far.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, drain_timeout: float = 60.0):
        self.path = None if path is None else os.fspath(path)
        self.events: list[dict] = []
        self._drain_timeout = drain_timeout
        self._t0 = now()
        self._cond = threading.Condition()
        self._closed = False
        self._draining = False
        self._expected: dict[int, int] = {}  # run id -> steps still to dispatch
        self._seen: collections.Counter[int] = collections.Counter()
        self._threads: dict[int, tuple[int, str]] = {}  # ident -> (tid, name)
        self._tids = itertools.count(1)
        self._cluster: Any = None
        self._tracks: dict[tuple[int, int], str] = {}
        self._processes: dict[int, str] = {CONTROLLER_PID: "controller"}
        self._devices: dict[int, dict] = {}
        self._island_of: dict[int, int] = {}
        self._clients: set[str] = set()
        self._steps: dict[int, tuple[Any, Any]] = {}  # id(step) -> (step, cached info)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._busy_until: dict[tuple[int, int], int] = {}
        self._deadline: float | None = None
        self._unfinished = 0
        self._watcher = reentry.runtime_thread(self._watch, name="pathways-trace-watcher")
        self._watcher.start()

    # --- time and tracks -------------------------------------------------------------

    now = staticmethod(now)
    MIN_WAIT_NS = 20_000

    def _us(self, t: int) -> float:
        return (t - self._t0) / 1e3

    def _thread_tid(self) -> int:
        ident = threading.get_ident()
        known = self._threads.get(ident)
        if known is None:
            known = (next(self._tids), threading.current_thread().name)
            self._threads[ident] = known
        return known[0]

    def _learn_cluster(self, cluster: Any) -> None:
        """Names the tracks of ``cluster``'s devices, from the plain places it gives (``device_places``)."""
        if cluster is None or cluster is self._cluster:
            return
        self._cluster = cluster
        for place in cluster.device_places():
            island = place.island
            self._processes.setdefault(1 + island, f"island {island}")
            if place.id in self._island_of:
                continue
            self._island_of[place.id] = island
            self._devices[place.id] = {
                "id": place.id,
                "island": island,
                "kind": place.kind,
                "host": place.host,
            }
            self._tracks[(1 + island, place.id)] = f"device {place.id} ({place.kind}, host {place.host})"

    # --- controller-side events ------------------------------------------------------

    def complete(
        self,
        name: str,
        cat: str,
        start: int,
        end: int | None = None,
        *,
        client: str | None = None,
        **args: Any,
    ) -> None:
        """Records a span on the calling thread's controller track, from ``start`` to ``end`` (now)."""
        end = now() if end is None else end
        self._controller_event(
            name, cat, client, args, ph="X", ts=self._us(start), dur=max(end - start, 0) / 1e3
        )

    def instant(self, name: str, cat: str, *, client: str | None = None, **args: Any) -> None:
        """Records a point in time on the calling thread's controller track."""
        self._controller_event(name, cat, client, args, ph="i", s="t", ts=self._us(now()))

    def _controller_event(self, name: str, cat: str, client: str | None, args: dict, **fields: Any) -> None:
        if self._closed:
            return
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

    def waited(
        self,
        start: int,
        end: int | None = None,
        *,
        client: str = DEFAULT_CLIENT,
        island: int | None = None,
        reason: str = "back-pressure",
        **args: Any,
    ) -> None:
        """Records a wait of the calling thread: back-pressure, an in-flight window, ...

        Waits shorter than ``MIN_WAIT_NS`` (20 µs) are not worth a slice and are dropped.

        Args:
          start: when the wait began (``Recorder.now()``).
          end: when it ended (default: now).
          client: the client whose work waited.
          island: the island whose resources were awaited, if any.
          reason: what was awaited, e.g. ``"back-pressure"`` (memory budget).
          **args: more detail for the event's ``args``.
        """
        end = now() if end is None else end
        if end - start < self.MIN_WAIT_NS:
            return
        where = f" (island {island})" if island is not None else ""
        self.complete(f"wait: {reason}{where}", "wait", start, end, client=client, island=island, **args)

    def submitted(self, plan: Any, run_id: int, start: int, client: str = DEFAULT_CLIENT) -> None:
        """A run was queued: records the submit span and expects its dispatches."""
        name = plan.graph.name
        self.complete(f"submit {name}", "submit", start, client=client, program=name, run=run_id)
        steps = plan.prepared.reports  # the run's dispatch reports (dispatched / moved / sent)
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

    def run_ended(self, run_id: int) -> None:
        """The controller will dispatch nothing more of this run (it failed)."""
        with self._cond:
            if self._expected.pop(run_id, None) is not None:
                self._cond.notify_all()
            else:  # it may fail (inline) before it is submitted(): expect nothing then
                self._seen[run_id] = _ENDED

    def _exec_info(self, run: Any, step: Any) -> tuple:
        cached = self._steps.get(id(step))
        if cached is not None and cached[0] is step:
            return cached[1]
        plan = run.plan
        self._learn_cluster(plan.cluster)
        node = step.node
        ids = plan.placement.device_ids(node.slice.id)
        info = (
            f"{plan.graph.name}/{node.name}",
            (1 + step.island, ids),
            {
                "program": plan.graph.name,
                "node": node.name,
                "kind": node.kind,
                "source": node.source_info,
                "slice": node.slice.id,
                "island": step.island,
            },
        )
        self._steps[id(step)] = (step, info)
        return info

    def dispatched(self, run: Any, step: Any, outs: Any, start: int) -> None:
        """The controller dispatched a node (``step``) of ``run`` from ``start`` until now."""
        if self._closed:
            return
        end = now()
        name, pid_tids, static = self._exec_info(run, step)
        client = client_of(run)
        self.complete(f"dispatch {name}", "dispatch", start, end, client=client, run=run.id)
        args = dict(static, run=run.id, client=client, dispatched_us=self._us(start))
        self._inbox.put(_Work(name, "execution", pid_tids, list(outs), start, args))
        self._dispatched_step(run.id)

    def sent(self, run: Any, host: int, island: int, ids: tuple[int, ...], marker: Any, start: int) -> None:
        """Ray backend: the controller sent ``host`` (of ``island``, devices ``ids``) its part of ``run``.

        ``marker`` is ready when the host's part is done.
        """
        if self._closed:
            return
        end = now()
        plan = run.plan
        self._learn_cluster(plan.cluster)
        client = client_of(run)
        name = f"{plan.graph.name} on host {host}"
        self.complete(f"dispatch {name}", "dispatch", start, end, client=client, run=run.id)
        args = {
            "program": plan.graph.name,
            "run": run.id,
            "client": client,
            "host": host,
            "island": island,
            "dispatched_us": self._us(start),
        }
        self._inbox.put(_Work(name, "execution", (1 + island, ids), [marker], start, args))
        self._dispatched_step(run.id)

    def moved(self, run: Any, step: Any, src: Any, dst: Any, start: int) -> None:
        """The controller started moving ``src`` to ``dst`` (a transfer or reshard) of ``run``."""
        if self._closed:
            return
        end = now()
        plan = run.plan
        self._learn_cluster(plan.cluster)
        kind = step.kind or "reshard"
        client = client_of(run)
        dst_ids = _device_ids(step.sharding)
        island = self._island_of.get(dst_ids[0], 0) if dst_ids else 0
        nbytes = int(getattr(src, "nbytes", 0))
        self.complete(f"dispatch {kind} transfer", "dispatch", start, end, client=client, run=run.id)
        args = {
            "program": plan.graph.name,
            "run": run.id,
            "client": client,
            "kind": kind,
            "bytes": nbytes,
            "value": aval_text(getattr(src, "aval", None)),
            "src_devices": list(_device_ids(getattr(src, "sharding", None))),
            "dst_devices": list(dst_ids),
            "dispatched_us": self._us(start),
        }
        self._processes.setdefault(1 + island, f"island {island}")
        self._tracks[(1 + island, TRANSFER_TID)] = f"transfers into island {island}"
        name = f"{kind} {nbytes} B"
        self._inbox.put(_Work(name, "transfer", (1 + island, (TRANSFER_TID,)), [dst], start, args))
        self._dispatched_step(run.id)

    # --- the watcher -----------------------------------------------------------------

    def _emit(self, work: _Work, unfinished: bool = False) -> None:
        end = work.end if work.end is not None else now()
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
            t = now()
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
        ACTIVE = Recorder(path, drain_timeout=drain_timeout)
        return ACTIVE


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


# --- hooks of the cold path: they log, and record when tracing ---------------------------

_last_plans: dict[int, tuple[weakref.ref, dict[int, tuple[int, ...]]]] = {}  # id(graph) -> placement, mapping


def _mapping(plan: Any) -> dict[int, tuple[int, ...]]:
    return {slice_id: plan.placement.device_ids(slice_id) for slice_id in plan.placement.slices}


def lowered(plan: Any, start: int) -> None:
    """``lowering.lower`` made ``plan``: logs it (and a remap), records a ``lower`` span."""
    graph = plan.graph
    key = id(graph)
    # The plan's placement, not the plan: a plan is copied once its backend prepares it (the
    # copy shares the placement), and a graph's plans all live while its placement does.
    previous = _last_plans.get(key)
    mapping = _mapping(plan)
    _last_plans[key] = (weakref.ref(plan.placement), mapping)
    if len(_last_plans) > 256:
        for k in [k for k, (ref, _) in _last_plans.items() if ref() is None]:
            del _last_plans[k]
    rec = ACTIVE
    if previous is not None and previous[0]() is not None:  # that graph's placement still lives
        before = previous[1]
        moved = {sid: (before.get(sid), devs) for sid, devs in mapping.items() if before.get(sid) != devs}
        logging.vlog(
            1,
            "program %r (%s) re-lowered after a remap: %s",
            graph.name,
            graph.source_info,
            "; ".join(f"slice #{sid} {a} -> {b}" for sid, (a, b) in moved.items()) or "no change",
        )
        if rec is not None:
            rec.instant(f"remap {graph.name}", "remap", program=graph.name, moved=str(moved))
    else:
        logging.vlog(
            1,
            "program %r (%s): lowered %d nodes onto devices %s in %.1f ms",
            graph.name,
            graph.source_info,
            len(graph.nodes),
            mapping,
            (now() - start) / 1e6,
        )
    if rec is not None:
        rec.complete(f"lower {graph.name}", "lower", start, program=graph.name, nodes=len(graph.nodes))


def compiled(node: Any, start: int) -> None:
    """``lowering`` compiled ``node``: logs it, records a ``compile`` span."""
    ms = (now() - start) / 1e6
    # vlog(1): shown with absl's --v=1 (or set_verbosity(DEBUG)); absl programs
    # print INFO by default and compiles are not news worth that.
    logging.vlog(
        1, "compiled node %r (%s) for slice #%d in %.1f ms", node.name, node.source_info, node.slice.id, ms
    )
    rec = ACTIVE
    if rec is not None:
        rec.complete(
            f"compile {node.name}",
            "compile",
            start,
            node=node.name,
            source=node.source_info,
            slice=node.slice.id,
        )


def failed(run: Any, message: str) -> None:
    """The controller failed ``run``: logs a warning, records a ``failure`` marker."""
    logging.warning("%s", message)
    rec = ACTIVE
    if rec is not None:
        rec.instant("run failed", "failure", client=client_of(run), run=run.id, message=message)
        rec.run_ended(run.id)
