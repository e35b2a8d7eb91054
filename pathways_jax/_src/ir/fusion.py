"""Chain fusion: consecutive nodes on one slice become one compiled node.

Programs fuse by default (``@pw.program(fuse=False)`` opts out): every run of
consecutive steps that are nodes on the same slice is compiled as one
executable, trading the graph's node-per-function structure for fewer
dispatches. A run ends after a node whose output another slice reads, so that
the transfer goes as soon as the value exists. Values the run makes and only the run
reads stay inside the executable; values read elsewhere (by a later node, a
transfer or the program's outputs) become outputs of the fused node, so results
are exactly those of the unfused program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend.core as jex
from jax.sharding import AxisType, NamedSharding

from pathways_jax._src.core.meshes import only_mesh
from pathways_jax._src.ir.graph import Graph, Node, Step


def _group_runs(graph: Graph) -> list[list[int] | Step]:
    """The steps, with consecutive same-slice node steps gathered into lists.

    A run ends after a node whose output another slice reads (through a
    transfer): that slice must not wait for the rest of the chain.
    """
    leaving = {t.value for t in graph.transfers}  # values another slice reads
    out: list[list[int] | Step] = []
    open_run = False
    for kind, index in graph.steps:
        if kind == "node":
            node = graph.nodes[index]
            last = out[-1] if out else None
            if open_run and isinstance(last, list) and graph.nodes[last[-1]].slice is node.slice:
                last.append(index)
            else:
                out.append([index])
            open_run = not leaving.intersection(node.outputs)
        else:
            out.append((kind, index))
            open_run = False
    return out


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _typed(aval: Any) -> bool:
    """Whether ``aval``'s type names a mesh."""
    sharding = getattr(aval, "sharding", None)
    return isinstance(sharding, NamedSharding) and not sharding.mesh.empty


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    # On Explicit axes a sharding is part of the type; elsewhere types carry none.
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, NamedSharding) or AxisType.Explicit not in sharding.mesh.axis_types:
        sharding = None
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False), sharding=sharding
    )


def _fuse_nodes(graph: Graph, members: list[Node], read_outside: set[int]) -> Node:
    produced = {vid for m in members for vid in m.outputs}
    inputs: list[int] = []
    in_specs: list[Any] = []
    donated: dict[int, bool] = {}  # an input stays donated if every member reading it donates it
    for m in members:
        for vid, spec, gives in zip(m.inputs, m.in_specs, m.donated, strict=True):
            if vid not in produced and vid not in inputs:
                inputs.append(vid)
                in_specs.append(spec)
            if vid not in produced:
                donated[vid] = donated.get(vid, True) and gives
    outputs: list[int] = []
    out_specs: list[Any] = []
    for m in members:
        for vid, spec in zip(m.outputs, m.out_specs, strict=True):
            if vid in read_outside:
                outputs.append(vid)
                out_specs.append(spec)
    functions = [(m, jex.jaxpr_as_fun(m.jaxpr)) for m in members]
    mesh = members[0].slice.mesh
    avals = [graph.values[v].aval for v in inputs]
    # Values no mesh types on a slice of Explicit axes (traced as jax.jit traces a call no mesh
    # types): the fused computation is traced with no mesh too, and its specs reshard there.
    untyped = AxisType.Explicit in mesh.axis_types and not any(
        _typed(a) for a in avals or members[0].jaxpr.out_avals
    )

    def constrain(value: Any, spec: Any) -> Any:
        # A member's placement specs still hold inside the fused executable.
        if spec is None:
            return value
        if untyped:
            return jax.sharding.reshard(value, NamedSharding(mesh, spec))
        return jax.lax.with_sharding_constraint(value, spec)

    def fused(*args: Any) -> list[Any]:
        env = dict(zip(inputs, args, strict=True))
        for m, fun in functions:
            ins = [
                constrain(env[v], spec) if v in produced else env[v]
                for v, spec in zip(m.inputs, m.in_specs, strict=True)
            ]
            outs = fun(*ins)
            env.update(
                (v, constrain(out, spec)) for v, out, spec in zip(m.outputs, outs, m.out_specs, strict=True)
            )
        return [env[v] for v in outputs]

    with only_mesh(_NO_MESH if untyped else mesh):
        closed = jax.make_jaxpr(fused)(*(_struct(a) for a in avals))
    first = members[0]
    return Node(
        name=f"{first.name}+{len(members) - 1}",
        kind="fused",
        slice=first.slice,
        jaxpr=closed,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        donated=tuple(donated[v] for v in inputs),
        source_info=first.source_info,
    )


def fuse(graph: Graph) -> Graph:
    """Returns ``graph`` with each chain of consecutive same-slice nodes fused into one."""
    runs = _group_runs(graph)
    if all(not isinstance(r, list) or len(r) == 1 for r in runs):
        return graph
    nodes: list[Node] = []
    steps: list[Step] = []
    returned = {o.value for o in graph.outputs if o.value is not None}
    for position, run in enumerate(runs):
        if not isinstance(run, list):
            steps.append(run)
            continue
        if len(run) == 1:
            nodes.append(graph.nodes[run[0]])
        else:
            members = [graph.nodes[i] for i in run]
            read_outside = set(returned)
            for later in runs[position + 1 :]:
                if isinstance(later, list):
                    read_outside.update(v for i in later for v in graph.nodes[i].inputs)
                elif later[0] == "transfer":
                    read_outside.add(graph.transfers[later[1]].value)
            nodes.append(_fuse_nodes(graph, members, read_outside))
        steps.append(("node", len(nodes) - 1))
    return dataclasses.replace(graph, nodes=tuple(nodes), steps=tuple(steps)).check()
