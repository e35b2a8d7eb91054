"""``pw.sim.predict``: a traced program on a simulated cluster.

The program is traced (not lowered or compiled: nothing runs on this
machine's devices), and its graph becomes a :class:`SimProgram`: each slice is
placed on the simulated cluster (keeping its share of its island, by
default), and each node's device time is worked out from its jaxpr (flops,
bytes and collectives, against the profile's rates) unless given.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax.extend.core as jex
import numpy as np

from pathways_jax import errors
from pathways_jax._src.api.decorator import program as make_program
from pathways_jax._src.api.graph_view import GraphView, NodeView
from pathways_jax._src.api.placed_jit import JitFunction
from pathways_jax._src.api.tracing import Program
from pathways_jax.sim._cluster import SimCluster
from pathways_jax.sim._engine import simulate
from pathways_jax.sim._results import SimResult
from pathways_jax.sim._workload import PREVIOUS_RUN, SimProgram, Step, Workload

_COLLECTIVES = (
    "psum",
    "all_gather",
    "all_to_all",
    "ppermute",
    "psum_scatter",
    "reduce_scatter",
    "pmax",
    "pmin",
)


def _nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    return int(np.prod(shape, dtype=np.int64)) * (dtype.itemsize if dtype is not None else 4)


@dataclasses.dataclass(slots=True)
class _Work:
    flops: float = 0.0
    collective_bytes: list[int] = dataclasses.field(default_factory=list)


def _walk(jaxpr: Any, work: _Work) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        out = sum(int(np.prod(getattr(v.aval, "shape", ()), dtype=np.int64)) for v in eqn.outvars)
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = int(np.prod([lhs[d] for d in contract], dtype=np.int64)) if contract else 1
            work.flops += 2.0 * out * k
        elif name.startswith(_COLLECTIVES):
            work.collective_bytes.append(sum(_nbytes(v.aval) for v in eqn.invars))
        else:
            work.flops += out
        for sub in jex.jaxprs_in_params(eqn.params):
            _walk(sub, work)


def estimate_node_time(node: NodeView, cluster: SimCluster, devices: int) -> float:
    """Device time of a graph node on ``devices`` devices, from its jaxpr and the profile.

    ``launch + max(flops, bytes over the rates) / devices + ICI all-reduce per collective``:
    a roofline estimate (the work assumed split evenly over the devices).
    """
    prof = cluster.profile
    jaxpr = node.jaxpr.jaxpr if hasattr(node.jaxpr, "jaxpr") else node.jaxpr
    work = _Work()
    _walk(jaxpr, work)
    nbytes = sum(_nbytes(a) for a in (*node.jaxpr.in_avals, *node.jaxpr.out_avals))
    compute = max(work.flops / prof.device.flops_per_s, nbytes / prof.device.bytes_per_s) / devices
    collectives = sum(prof.ici.all_reduce(b, devices) for b in work.collective_bytes)
    return prof.device.launch(devices) + compute + collectives


def _placement(graph: GraphView, cluster: SimCluster, mode: str) -> dict[int, tuple[int, int]]:
    """Each slice's ``[start, stop)`` devices on the simulated cluster, packed per island."""
    placed: dict[int, tuple[int, int]] = {}
    for s in graph.slices:  # the runtime's, where they are now
        island = s.island % cluster.islands
        lo, hi = cluster.island_devices(island)
        if mode == "scale":
            try:
                real = len(s.cluster.islands[s.island].devices)
            except (AttributeError, IndexError):
                real = s.size
            size = max(1, round(s.size * (hi - lo) / max(real, 1)))
        else:
            size = s.size
        if size > hi - lo:
            raise errors.ResourceError(
                f"slice #{s.id} of {s.size} devices does not fit island {island} of the simulated cluster "
                f"({hi - lo} devices); use placement='scale' or a bigger pw.sim.SimCluster."
            )
        # Slices share the island from its start (as pw.devices hands them out, here without exclusivity).
        placed[s.id] = (lo, lo + size)
    return placed


def from_graph(
    graph: GraphView,
    cluster: SimCluster,
    *,
    node_times: Mapping[str, float] | Callable[[NodeView, int], float] | None = None,
    placement: Literal["scale", "keep"] = "scale",
) -> SimProgram:
    """A traced ``pw.Graph`` as a :class:`SimProgram` on ``cluster``.

    Args:
      graph: ``program.graph(*args)``.
      cluster: the simulated cluster.
      node_times: device seconds per node, by node name or as a function of
        ``(node, devices)``; nodes not named are estimated from their jaxpr.
      placement: ``"scale"``: a slice keeps its share of its island (a slice
        of all 8 devices of this machine spans a whole simulated island);
        ``"keep"``: a slice keeps its device count.

    Raises:
      ResourceError: a slice does not fit, or ``placement`` is unknown.
    """
    if placement not in ("scale", "keep"):
        raise errors.ResourceError(f"placement must be 'scale' or 'keep', got {placement!r}.")
    placed = _placement(graph, cluster, placement)
    made: dict[int, int] = {}  # value id -> the step that makes it
    steps: list[Step] = []
    prof = cluster.profile

    def inputs_of(values: tuple[int, ...]) -> tuple[int, ...]:
        found = {made.get(v, PREVIOUS_RUN) for v in values}
        return tuple(sorted(found))

    for kind, index in graph.steps:
        if kind == "node":
            node = graph.nodes[index]
            lo, hi = placed[node.slice.id]
            n = hi - lo
            if callable(node_times):
                dur = float(node_times(node, n))
            elif node_times is not None and node.name in node_times:
                dur = prof.device.launch(n) + float(node_times[node.name])
            else:
                dur = estimate_node_time(node, cluster, n)
            steps.append(
                Step("node", node.name, (lo, hi), dur, inputs=inputs_of(node.inputs), windowed=n > 1)
            )
            for v in node.outputs:
                made[v] = len(steps) - 1
        else:
            t = graph.transfers[index]
            nbytes = _nbytes(graph.values[t.value].aval)
            dst, src = placed[t.dst.id], placed[t.src.id]
            if t.kind == "dcn":
                hosts = max(1, (dst[1] - dst[0]) // cluster.devices_per_host)
                dur = prof.dcn.transfer(nbytes, parallel=hosts)
            else:
                dur = prof.ici.transfer(nbytes)
            steps.append(
                Step(
                    "transfer",
                    f"v{t.value}",
                    dst,
                    dur,
                    inputs=inputs_of((t.value,)),
                    src=src,
                    link=t.kind,
                    nbytes=nbytes,
                )
            )
            made[t.output] = len(steps) - 1
    if not steps:
        raise errors.ResourceError(f"program {graph.name!r} has no nodes to simulate.")
    outs = [made[o.value] for o in graph.outputs if o.value is not None and o.value in made]
    return SimProgram(graph.name, tuple(steps), output=max(outs) if outs else len(steps) - 1).check(cluster)


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    """What ``pw.sim.predict`` says a program would do on a cluster.

    Attributes:
      step_time_s: seconds per call in the steady state.
      utilisation: fraction of the cluster's device time busy.
      throughput: calls per second.
      timeline: the trace-event JSON (what ``pw.trace`` writes; ``pw.plot_timeline`` draws it).
      program: the simulated program.
      cluster: the simulated cluster.
      result: the full :class:`SimResult`.
    """

    step_time_s: float
    utilisation: float
    throughput: float
    timeline: dict
    program: SimProgram
    cluster: SimCluster
    result: SimResult

    def save_timeline(self, path: str | os.PathLike) -> None:
        """Writes the timeline as trace-event JSON (ui.perfetto.dev opens it)."""
        with open(os.fspath(path), "w") as f:
            json.dump(self.timeline, f)

    def plot(self, out: str | os.PathLike | None = None, **kwargs: Any) -> Any:
        """Draws the timeline with ``pw.plot_timeline`` (needs matplotlib)."""
        from pathways_jax._src.views.plotting import plot_timeline

        kwargs.setdefault("title", f"{self.program.name} on {self.cluster!r} (simulated)")
        return plot_timeline(self.timeline, out, **kwargs)

    def __repr__(self) -> str:
        return (
            f"Prediction({self.program.name!r}: step {self.step_time_s * 1e3:.3f} ms, "
            f"utilisation {self.utilisation:.1%}, on {self.cluster!r})"
        )


def predict(
    program: Program | JitFunction | GraphView | SimProgram,
    *args: Any,
    cluster: SimCluster,
    runs: int = 8,
    node_times: Mapping[str, float] | Callable[[NodeView, int], float] | None = None,
    placement: Literal["scale", "keep"] = "scale",
    chained: bool = True,
    max_tracks: int = 16,
    **kwargs: Any,
) -> Prediction:
    """Predicts a program's step time, device utilisation and timeline on a simulated cluster.

    The program is traced with ``*args, **kwargs`` (nothing is compiled or run)
    and called ``runs`` times back to back, each call reading the one before's
    output when ``chained`` (a training loop).

    Args:
      program: a ``@pw.program``, a ``pw.jit`` function, a traced ``pw.Graph``
        or a :class:`SimProgram`.
      *args: the program's arguments (arrays, or ``jax.ShapeDtypeStruct``-like values it accepts).
      cluster: the simulated :class:`SimCluster`.
      runs: calls to simulate (the steady state is measured after the first quarter).
      node_times: device seconds per node (see :func:`from_graph`).
      placement: how slices map onto the cluster (see :func:`from_graph`).
      chained: each call reads the previous call's output.
      max_tracks: devices drawn in the timeline.
      **kwargs: the program's keyword arguments.

    Returns:
      A :class:`Prediction`.

    Raises:
      ProgramTraceError: ``program`` is not something that can be traced.
      ResourceError: a slice does not fit the cluster, or ``runs`` < 1.
    """
    if not isinstance(cluster, SimCluster):
        raise errors.ResourceError(
            f"predict needs cluster=pw.sim.SimCluster(...), got {type(cluster).__name__}."
        )
    if isinstance(program, JitFunction):
        fn = program
        program = make_program(lambda *a, **k: fn(*a, **k), name=getattr(fn, "__name__", "jit"))
    if isinstance(program, Program):
        sim_program = from_graph(
            program.graph(*args, **kwargs), cluster, node_times=node_times, placement=placement
        )
    elif isinstance(program, GraphView):
        sim_program = from_graph(program, cluster, node_times=node_times, placement=placement)
    elif isinstance(program, SimProgram):
        sim_program = program.check(cluster)
    else:
        raise errors.ProgramTraceError(
            f"pw.sim.predict simulates a @pw.program, a pw.jit function, a pw.Graph or a pw.sim.SimProgram; "
            f"got {type(program).__name__}."
        )
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise errors.ResourceError(f"predict: runs must be an integer >= 1, got {runs!r}.")
    result = simulate(
        cluster, Workload(sim_program, runs=runs, chained=chained), record=True, max_tracks=max_tracks
    )
    assert result.trace is not None
    step = result.step_time_s
    return Prediction(
        step_time_s=step,
        utilisation=result.utilisation,
        throughput=1.0 / step if step > 0 else math.inf,
        timeline=result.trace,
        program=sim_program,
        cluster=cluster,
        result=result,
    )
