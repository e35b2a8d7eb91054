"""Slices in any device order: results and shardings as plain ``jax.jit`` gives them on the same meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_jax as pw

ORDER = [3, 1, 2, 0]  # a slice's devices, in an order other than their ids'


def _mesh(ids, names=("x",)):
    by_id = {d.id: d for d in jax.devices()}
    return Mesh(np.array([by_id[i] for i in ids]), names)


def _ring(v):
    """axis_index and a ppermute around the ring: both follow the mesh's device order."""
    i = jax.lax.axis_index("x")
    return jax.lax.ppermute(v, "x", [(j, (j + 1) % 4) for j in range(4)]) * jax.lax.psum(v, "x") + i * 100


def _constrained(v):
    return jax.lax.with_sharding_constraint(jnp.sin(v) * 2, P("x"))  # a bare spec: the slice's mesh


def test_a_slice_program_under_the_callers_grad_jit_and_vmap_runs_on_the_slices_mesh():
    # README: code placed on a slice names the slice's mesh (shard_map over slice.mesh, bare
    # specs in constraints); a program called inside the caller's grad / jit / vmap runs as
    # jax.jit does there, which is jax.jit under the slice's mesh.
    s = pw.devices(mesh={"x": 4}, device_ids=ORDER)
    mesh = _mesh(ORDER)
    x = jnp.arange(16.0)
    ring = jax.shard_map(_ring, mesh=s.mesh, in_specs=P("x"), out_specs=P("x"))
    ring_prog = pw.program(lambda v: jax.jit(ring)(v), devices=s)
    ring_jit = pw.jit(ring, devices=s)
    constrained = pw.program(lambda v: jax.jit(_constrained)(v), devices=s)
    with jax.set_mesh(mesh):
        want_ring = jax.jit(ring)
        want_constrained = jax.jit(_constrained)
        grads = [jax.grad(lambda v, f=f: f(v).sum())(x) for f in (want_ring, want_constrained)]
        outs = [want_ring(x) + 1, want_constrained(x) + 1]
        batched = jax.vmap(want_constrained)(jnp.stack([x, x + 1]))
    for ours in (ring_prog, ring_jit):
        assert_matches(jax.grad(lambda v, f=ours: f(v).sum())(x), grads[0])
        assert_matches(jax.jit(lambda v, f=ours: f(v) + 1)(x), outs[0])
    assert_matches(jax.grad(lambda v: constrained(v).sum())(x), grads[1])
    assert_matches(jax.jit(lambda v: constrained(v) + 1)(x), outs[1])
    assert_matches(jax.vmap(constrained)(jnp.stack([x, x + 1])), batched)
    s.release()


def test_lower_of_a_slice_program_compiles_on_the_slices_mesh():
    # The AOT idiom, prog.lower(x).compile().cost_analysis(), of a program whose code names the
    # slice's mesh: jax.jit under jax.set_mesh of the slice's devices, in their order.
    s = pw.devices(mesh={"x": 4}, device_ids=ORDER)
    mesh = _mesh(ORDER)
    x = jnp.arange(16.0)
    ring = jax.shard_map(_ring, mesh=s.mesh, in_specs=P("x"), out_specs=P("x"))
    with jax.set_mesh(mesh):
        want = [jax.jit(ring).lower(x).compile(), jax.jit(_constrained).lower(x).compile()]
    ours = [
        pw.program(lambda v: jax.jit(ring)(v), devices=s).lower(x).compile(),
        pw.jit(_constrained, devices=s).lower(x).compile(),
    ]
    for got, ref in zip(ours, want, strict=True):
        assert got.output_shardings == ref.output_shardings
        assert got.cost_analysis() == ref.cost_analysis()
        assert_matches(got(x), ref(x))
    assert ours[0].output_shardings.device_set == set(s.devices)
    s.release()


def test_trace_and_eval_shape_of_a_slice_program_run_on_the_slices_mesh():
    s = pw.devices(mesh={"x": 4}, device_ids=ORDER)
    x = jnp.arange(16.0)
    with jax.set_mesh(_mesh(ORDER)):
        shape = jax.jit(_constrained).eval_shape(x)
        want = jax.jit(_constrained).trace(x).lower().compile()
    for ours in (pw.program(lambda v: jax.jit(_constrained)(v), devices=s), pw.jit(_constrained, devices=s)):
        assert ours.eval_shape(x) == shape
        traced = ours.trace(x)
        assert [(a.shape, a.dtype) for a in traced.jaxpr.out_avals] == [((16,), jnp.float32)]
        compiled = traced.lower().compile()
        assert compiled.output_shardings == want.output_shardings
        assert list(compiled.output_shardings.mesh.device_ids) == ORDER
    s.release()


def test_an_explicit_slice_program_under_the_callers_jit_and_vmap_and_lowered():
    explicit = jax.sharding.AxisType.Explicit
    s = pw.devices(mesh={"x": 4}, device_ids=ORDER, axis_types=explicit)
    mesh = jax.make_mesh((4,), ("x",), axis_types=(explicit,), devices=[jax.devices()[i] for i in ORDER])

    def f(v):
        return (jnp.sin(jax.sharding.reshard(v, P("x"))) * 2).sum()

    prog = pw.program(f, devices=s)
    x = jnp.arange(16.0)
    with jax.set_mesh(mesh):
        want = jax.jit(f)(x)
        batched = jax.vmap(f)(jnp.stack([x, x + 1]))
        compiled = jax.jit(f).lower(x).compile()
    assert_matches(jax.jit(lambda v: prog(v) + 1)(x), want + 1)
    assert_matches(jax.vmap(prog)(jnp.stack([x, x + 1])), batched)
    assert prog.lower(x).compile().output_shardings == compiled.output_shardings
    s.release()


def test_with_slice_inside_a_program_run_under_the_callers_jit_and_grad_sees_the_slices_mesh():
    # Values already on the slice's devices (a program's outputs, there): the caller's jax.jit
    # or grad of the program traces its `with s:` block as jax.jit does under the slice's mesh.
    s = pw.devices(mesh={"x": 4}, device_ids=ORDER)
    mesh = _mesh(ORDER)
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("x")))
    ring = jax.shard_map(_ring, mesh=s.mesh, in_specs=P("x"), out_specs=P("x"))

    @pw.program
    def prog(v):
        with s:
            return jax.jit(ring)(v) + jax.jit(_constrained)(v)

    with jax.set_mesh(mesh):
        want = jax.jit(lambda v: jax.jit(ring)(v) + jax.jit(_constrained)(v))
        want_out, want_grad = want(x), jax.grad(lambda v: want(v).sum())(x)
        want_ring = jax.jit(ring)(jnp.arange(16.0))
    assert_matches(prog(x), want_out)
    assert_matches(jax.jit(prog)(x), want_out)
    assert_matches(jax.grad(lambda v: prog(v).sum())(x), want_grad)
    assert_matches(prog.lower(x).compile()(x), want_out)
    with s:  # outside any program: as under jax.set_mesh(s.physical_mesh)
        got_ring = jax.jit(ring)(jnp.arange(16.0))
    assert_matches(got_ring, want_ring)
    assert got_ring.sharding == want_ring.sharding
    s.release()


def test_a_mesh_of_the_slices_devices_in_another_order_is_named_as_such():
    # JAX refuses one computation over the same devices in two orders; the error said to map the
    # slice onto the mesh's devices, which it already was, but not that the order differs.
    s = pw.devices(mesh={"x": 4}, device_ids=ORDER)
    theirs = NamedSharding(_mesh([0, 1, 2, 3]), P("x"))
    prog = pw.program(lambda v: jax.lax.with_sharding_constraint(v * 2, theirs), devices=s)
    with pytest.raises(
        pw.errors.PlacementError,
        match=r"another order \(ids \[0, 1, 2, 3\]; the slice's are \[3, 1, 2, 0\]\)",
    ):
        prog(jnp.arange(16.0))
    with jax.set_mesh(_mesh(ORDER)), pytest.raises(ValueError, match="incompatible devices"):
        jax.jit(lambda v: jax.lax.with_sharding_constraint(v * 2, theirs))(jnp.arange(16.0))  # as JAX
    s.release()


def _host_rows(shard):
    """Each host's rows of step ``i``'s global (4, 2) batch, by ``shard.index``: row r holds 10 * i + r."""
    n = 4 // shard.count
    for step in range(100):
        rows = np.arange(shard.index * n, (shard.index + 1) * n, dtype=np.float32)
        yield {"x": np.stack([rows + 10 * step, -rows], axis=1)}


def _global_rows(step):
    rows = np.arange(4, dtype=np.float32)
    return np.stack([rows + 10 * step, -rows], axis=1)


@pytest.mark.timeout(240)
def test_host_iterator_shards_follow_the_slices_device_order_across_hosts(ray_cluster):
    # A slice whose first device is on the second host holds the batch's first rows there:
    # that host's iterator is part 0 (Shard docs: "part index of count (its rows)"), not part 1.
    from pathways_jax import colocated_python

    pw.init(backend="ray", hosts=2, devices_per_host=1, islands=1)
    s = pw.devices(mesh={"x": 2}, device_ids=[1, 0])
    batch = {"x": jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))}
    batches = colocated_python.HostIterator(_host_rows, batch)
    step = pw.jit(lambda b: b["x"] * 2, devices=s, out_specs=pw.P("x"))
    for i in range(2):
        assert_matches(step(next(batches)), _global_rows(i) * 2)
    saved = batches.get_state()  # in host order, as set_state takes it back
    assert_matches(step(next(batches)), _global_rows(2) * 2)
    batches.set_state(saved)
    assert_matches(step(next(batches)), _global_rows(2) * 2)
    s.release()


def test_device_ids_taken_from_a_mesh_map_the_slice_onto_that_mesh():
    # Mapping a slice onto a mesh of one's own: its device_ids (a 2-D NumPy array), or
    # list(mesh.device_ids.flat) (NumPy integers), were refused as "not a device id".
    ids = [5, 2, 7, 0, 1, 6, 3, 4]
    mesh = Mesh(np.array([jax.devices()[i] for i in ids]).reshape(2, 4), ("x", "y"))
    x = jnp.arange(64.0).reshape(8, 8)
    want = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(mesh, P("y", "x")))(x)
    for given in (mesh.device_ids, list(mesh.device_ids.flat), mesh.device_ids.tolist(), tuple(ids)):
        s = pw.devices(mesh={"x": 2, "y": 4}, device_ids=given)
        assert [d.id for d in s.devices] == ids
        got = pw.jit(lambda v: v * 2, devices=s, out_specs=pw.P("y", "x"))(x)
        assert_matches(got, want)
        assert got.result().sharding == want.sharding
        s.release()
    with pytest.raises(pw.errors.ResourceError, match=r"shape \(4, 2\), but the mesh's is \(2, 4\)"):
        pw.devices(mesh={"x": 2, "y": 4}, device_ids=mesh.device_ids.reshape(4, 2))
    with pytest.raises(pw.errors.ResourceError, match=r"takes device ids: pass \[d.id for d in devices\]"):
        pw.devices(mesh={"x": 2, "y": 4}, device_ids=list(mesh.devices.flat))


def test_a_mesh_over_several_islands_is_refused_by_a_program_jax_jit_would_run_there():
    # jax.jit runs on the arguments' mesh; a program cannot run across islands, and ran on one
    # device instead: its output, off the mesh, then failed the caller's next line.
    pw.init(num_cpu_devices=8, islands=2)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
    with pytest.raises(pw.errors.PlacementError, match=r"devices of islands \[0, 1\].*one island's devices"):
        pw.program(lambda v: v * 2)(x)
    with pytest.raises(pw.errors.PlacementError, match=r"devices of islands \[0, 1\]"):
        pw.jit(lambda v: v * 2)(x)
    with jax.set_mesh(mesh), pytest.raises(pw.errors.PlacementError, match=r"devices of islands \[0, 1\]"):
        pw.program(lambda v: jax.lax.with_sharding_constraint(v * 2, P("data")))(jnp.arange(16.0))
    # A mesh of one island's devices, in any order, runs as jax.jit does.
    ids = [3, 1, 2, 0]
    one = jax.make_mesh(
        (4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=[jax.devices()[i] for i in ids]
    )
    y = jax.device_put(jnp.arange(16.0), NamedSharding(one, P("data")))
    got, want = pw.program(lambda v: v * 2)(y), jax.jit(lambda v: v * 2)(y)
    assert_matches(got, want)
    assert got.result().sharding == want.sharding


def test_lower_of_a_program_on_slices_of_two_orders_says_no_one_executable_spans_them():
    # The same devices in two orders (or two islands): jax.jit of the whole function has no one
    # device assignment; lower() raised JAX's "incompatible devices" about device_puts it never wrote.
    forward = pw.devices(mesh={"x": 4}, device_ids=[0, 1, 2, 3])
    backward = pw.devices(mesh={"x": 4}, device_ids=[3, 2, 1, 0])
    f = pw.jit(lambda v: jnp.sin(v) * 2, devices=backward, out_specs=pw.P("x"))
    g = pw.jit(lambda v: v.sum(), devices=forward, in_specs=pw.P("x"))
    step = pw.program(lambda v: g(f(v)))
    x = jnp.arange(16.0)
    with pytest.raises(pw.errors.PlacementError, match=r"no one executable spans") as info:
        step.lower(x)
    assert "incompatible devices" in str(info.value.__cause__)
    before = pw.counters()
    assert_matches(step(x), jnp.sum(jnp.sin(x) * 2), rtol=1e-5)  # its plan was prepared by lower()
    after = pw.counters()
    assert (after["traces"], after["compiles"]) == (before["traces"], before["compiles"])
    mixed = jax.device_put(x, NamedSharding(_mesh([0, 1, 2, 3]), P("x")))
    other = jax.device_put(x, NamedSharding(_mesh(ORDER), P("x")))
    with pytest.raises(
        ValueError, match="incompatible devices"
    ) as info:  # the caller's own arrays: JAX's words
        pw.program(lambda a, b: a + b).lower(mixed, other)
    assert not isinstance(info.value, pw.errors.PlacementError)
