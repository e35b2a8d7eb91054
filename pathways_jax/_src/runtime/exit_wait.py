"""How long a process's exit waits for its cluster: not for ever on a host callback that never returns.

At exit the controller is stopped once the runs queued and in flight have
finished (``clusters._shutdown_at_exit``), up to a minute, so that their host
callbacks' side effects (a log line, a checkpoint written) happen. A run whose
host callback (``jax.pure_callback``, ``io_callback``, ``jax.debug.callback``)
blocks for ever (waiting on an event nobody sets any more, as a notebook's
kernel leaves it) kept the exit that whole minute. The exit watches the
threads running host callbacks now (their Python frames) and the process's
CPU time: a callback that has run ``STUCK_S`` seconds while the process did
next to nothing (``IDLE_SHARE`` of a core, the exiting thread's own time left
out) for those seconds is blocked, and is abandoned with the runs left, named
in a warning. One still working (the process busy: serialising, writing) is
waited for, up to the minute, and a line says so.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

from absl import logging

STUCK_S = 3.0  # a host callback running this long at exit, the process idle meanwhile, is abandoned
IDLE_SHARE = 0.01  # of a core: the process's CPU time (the exiting thread's left out) below it is idle
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


def _others_cpu(callbacks: set[int]) -> float:
    """CPU seconds of this process's threads but the calling one (the exit's own polling) and the
    runtime's own (``pathways-*``: the accounting watcher polls runs in flight, about 2% of a core),
    those running a host callback (``callbacks``: the controller's thread may) still counted: what
    the user's work (a host callback, the threads it waits on) spent."""
    total = time.process_time() - time.thread_time()
    for thread in threading.enumerate():
        ident = thread.ident
        if thread.name.startswith("pathways-") and ident is not None and ident not in callbacks:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                total -= time.clock_gettime(time.pthread_getcpuclockid(ident))
    return total


def exit_timeout(controller: Any, timeout: float) -> float:
    """Waits (up to ``timeout`` s) until ``controller`` is idle or a host callback is blocked; the time left for its close.

    Returns at once when nothing runs. A host callback running ``STUCK_S``
    seconds, the process idle for the last ``STUCK_S`` seconds, is abandoned:
    a warning names it and the runs left, and the close gets ``ABANDON_S``
    seconds. One running that long while the process works is waited for.
    """
    deadline = time.monotonic() + timeout
    since: dict[tuple[int, int], float] = {}
    samples: collections.deque[tuple[float, float]] = collections.deque()  # (time, others' CPU)
    said: set[str] = set()
    while True:
        now = time.monotonic()
        if now >= deadline:
            return 0.0
        if _idle(controller):
            return deadline - time.monotonic()
        running = host_callbacks()
        cpu = _others_cpu({ident for ident, _ in running})
        samples.append((now, cpu))
        while len(samples) > 1 and samples[1][0] <= now - STUCK_S:
            samples.popleft()  # the oldest kept is STUCK_S old or more (once that long has passed)
        window = now - samples[0][0]
        idle = window >= STUCK_S and cpu - samples[0][1] < IDLE_SHARE * window
        since = {key: since.get(key, now) for key in running}
        long_running = sorted({running[key] for key, first in since.items() if now - first >= STUCK_S})
        if long_running and idle:
            queued = sum(controller.queued_by_client_name().values())
            in_flight = sum(controller.in_flight_by_island().values())
            logging.warning(
                "pathways_jax: at exit, the host callback %s has not returned in %.1f s and the process "
                "did nothing meanwhile; the exit waits no longer and abandons it and its run, with %d "
                "more run(s) queued and %d executable(s) in flight (their results are lost). A host "
                "callback that waits for something nobody will do any more keeps its run from "
                "finishing: give its wait a timeout.",
                ", ".join(long_running),
                STUCK_S,
                queued,
                in_flight,
            )
            return min(ABANDON_S, deadline - time.monotonic())
        for name in long_running:
            if name not in said:
                said.add(name)
                logging.warning(
                    "pathways_jax: at exit, waiting for the host callback %s (running %.1f s, the "
                    "process still working), up to %.0f s more.",
                    name,
                    STUCK_S,
                    deadline - now,
                )
        time.sleep(_POLL_S)


__all__ = ["ABANDON_S", "IDLE_SHARE", "STUCK_S", "exit_timeout", "host_callbacks"]
