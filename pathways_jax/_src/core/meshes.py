"""Mesh helpers: the meshes in JAX's context, and how a PartitionSpec splits a shape."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import numpy as np
from jax._src import config as jax_config
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

_NO_MESH = Mesh(np.empty((), dtype=object), ())


@contextlib.contextmanager
def only_mesh(abstract: AbstractMesh, concrete: Mesh | None = None) -> Iterator[None]:
    """Makes ``abstract`` (and ``concrete``, or no concrete mesh) the only meshes in context.

    Whatever mesh the caller set (``jax.set_mesh``, ``use_abstract_mesh``, of any
    size) is set aside, and restored on exit: the slice's mesh wins inside a
    program. Unlike ``jax.sharding.use_abstract_mesh`` it may change the mesh's
    size, and unlike ``jax.set_mesh`` it works inside a trace.
    """
    prev_abstract = jax_config.abstract_mesh_context_manager.swap_local(abstract)
    prev_concrete = jax_config.device_context.swap_local(_NO_MESH if concrete is None else concrete)
    try:
        yield
    finally:
        jax_config.abstract_mesh_context_manager.set_local(prev_abstract)
        jax_config.device_context.set_local(prev_concrete)


def fitting_spec(sharding: object, sizes: Mapping[str, int], shape: tuple[int, ...]) -> PartitionSpec:
    """``sharding``'s spec if it splits ``shape`` evenly over axes of these sizes, else ``P()``."""
    if isinstance(sharding, NamedSharding):
        parts = spec_parts(sharding.spec, sizes)
        if (
            parts is not None
            and len(parts) <= len(shape)
            and all(dim % count == 0 for dim, count in zip(shape, parts, strict=False))
        ):
            return sharding.spec
    return PartitionSpec()


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


__all__ = ["fitting_spec", "only_mesh", "spec_parts"]
