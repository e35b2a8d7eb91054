"""The single controller: the one place where program runs are dispatched.

All dispatch is serialised by the controller's lock and happens in submission
order, so every device of an island sees programs in one consistent order:
concurrent SPMD programs with collectives cannot deadlock (DESIGN §5).
Dispatch is asynchronous: the controller never waits for data, only for the
in-flight bound of an island.

Runs normally go through a queue to a background thread. When that thread is
idle, nothing is queued and the run can be dispatched without waiting (its
inputs exist and its executables fit in the in-flight windows), the
submitting thread takes the lock and dispatches the run itself: the order is
the same, and the hand-off between threads, which costs more than a dispatch,
is saved.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import TYPE_CHECKING, Any

import jax

from pathways_jax._src import counters, errors, timeline
from pathways_jax._src.lowering import ExecStep, MoveStep, Run
from pathways_jax._src.object_store import Failed, Freed, Pending, Ready

if TYPE_CHECKING:
    from pathways_jax._src.cluster import Cluster

_STOP = object()


class Controller:
    """Owns the dispatch lock, the queue and the background thread of a cluster."""

    def __init__(self, cluster: Cluster):
        self._cluster = cluster
        self._store = cluster.store
        self._window = cluster.in_flight
        self._inline = cluster.inline_dispatch
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._in_flight: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._dispatch = threading.Lock()  # held while a run is dispatched
        self._queued_lock = threading.Lock()
        self._queued = 0  # runs in the queue or being dispatched from it
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name="pathways-controller", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, run: Run) -> None:
        if self._stopped:
            raise errors.ClusterError("the cluster was shut down; call pw.init() to start a new one.")
        if self._inline and not self._queued and self._dispatch.acquire(blocking=False):
            try:
                if not self._queued and self._ready_now(run):
                    self._execute(run)
                    return
            finally:
                self._dispatch.release()
        with self._queued_lock:
            self._queued += 1
        self._queue.put(run)

    def stop(self, timeout: float) -> None:
        """Lets queued runs finish dispatching, then ends the thread."""
        self._stopped = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            run = self._queue.get()
            self._store.collect()
            if run is _STOP:
                return
            try:
                with self._dispatch:
                    self._execute(run)
            except BaseException as exc:
                self._fail(run, f"program {run.plan.graph.name!r} run {run.id} failed in the controller", exc)
            finally:
                with self._queued_lock:
                    self._queued -= 1

    def _ready_now(self, run: Run) -> bool:
        """True if dispatching ``run`` needs no waiting: inputs exist, windows have room."""
        if not run.plan.inline_ok:
            return False
        for _, future in run.future_inputs:
            if isinstance(future._entry.state, Pending):
                return False
        for island, count in run.plan.windowed.items():
            in_flight = self._in_flight[island]
            while in_flight and in_flight[0][0].is_ready():
                self._retire(in_flight.popleft(), island, waited=False)
            if len(in_flight) + count > self._window:
                return False
        return True

    def _retire(self, item: tuple, island: int, waited: bool = True) -> None:
        oldest, run = item
        rec = timeline.ACTIVE if waited else None
        t0 = rec.now() if rec is not None else 0
        try:
            oldest.block_until_ready()
        except Exception:  # the run's futures raise it; count the run once
            if not run.failed:
                run.failed = True
                counters.bump("failed_runs")
        if rec is not None:
            rec.waited(t0, client=timeline.client_of(run), island=island, reason="in-flight window")

    def _wait_window(self, island: int) -> None:
        in_flight = self._in_flight[island]
        while len(in_flight) >= self._window:
            self._retire(in_flight.popleft(), island)

    def _execute(self, run: Run) -> None:
        env = run.env
        graph = run.plan.graph
        rec = timeline.ACTIVE
        for slot, future in run.future_inputs:
            entry = future._entry
            state = entry.state
            if type(state) is Ready:
                env[slot] = state.array
                continue
            self._store.wait_settled(entry, None)
            match entry.state:
                case Ready(array):
                    env[slot] = array
                case Failed(message, cause):
                    self._fail(
                        run,
                        f"program {graph.name!r} run {run.id} got an input from a failed run: {message}",
                        cause,
                    )
                    return
                case Freed():
                    self._fail(run, f"program {graph.name!r} run {run.id} got an input that was freed", None)
                    return
        step: Any = None
        dispatched = 0
        try:
            for step in run.plan.steps:
                if isinstance(step, ExecStep):
                    if step.windowed:
                        self._wait_window(step.island)
                    if rec is not None:
                        t0 = rec.now()
                    outs = step.executable(*[env[s] for s in step.in_slots])
                    if step.pinned:
                        outs = list(outs)
                        for position, device in step.pinned:
                            outs[position] = next(
                                shard.data
                                for shard in outs[position].addressable_shards
                                if shard.device == device
                            )
                    for slot, array in zip(step.out_slots, outs, strict=True):
                        env[slot] = array
                    if outs and step.windowed:
                        self._in_flight[step.island].append((outs[0], run))
                    dispatched += 1
                    if rec is not None:
                        rec.dispatched(run, step, outs, t0)
                else:
                    if rec is not None:
                        t0 = rec.now()
                    try:
                        env[step.dst] = jax.device_put(env[step.src], step.sharding)
                    except Exception as exc:
                        raise errors.TransferError(
                            f"moving a value ({step.kind or 'reshard'}) onto {step.sharding} failed: {exc}"
                        ) from exc
                    if step.kind is not None:
                        counters.bump(f"transfers_{step.kind}")
                    if rec is not None:
                        rec.moved(run, step, env[step.src], env[step.dst], t0)
        except Exception as exc:  # a user error fails its run only
            self._fail(run, self._where(graph.name, run.id, step), exc)
            return
        finally:
            counters.bump("dispatches", dispatched)
            run.future_inputs = []
        set_ready = self._store.set_ready
        for out, entry in zip(run.plan.outputs, run.outputs, strict=True):
            if out.kind == "slot":
                set_ready(entry, env[out.where])
        self._store.wake()
        run.env = []

    @staticmethod
    def _where(program: str, run_id: int, step: Any) -> str:
        if isinstance(step, ExecStep):
            return (
                f"program {program!r} run {run_id} failed in node {step.node.name!r} "
                f"({step.node.source_info})"
            )
        if isinstance(step, MoveStep):
            return f"program {program!r} run {run_id} failed moving a value ({step.kind or 'reshard'})"
        return f"program {program!r} run {run_id} failed"

    def _fail(self, run: Run, message: str, cause: BaseException | None) -> None:
        run.failed = True
        counters.bump("failed_runs")
        detail = f"{message}: {type(cause).__name__}: {cause}" if cause is not None else message
        timeline.failed(run, detail)
        for entry in run.outputs:
            self._store.set_failed(entry, detail, cause)
        self._store.wake()
        run.future_inputs = []
        run.env = []
