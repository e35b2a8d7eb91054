"""JAX/Flax/Optax code with ``jax.jit`` swapped for ``pw.jit`` or ``pw.program``, compared with plain JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, init_with_ema, jax_config, train_with_ema

import pathways_jax as pw


def test_a_pw_jit_static_argument_made_abstract_by_eval_shape_is_refused_clearly():
    # jax.eval_shape traces every argument of a function that is not a jax.jit function itself;
    # pw.jit then failed in jax.jit's hashing ("Non-hashable static arguments ... DynamicJaxprTracer"),
    # naming neither the argument nor what to do. A program says so; pw.jit now does too.
    def fun(v, n):
        return jnp.tile(v, n)

    x = jnp.ones(3)
    want = jax.jit(fun, static_argnums=1).eval_shape(x, 2)
    s = pw.devices(mesh={"x": 2})
    for ours in (pw.jit(fun, static_argnums=1), pw.jit(fun, static_argnums=1, devices=s)):
        assert ours.eval_shape(x, 2) == want
        with pytest.raises(
            pw.errors.ProgramTraceError, match=r"static argument 1 .* is a JAX tracer"
        ) as info:
            jax.eval_shape(ours, x, 2)
        assert isinstance(info.value, ValueError)  # what jax.jit raises for an unhashable static
        assert "fun.eval_shape(...)" in str(info.value) and "test_dropin_round43.py" in str(info.value)
    named = pw.jit(fun, static_argnames="n")
    with pytest.raises(pw.errors.ProgramTraceError, match=r"static argument 'n' .* is a JAX tracer"):
        jax.eval_shape(lambda v, n: named(v, n=n), x, 2)


def test_an_argument_returned_twice_then_donated_trains_as_under_jax_jit():
    # An EMA (or a DQN target network) starts as a copy of the parameters. Under jax.jit each
    # output is its own buffer; a program returned the caller's arrays themselves, so the
    # donating step got one buffer twice ("Attempt to donate the same buffer twice") and the
    # caller's parameters were deleted.
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    x = jnp.ones(8)
    want = jax.jit(init_with_ema)(params)
    for _ in range(2):
        want = jax.jit(train_with_ema, donate_argnums=0)(want, x)
    state = pw.program(init_with_ema)(params)
    step = pw.program(train_with_ema, donate_argnums=0)
    for _ in range(2):
        state = step(state, x)
    assert_matches(state, want)
    assert not params["w"].is_deleted()


def test_each_output_is_its_own_array_as_under_jax_jit():
    x = jnp.arange(3.0)
    first, second, same = pw.program(lambda v: ((y := v * 2), y, v))(x)
    first.delete()  # as jax.jit's outputs, deleting one leaves the others and the argument
    np.testing.assert_array_equal(np.asarray(second), [0.0, 2.0, 4.0])
    assert not x.is_deleted()
    same.delete()
    assert not x.is_deleted()


def test_pw_jit_calls_under_grad_or_vmap_inside_a_program_keep_their_slices():
    # Model parallelism by hand: two pw.jit stages on two islands, differentiated (or vmapped)
    # inside the program. The stages' scopes came back wrapped by the transformation
    # (``jvp(pw_jit0)``, ``transpose(jvp(pw_jit0))``) and matched no slice: the whole step ran
    # as one node on a one-device slice of its own, neither stage where its pw.jit put it.
    pw.init(islands=2)
    a = pw.devices(mesh={"x": 4})
    b = pw.devices(mesh={"x": 4}, island=1)
    first = pw.jit(lambda x, w: jnp.tanh(x @ w), devices=a, in_specs=(pw.P("x"), pw.P()), out_specs=pw.P("x"))
    second = pw.jit(lambda h, w: ((h @ w) ** 2).mean(), devices=b)

    def loss(w1, w2, x, stage1, stage2):
        return stage2(stage1(x, w1), w2)

    def step(w1, w2, x):
        return jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x, first, second)

    def ensemble(ws, w2, x):
        return jax.vmap(lambda w: loss(w, w2, x, first, second))(ws)

    def plain(h, w):
        return ((h @ w) ** 2).mean()

    w1, w2 = jnp.full((4, 4), 0.1), jnp.full((4, 2), 0.2)
    x = jnp.arange(32.0).reshape(8, 4) / 32
    want = jax.jit(
        lambda w1, w2, x: jax.value_and_grad(loss, argnums=(0, 1))(
            w1, w2, x, lambda x, w: jnp.tanh(x @ w), plain
        )
    )(w1, w2, x)
    assert_matches(pw.program(step)(w1, w2, x), want, rtol=1e-5)
    graph = pw.program(step).graph(w1, w2, x)
    # first's forward and backward on a, second's forward and backward on b: two DCN hops.
    assert [n.slice for n in graph.nodes] == [a, b, a]
    assert [t.kind for t in graph.transfers] == ["dcn", "dcn"]

    ws = jnp.stack([w1, 2 * w1])
    want = jax.vmap(lambda w: loss(w, w2, x, lambda x, w: jnp.tanh(x @ w), plain))(ws)
    assert_matches(pw.program(ensemble)(ws, w2, x), want, rtol=1e-5)
    assert [n.slice for n in pw.program(ensemble).graph(ws, w2, x).nodes] == [a, b]

    # Under jax.checkpoint only the backward's recomputation is used: no node runs the forward.
    remat = jax.checkpoint(lambda w1: loss(w1, w2, x, first, second))
    want = jax.grad(jax.checkpoint(lambda w1: loss(w1, w2, x, lambda x, w: jnp.tanh(x @ w), plain)))(w1)
    assert_matches(pw.program(lambda w1: jax.grad(remat)(w1))(w1), want, rtol=1e-5)
    assert len(pw.program(lambda w1: jax.grad(remat)(w1)).graph(w1).nodes) == 1


def test_a_python_int_too_large_names_its_argument_as_jax_jit_does():
    def add(x, n):
        return x + n

    with pytest.raises(OverflowError, match=r"argument path is n"):
        jax.jit(add)(jnp.ones(2), 2**40)
    program = pw.program(add)
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"argument leaf 1, the Python int 1099511627776"
    ) as info:
        program(jnp.ones(2), 2**40)
    assert isinstance(info.value, OverflowError)  # what jax.jit raises
    np.testing.assert_array_equal(np.asarray(program(jnp.ones(2), 3)), [4.0, 4.0])  # the repeat call's path
    with pytest.raises(OverflowError, match=r"argument leaf 1"):
        program(jnp.ones(2), -(2**31) - 1)
    with jax_config("jax_enable_x64", True):  # an int64 then: taken, as by jax.jit
        want = jax.jit(add)(jnp.ones(2, jnp.int64), 2**40)
        np.testing.assert_array_equal(np.asarray(pw.program(add)(jnp.ones(2, jnp.int64), 2**40)), want)


def test_a_shape_dtype_struct_passed_to_a_call_says_to_ask_the_program_for_shapes():
    def double(v):
        return v * 2

    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    with pytest.raises(TypeError):  # jax.jit's
        jax.jit(double)(spec)
    program = pw.program(double)
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"a jax.ShapeDtypeStruct .*program.eval_shape"
    ) as info:
        program(spec)
    assert isinstance(info.value, TypeError) and "static_argnums" not in str(info.value)
    assert program.eval_shape(spec) == jax.jit(double).eval_shape(spec)
