"""Virtual slices: a mesh shape asked for by the user, mapped onto devices by the cluster."""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from pathways_jax._src import context, errors

if TYPE_CHECKING:
    from pathways_jax._src.cluster import Cluster

_ids = itertools.count()
_DEFAULT_AXIS_NAMES = ("x", "y", "z")
SCOPE_PREFIX = "pw_slice"


def _normalise_mesh(mesh: Mapping[str, int] | Sequence[int]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if isinstance(mesh, Mapping):
        names, sizes = tuple(mesh.keys()), tuple(mesh.values())
        if not all(isinstance(n, str) and n for n in names):
            raise errors.ResourceError(
                f"mesh axis names must be non-empty strings, got {list(names)!r}; "
                "e.g. pw.devices(mesh={'x': 4})."
            )
    elif isinstance(mesh, Sequence) and not isinstance(mesh, str):
        sizes = tuple(mesh)
        names = (
            _DEFAULT_AXIS_NAMES[: len(sizes)]
            if len(sizes) <= len(_DEFAULT_AXIS_NAMES)
            else tuple(f"axis{i}" for i in range(len(sizes)))
        )
    else:
        raise errors.ResourceError(
            f"mesh must be a dict {{axis_name: size}} or a tuple of sizes, got "
            f"{mesh!r}; e.g. pw.devices(mesh={{'x': 4}}) or pw.devices(mesh=(2, 2))."
        )
    if not sizes or not all(
        isinstance(s, int | np.integer) and not isinstance(s, bool) and s >= 1 for s in sizes
    ):
        raise errors.ResourceError(f"mesh sizes must be positive ints and at least one axis, got {mesh!r}.")
    return tuple(int(s) for s in sizes), names


class VirtualSlice:
    """A set of devices with a mesh shape and axis names, asked for with ``pw.devices``.

    The slice is virtual: programs traced against it name only its shape and axis
    names (``.mesh``, an ``AbstractMesh``); the cluster maps it onto physical devices
    (``.devices``). Use it as a context manager to place code traced inside it.

    Example:
      >>> import pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 2})
      >>> s.shape, s.axis_names
      ((2,), ('x',))
      >>> s.release()
    """

    def __init__(
        self,
        cluster: Cluster,
        shape: tuple[int, ...],
        axis_names: tuple[str, ...],
        island: int,
        devices: tuple[jax.Device, ...],
        exclusive: bool,
    ):
        self.id = next(_ids)
        self._cluster = cluster
        self.shape = shape
        self.axis_names = axis_names
        self.mesh = AbstractMesh(shape, axis_names)
        self.island = island
        self.exclusive = exclusive
        self._devices = devices
        self._released = False
        self._lock = threading.Lock()
        self._physical_mesh: Mesh | None = None
        # Gives the devices back if the slice is dropped without release().
        self._give_back = weakref.finalize(self, cluster.resources.release, devices, exclusive)
        cluster.add_slice(self)
        # One exit stack per active ``with`` of this slice on each thread.
        self._exits = threading.local()

    @property
    def size(self) -> int:
        return len(self._devices)

    @property
    def released(self) -> bool:
        return self._released or self._cluster.closed

    def check_usable(self) -> None:
        """Raises ``PlacementError`` if the slice was released or its cluster shut down."""
        if self._released:
            raise errors.PlacementError(f"{self!r} was released; ask for a new slice with pw.devices(...).")
        if self._cluster.closed:
            raise errors.PlacementError(
                f"{self!r} belongs to a cluster that was shut down; ask for a new "
                "slice with pw.devices(...) after pw.init()."
            )

    @property
    def cluster(self) -> Cluster:
        return self._cluster

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The physical devices the slice is mapped to now, in mesh order."""
        self.check_usable()
        return self._devices

    @property
    def physical_mesh(self) -> Mesh:
        """A ``jax.sharding.Mesh`` over ``.devices`` with the slice's shape and names."""
        self.check_usable()
        if self._physical_mesh is None:
            grid = np.array(self._devices, dtype=object).reshape(self.shape)
            self._physical_mesh = Mesh(grid, self.axis_names)
        return self._physical_mesh

    def sharding(self, *spec: str | tuple[str, ...] | None) -> NamedSharding:
        """A ``NamedSharding`` of the slice's current devices: ``s.sharding("x", None)``."""
        partition = PartitionSpec(*spec)
        check_spec(partition, self, what="sharding spec")
        return NamedSharding(self.physical_mesh, partition)

    def _move(self, island: int, devices: tuple[jax.Device, ...]) -> None:
        """Rebinds the slice to other devices (its host was lost); plans using it lower again."""
        self._give_back.detach()  # the old devices went with their host
        self._give_back = weakref.finalize(self, self._cluster.resources.release, devices, self.exclusive)
        self.island = island
        self._devices = devices
        self._physical_mesh = None

    def release(self) -> None:
        """Gives the devices back to the cluster. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._give_back()
        self._cluster.mapping_epoch += 1

    def __enter__(self) -> VirtualSlice:
        self.check_usable()
        stack = contextlib.ExitStack()
        trace = context.state.trace
        if trace is not None:
            trace.note_slice(self)
            stack.enter_context(jax.named_scope(f"{SCOPE_PREFIX}{self.id}"))
            stack.enter_context(jax.sharding.use_abstract_mesh(self.mesh))
        context.state.slices.append(self)
        if not hasattr(self._exits, "stacks"):
            self._exits.stacks = []
        self._exits.stacks.append(stack)
        return self

    def __exit__(self, *exc_info: object) -> None:
        context.state.slices.pop()
        self._exits.stacks.pop().close()

    def _repr_html_(self) -> str:
        from pathways_jax._src import notebook

        return notebook.slice_html(self)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n!r}: {s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        ids = ",".join(str(d.id) for d in self._devices)
        kind = "exclusive" if self.exclusive else "shared"
        state = ", released" if self.released else ""
        return (
            f"VirtualSlice#{self.id}(mesh={{{axes}}}, island={self.island}, devices=[{ids}], {kind}{state})"
        )


def check_spec(spec: PartitionSpec, slice_: VirtualSlice, *, what: str) -> None:
    """Raises ``PlacementError`` if ``spec`` names axes the slice does not have."""
    if not isinstance(spec, PartitionSpec):
        raise errors.PlacementError(f"{what} must be a pw.P(...) PartitionSpec, got {spec!r}.")
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        for name in names:
            if name is not None and name not in slice_.axis_names:
                raise errors.PlacementError(
                    f"{what} {spec} names axis {name!r}, but {slice_!r} has axes "
                    f"{slice_.axis_names}. Use the slice's axis names."
                )


def spec_parts(spec: PartitionSpec, sizes: Mapping[str, int]) -> list[int] | None:
    """How many parts each dimension is split into; None if an axis is unknown."""
    parts = []
    for entry in spec:
        count = 1
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is None:
                continue
            if name not in sizes:
                return None
            count *= sizes[name]
        parts.append(count)
    return parts


def devices(
    mesh: Mapping[str, int] | Sequence[int],
    *,
    island: int | None = None,
    exclusive: bool = False,
    timeout: float | None = None,
    device_ids: Sequence[int] | None = None,
) -> VirtualSlice:
    """Asks the cluster for a virtual slice of devices.

    Args:
      mesh: ``{axis_name: size}`` or a tuple of sizes (axes then named
        ``"x"``, ``"y"``, ``"z"``).
      island: the island to place the slice on; ``None`` lets the resource
        manager pick the least-loaded fitting island.
      exclusive: reserve the devices for this slice alone. By default slices
        are shared: several may map onto the same devices and the controller
        time-multiplexes them.
      timeout: seconds to wait for busy devices (``None``: wait as long as it
        takes). Only waits when devices are reserved by exclusive slices.
      device_ids: the devices to map the slice onto, one id per mesh
        position in row-major order (all on one island), instead of letting
        the resource manager choose. Two slices may name the same devices in
        different orders; the controller still orders every program on them
        consistently. If the island's host is lost (Ray backend), the slice
        moves to devices the resource manager picks.

    Returns:
      A :class:`VirtualSlice`.

    Raises:
      ResourceError: the request can never be met (more devices than any
        island has, an unknown island, ``device_ids`` that are unknown,
        repeated, of the wrong count or on several islands), or no devices
        freed up within ``timeout``.

    Example:
      >>> import pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 2})
      >>> len(s.devices)
      2
      >>> s.release()
    """
    from pathways_jax._src import cluster as cluster_lib

    shape, axis_names = _normalise_mesh(mesh)
    if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
        raise errors.ResourceError(f"timeout must be None or a number >= 0, got {timeout!r}.")
    cl = cluster_lib.cluster()
    size = int(np.prod(shape))
    island_index, physical = cl.resources.acquire(size, island, exclusive, timeout, device_ids)
    return VirtualSlice(cl, shape, axis_names, island_index, physical, exclusive)
