"""``pw.Future``: the handle a program call returns for each output value."""

from __future__ import annotations

import copy
import functools
import math
import numbers
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pathways_jax._src.core import arrays, checks, errors, readiness, reentry
from pathways_jax._src.runtime.object_store import Entry, Failed, Freed, ObjectStore, Pending, Ready


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


def _on_value(op: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``future.<name>(*args)`` is ``op(value, *args)``, once the value is computed."""

    def method(self: Future, *args: Any) -> Any:
        return op(self.result(), *args)

    method.__name__ = method.__qualname__ = name
    return method


def _reflected(op: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``future.<name>(other)`` is ``op(other, value)``: the future on the right."""

    def method(self: Future, other: Any) -> Any:
        return op(other, self.result())

    method.__name__ = method.__qualname__ = name
    return method


def _array_method(name: str) -> Callable[..., Any]:
    """``future.<name>(...)`` waits, then calls ``jax.Array.<name>`` on the value."""

    def method(self: Future, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.result(), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Waits for the value and returns ``value.{name}(...)`` (see ``jax.Array.{name}``)."
    return method


def _array_property(name: str) -> property:
    return property(
        lambda self: getattr(self.result(), name),
        doc=f"Waits for the value and returns ``value.{name}`` (see ``jax.Array.{name}``).",
    )


# Failures a future raises as their own type, not as ProgramFailedError: a lost
# host, a refused handle (controller service), memory back-pressure.
_KEPT_TYPES = (errors.HostLostError, errors.AccessError, errors.BackPressureTimeout)


def _failure_class(cause: BaseException | None) -> type[errors.PathwaysError]:
    """``ProgramFailedError``, also of the cause's class: ``except FloatingPointError``
    (jax_debug_nans) or ``except jax.errors.JaxRuntimeError`` written for jax.jit still
    catches it. Not for ours, nor for an interrupt that cut the run short: that is
    never raised again as a new Ctrl-C."""
    if not isinstance(cause, Exception) or isinstance(cause, errors.PathwaysError):
        return errors.ProgramFailedError
    return errors.also(errors.ProgramFailedError, type(cause))


class Future:
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

    def __del__(self) -> None:
        # No module globals here: at interpreter exit they may already be None.
        # The store frees the value at its next collect(): an atomic append.
        try:  # noqa: SIM105
            self._store._dropped.append(self._entry)
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
        if type(state) is Freed:
            return True
        if type(state) is Ready and array is not None:
            return readiness.is_deleted(array)
        return False

    def delete(self) -> None:
        """Frees the value now, as ``jax.Array.delete()``: reading it (or a run taking it) then raises."""
        entry = self._entry
        array = entry.array
        ready = type(entry.state) is Ready
        self._store.free([entry])
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
        """
        array = self._computed(timeout)
        if not isinstance(array, jax.Array):  # held by a backend's host (a handle): bring it here
            try:
                array = array.fetch()
            except errors.PathwaysError:
                raise
            except Exception as exc:
                raise errors.ProgramFailedError(f"fetching {self._entry.origin} failed: {exc}") from exc
        if _uncommitted_output(self._entry):
            return self._uncommitted(array)
        return array

    def _uncommitted(self, array: jax.Array) -> jax.Array:
        """``array`` (a one-device value) as jax.jit returns one nothing placed: uncommitted, on its device.

        The same buffer: made once per future, not copied.
        """
        if not getattr(array, "_committed", True):  # made so by its executable (lowering._loose_device)
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
            case Failed(message, cause):
                if isinstance(cause, _KEPT_TYPES):
                    raise type(cause)(message) from cause
                raise _failure_class(cause)(message) from cause
            case Freed() | Ready():  # Ready with no array: freed since it was read
                raise errors.PathwaysError(f"the value of {entry.origin} was freed.")
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

    # --- standing for the jax.Array: each of these waits for the value ----------------------

    __array_priority__ = 100  # as jax.Array: NumPy's operators defer to ours
    # As jax.Array: == compares elementwise. (typeshed has object.__hash__ always callable.)
    __hash__ = None  # type: ignore[assignment]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        # NumPy 2 passes copy= (copy=False raises if a copy is needed); NumPy 1 never does.
        if copy is None:
            return np.asarray(self.result(), dtype=dtype)
        return np.asarray(self.result(), dtype=dtype, copy=copy)

    def __jax_array__(self) -> jax.Array:
        return self.result()

    @property
    def ndim(self) -> int:
        return len(self._entry.aval.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._entry.aval.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __len__(self) -> int:
        shape = self._entry.aval.shape
        if not shape:
            raise TypeError("len() of unsized object")  # as jax.Array and NumPy
        return shape[0]

    __bool__ = _on_value(bool, "__bool__")
    __int__ = _on_value(int, "__int__")
    __float__ = _on_value(float, "__float__")
    __complex__ = _on_value(complex, "__complex__")
    __index__ = _on_value(operator.index, "__index__")
    __round__ = _on_value(round, "__round__")
    __format__ = _on_value(format, "__format__")
    __str__ = _on_value(str, "__str__")
    __iter__ = _on_value(iter, "__iter__")
    __contains__ = _on_value(operator.contains, "__contains__")

    def __getitem__(self, index: Any) -> Any:
        # Futures in the index stand for their arrays too (JAX's indexing takes only its own).
        return self.result()[_index_values(index)]

    def __setitem__(self, index: Any, value: Any) -> None:
        # Raises jax.Array's TypeError, with what a Flax Variable holding a future needs.
        try:
            self.result()[index] = value
        except TypeError as exc:
            exc.add_note(
                "pathways_jax: this is a pw.Future (a Flax Variable holds one after a program on Ray "
                "hosts or a controller service). Write into arrays: "
                "nnx.update(model, pw.results(nnx.state(model))) first."
            )
            raise

    __copy__ = _on_value(copy.copy, "__copy__")
    __deepcopy__ = _on_value(copy.deepcopy, "__deepcopy__")

    __neg__ = _on_value(operator.neg, "__neg__")
    __pos__ = _on_value(operator.pos, "__pos__")
    __abs__ = _on_value(operator.abs, "__abs__")
    __invert__ = _on_value(operator.invert, "__invert__")

    __eq__ = _on_value(operator.eq, "__eq__")  # type: ignore[assignment]
    __ne__ = _on_value(operator.ne, "__ne__")  # type: ignore[assignment]
    __lt__ = _on_value(operator.lt, "__lt__")
    __le__ = _on_value(operator.le, "__le__")
    __gt__ = _on_value(operator.gt, "__gt__")
    __ge__ = _on_value(operator.ge, "__ge__")

    # No __iadd__ and friends: `x += future` falls back to `x = x + future`, a new array.
    __add__, __radd__ = _on_value(operator.add, "__add__"), _reflected(operator.add, "__radd__")
    __sub__, __rsub__ = _on_value(operator.sub, "__sub__"), _reflected(operator.sub, "__rsub__")
    __mul__, __rmul__ = _on_value(operator.mul, "__mul__"), _reflected(operator.mul, "__rmul__")
    __matmul__ = _on_value(operator.matmul, "__matmul__")
    __rmatmul__ = _reflected(operator.matmul, "__rmatmul__")
    __truediv__ = _on_value(operator.truediv, "__truediv__")
    __rtruediv__ = _reflected(operator.truediv, "__rtruediv__")
    __floordiv__ = _on_value(operator.floordiv, "__floordiv__")
    __rfloordiv__ = _reflected(operator.floordiv, "__rfloordiv__")
    __mod__, __rmod__ = _on_value(operator.mod, "__mod__"), _reflected(operator.mod, "__rmod__")
    __divmod__, __rdivmod__ = _on_value(divmod, "__divmod__"), _reflected(divmod, "__rdivmod__")
    __pow__, __rpow__ = _on_value(operator.pow, "__pow__"), _reflected(operator.pow, "__rpow__")
    __and__, __rand__ = _on_value(operator.and_, "__and__"), _reflected(operator.and_, "__rand__")
    __or__, __ror__ = _on_value(operator.or_, "__or__"), _reflected(operator.or_, "__ror__")
    __xor__, __rxor__ = _on_value(operator.xor, "__xor__"), _reflected(operator.xor, "__rxor__")
    __lshift__ = _on_value(operator.lshift, "__lshift__")
    __rlshift__ = _reflected(operator.lshift, "__rlshift__")
    __rshift__ = _on_value(operator.rshift, "__rshift__")
    __rrshift__ = _reflected(operator.rshift, "__rrshift__")

    T = _array_property("T")
    mT = _array_property("mT")
    real = _array_property("real")
    imag = _array_property("imag")

    @property
    def at(self) -> Any:
        """Waits for the value and returns ``value.at`` (see ``jax.Array.at``); futures in its index work."""
        return _At(self.result().at)

    weak_type = _array_property("weak_type")
    traceback = _array_property("traceback")
    flat = _array_property("flat")  # raises as jax.Array's does, pointing at flatten()
    clone = _array_method("clone")
    addressable_shards = _array_property("addressable_shards")
    global_shards = _array_property("global_shards")
    format = _array_property("format")

    __array_namespace__ = _array_method("__array_namespace__")
    __dlpack__ = _array_method("__dlpack__")
    __dlpack_device__ = _array_method("__dlpack_device__")
    addressable_data = _array_method("addressable_data")
    on_device_size_in_bytes = _array_method("on_device_size_in_bytes")
    unsafe_buffer_pointer = _array_method("unsafe_buffer_pointer")
    all = _array_method("all")
    any = _array_method("any")
    argmax = _array_method("argmax")
    argmin = _array_method("argmin")
    argpartition = _array_method("argpartition")
    argsort = _array_method("argsort")
    astype = _array_method("astype")
    byteswap = _array_method("byteswap")
    choose = _array_method("choose")
    clip = _array_method("clip")
    compress = _array_method("compress")
    conj = _array_method("conj")
    conjugate = _array_method("conjugate")
    copy = _array_method("copy")
    cumprod = _array_method("cumprod")
    cumsum = _array_method("cumsum")
    diagonal = _array_method("diagonal")
    dot = _array_method("dot")
    flatten = _array_method("flatten")
    item = _array_method("item")
    max = _array_method("max")
    mean = _array_method("mean")
    min = _array_method("min")
    nonzero = _array_method("nonzero")
    prod = _array_method("prod")
    ptp = _array_method("ptp")
    ravel = _array_method("ravel")
    repeat = _array_method("repeat")
    reshape = _array_method("reshape")
    round = _array_method("round")
    searchsorted = _array_method("searchsorted")
    sort = _array_method("sort")
    squeeze = _array_method("squeeze")
    std = _array_method("std")
    sum = _array_method("sum")
    swapaxes = _array_method("swapaxes")
    take = _array_method("take")
    to_device = _array_method("to_device")
    tobytes = _array_method("tobytes")
    tolist = _array_method("tolist")
    trace = _array_method("trace")
    transpose = _array_method("transpose")
    var = _array_method("var")
    view = _array_method("view")

    def __reduce__(self) -> Any:
        # Pickled as the array it stands for (waits for it): a future names a run of this process.
        return self.result().__reduce__()

    def _repr_html_(self) -> str:
        from pathways_jax._src.views import notebook

        return notebook.future_html(self)

    def __repr__(self) -> str:
        state = type(self._entry.state).__name__.lower()
        return f"Future({self._entry.origin}, shape={self.shape}, dtype={self.dtype}, {state})"


def results(tree: Any, timeout: float | None = None) -> Any:
    """``tree`` with every future in it replaced by its ``jax.Array`` (waits for each).

    Other leaves stay as they are. Eager code that writes into what a program
    returned needs arrays, as a Flax Variable holding a future refuses
    ``variable[...] = v`` (values on Ray hosts or a controller service)::

      nnx.update(model, pw.results(nnx.state(model)))
      metrics.reset()

    Args:
      tree: any pytree.
      timeout: seconds to wait for each value; ``None`` waits as long as it takes.

    Raises:
      As :meth:`Future.result`.
    """
    return jax.tree.map(lambda v: v.result(timeout) if isinstance(v, Future) else v, tree)


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


def dispatched_values(entries: list[Entry], store: ObjectStore, wanted: Sequence[bool]) -> list[Any]:
    """A just-submitted run's outputs, those ``wanted`` as :func:`dispatched_all` gives them, made without futures.

    ``entries`` are the run's, held by no future yet (``submission.submit_values``).
    A wanted output that comes back as a ``jax.Array`` is read from its entry,
    which then goes at once, as a future's would once dropped: no future, no
    ready state outliving the call. Every other output, and every output when
    the run cannot be waited for here (a thread inside the runtime's work),
    comes back as a :class:`Future` of its entry.
    """
    if not entries:
        return []
    last = entries[-1]
    if type(last.state) is Pending:  # the outputs of one run settle together (Controller._publish)
        if reentry.inside.depth:  # a host callback on the controller's thread, a finalizer: see wait_settled
            return [Future(entry, store) for entry in entries]
        try:
            store.wait_settled(last, None)
        except BaseException:  # an interrupt: no future holds the entries, so they go here
            store.free(entries)
            raise
    out: list[Any] = []
    append = out.append
    taken: list[Entry] = []
    known, loose, array_type, impl = _LOOSE, arrays.loose, jax.Array, arrays.array_impl
    for entry, want in zip(entries, wanted, strict=True):
        array = entry.array  # read before the state: a ready state then has its array
        ready = want and type(entry.state) is Ready and array is not None
        if ready and (type(array) is impl or isinstance(array, array_type)):
            signature = entry.signature
            if signature is None or signature.committed or not getattr(array, "_committed", True):
                append(array)  # uncommitted already: its executable was compiled as jax.jit's
            else:  # as in dispatched_all
                held = known.get(id(signature))
                if held is not None and held[0] is signature and held[1] is array.aval:
                    append(loose(array, *held[2]))
                else:
                    append(loose(array, *_loose_type(signature, array)))
            taken.append(entry)
            continue
        append(Future(entry, store))
    store.forget(taken)
    return out


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


class _At:
    """``future.at``: the value's ``.at``, taking futures in the index as their arrays."""

    __slots__ = ("_at",)

    def __init__(self, at: Any):
        self._at = at

    def __getitem__(self, index: Any) -> Any:
        return self._at[_index_values(index)]


def _index_values(index: Any) -> Any:
    """``index`` with each future in it (alone or in a tuple) as its array."""
    if type(index) is Future:
        return index.result()
    if type(index) is tuple and any(type(part) is Future for part in index):
        return tuple(part.result() if type(part) is Future else part for part in index)
    return index
