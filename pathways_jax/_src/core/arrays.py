"""A ``jax.Array`` over another's buffers, typed or placed as ``jax.jit`` would have returned it.

Values pathways_jax hands back come from its own executables and transfers,
which commit them to their devices and, on the Ray backend, lose their weak
type on the way: ``jax.jit``'s outputs of uncommitted arguments are
uncommitted, and its weakly typed outputs stay weak (``0.1 * 0.5 ** step``
times a ``bfloat16`` array stays ``bfloat16``). Re-made here without a copy.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pathways_jax._src.core import reentry


def _array_type() -> Any:
    try:
        from jax._src.array import ArrayImpl
    except ImportError:  # pragma: no cover - another JAX: arrays are kept as they are
        return None
    return ArrayImpl


_ArrayImpl: Any = _array_type()  # JAX's own constructor, private to JAX
array_impl: Any = _ArrayImpl  # the type of every concrete ``jax.Array`` (None on another JAX)
_new: Any = _ArrayImpl  # the same, called (a name no type test narrows)


def _shard_args() -> tuple[Any, Any]:
    try:
        from jax._src.interpreters.pxla import shard_args
        from jax._src.lib import xla_client

        return shard_args, xla_client.ArrayCopySemantics.REUSE_INPUT
    except (ImportError, AttributeError):  # pragma: no cover - another JAX: jax.device_put
        return None, None


_shard, _REUSE = _shard_args()  # what jax.device_put calls for host data, private to JAX


def default_device() -> Any:
    """The device ``jax.jit`` puts values nothing placed on: ``jax.config.jax_default_device`` (a
    device, or a platform's first), else the first device."""
    device = getattr(jax.config, "jax_default_device", None)
    if isinstance(device, jax.Device):
        return device
    return jax.devices(device)[0] if device else jax.devices()[0]


def put(leaf: Any, sharding: Any) -> jax.Array:
    """``jax.device_put(leaf, sharding)`` of host data: a Python or NumPy scalar, or a NumPy array the
    caller will not change (its buffer may be taken as it is, as device_put may take it).

    Through JAX's own call for it, private to JAX: ``jax.device_put``'s Python path around it cost
    50-300 µs a leaf (measured 54-300 µs against 12), a cliff for a step fed a batch each call.
    Anything it does not take goes to ``jax.device_put``, which raises what it raises.
    """
    if _shard is not None and (type(leaf) in PYTHON_SCALARS or getattr(leaf, "dtype", None) in PLAIN):
        try:
            return _shard([sharding], [None], [_REUSE], [leaf])[0]
        except Exception as exc:  # let jax.device_put say what is wrong
            if reentry.from_signal_handler(exc):
                raise  # the caller's own (a time budget's alarm)
    return jax.device_put(leaf, sharding)


# Python scalars, of these exact types (a subclass such as an IntEnum is not one here).
PYTHON_SCALARS = frozenset({bool, int, float, complex})
# NumPy dtypes whose data goes to devices as it is (not float0, JAX's zero-size tangent type).
PLAIN = frozenset(
    np.dtype(t)
    for t in (
        *(np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64),
        *(np.float16, np.float32, np.float64, np.complex64, np.complex128, jnp.bfloat16),
    )
)
# NumPy's scalar types of those dtypes (np.float32(0.5), np.int32(3)): immutable host data.
NUMPY_SCALARS = frozenset(dtype.type for dtype in PLAIN)


def remade(
    array: jax.Array, *, aval: Any = None, sharding: Any = None, committed: bool | None = None
) -> jax.Array:
    """``array``'s buffers with another ``aval`` (its weak type), ``sharding`` (of the same devices) or ``committed``.

    JAX's own constructor, private to JAX: on a JAX without it, and for typed
    PRNG keys (not made of buffers of their own), the array as it is.
    """
    if type(array) is not _ArrayImpl:
        return array
    impl: Any = array
    return _new(
        impl.aval if aval is None else aval,
        impl.sharding if sharding is None else sharding,
        impl._arrays,  # its single-device buffers, one a shard (a new list each time it is read)
        committed=impl.committed if committed is None else committed,
        _skip_checks=True,
    )


def loose(array: jax.Array, aval: Any, sharding: Any) -> jax.Array:
    """``remade(array, aval=aval, sharding=sharding, committed=False)``, for a loop over many arrays."""
    if type(array) is not _ArrayImpl:
        return array
    impl: Any = array
    return _new(aval, sharding, impl._arrays, committed=False, _skip_checks=True)


def unplaced_aval(aval: Any) -> Any:
    """``aval`` with no mesh in its type, as ``jax.jit`` types an output it put on one device.

    A program with no slice is compiled on its default slice's one-device
    mesh, which its outputs' types would otherwise carry: ``jnp.add(out, y)``
    of ``y`` on a mesh of the user's then fails with "Mesh for all inputs
    should be equal", where ``jax.jit``'s output works. Made once per type
    (about 5 us each; a train loop reads the same types every step).
    """
    try:
        return _unplaced(aval)
    except TypeError:  # pragma: no cover - an unhashable type: made each time
        return _unplaced.__wrapped__(aval)


@functools.lru_cache(maxsize=1024)
def _unplaced(aval: Any) -> Any:
    try:
        mesh = jax.sharding.AbstractMesh((), ())
        spec = jax.sharding.PartitionSpec(*(None,) * aval.ndim)
        return aval.update(sharding=jax.sharding.NamedSharding(mesh, spec))
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - another JAX: the type as it is
        return aval
