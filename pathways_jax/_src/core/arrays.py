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


def _array_type() -> Any:
    try:
        from jax._src.array import ArrayImpl
    except ImportError:  # pragma: no cover - another JAX: arrays are kept as they are
        return None
    return ArrayImpl


_ArrayImpl: Any = _array_type()  # JAX's own constructor, private to JAX
array_impl: Any = _ArrayImpl  # the type of every concrete ``jax.Array`` (None on another JAX)
_new: Any = _ArrayImpl  # the same, called (a name no type test narrows)


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
