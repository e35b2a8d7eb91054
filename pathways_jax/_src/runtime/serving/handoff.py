"""Work handed to the controller service's event loop from other threads.

The loop owns the service's state; the channels' receive threads (a client's
batch, a host's answer) hand it what they received. A wake-up of the loop
(``call_soon_threadsafe``: a write to its self-pipe, then a thread switch) is
asked for only when none is pending, so what arrives meanwhile runs in the
same turn; and a batch sent to several hosts is handed over once, when the
last of them answered.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


class Handoff:
    """Calls posted from any thread, run on ``loop`` in the order they were posted."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        turn: tuple[Callable[[], None], Callable[[], None]] | None = None,
    ) -> None:
        self.loop = loop
        # Called before and after the calls of one turn (the hosts' link held, then sent: what a
        # turn sends a host goes in one batch).
        self._turn = turn
        self._calls: collections.deque[tuple[Callable[..., None], tuple]] = collections.deque()
        self._pending = False  # a drain is asked for and has not started

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Runs ``fn(*args)`` on the loop soon, after what was posted before it."""
        self._calls.append((fn, args))
        if not self._pending:
            self._pending = True
            self.loop.call_soon_threadsafe(self._drain)

    def when_done(self, futures: list[concurrent.futures.Future], then: Callable[[], None]) -> None:
        """Runs ``then()`` on the loop once every one of ``futures`` is done (one hand-off for them
        all, from the thread that settles the last: no task or asyncio future per answer)."""
        if not futures:
            self.post(then)
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_future: concurrent.futures.Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.post(then)

        for future in futures:
            future.add_done_callback(one_done)

    def _drain(self) -> None:
        # Cleared before the calls are taken: a call posted from now on asks for a drain of its own.
        self._pending = False
        calls = self._calls
        turn = self._turn
        if turn is not None:
            turn[0]()
        try:
            while calls:
                fn, args = calls.popleft()
                try:
                    fn(*args)
                except Exception as exc:  # reported as the loop reports a failed callback; the rest still run
                    self.loop.call_exception_handler(
                        {
                            "message": f"Exception in a call handed to the service's loop: {fn!r}",
                            "exception": exc,
                        }
                    )
        finally:
            if turn is not None:
                turn[1]()
