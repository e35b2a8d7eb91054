"""Where a graph runs, as plain data: what lowering is given instead of live slices.

Lowering reads the devices and island of each of a graph's slices, and what
the backend can do, from a :class:`Placement` the runtime makes for it
(``runtime.slices.placement_of``). It never reads a slice, the cluster or the
backend itself, so the same graph and placement lower to the same plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh

from pathways_jax._src.compile.executable_cache import ExecutableCache
from pathways_jax._src.ir.graph import SliceRef, TransferKind, transfer_kind


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """What lowering needs to know of the backend a plan runs on.

    Attributes:
      name: the backend's name (``pw.init(backend=...)``), for errors.
      donates: executables may consume donated buffers.
      exports: nodes are also serialized with ``jax.export`` (hosts compile them).
      calls_back: nodes may call back into Python on the host.
      stages_inputs: under a memory budget, a queued run's host inputs stay on the host.
      export_platforms: the platforms exported nodes are serialized for (None: this process's).
    """

    name: str
    donates: bool
    exports: bool
    calls_back: bool
    stages_inputs: bool
    export_platforms: tuple[str, ...] | None = None

    @classmethod
    def of(cls, backend: Any) -> Target:
        """The target of a backend (``backends.base.Backend``)."""
        platforms = getattr(backend, "export_platforms", None)
        return cls(
            backend.name,
            bool(backend.donates),
            bool(backend.exports),
            bool(backend.calls_back),
            bool(backend.stages_inputs),
            tuple(platforms) if platforms is not None else None,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """One slice of a graph where it is now: its physical mesh and island.

    Attributes:
      ref: the slice, as the graph names it.
      mesh: its devices now.
      island: its island now.
    """

    ref: SliceRef
    mesh: Mesh
    island: int


@dataclasses.dataclass(frozen=True, slots=True, weakref_slot=True)
class Placement:
    """Where a graph's slices are, and what runs them.

    Attributes:
      slices: each slice of the graph by id, placed.
      target: the backend (None: a graph that places nothing runs nowhere).
      limits: the memory budget, bytes per device id (None: no budget).
      executables: the compiled executables plans of this cluster share.

    Whether a placement still holds (no slice released or moved since) only
    the runtime can tell: it keeps that check beside the plan it lowers
    (``runtime.runnable.Runnable``), as it keeps the cluster and slices.
    """

    slices: Mapping[int, Placed]
    target: Target | None = None
    limits: Mapping[int, int] | None = None
    executables: ExecutableCache | None = None

    def kind(self, src: int, dst: int) -> TransferKind:
        """The kind of a transfer between two slices (by id): within an island or across."""
        return transfer_kind(self.slices[src].island, self.slices[dst].island)

    def device_ids(self, slice_id: int) -> tuple[int, ...]:
        """The ids of a slice's devices, in mesh order."""
        return tuple(d.id for d in self.slices[slice_id].mesh.devices.flat)


NOWHERE = Placement({})
"""The placement of a graph with no slices (it returns literals or its arguments)."""


__all__ = ["NOWHERE", "Placed", "Placement", "Target"]
