"""A program call's arguments: their signature (the plan cache's key), checks and repeat-call marks."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from pathways_jax._src.api import nnx_graph
from pathways_jax._src.core import arrays, errors, reentry
from pathways_jax._src.ir.signatures import ArgKey, ArrayKey, FutureKey, NumpyKey, ScalarKey, Signature
from pathways_jax._src.runtime import clients
from pathways_jax._src.runtime.futures import Future
from pathways_jax._src.runtime.object_store import Consumed, Freed
from pathways_jax._src.runtime.slices import VirtualSlice, explicit_view

_SCALARS = (bool, int, float, complex)


class TracerArgument(Exception):
    """Raised when a program is called with JAX tracers (inside a transformation)."""


class _StaleFuture(Exception):
    """A future of a released slice (or a cluster shut down since) among a call's arguments."""


def _stale(leaf: Future) -> bool:
    """True for a future whose slice is gone (released, or its cluster shut down)."""
    slice_ = leaf._entry.slice
    return slice_ is not None and slice_.released


class _DeletedArray(Exception):
    """A ``jax.Array`` deleted (or donated) before the call among its arguments."""


def _refuse_deleted(leaves: list[Any], program: str) -> None:
    """Raises, as ``jax.jit`` does at the call, for the first argument leaf that is a deleted
    ``jax.Array``, or a future freed or donated before the call."""
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, Future) and _gone(leaf._entry.state):
            caller = clients.current()
            if caller.closed:  # closing it freed the value: the call is refused for the close
                raise caller.closed_error()
            how = (
                "was donated to an earlier run (donate_argnums), which reused its buffer"
                if isinstance(leaf._entry.state, Consumed)
                else f"was freed (by .delete(), or when its client {leaf._entry.owner.client!r} was closed)"
            )
            raise errors.also(errors.PathwaysError, RuntimeError)(
                f"program {program!r} got argument leaf {position}, a pw.Future of {leaf._entry.origin} "
                f"({leaf._entry.aval.str_short()}) that {how}: as jax.jit refuses a deleted array, a "
                "program refuses it at the call. Pass a value that is still live (the donating "
                "program's outputs, or a copy made before the value was donated or deleted)."
            )
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
            raise errors.also(errors.PathwaysError, RuntimeError)(
                f"program {program!r} got argument leaf {position}, a jax.Array "
                f"({leaf.aval.str_short()}) that has been deleted (by .delete(), or donated to an "
                "earlier jax.jit or program call): as jax.jit, a program refuses it at the call. Pass "
                "an array that is still live (keep a copy of a value before donating it)."
            )


class _WideValue(Exception):
    """A 64-bit value made under ``jax_enable_x64`` among the arguments of a call made without it."""


def _check_width(dtype: Any) -> None:
    """Raises ``_WideValue`` for a 64-bit dtype JAX's configuration narrows (the callers test the size)."""
    if isinstance(dtype, np.dtype) and jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise _WideValue


def _narrowed(leaf: Any) -> Any:
    """``leaf`` in the dtype JAX's configuration makes of it (float64 as float32 without x64), as jax.jit takes it."""
    value = leaf.result() if type(leaf) is Future else leaf
    if isinstance(value, jax.Array) and isinstance(value.dtype, np.dtype):
        canonical = jax.dtypes.canonicalize_dtype(value.dtype)
        if canonical != value.dtype:
            warnings.warn(  # as jax.jit warns for it
                f"An argument of dtype {value.dtype} (made under jax_enable_x64) is not available "
                f"without it, and will be truncated to dtype {canonical}.",
                UserWarning,
                stacklevel=5,
            )
            return value.astype(canonical)
    return leaf


def _gone(state: Any) -> bool:
    """Whether a value in this state was freed or consumed (its future refused at a call)."""
    return isinstance(state, Freed | Consumed)


def _future_key(leaf: Future) -> FutureKey:
    if _stale(leaf):
        raise _StaleFuture
    entry = leaf._entry
    key = entry.signature
    if key is None:
        if _gone(entry.state):  # ObjectStore.free drops the signature of such a value
            raise _DeletedArray
        key = FutureKey.of(entry.aval, entry.sharding, entry.slice)
    if key.dtype.itemsize == 8:
        _check_width(key.dtype)
    return key


class AbstractArray:
    """A ``jax.ShapeDtypeStruct`` given to ``program.lower``, as the ``jax.Array`` a call passes for it.

    ``jax.jit(f).lower(sds).compile()`` warms ``jax.jit(f)(x)``: a call with an
    array of that shape, dtype and sharding (none: uncommitted on the default
    device) compiles nothing. ``Program.lower`` prepares the plan of that call
    from this stand-in, which signs as such an array does; nothing else takes it.
    """

    __slots__ = ("key",)

    def __init__(self, key: ArrayKey) -> None:
        self.key = key

    @classmethod
    def of(cls, leaf: jax.ShapeDtypeStruct) -> AbstractArray | None:
        """The stand-in of ``leaf``; None where no call's array is known for it.

        A sharding that names no devices (a ``PartitionSpec``, an abstract mesh)
        or a dtype JAX's configuration narrows leaves the plan to the first call.
        """
        dtype = leaf.dtype
        if isinstance(dtype, np.dtype) and jax.dtypes.canonicalize_dtype(dtype) != dtype:
            return None
        sharding = leaf.sharding
        if sharding is None:  # as jnp.asarray makes it: uncommitted, on the default device
            device = arrays.default_device()
            return cls(ArrayKey(leaf.shape, dtype, leaf.weak_type, _one_device(device), False))
        if not isinstance(sharding, jax.sharding.Sharding):
            return None
        try:
            sharding.device_set  # noqa: B018  # an abstract mesh's has none
        except (AttributeError, ValueError, RuntimeError):
            return None
        return cls(ArrayKey(leaf.shape, dtype, leaf.weak_type, sharding, True))


# Exact-type fast path of the signature (the common argument kinds).
_KEYS: dict[type, Callable[[Any], ArgKey]] = {Future: _future_key, AbstractArray: lambda leaf: leaf.key}


def _signed(leaves: list[Any], program: str) -> tuple[ArgKey, ...]:
    """The signature of a call's argument leaves.

    A future whose slice is gone (released, or its cluster shut down: after
    ``pw.shutdown()`` and ``pw.init()``) stands for its computed array, which is
    still readable: it is passed as that array (``leaves`` is updated), as
    ``jax.jit`` would take it.
    """
    try:
        return tuple([_leaf_signature(leaf, i, program) for i, leaf in enumerate(leaves)])
    except _StaleFuture:
        leaves[:] = [leaf.result() if type(leaf) is Future and _stale(leaf) else leaf for leaf in leaves]
        return _signed(leaves, program)
    except _WideValue:  # made under jax_enable_x64, passed without it: narrowed, as jax.jit does
        leaves[:] = [_narrowed(leaf) for leaf in leaves]
        return _signed(leaves, program)
    except _DeletedArray:
        _refuse_deleted(leaves, program)
        raise


def _as_array_key(key: FutureKey) -> ArrayKey | None:
    """The key of the ``jax.Array`` a future of ``key`` stands for (as ``result()`` gives it), or None."""
    sharding = key.sharding
    if not key.committed:  # as jax.jit's outputs of uncommitted arguments: on their one device, uncommitted
        devices = sharding.device_set
        if len(devices) != 1:
            return None
        sharding = _one_device(next(iter(devices)))
    return ArrayKey(key.shape, key.dtype, key.weak_type, sharding, key.committed)


# The key of the jax.Array that the futures of each program output stand for, by the identity
# of that output's FutureKey (made once per output, OutputSlot.signature, and shared by its
# futures), noted when the output's plan is made: a program's second call, with the futures of
# its first for the arrays, finds the first call's plan with no key made per leaf, and the keys
# found are the objects of that plan's own key where they can be, so the plans' table compares
# them by identity. Bounded: cleared when full (a key not found here is made as before).
_ARRAY_KEYS: dict[int, tuple[FutureKey, ArrayKey | None]] = {}
_ARRAY_KEYS_MAX = 1 << 16


def note_array_keys(outputs: Sequence[FutureKey | None], signature: tuple[ArgKey, ...]) -> None:
    """Notes the array key of each future of ``outputs`` (a plan's), taken from ``signature`` (its call's) where equal.

    The output at a position of the call's argument leaves (a step that
    returns what it takes: ``state = step(state)``) takes the key there first.
    """
    if len(_ARRAY_KEYS) + len(outputs) > _ARRAY_KEYS_MAX:
        _ARRAY_KEYS.clear()
    same: dict[ArgKey, ArgKey] | None = None
    for position, key in enumerate(outputs):
        if type(key) is not FutureKey or id(key) in _ARRAY_KEYS:
            continue
        array = _as_array_key(key)
        if array is not None:
            there = signature[position] if position < len(signature) else None
            if there == array:
                array = there
            else:
                if same is None:
                    same = {k: k for k in signature if type(k) is ArrayKey}
                array = same.get(array, array)
        _ARRAY_KEYS[id(key)] = (key, array)


def forget_array_keys(outputs: Sequence[FutureKey | None]) -> None:
    """Forgets what :func:`note_array_keys` noted of ``outputs`` (a plan's, the plan gone)."""
    known = _ARRAY_KEYS
    for key in outputs:
        noted = known.get(id(key))
        if noted is not None and noted[0] is key:  # held there: its id is its own
            known.pop(id(key), None)


def _as_array_keys(signature: tuple[ArgKey, ...]) -> tuple[ArgKey, ...] | None:
    """``signature`` with each future's key replaced by that of the array it stands for; None if one has none."""
    keys: list[ArgKey] = []
    known = _ARRAY_KEYS
    for key in signature:
        if type(key) is FutureKey:
            noted = known.get(id(key))
            array = noted[1] if noted is not None and noted[0] is key else _as_array_key(key)
            if array is None:
                return None
            key = array
        keys.append(key)
    return tuple(keys)


@functools.lru_cache(maxsize=256)
def _one_device(device: Any) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device)


def _array_key(leaf: jax.Array) -> ArrayKey:
    if leaf.is_deleted():
        raise _DeletedArray
    aval = leaf.aval  # an attribute: shape, dtype and weak_type are properties reading it
    dtype = aval.dtype
    if dtype.itemsize == 8:
        _check_width(dtype)
    return ArrayKey(aval.shape, dtype, aval.weak_type, leaf.sharding, leaf.committed)


def _valid_dtype_check() -> Callable[[Any], None] | None:
    """JAX's own check that a dtype is an array type it takes (private to JAX; None on another JAX)."""
    try:
        from jax._src.dtypes import check_valid_dtype
    except ImportError:  # pragma: no cover - another JAX: its trace checks instead
        return None
    return check_valid_dtype


_check_valid_dtype = _valid_dtype_check()
# (numpy type, dtype) of the numpy arguments taken so far: each kind is checked once.
_NUMPY_TAKEN: set[tuple[type, Any]] = set()


def _check_numpy(leaf: np.ndarray | np.generic, position: int, program: str) -> None:
    """Refuses, as ``jax.jit`` does, a numpy argument JAX does not take as an array: a masked array, a non-numeric dtype."""
    if isinstance(leaf, np.ma.MaskedArray):
        raise errors.also(errors.ProgramTraceError, ValueError)(
            f"program {program!r} got argument leaf {position}, a numpy masked array: as under "
            "jax.jit, masked arrays are not taken (their mask would be dropped). Pass "
            "arr.filled(fill_value), or the data and np.ma.getmaskarray(arr) as two arguments."
        )
    if _check_valid_dtype is not None:
        try:
            _check_valid_dtype(leaf.dtype)
        except TypeError:
            fix = (
                "x.astype(x.dtype.newbyteorder('=')) (JAX takes native byte order)"
                if not leaf.dtype.isnative
                else "np.asarray(x, np.float32), or pass it through static_argnums"
            )
            raise errors.also(errors.ProgramTraceError, TypeError)(
                f"program {program!r} got argument leaf {position}, a numpy {type(leaf).__name__} of "
                f"dtype {leaf.dtype}, which is not a JAX array type (as under jax.jit, only numeric "
                f"dtypes are). Convert it first: {fix}."
            ) from None
    _NUMPY_TAKEN.add((type(leaf), leaf.dtype))


def _leaf_signature(leaf: Any, position: int, program: str) -> ArgKey:
    fast = _KEYS.get(type(leaf))
    if fast is not None:
        return fast(leaf)
    if isinstance(leaf, Future):
        return _future_key(leaf)
    if isinstance(leaf, jax.core.Tracer):
        raise TracerArgument(position)
    if isinstance(leaf, jax.Array):
        if isinstance(getattr(leaf, "aval", None), jax.core.ShapedArray):
            _KEYS.setdefault(type(leaf), _array_key)
            return _array_key(leaf)
        if leaf.is_deleted():
            raise _DeletedArray
        return ArrayKey(
            leaf.shape, leaf.dtype, leaf.weak_type, leaf.sharding, getattr(leaf, "committed", True)
        )
    if isinstance(leaf, np.ndarray | np.generic):
        if (type(leaf), leaf.dtype) not in _NUMPY_TAKEN:
            _check_numpy(leaf, position, program)
        return NumpyKey(leaf.shape, jax.dtypes.canonicalize_dtype(leaf.dtype))
    if isinstance(leaf, _SCALARS):
        # A subclass (an IntEnum, a bool-like flag) traces as the scalar it is, as under jax.jit.
        return ScalarKey(next(t for t in _SCALARS if isinstance(leaf, t)))
    if nnx_graph.is_graph_leaf(leaf):
        raise nnx_graph.GraphArgument(position)
    if hasattr(leaf, "__jax_array__"):  # jax.jit refuses it with a ValueError too
        raise errors.also(errors.ProgramTraceError, ValueError)(
            f"program {program!r} got argument leaf {position} of type {type(leaf).__name__}, which "
            "has __jax_array__: JAX no longer converts such objects when it abstracts an argument. "
            "Convert it before the call (jnp.asarray(value)), or register its type as a pytree."
        )
    if isinstance(leaf, jax.ShapeDtypeStruct):  # a description of an argument, not a value
        raise errors.also(errors.ProgramTraceError, TypeError)(
            f"program {program!r} got argument leaf {position}, a jax.ShapeDtypeStruct "
            f"({leaf.dtype}{list(leaf.shape)}): a call needs values, as jax.jit's does. To work from "
            "shapes alone, ask the program: program.lower(...), program.trace(...) or "
            "program.eval_shape(...) take ShapeDtypeStructs."
        )
    raise errors.also(errors.ProgramTraceError, TypeError)(
        f"program {program!r} got argument leaf {position} of type "
        f"{type(leaf).__name__}; expected a jax.Array, numpy array, Python "
        "scalar or pw.Future (or a pytree of them). Pass other values through "
        "static_argnums."
    )


def _abstract(key: ArgKey, default: VirtualSlice | None = None) -> jax.ShapeDtypeStruct:
    # On a slice with Explicit axes the trace sees each input as the slice holds
    # it (its spec if it fits the slice, else replicated), whatever mesh it came on.
    match key:
        case FutureKey(shape=shape, dtype=dtype, sharding=sharding, weak_type=weak):
            view = explicit_view(default, sharding, shape)
            return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak, sharding=view)
        case ArrayKey(shape=shape, dtype=dtype, weak_type=weak, sharding=sharding):
            view = explicit_view(default, sharding, shape)
            return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak, sharding=view)
        case NumpyKey(shape=shape, dtype=dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=explicit_view(default, None, shape))
        case ScalarKey(python_type=python_type):
            dtype = jax.dtypes.canonicalize_dtype(np.dtype(python_type))
            return jax.ShapeDtypeStruct((), dtype, weak_type=python_type is not bool)
    raise AssertionError(key)  # pragma: no cover


class TraceInputs(NamedTuple):
    """What tracing and lowering a call need of its arguments (made per call by ``Program._split``)."""

    treedef: Any  # of the dynamic arguments: (positional tuple, keyword dict)
    statics: tuple[tuple[int | str, Any], ...]  # (position or keyword name, value), in position order
    signature: Signature  # one key per dynamic leaf
    ambient: VirtualSlice | None  # the enclosing ``with slice:`` (None: none, or the program has devices)
    leaves: list[Any]  # the dynamic leaves themselves


def _array_type() -> Any:
    """The type of every concrete ``jax.Array`` (private to JAX; None on another JAX: no fast path)."""
    try:
        from jax._src.array import ArrayImpl
    except ImportError:  # pragma: no cover - another JAX
        return None
    return ArrayImpl


_ArrayImpl: Any = _array_type()


def _key_array_type() -> Any:
    """The type of a typed PRNG key array (``jax.random.key``; private to JAX; None on another JAX)."""
    try:
        from jax._src.random.prng import PRNGKeyArray
    except ImportError:  # pragma: no cover - another JAX
        try:
            from jax._src.prng import PRNGKeyArray  # type: ignore[no-redef]
        except ImportError:  # keys are signed each call
            return None
    return PRNGKeyArray


_KeyArray: Any = _key_array_type()


def _marks(leaves: list[Any]) -> tuple[Any, ...] | None:
    """What identifies each leaf's type for :class:`_LastLeaves` (None: a leaf of another kind).

    A Python scalar's signature is its type alone (its value is the run's input,
    checked per run: ``submission._check_int``), so its mark is that type; a
    numpy array's or scalar's is its type, shape and dtype (:class:`_HostMark`).
    A loop fed a step number or a learning rate, or a numpy batch, each call
    then skips signing as one fed arrays does.
    """
    marks: list[Any] = []
    for leaf in leaves:
        kind = type(leaf)
        if kind is Future:
            signature = leaf._entry.signature
            if signature is None:
                return None
            marks.append(signature)
        elif kind is _ArrayImpl or kind is _KeyArray:  # a typed PRNG key array (jax.random.key) too
            marks.append((leaf.aval, leaf.sharding, leaf._committed))
        elif kind in arrays.PYTHON_SCALARS:  # exact types: a subclass (an IntEnum) is signed each call
            marks.append(kind)
        elif (kind is np.ndarray or kind in arrays.NUMPY_SCALARS) and (kind, leaf.dtype) in _NUMPY_TAKEN:
            marks.append(_HostMark(kind, leaf.shape, leaf.dtype))
        else:
            return None
    return tuple(marks)


class _HostMark(NamedTuple):
    """The mark of a numpy argument leaf (see :func:`_marks`): what its signature is made of."""

    kind: type
    shape: tuple[int, ...]
    dtype: Any


def _same_types(leaves: list[Any], marks: tuple[Any, ...]) -> bool:
    """True when each leaf has the type its mark recorded (by identity where it can); see :class:`_LastLeaves`."""
    if len(leaves) != len(marks):
        return False
    future, array, key = Future, _ArrayImpl, _KeyArray
    for leaf, mark in zip(leaves, marks, strict=True):
        kind = type(leaf)
        if kind is future:
            if leaf._entry.signature is not mark:
                return False
        elif (kind is not array and kind is not key) or type(mark) is not tuple:
            if mark is kind:  # a Python scalar of the same exact type
                continue
            if type(mark) is not _HostMark or mark.kind is not kind:
                return False
            if leaf.shape != mark.shape or leaf.dtype != mark.dtype:
                return False
        else:
            aval, sharding, committed = mark
            if leaf._committed is not committed:
                return False
            # By identity first; else by equality, as the signature compares them: an array of
            # jax.device_put(batch) has a sharding of its own each call, equal to the last one's.
            held = leaf.aval
            if held is not aval and held != aval:
                return False
            held = leaf.sharding
            if held is not sharding and held != sharding:
                return False
            if leaf.is_deleted():  # the call's signing refuses it, as jax.jit does
                return False
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class _KeyFault:
    """Why a static argument cannot be part of a program's cache key."""

    path: str  # where the part at fault sits in the argument (``[1][0]``); "" for the argument itself
    part: Any
    reason: str
    cause: BaseException | None = None
    unhashable: bool = False  # hash() raised TypeError: the value is of an unhashable type


def _key_fault(value: Any, path: str = "") -> _KeyFault | None:
    """Why ``value`` cannot be part of a cache key, or None if it can.

    A key must hash and equal itself. Tuples and frozensets are searched part by
    part: a tuple equals itself whatever it holds (its comparison checks identity
    first), but a NaN inside it never equals the NaN of the next call.
    """
    try:
        hash(value)
    except Exception as exc:
        if reentry.from_signal_handler(exc):
            raise  # the caller's own (a time budget's alarm), not the value's fault
        reason = f"hashing it raised {type(exc).__name__}: {exc}"
        return _KeyFault(path, value, reason, exc, unhashable=isinstance(exc, TypeError))
    try:
        same = bool(value == value)
    except Exception as exc:
        if reentry.from_signal_handler(exc):
            raise
        return _KeyFault(path, value, f"comparing it with itself raised {type(exc).__name__}: {exc}", exc)
    if not same:
        reason = "it is not equal to itself (no NaN is), so every call would miss the cache and trace again"
        return _KeyFault(path, value, reason)
    if isinstance(value, tuple | frozenset):
        parts = enumerate(value) if isinstance(value, tuple) else ((None, v) for v in value)
        for index, item in parts:
            fault = _key_fault(item, path if index is None else f"{path}[{index}]")
            if fault is not None:
                return fault
    return None


def _short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages; never raises."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
