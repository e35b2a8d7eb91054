"""Trace events: what the runtime did, as records of plain values, and the one sink they go to.

Each part that does something worth a trace (tracing, lowering, submission,
the controller, the backends, the cluster as it starts) builds an event from
its own objects and hands it to :data:`SINK`, the recorder listening
(``api.recording``), when there is one::

    sink = events.SINK
    if sink is not None:
        sink(events.Compiled(node.name, node.source_info, node.slice.id, t0, events.now()))

so tracing off costs one global load and one comparison. The sink is called
on the emitting thread (a recorder names the thread's track by it) and must
return at once.

Times are :func:`now` (``time.perf_counter_ns``). Fields are plain values:
ints, strings, floats, tuples and dicts of those. The one exception is
``watch`` of device work (:class:`Dispatched`, :class:`Sent`, :class:`Moved`):
the arrays (or markers) whose readiness ends that work, which the recorder
polls off the emitting thread.

:func:`run_failed` also logs, through ``absl.logging``, a failed run (WARNING)
whether or not a trace is recorded, unless its cause was said once for all the
runs it fails (:func:`said_once`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from absl import logging

__all__ = [
    "SINK",
    "Compiled",
    "Device",
    "Devices",
    "Dispatched",
    "Event",
    "Lowered",
    "Moved",
    "Remapped",
    "RunFailed",
    "Sent",
    "Submitted",
    "Traced",
    "Waited",
    "now",
    "run_failed",
    "said_once",
    "unsaid",
]

now = time.perf_counter_ns

# --- the controller's own work: spans and instants on the emitting thread's track ----------


@dataclasses.dataclass(frozen=True, slots=True)
class Traced:
    """``@pw.program`` traced ``program`` (defined at ``source``) into a graph."""

    program: str
    source: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True, slots=True)
class Lowered:
    """A graph of ``nodes`` nodes was lowered to a plan."""

    program: str
    nodes: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True, slots=True)
class Remapped:
    """A graph was lowered again after its slices moved: ``moved`` maps slice id to (before, after) device ids."""

    program: str
    moved: dict[int, tuple[tuple[int, ...] | None, tuple[int, ...]]]
    at: int


@dataclasses.dataclass(frozen=True, slots=True)
class Compiled:
    """A node (of ``slice``) was compiled."""

    node: str
    source: str
    slice: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True, slots=True)
class Submitted:
    """A run was queued; the backend will report ``reports`` dispatches of it."""

    run: int
    program: str
    client: str
    reports: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True, slots=True)
class Waited:
    """The emitting thread waited for ``reason`` (back-pressure, an in-flight window, ...)."""

    reason: str
    client: str
    island: int | None
    start: int
    end: int
    bytes: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RunFailed:
    """The controller failed a run: it dispatches nothing more of it."""

    run: int
    client: str
    message: str
    at: int


# --- device work: dispatched now, done when ``watch`` is ready ----------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Dispatched:
    """A node of a run was dispatched to the devices of its slice."""

    run: int
    client: str
    program: str
    node: str
    kind: str
    source: str
    slice: int
    island: int
    devices: tuple[int, ...]
    start: int
    end: int
    watch: tuple[Any, ...] = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    """A host (of ``island``, holding ``devices``) was sent its part of a run."""

    run: int
    client: str
    program: str
    host: int
    island: int
    devices: tuple[int, ...]
    start: int
    end: int
    watch: tuple[Any, ...] = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Moved:
    """A value of a run started moving: a transfer (``kind`` "ici" or "dcn") or a reshard."""

    run: int
    client: str
    program: str
    kind: str
    bytes: int
    value: str
    src_devices: tuple[int, ...]
    dst_devices: tuple[int, ...]
    start: int
    end: int
    watch: tuple[Any, ...] = dataclasses.field(compare=False, repr=False)


# --- the device table ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """A device of the cluster: its id, island, platform, and the host that owns it (a process index)."""

    id: int
    island: int
    kind: str
    host: int


@dataclasses.dataclass(frozen=True, slots=True)
class Devices:
    """The devices of a cluster that started (or was running when a trace began)."""

    devices: tuple[Device, ...]


Event = (
    Traced
    | Lowered
    | Remapped
    | Compiled
    | Submitted
    | Waited
    | RunFailed
    | Dispatched
    | Sent
    | Moved
    | Devices
)

# The recorder listening, or None. Read (never written) by emitters; set by api.recording.
SINK: Callable[[Event], None] | None = None


# The causes said once for all the runs they fail (see said_once), as the end of a run's message.
_SAID: set[str] = set()


def said_once(cause: str) -> None:
    """A run failing from now on with ``cause`` (its error's text: the message ends with it) logs no
    line of its own, as the cause was said once for all of them: a client process that left its
    controller service with runs in flight says how many in one line, not one line a run. The
    sink still hears of each. :func:`unsaid` undoes it."""
    _SAID.add(cause)


def unsaid(cause: str) -> None:
    """Runs failing with ``cause`` log their own lines again (undoes :func:`said_once`)."""
    _SAID.discard(cause)


def run_failed(run: int, client: str, message: str, *, log: bool = True) -> None:
    """The controller failed run ``run``: logs ``message`` (WARNING, unless its cause was said
    once: :func:`said_once`, or ``log`` is false: a run failed by an input that failed, whose
    first failure was said) and tells the sink."""
    said = _SAID
    if log and not (said and message.endswith(tuple(said))):
        logging.warning("%s", message)
    sink = SINK
    if sink is not None:
        sink(RunFailed(run, client, message, now()))
