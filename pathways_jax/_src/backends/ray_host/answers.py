"""What a host is told at set-up and what it answers: its role, a run's outcome, a failure.

NamedTuples and plain classes, pickled by the controller, the controller
service and the hosts alike with nothing else of pathways_jax imported.
"""

from __future__ import annotations

import traceback
from typing import Any, Literal, NamedTuple

from pathways_jax._src.backends.ray_host.ops import ExecOp, Op


class Role(NamedTuple):
    """A host's place in its island, sent with ``setup``.

    An island of several hosts is one ``jax.distributed`` system: ``rank``
    is this host's process id in it, ``size`` the number of hosts and
    ``coordinator`` the address of the coordination service (on rank 0).
    ``reach``: an address every host reaches (the Ray cluster's), whose route
    gives the address this host serves on.
    """

    island: int
    rank: int
    size: int
    coordinator: str | None
    reach: str | None = None


class RunFailure(NamedTuple):
    """Why a host's part of a run failed: the answer to its ``"run"`` message."""

    kind: Literal["error", "lost"]  # "lost": a value was to come from the lost host ``peer``
    peer: int | None
    message: str
    trace: str  # the host's formatted traceback ("" if none)
    peers: tuple[int, ...] = ()  # the hosts this run pulled values from
    # "JaxRuntimeError" where the host's JAX raised one (out of memory...): the controller raises it
    # as that class too, as jax.jit does; "" otherwise.
    error: str = ""


class RunDone(NamedTuple):
    """A host's part of a run completed: its device time, and its small kept values.

    ``values``: each kept value of at most :data:`SMALL_BYTES` held whole on
    this host, as the controller would fetch it (key -> numpy array or
    :class:`KeyData`), so reading it costs no round trip.
    """

    device_s: float
    values: dict[int, Any]


# Kept values up to this size come back with the run's completion (a loss, a metric).
SMALL_BYTES = 64


class Refused(NamedTuple):
    """The controller service's answer to a message it would not forward (a handle not the sender's)."""

    message: str
    # "access": a handle not the sender's; "memory": over budget; "gone": client left; "cancelled": its
    # pw.client was closed
    kind: str = "access"


class MessageFailed:
    """A failed message's answer (an exception would lose its type crossing Ray).

    ``trace``: the host's formatted traceback, for the controller to attach.
    ``ended``: a colocated function raised ``StopIteration`` (an input iterator ran out).
    """

    def __init__(self, message: str, trace: str = "", ended: bool = False):
        self.message = message
        self.trace = trace
        self.ended = ended

    def __repr__(self) -> str:
        return f"MessageFailed({self.message!r})"


def describe_failure(exc: BaseException, ops: list[Op], step: int) -> str:
    """What failed a run at ``ops[step]`` (the node it ran, or the kind of step), and why."""
    where = ""
    if 0 <= step < len(ops):
        op = ops[step]
        where = f" in node {op.name}" if isinstance(op, ExecOp) else f" in a {op.kind} step"
    return f"run failed{where}: {type(exc).__name__}: {exc}"


def trace_of(exc: BaseException) -> str:
    """``exc``'s traceback on this host, as text: it crosses to the controller with the error."""
    return "".join(traceback.format_exception(exc))
