"""The backends by name: ``pw.init(backend=name)`` starts the one registered under it.

A backend is added by registering a start function, ``start(options) ->
Backend``, where ``options`` holds ``pw.init``'s checked arguments
(:class:`~pathways_jax._src.backends.base.StartOptions`); the cluster then
dispatches through the :class:`~pathways_jax._src.backends.base.Backend` it
returns, and looks for optional capabilities (``HostFleet``, ``Shares``,
``ServiceView``) with ``isinstance``, never for a class.

Example:
  >>> from pathways_jax._src.backends import registry
  >>> registry.names()
  ('local', 'ray')
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pathways_jax._src.backends.base import Backend, StartOptions
from pathways_jax._src.core import errors

Start = Callable[[StartOptions], Backend]

_lock = threading.Lock()
_starts: dict[str, Start] = {}


def register(name: str, start: Start, *, replace: bool = False) -> None:
    """Makes ``pw.init(backend=name)`` start the backend ``start(options)`` returns.

    Raises ``ValueError`` for a name that is not a non-empty string, a
    ``start`` that is not callable, or a name already registered (unless
    ``replace``).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a backend's name is a non-empty str, got {name!r}.")
    if not callable(start):
        raise ValueError(f"backend {name!r}: start must be callable as start(options), got {start!r}.")
    with _lock:
        if name in _starts and not replace:
            raise ValueError(
                f"a backend named {name!r} is registered already; pass replace=True to replace it."
            )
        _starts[name] = start


def unregister(name: str) -> None:
    """Forgets the backend ``name`` (a cluster already running on it keeps it)."""
    with _lock:
        _starts.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered backends' names, in registration order."""
    with _lock:
        return tuple(_starts)


def start(name: str, options: StartOptions) -> Backend:
    """Starts backend ``name`` with ``pw.init``'s ``options``; ClusterError if none is registered so.

    The start function's own errors pass through as they are; what it
    returns must implement :class:`Backend`, else it is closed and refused.
    """
    with _lock:
        starter = _starts.get(name)
    if starter is None:
        raise errors.ClusterError(f"backend={name!r} is not a backend; use one of {list(names())}.")
    backend: Any = starter(options)
    if not isinstance(backend, Backend):
        missing = [m for m in _MEMBERS if not hasattr(backend, m)]
        close = getattr(backend, "close", None)
        if callable(close):
            close(0.0)
        raise errors.ClusterError(
            f"the start function of backend {name!r} returned {type(backend).__name__}, which lacks "
            f"{missing} of the Backend protocol (pathways_jax._src.backends.base.Backend)."
        )
    return backend


def _start_ray(options: StartOptions) -> Backend:
    from pathways_jax._src.backends import ray_start

    return ray_start.start(options)


def _start_local(options: StartOptions) -> Backend:
    from pathways_jax._src.backends import local

    return local.start(options)


_MEMBERS = (
    "name",
    "islands",
    "window_size",
    "donates",
    "exports",
    "calls_back",
    "stages_inputs",
    "lost",
    "on_lost",
    "prepare",
    "execute",
    "settle",
    "close",
)

register("local", _start_local)
register("ray", _start_ray)

__all__ = ["Start", "names", "register", "start", "unregister"]
