"""Is a value computed yet: one answer for every kind of array the runtime holds.

``jax.Array`` has ``is_ready``; arrays of extended dtypes (typed PRNG keys from
``jax.random.key``) do not, but wrap a plain array that has; values on Ray
hosts (``RemoteArray``) answer for themselves. Everything in the runtime that
asks whether a value is done asks here, so no array type a ``jax.jit``
function can return can break the controller.
"""

from __future__ import annotations

import operator
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from pathways_jax._src.core import reentry


@runtime_checkable
class RemoteValue(Protocol):
    """A value a backend holds away from this process (``ray_values.RemoteArray``): a capability.

    The runtime checks for it (``isinstance``), never for a backend's class.
    """

    def is_ready(self) -> bool:
        """True once the value is computed (or failed); never waits."""
        ...

    def wait_ready(self, timeout: float) -> None:
        """Returns once the value is ready or after ``timeout`` seconds."""
        ...

    def fetch(self, deadline: float | None = None) -> Any:
        """The value brought to this process as a ``jax.Array``; ``FutureTimeoutError`` if it has
        not come by ``deadline`` (``time.monotonic()``; None: none), the fetch going on for a next call."""
        ...


def hold_frames() -> None:
    """Gives each frame of the caller's stack its frame object, before a call into jaxlib that captures a traceback.

    jaxlib's ``is_ready()``, ``block_until_ready()`` and ``device_put`` capture
    the calling thread's Python traceback into a buffer of that thread's,
    making a frame object for each frame that has none yet. Making one may
    start a garbage collection, whose finalizers run there, in the middle of
    the capture: a finalizer that asks jaxlib the same (reads a program's
    value) fills that buffer too, and the outer capture then keeps code objects
    it holds no reference to; CPython later frees a code object still in use
    and crashes (one process in a few where finalizers read values while the
    runtime's threads ask about outputs). Made here first, in plain Python
    where a finalizer is harmless, the capture makes none and no collection
    can start inside it. A few tens of nanoseconds a frame once each has one.
    """
    frame: Any = sys._getframe(1)
    while frame is not None:
        frame = frame.f_back


def _probe(array: Any) -> Any:
    """The object whose ``is_ready`` answers for ``array``."""
    if hasattr(array, "is_ready"):
        return array
    base = getattr(array, "_base_array", None)  # extended dtypes: typed keys and the like
    if base is not None and hasattr(base, "is_ready"):
        return base
    return None


def is_ready(array: Any) -> bool:
    """True once ``array`` is computed (or failed). Never waits, except for unknown kinds.

    Raises what the computation raised, like ``jax.Array.is_ready``.
    """
    probe = _probe(array)
    if probe is not None:
        hold_frames()
        deleted = getattr(probe, "is_deleted", None)
        asks = (probe.is_ready,) if deleted is None else (deleted, probe.is_ready)
        return any(map(operator.call, asks))  # see settled(): deleted first, both in one call into C
    array.block_until_ready()  # a kind that cannot be asked: wait for it
    return True


def is_deleted(array: Any) -> bool:
    """True if ``array``'s buffers were deleted (freed or donated by its user)."""
    probe = getattr(array, "is_deleted", None)
    return bool(probe()) if probe is not None else False


def settled(array: Any) -> bool:
    """True once nothing more will happen to ``array``: computed, failed or deleted.

    On the dispatch path: two calls into XLA for a plain array.
    """
    hold_frames()
    try:
        # Deleted first: asking a deleted array whether it is ready crashes XLA's CPU client. Both
        # asked in one call into C: no other thread runs between them, as one could between two
        # Python calls, to delete() the array (its user's, an output of a run) after the first.
        return any(map(operator.call, (array.is_deleted, array.is_ready)))
    except AttributeError:  # an extended dtype, or a kind that cannot be asked
        pass
    except Exception as exc:  # it failed: it is over
        if reentry.from_signal_handler(exc):
            raise  # the caller's own (a time budget's alarm), not the value's failure
        return True
    try:
        return is_deleted(array) or is_ready(array)
    except Exception as exc:
        if reentry.from_signal_handler(exc):
            raise
        return True


def block(array: Any) -> None:
    """Waits for ``array``; raises its execution error. A deleted array is not an error."""
    hold_frames()
    try:
        array.block_until_ready()
    except Exception:
        if is_deleted(array) or _being_deleted(array):
            return
        raise


def _being_deleted(array: Any) -> bool:
    """True if some of ``array``'s buffers are deleted: a donation is taking them now.

    A donation on another thread deletes an array's buffers one by one and
    only then reads as ``is_deleted()``: a wait that met a deleted buffer in
    between raised "BlockHostUntilReady() called on deleted or donated
    buffer" while ``is_deleted()`` still said False.
    """
    try:
        return any(shard.data.is_deleted() for shard in array.addressable_shards)
    except Exception:
        return is_deleted(array)


def poll(
    arrays: Any,
    stopping: Callable[[], bool],
    first_s: float = 5e-4,
    longest_s: float = 2e-3,
    blocking_s: float = 0.1,
) -> None:
    """Waits until every array is settled or ``stopping()``, sleeping in Python between looks.

    For the runtime's own threads: a thread asleep in Python, unlike one
    blocked inside XLA, can be stopped at interpreter exit without aborting the
    process, so exit without ``pw.shutdown()`` stays clean whatever is running.
    A value that can be waited for with a timeout (``wait_ready``: values on
    Ray hosts, where each look is a call into Ray) is waited for up to
    ``blocking_s`` at a time instead, and the wait ends when it is ready.
    """
    pause = first_s  # each look costs a thread that dispatches a GIL hand-off: look rarely
    while True:
        waiting = next((array for array in arrays if not settled(array)), None)
        if waiting is None or stopping():
            return
        if isinstance(waiting, RemoteValue):
            waiting.wait_ready(blocking_s)
            continue
        time.sleep(pause)
        pause = min(pause * 2, longest_s)
