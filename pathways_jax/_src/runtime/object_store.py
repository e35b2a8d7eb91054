"""The object store: every value a program produces, reference-counted and owned.

A value's life is a small tagged union: ``Pending`` until the controller has
dispatched the node that makes it, then ``Ready`` (its entry then holds the
``jax.Array``, which may still be computing) or ``Failed``, and ``Freed`` once
freed (``Future.delete()``, its client closed, donated).

A value goes with its last reference, as a ``jax.Array`` does: its entry is
held by its future (and by the run that makes it, until the run is
dispatched), and the store holds only a weak reference to it. No finalizer of
Python's runs when a value goes: the weak reference's callback is a C call
(``deque.append``), so no signal handler can run inside it and a Ctrl-C that
lands as a value goes still reaches the user (an exception raised in a
``__del__`` is dropped), and no Python frame is paid per value. The store
forgets a gone entry's reference (and, under a memory budget, releases its
bytes) at its next :meth:`ObjectStore.collect`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import threading
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pathways_jax._src.core import errors, reentry
from pathways_jax._src.core.charges import Charge, charge_of

if typing.TYPE_CHECKING:
    from pathways_jax._src.runtime.admission import Budget


@dataclasses.dataclass(frozen=True, slots=True)
class Pending:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """The value is dispatched: its entry's ``array`` holds it (one marker for every value).

    Not an object per value: a run of many outputs would make one more object
    per output that the garbage collector tracks and, while the futures live,
    traverses; the array sits on the entry instead.
    """


# Made once per failed value: a plain slotted dataclass (a frozen one pays for
# object.__setattr__ on every field).
@dataclasses.dataclass(slots=True)
class Failed:
    message: str
    cause: BaseException | None


@dataclasses.dataclass(slots=True)
class Consumed(Failed):
    """A value a computation consumed (donated to it): its buffer was reused."""


@dataclasses.dataclass(frozen=True, slots=True)
class Freed:
    pass


State = Pending | Ready | Failed | Freed
PENDING = Pending()
READY = Ready()
FREED = Freed()


class Owner(typing.NamedTuple):
    """Who owns a value: the client that submitted the run (its name and key), and the run."""

    client: str
    run: int
    key: int = 0


MAIN_THREAD = threading.main_thread().ident  # the only thread KeyboardInterrupt lands on


class Entry:
    """One value in the store, owned by exactly one :class:`Future`.

    The value lives as long as that future: the user's references and the
    queued runs that read it (a run holds its input futures until it is
    dispatched) are counted by Python's own reference count of the future.
    The store holds the entry weakly (``ref``, see the module's docstring).
    """

    __slots__ = (
        "__weakref__",
        "array",
        "aval",
        "id",
        "origin",
        "owner",
        "ref",
        "sharding",
        "signature",
        "slice",
        "state",
    )

    def __init__(
        self, entry_id: int, owner: Owner, aval: Any, sharding: Any, slice_: Any, origin: str, signature: Any
    ):
        self.id = entry_id
        self.state: State = PENDING
        self.array: Any = None  # the value once it is Ready (dropped when it is freed or failed)
        self.owner = owner
        self.aval = aval
        self.sharding = sharding
        self.slice = slice_
        self.origin = origin
        # The cache key a program computes for this value as an argument.
        self.signature = signature
        # The store's weak reference to this entry (set by the store that makes it).
        self.ref: weakref.ref[Entry] | None = None


def own_buffer(value: Any) -> Any:
    """``value`` as a buffer of its own: a copy of a ``jax.Array`` (a remote host's value as it is).

    For a program output that would otherwise be an argument's buffer or another output's:
    every output of ``jax.jit`` is its own, which donating or deleting it relies on.
    """
    return value.copy() if isinstance(value, jax.Array) else value


class ObjectStore:
    """Tracks live values; frees a value when its last reference goes."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        # Weak references to the live entries (hashed by their entry while it lived).
        self._live: set[weakref.ref[Entry]] = set()
        # The references of entries gone land here: their callback is this deque's append, a
        # C call that may run at any moment (even while this thread holds a lock), and the
        # next collect() forgets them.
        self._gone: collections.deque[weakref.ref[Entry]] = collections.deque()
        self._on_gone = self._gone.append
        # Bytes reserved under the memory budget for each live value that has any, by its reference.
        self._charges: dict[weakref.ref[Entry], Charge] = {}
        # Values carry no event of their own (creating one per value cost more
        # than a dispatch): a thread that waits for a pending value registers
        # a held lock for it and blocks acquiring it again; wake() releases
        # only the locks of settled values, so a dispatch wakes the threads it
        # concerns, not every waiter. (A bare lock, not a threading.Event:
        # an Event's set and wait run several Python frames on the
        # dispatching thread for every waiter.)
        self._settled = threading.Lock()
        self._waiting: dict[int, tuple[Entry, Any]] = {}
        # Per-device memory budget (None: no budget; nothing is reserved).
        self.budget: Budget | None = None
        # Waits for the runs submitted so far (True: queued ones too) to finish on their
        # devices: set by the cluster whose store this is (its controller runs them).
        self.wait_for_readers: Callable[[bool], None] | None = None

    def new(
        self, owner: Owner, aval: Any, sharding: Any, slice_: Any, origin: str, signature: Any = None
    ) -> Entry:
        entry = Entry(next(self._ids), owner, aval, sharding, slice_, origin, signature)
        self._collect_before_new()
        ref = entry.ref = weakref.ref(entry, self._on_gone)
        self._live.add(ref)  # one set store: atomic under the GIL
        return entry

    def new_run(
        self, owner: Owner, outputs: list[Any], signatures: list[Any], slices: Sequence[Any]
    ) -> list[Entry]:
        """One entry per output of a run, as :meth:`new` each.

        ``outputs``, ``signatures``, ``slices``: its plan's output slots, their
        keys, and the slice (``VirtualSlice``) each is on (``Runnable.output_slices``).
        """
        self._collect_before_new()
        ids = self._ids
        entries = [
            Entry(next(ids), owner, out.aval, out.sharding, slice_, out.origin, signature)
            for out, signature, slice_ in zip(outputs, signatures, slices, strict=True)
        ]
        live, ref, on_gone = self._live, weakref.ref, self._on_gone
        for entry in entries:
            entry.ref = gone = ref(entry, on_gone)
            live.add(gone)  # one set store each: atomic under the GIL
        return entries

    def new_batch(self, owner: Owner, origin: str) -> Entry:
        """The one entry of a run whose outputs are read as soon as it is dispatched
        (``submission.submit_values``): not one per output.

        Its ``array`` becomes the tuple of the run's outputs (``Controller._publish``), or
        its state the run's failure. The store does not list it: the caller that waits
        for it holds it, reads the outputs, and makes entries (:meth:`new`) only for those
        it hands out as futures; the others, read as arrays, never were values of the store's.
        """
        return Entry(next(self._ids), owner, None, None, None, origin, None)

    def _collect_before_new(self) -> None:
        """Frees dropped values before new ones are made.

        Under a budget the main thread leaves freeing to the controller's thread:
        an interrupt there could cut a release in two and lose the bytes.
        """
        if self._gone and (self.budget is None or threading.get_ident() != MAIN_THREAD):
            self.collect()

    def collect_dropped(self) -> None:
        """Forgets the values gone, where :meth:`new` would (see ``_collect_before_new``)."""
        self._collect_before_new()

    def has_dropped(self) -> bool:
        """True when values went since the last :meth:`collect`."""
        return bool(self._gone)

    def collect(self) -> None:
        """Forgets the values gone (their buffers went with them), and releases their reserved bytes."""
        live, gone = self._live, self._gone
        budget = self.budget
        if budget is None:  # the common case, in one tight loop
            while gone:
                try:
                    live.discard(gone.popleft())
                except IndexError:
                    break
            return
        released = False
        charges = self._charges
        while gone:
            try:
                ref = gone.popleft()
            except IndexError:
                break
            live.discard(ref)
            with budget.lock:
                charge = charges.pop(ref, None)
                if charge:
                    budget.release(charge, locked=True)
                    released = True
        if released:
            budget.notify()

    def reserve(self, entry: Entry, charge: Charge) -> None:
        """Records ``charge``, reserved under the memory budget, as ``entry``'s (under ``budget.lock``).

        Released when the value is freed or goes (:meth:`free`, :meth:`collect`).
        """
        self._charges[entry.ref] = charge  # type: ignore[index]

    def free(
        self,
        entries: list[Entry],
        failure: tuple[str, BaseException | None] | None = None,
        consumed: bool = False,
    ) -> int:
        """Frees ``entries`` now (or marks them failed, or ``consumed`` by a computation they
        were donated to): their buffers and reserved bytes go.

        A freed or consumed value loses its signature: the repeat-call paths, which
        compare signatures, then sign a call passing it, and signing refuses it.
        Returns how many were still alive.
        """
        budget = self.budget
        live = self._live
        count = 0
        for entry in entries:
            ref = entry.ref
            if ref in live:
                live.discard(ref)
                count += 1
            state: State = FREED if failure is None else (Consumed if consumed else Failed)(*failure)
            if failure is None or consumed:
                entry.signature = None
            if budget is None:
                if not isinstance(entry.state, Freed):
                    entry.state = state
                    entry.array = None
                continue
            with budget.lock:
                if not isinstance(entry.state, Freed):
                    entry.state = state
                    entry.array = None
                charge = self._charges.pop(ref, None)  # type: ignore[arg-type]
                budget.release(charge or (), locked=True)
        if budget is not None:
            budget.notify()
        self.wake()
        return count

    def entries(self) -> list[Entry]:
        """The live values' entries."""
        return [entry for entry in map(operator.call, list(self._live)) if entry is not None]

    def entries_of(self, run: int) -> list[Entry]:
        """The live values of the run with this id, in the order it made them."""
        return sorted((e for e in self.entries() if e.owner.run == run), key=operator.attrgetter("id"))

    def owned_by(self, key: int) -> list[Entry]:
        """The live values owned by the client with this key."""
        return [e for e in self.entries() if e.owner.key == key]

    def bytes_in_use(self) -> dict[int, int]:
        """Bytes of the live, computed values on each device (from their static shapes)."""
        used: collections.Counter[int] = collections.Counter()
        for entry in self.entries():
            if isinstance(entry.state, Ready):
                for d, b in charge_of(entry.aval, entry.sharding):
                    used[d] += b
        return dict(used)

    @staticmethod
    def set_ready(entry: Entry, array: jax.Array) -> None:
        """Marks a value ready; call :meth:`wake` once the run's values are all set."""
        if not isinstance(entry.state, Freed):
            entry.array = array
            entry.state = READY

    @staticmethod
    def set_failed(entry: Entry, message: str, cause: BaseException | None) -> None:
        """Marks a value failed; call :meth:`wake` once the run's values are all set."""
        if not isinstance(entry.state, Freed):
            entry.state = Failed(message, cause)
            entry.array = None

    def wake(self) -> None:
        """Wakes the threads waiting for values that are no longer pending."""
        if self._waiting:
            with self._settled:
                waiting = self._waiting
                woken = [key for key, (entry, _) in waiting.items() if type(entry.state) is not Pending]
                for key in woken:
                    waiting.pop(key)[1].release()

    def wait_settled(self, entry: Entry, timeout: float | None) -> bool:
        """Waits until ``entry`` is no longer pending; False if ``timeout`` expired.

        Raises ``PathwaysError`` at once on a thread inside the runtime's work
        (``reentry.inside``: the controller's, where host callbacks run, or one
        holding the controller's locks): the run that makes the value cannot be
        dispatched until it leaves, so the wait would never end.
        """
        if type(entry.state) is not Pending:
            return True
        if reentry.inside.depth:
            raise errors.PathwaysError(
                f"{entry.origin} is not computed yet, and this wait runs on a thread that is inside "
                "pathways_jax's dispatch (Python code run meanwhile: a host callback such as "
                "jax.pure_callback or jax.debug.callback, a garbage-collector finalizer, a signal "
                "handler): the run that computes the value cannot be dispatched until this thread "
                "leaves it, so the wait would never end. Pass the value to the program as an argument, "
                "or wait for it outside such code."
            )
        waiter = threading.Lock()
        waiter.acquire()
        key = id(waiter)
        with self._settled:
            # State is set before wake() takes the lock: looking again under it
            # cannot miss a wake-up.
            if type(entry.state) is not Pending:
                return True
            self._waiting[key] = (entry, waiter)
        # wake() releases the lock once it has taken it out of _waiting.
        if not waiter.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            with self._settled:
                self._waiting.pop(key, None)
        return type(entry.state) is not Pending

    def live_count(self) -> int:
        """How many values are alive (held by a future or a queued run)."""
        self.collect()
        return len(self.entries())
