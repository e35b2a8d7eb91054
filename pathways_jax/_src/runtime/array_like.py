"""Standing for a ``jax.Array``: the operators, methods and properties a future answers as its value.

:class:`ArrayLike` is a mixin of no state, as NumPy's ``NDArrayOperatorsMixin``:
each of its members waits for the value through ``result()`` and then does what
the array would do, returning plain ``jax.Array`` s. ``pw.Future`` is the one
class that uses it; it gives ``result()``, ``shape`` and ``dtype``.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np


def _on_value(op: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``future.<name>(*args)`` is ``op(value, *args)``, once the value is computed."""

    def method(self: ArrayLike, *args: Any) -> Any:
        return op(self.result(), *args)

    method.__name__ = method.__qualname__ = name
    return method


def _reflected(op: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``future.<name>(other)`` is ``op(other, value)``: the future on the right."""

    def method(self: ArrayLike, other: Any) -> Any:
        return op(other, self.result())

    method.__name__ = method.__qualname__ = name
    return method


def _array_method(name: str) -> Callable[..., Any]:
    """``future.<name>(...)`` waits, then calls ``jax.Array.<name>`` on the value."""

    def method(self: ArrayLike, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.result(), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Waits for the value and returns ``value.{name}(...)`` (see ``jax.Array.{name}``)."
    return method


def _array_property(name: str) -> property:
    return property(
        lambda self: getattr(self.result(), name),
        doc=f"Waits for the value and returns ``value.{name}`` (see ``jax.Array.{name}``).",
    )


class ArrayLike:
    """What a value's handle answers as the value: everything but ``result()``, ``shape`` and ``dtype``."""

    __slots__ = ()

    if TYPE_CHECKING:  # what the class using the mixin gives (pw.Future)

        def result(self, timeout: float | None = None) -> jax.Array: ...

        @property
        def shape(self) -> tuple[int, ...]: ...

        @property
        def dtype(self) -> np.dtype: ...

        def done(self) -> bool: ...

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
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __len__(self) -> int:
        shape = self.shape
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
        return self.result()[index_values(index)]

    def __setitem__(self, index: Any, value: Any) -> None:
        # Raises jax.Array's TypeError, with what a Flax Variable holding a future needs.
        try:
            self.result()[index] = value
        except TypeError as exc:
            exc.add_note(
                "pathways_jax: this is a pw.Future, which stands for an immutable jax.Array. "
                "Write with future.at[index].set(value), or into pw.results(tree)."
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

    @property
    def format(self) -> Any:
        """As ``jax.Array.format`` (layout and sharding); a value not computed yet gives no wait.

        JAX reads it of every argument it traces (``jax.jit(f).lower``,
        ``eval_shape``, ``jax.make_jaxpr``), which a ``jax.Array`` still computing
        answers at once. A handle that knows its sharding before its value (a
        ``pw.Future``) answers so too, with the default layout (``None``, as JAX
        reads a default one); once computed, or for a handle that does not know
        its sharding, it is the value's.
        """
        if not self.done():
            sharding = getattr(self, "sharding", None)  # known before the value (pw.Future), or not at all
            if sharding is not None:
                from jax.experimental.layout import Format

                return Format(None, sharding)
        return self.result().format  # type: ignore[attr-defined]

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


class _At:
    """``future.at``: the value's ``.at``, taking futures in the index as their arrays."""

    __slots__ = ("_at",)

    def __init__(self, at: Any):
        self._at = at

    def __getitem__(self, index: Any) -> Any:
        return self._at[index_values(index)]


def index_values(index: Any) -> Any:
    """``index`` with each future in it (alone or in a tuple) as its array."""
    if isinstance(index, ArrayLike):
        return index.result()
    if type(index) is tuple and any(isinstance(part, ArrayLike) for part in index):
        return tuple(part.result() if isinstance(part, ArrayLike) else part for part in index)
    return index


__all__ = ["ArrayLike", "index_values"]
