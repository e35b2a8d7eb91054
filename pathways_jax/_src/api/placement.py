"""Where a program nothing places runs: the mesh or device ``jax.jit`` would pick, as a slice."""

from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import AxisType

from pathways_jax._src.core import arrays, errors
from pathways_jax._src.ir.signatures import ArgKey, ArrayKey
from pathways_jax._src.runtime import clusters, slices
from pathways_jax._src.runtime.slices import VirtualSlice


def _user_mesh() -> jax.sharding.Mesh | None:
    """The caller's ``jax.set_mesh`` mesh, if any (outside a JAX trace)."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside a JAX trace: only the abstract mesh is known
        return None
    return None if mesh.empty else mesh


def _mesh_mismatch_hint(exc: Exception, slice_: VirtualSlice | None) -> str:
    """What to do when the function names a mesh of its own inside a slice (JAX refuses that).

    ``slice_``: the slice the function was traced on (None: none, or not known here).
    """
    text = str(exc)
    if slice_ is not None and "should match the mesh passed to" in text:
        return (
            f". A function placed on slice {slice_!r} is traced against the slice's abstract mesh, "
            "not a physical one of yours: give shard_map mesh=slice.mesh (or "
            "jax.sharding.get_abstract_mesh()), and the slice the axis types your code expects "
            "(pw.devices(mesh=..., axis_types=...); jax.make_mesh makes Explicit axes by default)"
        )
    if "incompatible devices for jitted computation" in text and "context mesh" in text:
        ids = [[int(i) for i in found.split(",")] for found in re.findall(r"device ids \[([\d, ]+)\]", text)]
        context = re.search(r"context mesh with device ids \[([\d, ]+)\]", text)
        theirs = [i for i in ids if context is None or i != [int(d) for d in context.group(1).split(",")]]
        if context is not None and len(theirs) == 1:
            ours = [int(d) for d in context.group(1).split(",")]
            if sorted(ours) == sorted(theirs[0]):
                return (
                    f". Your mesh holds the slice's devices in another order (ids {theirs[0]}; the "
                    f"slice's are {ours}), and JAX takes one order per computation: name the slice's "
                    "mesh in shardings inside it (slice.mesh, or bare PartitionSpecs), build your mesh "
                    "in the slice's order (slice.physical_mesh), or map the slice as "
                    f"pw.devices(..., device_ids={theirs[0]})"
                )
        return (
            ". A function placed on a slice runs on the devices the slice is mapped to, not on "
            "those of a mesh of yours: name the slice's mesh in shardings inside it (slice.mesh, or "
            "bare PartitionSpecs), or map the slice onto your mesh's devices "
            "(pw.devices(..., device_ids=[...]))"
        )
    return ""


def _check_one_island(ids: tuple[int, ...], owner: str) -> None:
    """Refuses a mesh of yours that no slice can stand for: over devices of several islands, or not the cluster's.

    ``jax.jit`` would run the program on the whole mesh; a program runs each
    computation within one island, so it cannot, and running it on one device
    instead (as it did) returned values off the mesh that the caller's arrays
    on it then refused to combine with.
    """
    resources = clusters.cluster().resources
    island_of = {d.id: isl.index for isl in resources.islands for d in isl.devices}
    owners = sorted({island_of[i] for i in ids if i in island_of})
    unknown = [i for i in ids if i not in island_of]
    if len(owners) <= 1 and not unknown:
        return
    where = f"devices {unknown} this cluster does not use" if unknown else f"devices of islands {owners}"
    raise errors.PlacementError(
        f"{owner} runs where jax.jit would, on the mesh of its arguments (or of jax.set_mesh, "
        f"in_shardings or its own shardings): a mesh over devices {list(ids)}, which holds {where} "
        f"({resources.describe()}). A program runs each computation within one island. Make the "
        "mesh of one island's devices (jax.make_mesh(..., devices=pw.cluster().islands[i].devices)), "
        "start the cluster with one island (pw.init(islands=1)), or place the program on slices "
        "(pw.program(devices=pw.devices(...)))."
    )


def _mesh_slice(
    signature: tuple[ArgKey | None, ...], hint: jax.sharding.Mesh | None, owner: str = "the program"
) -> VirtualSlice | None:
    """The slice of the mesh ``jax.jit`` would run a program with no placement on, if any.

    ``hint`` (the mesh of the program's own ``in_shardings``, else the caller's
    ``jax.set_mesh`` mesh), of any size, wins; then the mesh of the first array
    argument on a mesh (``NamedSharding``), of one device too: ``jax.jit`` keeps
    an argument's mesh in its outputs' types and shardings (``float32[8@data]``
    on ``jax.make_mesh((1,), ("data",))``, a one-accelerator machine's mesh), and
    an output off that mesh does not combine with arrays on it. A one-device
    mesh of Auto axes named ``x`` is the slice ``_device_slice`` makes (a
    program's own outputs there): the same slice.
    """
    meshes = [
        hint,
        *(
            getattr(key.sharding, "mesh", None)
            for key in signature
            if key is not None and key.kind == "array"
        ),
    ]
    for mesh in meshes:
        if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
            ids = tuple(d.id for d in mesh.devices.flat)
            _check_one_island(ids, owner)
            shape = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
            types = tuple(mesh.axis_types)
            if shape == _DEVICE_MESH and types == (AxisType.Auto,):
                return slices.implied(ids, shape)  # _device_slice's: one slice for one device
            return slices.implied(ids, shape, types)
    return None


_DEVICE_MESH = {"x": 1}  # the mesh of the slice a program runs on for one device (_device_slice)


def _named_mesh(jaxpr: Any) -> jax.sharding.Mesh | None:
    """The first mesh a traced function names in its shardings, if any (of one device too).

    A ``shard_map``'s ``mesh=``, sharding constraints, inner ``jax.jit``
    shardings and ``jax.device_put`` targets, nested jaxprs included:
    the mesh ``jax.jit`` would run a function on when no argument is on a mesh,
    committing its outputs there (a one-device mesh as any other).
    """
    for eqn in jaxpr.eqns:
        mesh = eqn.params.get("mesh")  # a shard_map's own mesh=
        if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
            return mesh
        named = [eqn.params.get("sharding")]
        named += list(eqn.params.get("in_shardings", ()) or ()) + list(
            eqn.params.get("out_shardings", ()) or ()
        )
        if eqn.primitive.name == "device_put":  # jax.device_put(x, NamedSharding(...)) inside
            named += list(eqn.params.get("devices", ()) or ())
        for sharding in named:
            mesh = getattr(sharding, "mesh", None)
            if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
                return mesh
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's jaxpr, or a Jaxpr
                if hasattr(sub, "eqns"):
                    mesh = _named_mesh(sub)
                    if mesh is not None:
                        return mesh
    return None


def _device_slice(signature: tuple[ArgKey | None, ...]) -> VirtualSlice:
    """With no argument on a mesh: the first committed array argument's device, else JAX's default device.

    As ``jax.jit``: an array no one put on a device (a ``jnp`` result) follows
    the others, or JAX's default device (``jax.default_device``).
    """
    for key in signature:
        committed = isinstance(key, ArrayKey) and key.committed
        placed = getattr(key.sharding, "device_set", None) if committed else None  # type: ignore[union-attr]
        if placed and len(placed) == 1:
            return slices.implied((next(iter(placed)).id,), _DEVICE_MESH)
    return slices.implied((arrays.default_device().id,), _DEVICE_MESH)


def _is_device_slice(slice_: VirtualSlice) -> bool:
    """Whether ``slice_`` is one :func:`_device_slice` makes (one device, no mesh of the user's)."""
    return slices.is_implied(slice_, _DEVICE_MESH)


def _mesh_of(*shardings: Any) -> jax.sharding.Mesh | None:
    """The first concrete mesh named by a pytree of shardings (``in_shardings``/``out_shardings``)."""
    for leaf in jax.tree_util.tree_leaves(shardings):
        mesh = getattr(leaf, "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
            return mesh
    return None


def _single_device_of(*shardings: Any) -> jax.Device | None:
    """The device of the first ``SingleDeviceSharding`` in pytrees of shardings, if any."""
    for leaf in jax.tree_util.tree_leaves(shardings):
        if isinstance(leaf, jax.sharding.SingleDeviceSharding):
            return next(iter(leaf.device_set))
    return None
