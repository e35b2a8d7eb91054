"""Values and calls ``jax.jit`` takes, given to programs: results, types and shardings as ``jax.jit``'s."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_matches
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_jax as pw


def _outputs(x, y):
    return {"twice": x * 2, "same": x, "zeros": jnp.zeros(3), "scalar": 3.0, "y": y}


def test_a_program_given_device_returns_single_device_shardings_as_jax_jit_does():
    # pw.program(f, device=d) (and pw.jit(f, device=d)) returned outputs with a NamedSharding on a
    # one-device mesh of its own, where jax.jit(f, device=d) gives SingleDeviceSharding(d): the two
    # compared unequal, and the outputs were typed with a mesh the user never made.
    device = jax.devices()[3]
    x, y = jnp.arange(4.0), jax.device_put(jnp.ones(2), device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # device= is deprecated in jax.jit
        want = jax.jit(_outputs, device=device)
        want_out = want(x, y)
        for ours in (pw.program(_outputs, device=device), pw.jit(_outputs, device=device)):
            out = ours(x, y)
            assert_matches(out, want_out)
            for name, expected in want_out.items():
                assert type(out[name].sharding) is type(expected.sharding), name
                assert out[name].sharding == expected.sharding, name
                got = out[name].result(timeout=60)
                assert got.sharding == expected.sharding, name
                assert jax.typeof(got) == jax.typeof(expected), name
            compiled, want_compiled = ours.lower(x, y).compile(), want.lower(x, y).compile()
            assert compiled.input_shardings == want_compiled.input_shardings
            assert compiled.output_shardings == want_compiled.output_shardings


def test_a_constant_output_of_a_call_committed_arguments_place_on_one_device_has_no_mesh_in_its_type():
    # Committed one-device arguments place the call on their device; a Python constant returned
    # beside other outputs came back typed on a one-device mesh 'x' of the program's own
    # (jax.typeof(out).sharding.mesh), where jax.jit's has none.
    device = jax.devices()[5]
    x, y = jax.device_put(jnp.arange(4.0), device), jax.device_put(jnp.ones(2), device)
    want = jax.jit(_outputs)(x, y)
    out = pw.results(pw.program(_outputs)(x, y))
    assert_matches(out, want)
    for name, expected in want.items():
        assert out[name].sharding == expected.sharding, name
        assert jax.typeof(out[name]) == jax.typeof(expected), name
    assert (out["scalar"] + want["twice"]).sharding == expected.sharding


def _doubled_and_sum(x):
    return x * 2, x.sum()


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("given", ["in", "in_out", "in_donate", "out"])
def test_lower_of_a_program_given_shardings_keeps_them_as_jax_jit_does(axis_type, given):
    # pw.program(f, in_shardings=s, out_shardings=...).lower(x).compile().input_shardings gave
    # GSPMDSharding (the function compiled inside a second jax.jit), where jax.jit keeps the
    # NamedSharding given; with donate_argnums too, and out_shardings alone lowered another text.
    # pw.jit(f, in_shardings=s, donate_argnums=0) did the same, and pw.jit or pw.program of a
    # jax.jit function given out_shardings on Explicit axes failed to lower at all.
    mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    sharded = NamedSharding(mesh, P("x"))
    options = {
        "in": {"in_shardings": sharded},
        "in_out": {"in_shardings": sharded, "out_shardings": (sharded, NamedSharding(mesh, P()))},
        "in_donate": {"in_shardings": sharded, "donate_argnums": 0},
        "out": {"out_shardings": (sharded, NamedSharding(mesh, P()))},
    }[given]
    want = jax.jit(_doubled_and_sum, **options)
    x = jnp.arange(8.0)
    want_lowered = want.lower(x)
    want_compiled = want_lowered.compile()
    for ours in (
        pw.program(_doubled_and_sum, **options),
        pw.jit(_doubled_and_sum, **options),
        pw.program(jax.jit(_doubled_and_sum, **options)),
        pw.jit(jax.jit(_doubled_and_sum, **options)),
    ):
        lowered = ours.lower(x)
        assert lowered.as_text() == want_lowered.as_text()
        compiled = lowered.compile()
        assert compiled.input_shardings == want_compiled.input_shardings
        assert compiled.output_shardings == want_compiled.output_shardings
        assert str(ours.trace(x).jaxpr) == str(want.trace(x).jaxpr)
        assert ours.eval_shape(x) == want.eval_shape(x)
        out, want_out = pw.results(ours(jnp.arange(8.0))), want(jnp.arange(8.0))
        assert_matches(out, want_out)
        for got, expected in zip(out, want_out, strict=True):
            assert got.sharding == expected.sharding
            assert jax.typeof(got) == jax.typeof(expected)


def _explicit_loss(w, x):
    h = jnp.tanh(x @ jax.sharding.reshard(w, P(None, "x")))
    return jnp.sum(h**2), h


def test_under_with_slice_the_callers_eager_grad_of_a_program_on_an_explicit_slice_adds_other_uses_of_the_input():
    # Under `with s:` (as under jax.set_mesh(s.physical_mesh)), jax.grad of a loss reading the
    # parameters both through a program (or pw.jit) on an Explicit-axes slice and in eager code
    # failed ("incompatible devices ... device ids [0]"): the program put the uncommitted
    # parameters on the slice, and the transpose of that move brought their cotangent back
    # committed to device 0. jax.jit there takes them as they are.
    s = pw.devices(mesh={"x": 4}, axis_types=AxisType.Explicit)
    w, x = jnp.full((8, 8), 0.1), jnp.arange(32.0).reshape(4, 8) / 32

    def losses(f):
        return (
            lambda v: f(v, x)[0] + 0.1 * jnp.sum(v**2),
            lambda v: f(v, x)[0] + f(v * 2, x)[0],
        )

    with jax.set_mesh(s.physical_mesh):
        want = [jax.grad(loss)(w) for loss in losses(jax.jit(_explicit_loss))]
    for ours in (
        pw.program(_explicit_loss, devices=s),
        pw.jit(_explicit_loss, devices=s),
    ):
        with s:
            got = [jax.grad(loss)(w) for loss in losses(ours)]
        assert_matches(got, want)
        for g, expected in zip(got, want, strict=True):
            assert jax.typeof(g) == jax.typeof(expected)
    s.release()


def _tanh_sum(w, x):
    return jnp.tanh(x @ w).sum()


def test_the_callers_eager_vmap_of_grad_of_a_program_on_an_explicit_slice_computes_as_jax_jit():
    # jax.vmap(jax.grad(f)) of a program (or pw.jit) on an Explicit-axes slice, outside any mesh,
    # failed ("is_fully_addressable is not implemented for jax.sharding.AbstractMesh"): the move
    # that retypes its outputs for the caller had its source taken from the outputs' abstract type.
    s = pw.devices(mesh={"x": 4}, axis_types=AxisType.Explicit)
    w, xs = jnp.full((8, 8), 0.1), jnp.arange(64.0).reshape(2, 4, 8) / 64
    with jax.set_mesh(s.physical_mesh):
        want = jax.vmap(jax.grad(jax.jit(_tanh_sum)), in_axes=(None, 0))(w, xs)
    for ours in (pw.program(_tanh_sum, devices=s), pw.jit(_tanh_sum, devices=s)):
        assert_matches(jax.vmap(jax.grad(ours), in_axes=(None, 0))(w, xs), want)
    s.release()


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.int2])
def test_sub_byte_values_on_one_device_come_back_as_jax_jit_gives_them(dtype):
    # int4 arrays a program computed on the one device that device= or committed arguments
    # placed it on came back with a NamedSharding on a one-device mesh of the program's own
    # (typed with it), where jax.jit gives SingleDeviceSharding and no mesh in the type.
    device = jax.devices()[2]
    values = jnp.arange(6).astype(dtype).reshape(2, 3)

    def twice(v):
        return v, v + v

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # device= is deprecated in jax.jit
        calls = [
            (jax.jit(twice, device=device), pw.program(twice, device=device), values),
            (jax.jit(twice), pw.program(twice), jax.device_put(values, device)),
        ]
        for want, ours, arg in calls:
            want_out = want(arg)
            for _ in range(2):  # the repeat call too
                out = pw.results(ours(arg))
                assert_matches(out, want_out)
                for got, expected in zip(out, want_out, strict=True):
                    assert got.sharding == expected.sharding
                    assert jax.typeof(got) == jax.typeof(expected)


@pytest.mark.parametrize("fun", [lambda a, b: (a, b), lambda a, b: b], ids=["returned", "unused"])
def test_a_python_int_too_large_for_int32_is_refused_as_jax_jit_refuses_it_wherever_it_goes(fun):
    # jax.jit refuses a Python int beyond int32 (x64 off) whatever the function does with it.
    # A program refused it only where a computation read it: returned as it is, it raised a
    # bare OverflowError from jnp.asarray once the run was made; unused, it was taken silently.
    x = jnp.ones(2)
    with pytest.raises(OverflowError):
        jax.jit(fun)(2**40, x)
    with pytest.raises(pw.errors.ProgramTraceError) as raised:
        pw.results(pw.program(fun)(2**40, x))
    assert isinstance(raised.value, OverflowError)
    assert "int32" in str(raised.value)


def _doubled_pair(x, y):
    return x * 2, y + 1


@pytest.mark.parametrize("inner", ["jax.jit", "pw.jit"])
def test_a_donation_of_a_function_called_inside_a_program_leaves_the_programs_arguments_alone(inner):
    # Under jax.jit, an inner jax.jit's donate_argnums is ignored: only the outer call's own
    # donation consumes the caller's arrays. A program consumed them: the caller's x read as
    # deleted after a program that was never asked to donate.
    maker = jax.jit if inner == "jax.jit" else pw.jit
    donating = maker(_doubled_pair, donate_argnums=0)

    def step(a, b):
        return donating(a, b)

    x, y = jnp.arange(8.0), jnp.arange(8.0)
    want = jax.jit(step)(x, y)
    assert not x.is_deleted()
    out = pw.results(pw.program(step)(x, y))
    assert_matches(out, want)
    assert not x.is_deleted()
