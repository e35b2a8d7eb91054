"""What a simulation tracks as it goes: runs, their dispatched steps, in-flight windows."""

from __future__ import annotations

import math
from typing import Any

from pathways_jax.sim._workload import Step


class Window:
    """A bound on executables in flight; waiters ask for the count to fall to a level."""

    def __init__(self, env: Any, size: int):
        self.env = env
        self.size = size
        self.count = 0
        self._waiters: list[tuple[int, Any]] = []

    def until(self, level: int) -> Any:
        event = self.env.event()
        if self.count <= level:
            event.succeed()
        else:
            self._waiters.append((level, event))
        return event

    def release(self) -> None:
        self.count -= 1
        still = []
        for level, event in self._waiters:
            if self.count <= level:
                event.succeed()
            else:
                still.append((level, event))
        self._waiters = still


class Item:
    """One step of one run, once dispatched."""

    __slots__ = ("done", "end", "enqueued", "hosts_left", "index", "run", "start", "step")

    def __init__(self, env: Any, run: Run, index: int, step: Step, hosts: int):
        self.run = run
        self.index = index
        self.step = step
        self.done = env.event()
        self.enqueued = env.event()
        self.hosts_left = hosts
        self.start = math.nan
        self.end = math.nan


class Run:
    """One client's run: when it was submitted and dispatched, and its items once dispatched."""

    __slots__ = (
        "client",
        "dispatch_end",
        "dispatch_start",
        "done",
        "index",
        "items",
        "prev",
        "seq",
        "submitted",
    )

    def __init__(self, client: int, index: int, seq: int, submitted: float, prev: Run | None):
        self.client = client
        self.index = index
        self.seq = seq
        self.submitted = submitted
        self.prev = prev
        self.items: list[Item] = []
        self.dispatch_start = math.nan
        self.dispatch_end = math.nan
        self.done: Any = None
