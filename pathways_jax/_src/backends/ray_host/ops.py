"""A plan's part for one host: sharding descriptors and the operations a host runs.

NamedTuples, so the controller and a host pickle them with nothing else of
pathways_jax imported. Shardings are named by descriptors over the island's
devices (:class:`SingleDesc`, :class:`NamedDesc`); :func:`sharding_of` makes
the ``jax.sharding.Sharding`` a descriptor names.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple


class SingleDesc(NamedTuple):
    """A value on one device: number ``device_index`` of its island's devices."""

    device_index: int
    kind: Literal["single"] = "single"


class NamedDesc(NamedTuple):
    """A value sharded with ``spec`` over a mesh of its island's devices (of one host or several)."""

    device_indices: tuple[int, ...]  # the island's devices, in the mesh's order
    grid_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    spec: Any  # a jax.sharding.PartitionSpec
    kind: Literal["named"] = "named"


ShardingDesc = SingleDesc | NamedDesc


class ExecOp(NamedTuple):
    """Run a compiled computation (by fingerprint) on the values in ``in_slots``."""

    fingerprint: str
    in_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    windowed: bool  # counts against the host's bound of executables in flight
    name: str  # the node, as messages name it
    # Positions of the arguments whose buffers the computation consumes (donate_argnums).
    donated: tuple[int, ...] = ()
    kind: Literal["exec"] = "exec"


class PutOp(NamedTuple):
    """Copy slot ``src`` to slot ``dst`` with another sharding, on this host.

    ``fresh``: a buffer of its own even on the same sharding (a program output that is an
    argument returned as it is, or a value returned twice: as ``jax.jit``'s, its own buffer).
    """

    src: int
    dst: int
    desc: ShardingDesc
    fresh: bool = False
    kind: Literal["put"] = "put"


class Piece(NamedTuple):
    """One distinct shard of a value moving between hosts.

    ``position``: the device holding it, numbered in its island's global
    device order; ``bounds``: ``(start, stop)`` per dimension of the value;
    ``shape``: the shard's shape.
    """

    position: int
    bounds: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]


class PostOp(NamedTuple):
    """Offer this host's ``pieces`` of slot ``src`` to host ``peer`` on the transfer server.

    The uuid is the run's transfer base (sent with the run) plus ``offset``;
    the peer pulls it, host to host, without the controller.
    """

    src: int
    peer: int
    offset: int
    pieces: tuple[Piece, ...]
    dtype: str
    key_impl: str | None = None  # a typed key's: its key_data goes (pieces and dtype are the data's)
    kind: Literal["post"] = "post"


class PullOp(NamedTuple):
    """Gather a value from its hosts into slot ``dst`` with sharding ``desc``.

    ``parts``: ``(host, offset, pieces)`` per source host; this host's own
    pieces (``host`` is this one) are read from slot ``src`` directly, the
    others are pulled from their hosts' transfer servers. The pieces are put
    together on this host, then placed (resharded locally).
    """

    dst: int
    src: int
    parts: tuple[tuple[int, int, tuple[Piece, ...]], ...]
    shape: tuple[int, ...]
    dtype: str
    desc: Any  # ShardingDesc
    key_impl: str | None = (
        None  # a typed key's: its key_data comes (shape and dtype are the data's), then wrapped
    )
    kind: Literal["pull"] = "pull"


Op = ExecOp | PutOp | PostOp | PullOp


def donated_slots(ops: list[Op]) -> frozenset[int]:
    """The slots whose buffers a computation of ``ops`` consumes (donation)."""
    return frozenset(op.in_slots[position] for op in ops if isinstance(op, ExecOp) for position in op.donated)


def fingerprints_of(ops: list[Op]) -> set[str]:
    """The computations (fingerprints) ``ops`` run, each once."""
    return {op.fingerprint for op in ops if isinstance(op, ExecOp)}


def sharding_of(desc: ShardingDesc, devices: list) -> Any:
    """The ``jax.sharding.Sharding`` a controller descriptor names over an island's devices."""
    import jax
    import numpy as np

    if isinstance(desc, SingleDesc):
        return jax.sharding.SingleDeviceSharding(devices[desc.device_index])
    grid = np.array([devices[i] for i in desc.device_indices], dtype=object).reshape(desc.grid_shape)
    return jax.sharding.NamedSharding(jax.sharding.Mesh(grid, desc.axis_names), desc.spec)
