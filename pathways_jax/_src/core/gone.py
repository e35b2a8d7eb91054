"""Keys of objects garbage-collected since the last look, noted with no Python code run.

A ``weakref.finalize`` callback is Python code (``finalize.__call__``) even
when its function is a C method: run on the main thread wherever the last
reference went (a cell dropping a program), it is where a Ctrl-C landing is
only reported ("Exception ignored in: <finalize object>"), never raised to
the user, and one landing as it starts loses the callback itself. Here the
callback of each object's weak reference is a C method (``deque.append``):
no Python frame runs as the object goes, and the key is read at the next look.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Generic, TypeVar

K = TypeVar("K")
_MISSING: Any = object()


class Gone(Generic[K]):
    """Watches objects by key; :meth:`popleft` gives the keys of those gone (truthy while some are)."""

    def __init__(self) -> None:
        # By the reference's id (an object that cannot be hashed, a NumPy array, may be watched):
        # unique while the reference, held here, lives.
        self._keys: dict[int, tuple[weakref.ref[Any], K]] = {}
        self._dead: collections.deque[weakref.ref[Any]] = collections.deque()

    def watch(self, obj: Any, key: K) -> None:
        """Notes ``key`` once ``obj`` is garbage. Raises TypeError if ``obj`` takes no weak reference."""
        ref = weakref.ref(obj, self._dead.append)
        self._keys[id(ref)] = (ref, key)

    def __bool__(self) -> bool:
        return bool(self._dead)

    def popleft(self) -> K:
        """The key of the object gone first since the last look; IndexError if none went.

        Each step is one C call: a Ctrl-C between them leaves the key for the next look, once.
        """
        while True:
            ref = self._dead[0]
            entry = self._keys.pop(id(ref), _MISSING)
            self._dead.popleft()
            if entry is not _MISSING:
                return entry[1]

    def clear(self) -> None:
        """Forgets the keys of the objects gone so far (those still watched are noted when they go)."""
        while self._dead:
            self._keys.pop(id(self._dead[0]), None)
            self._dead.popleft()


__all__ = ["Gone"]
