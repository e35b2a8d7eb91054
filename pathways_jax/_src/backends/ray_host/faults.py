"""Faults a host does to itself when the controller asks (``pw.faults``): a rehearsed failure.

A host killed or stopped by its own process, at a point the caller chose,
is what a lost machine or a hung one looks like to the controller: the Ray
actor dies (``"kill"``: SIGKILL, nothing runs after it), or the process
stops and stays alive to Ray while its channel falls silent (``"hang"``:
SIGSTOP, found by the controller's hung-host check and killed). Done by the
host itself, so it works wherever the host runs, on this machine or another.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Literal, NamedTuple

FaultKind = Literal["kill", "hang"]

# How long after answering that it was armed a host strikes a fault asked for
# now: long enough for the answer to leave the process.
STRIKE_DELAY_S = 0.05


class Fault(NamedTuple):
    """A fault to strike: what, and when.

    ``at_run``: 0 strikes now; ``n`` strikes during the ``n``-th run this
    host starts from now, once that run's work is enqueued on its devices
    and before its answer is sent (mid-step: the run was acknowledged and
    will not complete). ``at_save``: ``n`` strikes as the ``n``-th checkpoint
    save from now starts writing on this host (``at_run`` is then 0).
    """

    kind: FaultKind
    at_run: int
    at_save: int = 0


def strike(kind: FaultKind) -> None:
    """Kills (SIGKILL) or stops (SIGSTOP) this process at once."""
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


def strike_soon(kind: FaultKind) -> None:
    """Strikes after :data:`STRIKE_DELAY_S`, from a thread of its own."""
    timer = threading.Timer(STRIKE_DELAY_S, strike, (kind,))
    timer.daemon = True
    timer.start()


class Armed:
    """The fault a host holds, counting the runs (or checkpoint writes) it starts down to the one it strikes in."""

    __slots__ = ("fault", "left")

    def __init__(self) -> None:
        self.fault: Fault | None = None
        self.left = 0

    def arm(self, fault: Fault) -> None:
        """Holds ``fault`` (replacing one held); one asked for now strikes at once (soon)."""
        if fault.at_run <= 0 and fault.at_save <= 0:
            self.fault = None
            strike_soon(fault.kind)
            return
        self.fault, self.left = fault, max(fault.at_run, fault.at_save)

    def save_started(self) -> None:
        """A checkpoint save starts writing: strikes if this is the save the fault waits for."""
        fault = self.fault
        if fault is None or fault.at_save <= 0:
            return
        self._count(fault)

    def run_enqueued(self) -> None:
        """A run's work is on the devices: strikes if this is the run the fault waits for."""
        fault = self.fault
        if fault is None or fault.at_run <= 0:
            return
        self._count(fault)

    def _count(self, fault: Fault) -> None:
        self.left -= 1
        if self.left <= 0:
            self.fault = None
            strike(fault.kind)
