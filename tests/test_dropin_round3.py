"""Drop-in use met by third-party code: what ``jax.jit`` user code does around its jitted functions.

Each test runs the same code with ``jax.jit`` and with ``@pw.program`` /
``pw.jit`` in its place, on identical inputs, and compares what comes back.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

pytestmark = pytest.mark.timeout(60)


class _Trainer:
    """Training code keeping its jitted step on itself, as many trainers do."""

    def __init__(self, wrap):
        self.scale = 3.0
        self.step = wrap(self._step)

    def _step(self, x):
        return x * self.scale


@pytest.mark.parametrize("wrap", [pw.program, pw.jit], ids=["pw.program", "pw.jit"])
def test_an_object_holding_a_program_deep_copies_as_one_holding_a_jax_jit_function(wrap):
    # copy.deepcopy of a trainer, a config or an nnx.Module holding a program raised TypeError:
    # "cannot pickle '_thread.RLock' object"; one holding a jax.jit function copies, and its
    # copy runs the function as the original does.
    x = jnp.arange(4.0)
    want = copy.deepcopy(_Trainer(jax.jit))
    have = copy.deepcopy(_Trainer(wrap))
    np.testing.assert_array_equal(pw.results(have.step(x)), want.step(x))
    assert copy.deepcopy({"step": have.step})["step"](x).dtype == want.step(x).dtype
