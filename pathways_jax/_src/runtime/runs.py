"""A run: one call of a program, queued for the controller (made by ``submission``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pathways_jax._src.core.charges import Charge

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan
    from pathways_jax._src.runtime.futures import Future


class Staged(Protocol):
    """Host-input bytes a queued run holds until admission (``submission.StagedBytes``)."""

    def release(self) -> None:
        """Gives the bytes back (once: later calls do nothing)."""
        ...


@dataclasses.dataclass(slots=True)
class Run:
    """One call of a program, queued for the controller."""

    id: int
    plan: Plan
    env: list[Any]
    # The run's future inputs and their slots in ``env``, in one order: read at dispatch. Two
    # sequences, not a pair per input: a run of many leaves makes no object per input.
    feed_slots: Sequence[int]
    feeds: list[Future]
    outputs: list[Any]
    failed: bool = False
    # A run whose caller reads its outputs once it is dispatched (``submission.submit_values``)
    # has one entry for them all, here, and no ``outputs``: its array becomes their tuple.
    batch: Any = None
    # The client that submitted the run, its place in the submission order,
    # and what the scheduler and the memory budget know of it.
    client: Any = None
    seq: int = 0
    estimate: float = 0.0  # device-seconds charged to the client at dispatch
    transient: Charge = ()  # reserved bytes released when the run completes
    blocked_since: float | None = None  # when it first waited for memory
    blocked_ns: int = 0
    staged: Staged | None = None  # host-input bytes held until admission (under a budget)
    head: Any = (
        None  # how the scheduling policy sees it once queued (a scheduler.Head; cost refreshed when picked)
    )


__all__ = ["Run", "Staged"]
