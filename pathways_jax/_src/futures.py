"""``pw.Future``: the handle a program call returns for each output value."""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from pathways_jax._src import errors
from pathways_jax._src.backends.ray import RemoteArray
from pathways_jax._src.object_store import Entry, Failed, Freed, ObjectStore, Pending, Ready


def _wait_ready(array: jax.Array, deadline: float | None) -> bool:
    if deadline is None:
        array.block_until_ready()
        return True
    pause = 1e-5
    while not array.is_ready():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, 5e-3)
    array.block_until_ready()  # surfaces an execution error, if any
    return True


class Future:
    """A value a program is computing, living on the devices of a slice.

    Passing a future to another program keeps the value on its devices; call
    :meth:`result` to bring it to the caller as a ``jax.Array``.

    Example:
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> double = pw.jit(lambda v: v * 2, devices=s)
      >>> fut = double(jnp.arange(3.0))
      >>> fut.shape, fut.result().tolist()
      ((3,), [0.0, 2.0, 4.0])
      >>> s.release()
    """

    __slots__ = ("__weakref__", "_entry", "_store")

    def __init__(self, entry: Entry, store: ObjectStore):
        self._entry = entry
        self._store = store

    def __del__(self) -> None:
        # No module globals here: at interpreter exit they may already be None.
        try:  # noqa: SIM105
            self._store.drop(self._entry)
        except Exception:
            pass

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._entry.aval.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._entry.aval.dtype

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """Where the value lives (known when the call returns)."""
        return self._entry.sharding

    @property
    def slice(self):
        """The :class:`VirtualSlice` the value lives on."""
        return self._entry.slice

    def done(self) -> bool:
        """True once the value is computed (or its run failed)."""
        entry = self._entry
        match entry.state:
            case Pending():
                return False
            case Ready(array):
                return array.is_ready()
            case _:
                return True

    def result(self, timeout: float | None = None) -> jax.Array:
        """Waits for the value and returns it as a ``jax.Array``.

        Args:
          timeout: seconds to wait; ``None`` waits as long as it takes.

        Raises:
          FutureTimeoutError: the value was not ready within ``timeout``.
          ProgramFailedError: the run that computes the value failed; the
            original exception is chained.
          BackPressureTimeout: the run waited for device memory longer than
            ``pw.init(backpressure_timeout=...)``.
        """
        entry = self._entry
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._store.wait_settled(entry, timeout):
            raise self._timeout(timeout)
        match entry.state:
            case Ready(array):
                try:
                    ready = _wait_ready(array, deadline)
                except errors.HostLostError as exc:
                    raise errors.HostLostError(f"{entry.origin}: {exc}") from exc
                except Exception as exc:
                    raise errors.ProgramFailedError(f"{entry.origin} failed while executing: {exc}") from exc
                if not ready:
                    raise self._timeout(timeout)
                if type(array) is RemoteArray:  # on a host of the Ray backend: bring it here
                    try:
                        return array.fetch()
                    except errors.PathwaysError:
                        raise
                    except Exception as exc:
                        raise errors.ProgramFailedError(f"fetching {entry.origin} failed: {exc}") from exc
                return array
            case Failed(message, cause):
                if isinstance(cause, errors.BackPressureTimeout):
                    raise errors.BackPressureTimeout(message) from cause
                if isinstance(cause, errors.HostLostError):
                    raise errors.HostLostError(message) from cause
                raise errors.ProgramFailedError(message) from cause
            case Freed():
                raise errors.PathwaysError(f"the value of {entry.origin} was freed.")
            case Pending():
                raise self._timeout(timeout)
        raise AssertionError(f"unknown state {entry.state!r}")  # pragma: no cover

    def _timeout(self, timeout: float | None) -> errors.FutureTimeoutError:
        return errors.FutureTimeoutError(
            f"{self._entry.origin} was not ready within timeout={timeout}s; wait "
            "longer, or check .done() before calling .result()."
        )

    def block_until_ready(self) -> Future:
        """Waits for the value; returns the future itself."""
        self.result()
        return self

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = np.asarray(self.result())
        return out if dtype is None else out.astype(dtype)

    def _repr_html_(self) -> str:
        from pathways_jax._src import notebook

        return notebook.future_html(self)

    def __repr__(self) -> str:
        state = type(self._entry.state).__name__.lower()
        return f"Future({self._entry.origin}, shape={self.shape}, dtype={self.dtype}, {state})"
