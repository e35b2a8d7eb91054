"""Meshes: the caller's ambient mesh, slices with Explicit axes, inputs on the user's meshes."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_matches
from jax.sharding import AxisType, NamedSharding

import pathways_jax as pw

P = pw.P
pytestmark = pytest.mark.timeout(120)
Auto, Explicit = AxisType.Auto, AxisType.Explicit


def _step(v):
    return jnp.sin(v) * 2 + v.sum()


@pytest.mark.parametrize("size", [2, 8])
def test_program_and_jit_inside_an_ambient_mesh_of_another_size(size):
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 4})
    prog = pw.program(_step, devices=s)
    f = pw.jit(_step, devices=s, in_specs=P("x"), out_specs=P("x"))
    free = pw.program(lambda v: f(v) + 1)  # no default slice: glue placed with f
    x = jnp.arange(16.0)
    want = jax.jit(_step)(x)
    user = jax.make_mesh((size,), ("d",), axis_types=(Auto,))
    with jax.set_mesh(user):
        outs = [prog(x), f(x), free(x)]
        assert jax.sharding.get_abstract_mesh() == user.abstract_mesh
        assert jax.sharding.get_mesh() == user
    for out, expected in zip(outs, [want, want, want + 1], strict=True):
        assert_matches(out, expected, rtol=1e-5)
    assert outs[1].result().sharding == s.sharding("x")
    assert jax.sharding.get_abstract_mesh().empty


@pytest.mark.parametrize("kind", [Auto, Explicit])
def test_a_program_with_no_slice_runs_on_the_callers_one_device_mesh_as_jax_jit(kind):
    pw.init(num_cpu_devices=8)

    def constrained(v):  # names the caller's mesh with a bare spec: it needs one in context
        if kind == Explicit:
            return jax.sharding.reshard(v * 2, P("d")) + 1
        return jax.lax.with_sharding_constraint(v * 2, P("d")) + 1

    x = jnp.arange(8.0)
    for size in (1, 2):  # a mesh of one device is a mesh too
        user = jax.make_mesh((size,), ("d",), devices=jax.devices()[:size], axis_types=(kind,))
        with jax.set_mesh(user):
            want = jax.jit(constrained)(x)
            got = pw.program(constrained)(x).result()
        assert_matches(got, want)
        assert got.sharding.mesh.devices.tolist() == want.sharding.mesh.devices.tolist()
        assert got.sharding.spec == want.sharding.spec


def test_ambient_explicit_mesh_is_set_aside_inside_the_program():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 4})
    seen = []

    @pw.program(devices=s)
    def prog(v):
        seen.append(jax.sharding.get_abstract_mesh())
        return v * 2

    user = jax.make_mesh((2,), ("data",), axis_types=(Explicit,))
    with jax.set_mesh(user):
        x = jnp.arange(8.0)
        out = prog(x)
        assert jax.sharding.get_abstract_mesh() == user.abstract_mesh
    assert_matches(out, jnp.arange(8.0) * 2)
    assert seen == [s.mesh]


def _explicit_body(v, w):
    v = jax.sharding.reshard(v, P("x", None))
    y = jnp.tanh(v) @ w  # (8, 4) @ (4, 4): rows stay split over "x"
    return y, jax.sharding.reshard(y.sum(1), P())


def test_explicit_slice_matches_jit_under_set_mesh_of_the_same_explicit_mesh():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 4}, axis_types=Explicit)
    assert s.axis_types == (Explicit,) and s.mesh.axis_types == (Explicit,)
    assert s.physical_mesh.axis_types == (Explicit,)
    seen = []

    @pw.program(devices=s)
    def prog(v, w):
        v = jax.sharding.reshard(v, P("x", None))
        seen.append(jax.typeof(v).sharding)
        return _explicit_body(v, w)

    x = jnp.arange(32.0).reshape(8, 4) / 32
    w = jnp.eye(4) + 0.5
    mesh = jax.make_mesh((4,), ("x",), axis_types=(Explicit,))
    with jax.set_mesh(mesh):
        want = jax.jit(_explicit_body)(x, w)
    got = prog(x, w)
    assert_matches(got, want, rtol=1e-5)
    for g, expected in zip(got, want, strict=True):
        assert g.result().sharding.spec == expected.sharding.spec
    assert seen == [NamedSharding(s.mesh, P("x", None))]
    # Futures come back in with their types: no re-trace for the second call.
    again = prog(got[0], w)
    assert again[0].result().sharding.spec == P("x", None)


def test_explicit_pw_jit_specs_are_types():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 4}, axis_types=(Explicit,))
    types = []

    @pw.jit(devices=s, in_specs=P("x"), out_specs=P())
    def f(v):
        types.append(jax.typeof(v).sharding.spec)
        return v * 3

    x = jnp.arange(16.0)
    out = f(x).result()
    assert types == [P("x")]
    assert out.sharding.is_equivalent_to(s.sharding(), 1)
    assert_matches(out, x * 3)


@pytest.mark.parametrize("slice_types", [Auto, Explicit])
@pytest.mark.parametrize("user_types", [Auto, Explicit])
@pytest.mark.parametrize(("names", "first"), [(("data",), 0), (("data",), 4), (("x",), 6)])
def test_inputs_sharded_on_user_meshes_are_accepted(slice_types, user_types, names, first):
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 4}, axis_types=slice_types)
    user = jax.make_mesh((2,), names, axis_types=(user_types,), devices=jax.devices()[first : first + 2])
    x = jax.device_put(jnp.arange(16.0), NamedSharding(user, P(names[0])))
    prog = pw.program(lambda v: jnp.cos(v) + 1, devices=s)
    f = pw.jit(lambda v: v * 3, devices=s, in_specs=P("x"), out_specs=P("x"))
    want_prog = jax.jit(lambda v: jnp.cos(v) + 1)(x)
    assert_matches(prog(x), want_prog)
    out = f(x)
    assert_matches(out, jax.jit(lambda v: v * 3)(x))
    assert out.result().sharding == s.sharding("x")
    assert set(out.result().sharding.device_set) == set(s.devices)


def test_slices_with_different_axis_types_share_devices_and_compile_apart():
    pw.init(num_cpu_devices=8)
    auto = pw.devices(mesh={"x": 4}, device_ids=[0, 1, 2, 3])
    explicit = pw.devices(mesh={"x": 4}, device_ids=[0, 1, 2, 3], axis_types=Explicit)
    assert auto.devices == explicit.devices and auto.mesh != explicit.mesh
    spec_of = {}

    def body(v):
        spec_of[jax.sharding.get_abstract_mesh().axis_types] = jax.typeof(v * 2).sharding.spec
        return v * 2

    x = jax.device_put(jnp.arange(8.0), auto.sharding("x"))
    outs = [pw.program(body, devices=sl)(x) for sl in (auto, explicit)]
    for out in outs:
        assert_matches(out, jnp.arange(8.0) * 2)
    assert outs[1].result().sharding.mesh.axis_types == (Explicit,)
    assert spec_of[(Explicit,)] == P("x")


@pytest.mark.parametrize(
    ("axis_types", "match"),
    [
        ((Explicit,), "2 axes"),
        ((Explicit, Auto, Auto), "2 axes"),
        (("Explicit", Auto), "AxisType values"),
        ("Explicit", "AxisType or a tuple"),
        ((AxisType.Manual, Auto), "Manual"),
    ],
)
def test_bad_axis_types_raise_resource_error(axis_types, match):
    pw.init(num_cpu_devices=8)
    with pytest.raises(pw.errors.ResourceError, match=match):
        pw.devices(mesh={"x": 2, "y": 2}, axis_types=axis_types)


@pytest.mark.parametrize("fuse", [True, False])
def test_inner_jit_out_shardings_on_explicit_axes_follow_the_values_types_as_under_jax_jit(fuse):
    # Under an Explicit mesh an inner jax.jit's output is typed by its input's sharding, not by its
    # out_shardings: the fused executable constrained it to out_shardings, which Explicit axes assert.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(Explicit,) * 2)
    with jax.set_mesh(mesh):
        inner = jax.jit(lambda a: a * 2, out_shardings=P(None, "model"))
        inner2 = jax.jit(lambda a: a - 1, out_shardings=P("model", None))
        x = jax.device_put(jnp.ones((8, 16)), P("data"))
        for f in (lambda a: inner(a) + 1, inner, lambda a: inner2(inner(a))):
            # pw.program(inner) stands where inner was called: its outputs take its out_shardings
            # as inner(x)'s do (P(None, "model")), not as a jax.jit around it (P("data", None)).
            want = inner(x) if f is inner else jax.jit(f)(x)
            got = pw.program(f, fuse=fuse)(x)
            assert_matches(got, want, rtol=0, atol=0)
            assert got.result().sharding == want.sharding


def test_output_specs_are_named_after_the_first_argument_s_as_jax_jit_names_them():
    # XLA's output sharding is named after an equivalent input sharding: jax.jit's first argument's.
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(Auto,))
    trailing = NamedSharding(mesh, P("fsdp", None))
    p = jax.device_put(jnp.ones((16, 16)), trailing)
    x = jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P("fsdp")))

    def step(p, x):
        return p - 0.1 * jax.grad(lambda p: jnp.sum(x @ p))(p)

    want, got = jax.jit(step)(p, x), pw.program(step)(p, x)
    assert_matches(got, want, rtol=1e-6)
    assert want.sharding == trailing
    assert got.result().sharding == want.sharding  # P("fsdp", None), not the equivalent P("fsdp")
