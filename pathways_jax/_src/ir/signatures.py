"""Argument signatures: the cache key of each argument leaf, which traces and plans depend on.

NamedTuples: hashed and compared as tuples, and the ``kind`` field (last, with
a default) keeps kinds apart.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple


class FutureKey(NamedTuple):
    """The cache key of a future passed to a program: what its trace and plan depend on.

    Made once per program output (see ``compile.steps.OutputSlot.signature``) and
    shared by every future of that output, so a call with the same futures as
    the call before can compare keys by identity. Equal exactly when shape,
    dtype, sharding and slice are.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax import core
      >>> key = FutureKey.of(core.ShapedArray((2, 3), jnp.float32), None, None)
      >>> key.kind, key.shape, key.slice_id
      ('future', (2, 3), None)
    """

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    slice_id: int | None  # the virtual slice the value lives on (None: none)
    weak_type: bool = False  # as the array's: a weakly typed output stays weak in the next call
    # As jax.Array.committed: False for outputs placed on JAX's default device because nothing
    # placed the call, as jax.jit's outputs of uncommitted arguments are (result() says so too).
    committed: bool = True
    kind: Literal["future"] = "future"

    @classmethod
    def of(cls, aval: Any, sharding: Any, slice_: Any, committed: bool = True) -> FutureKey:
        """The key of a value of ``aval`` with ``sharding`` on the virtual slice ``slice_`` (or None)."""
        slice_id = slice_.id if slice_ is not None else None
        weak = bool(getattr(aval, "weak_type", False))
        return cls(tuple(aval.shape), aval.dtype, sharding, slice_id, weak, committed)


class ArrayKey(NamedTuple):
    """The cache key of a ``jax.Array`` argument leaf: used where it is, as it is."""

    shape: tuple[int, ...]
    dtype: Any
    weak_type: bool
    sharding: Any
    committed: bool = True  # placed by the user (jax.device_put to a device), not by default
    kind: Literal["array"] = "array"


class NumpyKey(NamedTuple):
    """The cache key of a numpy array argument leaf: put on devices at each call."""

    shape: tuple[int, ...]
    dtype: Any  # canonical: what JAX makes of it
    kind: Literal["numpy"] = "numpy"


class ScalarKey(NamedTuple):
    """The cache key of a Python scalar argument leaf (a weakly typed value, but for bool)."""

    python_type: type
    kind: Literal["scalar"] = "scalar"


# The cache key of one argument leaf: what tracing and lowering depend on.
# NamedTuples: hashed and compared as tuples (the kind keeps kinds apart).
ArgKey = FutureKey | ArrayKey | NumpyKey | ScalarKey
Signature = tuple[ArgKey, ...]  # one key per argument leaf


__all__ = ["ArgKey", "ArrayKey", "FutureKey", "NumpyKey", "ScalarKey", "Signature"]
