"""Gang-scheduling policies: which queued run the controller dispatches next.

The controller keeps one FIFO queue per client (a client's runs keep their
order) and asks a policy to choose among the queues' *heads* that can go now.
Every device of an island then sees programs in the order of that one
sequence of choices, so concurrent SPMD programs with collectives cannot
deadlock whatever the policy picks. The policies here are plain objects of
explicit state, with no threads and no clock: tests drive them directly.

- :class:`Fifo`: the oldest head (global submission order).
- :class:`Priority`: the highest ``priority``, FIFO within a level; a head
  passed over more than ``starvation_limit`` times goes next.
- :class:`Fair`: proportional share of device time by ``weight`` (stride
  scheduling): each client has a virtual time advanced by the device time its
  runs cost divided by its weight; the head with the smallest virtual time goes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Literal, Protocol, runtime_checkable

PolicyName = Literal["fifo", "priority", "fair"]
POLICIES: tuple[str, ...] = ("fifo", "priority", "fair")
DEFAULT_STARVATION_LIMIT = 16


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """The first queued run of one client, as a policy sees it.

    Attributes:
      client: the client's key (any hashable).
      seq: the run's submission number (smaller: submitted earlier).
      priority: the client's priority (higher goes first under ``"priority"``).
      weight: the client's share under ``"fair"`` (> 0).
      cost: the run's estimated device time in seconds.
    """

    client: Hashable
    seq: int
    priority: int = 0
    weight: float = 1.0
    cost: float = 0.0


@runtime_checkable
class Policy(Protocol):
    """Everything the controller asks of a scheduling policy.

    The controller calls every method, whatever the policy (one that has no use
    for a call makes it a no-op), always under its lock. A client's state may
    live from its first :meth:`activate` or :meth:`charge` until :meth:`forget`;
    a run's, from the time it heads its queue until :meth:`picked` or
    :meth:`discard`. Nothing is kept past those calls.
    """

    name: str
    # False when charge() does nothing: the controller's inline dispatch then skips
    # the call and the lock it needs (a run dispatched on the caller's thread).
    charges: bool

    def pick(self, heads: Sequence[Head]) -> int:
        """The index in ``heads`` of the run to dispatch next (``heads`` is non-empty)."""
        ...

    def picked(self, heads: Sequence[Head], index: int) -> None:
        """``heads[index]`` was dispatched; the other heads were passed over."""
        ...

    def activate(self, client: Hashable) -> None:
        """``client``'s queue became non-empty."""
        ...

    def deactivate(self, client: Hashable) -> None:
        """``client``'s queue became empty (its runs were dispatched, failed or cancelled)."""
        ...

    def charge(self, client: Hashable, seconds: float, weight: float) -> None:
        """``client`` used ``seconds`` of device time outside :meth:`picked` (an inline dispatch)."""
        ...

    def discard(self, head: Head) -> None:
        """A queued run left its queue without being picked (it failed or was cancelled)."""
        ...

    def forget(self, client: Hashable) -> None:
        """``client`` was closed: drops everything kept for it."""
        ...


class Fifo:
    """Dispatches the oldest head: plain submission order.

    Example:
      >>> p = Fifo()
      >>> p.pick([Head("a", seq=5), Head("b", seq=2)])
      1
    """

    name = "fifo"
    charges = False

    def pick(self, heads: Sequence[Head]) -> int:
        seqs = [head.seq for head in heads]
        return seqs.index(min(seqs))

    def picked(self, heads: Sequence[Head], index: int) -> None:
        pass

    def activate(self, client: Hashable) -> None:
        pass

    def deactivate(self, client: Hashable) -> None:
        pass

    def charge(self, client: Hashable, seconds: float, weight: float) -> None:
        pass

    def discard(self, head: Head) -> None:
        pass

    def forget(self, client: Hashable) -> None:
        pass


class Priority:
    """Highest priority first, FIFO within a level, with a bound on starvation.

    A head that was eligible and passed over more than ``starvation_limit``
    times goes next (the longest-starved first), whatever its priority.

    Example:
      >>> p = Priority(starvation_limit=1)
      >>> heads = [Head("low", seq=0, priority=0), Head("high", seq=1, priority=5)]
      >>> [p.pick(heads), p.pick(heads)]
      [1, 1]
      >>> p.picked(heads, 1); p.picked(heads, 1)  # "low" passed over twice
      >>> p.pick(heads)
      0
    """

    name = "priority"
    charges = False

    def __init__(self, starvation_limit: int = DEFAULT_STARVATION_LIMIT):
        self.starvation_limit = starvation_limit
        self.passed: dict[int, int] = {}  # run seq -> times passed over

    def pick(self, heads: Sequence[Head]) -> int:
        starved = [i for i in range(len(heads)) if self.passed.get(heads[i].seq, 0) > self.starvation_limit]
        if starved:
            return min(starved, key=lambda i: (-self.passed[heads[i].seq], heads[i].seq))
        return min(range(len(heads)), key=lambda i: (-heads[i].priority, heads[i].seq))

    def picked(self, heads: Sequence[Head], index: int) -> None:
        self.passed.pop(heads[index].seq, None)
        for i, head in enumerate(heads):
            if i != index:
                self.passed[head.seq] = self.passed.get(head.seq, 0) + 1

    def discard(self, head: Head) -> None:
        """Drops the count of a run that left its queue without being picked."""
        self.passed.pop(head.seq, None)

    def activate(self, client: Hashable) -> None:
        pass

    def deactivate(self, client: Hashable) -> None:
        pass

    def charge(self, client: Hashable, seconds: float, weight: float) -> None:
        pass

    def forget(self, client: Hashable) -> None:
        pass  # counts are per run: the client's runs were picked or discarded


class Fair:
    """Proportional share of device time by weight (stride scheduling).

    Each client has a virtual time; a dispatched run advances it by its
    estimated cost divided by the client's weight, and :meth:`charge` corrects
    it once the real device time is measured. The head with the smallest
    virtual time goes (ties: the oldest). A client that becomes active again
    starts at the smallest virtual time of the active clients, so idling
    banks no credit.

    Example:
      >>> p = Fair()
      >>> heads = [Head("a", seq=0, weight=1.0, cost=1.0), Head("b", seq=1, weight=3.0, cost=1.0)]
      >>> order = []
      >>> for _ in range(8):
      ...     i = p.pick(heads)
      ...     p.picked(heads, i)
      ...     order.append(heads[i].client)
      >>> order.count("b"), order.count("a")
      (6, 2)
    """

    name = "fair"
    charges = True

    def __init__(self) -> None:
        self.vtime: dict[Hashable, float] = {}
        self.active: set[Hashable] = set()

    def _floor(self) -> float:
        live = [self.vtime[c] for c in self.active if c in self.vtime]
        return min(live) if live else max(self.vtime.values(), default=0.0)

    def pick(self, heads: Sequence[Head]) -> int:
        return min(range(len(heads)), key=lambda i: (self.vtime.get(heads[i].client, 0.0), heads[i].seq))

    def picked(self, heads: Sequence[Head], index: int) -> None:
        head = heads[index]
        self.charge(head.client, head.cost, head.weight)

    def activate(self, client: Hashable) -> None:
        floor = self._floor()
        self.vtime[client] = max(self.vtime.get(client, floor), floor)
        self.active.add(client)

    def deactivate(self, client: Hashable) -> None:
        self.active.discard(client)

    def charge(self, client: Hashable, seconds: float, weight: float) -> None:
        self.vtime[client] = self.vtime.get(client, 0.0) + seconds / weight

    def discard(self, head: Head) -> None:
        pass  # a run that never went charged nothing

    def forget(self, client: Hashable) -> None:
        self.vtime.pop(client, None)
        self.active.discard(client)


def make(policy: str, *, starvation_limit: int = DEFAULT_STARVATION_LIMIT) -> Policy:
    """The policy object for a ``pw.init(scheduler=...)`` name."""
    match policy:
        case "fifo":
            return Fifo()
        case "priority":
            return Priority(starvation_limit)
        case "fair":
            return Fair()
    raise ValueError(f"unknown scheduler {policy!r}; expected one of {POLICIES}")


__all__ = ["POLICIES", "Fair", "Fifo", "Head", "Policy", "Priority", "make"]
