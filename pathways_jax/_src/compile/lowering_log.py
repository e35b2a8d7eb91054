"""What lowering tells: its compiles, lowerings and remaps, logged and sent to the trace.

Logged through ``absl.logging`` at ``vlog(1)`` whether or not a trace is
recorded (absl's ``--v=1``, or ``absl.logging.set_verbosity("debug")``,
shows them; compiles are not news worth an INFO line), and handed to the
trace's sink (``core.events``) as :class:`~pathways_jax._src.core.events.Compiled`,
:class:`~pathways_jax._src.core.events.Lowered` and
:class:`~pathways_jax._src.core.events.Remapped` when a trace is recorded.
"""

from __future__ import annotations

import weakref

from absl import logging

from pathways_jax._src.compile.placement import Placement
from pathways_jax._src.core import events
from pathways_jax._src.ir.graph import Graph, Node

__all__ = ["compiled", "lowered"]

_BySlice = dict[int, tuple[int, ...]]  # slice id -> device ids

# id(graph) -> the placement it was last lowered onto (weakly) and that placement's devices by slice.
_last: dict[int, tuple[weakref.ref[Placement], _BySlice]] = {}
_KEPT = 256


def compiled(node: Node, start: int) -> None:
    """``node`` was compiled, from ``start`` until now."""
    end = events.now()
    logging.vlog(
        1,
        "compiled node %r (%s) for slice #%d in %.1f ms",
        node.name,
        node.source_info,
        node.slice.id,
        (end - start) / 1e6,
    )
    sink = events.SINK
    if sink is not None:
        sink(events.Compiled(node.name, node.source_info, node.slice.id, start, end))


def lowered(graph: Graph, placement: Placement, start: int) -> None:
    """``graph`` was lowered onto ``placement``, from ``start`` until now; tells a remap apart."""
    end = events.now()
    key = id(graph)
    # The plan's placement, not the plan: a plan is copied once its backend prepares it (the
    # copy shares the placement), and a graph's plans all live while its placement does.
    previous = _last.get(key)
    mapping = {slice_id: placement.device_ids(slice_id) for slice_id in placement.slices}
    _last[key] = (weakref.ref(placement), mapping)
    if len(_last) > _KEPT:
        for k in [k for k, (ref, _) in _last.items() if ref() is None]:
            del _last[k]
    sink = events.SINK
    if previous is not None and previous[0]() is not None:  # that graph's placement still lives
        before = previous[1]
        moved = {sid: (before.get(sid), devs) for sid, devs in mapping.items() if before.get(sid) != devs}
        logging.vlog(
            1,
            "program %r (%s) re-lowered after a remap: %s",
            graph.name,
            graph.source_info,
            "; ".join(f"slice #{sid} {a} -> {b}" for sid, (a, b) in moved.items()) or "no change",
        )
        if sink is not None:
            sink(events.Remapped(graph.name, moved, end))
    else:
        logging.vlog(
            1,
            "program %r (%s): lowered %d nodes onto devices %s in %.1f ms",
            graph.name,
            graph.source_info,
            len(graph.nodes),
            mapping,
            (end - start) / 1e6,
        )
    if sink is not None:
        sink(events.Lowered(graph.name, len(graph.nodes), start, end))
