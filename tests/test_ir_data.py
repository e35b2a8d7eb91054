"""The traced graph is plain data: it names slices by frozen ``SliceRef`` s, never the runtime's.

Where a slice is (its island, its devices) is the placement's: a graph does not
change when a slice moves, and lowering it with the new placement gives the
new transfer kinds. ``program.graph(x)`` shows users the slices where they are now.
"""

import contextlib
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

import pathways_jax as pw
from pathways_jax._src.backends import base as backends_base
from pathways_jax._src.compile import lowering, steps
from pathways_jax._src.ir import graph as ir_graph
from pathways_jax._src.runtime import clusters as clusters_lib
from pathways_jax._src.runtime import slices as slices_lib


def _reachable(root):
    """Every object reachable from ``root`` through dataclass fields, tuples, lists and dicts."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found.append(obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        elif isinstance(obj, tuple | list | set | frozenset):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
    return found


def _two_islands(fuse=False):
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    f = pw.jit(lambda v: v * 2, devices=a)
    g = pw.jit(lambda v: v.sum(), devices=b)
    step = pw.program(lambda v: g(f(v)), fuse=fuse)
    return a, b, step


def test_no_virtual_slice_is_reachable_from_a_traced_graph():
    """Nodes, values and transfers (glue, fused nodes and future inputs included) hold
    ``SliceRef`` s: the graph a program lowers holds nothing of the runtime."""
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    f = pw.jit(lambda v: v * 2, devices=a)
    g = pw.jit(lambda v: v.sum(), devices=b)

    @pw.program
    def step(x, y):
        with b:
            z = jnp.sin(y) + 1  # glue on b, reading a future of b
        return g(f(x) + 1) + z.sum()

    y = pw.program(lambda v: v + 1, devices=b)(jnp.ones(4))
    x = jnp.arange(4.0)
    np.testing.assert_allclose(
        step(x, y).result(), (x * 2 + 1).sum() + (jnp.sin(jnp.ones(4) + 1) + 1).sum(), rtol=1e-6
    )
    view = step.graph(x, y)
    graph = getattr(view, "ir", view)  # the graph itself, as lowering is given it
    assert graph.transfers and any(v.slice is not None for v in graph.values)
    reached = _reachable(graph)
    assert not [o for o in reached if isinstance(o, pw.VirtualSlice)]
    refs = {o for o in reached if isinstance(o, ir_graph.SliceRef)}
    assert refs == {a.ref, b.ref}
    plan = next(iter(step._plans.values())).plan
    assert plan.graph is graph
    assert not [o for o in _reachable(plan.outputs) if isinstance(o, pw.VirtualSlice)]
    # What users read is the runtime's slices, where they are now.
    assert [n.slice for n in view.nodes][-1] is b and view.transfers[0].src is a
    assert step(x, y).slice is b


def _runtime_objects(root):
    """The runtime objects (a ``Cluster``, a ``VirtualSlice``, a backend, anything of the runtime's
    modules) reachable from ``root``: through dataclass fields, attributes and slots of the
    library's objects, tuples, lists, sets, dicts, and the closures and bound ``self`` of functions."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, str | int | float | bool | type):
            continue
        seen.add(id(obj))
        module = type(obj).__module__ or ""
        if isinstance(
            obj, clusters_lib.Cluster | pw.VirtualSlice | backends_base.Backend
        ) or module.startswith("pathways_jax._src.runtime"):
            found.append(obj)
            continue
        if isinstance(obj, tuple | list | set | frozenset):
            stack.extend(obj)
        elif isinstance(obj, dict | types.MappingProxyType):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, types.FunctionType | types.MethodType | functools.partial):
            stack.append(getattr(obj, "__self__", None))
            for cell in getattr(obj, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    stack.append(cell.cell_contents)
            if isinstance(obj, functools.partial):
                stack.extend((obj.func, obj.args, obj.keywords))
        elif module.startswith("pathways_jax"):  # the library's own records: their fields and attributes
            if dataclasses.is_dataclass(obj):
                stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for klass in type(obj).__mro__:
                for name in getattr(klass, "__slots__", ()):
                    stack.append(getattr(obj, name, None))
    return found


def test_nothing_of_the_runtime_is_reachable_from_a_compiled_plan():
    """A plan is plain data: neither the plan lowering returns nor the one a program runs (its
    backend's part included) reaches the cluster, a ``VirtualSlice`` or the backend. The runtime
    keeps those beside the plan, once per plan: the program's cache holds them together."""
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    f = pw.jit(lambda v: v * 2, devices=a)
    g = pw.jit(lambda v: v.sum(), devices=b)

    @pw.program(fuse=False)
    def step(x, y):
        with b:
            z = jnp.sin(y) + 1  # glue on b, reading a future of b
        return g(f(x) + 1), z.sum(), x  # an argument returned as it is, too

    y = pw.program(lambda v: v + 1, devices=b)(jnp.ones(4))
    x = jnp.arange(4.0)
    out = step(x, y)
    np.testing.assert_allclose(out[0].result(), (x * 2 + 1).sum())
    (kept,) = step._plans.values()
    run = getattr(kept, "plan", kept)  # the plan a call runs, its backend's part in
    assert run.prepared.part is not None and run.steps
    view = step.graph(x, y)
    _, inputs = step._info.split((x, y), {})
    lowered = lowering.lower(view.ir, inputs.signature, slices_lib.placement_of(view.slices))
    for plan in (lowered, run):
        assert _runtime_objects(plan) == []
        assert not [name for name in ("cluster", "backend", "output_slices") if hasattr(plan, name)]
    # What a call runs with is the runtime's, kept with the plan once: the cluster and the slices
    # its outputs' futures name.
    assert kept.cluster is pw.cluster() and kept.output_slices == (b, b, None)
    assert (out[0].slice, out[1].slice) == (b, b)


def test_two_traces_of_a_program_give_equal_graphs():
    _, _, step = _two_islands()
    x = jnp.arange(8.0)
    first = step.graph(x).ir
    step.clear_cache()
    second = step.graph(x).ir
    assert second is not first
    assert second == first and hash(second) == hash(first)
    assert repr(second) == repr(first)


def test_a_graph_does_not_change_when_its_slice_moves_islands():
    """Island 1 lost by hand: b moves to island 0. The traced graph is the same object, equal
    and printed the same; the placement now says ICI, and so do lowering and the public view."""
    a, b, step = _two_islands()
    x = jnp.arange(8.0)
    want = jax.jit(lambda v: (v * 2).sum())(x)
    np.testing.assert_allclose(step(x).result(), want)
    view = step.graph(x)
    graph = view.ir
    text, digest = repr(graph), hash(graph)
    copy = dataclasses.replace(graph)
    assert [t.kind for t in view.transfers] == ["dcn"]
    assert "island 1" in repr(view) and "dcn" in repr(view)

    pw.cluster().host_lost(1)  # b moves to island 0
    assert b.island == 0

    assert step.graph(x).ir is graph  # not traced again
    assert graph == copy and hash(graph) == digest and repr(graph) == text
    assert graph.transfers[0].src == a.ref and graph.transfers[0].dst == b.ref
    # Lowered with where the slices are now, the transfer stays on one island.
    _, inputs = step._info.split((x,), {})
    placement = slices_lib.placement_of(tuple(view.held.values()))
    assert placement.kind(a.id, b.id) == "ici"
    assert graph.transfers[0].kind_in({a.id: a.island, b.id: b.island}) == "ici"
    plan = lowering.lower(graph, inputs.signature, placement)
    assert [s.kind for s in plan.steps if isinstance(s, steps.MoveStep) and s.kind] == ["ici"]
    # The public view reads the slices now: the same transfer, another kind.
    assert [t.kind for t in view.transfers] == ["ici"]
    assert "island 1" not in repr(view) and "ici" in repr(view)
    before = pw.counters()
    np.testing.assert_allclose(step(x).result(), want)
    assert pw.counters()["transfers_ici"] - before["transfers_ici"] == 1


def test_the_public_graph_reads_as_before():
    """``program.graph(x)`` keeps its attributes: nodes' slices, transfers' kinds, the printed text."""
    a, b, step = _two_islands()
    x = jnp.arange(8.0)
    view = step.graph(x)
    assert isinstance(view, pw.Graph) and view.check() is view
    assert all(isinstance(n, pw.Node) for n in view.nodes)
    assert all(isinstance(t, pw.Transfer) for t in view.transfers)
    assert [n.slice for n in view.nodes] == [a, b] and view.slices == (a, b)
    assert [n.slice.island for n in view.nodes] == [0, 1]
    t = view.transfers[0]
    assert (t.src, t.dst, t.kind, t.value, t.output) == (a, b, "dcn", t.ir.value, t.ir.output)
    assert repr(t) == f"Transfer(v{t.value} -> v{t.output}, dcn, #{a.id} (island 0) -> #{b.id} (island 1))"
    lines = repr(view).splitlines()
    assert lines[0] == "Graph('<lambda>', 2 nodes, 1 transfers)"
    assert lines[2].startswith(
        f"  node   <lambda> [jit] on #{a.id} {{'x': 2}} island 0: (v0) -> (v1: f32[8])"
    )
    assert lines[3] == f"  Transfer(v1 -> v2, dcn, #{a.id} (island 0) -> #{b.id} (island 1))"
    assert view.values[view.inputs[0].value].slice is None and view.values[1].slice is a
    assert view.name == view.ir.name and view.steps == view.ir.steps and view.outputs == view.ir.outputs
