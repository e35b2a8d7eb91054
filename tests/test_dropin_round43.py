"""JAX/Flax/Optax code with ``jax.jit`` swapped for ``pw.jit`` or ``pw.program``, compared with plain JAX."""

import jax
import jax.numpy as jnp
import pytest

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
