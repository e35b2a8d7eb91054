"""The compiled executables a cluster shares between plans, bounded in count and in what they hold."""

from __future__ import annotations

import collections
import threading
from typing import Any

from pathways_jax._src.core.gone import Gone

# Compiled executables a cluster keeps for sharing between plans (the plans
# themselves hold theirs): beyond this many the least recently used go.
EXECUTABLE_CACHE_SIZE = 256


class ExecutableCache:
    """Compiled node executables shared by plans: a function called in many programs compiles once.

    Keyed by the node's text, its constants' identities, mesh, shardings and
    donation. Bounded: past ``size`` entries the least recently used goes,
    and an entry goes once one of its constants is collected (at the cache's
    next use), so the arrays a dropped program closed over are not kept
    alive. Constants that take no weak reference are held, within the bound.
    A plan holds its own executables: eviction costs at most a compile when
    a plan is lowered again.
    """

    def __init__(self, size: int = EXECUTABLE_CACHE_SIZE):
        self.size = size
        self._entries: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()
        # Keys whose constants died: noted at any allocation, even under the lock, with no
        # Python code run (core.gone), and the next use evicts.
        self._dead: Gone[tuple] = Gone()

    def get(self, key: tuple) -> Any:
        with self._lock:
            self._evict_dead()
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        return None

    def put(self, key: tuple, value: Any, consts: tuple) -> None:
        held: tuple = ()
        try:
            for const in consts:
                self._dead.watch(const, key)
        except TypeError:  # a constant that takes no weak reference: hold it (its id stays unique)
            held = consts
        with self._lock:
            self._evict_dead()
            self._entries[key] = (value, held)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drops every entry (``jax.clear_caches()``): plans lowered later compile again."""
        with self._lock:
            self._entries.clear()
            self._dead.clear()

    def _evict_dead(self) -> None:
        while self._dead:
            self._entries.pop(self._dead.popleft(), None)

    def __len__(self) -> int:
        with self._lock:
            self._evict_dead()
            return len(self._entries)


__all__ = ["EXECUTABLE_CACHE_SIZE", "ExecutableCache"]
