"""Accounting: device busy time, utilisation and per-client usage, measured off the hot path.

After dispatching a run the controller hands the watcher one record: the run,
when its dispatch began, and for each set of devices it used the output of its
last node there. The watcher (a daemon thread) notes when those outputs become
ready; a run's busy interval on a device is ``[max(dispatch, previous end on
that device), ready]``. Runs seen ready at the same moment on a device share
that interval in proportion to their node counts there. The controller never
waits for the watcher.

When all of a run's outputs are ready the watcher calls back the controller,
which releases the run's intermediate bytes and fails the run if an output
raised; the measured device time updates the plan's cost estimate (an EMA),
which the fair scheduler charges each run.

Usage is kept per live client only: a closed client's usage joins one row,
``CLOSED_CLIENTS``, as do its runs that finish after it closed, so a process
that makes a client per request keeps a bounded table.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from pathways_jax._src.core import readiness, reentry
from pathways_jax._src.core.gone import Gone
from pathways_jax._src.runtime.admission import fold, fold_median

now = time.perf_counter_ns
# The watcher is never woken per run (a wake-up per run costs the dispatching
# thread a GIL hand-off): when idle it looks for new notes this often, and
# otherwise it looks at the oldest unfinished run at most every 0.5-2 ms. It
# sleeps in Python, never inside XLA: a thread blocked inside XLA at
# interpreter exit aborts the process when it wakes, so exit without
# pw.shutdown() could not be clean.
_IDLE_POLL_S = 2e-3
# After each accounted batch the watcher sleeps this long, so that it takes the
# GIL once per batch of short runs rather than once per run: end times are
# known to about this granularity (exactly for runs longer than it).
_BATCH_S = 4e-3
# How long every run stays accounted before on_idle is called: a caller that reads each result
# and calls again within it (a loop) is not paid a hook's work on every call.
_IDLE_HOOK_S = 0.02
_STOP_TIMEOUT_S = 10.0  # how long stop() waits for the watcher unless told
# The pw.stats() row summing every closed client (a name pw.client refuses).
CLOSED_CLIENTS = "(closed clients)"


def _ready(arrays: tuple) -> bool:
    return all(readiness.settled(array) for array in arrays)


def _block(arrays: tuple) -> None:
    for array in arrays:
        # Deleted (or donated) by its user once computed: not a failure of the run.
        readiness.block(array)


@dataclasses.dataclass(slots=True)
class Note:
    """Dispatched runs of one plan and client the watcher waits for (one run, or several folded).

    ``run`` is the newest, ``start`` the first dispatch, ``arrays`` the newest
    run's last output on each device set of the plan, ``count`` how many runs.
    Updated in place while folding: no allocation per folded run.
    """

    run: Any
    start: int
    arrays: tuple
    count: int = 1


@dataclasses.dataclass(slots=True)
class _Group:
    """The notes of one plan and client in a batch the watcher accounts together."""

    plan: Any
    client: Any
    runs: int
    start: int  # the first dispatch among them


@dataclasses.dataclass(slots=True)
class _PlanTime:
    """Device time measured for one plan's runs in a batch (every client's)."""

    plan: Any
    ns: int = 0
    runs: int = 0


@dataclasses.dataclass(slots=True)
class ClientUsage:
    name: str
    device_ns: int = 0
    programs: int = 0
    failures: int = 0
    # Runs per live plan (by plan key): device time is attributed per plan at read
    # time (see snapshot); once a plan is gone its share moves to settled_ns.
    runs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    settled_ns: int = 0
    # The CLOSED_CLIENTS row only: how many closed clients it sums.
    clients: int = 0


class Accounting:
    """Busy time per device and usage per client, fed by the controller, read by ``pw.stats()``."""

    def __init__(self, device_ids: list[int], on_done: Callable[[Any, float, BaseException | None], None]):
        self._on_done = on_done
        self._lock = threading.Lock()
        self._device_ids = list(device_ids)
        self._end: dict[int, int] = {}
        self._started = False
        self._start_lock = threading.Lock()
        self._busy = False  # the watcher holds records not accounted yet
        # Called on the watcher's thread once every run it was given stayed accounted for
        # _IDLE_HOOK_S (the controller's: its windows let go of the outputs they watched).
        self.on_idle: Callable[[], None] = lambda: None
        # Notes are appended by the dispatcher (no lock: deque appends are
        # atomic) and taken by the watcher, which is woken only when it sleeps.
        self._notes: collections.deque[Note] = collections.deque()
        self._batch: list[Note] = []  # the notes being accounted now (failed with them on a bug)
        # What stop() puts in to wake the watcher: one C call, where a threading.Event's set()
        # takes its Condition's lock in a Python frame, and a Ctrl-C landing as that lock was
        # taken left it held: the watcher, and every later stop(), waited for it for ever.
        self._wakeup: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._open: dict[tuple, Note] = {}  # folded records, taken by the watcher
        # Keys of plans with figures here, and of those garbage-collected since
        # (a finaliser only appends: it may run at any allocation, lock held or not).
        self._tracked: set[int] = set()
        self._gone: Gone[int] = Gone()
        # Each live plan's cost estimate: a smoothed mean of a run's measured device-seconds
        # (admission.fold), by plan key; absent: not measured yet. Not cleared by reset().
        self.costs: dict[int, float] = {}
        self._measured_once: set[int] = set()  # plans whose estimate is their first measurement
        # Each live plan's median device-seconds a run over its latest measurements
        # (admission.fold_median): whether its runs are short. Absent: not measured yet.
        self.medians: dict[int, float] = {}
        self._recent: dict[int, collections.deque[float]] = {}
        self._open_lock = threading.Lock()
        self._stopping = False
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.t0 = now()
            self.busy: collections.Counter[int] = collections.Counter()
            self.usage: dict[int, ClientUsage] = {}  # live clients' usage, by client key
            self.closed_usage = ClientUsage(CLOSED_CLIENTS)  # every closed client's, together
            self.plan_ns: collections.Counter[int] = collections.Counter()
            self.plan_runs: collections.Counter[int] = collections.Counter()

    def cost(self, plan: Any) -> float:
        """``plan``'s estimated device-seconds a run (0.0: none measured yet)."""
        return self.costs.get(plan.key, 0.0)

    def median(self, plan: Any) -> float:
        """The median device-seconds a run of ``plan`` measured lately (0.0: none measured yet)."""
        return self.medians.get(plan.key, 0.0)

    def _settle_gone(self) -> None:
        """Moves the figures of plans that were garbage-collected into their clients' rows (lock held).

        Keeps the accounting's size bounded by the live plans, however many
        throw-away programs come and go.
        """
        while self._gone:
            key = self._gone.popleft()
            self._tracked.discard(key)
            self.costs.pop(key, None)
            self._measured_once.discard(key)
            self.medians.pop(key, None)
            self._recent.pop(key, None)
            ns, runs = self.plan_ns.pop(key, 0), self.plan_runs.pop(key, 0)
            for usage in (*self.usage.values(), self.closed_usage):
                mine = usage.runs.pop(key, 0)
                if mine and runs:
                    usage.settled_ns += mine * ns // runs

    def _usage(self, client: Any) -> ClientUsage:
        """The row ``client``'s usage goes to (lock held): its own, or the closed clients' row."""
        usage = self.usage.get(client.key)
        if usage is None:
            if client.closed or client.ended:  # set before forget() runs: no row comes back
                return self.closed_usage
            usage = self.usage[client.key] = ClientUsage(client.name)
        return usage

    def forget(self, client: Any) -> None:
        """``client`` was closed: its usage joins the ``CLOSED_CLIENTS`` row, and so will later runs of it."""
        with self._lock:
            usage = self.usage.pop(client.key, None)
            closed = self.closed_usage
            closed.clients += 1
            if usage is not None:
                closed.programs += usage.programs
                closed.failures += usage.failures
                closed.runs.update(usage.runs)
                closed.settled_ns += usage.settled_ns

    def note(self, run: Any, start: int, arrays: tuple) -> None:
        """A run was dispatched at ``start``; ``arrays``: the last output on each of its device sets.

        Runs of one plan and client dispatched between two looks of the watcher
        are folded into one record (first start, newest outputs, count): the
        watcher's work then grows with the kinds of runs, not their number,
        and it is that work that competes with dispatch for the GIL. Runs that
        hold intermediate bytes are recorded one by one (each is released).
        """
        if run.transient:
            self._notes.append(Note(run, start, arrays))
        else:
            key = (run.plan.key, run.client.key)
            with self._open_lock:
                record = self._open.get(key)
                if record is None:
                    self._open[key] = Note(run, start, arrays)
                else:
                    record.run = run
                    record.arrays = arrays
                    record.count += 1
        if not self._started:
            self._start()

    def failed(self, run: Any) -> None:
        """A run failed before (or while) being dispatched: count it."""
        with self._lock:
            usage = self._usage(run.client)
            usage.failures += 1

    def idle(self) -> bool:
        """True when every noted run was accounted."""
        return not self._notes and not self._open and not self._busy

    def stop(self, timeout: float | None = _STOP_TIMEOUT_S) -> None:
        """Ends the watcher; waits for it up to ``timeout`` seconds (``None``: as long as it takes).

        Waiting keeps a thread from being inside XLA at exit. A watcher that
        does not end in time (it waits for a hung host) is left running as a
        daemon thread, and logged.
        """
        self._stopping = True
        self._wakeup.put(None)
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(None if timeout is None else max(timeout, 0.0))
        if thread.is_alive():
            logging.warning(
                "pathways_jax: the accounting watcher did not stop within %ss (it waits for a run's "
                "outputs); it is left running as a daemon thread.",
                timeout,
            )

    def _start(self) -> None:
        with self._start_lock:
            if not self._started:
                self._thread = reentry.runtime_thread(self._watch, name="pathways-accounting")
                self._thread.start()
                self._started = True

    # --- the watcher ---------------------------------------------------------------------

    def _watch(self) -> None:
        pending: collections.deque[Note] = collections.deque()
        notes = self._notes
        idle_since, hook_due = 0.0, False
        while not self._stopping:
            if not pending and not notes and not self._open:
                if self._busy:
                    self._busy = False
                    idle_since, hook_due = time.monotonic(), True
                elif hook_due and time.monotonic() - idle_since >= _IDLE_HOOK_S:
                    hook_due = False
                    try:
                        self.on_idle()
                    except Exception:  # pragma: no cover - a bug: the watcher keeps serving
                        logging.exception("pathways_jax: the accounting watcher's idle hook failed")
                with contextlib.suppress(queue.Empty):
                    self._wakeup.get(timeout=_IDLE_POLL_S)
                continue
            self._busy = True
            try:
                self._step(pending)
            except Exception as exc:  # the watcher's own bookkeeping failed: fail its runs, go on
                self._internal_error(pending, exc)

    def _internal_error(self, pending: collections.deque[Note], exc: Exception) -> None:
        """Fails the runs the watcher holds after a bug of its own; the watcher keeps serving."""
        from pathways_jax._src.core import errors

        logging.error("pathways_jax accounting failed; the runs it held fail: %r", exc)
        notes = list(pending) + self._batch
        pending.clear()
        self._batch = []
        for note in notes:
            cause = errors.PathwaysError(
                f"pathways_jax's accounting failed while it watched this run ({type(exc).__name__}: "
                f"{exc}); the run's outputs are not trusted. This is a bug of pathways_jax: please "
                "report it. Other programs keep running."
            )
            cause.__cause__ = exc
            with contextlib.suppress(Exception):
                self._on_done(note.run, 0.0, cause)

    def _step(self, pending: collections.deque[Note]) -> None:
        """Takes new notes, waits for the oldest run, and accounts every run that is done."""
        notes = self._notes
        while notes:
            pending.append(notes.popleft())
        if self._open:
            with self._open_lock:
                folded, self._open = self._open, {}
            pending.extend(folded.values())
        # Runs on the same devices finish in dispatch order: wait (in XLA,
        # without the GIL) for the oldest, then take every run that is done.
        head = pending[0]
        behind = _ready(head.arrays)
        if not behind:
            readiness.poll(head.arrays, lambda: self._stopping)
        t = now()
        # Runs of one plan use the same devices and finish in dispatch order:
        # once the newest finished run of a plan is found, every older run of
        # it is done too. So readiness is asked once per plan, not per run
        # (every question costs the dispatching thread GIL time).
        done_plans: set[int] = set()
        batch, keep = [], []
        for note in reversed(pending):
            plan_id = id(note.run.plan)
            if plan_id in done_plans or _ready(note.arrays):
                done_plans.add(plan_id)
                batch.append(note)
            else:
                keep.append(note)
        pending.clear()
        pending.extend(reversed(keep))
        batch.reverse()
        self._batch = batch  # failed too if accounting them breaks
        self._account(batch, t)
        self._batch = []
        if behind or len(batch) > 1 or t - head.start < _BATCH_S * 1e9:
            # Short runs: wake once per batch (end times then known to _BATCH_S).
            time.sleep(_BATCH_S)

    def _account(self, batch: list[Note], t: int) -> None:
        # Execution errors are looked for once per record: exact for runs noted
        # alone; for a folded record, the newest run's (the others' futures
        # still raise their own errors).
        # Runs of one plan and client are accounted together: the watcher's work
        # per batch grows with the kinds of runs in it, not with their number.
        groups: dict[tuple, _Group] = {}
        for note in batch:
            run = note.run
            key = (run.plan.key, run.client.key)
            group = groups.get(key)
            if group is None:
                groups[key] = _Group(run.plan, run.client, note.count, note.start)
            else:
                group.runs += note.count
                group.start = min(group.start, note.start)
        durations = []
        with self._lock:
            self._settle_gone()
            per_device: dict[int, list[tuple[_Group, int]]] = collections.defaultdict(list)
            for group in groups.values():
                for acct in group.plan.acct_groups:
                    weight = group.runs * acct.node_count
                    for d in acct.devices:
                        per_device[d].append((group, weight))
            spent: collections.Counter[int] = collections.Counter()
            for d, items in per_device.items():
                start = max(min(group.start for group, _ in items), self._end.get(d, 0), self.t0)
                span = max(t - start, 0)
                total = sum(weight for _, weight in items)
                for group, weight in items:
                    spent[id(group)] += span * weight // total if total else 0
                self.busy[d] += span
                self._end[d] = max(self._end.get(d, 0), t)
            # Device time is measured per plan (over every client's runs of it) and
            # shared among clients by their runs of the plan when read. Charging
            # each client the spans its records were accounted in skews it: a
            # client's folded record is accounted when its newest run is done,
            # often a span after its older runs ran.
            per_plan: dict[int, _PlanTime] = {}
            for group in groups.values():
                totals = per_plan.get(group.plan.key)
                if totals is None:
                    totals = per_plan[group.plan.key] = _PlanTime(group.plan)
                totals.ns += spent.get(id(group), 0)
                totals.runs += group.runs
            for totals in per_plan.values():
                plan, ns, runs = totals.plan, totals.ns, totals.runs
                seconds = ns / runs / 1e9
                fold(self.costs, self._measured_once, plan.key, seconds)
                fold_median(self.medians, self._recent, plan.key, seconds)
                if plan.key not in self._tracked:  # its figures go when it does
                    self._tracked.add(plan.key)
                    self._gone.watch(plan, plan.key)
                self.plan_ns[plan.key] += ns
                self.plan_runs[plan.key] += runs
            for group in groups.values():
                usage = self._usage(group.client)
                usage.runs[group.plan.key] += group.runs
                usage.programs += group.runs
            for note in batch:
                run = note.run
                error = None
                try:  # a folded record shows the newest run's outputs
                    _block(note.arrays)
                except Exception as exc:
                    error = exc
                    self._usage(run.client).failures += 1
                if error is not None or run.transient:
                    durations.append((run, 0.0, error))
        for run, seconds, error in durations:
            if error is not None or run.transient:
                with contextlib.suppress(Exception):  # never let a callback end the watcher
                    self._on_done(run, seconds, error)

    def snapshot(self, reset: bool = False) -> tuple[float, dict[int, int], list[ClientUsage]]:
        """(elapsed seconds, busy ns per device, usage per live client and closed clients) since the last reset."""
        with self._lock:
            self._settle_gone()
            elapsed = (now() - self.t0) / 1e9
            busy = {d: self.busy.get(d, 0) for d in self._device_ids}
            usage = []
            rows = list(self.usage.values())
            closed = self.closed_usage
            if closed.clients or closed.programs or closed.failures:
                rows.append(closed)
            for u in rows:
                copy = dataclasses.replace(u, runs=collections.Counter(u.runs))
                copy.device_ns = u.settled_ns + sum(
                    runs * self.plan_ns[plan] // self.plan_runs[plan]
                    for plan, runs in u.runs.items()
                    if self.plan_runs[plan]
                )
                usage.append(copy)
        if reset:
            self.reset()
        return elapsed, busy, usage


__all__ = ["CLOSED_CLIENTS", "Accounting", "ClientUsage"]
