"""Typed records instead of positional tuples, and one implementation of each concept.

Argument signatures, the future cache key, accounting notes and groups, Ray
host operations; aval text and HTML escaping, each made in one place.
"""

import ast
import inspect
import pathlib
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_source
from jax import core

import pathways_jax as pw
from pathways_jax._src.api import arguments
from pathways_jax._src.backends import ray_host
from pathways_jax._src.backends.ray_host import answers
from pathways_jax._src.compile import lowering, steps
from pathways_jax._src.core import formatting
from pathways_jax._src.ir import graph as ir_graph
from pathways_jax._src.ir import signatures
from pathways_jax._src.ir.signatures import FutureKey
from pathways_jax._src.runtime import accounting
from pathways_jax._src.views import notebook, render

# --- the future cache key ---------------------------------------------------------------


def test_the_future_key_made_by_lowering_and_by_tracing_is_one_record():
    s = pw.devices(mesh={"x": 2})
    double = pw.jit(lambda v: v * 2, devices=s)
    fut = double(jnp.arange(4.0))
    made = fut._entry.signature  # by the plan (steps.OutputSlot.signature), shared by its runs
    assert type(made) is FutureKey
    assert (made.kind, made.shape, made.dtype, made.slice_id) == ("future", (4,), jnp.float32, s.id)
    assert made.sharding == fut.sharding
    assert double(jnp.arange(4.0))._entry.signature is made  # one object for every run of the plan

    fut._entry.signature = None  # as for a value whose sharding was not known when it was made
    try:
        computed = arguments._leaf_signature(fut, 0, "p")  # tracing builds the key itself
    finally:
        fut._entry.signature = made
    assert type(computed) is FutureKey and computed is not made
    assert computed == made and hash(computed) == hash(made)
    s.release()


def test_a_call_with_the_same_futures_compares_their_keys_by_identity():
    s = pw.devices(mesh={"x": 1})
    inc = pw.program(lambda v: v + 1, devices=s)
    fut = inc(jnp.zeros(3))
    inc(fut).result()
    last = inc._repeats.last
    assert last is not None and last.signatures[0] is fut._entry.signature and last.ambient is None
    before = pw.counters()
    assert inc(fut).result().tolist() == [2.0, 2.0, 2.0]
    after = pw.counters()
    assert after["traces"] == before["traces"] and after["lowerings"] == before["lowerings"]
    s.release()


# --- argument signatures ------------------------------------------------------------------


def test_argument_signatures_have_named_fields_and_stay_cache_keys():
    s = pw.devices(mesh={"x": 1})
    prog = pw.program(lambda a, b, c, d, k: (a, b, c, d, k), devices=s, static_argnames="k")
    args = (jnp.zeros((2, 3), jnp.bfloat16), np.ones(4), 1.5, True)
    key, inputs = prog._info.split(args, {"k": 7})
    array, numpy_, scalar, boolean = inputs.signature
    assert isinstance(inputs, arguments.TraceInputs)
    assert inputs.statics == (("k", 7),) and inputs.ambient is None and len(inputs.leaves) == 4
    assert isinstance(array, signatures.ArrayKey)
    assert (array.kind, array.shape, array.dtype, array.weak_type) == ("array", (2, 3), jnp.bfloat16, False)
    assert array.sharding == args[0].sharding
    assert isinstance(numpy_, signatures.NumpyKey)
    assert (numpy_.kind, numpy_.shape, numpy_.dtype) == ("numpy", (4,), jnp.float32)  # canonical
    assert isinstance(scalar, signatures.ScalarKey) and (scalar.kind, scalar.python_type) == ("scalar", float)
    assert boolean.python_type is bool
    # Same arguments: an equal, hashable key; another kind of leaf: never equal.
    again, _ = prog._info.split(args, {"k": 7})
    assert again == key and hash(again) == hash(key)
    assert signatures.ScalarKey(int) != signatures.ScalarKey(float)
    assert signatures.NumpyKey((4,), jnp.float32) != signatures.ArrayKey((4,), jnp.float32, False, None)
    s.release()


def test_programs_trace_from_the_named_signature():
    s = pw.devices(mesh={"x": 2})

    @pw.program(devices=s)
    def step(a, b, c):
        return a * b + c

    out = step(jnp.arange(4.0), np.arange(4, dtype=np.float32), 2)
    np.testing.assert_allclose(
        out.result(), jax.jit(lambda a, b, c: a * b + c)(jnp.arange(4.0), np.arange(4.0), 2)
    )
    graph = step.graph(jnp.arange(4.0), np.arange(4, dtype=np.float32), 2)
    assert [str(i.index) for i in graph.inputs] == ["0", "1", "2"]
    s.release()


# --- plans and accounting -------------------------------------------------------------------


def _two_island_step(b_size: int):
    """Slices a (2 devices, island 0) and b (``b_size``, island 1), and a program doubling on a
    and summing on b, unfused; it has run once, checked against jax.jit."""
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": b_size}, island=1)
    f = pw.jit(lambda v: v * 2, devices=a)
    g = pw.jit(lambda v: v.sum(), devices=b)
    step = pw.program(lambda v: g(f(v)), fuse=False)
    np.testing.assert_allclose(step(jnp.ones(8)).result(), jax.jit(lambda v: (v * 2).sum())(jnp.ones(8)))
    return a, b, step


def test_accounting_groups_are_named_and_still_unpack():
    a, b, step = _two_island_step(4)
    plan = next(iter(step._plans.values())).plan
    groups = plan.acct_groups
    assert all(isinstance(group, steps.AccountingGroup) for group in groups)
    assert sorted(group.devices for group in groups) == sorted(
        [tuple(sorted(d.id for d in a.devices)), tuple(sorted(d.id for d in b.devices))]
    )
    for group in groups:
        devices, slot, node_count = group  # tuple unpacking keeps working
        assert (devices, slot, node_count) == (
            group.devices,
            group.slot,
            group.node_count,
        ) and node_count == 1


def test_a_compiled_plan_is_frozen_and_its_backends_part_comes_in_a_copy():
    import dataclasses

    from pathways_jax._src.backends import base

    _, b, step = _two_island_step(1)
    plan = next(iter(step._plans.values())).plan
    with pytest.raises(dataclasses.FrozenInstanceError, match="frozen once compiled"):
        plan.steps = []
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prepared.reports = 0
    prepared = plan.prepared
    assert isinstance(prepared, base.Prepared) and prepared.part is not None
    assert prepared.reports == len(plan.steps) and prepared.islands == {0, 1}
    # The local backend adds the window of b's one device (a single-device executable) to the compiler's.
    assert prepared.windowed == {**plan.windowed, base.device_window_key(b.devices[0].id): 1}
    # A backend's part comes in a copy sharing the plan's content; the plan is left as it was.
    other = base.Prepared({}, frozenset(), 0, None)
    again = plan.with_prepared(other)
    assert again is not plan and again.prepared is other and again.steps is plan.steps
    assert plan.prepared is prepared and again.key == plan.key


class _Run:
    def __init__(self, plan_key, client_key, transient=()):
        self.plan = type("P", (), {"key": plan_key})()
        self.client = type("C", (), {"key": client_key})()
        self.transient = transient


def test_accounting_notes_fold_in_place():
    acct = accounting.Accounting([0], on_done=lambda *_: None)
    acct._started = True  # no watcher thread: the notes stay where note() put them
    first, second, other = _Run(1, 1), _Run(1, 1), _Run(1, 2, transient=((0, 8),))
    acct.note(first, 100, ("a",))
    note = acct._open[(1, 1)]
    acct.note(second, 200, ("b",))
    assert acct._open[(1, 1)] is note  # folded into the same record, no new one
    assert isinstance(note, accounting.Note)
    assert (note.run, note.start, note.arrays, note.count) == (second, 100, ("b",), 2)
    acct.note(other, 300, ("c",))
    (alone,) = acct._notes  # a run holding transient bytes is noted alone
    assert (alone.run, alone.start, alone.arrays, alone.count) == (other, 300, ("c",), 1)


# --- Ray host operations --------------------------------------------------------------------


def test_ray_host_operations_are_named_and_pickle():
    desc = ray_host.NamedDesc((1, 0), (2,), ("x",), jax.sharding.PartitionSpec("x"))
    ops = [
        ray_host.ExecOp("fp", (0,), (1, 2), True, "'f' (a.py:1)"),
        ray_host.PutOp(1, 3, ray_host.SingleDesc(1)),
        ray_host.PostOp(2, 1, 7, (ray_host.Piece(0, ((0, 2),), (2,)),), "float32"),
        ray_host.PullOp(4, 2, ((0, 7, (ray_host.Piece(0, ((0, 2),), (2,)),)),), (2,), "float32", desc),
    ]
    assert pickle.loads(pickle.dumps(ops)) == ops
    assert [op.kind for op in ops] == ["exec", "put", "post", "pull"]
    devices = jax.devices()[:2]
    single = ray_host.sharding_of(ray_host.SingleDesc(1), devices)
    assert single.device_set == {devices[1]}
    named = ray_host.sharding_of(desc, devices)
    assert list(named.mesh.devices.flat) == [devices[1], devices[0]] and named.spec == desc.spec
    assert (
        answers.describe_failure(ValueError("boom"), ops, 0)
        == "run failed in node 'f' (a.py:1): ValueError: boom"
    )
    assert (
        answers.describe_failure(ValueError("boom"), ops, 2) == "run failed in a post step: ValueError: boom"
    )
    failure = ray_host.RunFailure("lost", 1, "host 0: gone", "")
    assert pickle.loads(pickle.dumps(failure)) == failure and failure.peer == 1


def test_ray_host_imports_nothing_of_pathways_jax_but_itself_nor_ray():
    folder = pathlib.Path(inspect.getfile(ray_host)).parent
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        imported |= {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
        }
        outside = {
            name
            for name in imported
            if name.split(".")[0] in ("pathways_jax", "ray") and not name.startswith(ray_host.__name__)
        }
        assert not outside, (path.name, outside)


def test_a_host_process_loads_the_host_package_and_nothing_else_of_pathways_jax():
    # What a Ray host actor's process imports (its class's module): the public package's names
    # load on first use, so the rest of pathways_jax (about 0.3 s of a host's start) stays out.
    done = run_source(
        """
        import sys
        import pathways_jax._src.backends.ray_host.actor
        print(sorted(m for m in sys.modules if m.startswith("pathways_jax")))
        """
    )
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout.strip().splitlines()[-1])
    outside = [m for m in loaded if not m.startswith(ray_host.__name__)]
    assert outside == [
        "pathways_jax",
        "pathways_jax._src",
        "pathways_jax._src.backends",
        "pathways_jax._src.core",
        "pathways_jax._src.core.version",
    ], outside


# --- formatting -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("aval", "text"),
    [
        (core.ShapedArray((4, 8), jnp.float32), "f32[4,8]"),
        (core.ShapedArray((), jnp.bfloat16), "bf16[]"),
        (core.ShapedArray((3,), jnp.int4), "i4[3]"),
        (core.ShapedArray((2,), jnp.float32, weak_type=True), "f32[2]"),
        (jax.random.split(jax.random.key(0), 4).aval, "key<fry>[4]"),
        (jax.random.key(0).aval, "key<fry>[]"),
        (None, "None"),
    ],
)
def test_aval_text(aval, text):
    assert formatting.aval_text(aval) == text


def test_graph_listing_and_picture_show_avals_the_same_way():
    s = pw.devices(mesh={"x": 1})
    prog = pw.program(lambda k, v: (jax.random.split(k, 4), v.astype(jnp.bfloat16)), devices=s)
    graph = prog.graph(jax.random.key(0), jnp.zeros(2))
    listing, dot = str(graph), graph.to_dot()
    for text in ("key<fry>[]", "key<fry>[4]", "bf16[2]", "f32[2]"):
        assert text in listing and text in dot, text
    s.release()


def test_html_escaping_is_the_standard_one():
    assert formatting.escape("<a & \"b\" 'c'>") == "&lt;a &amp; &quot;b&quot; &#x27;c&#x27;&gt;"
    assert formatting.escape(3) == "3"


def test_names_with_html_characters_are_escaped_in_pictures_and_views():
    name = "a<b&c>\"d'e"
    s = pw.devices(mesh={"x": 1})
    prog = pw.program(lambda v: v + 1, devices=s, name=name)
    prog(jnp.zeros(2)).result()
    graph = prog.graph(jnp.zeros(2))
    for text in (render.to_html(graph), notebook.program_html(prog)):
        assert formatting.escape(name) in text
        assert name not in text
        assert not re.search(r"<b&c>", text)
    s.release()


def test_a_transfers_kind_follows_where_its_slices_are_now_not_where_they_were_traced():
    """A slice moved off a lost island (here: island 1 lost by hand) makes its program lower
    again; a move that crossed islands when traced now stays in one, and is counted as such."""
    _, b, step = _two_island_step(1)
    cluster = pw.cluster()
    want = jax.jit(lambda v: (v * 2).sum())(jnp.arange(8.0))
    before = pw.counters()
    np.testing.assert_allclose(step(jnp.arange(8.0)).result(), want)
    assert pw.counters()["transfers_dcn"] - before["transfers_dcn"] == 1
    cluster.host_lost(1)  # b moves to island 0, where a's neighbours are free
    assert b.island == 0
    before = pw.counters()
    np.testing.assert_allclose(step(jnp.arange(8.0)).result(), want)
    after = pw.counters()
    assert (
        after["transfers_ici"] - before["transfers_ici"],
        after["transfers_dcn"] - before["transfers_dcn"],
    ) == (1, 0)
    plan = next(r.plan for r in step._plans.values() if r.is_current())
    assert [s.kind for s in plan.steps if isinstance(s, steps.MoveStep) and s.kind] == ["ici"]


def test_lowering_reads_where_slices_are_from_the_placement_it_is_given_and_nothing_else():
    """The compiler is a function of plain data: given a placement that puts the graph's slices
    on other devices and islands than they have now, it compiles for those, and derives each
    transfer's kind from that placement; the live slices are not read (nor changed)."""
    import dataclasses

    from jax.sharding import Mesh

    from pathways_jax._src.compile import placement as placement_lib
    from pathways_jax._src.runtime import runnable as runnable_lib
    from pathways_jax._src.runtime import slices as slices_lib

    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    f = pw.jit(lambda v: v * 2, devices=a)
    g = pw.jit(lambda v: v + 1, devices=b)
    step = pw.program(lambda v: g(f(v)), fuse=False)
    x = jnp.arange(4.0)
    np.testing.assert_allclose(step(x).result(), jax.jit(lambda v: v * 2 + 1)(x))
    graph = step.graph(x)
    _, inputs = step._info.split((x,), {})
    live = slices_lib.placement_of(graph.slices)
    assert live.kind(a.id, b.id) == "dcn"
    # Elsewhere: a on devices 6 and 7, b beside it on 4 and 5, one island.
    devices = {d.id: d for d in jax.devices()}
    elsewhere = dataclasses.replace(
        live,
        slices={
            a.id: placement_lib.Placed(a.ref, Mesh(np.array([devices[6], devices[7]]), ("x",)), 1),
            b.id: placement_lib.Placed(b.ref, Mesh(np.array([devices[4], devices[5]]), ("x",)), 1),
        },
    )
    # The graph lowered names its slices by their frozen refs alone: no island, no devices to read.
    assert all(type(n.slice) is ir_graph.SliceRef and not hasattr(n.slice, "island") for n in graph.ir.nodes)
    plan = lowering.lower(graph.ir, inputs.signature, elsewhere)
    execs = [s for s in plan.steps if isinstance(s, steps.ExecStep)]
    placed_on = [sorted(d.id for d in s.executable.output_shardings[0].device_set) for s in execs]
    assert placed_on == [[6, 7], [4, 5]]
    assert [s.island for s in execs] == [1, 1]
    assert [s.kind for s in plan.steps if isinstance(s, steps.MoveStep) and s.kind] == ["ici"]
    assert plan.placement is elsewhere and not hasattr(plan, "cluster")
    # The runtime keeps what the plan runs with beside it: the live cluster, and the slices its
    # outputs' futures name, as they were when it was lowered (whatever placement it was given).
    kept = runnable_lib.lowered(
        lambda g, sig, _, donated: lowering.lower(g, sig, elsewhere, donated),
        graph.ir,
        inputs.signature,
        graph.slices,
        frozenset(),
    )
    assert kept.plan.placement is elsewhere and kept.cluster is a.cluster and kept.output_slices == (b,)
    # The slices themselves are where they were, and a call still runs there, exactly.
    assert (a.island, b.island) == (0, 1) and [d.id for d in a.devices] != [6, 7]
    np.testing.assert_allclose(step(x).result(), jax.jit(lambda v: v * 2 + 1)(x))
