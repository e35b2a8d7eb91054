"""The controller's in-flight windows: per key, the work dispatched there and not known done.

A window's key is an island's index (executables over several devices, or
calling back into Python, whose order must be one on every device) or a
device's ``base.device_window_key`` (the runs its single-device executables
queued there). Entries are appended by the thread that dispatches (under the
controller's dispatch lock) and the settled ones at the front leave under
:attr:`InFlightWindows.lock`, from whichever thread looks. This is what a
backend is handed while it dispatches (``base.Windows``).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from pathways_jax._src.backends.base import Backend, RunView
from pathways_jax._src.core import events, readiness, reentry

# A window's entries are (an output of what was dispatched, the _Flight of its run).
Entry = tuple[Any, "Flight"]
_FLIGHTS_KEPT = 256  # what windows keep of runs, made once per plan and client (in_flight)


class Flight:
    """What a window keeps of a dispatched run until its entry settles.

    Not the run: a window's entries leave only when the window is next looked
    at, and the run's plan holds its executables and the constants they close
    over, which a dropped program must let go (``Invariants``: nothing grows).
    The plan is only needed while it lives (its measured cost, :meth:`InFlightWindows.short_oldest`).
    """

    __slots__ = ("client", "plan")

    def __init__(self, run: RunView):
        self.plan = weakref.ref(run.plan)
        self.client: str = run.client.name


class InFlightWindows:
    """Every window of one controller, by key, with the sizes that bound them.

    Args:
      backend: settles a window's entries (``Backend.settle``).
      island_size: entries an island's window holds.
      device_size: entries a device's window holds.
      island_of: the island of each device's window key (for traces and stats).
      cost: a plan's median device seconds a run lately (0: none measured yet), for :meth:`short_oldest`.
    """

    def __init__(
        self,
        backend: Backend,
        island_size: int,
        device_size: int,
        island_of: dict[int, int],
        cost: Callable[[Any], float],
    ):
        self.backend = backend
        self.island_size = island_size
        self.device_size = device_size
        self.island_of = island_of
        self._cost = cost
        self.entries: dict[int, collections.deque[Entry]] = collections.defaultdict(collections.deque)
        self._flights: dict[tuple[int, str], Flight] = {}  # by plan and client (see in_flight)
        self.lock = threading.Lock()  # the settled entries at a window's front leave under it

    def size(self, key: int) -> int:
        """How many entries window ``key`` holds: an island's executables, or a device's runs."""
        return self.island_size if key >= 0 else self.device_size

    def settle(self, key: int) -> int:
        """Drops the settled entries at the front of window ``key``; how many are left.

        Oldest first, up to the first one still running: those behind it
        count as running, which at worst makes a run wait for the next look.
        """
        entries = self.entries[key]
        inside = reentry.inside
        inside.depth += 1
        try:
            with self.lock:
                self.backend.settle(entries)
                return len(entries)
        finally:
            inside.depth -= 1

    def settle_all(self) -> None:
        """Drops the settled entries of every window (the outputs they watched stay no longer)."""
        for key in list(self.entries):
            self.settle(key)

    def short_oldest(self, key: int, short_s: float) -> bool:
        """True if the oldest entry of window ``key`` is of a run known to take at most ``short_s``."""
        entries = self.entries[key]
        if not entries:
            return False
        plan = entries[0][1].plan()
        cost = self._cost(plan) if plan is not None else 0.0
        return 0.0 < cost <= short_s

    def only_of(self, key: int, client: str) -> bool:
        """True if every entry of window ``key`` is of runs of the client named ``client``."""
        return all(flight.client == client for _, flight in list(self.entries[key]))

    def drain(self, key: int, short_s: float, deadline: float | None = None, block_s: float = 0.0) -> None:
        """Waits (inside XLA, no lock held) until window ``key`` is at most half full.

        Only on short runs: it stops at an entry of a run not known to take at most ``short_s``.
        With a ``deadline`` (``time.monotonic()``) it stops then too: a run known to take at most
        ``block_s`` is waited for inside XLA, a longer one looked at now and then until then (a
        run that measured short may hang now: one waiting for a host callback's gate).
        """
        low = self.size(key) // 2
        while self.settle(key) > low and self.short_oldest(key, short_s):
            oldest, flight = self.entries[key][0]
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                plan = flight.plan()
                if not 0.0 < (self._cost(plan) if plan is not None else 0.0) <= block_s:
                    readiness.poll([oldest], lambda: time.monotonic() >= deadline, blocking_s=left)
                    continue
            with contextlib.suppress(Exception):  # its error reaches the run's futures
                readiness.block(oldest)

    def markers(self) -> list[Any]:
        """A snapshot of every entry's marker (taken under :attr:`lock`)."""
        with self.lock:
            return [marker for window in list(self.entries.values()) for marker, _ in window]

    def by_island(self) -> dict[int, int]:
        """Executables (or host messages) in an island's window, dispatched and not settled, per island.

        What ``max_in_flight`` bounds. The devices' windows (keys < 0) count
        runs, not executables, under another bound: they are not added in.
        """
        return {
            island: sum(1 for item in list(items) if not readiness.settled(item[0]))
            for island, items in list(self.entries.items())
            if island >= 0
        }

    # --- base.Windows: what a backend asks while it dispatches ------------------------------

    def make_room(self, key: int) -> None:
        """Makes room for one more entry in window ``key``, waiting for the oldest if need be.

        The controller dispatches a run only once its windows have room, so
        this waits only for a run with more executables there than the window
        holds (for its own oldest ones), or when a dispatch on another thread
        filled the window in between. A full window is drained to half: the
        dispatching thread then wakes once per half window, not once per executable.
        """
        size = self.size(key)
        if len(self.entries[key]) < size or self.settle(key) < size:
            return
        sink = events.SINK
        t0 = events.now() if sink is not None else 0
        flight = None
        low = size // 2
        while self.settle(key) > low:
            oldest, flight = self.entries[key][0]
            # Its error reaches the run's futures, and the watcher counts the run.
            with contextlib.suppress(Exception):
                readiness.block(oldest)
        if sink is not None and flight is not None:
            sink(
                events.Waited(
                    reason="in-flight window",
                    client=flight.client,
                    island=self.island_of.get(key, key),
                    start=t0,
                    end=events.now(),
                )
            )

    def in_flight(self, key: int, marker: Any, run: RunView) -> None:
        """``marker`` settles when the work just dispatched in window ``key`` for ``run`` is done."""
        # What a window keeps of a run is the same for every run of a plan and client: made
        # once (on a single device this is once per run, and making it cost about 2 µs of a
        # pw.jit call's 30). Bounded: throw-away programs or clients do not pile up here.
        kept = (run.plan.key, run.client.name)
        flight = self._flights.get(kept)
        if flight is None:
            if len(self._flights) >= _FLIGHTS_KEPT:
                self._flights.clear()
            flight = self._flights[kept] = Flight(run)
        self.entries[key].append((marker, flight))

    def handed_on(self, consumed: Sequence[Any], marker: Any) -> None:
        """An executable whose output is ``marker`` just took the buffers ``consumed`` (donation)."""
        # Donation deletes an entry's marker when the next executable takes its buffer (a
        # train step's parameters): deleted reads as settled, and the window would stop
        # bounding collectives in flight (DESIGN, "Donation and the in-flight window").
        # The taker runs after the maker, so its output marks both. Under the lock, as
        # entries leave under it; one that a look between the call and here saw deleted has
        # left already, which at worst lets one more executable in for a moment.
        ids = {id(array) for array in consumed}
        with self.lock:
            for window in list(self.entries.values()):
                for index in [i for i, (old, _) in enumerate(window) if id(old) in ids]:
                    window[index] = (marker, window[index][1])


__all__ = ["Flight", "InFlightWindows"]
