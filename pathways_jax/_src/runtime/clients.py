"""Clients: who a program run belongs to, with its scheduling priority and weight.

Every program run is owned by a client: the one entered with ``with client:``
on the submitting thread, else that thread's default client (``"default"`` on
the main thread, the thread's name on others). Closing a client (or the end of
a thread, for its default client) cancels its queued runs and frees every value
it owns; other clients are not touched.
"""

from __future__ import annotations

import itertools
import math
import numbers
import threading
import weakref
from typing import Any, cast

from pathways_jax._src.core import errors
from pathways_jax._src.runtime import clusters
from pathways_jax._src.runtime.accounting import CLOSED_CLIENTS

_ids = itertools.count(1)


class _Local(threading.local):
    """A thread's client stack and default client: attributes every thread has (None until set).

    As class attributes, a thread that never entered a client reads None
    without the failed lookup (and its exception) of ``getattr(local, name, None)``:
    :func:`current` runs on every program call.
    """

    stack: list[Any] | None = None
    default: Any = None


_local = _Local()


class Client:
    """A tenant of the cluster: programs submitted inside ``with client:`` belong to it.

    Made by :func:`client`. The scheduler orders clients' runs by the policy
    chosen at ``pw.init(scheduler=...)``: ``priority`` counts under
    ``"priority"``, ``weight`` under ``"fair"``.

    Attributes:
      name: shown in ``pw.stats()``, traces and errors.
      priority: higher goes first under the ``"priority"`` scheduler.
      weight: share of device time under the ``"fair"`` scheduler.
      closed: True once :meth:`close` ran.
      ended: True once the thread it is the default client of ended (it
        submits nothing more; what it submitted still runs).
    """

    def __init__(self, name: str, *, priority: int = 0, weight: float = 1.0):
        self.name = name
        self.priority = priority
        self.weight = weight
        self.key = next(_ids)
        self.closed = False
        self.ended = False
        self._lock = threading.Lock()

    def __enter__(self) -> Client:
        if self.closed:
            raise errors.ClusterError(f"{self!r} is closed; make a new one with pw.client(...).")
        stack = _local.stack
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        cast("list[Any]", _local.stack).pop()  # entered on this thread: it has a stack

    def close(self) -> None:
        """Cancels this client's queued runs and frees every value it owns. Idempotent.

        Futures of the client then raise instead of waiting: a cancelled run's
        with ``ProgramFailedError``, a freed value's with ``PathwaysError``.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
        current = clusters.running()
        if current is not None:
            current.close_client(self)

    def closed_error(self) -> errors.ClusterError:
        """The error a program call made inside this closed client raises."""
        return errors.ClusterError(f"{self!r} is closed; programs cannot be submitted for it.")

    def _end(self) -> None:
        """Its thread ended: it is retired, not closed (its runs still run, its values stay)."""
        with self._lock:
            if self.closed or self.ended:
                return
            self.ended = True
        current = clusters.running()
        if current is not None:
            current.retire_client(self)

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ", ended" if self.ended else ""
        return f"Client({self.name!r}, priority={self.priority}, weight={self.weight}{state})"


class _ThreadDefault:
    """Holds a thread's default client; retires it when the thread ends."""

    def __init__(self, owner: Client):
        self.client = owner
        weakref.finalize(self, owner._end)


def client(name: str, *, priority: int = 0, weight: float = 1.0) -> Client:
    """Makes a client: a tenant whose programs are scheduled, accounted and freed together.

    Args:
      name: the client's name in ``pw.stats()``, traces and errors.
      priority: under ``pw.init(scheduler="priority")``, runs of higher
        priority go first (FIFO within a level; a run passed over more than
        ``starvation_limit`` times goes next).
      weight: under ``pw.init(scheduler="fair")``, the client's share of
        device time is proportional to its weight.

    Returns:
      A :class:`Client`; use it as a context manager (programs called inside
      belong to it) and ``close()`` it to free all it owns.

    Raises:
      ResourceError: (a ``ValueError``) a name that is not a non-empty string
        (or is ``"(closed clients)"``, the ``pw.stats()`` row of closed
        clients), a priority that is not an int, or a weight that is not a
        finite number > 0.

    Example:
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> double = pw.jit(lambda v: v * 2, devices=s)
      >>> with pw.client("alice", weight=2.0) as alice:
      ...     out = double(jnp.ones(2))
      >>> out.result().tolist()
      [2.0, 2.0]
      >>> pw.stats()["clients"]["alice"]["programs"]
      1
      >>> alice.close()
      >>> s.release()
    """
    if not isinstance(name, str) or not name:
        raise errors.ResourceError(f"a client's name must be a non-empty string, got {name!r}.")
    if name == CLOSED_CLIENTS:
        raise errors.ResourceError(
            f"a client's name must not be {CLOSED_CLIENTS!r}: pw.stats() sums closed clients under it."
        )
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise errors.ResourceError(f"priority must be an int, got {priority!r} ({type(priority).__name__}).")
    if not isinstance(weight, numbers.Real) or isinstance(weight, bool) or not (0 < weight < math.inf):
        raise errors.ResourceError(
            f"weight must be a finite number > 0, got {weight!r} ({type(weight).__name__})."
        )
    return Client(name, priority=int(priority), weight=float(weight))


def current() -> Client:
    """The client runs submitted now on this thread belong to."""
    stack = _local.stack
    if stack:
        return stack[-1]
    holder: Any = _local.default
    if holder is None or holder.client.closed:
        thread = threading.current_thread()
        name = "default" if thread is threading.main_thread() else thread.name
        holder = _local.default = _ThreadDefault(Client(name))
    return holder.client


__all__ = ["Client", "client", "current"]
