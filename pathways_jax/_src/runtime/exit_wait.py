"""How long a process's exit waits for its cluster: not for ever on a host callback that never returns.

At exit the controller is stopped once the runs queued and in flight have
finished (``clusters._shutdown_at_exit``), up to a minute. A run whose host
callback (``jax.pure_callback``, ``io_callback``, ``jax.debug.callback``)
blocks for ever (waiting on an event nobody sets any more, as a notebook's
kernel leaves it) kept the exit that whole minute. The exit watches the
threads running host callbacks now (their Python frames): one that has not
returned in ``STUCK_S`` seconds is abandoned, and the runs left are named in a
warning, rather than waited for.
"""

from __future__ import annotations

import os
import sys
import time
from types import FrameType
from typing import Any

from absl import logging

STUCK_S = 3.0  # a host callback still running this long at exit is abandoned
ABANDON_S = 0.5  # what the close is given then: to stop what is not stuck
_POLL_S = 0.05
_CALLBACK_FILE = os.path.join("jax", "_src", "callback.py")


def host_callbacks() -> dict[tuple[int, int], str]:
    """The host callbacks running now, by (thread id, frame id): the user's function and its file:line.

    Read from the threads' Python frames: a frame of JAX's callback module,
    and the frame it called (the user's function) named.
    """
    found: dict[tuple[int, int], str] = {}
    for ident, top in sys._current_frames().items():
        frame: FrameType | None = top
        inner = None
        while frame is not None:
            if frame.f_code.co_filename.endswith(_CALLBACK_FILE):
                if inner is not None:
                    code = inner.f_code
                    found[(ident, id(frame))] = (
                        f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
                    )
                break
            inner = frame
            frame = frame.f_back
    return found


def _idle(controller: Any) -> bool:
    """Nothing queued, nothing dispatching, every run dispatched finished on its devices."""
    return not any(controller.queued_by_client_name().values()) and controller.wait_settled(0)


def exit_timeout(controller: Any, timeout: float) -> float:
    """Waits (up to ``timeout`` s) until ``controller`` is idle or a host callback is stuck; the time left for its close.

    Returns at once when nothing runs. A host callback running ``STUCK_S``
    seconds is abandoned: a warning names it and the runs left, and the
    close gets ``ABANDON_S`` seconds.
    """
    deadline = time.monotonic() + timeout
    since: dict[tuple[int, int], float] = {}
    while True:
        now = time.monotonic()
        if now >= deadline:
            return 0.0
        if _idle(controller):
            return deadline - time.monotonic()
        running = host_callbacks()
        since = {key: since.get(key, now) for key in running}
        stuck = [running[key] for key, first in since.items() if now - first >= STUCK_S]
        if stuck:
            queued = sum(controller.queued_by_client_name().values())
            in_flight = sum(controller.in_flight_by_island().values())
            logging.warning(
                "pathways_jax: at exit, the host callback %s has not returned in %.1f s; the exit "
                "waits no longer and abandons it and its run, with %d more run(s) queued and %d "
                "executable(s) in flight (their results are lost). A host callback that waits for "
                "something nobody will do any more keeps its run from finishing: give its wait a timeout.",
                ", ".join(sorted(set(stuck))),
                STUCK_S,
                queued,
                in_flight,
            )
            return min(ABANDON_S, deadline - time.monotonic())
        time.sleep(_POLL_S)


__all__ = ["ABANDON_S", "STUCK_S", "exit_timeout", "host_callbacks"]
