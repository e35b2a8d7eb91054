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


@pytest.mark.xfail(
    strict=True,
    raises=pw.errors.ProgramTraceError,
    reason="a jax.Ref argument is refused when the call is signed (api/arguments.py, the per-call "
    "path): the fix reads each Ref's value as an input, traces the function on a Ref made from it, "
    "and writes the value it ends with back into the caller's Ref",
)
def test_a_jax_ref_argument_is_updated_in_place_as_under_jax_jit():
    # jax.new_ref is public JAX: jax.jit takes a Ref argument and writes into it.
    want_ref = jax.new_ref(jnp.zeros(4))
    step = jax.jit(_accumulate)
    want = [np.asarray(step(want_ref, jnp.ones(4))) for _ in range(2)]
    ref = jax.new_ref(jnp.zeros(4))
    program = pw.program(_accumulate)
    got = [np.asarray(program(ref, jnp.ones(4))) for _ in range(2)]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(ref[...]), np.asarray(want_ref[...]))


class _Counted(nnx.Module):
    def __init__(self, rngs):
        self.calls = nnx.BatchStat(jnp.array(0))
        self.linear = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x):
        self.calls[...] += 1
        return self.linear(x)


@pytest.mark.xfail(
    strict=True,
    raises=pw.errors.ProgramTraceError,
    reason="NNX objects are routed through api/nnx_graph.py (the per-call path), whose inner "
    "program is handed Flax's Ref-holding Variables and refuses them as graph nodes in tree mode",
)
def test_an_nnx_model_in_flax_ref_mode_is_updated_in_place_as_under_nnx_jit():
    # nnx.var_defaults(ref=True): Variables hold jax.Refs; nnx.jit (and jax.jit) update them in place.
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
