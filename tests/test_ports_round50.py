"""Programs written for jax.jit / nnx.jit, with only the decorator changed, compared with the original (round 50)."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)

_DECORATORS = [pw.program, pw.jit]
_IDS = ["program", "pw-jit"]


def _bits(tree):
    return [
        (np.asarray(leaf).dtype.str, np.asarray(leaf).tobytes()) for leaf in jax.tree.leaves(pw.results(tree))
    ]


@pytest.mark.parametrize("decorate", _DECORATORS, ids=_IDS)
def test_the_ref_guides_closed_over_ref_is_written_as_under_jax_jit(decorate):
    # The first example of JAX's Ref guide: `@jax.jit def f(): x_ref[1] += 1.`. With the decorator
    # changed, the call raised PlacementError ("Too many leaves for PyTreeDef; expected 0"): the Ref
    # the function closes over became a constant of a node, whose writes had nowhere to go.
    refs = []
    for make in (jax.jit, decorate):
        x_ref = jax.new_ref(jnp.zeros(3))
        refs.append(x_ref)

        def f(x_ref=x_ref):
            x_ref[1] += 1.0

        step = make(lambda: f())
        step()
        pw.results(step())
    assert _bits(refs[1][...]) == _bits(refs[0][...])
    np.testing.assert_array_equal(refs[1][...], [0.0, 2.0, 0.0])


@pytest.mark.parametrize("decorate", _DECORATORS, ids=_IDS)
def test_closed_over_refs_read_and_written_in_inner_jits_loops_and_beside_ref_arguments(decorate):
    # Closed-over Refs of two dtypes, read and written at the top, in an inner jax.jit and in a scan
    # body, beside a Ref argument, in a loop fed its own futures: jax.jit's values, bit for bit.
    ends = []
    for make in (jax.jit, decorate):
        total = jax.new_ref(jnp.zeros(3))
        count = jax.new_ref(jnp.int8(0))
        scaled = jax.jit(lambda x, total=total: total[...] * x)

        def step(x, seen, total=total, count=count, scaled=scaled):
            total[1] += x.sum()
            seen[...] += 1.0

            def body(carry, xi):
                count[...] += 1
                return carry + total[...].sum() * xi, None

            s, _ = jax.lax.scan(body, 0.0, x)
            return scaled(x) / 8, s

        seen = jax.new_ref(jnp.zeros(2, jnp.bfloat16))
        f = make(step)
        x, outs = jnp.arange(3.0), []
        for _ in range(3):
            x, s = f(x, seen)
            outs.append(s)
        ends.append(_bits((x, outs, total[...], count[...], seen[...])))
    assert ends[1] == ends[0]


def test_a_closed_over_ref_is_not_traced_again_at_later_calls():
    # The first call traces to find the Refs, then runs with them as inputs; later calls of the
    # same signature trace nothing (as jax.jit's do) and write the Ref each time.
    total = jax.new_ref(jnp.zeros(2))
    traces = []

    @pw.program
    def step(x):
        traces.append(1)
        total[...] += x
        return x * 2

    pw.results(step(jnp.ones(2)))
    first = len(traces)
    for _ in range(3):
        out = step(jnp.ones(2))
    np.testing.assert_array_equal(pw.results(out), [2.0, 2.0])
    assert len(traces) == first
    np.testing.assert_array_equal(total[...], [4.0, 4.0])


@pytest.mark.parametrize("mode", ["ref", "hijax"])
def test_a_flax_ref_or_hijax_mode_model_a_step_closes_over_is_updated_as_under_jax_jit(mode):
    # Flax's ref mode (nnx.var_defaults(ref=True)) keeps each Variable's value in a jax.Ref, its
    # hijax mode makes each Variable a JAX mutable type: a step that uses a model it does not take
    # (a closure, as jax.jit allows) failed with PlacementError (ref) or NotImplementedError (hijax).
    ends = []
    for make in (jax.jit, pw.program):
        with nnx.var_defaults(**{mode: True}):
            model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            calls = nnx.BatchStat(jnp.int32(0))

        def step(x, model=model, calls=calls):
            y = model(x)
            model.kernel[...] = model.kernel[...] * 0.5
            calls[...] += 1
            return y

        f = make(step)
        ys = [f(jnp.ones((1, 2))) for _ in range(2)]
        ends.append(_bits((ys, model.kernel[...], model.bias[...], calls[...])))
    assert ends[1] == ends[0]


def test_lower_and_graph_of_a_step_closing_over_a_ref_answer_and_run_nothing():
    # program.lower / .graph of such a step raised as its call did; now they answer as jax.jit's
    # lower does (the Ref's value is an input of the graph) and leave the Ref as it was.
    total = jax.new_ref(jnp.zeros(2))

    @pw.program
    def step(x):
        total[...] += x
        return x * 2

    assert "stablehlo" in step.lower(jnp.ones(2)).as_text()
    assert len(step.graph(jnp.ones(2)).ir.inputs) == 2  # x and the Ref's value
    np.testing.assert_array_equal(total[...], [0.0, 0.0])
    np.testing.assert_array_equal(pw.results(step(jnp.ones(2))), [2.0, 2.0])
    np.testing.assert_array_equal(total[...], [1.0, 1.0])


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float


def _rescaled(config, x):
    config.scale = 2.0  # a frozen dataclass: raises in its generated __setattr__ (file "<string>")
    return x * config.scale


def test_an_error_raised_in_generated_code_names_the_users_line_not_string():
    # Flax Linen modules and frozen configs are dataclasses, whose __init__ / __setattr__ Python
    # generates (file "<string>"). An error raised there was placed "at inside <string>:4
    # (__setattr__)": no file of the user's, and not a sentence. It names the user's line.
    line = _rescaled.__code__.co_firstlineno + 1
    here = f"{os.path.basename(__file__)}:{line} (_rescaled)"
    for fun, where in (
        (lambda x: _rescaled(_Config(1.0), x), f"inside {here}"),  # the program's own line, then this one
        (functools.partial(_rescaled, _Config(1.0)), here),  # a partial: no line of its own
    ):
        with pytest.raises(dataclasses.FrozenInstanceError) as info:
            pw.program(fun)(jnp.ones(2))
        message = str(info.value)
        assert isinstance(info.value, pw.errors.ProgramTraceError)
        assert "<string>" not in message and "at inside" not in message, message
        assert f"failed at {where}" in message or f", {where}" in message, message
