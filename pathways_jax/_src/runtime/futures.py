"""``pw.Future``: the handle a program call returns for each output value."""

from __future__ import annotations

import functools
import math
import numbers
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pathways_jax._src.core import arrays, checks, errors, readiness, reentry
from pathways_jax._src.runtime.array_like import ArrayLike
from pathways_jax._src.runtime.object_store import (
    READY,
    Consumed,
    Entry,
    Failed,
    Freed,
    ObjectStore,
    Owner,
    Pending,
    Ready,
)


def _wait_ready(array: jax.Array, deadline: float | None) -> bool:
    if deadline is None:
        array.block_until_ready()
        return True
    readiness.poll(
        [array], lambda: time.monotonic() >= deadline, first_s=1e-5, longest_s=5e-3, blocking_s=5e-3
    )
    if not readiness.settled(array):
        return False
    array.block_until_ready()  # surfaces an execution error, if any
    return True


# Failures a future raises as their own type, not as ProgramFailedError: a lost
# host, a refused handle (controller service), memory back-pressure, a cluster
# gone (a controller service that died or dropped this process).
_KEPT_TYPES = (errors.HostLostError, errors.AccessError, errors.BackPressureTimeout, errors.ClusterError)


def failure_of(state: Failed) -> BaseException:
    """What reading a value in ``state`` raises (its cause chained): the run's own error."""
    message, cause = state.message, state.cause
    error = type(cause)(message) if isinstance(cause, _KEPT_TYPES) else _failure_class(cause)(message)
    error.__cause__ = cause
    return error


def _failure_class(cause: BaseException | None) -> type[errors.PathwaysError]:
    """``ProgramFailedError``, also of the cause's class: ``except FloatingPointError``
    (jax_debug_nans) or ``except jax.errors.JaxRuntimeError`` written for jax.jit still
    catches it. Not for ours, nor for an interrupt that cut the run short: that is
    never raised again as a new Ctrl-C."""
    if not isinstance(cause, Exception) or isinstance(cause, errors.PathwaysError):
        return errors.ProgramFailedError
    return errors.also(errors.ProgramFailedError, type(cause))


class Future(ArrayLike):
    """A value a program is computing, living on the devices of a slice.

    Passing a future to another program keeps the value on its devices and does
    not wait for it; call :meth:`result` to bring it to the caller as a
    ``jax.Array``.

    Everywhere else a future stands for that ``jax.Array``: it waits for the
    value (through :meth:`result`, so a failed run raises the same
    ``pw.errors`` type) and then does what the array would do, returning plain
    ``jax.Array`` s. That covers ``float``, ``int``, ``bool``, ``complex``,
    ``operator.index``, ``round``, ``format``/f-strings and ``str``; every
    arithmetic, bitwise and comparison operator with an array, a scalar or
    another future on either side, and unary ``-``, ``+``, ``abs``, ``~``
    (``x += future`` binds ``x`` to a new array, as for a ``jax.Array``);
    indexing, iteration, ``in``; the ``jax.Array`` methods (``.item()``,
    ``.tolist()``, ``.astype``, ``.reshape``, ``.sum``, ...) and properties
    (``.T``, ``.real``, ``.at``, ...); ``np.asarray`` (with NumPy 2's
    ``copy=``), ``jnp.asarray`` and the other ``jnp`` functions;
    ``jax.jit(g)(future)``, which traces and caches as for the array itself;
    and Flax NNX modules whose parameters hold futures; ``pickle`` (as the
    array). Like an array, a future is unhashable. ``shape``, ``dtype``,
    ``ndim``, ``size``, ``nbytes``, ``sharding``, ``committed``, ``aval``, ``devices()``,
    ``is_fully_replicated``, ``is_deleted()``, ``len`` and ``repr`` come
    without waiting; ``copy_to_host_async()`` waits for the run's dispatch
    only; ``delete()`` frees the value at once.

    What still differs from a ``jax.Array``: ``isinstance(future, jax.Array)``
    is False; ``repr`` shows the future (program, state), not the value; a
    future is a pytree leaf of its own type, so ``jax.tree.map`` hands the
    future itself to the function; abstract evaluation (``jax.eval_shape``,
    tracing under ``jax.jit``) waits for the value too; and ``jax.jit`` and
    ``jnp`` take futures through private JAX hooks registered at import
    (``compat.jax_futures``): on a JAX without them, call :meth:`result`
    first. Futures of different slices combine as arrays on different devices
    do: JAX raises unless they are moved (``jax.device_put``). JAX's own
    indexing takes only its arrays as indices: ``array[future]`` needs
    ``array[future.result()]`` (``numpy_array[future]``, ``future[i]`` and ``future[other_future]`` work).

    Example:
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> double = pw.jit(lambda v: v * 2, devices=s)
      >>> fut = double(jnp.arange(3.0))
      >>> fut.shape, fut.result().tolist()
      ((3,), [0.0, 2.0, 4.0])
      >>> f"{fut.sum():.1f}", (fut + 1).tolist(), float(fut[2])
      ('6.0', [1.0, 3.0, 5.0], 4.0)
      >>> s.release()
    """

    __slots__ = ("__weakref__", "_entry", "_loose", "_store")

    def __init__(self, entry: Entry, store: ObjectStore):
        self._entry = entry
        self._store = store

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._entry.aval.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._entry.aval.dtype

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """Where the value lives (known when the call returns), as ``result().sharding``."""
        entry = self._entry
        if _uncommitted_output(entry):
            return jax.sharding.SingleDeviceSharding(next(iter(entry.sharding.device_set)))
        return entry.sharding

    @property
    def committed(self) -> bool:
        """As ``jax.Array.committed``: False for outputs placed where nothing placed the call; no wait."""
        return not _uncommitted_output(self._entry)

    @property
    def _committed(self) -> bool:
        """What ``jax.jit`` reads of an argument (``getattr(arg, "_committed", True)``) to place a call."""
        return not _uncommitted_output(self._entry)

    @property
    def slice(self):
        """The :class:`VirtualSlice` the value lives on."""
        return self._entry.slice

    @property
    def aval(self) -> Any:
        """The value's abstract value (shape, dtype, weak type), as ``jax.Array.aval``; no wait."""
        return self._entry.aval

    @property
    def is_fully_replicated(self) -> bool:
        """As ``jax.Array.is_fully_replicated``, from the sharding; no wait."""
        return self._entry.sharding.is_fully_replicated

    @property
    def device(self) -> Any:
        """As ``jax.Array.device``: the device of a value on one, else its sharding; no wait."""
        sharding = self._entry.sharding
        devices = sharding.device_set
        return next(iter(devices)) if len(devices) == 1 else sharding

    @property
    def is_fully_addressable(self) -> bool:
        """As ``jax.Array.is_fully_addressable``, from the sharding; no wait."""
        return self._entry.sharding.is_fully_addressable

    def devices(self) -> set[Any]:
        """The devices the value lives on, as ``jax.Array.devices()``; no wait."""
        return set(self._entry.sharding.device_set)

    def is_deleted(self) -> bool:
        """True once the value was freed (or its buffers deleted or donated); never waits."""
        entry = self._entry
        array = entry.array  # read before the state: a ready state then has its array
        state = entry.state
        if type(state) is Freed or type(state) is Consumed:  # donated: as a donated jax.Array
            return True
        if type(state) is Ready and array is not None:
            return readiness.is_deleted(array)
        return False

    def delete(self) -> None:
        """Frees the value, as ``jax.Array.delete()``: reading it (or a run taking it later) then raises.

        As ``jax.Array.delete()`` waits for the computations enqueued before it
        that read the buffer, this waits for the runs submitted before it to be
        dispatched (they take the value) and to finish on their devices: a run
        whose host callback reads the value would otherwise wait for ever for
        the interpreter lock the deleting thread holds inside XLA. Under a
        memory budget a queued run may wait for the bytes this frees: only the
        runs dispatched are waited for there.
        """
        entry, store = self._entry, self._store
        wait = store.wait_for_readers
        # Not inside the runtime's work (a host callback, a finalizer): the runs may wait for this thread.
        if (
            wait is not None
            and not reentry.inside.depth
            and type(entry.state) is Ready
            and isinstance(entry.array, jax.Array)
        ):
            wait(store.budget is None)
        array = entry.array
        ready = type(entry.state) is Ready
        store.free([entry])
        if ready and isinstance(array, jax.Array):
            array.delete()

    def copy_to_host_async(self) -> None:
        """Starts copying the value to the host, as ``jax.Array.copy_to_host_async()``.

        Waits for the run's dispatch only, not for the value; a value held by a
        Ray host or a controller service is left where it is (``result()`` fetches it).
        """
        array = dispatched(self)
        if isinstance(array, jax.Array):
            array.copy_to_host_async()

    def is_ready(self) -> bool:
        """As ``jax.Array.is_ready``: True once the value is computed (or its run failed); never waits."""
        return self.done()

    def platform(self) -> str:
        """As ``jax.Array.platform``: the platform of the devices the value lives on; never waits."""
        return next(iter(self.devices())).platform

    def done(self) -> bool:
        """True once the value is computed (or its run failed)."""
        entry = self._entry
        array = entry.array  # read before the state: a ready state then has its array
        match entry.state:
            case Pending():
                return False
            case Ready() if array is not None:
                return readiness.settled(array)
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
          HostLostError: a Ray host the value lived on (or came from) died.
          AccessError: a controller service refused the run: it read a value
            handle that is not this process's (nor shared with it), or one freed.
          ClusterError: the cluster the value lived on is gone: its controller
            service died or dropped this process, or ``pw.shutdown()`` ended
            its Ray hosts before the value was read.
        """
        deadline = None if timeout is None or not checks.is_seconds(timeout) else time.monotonic() + timeout
        array = self._computed(timeout)
        if not isinstance(array, jax.Array):
            if not isinstance(array, readiness.RemoteValue):
                raise errors.ProgramFailedError(
                    f"fetching {self._entry.origin} failed: its value is a {type(array).__name__}, "
                    "neither a jax.Array nor a value a backend holds (core.readiness.RemoteValue); "
                    "the backend that made it must return one of those"
                )
            try:  # held by a backend's host (a handle): bring it here
                array = array.fetch(deadline)
            except errors.FutureTimeoutError as exc:
                raise self._timeout(timeout) from exc
            except errors.PathwaysError:
                raise
            except Exception as exc:
                if reentry.from_signal_handler(exc):
                    raise  # the caller's own (a time budget's alarm), not a failed fetch
                raise errors.ProgramFailedError(f"fetching {self._entry.origin} failed: {exc}") from exc
        if _uncommitted_output(self._entry):
            return self._uncommitted(array)
        return array

    def _uncommitted(self, array: jax.Array) -> jax.Array:
        """``array`` (a one-device value) as jax.jit returns one nothing placed: uncommitted, on its device.

        The same buffer: made once per future, not copied.
        """
        if not getattr(array, "_committed", True):  # made so by its executable (node_compiler.loose_device)
            return array
        loose = getattr(self, "_loose", None)
        if loose is None or loose[0] is not array:
            aval, sharding = _loose_type(self._entry.signature, array)
            made = arrays.remade(array, aval=aval, sharding=sharding, committed=False)
            loose = self._loose = (array, made)
        return loose[1]

    def _computed(self, timeout: float | None) -> Any:
        """The value once computed (a ``jax.Array``, or a backend's handle to it); raises as :meth:`result`."""
        entry = self._entry
        if timeout is not None and not checks.is_seconds(timeout):
            timeout = self._checked_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._store.wait_settled(entry, timeout):
            raise self._timeout(timeout)
        array = entry.array  # read before the state: a ready state then has its array
        match entry.state:
            case Ready() if array is not None:
                try:
                    ready = _wait_ready(array, deadline)
                except _KEPT_TYPES as exc:  # kept as they are: what went wrong is not the program's doing
                    raise type(exc)(f"{entry.origin}: {exc}") from exc
                except Exception as exc:
                    if reentry.from_signal_handler(exc):
                        raise  # the caller's own (a time budget's alarm), not the run's failure
                    if isinstance(array, jax.Array) and array.is_deleted():
                        # As jax.Array's "Array has been deleted": a RuntimeError, not a failed run.
                        raise errors.also(errors.PathwaysError, RuntimeError)(
                            f"the value of {entry.origin} has been deleted: a computation it was donated "
                            "to (donate_argnums of a jax.jit function or a program) consumed its buffer. "
                            "Read it before donating it, or do not donate it."
                        ) from exc
                    raise _failure_class(exc)(f"{entry.origin} failed while executing: {exc}") from exc
                if not ready:
                    raise self._timeout(timeout)
                return array
            case Failed():
                raise failure_of(entry.state)
            case Freed() | Ready():  # Ready with no array: freed since it was read
                raise _freed(f"the value of {entry.origin}")
            case Pending():
                raise self._timeout(timeout)
        raise AssertionError(f"unknown state {entry.state!r}")  # pragma: no cover

    def _checked_timeout(self, timeout: Any) -> float | None:
        """``timeout`` that is not a finite number of seconds >= 0: None for infinity, else an error."""
        number = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
        if number and float(timeout) == math.inf:
            return None  # as long as it takes
        kind = ValueError if number else TypeError
        raise errors.also(errors.PathwaysError, kind)(
            f"result(timeout=...) takes None or a number of seconds >= 0, got {timeout!r} "
            f"({type(timeout).__name__}) for {self._entry.origin}; pass None to wait as long as it takes."
        )

    def _timeout(self, timeout: float | None) -> errors.FutureTimeoutError:
        return errors.FutureTimeoutError(
            f"{self._entry.origin} was not ready within timeout={timeout}s; wait "
            "longer, or check .done() before calling .result()."
        )

    def block_until_ready(self) -> Future:
        """Waits until the value is computed (raising as :meth:`result` does); returns the future itself.

        A value on a Ray host stays there: only :meth:`result` brings it here.
        """
        self._computed(None)
        return self

    def __reduce__(self) -> Any:
        # Pickled as the array it stands for (waits for it): a future names a run of this process.
        return self.result().__reduce__()

    def _repr_html_(self) -> str:
        from pathways_jax._src.views import notebook

        return notebook.future_html(self)

    def __repr__(self) -> str:
        state, detail = state_of(self)
        first = detail.splitlines()[0] if detail else ""
        shown = state if state in ("ready", "freed") else f"{state}: {first:.100}"
        return f"Future({self._entry.origin}, shape={self.shape}, dtype={self.dtype}, {shown})"


def state_of(future: Future) -> tuple[str, str]:
    """(state, detail) of a future, without waiting: pending, ready, failed or freed.

    A run that failed on its devices leaves an array that raises when read: it
    is "failed" here once computed, as a dispatched run still computing is
    "pending". What ``repr`` and the notebook view show.
    """
    entry = future._entry
    array = entry.array  # read before the state: a ready state then has its array
    match entry.state:
        case Pending():
            return "pending", "queued, or being dispatched"
        case Ready() if array is not None:
            try:
                if not readiness.is_ready(array):
                    return "pending", "dispatched, computing"
                array.block_until_ready()  # computed: returns at once, or raises its error
            except Exception as exc:
                return "failed", f"{type(exc).__name__}: {exc}"
            return "ready", ""
        case Failed(message, _):
            return "failed", message
        case Freed() | Ready():  # Ready with no array: freed since it was read
            return "freed", "its value was freed"
    return "unknown", ""  # pragma: no cover


def results(tree: Any, timeout: float | None = None) -> Any:
    """``tree`` with every future in it replaced by its ``jax.Array`` (waits for each).

    A future here is a ``pw.Future`` or another handle that answers as its
    value (``pw.elastic``'s ``Loss``). Other leaves stay as they are. Code
    that needs arrays, not handles (``isinstance(v, jax.Array)``, writing
    into the value itself), takes them this way::

      state = pw.results(nnx.state(model))

    Args:
      tree: any pytree.
      timeout: seconds to wait for each value; ``None`` waits as long as it takes.

    Raises:
      As :meth:`Future.result`.
    """
    return jax.tree.map(lambda v: v.result(timeout) if isinstance(v, ArrayLike) else v, tree)


def sent(future: Future, timeout: float | None, what: str) -> Any:
    """What ``future``'s value is once its run was sent (not computed): a handle on hosts, or an array.

    Raises ``FutureTimeoutError`` if the run is not sent within ``timeout``
    seconds, and the run's own error (``HostLostError`` kept as it is, else
    ``ProgramFailedError``) if it failed; ``what`` (the caller's operation)
    opens the message.
    """
    entry = future._entry
    if not future._store.wait_settled(entry, timeout):
        raise errors.FutureTimeoutError(
            f"{what}: {entry.origin} was not sent to its devices within {timeout:.0f}s."
        )
    array = entry.array  # read before the state: a ready state then has its array
    state = entry.state
    if isinstance(state, Failed):
        cause = state.cause
        kept = (errors.HostLostError, errors.ClusterError)  # raised as their own type
        kind = type(cause) if isinstance(cause, kept) else errors.ProgramFailedError
        raise kind(f"{what}: {entry.origin} failed: {state.message}") from state.cause
    if not isinstance(state, Ready) or array is None:
        raise _freed(f"{what}: {entry.origin}")
    return array


def _freed(what: str) -> errors.PathwaysError:
    """The error of reading a freed value: also a ``RuntimeError``, as reading a deleted ``jax.Array`` raises."""
    return errors.also(errors.PathwaysError, RuntimeError)(
        f"{what} was freed (its future deleted with .delete(), its client closed, or the garbage "
        "collector freeing it in a reference cycle): as a deleted jax.Array, it cannot be read. "
        "Read it, or keep a copy (jnp.copy(future)), before it is freed."
    )


def adopted(store: ObjectStore, owner: Owner, value: Any, origin: str) -> Future:
    """A future, ready at once, of ``value`` made outside a run (a handle on hosts, with ``aval`` and
    ``sharding``): a value a restore, a colocated call or another client process made."""
    entry = store.new(owner, value.aval, value.sharding, None, origin)
    store.set_ready(entry, value)
    return Future(entry, store)


def dispatched(future: Future) -> Any:
    """The ``jax.Array`` ``future`` stands for once its run is dispatched (not computed); else the future.

    Waits only for the dispatch, as a ``jax.jit`` call returns once its
    computation is enqueued. The future itself comes back where its value
    cannot be had that way: a value held by a Ray host or a controller service,
    a run that failed, a value under a memory budget (whose bytes the store
    counts while a future holds them), or a wait inside the runtime's work (a
    host callback on the controller's thread, a finalizer), which would never end.
    """
    store = future._store
    entry = future._entry
    if store.budget is not None:
        return future
    if type(entry.state) is Pending:
        if reentry.inside.depth:  # a host callback on the controller's thread, a finalizer: see wait_settled
            return future
        store.wait_settled(entry, None)
    array = entry.array  # read before the state: a ready state then has its array
    if type(entry.state) is Ready and isinstance(array, jax.Array):
        if _uncommitted_output(entry):
            return future._uncommitted(array)
        return array
    return future


def dispatched_all(futures: list[Future]) -> list[Any]:
    """:func:`dispatched` of each future, in one pass: what ``nnx_graph`` writes back into Variables.

    The futures of one run settle together: one wait for the last, then each
    value as :func:`dispatched` gives it.
    """
    if not futures:
        return []
    store = futures[0]._store
    if store.budget is not None or any(f._store is not store for f in futures):
        return [dispatched(f) for f in futures]
    last = futures[-1]._entry
    if type(last.state) is Pending:
        if reentry.inside.depth:
            return [dispatched(f) for f in futures]
        store.wait_settled(last, None)
    out: list[Any] = []
    append = out.append
    known, loose, array_type = _LOOSE, arrays.loose, jax.Array
    for future in futures:
        entry = future._entry
        array = entry.array  # read before the state: a ready state then has its array
        if type(entry.state) is not Ready or array is None:
            append(dispatched(future))
            continue
        signature = entry.signature
        if not isinstance(array, array_type):  # held by a backend's host: stays a future
            append(future)
        elif signature is None or signature.committed or not getattr(array, "_committed", True):
            append(array)
        else:  # as Future._uncommitted, inlined: hundreds of outputs a call
            held = known.get(id(signature))
            if held is not None and held[0] is signature and held[1] is array.aval:
                append(loose(array, *held[2]))
            else:
                append(loose(array, *_loose_type(signature, array)))
    return out


def batch_values(
    batch: Entry, plan: Any, slices: Sequence[Any], store: ObjectStore, wanted: Sequence[bool]
) -> list[Any]:
    """A just-submitted run's outputs, from its one entry (``submission.submit_values``): those
    ``wanted`` as :func:`dispatched_all` gives them, the others as futures.

    Waits for the run's dispatch. A wanted output that comes back as a
    ``jax.Array`` is that array: no entry, no future, no state outliving the
    call. Every other output becomes a :class:`Future` of an entry of its own,
    which the store lists then. A run that failed at dispatch raises its
    error here, as :meth:`Future.result` would and as a ``jax.jit`` call whose
    dispatch fails does (a host callback that raised, ``jax_debug_nans``):
    its caller writes nothing back.
    ``plan``, ``slices``: the run's plan and the slice of each output
    (``Runnable.output_slices``).
    """
    if type(batch.state) is Pending:
        try:
            store.wait_settled(batch, None)
        except BaseException:  # an interrupt: nothing else holds the run's outputs, so they go here
            store.free([batch])
            raise
    outputs = batch.array  # read before the state: a ready state then has its array
    state = batch.state
    if isinstance(state, Failed):  # as a jax.jit call whose dispatch fails: the call raises
        raise failure_of(state)
    if type(state) is not Ready or outputs is None:  # freed: only by an interrupt, raised above
        raise _freed(batch.origin)
    out: list[Any] = []
    append = out.append
    signatures = plan.signatures
    known, loose, array_type, impl = _LOOSE, arrays.loose, jax.Array, arrays.array_impl
    for position, (array, want) in enumerate(zip(outputs, wanted, strict=True)):
        if want and (type(array) is impl or isinstance(array, array_type)):
            signature = signatures[position]
            if signature is None or signature.committed or not getattr(array, "_committed", True):
                append(array)  # uncommitted already: its executable was compiled as jax.jit's
            else:  # as in dispatched_all
                held = known.get(id(signature))
                if held is not None and held[0] is signature and held[1] is array.aval:
                    append(loose(array, *held[2]))
                else:
                    append(loose(array, *_loose_type(signature, array)))
            continue
        append(_adopted(store, batch, plan, slices, position, array))
    batch.array = None
    return out


def _adopted(
    store: ObjectStore, batch: Entry, plan: Any, slices: Sequence[Any], position: int, array: Any
) -> Future:
    """A future of output ``position``, ``array``, of the run whose entry is ``batch``."""
    out = plan.outputs[position]
    entry = store.new(
        batch.owner, out.aval, out.sharding, slices[position], out.origin, plan.signatures[position]
    )
    entry.array = array  # before the state: a ready state has its array
    entry.state = READY
    return Future(entry, store)


# (id of an output's FutureKey) -> (that key, the aval and sharding of its uncommitted
# arrays): made once per program output, not once per value (a SingleDeviceSharding
# made anew computes its XLA sharding again in every array made with it).
_LOOSE: dict[int, tuple[Any, Any, Any]] = {}


def _loose_type(signature: Any, array: jax.Array) -> tuple[Any, Any]:
    """The aval and sharding ``jax.jit`` gives an uncommitted one-device output like ``array``."""
    held = _LOOSE.get(id(signature))
    if held is not None and held[0] is signature and held[1] is array.aval:
        return held[2]
    device = next(iter(array.sharding.device_set))
    made = (arrays.unplaced_aval(array.aval), _device_sharding(device))
    if len(_LOOSE) > 4096:  # one per program output: a bound, never reached in a train loop
        _LOOSE.clear()
    _LOOSE[id(signature)] = (signature, array.aval, made)
    return made


@functools.lru_cache(maxsize=256)
def _device_sharding(device: Any) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device)


def _uncommitted_output(entry: Entry) -> bool:
    """True for an output placed where nothing placed its call: uncommitted, as ``jax.jit``'s."""
    signature = entry.signature
    return signature is not None and not signature.committed
