"""Values on a host: to and from the wire, typed keys, placing, and what a fetch reads.

Typed PRNG keys cross as :class:`KeyData` (their raw data and
implementation); a value spanning hosts is read as this host's
:class:`Shards` of it, and fed as this host's :class:`Blocks` of it. JAX and numpy are imported where used.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pathways_jax._src.backends.ray_host.answers import SMALL_BYTES


class KeyData(NamedTuple):
    """Typed PRNG keys on their way between the controller and a host: raw data and implementation.

    ``data``: ``jax.random.key_data`` of the keys (numpy, a host's
    :class:`Shards` of it, or the :class:`Blocks` of it a host is fed); ``impl``: the implementation's name
    (``"threefry2x32"``, ``"rbg"``, ...), for ``jax.random.wrap_key_data``.
    """

    data: Any
    impl: str


def to_wire(value: Any) -> Any:
    """``value`` as Ray ships it: a numpy array, or :class:`KeyData` for typed keys."""
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.extended):
        return KeyData(np.asarray(jax.random.key_data(value)), str(jax.random.key_impl(value)))
    return np.asarray(value)


def from_wire(data: Any) -> Any:
    """What :func:`to_wire` made, as a value again (typed keys wrapped back)."""
    if isinstance(data, KeyData):
        import jax

        raw = data.data
        if isinstance(raw, Blocks):  # this host's blocks of the keys' raw data: keys block by block
            return Blocks(
                raw.shape,
                [(bounds, jax.random.wrap_key_data(block, impl=data.impl)) for bounds, block in raw.parts],
            )
        return jax.random.wrap_key_data(raw, impl=data.impl)
    return data


def own_copy(value: Any) -> Any:
    """A copy of ``value`` on its own devices: a buffer of its own (for a computation that consumes
    its buffers, or a program output that must not be another's)."""
    import jax

    return jax.device_put(value, value.sharding, may_alias=False)


def place(data: Any, sharding: Any) -> Any:
    """``data`` (numpy, or an array on this host) put on ``sharding``, which may span hosts.

    Over devices of several hosts, each host makes its own shards (every
    host of the island holds the same ``data``) and the result is one global
    array, as a multi-controller JAX program would build it.
    """
    import jax

    if isinstance(data, Blocks):  # this host's blocks only: each to the devices that hold it
        parts = {tuple(bounds): block for bounds, block in data.parts}
        shards = [
            jax.device_put(parts[bounds_of(index, data.shape)], device)
            for device, index in sharding.addressable_devices_indices_map(data.shape).items()
        ]
        return jax.make_array_from_single_device_arrays(data.shape, sharding, shards)
    if getattr(data, "sharding", None) == sharding:  # already there (a pulled value, most often)
        return data
    if sharding.is_fully_addressable:
        return jax.device_put(data, sharding)
    shape = tuple(data.shape)
    shards = [
        jax.device_put(data[index], device)
        for device, index in sharding.addressable_devices_indices_map(shape).items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def key_data(value: Any) -> Any:
    """A typed key array's raw data."""
    import jax

    return jax.random.key_data(value)


def wrap_key(data: Any, impl: str) -> Any:
    """Raw key ``data`` as typed keys of implementation ``impl`` again."""
    import jax

    return jax.random.wrap_key_data(data, impl=impl)


def is_ready(value: Any) -> bool:
    """Whether a value's computation is over (a value that cannot say is taken as not)."""
    try:
        return bool(value.is_ready())
    except Exception:
        return False


def is_small(value: Any) -> bool:
    """Whether a kept value comes back with its run's completion: small, and whole on this host."""
    try:
        return value.size * value.dtype.itemsize <= SMALL_BYTES and value.is_fully_addressable
    except Exception:  # typed keys (no itemsize) and the like: fetched when asked for
        return False


def readable(value: Any, np: Any) -> Any:
    """A kept value for the controller: a numpy array, or this host's distinct shards of it.

    Typed keys go as :class:`KeyData` around their raw data's.
    """
    if not isinstance(value.dtype, np.dtype):  # (an extended dtype is no numpy dtype)
        import jax

        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
            return KeyData(readable(jax.random.key_data(value), np), str(jax.random.key_impl(value)))
    if value.is_fully_addressable:
        return np.asarray(value)
    return Shards(
        [
            (bounds_of(shard.index, value.shape), np.asarray(shard.data))
            for shard in value.addressable_shards
            if shard.replica_id == 0
        ]
    )


def bounds_of(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's ``index`` (slices) as ``(start, stop)`` per dimension."""
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape, strict=True))


class Shards(NamedTuple):
    """A host's distinct shards of a value spanning hosts: ``(bounds, data)`` each."""

    parts: list


class Blocks(NamedTuple):
    """What a host is fed of an argument sharded over several hosts: the blocks its own devices
    hold, ``(bounds, data)`` each, of a value of ``shape`` (not the whole value, which every host
    of it would otherwise receive). Typed keys are fed as :class:`KeyData` around the blocks of
    their raw data (``shape``: the keys', each block with its keys' words whole)."""

    shape: tuple[int, ...]
    parts: list

    @property
    def nbytes(self) -> int:
        return sum(data.nbytes for _, data in self.parts)
