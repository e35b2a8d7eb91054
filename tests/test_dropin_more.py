"""More drop-in use: ``jax.jit`` options as third-party training code passes them.

Each test runs the same function under plain ``jax.jit`` (or ``nnx.jit``) and
``@pw.program`` on identical inputs and compares the results.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import assert_matches, jax_config

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


# --- jax_debug_nans / jax_debug_infs -----------------------------------------------------


def _log_then_scale(x):
    y = jnp.log(x)  # the NaN is made here
    return y * 2


def _line_of_nan() -> int:
    lines, first = inspect.getsourcelines(_log_then_scale)
    return next(first + i for i, text in enumerate(lines) if "the NaN is made here" in text)


_bump = jax.jit(lambda v: v + 1)
_FORMS = {
    "one_node": _log_then_scale,
    "among_nodes": lambda v: _bump(jax.jit(_log_then_scale)(_bump(v))),
    "nested_jit": lambda v: jax.jit(_log_then_scale)(v) + 1,
}


@pytest.mark.parametrize("form", list(_FORMS))
def test_debug_nans_raises_floating_point_error_naming_the_operation_and_line(form):
    fun = _FORMS[form]
    prog = pw.program(fun, fuse=False)
    bad, good = jnp.array([-2.0, 1.0]), jnp.array([2.0, 1.0])
    with jax_config("jax_debug_nans", True):
        with pytest.raises(FloatingPointError, match=r"invalid value \(nan\) encountered in log"):
            jax.jit(fun)(bad).block_until_ready()
        out = prog(bad)
        with pytest.raises(FloatingPointError, match=r"invalid value \(nan\) encountered in log") as info:
            out.result(timeout=60)
        assert isinstance(info.value, errors.ProgramFailedError)  # and pathways_jax's own type
        assert f"test_dropin_more.py:{_line_of_nan()}" in str(info.value)  # the user's line
        # The controller goes on: the next call with valid inputs is exact.
        assert_matches(prog(good), jax.jit(fun)(good))


def test_debug_infs_raises_for_an_inf_as_jax_jit_does():
    divide = lambda x: 1.0 / x  # noqa: E731
    with jax_config("jax_debug_infs", True):
        with pytest.raises(FloatingPointError):
            jax.jit(divide)(jnp.zeros(2)).block_until_ready()
        with pytest.raises(FloatingPointError, match="invalid value \\(inf\\) encountered in div"):
            pw.program(divide)(jnp.zeros(2)).result(timeout=60)
        assert_matches(pw.program(divide)(jnp.ones(2)), jax.jit(divide)(jnp.ones(2)))


def test_a_run_that_fails_on_its_devices_raises_what_jax_jit_raises_there_too():
    """Code written for jax.jit catches a device-side failure by JAX's class, and by ours."""

    def refuse(a):
        raise ValueError("bad value in callback")

    def fun(x):
        return jax.pure_callback(refuse, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    with pytest.raises(jax.errors.JaxRuntimeError, match="bad value in callback"):
        jax.jit(fun)(jnp.ones(2)).block_until_ready()
    with pytest.raises(jax.errors.JaxRuntimeError, match="bad value in callback") as info:
        pw.program(fun)(jnp.ones(2)).result(timeout=60)
    assert isinstance(info.value, errors.ProgramFailedError)
