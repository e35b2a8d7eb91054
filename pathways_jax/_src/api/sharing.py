"""``pw.share`` and ``pw.receive``: values passed between client processes of a controller service."""

from __future__ import annotations

import itertools
from typing import Any

from pathways_jax._src.backends.base import Shares
from pathways_jax._src.core import checks, errors, source
from pathways_jax._src.runtime import clients, clusters, futures
from pathways_jax._src.runtime.futures import Future
from pathways_jax._src.runtime.object_store import Owner

_SHARE_TIMEOUT_S = 60.0
_received = itertools.count()


def _service_backend(what: str) -> Shares:
    backend = clusters.cluster().backend
    if not isinstance(backend, Shares):
        raise errors.ClusterError(
            f"{what} passes values between client processes of a controller service; this process "
            "did not join one. Start one with pw.serve(...) and join it with "
            "pw.init(backend='ray', address=..., service='<name>')."
        )
    return backend


def share(future: Any, client: str | None = None, *, timeout: float | None = _SHARE_TIMEOUT_S) -> Any:
    """A handle to ``future``'s value that another client process of the service may use.

    Args:
      future: a future of this process (of a program run on the service's hosts),
        or a pytree of them (a program's outputs): each future is shared, and
        the same pytree of handles comes back (other leaves as they are).
      client: the client process allowed to read it: its ``client_name``
        (``pw.init(..., client_name=...)``) or its id in the service's stats.
        ``None``: nobody else (the handle names the value, and only this
        process may use it).
      timeout: seconds to wait for the run making the value to be sent to
        the hosts.

    Returns:
      A picklable :class:`pw.Handle` (a pytree of them for a pytree); the
      other process calls ``pw.receive(handle)``. The value lives while this process's future or
      the receiver's does.

    Raises:
      ClusterError: this process did not join a controller service.
      AccessError: the value is not on the hosts (freed, or its run failed), or
        no client process of that name is connected.
      PathwaysError: ``future`` holds no ``pw.Future``, or ``client`` is not None nor a
        string (also a ``TypeError``); ``timeout`` is not None nor a number of seconds >= 0,
        or ``client`` is an empty string (also a ``ValueError``).
    """
    import jax

    backend = _service_backend("pw.share")
    if timeout is not None and not checks.is_seconds(timeout):
        raise errors.also(errors.PathwaysError, ValueError)(
            f"pw.share (at {source.of_caller()}): timeout must be None or a number of seconds >= 0, got "
            f"{timeout!r} ({type(timeout).__name__}); give a finite number, or None to wait as long as it takes."
        )
    if client is not None and (not isinstance(client, str) or not client):
        raise errors.also(errors.PathwaysError, ValueError if isinstance(client, str) else TypeError)(
            f"pw.share (at {source.of_caller()}): client must be None (only this process) or the name of "
            f"a client process of the service (its client_name, or its id in the service's stats, as a "
            f"str), got {client!r} ({type(client).__name__}); pw.share(future, client='train')."
        )
    if not isinstance(future, Future):
        leaves = jax.tree.leaves(future)
        if not any(isinstance(leaf, Future) for leaf in leaves):
            raise errors.also(errors.PathwaysError, TypeError)(
                f"pw.share (at {source.of_caller()}) takes a pw.Future or a pytree of them (a program's "
                f"outputs), got {type(future).__name__} holding no pw.Future."
            )
        return jax.tree.map(
            lambda leaf: share(leaf, client, timeout=timeout) if isinstance(leaf, Future) else leaf, future
        )
    array: Any = futures.sent(future, timeout, "pw.share")
    if not isinstance(getattr(array, "key", None), int | tuple):
        raise errors.AccessError(f"pw.share: {future._entry.origin} is not a value on the service's hosts.")
    # array: a RemoteArray (checked above)
    if client is not None:
        if not isinstance(array.key, int):
            raise errors.AccessError("pw.share: only a value's owner shares it; this process received it.")
        backend.share(array.key, client)
    return backend.handle_of(array)


def receive(handle: Any) -> Any:
    """A future of this process for a value another client process shared (``pw.share``).

    A pytree of handles (``pw.share`` of a pytree) gives the same pytree of
    futures. Nothing is asked of the service here: a handle that was not
    shared with this process (or whose value was freed) fails the first
    program or ``result()`` that reads it, with ``AccessError``, touching nothing.
    """
    import jax

    from pathways_jax._src.backends import service_client as service_lib

    backend = _service_backend("pw.receive")
    if not isinstance(handle, service_lib.Handle):
        is_handle = lambda leaf: isinstance(leaf, service_lib.Handle)  # noqa: E731
        if not any(is_handle(leaf) for leaf in jax.tree.leaves(handle, is_leaf=is_handle)):
            raise errors.also(errors.PathwaysError, TypeError)(
                f"pw.receive (at {source.of_caller()}) takes a pw.Handle (from pw.share in the process "
                f"that owns the value) or a pytree of them, got {type(handle).__name__} holding none."
            )
        return jax.tree.map(
            lambda leaf: receive(leaf) if is_handle(leaf) else leaf, handle, is_leaf=is_handle
        )
    array = backend.array_of(handle)
    client = clients.current()
    owner = Owner(client.name, -1 - next(_received), client.key)
    origin = f"a value received from client {handle.owner} (key {handle.key})"
    return futures.adopted(clusters.cluster().store, owner, array, origin)


__all__ = ["receive", "share"]
