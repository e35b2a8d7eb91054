"""Virtual slices: a mesh shape asked for by the user, mapped onto devices by the cluster."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from pathways_jax._src.compile.placement import NOWHERE, Placed, Placement, Target
from pathways_jax._src.core import checks, errors
from pathways_jax._src.core.meshes import fitting_spec, only_mesh
from pathways_jax._src.ir.graph import SliceRef
from pathways_jax._src.runtime import clusters, context

if TYPE_CHECKING:
    from pathways_jax._src.runtime.clusters import Cluster
    from pathways_jax._src.runtime.resources import Hold

_ids = itertools.count()
_DEFAULT_AXIS_NAMES = ("x", "y", "z")
SCOPE_PREFIX = "pw_slice"
NO_ABSTRACT_MESH = AbstractMesh((), ())


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


def _normalise_axis_types(
    axis_types: AxisType | Sequence[AxisType] | None, axis_names: tuple[str, ...]
) -> tuple[AxisType, ...]:
    if axis_types is None:
        return (AxisType.Auto,) * len(axis_names)
    if isinstance(axis_types, AxisType):
        return (axis_types,) * len(axis_names)
    given = axis_types
    if isinstance(given, str) or not isinstance(given, Sequence):
        raise errors.ResourceError(
            f"axis_types must be a jax.sharding.AxisType or a tuple of them, one per mesh axis "
            f"{axis_names}, got {axis_types!r}; e.g. axis_types=jax.sharding.AxisType.Explicit."
        )
    types = tuple(given)
    if len(types) != len(axis_names):
        raise errors.ResourceError(
            f"axis_types has {len(types)} entries {types} but the mesh has {len(axis_names)} "
            f"axes {axis_names}; give one AxisType, or one per axis."
        )
    for t in types:
        if not isinstance(t, AxisType):
            raise errors.ResourceError(
                f"axis_types entries must be jax.sharding.AxisType values, got {t!r} in "
                f"{axis_types!r}; e.g. (AxisType.Explicit, AxisType.Auto)."
            )
        if t == AxisType.Manual:
            raise errors.ResourceError(
                f"axis_types {types} has a Manual axis; a slice's axes are Auto or Explicit "
                "(jax.set_mesh refuses Manual axes too). Enter manual mode inside the program "
                "with jax.shard_map over the slice's axes."
            )
    return types


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
        axis_types: tuple[AxisType, ...] | None = None,
        hold: Hold | None = None,
    ):
        self.id = next(_ids)
        self._cluster = cluster
        self.shape = shape
        self.axis_names = axis_names
        self.axis_types = axis_types or (AxisType.Auto,) * len(axis_names)
        # The abstract mesh names the kind of device (not which ones): code traced
        # on it lowers for the physical mesh, whose abstract mesh it is.
        grid = np.array(devices, dtype=object).reshape(shape)
        self.mesh: AbstractMesh = Mesh(grid, axis_names, axis_types=self.axis_types).abstract_mesh
        # What the slice is, as the IR names it; where it is (devices, island) may change.
        self.ref = SliceRef(self.id, tuple(shape), tuple(axis_names), tuple(self.axis_types), self.mesh)
        self.island = island
        self.exclusive = exclusive
        self._devices = devices
        self._released = False
        self._lock = threading.Lock()
        self._physical_mesh: Mesh | None = None
        # Keeps the devices the slice's: dropped with it (without release()), they go back (Hold).
        self._hold = hold
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
            self._physical_mesh = Mesh(grid, self.axis_names, axis_types=self.axis_types)
        return self._physical_mesh

    def sharding(self, *spec: str | tuple[str, ...] | PartitionSpec | None) -> NamedSharding:
        """A ``NamedSharding`` of the slice's current devices: ``s.sharding("x", None)``.

        One ``pw.P(...)`` is taken as the whole spec, as ``NamedSharding(mesh, spec)`` takes it:
        ``s.sharding(pw.P("x", None))`` is ``s.sharding("x", None)``.
        """
        if len(spec) == 1 and isinstance(spec[0], PartitionSpec):
            partition = spec[0]
        else:
            for entry in spec:
                for name in entry if isinstance(entry, tuple) else (entry,):
                    if name is not None and not isinstance(name, str):
                        raise errors.PlacementError(
                            f"sharding spec {spec} has the entry {name!r} ({type(name).__name__}); each "
                            f"entry is an axis name of {self!r} ({self.axis_names}), a tuple of them, or "
                            "None; or pass one pw.P(...) as the whole spec."
                        )
            partition = PartitionSpec(*spec)
        check_spec(partition, self, what="sharding spec")
        return NamedSharding(self.physical_mesh, partition)

    def _move(self, island: int, devices: tuple[jax.Device, ...], hold: Hold) -> None:
        """Rebinds the slice to other devices (its host was lost); plans using it lower again.

        The mapping epoch moves before and after: a caller that sees the new island sees the
        new devices too, and a plan checked then (``still_placed``) is found moved, so its next
        call lowers again rather than run on the lost island.
        """
        self._hold = hold  # the old one goes: nothing is placed on the lost island's devices anyway
        self._cluster.mapping_epoch += 1
        self._devices = devices
        self._physical_mesh = None
        self.island = island
        self._cluster.mapping_epoch += 1

    def release(self) -> None:
        """Gives the devices back to the cluster. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        if self._hold is not None:
            self._cluster.resources.release(self._hold)
        self._cluster.mapping_epoch += 1

    def __enter__(self) -> VirtualSlice:
        self.check_usable()
        stack = contextlib.ExitStack()
        trace = context.state.trace
        if trace is not None:
            trace.note_slice(self)
            stack.enter_context(jax.named_scope(f"{SCOPE_PREFIX}{self.id}"))
            stack.enter_context(only_mesh(self.mesh))
        else:
            # Run as jax.jit (outside a program, or under the caller's grad/jit/vmap), code
            # naming the slice's mesh sees its devices, as under jax.set_mesh(physical_mesh).
            stack.enter_context(on_slice_mesh(self))
        context.state.slices.append(self)
        if not hasattr(self._exits, "stacks"):
            self._exits.stacks = []
        self._exits.stacks.append(stack)
        return self

    def __exit__(self, *exc_info: object) -> None:
        context.state.slices.pop()
        self._exits.stacks.pop().close()

    def _repr_html_(self) -> str:
        from pathways_jax._src.views import notebook

        return notebook.slice_html(self)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n!r}: {s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        ids = ",".join(str(d.id) for d in self._devices)
        kind = "exclusive" if self.exclusive else "shared"
        state = ", released" if self.released else ""
        types = ""
        if any(t != AxisType.Auto for t in self.axis_types):
            types = f", axis_types=({', '.join(t.name for t in self.axis_types)})"
        return (
            f"VirtualSlice#{self.id}(mesh={{{axes}}}{types}, island={self.island}, "
            f"devices=[{ids}], {kind}{state})"
        )


def current_slice() -> VirtualSlice | None:
    """The innermost slice entered with ``with slice:`` on this thread, if any."""
    return cast("VirtualSlice | None", context.current_slice())  # only VirtualSlices enter


def on_slice_mesh(slice_: VirtualSlice) -> contextlib.AbstractContextManager[None]:
    """The slice's meshes, abstract and physical, as the only ones in JAX's context.

    Code placed on the slice names its mesh (``shard_map(mesh=slice.mesh)``,
    bare specs in sharding constraints). Where such code runs as ``jax.jit``
    (under the caller's ``grad``, ``jit`` or ``vmap``, or lowered with
    ``lower``), this gives it the slice's devices, in the slice's order, as
    ``jax.set_mesh(slice.physical_mesh)`` would; it also works inside a trace.
    """
    return only_mesh(slice_.mesh, slice_.physical_mesh)


def typed_for_caller(slice_: VirtualSlice, tree: object) -> object:
    """``tree``, its values typed on ``slice_``'s Explicit mesh retyped as the same layout on Auto axes.

    A program or ``pw.jit`` function on a slice with Explicit axes, called
    under the caller's ``grad``/``jit``/``vmap``, runs as ``jax.jit`` under the
    slice's mesh; its outputs then leave that mesh. Typed on it, they would
    ask for it in the caller's code: ``jax.grad`` seeds the output's
    cotangent there ("Length of device assignment 1 is not equal to the size
    of the mesh"), where under ``jax.set_mesh`` of the slice's mesh it has
    it. Retyped on Auto axes of the same devices and specs they keep their
    values and layout and need no mesh. A caller under that mesh itself gets
    them as they are.
    """
    if AxisType.Explicit not in slice_.axis_types or jax.sharding.get_abstract_mesh() == slice_.mesh:
        return tree
    physical = slice_.physical_mesh
    auto = Mesh(physical.devices, physical.axis_names, axis_types=(AxisType.Auto,) * len(physical.axis_names))

    def retyped(leaf: object) -> object:
        if not isinstance(leaf, jax.Array):  # tracers are jax.Arrays too
            return leaf
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh != slice_.mesh:
            return leaf
        spec = PartitionSpec(*sharding.spec)
        # Its source named on the slice's physical mesh: inferred from its type (the abstract
        # mesh), the move's transpose under the caller's vmap of grad had no devices to go to.
        return jax.device_put(leaf, NamedSharding(auto, spec), src=NamedSharding(physical, spec))

    return jax.tree_util.tree_map(retyped, tree)


def put_for_jit(tree: object, sharding: NamedSharding) -> object:
    """``tree`` put on ``sharding`` as a function run as ``jax.jit`` on a slice takes it under the caller's transformation.

    Its arrays are put there (replicated), so that the computation stays on
    the slice's devices, except uncommitted ones (``jnp`` results, under the
    caller's eager ``grad`` too), which ``jax.jit`` under the slice's mesh
    takes as they are and places itself. Put there, their cotangents under
    the caller's ``grad`` came back committed to the device the uncommitted
    array was on (``jax.device_put``'s transpose), and adding them to the
    other cotangents of the same value, on the slice's devices or the
    caller's mesh, failed ("incompatible devices").
    """

    def put(leaf: object) -> object:
        value = leaf.to_concrete_value() if isinstance(leaf, jax.core.Tracer) else leaf
        if isinstance(value, jax.Array) and not getattr(value, "committed", True):
            return leaf
        return jax.device_put(leaf, sharding)

    return jax.tree_util.tree_map(put, tree)


def moved_onto(slice_: VirtualSlice, tree: object) -> object:
    """``tree``, its arrays on other devices than ``slice_``'s as the call puts them there (abstract).

    A call moves such an array onto the slice, keeping its spec where it
    names the slice's axes and divides evenly, else replicated; ``lower``,
    ``trace`` and ``eval_shape`` (``jax.jit`` under the slice's mesh, which
    would refuse it: "incompatible devices") take a ``jax.ShapeDtypeStruct``
    of that sharding in its place.
    """
    devices = set(slice_.devices)
    mesh = slice_.physical_mesh
    sizes = dict(zip(slice_.axis_names, slice_.shape, strict=True))

    def moved(leaf: object) -> object:
        # Arrays, abstract ones and futures (whose sharding is known without waiting).
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding) or isinstance(leaf, jax.core.Tracer):
            return leaf
        if not getattr(leaf, "committed", True):  # jax.jit puts it anywhere, as the call does
            return leaf
        if sharding.device_set <= devices:
            return leaf
        shape = tuple(leaf.shape)  # type: ignore[attr-defined]  # an array's, or a future's
        spec = fitting_spec(sharding, sizes, shape)
        return jax.ShapeDtypeStruct(
            shape,
            leaf.dtype,  # type: ignore[attr-defined]
            sharding=NamedSharding(mesh, spec),
            weak_type=bool(getattr(leaf, "weak_type", False)),
        )

    return jax.tree_util.tree_map(moved, tree)


def placement_of(slices: Sequence[VirtualSlice]) -> Placement:
    """Where ``slices`` (every slice a graph names) are now, as the plain data lowering is given."""
    if not slices:
        return NOWHERE
    cluster = slices[0].cluster
    where = {s.id: Placed(s.ref, s.physical_mesh, s.island) for s in slices}
    budget = cluster.store.budget
    return Placement(
        where,
        Target.of(cluster.backend),
        dict(budget.limits) if budget is not None else None,
        cluster.executables,
    )


def still_placed(slices: Sequence[VirtualSlice]) -> Callable[[], bool]:
    """A check that ``slices`` are where they are now: none released or moved since.

    Made before their placement is read, so that a move in between makes the
    check fail, never pass. Asked on every call of a plan: an unchanged
    mapping epoch answers it.
    """
    if not slices:
        return _always
    cluster = slices[0].cluster
    mapping = tuple((s, s.devices) for s in slices)
    epoch = cluster.mapping_epoch

    def current() -> bool:
        nonlocal epoch
        if cluster.mapping_epoch == epoch:
            return True  # nothing was released or remapped since the last look
        held = all(s._devices is devices and not s.released for s, devices in mapping)
        if held:
            epoch = cluster.mapping_epoch
        return held

    return current


def _always() -> bool:
    return True


def explicit_view(
    slice_: VirtualSlice | None, sharding: object, shape: tuple[int, ...]
) -> NamedSharding | None:
    """How a value with ``sharding`` looks to code traced on an Explicit-axes slice.

    ``None`` on slices without Explicit axes (types there carry no sharding).
    A value from another mesh (the user's, another slice's) is seen with its
    spec when that spec names the slice's axes and fits, else replicated: it
    is moved onto the slice that way when the program runs.
    """
    if slice_ is None or AxisType.Explicit not in slice_.axis_types:
        return None
    sizes = dict(zip(slice_.axis_names, slice_.shape, strict=True))
    return NamedSharding(slice_.mesh, fitting_spec(sharding, sizes, shape))


def _normalise_device_ids(device_ids: object, shape: tuple[int, ...]) -> object:
    """``device_ids`` as a flat list of ints in row-major mesh order, where it is ids in another form.

    A ``jax.sharding.Mesh``'s ``device_ids`` (a NumPy array in the mesh's
    shape), a nested list of that shape, or NumPy integer ids
    (``list(mesh.device_ids.flat)``) name devices as a list of ints does.
    Anything else is left for the resource manager's checks to refuse.
    """
    if device_ids is None or isinstance(device_ids, str | bytes):
        return device_ids
    nested = isinstance(device_ids, np.ndarray) or (
        isinstance(device_ids, Sequence)
        and any(isinstance(i, np.ndarray | Sequence) and not isinstance(i, str | bytes) for i in device_ids)
    )
    if nested:
        try:
            grid = np.asarray(device_ids, dtype=object)
        except ValueError:  # ragged: refused below as ids that are not ids
            return device_ids
        if grid.ndim > 1 and grid.shape != shape:
            raise errors.ResourceError(
                f"device_ids has shape {grid.shape}, but the mesh's is {shape}; give the ids flat, in "
                "row-major mesh order, or in the mesh's shape (as a jax.sharding.Mesh's device_ids)."
            )
        device_ids = list(grid.reshape(-1))
    if not isinstance(device_ids, Sequence):
        return device_ids
    for i in device_ids:
        if isinstance(i, jax.Device):
            raise errors.ResourceError(
                f"device_ids names the device {i!r}; it takes device ids: pass [d.id for d in devices] "
                "(or a mesh's device_ids)."
            )
    return [int(i) if isinstance(i, np.integer) else i for i in device_ids]


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


def devices(
    mesh: Mapping[str, int] | Sequence[int],
    *,
    island: int | None = None,
    exclusive: bool = False,
    timeout: float | None = None,
    device_ids: Sequence[int] | np.ndarray | None = None,
    axis_types: AxisType | Sequence[AxisType] | None = None,
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
        takes). A shared slice waits only while devices are reserved by
        exclusive slices; an exclusive one also while shared slices use them
        (those this thread holds too: release them first, or give a timeout).
      device_ids: the devices to map the slice onto, one id per mesh
        position in row-major order (all on one island), instead of letting
        the resource manager choose; or the ids in the mesh's shape (a
        ``jax.sharding.Mesh``'s ``device_ids``: NumPy integers are ids). Two slices may name the same devices in
        different orders; the controller still orders every program on them
        consistently. If the island's host is lost (Ray backend), the slice
        moves to devices the resource manager picks.
      axis_types: a ``jax.sharding.AxisType`` for every axis, or one per axis
        (as in ``jax.make_mesh``); default ``Auto``. With ``Explicit`` axes,
        code traced on the slice carries shardings in its types
        (``jax.typeof(x).sharding``) and may call ``jax.sharding.reshard``,
        as under ``jax.set_mesh`` of an explicit mesh. Slices with different
        axis types may share devices.

    Returns:
      A :class:`VirtualSlice`.

    Raises:
      ResourceError: an argument of the wrong type or out of range (e.g. a
        ``timeout`` that is NaN, infinite or negative), the request can never
        be met (more devices than any island has, an unknown island,
        ``device_ids`` that are unknown, repeated, of the wrong count or on
        several islands), ``axis_types`` of the wrong count or kind
        (``Manual`` included), or no devices freed up within ``timeout``.
      ClusterError: ``pw.shutdown()`` ended the cluster and ``pw.init`` was
        not called since.

    Example:
      >>> import pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 2})
      >>> len(s.devices)
      2
      >>> s.release()
    """
    shape, axis_names = _normalise_mesh(mesh)
    types = _normalise_axis_types(axis_types, axis_names)
    if not isinstance(exclusive, bool):
        raise errors.ResourceError(f"exclusive must be True or False, got {exclusive!r}.")
    if timeout is not None and not checks.is_seconds(timeout):
        raise errors.ResourceError(
            f"timeout must be None or a number >= 0, got {timeout!r} ({type(timeout).__name__}); give a "
            "finite number of seconds, or None to wait as long as it takes."
        )
    cl = clusters.cluster()
    size = int(np.prod(shape))
    named = _normalise_device_ids(device_ids, shape)
    island_index, physical, hold = cl.resources.acquire(size, island, exclusive, timeout, named)
    return VirtualSlice(cl, shape, axis_names, island_index, physical, exclusive, types, hold)


def is_implied(slice_: VirtualSlice, mesh: Mapping[str, int]) -> bool:
    """Whether ``slice_`` is the slice :func:`implied` gives for its devices and ``mesh`` (Auto axes); makes none."""
    if slice_.axis_names != tuple(mesh) or slice_.shape != tuple(mesh.values()):
        return False
    key = (tuple(d.id for d in slice_._devices), tuple(mesh.items()), None)
    return clusters.cluster().implied_slices.get(key) is slice_


def implied(
    device_ids: tuple[int, ...], mesh: Mapping[str, int], axis_types: tuple[AxisType, ...] | None = None
) -> VirtualSlice:
    """The shared slice a program with no placement runs on, for inputs on these devices.

    One slice per devices, mesh and axis types for the life of the cluster, so
    every call of such a program finds the same slice (and its cached plan).
    """
    cl = clusters.cluster()
    key = (device_ids, tuple(mesh.items()), axis_types)
    with cl.implied_lock:
        found = cl.implied_slices.get(key)
        if found is None or found.released:
            found = cl.implied_slices[key] = devices(
                mesh, device_ids=device_ids, axis_types=axis_types, timeout=0
            )
        return found
