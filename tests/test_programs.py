"""Programs give plain jax.jit's results, with the graph structure and caching promised."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches

import pathways_jax as pw

P = pw.P
Explicit = jax.sharding.AxisType.Explicit


def _sin2(x):
    return jnp.sin(x) * 2


def _total(x):
    return x.sum()


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_two_node_program_matches_jit_on_one_island(size):
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": size})
    f = pw.jit(_sin2, devices=s, in_specs=P("x"), out_specs=P("x"))
    g = pw.jit(_total, devices=s)

    @pw.program(fuse=False)
    def step(x):
        return g(f(x)) + 1.0

    x = jnp.arange(16.0)
    want = jax.jit(lambda v: _total(_sin2(v)) + 1.0)(x)
    assert_matches(step(x), want, rtol=1e-5)
    graph = step.graph(x)
    assert [n.kind for n in graph.nodes] == ["jit", "jit", "glue"]
    assert all(n.slice is s for n in graph.nodes)
    assert graph.transfers == ()
    assert len(s.devices) == size


@pytest.mark.parametrize("islands", [2, 4])
def test_chain_across_islands_matches_jit(islands):
    pw.init(num_cpu_devices=8, islands=islands)
    per = 8 // islands
    slices = [pw.devices(mesh={"x": per}, island=i) for i in range(islands)]
    stages = [
        pw.jit(lambda v, k=k: jnp.tanh(v * (k + 1)) + k, devices=s, in_specs=P("x"), out_specs=P("x"))
        for k, s in enumerate(slices)
    ]

    @pw.program
    def chain(x):
        for stage in stages:
            x = stage(x)
        return x

    def reference(v):
        for k in range(islands):
            v = jnp.tanh(v * (k + 1)) + k
        return v

    x = jnp.linspace(-1.0, 1.0, 32)
    before = pw.counters()
    assert_matches(chain(x), jax.jit(reference)(x), rtol=1e-5)
    after = pw.counters()
    assert after["transfers_dcn"] - before["transfers_dcn"] == islands - 1
    assert after["transfers_ici"] == before["transfers_ici"]
    graph = chain.graph(x)
    assert len(graph.nodes) == islands
    assert [n.slice.island for n in graph.nodes] == list(range(islands))
    assert [t.kind for t in graph.transfers] == ["dcn"] * (islands - 1)
    assert [(t.src, t.dst) for t in graph.transfers] == list(itertools.pairwise(slices))


def test_quickstart_program_graph_and_counters():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4})
    b = pw.devices(mesh={"x": 4}, island=1)
    f = pw.jit(_sin2, devices=a, out_specs=P("x"))
    g = pw.jit(_total, devices=b)

    @pw.program
    def step(x):
        return g(f(x))

    x = jnp.arange(16.0)
    graph = step.graph(x).check()
    assert [n.name for n in graph.nodes] == ["_sin2", "_total"]
    assert [n.slice for n in graph.nodes] == [a, b]
    assert [t.kind for t in graph.transfers] == ["dcn"]
    assert graph.transfers[0].src is a and graph.transfers[0].dst is b
    # source_info names this file and the line of the call inside step.
    assert all(n.source_info.startswith("test_programs.py:") for n in graph.nodes)
    assert "_sin2 [jit]" in repr(graph) and "dcn" in repr(graph)

    pw.reset_counters()
    out = step(x)
    assert isinstance(out, pw.Future)
    assert_matches(out, jax.jit(lambda v: _total(_sin2(v)))(x), rtol=1e-5)
    first = pw.counters()
    assert (first["traces"], first["lowerings"], first["compiles"]) == (0, 1, 2)  # traced by .graph()
    for _ in range(3):
        step(x + 1.0).result(timeout=60)
    again = pw.counters()
    assert (again["traces"], again["lowerings"], again["compiles"]) == (0, 1, 2)
    assert again["dispatches"] == 8 and again["transfers_dcn"] == 4


def test_new_signature_retraces_once():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})

    @pw.program(devices=s)
    def scale(x, k):
        return x * k

    pw.reset_counters()
    scale(jnp.ones(4), 2.0).result()
    scale(jnp.ones(4), 3.0).result()  # same signature: cached
    assert pw.counters()["traces"] == 1
    scale(jnp.ones(6), 2.0).result()  # new shape
    scale(jnp.ones(4, jnp.int32), 2).result()  # new dtypes
    assert pw.counters()["traces"] == 3
    assert pw.counters()["lowerings"] == 3


def test_island_local_program_makes_no_dcn_transfer():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=1)
    b = pw.devices(mesh={"x": 2}, island=1, exclusive=True)
    f = pw.jit(_sin2, devices=a)
    g = pw.jit(_total, devices=b)

    @pw.program
    def step(x):
        return g(f(x))

    pw.reset_counters()
    x = jnp.arange(8.0)
    assert_matches(step(x), jax.jit(lambda v: _total(_sin2(v)))(x), rtol=1e-5)
    assert [t.kind for t in step.graph(x).transfers] == ["ici"]
    assert pw.counters()["transfers_dcn"] == 0
    assert pw.counters()["transfers_ici"] == 1


def test_plain_jax_jit_and_glue_are_placed_by_with_slice():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)
    f = jax.jit(lambda v: v * 3.0)
    g = jax.jit(lambda v, w: v @ w)

    @pw.program(fuse=False)
    def step(x, w):
        with a:
            y = f(x) - 1.0
        with b:
            z = g(y, w)
        return z, y.mean()

    x = jnp.arange(12.0).reshape(3, 4)
    w = jnp.ones((4, 2))
    want = jax.jit(lambda v, m: ((v * 3.0 - 1.0) @ m, (v * 3.0 - 1.0).mean()))(x, w)
    assert_matches(step(x, w), want, rtol=1e-5)
    graph = step.graph(x, w)
    kinds = [(n.kind, n.slice) for n in graph.nodes]
    assert kinds == [("jit", a), ("glue", a), ("jit", b), ("glue", a)]
    assert [t.kind for t in graph.transfers] == ["dcn"]


def test_glue_goes_with_its_inputs_and_program_default():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    f = pw.jit(lambda v: v + 1.0, devices=a)

    @pw.program(devices=b, fuse=False)
    def step(x):
        y = f(x)
        z = jnp.exp(y) * 2.0  # glue: grouped with its input on `a`
        return z, jnp.cos(x)  # glue on the program's default slice `b`

    x = jnp.linspace(0.0, 1.0, 6)
    want = jax.jit(lambda v: (jnp.exp(v + 1.0) * 2.0, jnp.cos(v)))(x)
    assert_matches(step(x), want, rtol=1e-5)
    graph = step.graph(x)
    placed = {(n.kind, n.slice.id) for n in graph.nodes}
    assert placed == {("jit", a.id), ("glue", a.id), ("glue", b.id)}
    assert len(graph.nodes) == 3  # exp and mul grouped into one glue node
    assert graph.transfers == ()


def test_pytrees_static_args_and_kwargs():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"data": 4})

    @pw.jit(devices=s, in_specs=(P("data"), None), static_argnums=2)
    def affine(batch, params, activation):
        h = batch["x"] @ params["w"] + params["b"]
        return {"out": jnp.tanh(h) if activation == "tanh" else h, "n": batch["x"].shape[0]}

    @pw.program(static_argnums=1)
    def run(params, activation, *, batch):
        out = affine(batch, params, activation)
        return out["out"].sum(axis=0), [out["n"], out["out"]]

    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}
    batch = {"x": rng.normal(size=(8, 3)).astype(np.float32)}

    def reference(p, b, activation):
        h = b["x"] @ p["w"] + p["b"]
        h = jnp.tanh(h) if activation == "tanh" else h
        return h.sum(axis=0), [jnp.asarray(b["x"].shape[0]), h]

    for activation in ["tanh", "linear"]:
        got = run(params, activation, batch=batch)
        want = jax.jit(reference, static_argnums=2)(params, batch, activation)
        assert_matches(got, want, rtol=1e-5)
    assert isinstance(got[1], list) and all(isinstance(v, pw.Future) for v in got[1])


def test_numpy_scalars_and_futures_as_inputs():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    step = pw.program(lambda x, k: x * k + 1, devices=s)
    x = np.arange(6, dtype=np.float32)
    first = step(x, 2)
    second = step(first, 0.5)  # a future straight into the next call
    ref = jax.jit(lambda v, k: v * k + 1)
    assert_matches(second, ref(ref(x, 2), 0.5))


def test_numpy_input_is_copied_at_call_time():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    step = pw.program(lambda x: x + 1, devices=s)
    x = np.zeros(4, np.float32)
    out = step(x)
    x[:] = 100.0
    np.testing.assert_array_equal(np.asarray(out), np.ones(4, np.float32))


def test_call_returns_before_the_computation_finishes():
    import threading

    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    gate = threading.Event()

    def wait_for_gate(v):
        if v[0] > 0:  # the warm-up call passes straight through
            gate.wait(30)
        return v

    @pw.jit(devices=s)
    def slow(x):
        return jax.pure_callback(wait_for_gate, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    @pw.program
    def step(x):
        return slow(x) * 2

    step(jnp.zeros(2)).result(timeout=60)  # compile first
    try:
        out = step(jnp.ones(2))
        assert not out.done()
    finally:
        gate.set()
    np.testing.assert_array_equal(np.asarray(out.result(timeout=60)), [4.0, 4.0])


def test_sharded_outputs_keep_their_specs():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2, "y": 2})

    @pw.jit(devices=s, in_specs=P("x", "y"), out_specs=P("x", None))
    def rowsum_keep(m):
        return m * m.sum(axis=1, keepdims=True)

    m = jnp.arange(16.0).reshape(4, 4)
    out = rowsum_keep(m)
    assert out.sharding.spec == P("x", None)
    assert set(out.sharding.device_set) == set(s.devices)
    assert_matches(out, jax.jit(lambda v: v * v.sum(axis=1, keepdims=True))(m))
    assert s.sharding("x").spec == P("x")


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_shard_map_all_reduce_node(size):
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": size})

    @pw.jit(devices=s, in_specs=P("x"))
    def allreduce(v):
        return jax.shard_map(lambda b: jax.lax.psum(b.sum(), "x"), in_specs=P("x"), out_specs=P())(v)

    x = jnp.arange(32.0)
    assert_matches(allreduce(x), jnp.asarray(x.sum()))


def test_graph_check_rejects_a_broken_graph():
    import dataclasses

    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    step = pw.program(lambda x: jnp.sin(x) + 1, devices=s)
    graph = step.graph(jnp.zeros(3))
    assert graph.check() is graph
    ir = graph.ir  # the graph as plain data: changes make copies
    assert ir.check() is ir
    broken = dataclasses.replace(ir, nodes=(dataclasses.replace(ir.nodes[0], inputs=(99,)),))
    with pytest.raises(pw.errors.ProgramTraceError, match="before it exists"):
        broken.check()


def test_a_program_called_inside_a_program_joins_it():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    inner = pw.program(lambda v: jnp.sin(v) + 1.0, devices=b)
    f = pw.jit(lambda v: v * 3.0, devices=a)

    @pw.program
    def outer(x):
        return inner(f(x))

    x = jnp.arange(4.0)
    assert_matches(outer(x), jax.jit(lambda v: jnp.sin(v * 3.0) + 1.0)(x), rtol=1e-5)
    graph = outer.graph(x)
    assert [n.slice for n in graph.nodes] == [a, b]
    assert [t.kind for t in graph.transfers] == ["dcn"]


def test_callback_output_feeding_a_sharded_node_is_not_pinned_to_one_device():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 4})

    @pw.jit(devices=s)
    def hold(x):
        return jax.pure_callback(lambda v: np.asarray(v) * 2.0, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    spread = pw.jit(lambda v: v + 1.0, devices=s, in_specs=P("x"), out_specs=P("x"))

    @pw.program
    def step(x):
        return spread(hold(x))

    x = jnp.arange(8.0)
    assert_matches(step(x), x * 2.0 + 1.0)


def test_out_specs_for_outputs_that_are_lists():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    pair = pw.jit(lambda p: [p[0] * 2.0, p[1] + 1.0], devices=s, out_specs=[P("x"), P()])
    got = pair([jnp.arange(4.0), jnp.ones(2)])
    assert got[0].sharding.spec == P("x") and got[1].sharding.spec == P()
    assert_matches(got, [jnp.arange(4.0) * 2.0, jnp.ones(2) + 1.0])


def test_in_specs_are_pytree_prefixes_of_each_argument_as_shard_map_s():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 4}, axis_types=(Explicit,))
    seen = []

    def body(t, w):
        seen.append({k: jax.typeof(v).sharding.spec for k, v in t.items()})
        return t["a"] * w, t["b"] + w

    f = pw.jit(body, devices=s, in_specs=({"a": P("x"), "b": None}, P()), out_specs=(P("x"), P()))
    t = {"a": jnp.arange(8.0), "b": jnp.ones(3)}
    got = f(t, 3.0)
    assert seen == [{"a": P("x"), "b": P(None)}]
    assert got[0].sharding.spec == P("x") and got[1].sharding.is_fully_replicated
    assert_matches(got, jax.jit(lambda t, w: (t["a"] * w, t["b"] + w))(t, 3.0), rtol=0, atol=0)
    # A prefix that does not match the argument, or a leaf that is not a spec: named errors.
    with pytest.raises(pw.errors.PlacementError, match=r"in_specs\[0\].*does not match the structure"):
        f({"a": jnp.arange(8.0), "c": jnp.ones(3)}, 3.0)
    with pytest.raises(pw.errors.PlacementError, match=r"must hold pw\.P"):
        pw.jit(body, devices=s, in_specs=({"a": "x", "b": None}, P()))


def test_a_replicated_output_of_one_slice_feeds_a_program_on_a_slice_of_another_size():
    # XLA's replicated output sharding is "tile maximal" too: it was taken for a pinned one-device
    # output, whose device list it does not have (IndexError while compiling).
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    x = np.ones((8, 4), np.float32)
    r = pw.program(lambda v: v + 1, devices=b)(x)
    q = pw.program(lambda y: y * 2, devices=a)(r)
    assert_matches(q, jax.jit(lambda v: (v + 1) * 2)(x), rtol=0, atol=0)


def test_pw_jit_placements_inside_lax_control_flow_are_said_not_to_hold():
    # JAX traces lax.cond and lax.scan as one operation: a pw.jit inside runs where the whole
    # operation runs. Its devices were dropped without a word.
    pw.init(num_cpu_devices=8)
    a, b = pw.devices(mesh={"x": 2}), pw.devices(mesh={"x": 2})
    double = pw.jit(lambda v: v * 2, devices=a)
    inc = pw.jit(lambda v: v + 1, devices=b)

    def choose(x, p):
        return jax.lax.cond(p > 0, double, inc, x)

    def loop(x):
        return jax.lax.scan(lambda c, _: (inc(c), None), x, None, length=3)[0]

    x = jnp.arange(4.0)
    with pytest.warns(UserWarning, match=r"inside `cond` at .*not honoured") as said:
        got = pw.program(choose)(x, 1)
    assert "devices=[0,1]" in str(said[0].message) and "devices=[2,3]" in str(said[0].message)
    assert_matches(got, jax.jit(lambda x: jax.lax.cond(True, lambda v: v * 2, lambda v: v + 1, x))(x))
    with pytest.warns(UserWarning, match=r"pw.jit at .*test_programs.py.* inside `scan`"):
        got = pw.program(loop)(x)
    assert_matches(got, jax.jit(lambda x: jax.lax.scan(lambda c, _: (c + 1, None), x, None, length=3)[0])(x))
    # A pw.jit on the slice the whole loop runs on is honoured: nothing to say.
    same = pw.program(lambda x: jax.lax.scan(lambda c, _: (inc(c), None), x, None, length=2)[0], devices=b)
    twin = pw.devices(mesh={"x": 2}, device_ids=[d.id for d in b.devices])  # b's devices, another slice
    on_twin = pw.program(
        lambda x: jax.lax.scan(lambda c, _: (inc(c), None), x, None, length=2)[0], devices=twin
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches(same(x), x + 2)
        assert_matches(on_twin(x), x + 2)
