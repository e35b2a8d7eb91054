"""JAX/Flax/Optax code with ``jax.jit`` / ``nnx.jit`` swapped for ``pw.program``, compared with plain JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pathways_jax as pw


def _accumulate(ref, x):
    ref[...] += x
    return ref[...] * 2


def test_a_jax_ref_argument_is_updated_in_place_as_under_jax_jit():
    # jax.new_ref is public JAX: jax.jit takes a Ref argument and writes into it. A program
    # refused it ("argument leaf 0 of type Ref ... Pass other values through static_argnums",
    # or, Flax imported, "a Flax NNX object that is not a pytree while nnx.set_graph_mode(False)").
    want_ref = jax.new_ref(jnp.zeros(4))
    step = jax.jit(_accumulate)
    want = [np.asarray(step(want_ref, jnp.ones(4))) for _ in range(2)]
    s = pw.devices(mesh={"x": 2})
    for ours in (pw.program(_accumulate), pw.program(_accumulate, devices=s), pw.jit(_accumulate, devices=s)):
        ref = jax.new_ref(jnp.zeros(4))
        got = [np.asarray(ours(ref, jnp.ones(4))) for _ in range(2)]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.asarray(ref[...]), np.asarray(want_ref[...]))
        assert ref[...].sharding == want_ref[...].sharding  # the value stays where the Ref held it
    # lower, as jax.jit's, takes the Ref too, and warms the call; graph shows what it runs.
    program = pw.program(_accumulate)
    assert program.lower(ref, jnp.ones(4)).as_text() == step.lower(ref, jnp.ones(4)).as_text()
    compiles = pw.counters()["compiles"]
    np.testing.assert_array_equal(np.asarray(program(ref, jnp.ones(4))), step(want_ref, jnp.ones(4)))
    assert pw.counters()["compiles"] == compiles
    assert len(program.graph(ref, jnp.ones(4)).nodes) == 1
    # A call that fails while traced leaves the Ref as it was, as under jax.jit.
    with pytest.raises(pw.errors.ProgramTraceError, match=r"test_dropin_round45\.py"):
        pw.program(lambda r, x: _accumulate(r, x @ x))(ref, jnp.ones((2, 3)))
    np.testing.assert_array_equal(np.asarray(ref[...]), np.asarray(want_ref[...]))


def test_one_ref_passed_twice_is_refused_as_by_jax_jit():
    def both(a, b):
        a[...] += 1
        return b[...]

    ref = jax.new_ref(jnp.zeros(2))
    with pytest.raises(ValueError, match="only one reference to a mutable array"):
        jax.jit(both)(ref, ref)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"one jax\.Ref as argument leaves 0 and 1") as info:
        pw.program(both)(ref, ref)
    assert isinstance(info.value, ValueError)


class _Counted(nnx.Module):
    def __init__(self, rngs):
        self.calls = nnx.BatchStat(jnp.array(0))
        self.linear = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x):
        self.calls[...] += 1
        return self.linear(x)


def test_an_nnx_model_in_flax_ref_mode_is_updated_in_place_as_under_nnx_jit():
    # nnx.var_defaults(ref=True): Variables hold jax.Refs; nnx.jit (and jax.jit) update them in
    # place. A program refused them ("a Flax NNX object that is not a pytree ...").
    x = jnp.ones((4, 2))
    with nnx.var_defaults(ref=True):
        want_model = _Counted(nnx.Rngs(0))
        model = _Counted(nnx.Rngs(0))
    forward = nnx.jit(lambda m, v: m(v).sum())
    want = [np.asarray(forward(want_model, x)) for _ in range(2)]
    program = pw.program(lambda m, v: m(v).sum())
    got = [np.asarray(program(model, x)) for _ in range(2)]
    np.testing.assert_array_equal(got, want)
    assert int(model.calls[...]) == int(want_model.calls[...]) == 2


def _hijax_step(model, x):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        return jnp.mean(nnx.merge(graphdef, params, rest)(x) ** 2)

    grads = jax.grad(loss_fn)(nnx.with_vars(params, hijax=False))
    jax.tree.map(lambda p, g: p.set_value(p.get_value() - 0.1 * g.get_value()), params, grads)


def test_an_nnx_model_in_flax_hijax_mode_trains_as_under_jax_jit():
    # Flax's hijax mode (its nnx_toy_examples/hijax_basic.py): Variables are JAX hijax types and
    # plain jax.jit updates the model in place.
    x = jnp.ones((4, 2))
    with nnx.var_defaults(hijax=True):
        want = _Counted(nnx.Rngs(0))
        model = _Counted(nnx.Rngs(0))
    for _ in range(2):
        jax.jit(_hijax_step)(want, x)
    step = pw.program(_hijax_step)
    for _ in range(2):
        step(model, x)
    np.testing.assert_array_equal(np.asarray(model.linear.kernel[...]), np.asarray(want.linear.kernel[...]))
    assert int(model.calls[...]) == int(want.calls[...]) == 2


def test_a_ref_made_inside_a_program_whose_nodes_are_on_two_islands_computes_as_under_jax_jit():
    # A Ref made inside (jax.new_ref) and used on both sides of pw.jit calls placed on two
    # islands crossed from one node to the next as a plain array ("`swap` must be called on
    # `Ref` types"); so did a Ref argument's. The program's Refs are now threaded as values.
    pw.init(num_cpu_devices=8, islands=2)
    first = pw.jit(lambda v: v * 3, devices=pw.devices(mesh={"x": 2}, island=0))
    second = pw.jit(lambda v: v + 100, devices=pw.devices(mesh={"x": 2}, island=1))

    def made_inside(x):
        ref = jax.new_ref(x)
        old = ref[...]
        ref[...] = first(old) + x
        return second(old), ref[...]

    def reference(x):
        ref = jax.new_ref(x)
        old = ref[...]
        ref[...] = old * 3 + x
        return old + 100, ref[...]

    x = jnp.arange(4.0)
    want = jax.jit(reference)(x)
    program = pw.program(made_inside)
    assert len(program.graph(x).nodes) == 2
    for got, expected in zip(program(x), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))

    def given(ref, x):
        return made_inside(ref[...] + x)[0] + _accumulate(ref, x)

    want_ref, ref = jax.new_ref(x), jax.new_ref(x)
    want = jax.jit(lambda r, v: reference(r[...] + v)[0] + _accumulate(r, v))(want_ref, x)
    np.testing.assert_array_equal(np.asarray(pw.program(given)(ref, x)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(ref[...]), np.asarray(want_ref[...]))
