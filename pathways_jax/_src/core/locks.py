"""Taking a lock where a signal handler may raise (Ctrl-C on the main thread).

Python runs signal handlers between two bytecodes of the main thread, and one
of those moments is right after a call returns. ``if lock.acquire(): try: ...``
is then cut in two: ``acquire`` took the lock, the handler raises
(``KeyboardInterrupt``) before the caller stored what ``acquire`` returned, and
no ``finally`` knows to release it; every later taker waits for ever. (A
``with lock:`` block is safe: Python enters it and its cleanup together.)

:func:`acquire` records that the lock was taken in the same C call that takes
it, in a list the caller's ``finally`` reads; the code of that ``finally``
must make no call before the release (a handler may run when a call returns).
"""

from __future__ import annotations

from typing import Protocol


class Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...


def acquire(lock: Lock, held: list[bool], *, blocking: bool = True, timeout: float = -1) -> bool:
    """Acquires ``lock`` as ``lock.acquire(blocking, timeout)``; whether it did.

    Once the lock is taken, ``held`` holds ``True`` even if a signal handler
    raises as this returns, so that the caller releases it::

        held: list[bool] = []
        try:
            if not locks.acquire(lock, held, timeout=1.0):
                return False
            ...
        finally:
            if held:
                lock.release()

    A handler that raises while ``acquire`` waits stops the wait, the lock not
    taken (``held`` stays empty).
    """
    # One C call (list.extend over map over the lock's acquire) takes the lock and
    # stores that it did: no bytecode, so no signal handler, runs in between.
    held.extend(filter(None, map(lock.acquire, (blocking,), (timeout,))))
    return bool(held)


__all__ = ["acquire"]
