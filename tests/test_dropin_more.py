"""More drop-in use: ``jax.jit`` options as third-party training code passes them.

Each test runs the same function under plain ``jax.jit`` (or ``nnx.jit``) and
``@pw.program`` on identical inputs and compares the results.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import assert_matches

import pathways_jax as pw
from pathways_jax import errors

pytestmark = pytest.mark.timeout(120)


def _scaled(x, n, *, mode="add"):
    return x * n if mode == "mul" else x + n


def test_static_argnames_by_keyword_and_by_position_match_jax_jit():
    s = pw.devices(mesh={"x": 2})
    x = jnp.arange(4.0)
    ref = jax.jit(_scaled, static_argnames=("n", "mode"))
    prog = pw.program(_scaled, devices=s, static_argnames=("n", "mode"))
    calls = [((x, 2), {}), ((x,), {"n": 3}), ((x, 3), {"mode": "mul"}), ((x,), {"n": 2, "mode": "mul"})]
    for args, kwargs in calls:
        assert_matches(prog(*args, **kwargs), ref(*args, **kwargs))
    pw.reset_counters()
    prog(x, n=3)
    prog(x, n=3)
    assert pw.counters()["traces"] == 0  # seen above: neither re-traced nor re-lowered
    assert pw.counters()["lowerings"] == 0
    s.release()


def test_static_argnums_passed_by_keyword_is_static_as_in_jax_jit():
    s = pw.devices(mesh={"x": 2})
    x = jnp.arange(4.0)
    want = jax.jit(_scaled, static_argnums=1)(x, n=5)
    assert_matches(pw.program(_scaled, devices=s, static_argnums=1)(x, n=5), want)
    s.release()


def test_static_argnames_with_nnx_modules_match_nnx_jit():
    s = pw.devices(mesh={"x": 2})

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(1.0, 5.0))

        def __call__(self, x, train):
            return x * self.w * (2.0 if train else 1.0)

    def apply(model, x, train):
        return model(x, train)

    x = jnp.arange(4.0)
    ref = nnx.jit(apply, static_argnames="train")
    prog = pw.program(apply, devices=s, static_argnames="train")
    for train in (True, False):
        assert_matches(prog(Scale(), x, train=train), ref(Scale(), x, train=train))
    assert_matches(prog(Scale(), x, True), ref(Scale(), x, True))
    s.release()


def test_bad_static_argnames_is_a_named_error():
    with pytest.raises(errors.ProgramTraceError, match="static_argnames must be strings"):
        pw.program(_scaled, static_argnames=(1,))
    prog = pw.program(functools.partial(_scaled, mode="mul"), static_argnames="n")
    with pytest.raises(errors.ProgramTraceError, match="must be hashable"):
        prog(jnp.ones(2), n=[1])
