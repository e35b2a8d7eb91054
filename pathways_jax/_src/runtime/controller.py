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
is saved. A caller whose window is full of its own runs, each measured short
enough that half a window of them takes at most ``_CALLER_WAIT_S`` (under
``"fifo"``; ``_SHORT_RUN_S`` under the policies that reorder), waits for half of
them (for at most ``_CALLER_WAIT_S``) and goes on dispatching itself; longer
runs are queued, and so is its run once that wait is over.

Runs wait in one FIFO queue per client (at most ``pw.init(max_queued=...)``
each: a caller beyond that waits); the scheduling policy (``scheduler.py``)
picks which client's head goes next among the heads that can go now (inputs
computed, memory budget met, room in the in-flight windows of its islands).
A busy island holds back only the runs that need it: when every head waits for
a full window, the controller looks at the windows' oldest executables again
about when a quarter of such a run is done, and only for runs shorter than
``_SHORT_RUN_S`` does it drain the window inside XLA (at most half a window of
them, which is what throughput on tiny runs needs). With a memory budget, a run's
node output bytes and the bytes of its host inputs are reserved before
dispatch (its host inputs are put on devices only then); a run that does not
fit waits. Accounting (device busy time, per-client usage) is measured by a
watcher thread (``accounting.py``) that the controller never waits for.

The controller's threads never die of an error: one in its own bookkeeping
fails the run concerned and serving goes on; if the thread ends anyway, the
next call says so at once. An interrupt (``KeyboardInterrupt``) on a thread
that is dispatching its own run fails that run and frees what it held; under
a memory budget the main thread (where interrupts land) leaves reserving and
releasing bytes to the controller's thread, so that no interrupt cuts it in two.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from absl import logging

from pathways_jax._src.backends.base import Backend, StepFailed, device_window_key
from pathways_jax._src.core import counts, errors, events, locks, readiness, reentry
from pathways_jax._src.runtime import admission, scheduler
from pathways_jax._src.runtime.accounting import Accounting
from pathways_jax._src.runtime.object_store import (
    MAIN_THREAD,
    READY,
    Failed,
    Freed,
    Pending,
    Ready,
    own_buffer,
)
from pathways_jax._src.runtime.windows import InFlightWindows

if TYPE_CHECKING:
    import jax

    from pathways_jax._src.runtime.object_store import ObjectStore
    from pathways_jax._src.runtime.resources import Island
    from pathways_jax._src.runtime.runs import Run

_now = time.perf_counter_ns
# What keeps a queued head from going now (in order of preference).
_GO, _NO_ROOM, _INPUT, _MEMORY = 0, 1, 2, 3
_GOES, _WAITS_FOR_INPUT, _WAITS_FOR_MEMORY = (_GO, 0), (_INPUT, 0), (_MEMORY, 0)  # _blocker's answers
_NOT_BLOCKING = (False,)  # Lock.acquire's argument, mapped over (see _try_inline)
_BLOCKED_POLL_S = 0.002  # how often a blocked head is looked at again
# While every head that could go waits for room in a window, the windows'
# oldest executables are looked at again after this long, doubling up to
# _BLOCKED_POLL_S: short runs free a window within microseconds.
_ROOM_POLL_S = 5e-5
# When every head that could go waits for room and its runs take at most this
# long on the devices, the controller drains the full window to half inside
# XLA (one wake-up per half window, as throughput wants) instead of looking
# again and again: another island's run then waits at most about half a
# window of such short runs.
_SHORT_RUN_S = 5e-4
# A caller that finds its window full of its own runs waits for it to drain to half,
# and dispatches its run itself, when that wait is expected to take at most this long
# (half the island's window of such runs; never less than _SHORT_RUN_S a run; under
# the "fifo" policy only, see Controller._caller_short_s), and waits no longer than
# this. Longer runs are queued, and the caller goes on at once.
# Queued, every run is handed to the controller's thread, each hand-over a wake-up
# and a GIL round trip: the README demo's 1 ms step ran at 0.92-0.96x of jax.jit
# queued, 0.96-1.05x dispatched by its caller (benchmarks/demo.py, four runs each).
_CALLER_WAIT_S = 0.05
_DEFAULT_COST_S = 1e-4  # a run's device time before any was measured
# The longest a caller waits for its queued short runs to be dispatched before
# it queues its own behind them (Controller._catch_up).
_CATCH_UP_S = 0.05
# Runs queued on one device by its single-device executables (a device's
# window, base.device_window_key) before more of them wait in the controller's
# queues, where the policy orders them. Deep enough that the device never
# idles while the controller refills it (it wakes when half is done, and then
# has the other half of the runs to do it in), shallow enough that a run picked
# now starts after at most this many: measured in docs/DESIGN.md (Schedule).
DEVICE_WINDOW = 4

_FROM_FAILED = " got an input from a failed run: "  # a run failed by an input that failed


class Drain(NamedTuple):
    """What ``Controller._next`` picks when every head waits for a window of short runs."""

    key: int  # the key of the window to drain (an island's, or a device's)


class Forked(Exception):
    """Why a controller cannot serve in a process forked from its own."""


# Controllers of this process: a child forked from it finds them without their threads.
_controllers: weakref.WeakSet[Controller] = weakref.WeakSet()
# Whether this process was forked from one where a controller ran (JAX's runtime was started
# there): JAX's own threads do not survive the fork, so compiling or running anything hangs here.
_forked = False

FORKED_MESSAGE = (
    "this process was forked (os.fork, or multiprocessing's 'fork' start method) from one "
    "running pathways_jax: the controller's threads, and JAX's runtime, do not survive a "
    "fork, so no program can run here. Start worker processes that use pathways_jax with "
    "multiprocessing's 'spawn' or 'forkserver' start method, or call programs only in the "
    "parent."
)


def _after_fork_in_child() -> None:
    """Marks the controllers the child inherited as dead, and their queued values as failed.

    Runs in the child, where only the forking thread exists: a lock another
    thread held at the fork stays held, so nothing here takes one. A value
    still pending (its run queued in the parent) would never be dispatched
    here; it fails, so reading it raises instead of waiting for ever.
    """
    global _forked
    controllers = list(_controllers)
    if not controllers:
        return
    _forked = True
    cause = errors.ClusterError(FORKED_MESSAGE)
    for controller in controllers:
        controller._dead = Forked("this process was forked from the one that started it")
        for entry in controller._store.entries():
            if type(entry.state) is Pending:
                controller._store.set_failed(
                    entry,
                    f"{entry.origin} was still queued when this process was forked: {FORKED_MESSAGE}",
                    cause,
                )


def refuse_if_forked() -> None:
    """Raises ``ClusterError`` in a process forked from one where a controller ran.

    Before anything compiles or starts a cluster there: JAX's runtime hangs in
    such a child, so a new signature's compile would never return.
    """
    if _forked:
        raise errors.ClusterError(FORKED_MESSAGE)


os.register_at_fork(after_in_child=_after_fork_in_child)


class Settings(Protocol):
    """What a controller reads of its cluster when it is made (``clusters.Cluster``)."""

    @property
    def store(self) -> ObjectStore: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def islands(self) -> tuple[Island, ...]: ...
    @property
    def devices(self) -> tuple[jax.Device, ...]: ...
    @property
    def inline_dispatch(self) -> bool: ...
    @property
    def max_queued(self) -> int: ...
    @property
    def scheduler(self) -> str: ...
    @property
    def starvation_limit(self) -> int: ...
    @property
    def backpressure_timeout(self) -> float | None: ...


class Controller:
    """Owns the dispatch lock, the queue and the background thread of a cluster."""

    def __init__(self, cluster: Settings):
        self._store = cluster.store
        self._backend: Backend = cluster.backend
        self._inline = cluster.inline_dispatch
        self._max_queued = cluster.max_queued
        self._dispatch = threading.Lock()  # held while a run is dispatched
        # Guards the per-client queues and the policy; reentrant because a
        # budget release (which notifies it) may happen on a thread holding it.
        # Taken as the bare lock (``with self._lock``), which is the condition's
        # own: a Condition's __enter__ and __exit__ are Python frames.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        # Callers waiting for their client's queue to drop below max_queued.
        self._room = threading.Condition(self._lock)
        self._room_waiters = 0
        # Callers waiting in _catch_up, woken when a dispatch by the controller's thread ends.
        self._emptied = threading.Condition(self._lock)
        self._catching_up = 0
        self._sleeping = False  # the controller thread waits on _cv: a submission notifies it
        # The run the controller thread took off the queues and is dispatching. No
        # run goes inline while a run is queued or picked: a thread never bypasses
        # the policy, and a client's runs keep their order.
        self._picked: Run | None = None
        self._seq = itertools.count()
        self._policy: scheduler.Policy = scheduler.make(
            cluster.scheduler, starvation_limit=cluster.starvation_limit
        )
        # The clients' queues of runs and the policy (admission.py); the queues' dict is
        # read bare on the inline path: empty when nothing is queued.
        self._admission: admission.Queues[int, Run] = admission.Queues(self._policy)
        self._queues = self._admission.queues
        self._budget = self._store.budget
        self._bp_timeout = cluster.backpressure_timeout
        if self._budget is not None:
            self._budget.listeners.append(self._wake)
        self.accounting = Accounting([d.id for d in cluster.devices], self._run_done)
        # What is in flight per window key, appended under _dispatch (windows.py): executables
        # (or host messages) per island, before dispatch there waits; runs queued per device.
        self.windows = InFlightWindows(
            self._backend,
            self._backend.window_size or cluster.in_flight,
            DEVICE_WINDOW,
            {device_window_key(d.id): island.index for island in cluster.islands for d in island.devices},
            self.accounting.median,
        )
        # Once every run stayed accounted a moment (accounting._IDLE_HOOK_S: not between the
        # calls of a loop that reads each result), this thread settles the windows: the last runs'
        # outputs then live as long as their futures, as jax.jit's arrays do, not until the next
        # dispatch looks. (This thread, not the watcher: a buffer freed on the watcher's thread
        # grew the process by 1-11 MiB, test_cpu_device_buffers_are_released_to_the_system_when_freed.)
        self._settle_idle = False
        self.accounting.on_idle = self._idle
        self._stopped = False
        self._dead: BaseException | None = None  # why the controller thread ended, if it did
        self._thread = reentry.runtime_thread(self._serve, name="pathways-controller")
        _controllers.add(self)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, run: Run) -> None:
        if self._stopped:
            raise errors.ClusterError("the cluster was shut down; call pw.init() to start a new one.")
        if self._dead is not None:  # set by the thread as it ends (see _serve)
            self._died()
        # Inline only while nothing is queued or picked: a thread never bypasses the policy.
        # Under a memory budget the main thread never dispatches: an interrupt
        # (Ctrl-C) lands only there, and reserving or releasing bytes there
        # could be cut in two. The controller's thread is never interrupted.
        drained = caught_up = False
        while True:
            if (
                self._inline
                and not self._queues
                and self._picked is None
                and (self._budget is None or threading.get_ident() != MAIN_THREAD)
            ):
                done, full = self._try_inline(run)
                if done:
                    return
                if (
                    full is not None
                    and not drained
                    and self._may_wait_here(run)
                    and self.windows.short_oldest(full, self._caller_short_s())
                    and self.windows.only_of(full, run.client.name)
                ):
                    # Only a window of this client's short runs is full: wait for it here
                    # (inside XLA, no lock held), as the controller's thread would, and try
                    # once more. Queued, the run would be dispatched by that thread, and every
                    # later call of this client queued behind it, each paying for a hand-over
                    # between threads. (Runs of other clients in the window: the policy picks.)
                    drained = True
                    # Within _CALLER_WAIT_S: a run that measured short may hang now (it waits for a
                    # host callback's gate); then the run is queued, under max_queued's back-pressure.
                    self.windows.drain(
                        full, self._caller_short_s(), time.monotonic() + _CALLER_WAIT_S, _SHORT_RUN_S
                    )
                    continue
            key = run.client.key
            with self._lock:
                queue = self._queues.get(key)
                if queue is not None and not caught_up and self._may_wait_here(run):
                    # This client's short runs are queued, no one else's: let the controller's
                    # thread dispatch them, then go on inline instead of queueing behind them.
                    caught_up = True
                    if self._catch_up(run):
                        continue
                    queue = self._queues.get(key)
                if queue is not None and len(queue) >= self._max_queued:
                    queue = self._wait_for_room(run)
                closed = run.client.closed  # since submission checked: queued, it would outlive the client
                if not closed:
                    run.seq = next(self._seq)
                    run.head = self._head(run)
                    self._admission.push(key, run)
                if self._sleeping:
                    self._cv.notify()
            break
        if closed:
            self._fail(
                run,
                f"program {run.plan.graph.name!r} run {run.id} was cancelled: client {run.client.name!r} was closed",
                None,
                count=False,
            )

    def _try_inline(self, run: Run) -> tuple[bool, int | None]:
        """Dispatches ``run`` on the caller's thread if nothing would wait.

        Returns whether it went (or failed), and the key of the window whose
        lack of room alone kept it (None: something else did).
        """
        inside = reentry.inside
        inside.depth += 1
        # The lock taken as core.locks.acquire takes it: a Ctrl-C landing as acquire() returns
        # (Python runs signal handlers there) must not leave it held, or every later call and
        # the exit hang. One C call takes it and records so in `held`, inside the try; the
        # finally makes no call before the release.
        held: list[bool] = []
        try:
            held.extend(filter(None, map(self._dispatch.acquire, _NOT_BLOCKING)))
            if not held:
                return False, None
            if self._stopped:  # stop() ran between the caller's check and here: it no longer waits for us
                raise errors.ClusterError("the cluster was shut down; call pw.init() to start a new one.")
            try:
                if self._queues or self._picked is not None or not run.plan.inline_ok:
                    return False, None
                blocker, full = self._blocker(run)
                if blocker == _GO and (self._budget is None or self._admit(run)):
                    run.seq = next(self._seq)
                    if self._policy.charges:
                        self._charge(run)
                    self._execute(run)
                    return True, None
                return False, full if blocker == _NO_ROOM else None
            except BaseException as exc:
                if isinstance(exc, Exception) and not reentry.from_signal_handler(exc):
                    self._internal_error(run, exc)  # the controller's own bookkeeping: fail this run only
                    return True, None
                # An interrupt, or what a signal handler raised here: the run fails and frees what
                # it reserved, and the exception goes on to the caller.
                self._fail(run, f"program {run.plan.graph.name!r} run {run.id} was interrupted", exc)
                raise
        finally:
            inside.depth -= 1
            if held:
                self._dispatch.release()

    def _may_wait_here(self, run: Run) -> bool:
        """Whether the caller may wait in :meth:`submit` for ``run``'s way to clear, then dispatch it.

        Only for a run measured short enough that half a window of them takes
        at most ``_CALLER_WAIT_S`` (:meth:`_caller_short_s`), on a thread that
        dispatches inline, and never on the controller's thread or inside
        pathways_jax's own work (a host callback: what it would wait for may
        wait for it).
        """
        return (
            self._inline
            and not reentry.inside.depth
            and threading.get_ident() != self._thread.ident
            and (self._budget is None or threading.get_ident() != MAIN_THREAD)
            and self._caller_waits_for(run.plan)
        )

    def _caller_waits_for(self, plan: Any) -> bool:
        """Whether runs of ``plan`` are measured short enough for a caller to wait for (:meth:`_caller_short_s`)."""
        return 0.0 < self.accounting.medians.get(plan.key, 0.0) <= self._caller_short_s()

    def _caller_short_s(self) -> float:
        """The longest run (device seconds) a caller waits for rather than queue its own behind it.

        Half the island's window of such runs takes at most ``_CALLER_WAIT_S``,
        and never less than ``_SHORT_RUN_S`` counts. Under ``"fifo"`` only: in
        submission order, a run waiting in its caller's loop goes when it would
        have gone from the queue. A policy that reorders (``"priority"``,
        ``"fair"``) orders the runs queued: a low-priority backlog of
        millisecond runs is queued at once, so that later high-priority runs
        go before it.
        """
        if self._policy.name != "fifo":
            return _SHORT_RUN_S
        return max(_SHORT_RUN_S, _CALLER_WAIT_S / max(1, self.windows.island_size // 2))

    def _catch_up(self, run: Run) -> bool:
        """Waits (lock held) until ``run``'s client has nothing queued and nothing is being dispatched.

        Only while the controller's thread works through runs short enough for
        a caller to wait for (:meth:`_caller_short_s`): False at once if another
        client's runs are queued too (the policy orders them) or the run it
        dispatches is not known to be that short, and after ``_CATCH_UP_S``.
        """
        key = run.client.key
        deadline = time.monotonic() + _CATCH_UP_S
        while key in self._queues or self._picked is not None:
            picked = self._picked
            left = deadline - time.monotonic()
            if (
                len(self._queues) > 1
                or (picked is not None and not self._caller_waits_for(picked.plan))
                or self._stopped
                or self._dead is not None
                or left <= 0
            ):
                return False
            self._catching_up += 1
            try:
                self._emptied.wait(left)
            finally:
                self._catching_up -= 1
        return True

    def _wait_for_room(self, run: Run) -> collections.deque[Run] | None:
        """Blocks the caller (lock held) until its client has fewer than ``max_queued`` runs queued.

        Returns the client's queue (None once empty). Raises ``BackPressureTimeout``
        after ``backpressure_timeout`` seconds; the run is not queued then.
        """
        key = run.client.key
        if threading.get_ident() == self._thread.ident:
            return self._queues.get(key)  # a host callback submitting: waiting would stall the controller
        deadline = None if self._bp_timeout is None else time.monotonic() + self._bp_timeout
        since = time.monotonic()
        while True:
            queue = self._queues.get(key)
            if queue is None or len(queue) < self._max_queued:
                return queue
            if self._stopped or self._dead is not None:
                raise errors.ClusterError("the cluster was shut down while this call waited to be queued.")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                message = (
                    f"program {run.plan.graph.name!r}: client {run.client.name!r} already has "
                    f"{len(queue)} runs queued (pw.init(max_queued={self._max_queued})) and none was "
                    f"dispatched in {time.monotonic() - since:.2f}s (backpressure_timeout={self._bp_timeout}s). "
                    "Wait for results before submitting more, or raise max_queued."
                )
                error = errors.BackPressureTimeout(message)
                self._fail(run, f"program {run.plan.graph.name!r} run {run.id} was not queued", error)
                raise error
            self._room_waiters += 1
            try:
                self._room.wait(0.1 if left is None else min(left, 0.1))
            finally:
                self._room_waiters -= 1

    def _died(self) -> None:
        """Raises the error of a call made after the controller thread ended."""
        cause = self._dead
        if isinstance(cause, Forked):
            raise errors.ClusterError(FORKED_MESSAGE)
        raise errors.ClusterError(
            "pathways_jax's controller thread has stopped"
            + (f" ({type(cause).__name__}: {cause})" if cause is not None else "")
            + "; no program can run. Call pw.shutdown() and pw.init() to start a new cluster, and "
            "please report this as a bug of pathways_jax."
        ) from cause

    def stop(self, timeout: float) -> None:
        """Lets queued runs finish dispatching (for up to ``timeout`` s), then ends the threads."""
        deadline = time.monotonic() + timeout
        self._stopped = True
        self._wake()
        # Called from Python code run inside the runtime's work on this thread (a signal handler
        # such as a preemption hook, landing while this thread dispatches its own run; a host
        # callback on the controller's thread), the dispatch under way is this thread's own: it
        # goes on only once that code returns, so waiting for it (or joining this very thread)
        # would only spend the whole timeout.
        own = reentry.inside.depth > 0
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            logging.warning(
                "pathways_jax: the controller thread did not stop within %.1fs; it is left as a daemon.",
                timeout,
            )
        # A run another thread is dispatching inline (in XLA now) ends before stop returns:
        # at exit, a thread still inside XLA as the interpreter finalises aborts the process.
        if not own:
            held: list[bool] = []
            try:
                locks.acquire(self._dispatch, held, timeout=max(0.0, deadline - time.monotonic()))
            finally:
                if held:
                    self._dispatch.release()
        # And so do the runs dispatched: one whose host callback XLA calls as the interpreter
        # finalises aborts the process ("terminate called without an active exception").
        self.wait_settled(max(0.0, deadline - time.monotonic()))
        self.accounting.stop(max(0.0, deadline - time.monotonic()))

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Waits until every run dispatched now has finished on its devices; False on timeout.

        Failed runs count as finished (their errors reach their futures). At
        once on pathways_jax's own threads and in Python code run inside its
        work (a host callback): the run calling back may be one of them.
        """
        if threading.get_ident() == self._thread.ident or reentry.inside.depth:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        # Appended under _dispatch, dropped under the windows' lock (taken in that order): a snapshot.
        # Taken with locks.acquire: a Ctrl-C landing as the lock is taken (jax.effects_barrier(),
        # Future.delete() on the main thread) must not leave it held, stopping every dispatch.
        held: list[bool] = []
        try:
            if not locks.acquire(self._dispatch, held, timeout=-1 if timeout is None else max(0.0, timeout)):
                return False  # a dispatch in progress did not end in time
            markers = self.windows.markers()
        finally:
            if held:
                self._dispatch.release()
        readiness.poll(markers, lambda: deadline is not None and time.monotonic() >= deadline)
        return all(readiness.settled(marker) for marker in markers)

    def _wake(self) -> None:
        with self._lock:
            self._cv.notify_all()

    def _idle(self) -> None:
        """Every dispatched run stayed accounted a moment (the watcher's thread): the windows are settled here."""
        with self._lock:
            self._settle_idle = True
            self._cv.notify_all()

    def _serve(self) -> None:
        try:
            self._serve_runs()
        except BaseException as exc:  # pragma: no cover - the loop below catches everything it can
            self._dead = exc
            logging.error("pathways_jax controller thread died: %r", exc)
            self._fail_queued(f"the controller thread died ({type(exc).__name__}: {exc})")

    def _serve_runs(self) -> None:
        while True:
            try:
                run = self._next()  # collects dropped values first
            except BaseException as exc:  # a bug in the controller's own bookkeeping: keep serving
                logging.error("pathways_jax controller: picking the next run failed: %r", exc)
                self._picked = None
                time.sleep(_BLOCKED_POLL_S)
                continue
            if run is None:
                return
            if isinstance(run, Drain):  # every head waits for a window of short runs: drain it
                self.windows.drain(run.key, _SHORT_RUN_S)
                continue
            try:
                with self._dispatch:
                    self._execute(run)
            except BaseException as exc:
                self._internal_error(run, exc)
            finally:
                self._picked = None
                if self._catching_up:
                    with self._lock:
                        self._emptied.notify_all()

    def _fail_queued(self, why: str) -> None:
        """Fails every queued run (the controller thread is gone)."""
        with self._lock:
            runs = [run for queue in self._queues.values() for run in queue]
            self._queues.clear()
        for run in runs:
            with contextlib.suppress(Exception):  # last resort: nothing may escape here
                self._fail(run, f"program {run.plan.graph.name!r} run {run.id} was cancelled: {why}", None)

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
        cost = self.accounting.costs.get(plan.key) or _DEFAULT_COST_S * max(1, len(plan.acct_groups))
        return scheduler.Head(client.key, run.seq, client.priority, client.weight, cost)

    def _charge(self, run: Run) -> None:
        """Charges an inline dispatch (one the policy did not pick) to its client."""
        client = run.client
        plan = run.plan
        cost = run.estimate = self.accounting.costs.get(plan.key) or _DEFAULT_COST_S * max(
            1, len(plan.acct_groups)
        )
        with self._lock:
            # A client closed meanwhile was forgotten by the policy: charging it would bring it back.
            if not (client.closed or client.ended):
                self._policy.charge(client.key, cost, client.weight)

    def _blocker(self, run: Run, busy: dict[int, int] | None = None) -> tuple[int, int]:
        """What keeps ``run`` from being dispatched now (``_GO``: nothing), and the full window's key.

        The key is that of the window without room when the answer is
        ``_NO_ROOM``, else 0.

        ``busy``: executables in flight per island, filled as islands are
        looked at, so that one pass over the clients' heads asks each island
        once, not once per head.
        """
        for future in run.feeds:
            if type(future._entry.state) is Pending:
                return _WAITS_FOR_INPUT
        budget = self._budget
        if budget is not None and not budget.fits(run.plan.admit_charge):
            return _WAITS_FOR_MEMORY
        windows = self.windows
        entries = windows.entries
        for island, count in run.plan.prepared.windowed.items():
            size = windows.island_size if island >= 0 else windows.device_size  # .size(island), inlined
            need = admission.most_running(count, size)  # has_room is running <= need: asked twice
            running = None if busy is None else busy.get(island)
            if running is None:
                running = len(entries[island])
                # Only a window that looks full is asked (every question is a call
                # into XLA, or Ray): its settled executables leave first.
                if running > need:
                    running = windows.settle(island)
                if busy is not None:
                    busy[island] = running
            if running > need:
                return _NO_ROOM, island
        return _GOES

    def _next(self) -> Run | Drain | None:
        """Waits for a run the policy picks among the heads that can go now; None once stopped.

        A :class:`Drain` of a window instead when every head waits for room and
        the shortest of them runs under ``_SHORT_RUN_S``: the caller drains it.

        A head that waits for room in a window is otherwise looked at again
        about when a quarter of such a run is done (``_ROOM_POLL_S`` doubling
        when its cost is not known yet), rather than waited for inside XLA: a
        run for another island, submitted meanwhile, then goes at once.
        """
        pause = _ROOM_POLL_S
        with self._lock:
            while True:
                if self._store.has_dropped():
                    self._store.collect()
                if not self._queues:
                    if self._stopped:
                        return None
                    if self._settle_idle:
                        self._settle_idle = False
                        self.windows.settle_all()
                        continue  # settling may have freed values: collect them first
                    self._sleep()
                    pause = _ROOM_POLL_S
                    continue
                go: list[Run] = []
                no_room = False
                expected = 0.0  # the shortest device time of a head waiting for room
                full = 0  # the island whose window that head waits for
                blocked: list[Run] = []
                busy: dict[int, int] = {}
                # Heads of one plan without future inputs are held back (or not)
                # by the same things: look once per plan, not once per client.
                verdicts: dict[int, tuple[int, int]] = {}  # plan -> (why, full island)
                broken: list[tuple[Run, BaseException]] = []
                for key, queue in list(self._queues.items()):
                    if not queue:  # left empty by an interrupted submission
                        self._admission.remove_empty(key)
                        continue
                    run = queue[0]
                    try:
                        if run.feeds:
                            why, waits_on = self._blocker(run, busy)
                        else:
                            verdict = verdicts.get(id(run.plan))
                            if verdict is None:
                                verdict = verdicts[id(run.plan)] = self._blocker(run, busy)
                            why, waits_on = verdict
                    except Exception as exc:
                        broken.append((run, exc))
                        continue
                    if why == _GO:
                        go.append(run)
                    elif why == _NO_ROOM:
                        no_room = True
                        # The run's median device time lately (0: none measured yet).
                        cost = self.accounting.median(run.plan)
                        if cost and (expected == 0.0 or cost < expected):
                            expected, full = cost, waits_on
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
                if go:
                    run = go[0]
                    try:
                        heads = [candidate.head for candidate in go]
                        index = self._admission.choose(heads)
                        run = go[index]
                        if not self._admit(run):  # memory went between the check and now
                            self._sleep(_BLOCKED_POLL_S)
                            continue
                        # Charged at the cost known now: the estimate moves while a run waits.
                        heads[index] = self._head(run)
                        self._admission.picked(heads, index)
                        run.estimate = heads[index].cost
                    except Exception as exc:  # the policy's bookkeeping: the picked run fails alone
                        self._drop(run)
                        self._internal_error(run, exc)
                        continue
                    self._picked = run
                    self._pop(run)
                    if run.blocked_since is not None:
                        sink = events.SINK
                        if sink is not None:
                            sink(
                                events.Waited(
                                    reason="back-pressure",
                                    client=run.client.name,
                                    island=min(run.plan.prepared.islands, default=None),
                                    start=run.blocked_ns,
                                    end=events.now(),
                                    bytes=sum(b for _, b in run.plan.admit_charge),
                                )
                            )
                    return run
                self._expire(blocked)
                if no_room:
                    if (
                        expected
                        and expected <= _SHORT_RUN_S
                        and not blocked
                        and self.windows.short_oldest(full, _SHORT_RUN_S)
                    ):
                        return Drain(full)
                    if expected:  # look again about when a quarter of such a run is done
                        pause = min(max(expected / 4, _ROOM_POLL_S / 2), pause)
                    self._sleep(pause)
                    pause = min(pause * 2, _BLOCKED_POLL_S)
                else:
                    self._sleep(_BLOCKED_POLL_S)  # freed values are collected at the loop's top

    def _pop(self, run: Run) -> None:
        """Takes ``run``, its client's head, off the queue (lock held)."""
        self._admission.pop(run.client.key)
        if self._room_waiters:
            self._room.notify_all()

    def _drop(self, run: Run) -> None:
        """Takes ``run`` off the queue without dispatching it (lock held): it fails."""
        self._admission.drop(run.client.key, run.head)
        if self._room_waiters:
            self._room.notify_all()

    def _expire(self, blocked: list[Run]) -> None:
        """Fails heads that waited for memory past the timeout (all of them once stopped)."""
        moment = time.monotonic()
        for run in blocked:
            since = run.blocked_since
            if not self._stopped and not admission.waited_too_long(since, moment, self._bp_timeout):
                continue
            self._drop(run)
            if self._stopped or since is None:  # (not stopped: it waited, since is set)
                self._fail(
                    run,
                    f"program {run.plan.graph.name!r} run {run.id} was cancelled: the cluster shut down",
                    None,
                )
                continue
            inputs = dict(run.plan.admit_charge)
            for d, b in run.plan.charge:
                inputs[d] -= b
            need = ", ".join(
                f"device {d}: {b} B" + (f" + {inputs[d]} B of host inputs" if inputs.get(d) else "")
                for d, b in run.plan.charge
            )
            budget = self._budget
            have = (
                ", ".join(
                    f"device {d}: {budget.used.get(d, 0)}/{budget.limits.get(d)} B in use"
                    for d, _ in run.plan.admit_charge
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
        """Reserves the run's node output and host input bytes under the memory budget.

        False if they don't fit now. The bytes of outputs go with their values
        (``ObjectStore.reserve``); the rest (``run.transient``) when the run completes
        or fails. Runs on the controller's thread or a caller's other than the
        main one (see :meth:`submit`): no interrupt cuts it in two.
        """
        budget = self._budget
        if budget is None:
            return True
        plan = run.plan
        with budget.lock:  # a value freed meanwhile (its future dropped) keeps no charge
            if not budget.try_reserve(plan.admit_charge):
                return False
            transient = dict(plan.admit_charge)
            for entry, charge in zip(run.outputs, plan.out_charges, strict=True):
                if charge and not isinstance(entry.state, Freed):
                    self._store.reserve(entry, charge)
                    for d, b in charge:
                        transient[d] -= b
            run.transient = tuple((d, b) for d, b in transient.items() if b)
        return True

    def _release(self, run: Run) -> None:
        """Returns the bytes ``run`` holds beyond its outputs' (once: the first caller takes them)."""
        budget = self._budget
        if budget is None:
            return
        with budget.lock:
            transient, run.transient = run.transient, ()
        budget.release(transient)

    def _run_done(self, run: Run, device_s: float, error: BaseException | None) -> None:
        """Called by the accounting watcher once every output of a dispatched run is ready."""
        if run.transient:
            self._release(run)
        if error is not None and not run.failed:
            run.failed = True
            counts.bump("failed_runs")
            message = f"program {run.plan.graph.name!r} run {run.id} failed while executing"
            events.run_failed(run.id, run.client.name, f"{message}: {type(error).__name__}: {error}")
            for entry in self._store.entries_of(run.id):  # those alive (the run let them go at publish)
                cause: BaseException = error
                array = entry.array
                if type(entry.state) is Ready and array is not None:
                    try:
                        array.block_until_ready()
                    except Exception as exc:
                        cause = exc
                self._store.free([entry], failure=(f"{entry.origin} failed while executing: {cause}", cause))

    def close_client(self, client: Any) -> None:
        """Cancels ``client``'s queued runs and frees the values it owns."""
        with self._lock:
            queue = self._admission.close(client.key, lambda run: run.head)
            self._cv.notify_all()
            if self._room_waiters:
                self._room.notify_all()
        for run in queue:
            self._fail(
                run,
                f"program {run.plan.graph.name!r} run {run.id} was cancelled: client {client.name!r} was closed",
                None,
                count=False,
            )
        self._store.free(self._store.owned_by(client.key))

    def retire_client(self, client: Any) -> None:
        """``client`` submits nothing more: the policy forgets it once its queued runs are gone."""
        with self._lock:
            self._admission.retire(client.key)  # forgotten after its last queued run

    def wait_dispatched(self, timeout: float | None = None) -> bool:
        """Waits until every run queued (or being dispatched) now has been dispatched, or failed.

        What ``jax.effects_barrier()`` needs before JAX's own barrier: a queued
        run's host callbacks have not run yet. Returns False on timeout; at
        once on the controller's own thread (a callback), which dispatches them.
        """
        if threading.get_ident() == self._thread.ident:
            return True
        waiting = self._undispatched()
        deadline = None if timeout is None else time.monotonic() + timeout
        while waiting:
            if not self._thread.is_alive():
                return True  # nothing more is dispatched: the queued runs were failed
            waiting &= self._undispatched()
            if waiting:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                time.sleep(0.0005)
        return True

    def _undispatched(self) -> set[int]:
        """The ids of the runs queued or being dispatched now."""
        with self._lock:
            ids = {run.id for queue in self._queues.values() for run in queue}
            if self._picked is not None:
                ids.add(self._picked.id)
        return ids

    def queued_by_island(self) -> dict[int, int]:
        with self._lock:
            runs = [run for queue in self._queues.values() for run in queue]
        by_island: collections.Counter[int] = collections.Counter()
        for run in runs:
            by_island.update(run.plan.prepared.islands)
        return dict(by_island)

    def queued_by_client_name(self) -> dict[str, int]:
        counts: collections.Counter[str] = collections.Counter()
        with self._lock:
            for queue in self._queues.values():
                if queue:
                    counts[queue[0].client.name] += len(queue)
        return dict(counts)

    def in_flight_by_island(self) -> dict[int, int]:
        """Executables (or host messages) in an island's window, dispatched and not settled, per island."""
        return self.windows.by_island()

    def _ready_now(self, run: Run) -> bool:
        """True if ``run`` may be dispatched on the caller's thread: nothing would wait."""
        return run.plan.inline_ok and self._blocker(run)[0] == _GO

    def _execute(self, run: Run) -> None:
        started = _now()
        env = run.env
        graph = run.plan.graph
        for slot, future in zip(run.feed_slots, run.feeds, strict=True):
            entry = future._entry
            array = entry.array  # read before the state: a ready state then has its array
            if type(entry.state) is Ready and array is not None:
                env[slot] = array
                continue
            self._store.wait_settled(entry, None)
            match entry.state:
                case Ready():
                    env[slot] = entry.array
                case Failed(message, cause):
                    # Named by the run that failed first (its message holds the cause's text), not
                    # by every run between: a chain of N runs queued behind a failure made N
                    # messages, and N WARNING lines, each holding all those before it.
                    first = message.rpartition(_FROM_FAILED)[2]
                    self._fail(
                        run, f"program {graph.name!r} run {run.id}{_FROM_FAILED}{first}", cause, said=True
                    )
                    return
                case Freed():
                    self._fail(
                        run,
                        f"program {graph.name!r} run {run.id} got an input that was freed (its future "
                        "was deleted, or donated to an earlier run, before this run was dispatched): "
                        "pass a value that is still live, as jax.jit refuses a deleted array",
                        None,
                    )
                    return
        try:
            dispatched = self._backend.execute(run, self.windows)
            values, last, copies = dispatched
            if run.plan.consumed_feeds:
                self._spend(run)
        except StepFailed as failed:  # the run's own failure: it fails alone
            self._fail(run, failed.where, failed.cause)
            return
        finally:
            run.feeds = []
        self._publish(run, started, values, last, copies)

    def _spend(self, run: Run) -> None:
        """Futures whose buffers the run's executables consumed (donated) cannot be read again."""
        consumed = run.plan.consumed_feeds
        for slot, future in zip(run.feed_slots, run.feeds, strict=True):
            if slot in consumed:
                entry = future._entry
                message = (
                    f"this value (made by {entry.origin}) was donated to program "
                    f"{run.plan.graph.name!r} (donate_argnums) and its buffer was reused; use the "
                    "program's outputs instead."
                )
                self._store.free([entry], failure=(message, None), consumed=True)

    def _publish(self, run: Run, started: int, values: Any, last: tuple, copies: dict | None = None) -> None:
        """A dispatched run's outputs become ready (``values[slot]``, or ``copies[position]`` where
        the backend made an output's own buffer); the watcher gets ``last``."""
        plan = run.plan
        batch = run.batch
        if batch is not None:  # one entry for every output (submission.submit_values): their tuple
            if type(batch.state) is not Freed:
                getter = plan.outputs_of
                batch.array = getter(values) if getter is not None else _outputs(plan, values, copies)
                batch.state = READY
            run.batch = None
        else:
            # ObjectStore.set_ready for each output a node made, inlined (once per output leaf).
            entries = run.outputs
            for position, slot in plan.published:
                entry = entries[position]
                if type(entry.state) is not Freed:
                    entry.array = values[slot]  # before the state: a ready state has its array
                    entry.state = READY
            if plan.published_copies:  # an argument, or a value returned twice: a buffer of its own
                for position, slot in plan.published_copies:
                    entry = entries[position]
                    if type(entry.state) is not Freed:
                        entry.array = own_buffer(values[slot]) if copies is None else copies[position]
                        entry.state = READY
            # The run (kept by the accounting until its outputs are computed) lets go of its
            # entries: a value whose future is gone then goes at once, as a jax.Array does.
            run.outputs = []
        self._store.wake()
        self.accounting.note(run, started, last)
        run.env = []

    def _fail(
        self, run: Run, message: str, cause: BaseException | None, *, count: bool = True, said: bool = False
    ) -> None:
        """Fails every output of ``run`` and frees what it holds; other runs are not touched.

        ``said``: ``message`` already holds ``cause``'s text, logged with the run that failed first
        (a run failed by an input that failed): not added again, nor logged again.
        """
        run.failed = True
        if count:
            counts.bump("failed_runs")
            self.accounting.failed(run)
        detail = f"{message}: {type(cause).__name__}: {cause}" if cause is not None and not said else message
        events.run_failed(run.id, run.client.name, detail, log=not said)
        if run.transient:
            self._release(run)
        self._store.free(
            [*run.outputs, run.batch] if run.batch else list(run.outputs), failure=(detail, cause)
        )
        run.feeds = []
        run.env = []


def _outputs(plan: Any, values: Any, copies: dict | None) -> tuple[Any, ...]:
    """A run's outputs in position order (a plan of one output, or of outputs published as copies)."""
    outputs: list[Any] = [None] * len(plan.outputs)
    for position, slot in plan.published:
        outputs[position] = values[slot]
    for position, slot in plan.published_copies:
        outputs[position] = own_buffer(values[slot]) if copies is None else copies[position]
    return tuple(outputs)
