"""Admission: which queued run goes next, and what it may hold. One core, no clock, no threads.

The threaded controller (``controller.py``), the controller service
(``service.py``) and the simulator (``pw.sim``) all admit runs the same way,
with the objects of this module:

- :class:`Queues`: one FIFO queue per client (a client's runs keep their
  order); the scheduling policy (``scheduler.py``) picks among the heads that
  may go now, and is told when a client's queue fills or empties, when a head
  is dropped and when a client leaves.
- :func:`has_room`: whether a run fits in an in-flight window (a run with more
  executables than half a window goes once half the window is free).
- :class:`Budget`: bytes reserved per device (or per pool) against limits.
- :func:`waited_too_long`: the back-pressure verdict on a head that waits for
  memory.
- :func:`smoothed`, :func:`fold`: the one running estimate of a program's device time;
  :func:`fold_median`: the median of its latest measurements, which says whether its runs are short.

What "may go now" means is each caller's: inputs computed and settled windows
(controller), runs in flight per island (service), simulated windows (sim).
Time enters only as arguments. The owners lock around these objects as they
need (the controller under its lock, the service on its event loop, the
simulator in its single process).
"""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from pathways_jax._src.core.charges import Charge
from pathways_jax._src.runtime.scheduler import Head, Policy

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# Weight of a new measurement in a program's device-time estimate: low, so that
# one slow run (a compilation, a loaded machine) moves the policy little.
ESTIMATE_WEIGHT = 0.1


def smoothed(estimate: float, measured: float) -> float:
    """A program's device-time estimate after one more run took ``measured`` seconds (0: none yet)."""
    if estimate == 0.0:
        return measured
    return (1.0 - ESTIMATE_WEIGHT) * estimate + ESTIMATE_WEIGHT * measured


def fold(estimates: dict[K, float], once: set[K], key: K, measured: float) -> None:
    """Folds one more measurement of program ``key`` (seconds a run) into ``estimates``.

    The first measurement seeds the estimate and the second replaces it; later
    ones are :func:`smoothed`. A program's first run pays one-time work (its
    first execution's allocations): a short train step measured 2.7 ms there
    and 0.1 ms a run after, and smoothed at ``ESTIMATE_WEIGHT`` that first figure
    took hundreds of runs to fade, while the controller counted the program
    long. ``once`` holds the keys measured once so far.
    """
    if key in once:
        once.discard(key)
        estimates[key] = measured
    elif key in estimates:
        estimates[key] = smoothed(estimates[key], measured)
    else:
        estimates[key] = measured
        once.add(key)


# How many of a program's latest measurements :func:`fold_median` keeps.
MEDIAN_KEPT = 8


def fold_median(
    medians: dict[K, float], recent: dict[K, collections.deque[float]], key: K, measured: float
) -> None:
    """Folds one more measurement of program ``key`` into ``medians``: the median of its latest ``MEDIAN_KEPT``.

    What the controller asks to know whether a run is short (whether a caller
    may wait for room in a window rather than queue the run). A measurement is
    the time between two looks of a watcher thread over the runs done between
    them. A look that waited for the GIL makes one too long, and the look after
    it one too short; where runs are queued and handed from thread to thread,
    the caller's pace is the hand-over's, and adds to them too. The smoothed
    estimate (:func:`fold`) grew with the slowness queueing caused, and a loop
    of 30 µs steps stayed queued for thousands of runs, each handed from the
    caller's thread to the controller's; the least of the latest measurements
    took runs of a millisecond for short now and then. Their median is moved
    by neither: it follows a program once most of its latest runs measured so.
    """
    kept = recent.get(key)
    if kept is None:
        kept = recent[key] = collections.deque(maxlen=MEDIAN_KEPT)
    kept.append(measured)
    medians[key] = statistics.median(kept)


def has_room(running: int, count: int, size: int) -> bool:
    """Whether ``count`` more executables fit in a window of ``size`` with ``running`` in it.

    A run with more executables than half the window counts as half of it: it
    goes once half the window is free (it waits for the oldest as it goes),
    so that no run waits forever for a window smaller than itself.
    """
    return running <= most_running(count, size)


def most_running(count: int, size: int) -> int:
    """The most executables a window of ``size`` may hold for ``count`` more to go (:func:`has_room`)."""
    return size - min(count, max(1, size // 2))


def waited_too_long(since: float | None, now: float, timeout: float | None) -> bool:
    """Whether a head waiting for memory since ``since`` (None: not waiting) waited past ``timeout``."""
    return since is not None and timeout is not None and now - since >= timeout


class Queues(Generic[K, T]):
    """One FIFO queue per client, and the policy that picks among their heads.

    ``queues`` maps a client's key to its queue; a client with nothing queued
    has no entry, so ``bool(queues)`` says whether anything waits. The policy
    is kept told: :meth:`push` activates a client whose queue was empty,
    :meth:`pop` deactivates one it empties (and forgets one that is retiring).
    """

    __slots__ = ("policy", "queues", "retiring")

    def __init__(self, policy: Policy):
        self.policy = policy
        self.queues: dict[K, collections.deque[T]] = {}
        self.retiring: set[K] = set()

    def __bool__(self) -> bool:
        return bool(self.queues)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self.queues.values())

    def queued(self, key: K) -> int:
        queue = self.queues.get(key)
        return 0 if queue is None else len(queue)

    def push(self, key: K, item: T) -> None:
        """Queues ``item`` behind the client's others."""
        queue = self.queues.get(key)
        if queue is None:
            self.policy.activate(key)
            self.queues[key] = collections.deque((item,))
        else:
            queue.append(item)

    def heads(self) -> list[tuple[K, T]]:
        """Each client's first item, in the order the clients first queued."""
        return [(key, queue[0]) for key, queue in self.queues.items()]

    def pick(self, heads: Sequence[Head]) -> int:
        """The index of the head the policy sends next, counted as picked."""
        index = self.policy.pick(heads)
        self.policy.picked(heads, index)
        return index

    def choose(self, heads: Sequence[Head]) -> int:
        """The index of the head the policy would send next, not yet counted (see :meth:`picked`).

        For a caller that makes a last check (a reservation) before the head
        goes: a head it refuses stays queued, uncharged.
        """
        return self.policy.pick(heads)

    def picked(self, heads: Sequence[Head], index: int) -> None:
        """The head :meth:`choose` gave goes: the policy counts it."""
        self.policy.picked(heads, index)

    def pop(self, key: K) -> T:
        """Takes the client's head off its queue (it goes)."""
        queue = self.queues[key]
        item = queue.popleft()
        if not queue:
            del self.queues[key]
            self.policy.deactivate(key)
            if key in self.retiring:
                self.retiring.discard(key)
                self.policy.forget(key)
        return item

    def drop(self, key: K, head: Head) -> T:
        """Takes the client's head off its queue without sending it (it fails, or was cancelled)."""
        item = self.pop(key)
        self.policy.discard(head)
        return item

    def cancel(self, key: K, doomed: Callable[[T], bool], head_of: Callable[[T], Head]) -> list[T]:
        """Takes the client's queued items for which ``doomed`` holds off its queue, in their order,
        without sending them (they were cancelled); the others keep theirs."""
        queue = self.queues.get(key)
        if queue is None:
            return []
        gone = [item for item in queue if doomed(item)]
        if gone:
            kept = [item for item in queue if not doomed(item)]
            queue.clear()
            queue.extend(kept)
            for item in gone:
                self.policy.discard(head_of(item))
            if not kept:
                self.remove_empty(key)
        return gone

    def remove_empty(self, key: K) -> None:
        """Forgets the client's queue if it is empty (left so by an interrupted push)."""
        if key in self.queues and not self.queues[key]:
            del self.queues[key]
            self.policy.deactivate(key)

    def close(self, key: K, head_of: Callable[[T], Head]) -> list[T]:
        """The client leaves: its queued items (which will not go) and its policy state are dropped."""
        queue = self.queues.pop(key, None)
        items = list(queue or ())
        for item in items:
            self.policy.discard(head_of(item))
        if queue is not None:
            self.policy.deactivate(key)
        self.policy.forget(key)
        self.retiring.discard(key)
        return items

    def retire(self, key: K) -> None:
        """The client queues nothing more: the policy forgets it once its last item went."""
        if key in self.queues:
            self.retiring.add(key)
        else:
            self.policy.forget(key)


class Budget:
    """Per-device (or per-pool) byte budgets and the bytes reserved against them.

    A run's statically-known bytes are reserved before it goes
    (:meth:`try_reserve`); what it holds beyond its outputs is released when
    it completes, its outputs' bytes when their values are freed. Listeners
    (the controller) are called after every release made without the lock.
    """

    def __init__(self, limits: dict[int, int]):
        self.limits = dict(limits)
        self.used = dict.fromkeys(limits, 0)
        self.lock = threading.Lock()
        self.listeners: list[Callable[[], None]] = []

    def fits(self, charge: Charge) -> bool:
        used, limits = self.used, self.limits
        return all(used.get(d, 0) + b <= limits.get(d, b) for d, b in charge)

    def exceeds(self, charge: Charge) -> bool:
        """Whether ``charge`` could never fit, even with nothing else held."""
        return any(d in self.limits and b > self.limits[d] for d, b in charge)

    def hold(self, charge: Charge) -> None:
        """Counts bytes already committed (a value an admitted run made); call with :attr:`lock` held."""
        for d, b in charge:
            self.used[d] = self.used.get(d, 0) + b

    def try_reserve(self, charge: Charge) -> bool:
        """Reserves ``charge`` if it fits now; call with :attr:`lock` held."""
        if not self.fits(charge):
            return False
        self.hold(charge)
        return True

    def release(self, charge: Charge, *, locked: bool = False) -> None:
        if not charge:
            return
        if locked:
            self._sub(charge)
        else:
            with self.lock:
                self._sub(charge)
            self.notify()

    def _sub(self, charge: Charge) -> None:
        for d, b in charge:
            self.used[d] = self.used.get(d, 0) - b

    def notify(self) -> None:
        for listener in list(self.listeners):
            listener()
