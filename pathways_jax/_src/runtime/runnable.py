"""A lowered plan with what the runtime runs it with: its cluster, its outputs' slices, its check.

The compiler's :class:`~pathways_jax._src.compile.lowering.Plan` is plain
data. What a call of it needs of the live runtime (the cluster whose
controller and store take the run, the ``VirtualSlice`` each output's future
names, whether the slices are still where the plan was lowered for) is kept
here, made once per plan where the plan is lowered (:func:`lowered`) and
cached with it, so a call reads it without a lookup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pathways_jax._src.compile.lowering import Plan, Prepared
from pathways_jax._src.core import errors
from pathways_jax._src.runtime import context
from pathways_jax._src.runtime import controller as controller_lib
from pathways_jax._src.runtime import slices as slices_lib

if TYPE_CHECKING:
    from pathways_jax._src.ir.graph import Graph
    from pathways_jax._src.ir.signatures import Signature
    from pathways_jax._src.runtime.clusters import Cluster
    from pathways_jax._src.runtime.slices import VirtualSlice


@dataclasses.dataclass(frozen=True, slots=True)
class Runnable:
    """A plan as the runtime runs it.

    Attributes:
      plan: the compiled plan, its backend's part included.
      cluster: the cluster the plan runs on (None: it places nothing, and runs
        on whichever cluster is current).
      output_slices: the slice each output's future names, in output order
        (None: an output on no slice).
      is_current: False once a slice of the plan was released or moved: the
        plan must be lowered again.
    """

    plan: Plan
    cluster: Cluster | None
    output_slices: tuple[VirtualSlice | None, ...]
    is_current: Callable[[], bool]


def lowered(
    lower: Callable[..., Plan],
    graph: Graph,
    signature: Signature,
    held: Sequence[VirtualSlice],
    donated: frozenset[int],
) -> Runnable:
    """``lower`` applied to ``graph`` placed where ``held`` (every slice it names) are now, prepared by the backend.

    Raises:
      ClusterError: the cluster's backend answered ``prepare`` with something
        other than a ``Prepared`` record, or this process was forked from one
        running pathways_jax (JAX's runtime does not survive the fork).
    """
    # In a process forked from a running one JAX's compiler never returns: refused first.
    controller_lib.refuse_if_forked()
    current = slices_lib.still_placed(held)  # before the placement is read: a move in between fails it
    with context.lowering():  # its XLA compiles: the exit hook waits for them (a daemon thread's)
        plan = lower(graph, signature, slices_lib.placement_of(held), donated)
    if not held:  # it places nothing: no backend's part, no cluster of its own
        return Runnable(plan, None, (None,) * len(plan.outputs), current)
    cluster = held[0].cluster
    backend = cluster.backend
    # The compiler calls no backend: the backend's part is made here, a copy holds it.
    prepared = backend.prepare(plan)
    if not isinstance(prepared, Prepared):
        raise errors.ClusterError(
            f"backend {backend.name!r}: its prepare returned {type(prepared).__name__}, not a "
            "Prepared record (pathways_jax._src.backends.base.Prepared: the windows, islands, "
            "reports and the backend's own part of the plan); fix the backend"
        )
    by_id = {s.id: s for s in held}
    outputs = tuple(by_id[out.slice.id] if out.slice is not None else None for out in plan.outputs)
    return Runnable(plan.with_prepared(prepared), cluster, outputs, current)


__all__ = ["Runnable", "lowered"]
