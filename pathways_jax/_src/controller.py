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

Runs wait in one FIFO queue per client; the scheduling policy
(``scheduler.py``) picks which client's head goes next among the heads that
can go now (inputs computed, memory budget met; heads whose islands have no
in-flight room only if no other can go). With a memory budget, a run's node
output bytes are reserved before dispatch; a run that does not fit waits.
Accounting (device busy time, per-client usage) is measured by a watcher
thread (``accounting.py``) that the controller never waits for.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any

import jax
from absl import logging

from pathways_jax._src import counters, errors, readiness, scheduler, timeline
from pathways_jax._src.accounting import Accounting
from pathways_jax._src.lowering import ExecStep, MoveStep, Run
from pathways_jax._src.object_store import Failed, Freed, Pending, Ready

if TYPE_CHECKING:
    from pathways_jax._src.cluster import Cluster

_now = time.perf_counter_ns
# What keeps a queued head from going now (in order of preference).
_GO, _NO_ROOM, _INPUT, _MEMORY = 0, 1, 2, 3
_BLOCKED_POLL_S = 0.002  # how often a blocked head is looked at again
_DEFAULT_COST_S = 1e-4  # a run's device time before any was measured
REMOTE_RUNS_IN_FLIGHT = 64  # Ray backend: runs sent to one host and not complete yet


class Controller:
    """Owns the dispatch lock, the queue and the background thread of a cluster."""

    def __init__(self, cluster: Cluster):
        self._cluster = cluster
        self._store = cluster.store
        # On the Ray backend the hosts bound their own executables in flight
        # (max_in_flight); here the window counts runs per host.
        self._window = cluster.in_flight if cluster.remote is None else REMOTE_RUNS_IN_FLIGHT
        self._inline = cluster.inline_dispatch
        self._remote = cluster.remote
        self._in_flight: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._dispatch = threading.Lock()  # held while a run is dispatched
        # Guards the per-client queues and the policy; reentrant because a
        # budget release (which notifies it) may happen on a thread holding it.
        # Taken as the bare lock (``with self._lock``), which is the condition's
        # own: a Condition's __enter__ and __exit__ are Python frames.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._sleeping = False  # the controller thread waits on _cv: a submission notifies it
        self._queues: dict[int, collections.deque[Run]] = {}  # client key -> its queued runs
        self._queued = 0  # runs in the queues or being dispatched from them
        self._seq = itertools.count()
        self._policy: scheduler.Policy = scheduler.make(
            cluster.scheduler, starvation_limit=cluster.starvation_limit
        )
        self._budget = self._store.budget
        self._bp_timeout = cluster.backpressure_timeout
        if self._budget is not None:
            self._budget.listeners.append(self._wake)
        self.accounting = Accounting([d.id for d in cluster.devices], self._run_done)
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name="pathways-controller", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, run: Run) -> None:
        if self._stopped:
            raise errors.ClusterError("the cluster was shut down; call pw.init() to start a new one.")
        # Inline only while nothing is queued: a thread never bypasses the policy.
        if self._inline and not self._queued and self._dispatch.acquire(blocking=False):
            try:
                if not self._queued and self._ready_now(run) and self._admit(run):
                    run.seq = next(self._seq)
                    if self._policy.charges:
                        self._charge(run)
                    self._execute(run)
                    return
            except Exception as exc:  # the controller's own bookkeeping: fail this run only
                self._internal_error(run, exc)
                return
            finally:
                self._dispatch.release()
        key = run.client.key
        with self._lock:
            run.seq = next(self._seq)
            run.head = self._head(run)
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = collections.deque()
                self._policy.activate(key)
            queue.append(run)
            self._queued += 1
            if self._sleeping:
                self._cv.notify()

    def stop(self, timeout: float) -> None:
        """Lets queued runs finish dispatching, then ends the thread."""
        self._stopped = True
        self._wake()
        self._thread.join(timeout)
        self.accounting.stop()

    def _wake(self) -> None:
        with self._lock:
            self._cv.notify_all()

    def _serve(self) -> None:
        finished = False
        while True:
            try:
                self._store.collect()
                run = self._next(finished)
            except Exception as exc:  # a bug in the controller's own bookkeeping: keep serving
                finished = False
                logging.error("pathways_jax controller: picking the next run failed: %r", exc)
                time.sleep(_BLOCKED_POLL_S)
                continue
            if run is None:
                return
            finished = True
            try:
                with self._dispatch:
                    self._execute(run)
            except BaseException as exc:
                self._internal_error(run, exc)

    def _internal_error(self, run: Run, exc: BaseException) -> None:
        """Fails ``run`` after an error of the controller's own (not of the user's code)."""
        logging.error("pathways_jax controller failed on run %d: %r", run.id, exc)
        cause = errors.PathwaysError(
            f"pathways_jax's controller failed while handling this run ({type(exc).__name__}: {exc}). "
            "This is a bug of pathways_jax: please report it. Other programs keep running."
        )
        cause.__cause__ = exc
        try:
            self._fail(run, f"program {run.plan.graph.name!r} run {run.id} failed in the controller", cause)
        except Exception as again:  # pragma: no cover - last resort: never let it escape
            logging.error("pathways_jax controller could not fail run %d: %r", run.id, again)

    def _sleep(self, timeout: float | None = None) -> None:
        """Waits on the condition (lock held) until a submission or a release notifies it."""
        self._sleeping = True
        try:
            self._cv.wait(timeout)
        finally:
            self._sleeping = False

    # --- scheduling ----------------------------------------------------------------------

    def _head(self, run: Run) -> scheduler.Head:
        client = run.client
        plan = run.plan
        cost = plan.cost or _DEFAULT_COST_S * max(1, len(plan.acct_groups))
        return scheduler.Head(client.key, run.seq, client.priority, client.weight, cost)

    def _charge(self, run: Run) -> None:
        """Charges an inline dispatch (one the policy did not pick) to its client."""
        client = run.client
        plan = run.plan
        cost = run.estimate = plan.cost or _DEFAULT_COST_S * max(1, len(plan.acct_groups))
        with self._lock:
            self._policy.charge(client.key, cost, client.weight)

    def _blocker(self, run: Run, busy: dict[int, int] | None = None) -> int:
        """What keeps ``run`` from being dispatched now (``_GO``: nothing).

        ``busy``: executables in flight per island, filled as islands are
        looked at, so that one pass over the clients' heads asks each island's
        in-flight outputs once, not once per head.
        """
        for _, future in run.future_inputs:
            if type(future._entry.state) is Pending:
                return _INPUT
        budget = self._budget
        if budget is not None and not budget.fits(run.plan.charge):
            return _MEMORY
        window = self._window
        for island, count in run.plan.windowed.items():
            running = None if busy is None else busy.get(island)
            if running is None:
                # Read-only: an inline dispatch may be retiring from these deques now.
                items = list(self._in_flight[island])
                running = len(items)
                # Runs on a host leave at dispatch. Local ones are asked only if
                # the window looks full, oldest first, up to the first one still
                # running (every question is a call into XLA); those behind it
                # count as running, which at worst sends a run to the queue.
                if self._remote is None and running + count > window:
                    for item in items:
                        if not readiness.settled(item[0]):
                            break
                        running -= 1
                if busy is not None:
                    busy[island] = running
            if running + count > window:
                return _NO_ROOM
        return _GO

    def _next(self, finished: bool) -> Run | None:
        """Waits for a run the policy picks among the heads that can go; None once stopped.

        ``finished``: the run this returned last time has been dispatched (it
        leaves the count of queued runs here, under the lock taken anyway).
        """
        with self._lock:
            if finished:
                self._queued -= 1
            while True:
                if not self._queues:
                    if self._stopped:
                        return None
                    self._sleep()
                    continue
                go: list[Run] = []
                no_room: list[Run] = []
                blocked: list[Run] = []
                busy: dict[int, int] = {}
                # Heads of one plan without future inputs are held back (or not)
                # by the same things: look once per plan, not once per client.
                verdicts: dict[int, int] = {}
                broken: list[tuple[Run, Exception]] = []
                for queue in self._queues.values():
                    run = queue[0]
                    try:
                        if run.future_inputs:
                            why = self._blocker(run, busy)
                        else:
                            verdict = verdicts.get(id(run.plan))
                            if verdict is None:
                                verdict = verdicts[id(run.plan)] = self._blocker(run, busy)
                            why = verdict
                    except Exception as exc:
                        broken.append((run, exc))
                        continue
                    if why == _GO:
                        go.append(run)
                    elif why == _NO_ROOM:
                        no_room.append(run)
                    else:
                        blocked.append(run)
                        if why == _MEMORY and run.blocked_since is None:
                            run.blocked_since = time.monotonic()
                            run.blocked_ns = _now()
                if broken:
                    for run, error in broken:
                        self._drop(run)
                        self._internal_error(run, error)
                    continue
                candidates = go or no_room
                if candidates:
                    heads = [run.head for run in candidates]
                    run = candidates[0]
                    try:
                        index = self._policy.pick(heads)
                        run = candidates[index]
                        if not self._admit(run):  # memory went between the check and now
                            self._sleep(_BLOCKED_POLL_S)
                            continue
                        # Charged at the cost known now: the estimate moves while a run waits.
                        heads[index] = self._head(run)
                        self._policy.picked(heads, index)
                        run.estimate = heads[index].cost
                    except Exception as exc:  # the policy's bookkeeping: the picked run fails alone
                        self._drop(run)
                        self._internal_error(run, exc)
                        continue
                    self._pop(run)
                    if run.blocked_since is not None:
                        rec = timeline.ACTIVE
                        if rec is not None:
                            rec.waited(
                                run.blocked_ns,
                                client=run.client.name,
                                island=min(run.plan.islands, default=None),
                                reason="back-pressure",
                                bytes=sum(b for _, b in run.plan.charge),
                            )
                    return run
                self._expire(blocked)
                self._sleep(_BLOCKED_POLL_S)
                self._store.collect()

    def _pop(self, run: Run) -> None:
        """Takes ``run``, its client's head, off the queue (lock held)."""
        key = run.client.key
        queue = self._queues[key]
        queue.popleft()
        if not queue:
            del self._queues[key]
            self._policy.deactivate(key)

    def _drop(self, run: Run) -> None:
        """Takes ``run`` off the queue without dispatching it (lock held): it fails."""
        self._pop(run)
        self._queued -= 1
        self._policy.discard(run.head)

    def _expire(self, blocked: list[Run]) -> None:
        """Fails heads that waited for memory past the timeout (all of them once stopped)."""
        moment = time.monotonic()
        for run in blocked:
            since = run.blocked_since
            if since is None:
                if not self._stopped:
                    continue
            elif not self._stopped and (self._bp_timeout is None or moment - since < self._bp_timeout):
                continue
            self._drop(run)
            if self._stopped or since is None:  # (not stopped: it waited, since is set)
                self._fail(
                    run,
                    f"program {run.plan.graph.name!r} run {run.id} was cancelled: the cluster shut down",
                    None,
                )
                continue
            need = ", ".join(f"device {d}: {b} B" for d, b in run.plan.charge)
            budget = self._budget
            have = (
                ", ".join(
                    f"device {d}: {budget.used.get(d, 0)}/{budget.limits.get(d)} B in use"
                    for d, _ in run.plan.charge
                )
                if budget is not None
                else "no memory budget"
            )
            message = (
                f"program {run.plan.graph.name!r} run {run.id} of client {run.client.name!r} waited "
                f"{moment - since:.2f}s (backpressure_timeout={self._bp_timeout}s) for device "
                f"memory: it needs {need}; {have}. Free values you no longer need (drop their futures) "
                "or raise pw.init(memory_budget=...)."
            )
            self._fail(
                run,
                f"program {run.plan.graph.name!r} run {run.id} was not admitted",
                errors.BackPressureTimeout(message),
            )

    def _admit(self, run: Run) -> bool:
        """Reserves the run's node output bytes under the memory budget; False if they don't fit."""
        budget = self._budget
        if budget is None:
            return True
        plan = run.plan
        with budget.lock:
            if not budget.try_reserve(plan.charge):
                return False
            transient = dict(plan.charge)
            for entry, charge in zip(run.outputs, plan.out_charges, strict=True):
                if charge and not isinstance(entry.state, Freed):
                    entry.charge = charge
                    for d, b in charge:
                        transient[d] -= b
            run.transient = tuple((d, b) for d, b in transient.items() if b)
        return True

    def _run_done(self, run: Run, device_s: float, error: BaseException | None) -> None:
        """Called by the accounting watcher once every output of a dispatched run is ready."""
        if run.transient:
            transient, run.transient = run.transient, ()
            if self._budget is not None:  # a run holds transient bytes only under a budget
                self._budget.release(transient)
        if error is not None and not run.failed:
            run.failed = True
            counters.bump("failed_runs")
            message = f"program {run.plan.graph.name!r} run {run.id} failed while executing"
            timeline.failed(run, f"{message}: {type(error).__name__}: {error}")
            for entry in run.outputs:
                cause: BaseException = error
                match entry.state:
                    case Ready(array):
                        try:
                            array.block_until_ready()
                        except Exception as exc:
                            cause = exc
                self._store.free([entry], failure=(f"{entry.origin} failed while executing: {cause}", cause))

    def close_client(self, client: Any) -> None:
        """Cancels ``client``'s queued runs and frees the values it owns."""
        with self._lock:
            queue = self._queues.pop(client.key, None)
            if queue:
                self._queued -= len(queue)
                for run in queue:
                    self._policy.discard(run.head)
                self._policy.deactivate(client.key)
            self._policy.forget(client.key)
            self._cv.notify_all()
        for run in queue or ():
            self._fail(
                run,
                f"program {run.plan.graph.name!r} run {run.id} was cancelled: client {client.name!r} was closed",
                None,
                count=False,
            )
        self._store.free(self._store.owned_by(client.key))

    def queued_by_island(self) -> dict[int, int]:
        with self._lock:
            runs = [run for queue in self._queues.values() for run in queue]
        counts: collections.Counter[int] = collections.Counter()
        for run in runs:
            counts.update(run.plan.islands)
        return dict(counts)

    def queued_by_client_name(self) -> dict[str, int]:
        counts: collections.Counter[str] = collections.Counter()
        with self._lock:
            for queue in self._queues.values():
                if queue:
                    counts[queue[0].client.name] += len(queue)
        return dict(counts)

    def in_flight_by_island(self) -> dict[int, int]:
        return {
            island: sum(1 for item in list(items) if not readiness.settled(item[0]))
            for island, items in list(self._in_flight.items())
        }

    def _ready_now(self, run: Run) -> bool:
        """True if ``run`` may be dispatched on the caller's thread: nothing would wait."""
        return run.plan.inline_ok and self._blocker(run) == _GO

    def _retire(self, item: tuple, island: int, waited: bool = True) -> None:
        oldest, run = item
        rec = timeline.ACTIVE if waited else None
        t0 = rec.now() if rec is not None else 0
        try:
            readiness.block(oldest)  # a later run may have consumed it (donation): not a failure
        except Exception:  # the run's futures raise it; count the run once
            if not run.failed:
                run.failed = True
                counters.bump("failed_runs")
        if rec is not None:
            rec.waited(t0, client=timeline.client_of(run), island=island, reason="in-flight window")

    def _wait_window(self, island: int) -> None:
        """Makes room for one more executable on ``island``.

        A full window is drained to half before dispatch goes on: the
        dispatching thread then wakes once per half window of runs instead of
        once per run, and half a window still queued keeps the devices busy.
        """
        in_flight = self._in_flight[island]
        if len(in_flight) >= self._window:
            low = self._window // 2
            while len(in_flight) > low:
                self._retire(in_flight.popleft(), island)

    def _execute(self, run: Run) -> None:
        started = _now()
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
        if run.plan.remote is not None:
            self._execute_remote(run, started)
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
            if run.plan.consumed_feeds:
                self._spend(run)
        except Exception as exc:  # a user error fails its run only
            self._fail(run, self._where(graph.name, run.id, step), exc)
            return
        finally:
            counters.bump("dispatches", dispatched)
            run.future_inputs = []
        self._publish(run, started, env, tuple([env[slot] for _, slot, _ in run.plan.acct_groups]))

    def _spend(self, run: Run) -> None:
        """Futures whose buffers the run's executables consumed (donated) cannot be read again."""
        consumed = run.plan.consumed_feeds
        for slot, future in run.future_inputs:
            if slot in consumed:
                entry = future._entry
                message = (
                    f"{entry.origin} was donated to program {run.plan.graph.name!r} (donate_argnums) "
                    "and its buffer was reused; use the program's outputs instead."
                )
                self._store.free([entry], failure=(message, None))

    def _publish(self, run: Run, started: int, values: Any, last: tuple) -> None:
        """A dispatched run's outputs become ready (``values[slot]``); the watcher gets ``last``."""
        set_ready = self._store.set_ready
        for out, entry in zip(run.plan.outputs, run.outputs, strict=True):
            if out.kind == "slot":
                set_ready(entry, values[out.where])
        self._store.wake()
        self.accounting.note(run, started, last)
        run.env = []

    def _execute_remote(self, run: Run, started: int) -> None:
        """Ray backend: one message per host of the run; the hosts do the rest."""
        plan = run.plan
        remote_plan = plan.remote
        if remote_plan is None:
            raise errors.PathwaysError(
                f"program {plan.graph.name!r} was dispatched to the Ray hosts without its host plan; "
                "this is a bug in pathways_jax, please report it."
            )
        remote = self._remote
        for island in plan.windowed:
            remote.retire_ready(self._in_flight[island])
            self._wait_window(island)
        rec = timeline.ACTIVE
        t0 = rec.now() if rec is not None else 0
        try:
            outputs, markers = remote.dispatch(run)
        except Exception as exc:
            self._fail(run, f"program {plan.graph.name!r} run {run.id} could not be sent to its hosts", exc)
            return
        finally:
            run.future_inputs = []
        counters.bump("dispatches", len(markers))
        for kind, count in remote_plan.transfers.items():
            counters.bump(f"transfers_{kind}", count)
        for host, marker in markers.items():
            self._in_flight[host].append((marker, run))
            if rec is not None:
                rec.sent(run, host, marker, t0)
        slot_host = remote_plan.slot_host
        self._publish(
            run, started, outputs, tuple([markers[slot_host[slot]] for _, slot, _ in plan.acct_groups])
        )

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

    def _fail(self, run: Run, message: str, cause: BaseException | None, *, count: bool = True) -> None:
        """Fails every output of ``run`` and frees what it holds; other runs are not touched."""
        run.failed = True
        if count:
            counters.bump("failed_runs")
            self.accounting.failed(run)
        detail = f"{message}: {type(cause).__name__}: {cause}" if cause is not None else message
        timeline.failed(run, detail)
        if run.transient:
            transient, run.transient = run.transient, ()
            if self._budget is not None:  # a run holds transient bytes only under a budget
                self._budget.release(transient)
        self._store.free(list(run.outputs), failure=(detail, cause))
        run.future_inputs = []
        run.env = []
