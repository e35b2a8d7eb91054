"""The object store: every value a program produces, reference-counted and owned.

A value's life is a small tagged union: ``Pending`` until the controller has
dispatched the node that makes it, then ``Ready`` (holding the ``jax.Array``,
which may still be computing) or ``Failed``, and ``Freed`` once its last
reference is gone.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any

import jax


@dataclasses.dataclass(frozen=True, slots=True)
class Pending:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    array: jax.Array


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    message: str
    cause: BaseException | None


@dataclasses.dataclass(frozen=True, slots=True)
class Freed:
    pass


State = Pending | Ready | Failed | Freed
PENDING = Pending()
FREED = Freed()


@dataclasses.dataclass(frozen=True, slots=True)
class Owner:
    """Who owns a value: the client that submitted the run, and the run."""

    client: str
    run: int


class Entry:
    """One value in the store. ``refs`` counts futures and queued runs holding it."""

    __slots__ = ("aval", "id", "origin", "owner", "refs", "sharding", "signature", "slice", "state")

    def __init__(
        self, entry_id: int, owner: Owner, aval: Any, sharding: Any, slice_: Any, origin: str, signature: Any
    ):
        self.id = entry_id
        self.state: State = PENDING
        self.owner = owner
        self.refs = 1
        self.aval = aval
        self.sharding = sharding
        self.slice = slice_
        self.origin = origin
        # The cache key a program computes for this value as an argument.
        self.signature = signature


class ObjectStore:
    """Tracks live values; frees a value when its last reference goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._live: dict[int, Entry] = {}
        # Futures dropped by the garbage collector land here: a finaliser may
        # run at any allocation, even while this thread holds the lock, so it
        # only appends (atomic) and the next store operation does the freeing.
        self._dropped: collections.deque[Entry] = collections.deque()
        # One condition for every value: waiting is rare, so values carry no
        # event of their own (creating one per value cost more than a dispatch).
        self._settled = threading.Condition(threading.Lock())
        self._waiters = 0

    def new(
        self, owner: Owner, aval: Any, sharding: Any, slice_: Any, origin: str, signature: Any = None
    ) -> Entry:
        entry = Entry(next(self._ids), owner, aval, sharding, slice_, origin, signature)
        if self._dropped:
            self.collect()
        with self._lock:
            self._live[entry.id] = entry
        return entry

    def drop(self, entry: Entry) -> None:
        """Called from ``Future.__del__``: frees the reference at the next collect()."""
        self._dropped.append(entry)

    def collect(self) -> None:
        """Applies the references dropped by finalisers."""
        while self._dropped:
            try:
                entry = self._dropped.popleft()
            except IndexError:
                return
            self.decref(entry)

    def incref(self, entry: Entry) -> None:
        with self._lock:
            entry.refs += 1

    def decref(self, entry: Entry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            self._live.pop(entry.id, None)
        # Dropping the store's reference lets JAX free the buffer once nothing
        # else (a queued computation, an array the user took) holds it.
        entry.state = FREED
        self.wake()

    @staticmethod
    def set_ready(entry: Entry, array: jax.Array) -> None:
        """Marks a value ready; call :meth:`wake` once the run's values are all set."""
        if not isinstance(entry.state, Freed):
            entry.state = Ready(array)

    @staticmethod
    def set_failed(entry: Entry, message: str, cause: BaseException | None) -> None:
        """Marks a value failed; call :meth:`wake` once the run's values are all set."""
        if not isinstance(entry.state, Freed):
            entry.state = Failed(message, cause)

    def wake(self) -> None:
        """Wakes the threads waiting for values that were pending."""
        if self._waiters:
            with self._settled:
                self._settled.notify_all()

    def wait_settled(self, entry: Entry, timeout: float | None) -> bool:
        """Waits until ``entry`` is no longer pending; False if ``timeout`` expired."""
        if not isinstance(entry.state, Pending):
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._settled:
            self._waiters += 1
            try:
                while isinstance(entry.state, Pending):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._settled.wait(remaining)
            finally:
                self._waiters -= 1
        return True

    def live_count(self) -> int:
        """How many values are alive (held by a future or a queued run)."""
        self.collect()
        with self._lock:
            return len(self._live)
