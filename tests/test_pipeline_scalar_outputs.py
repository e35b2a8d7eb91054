"""Stage outputs with leaves that do not lead with the batch: an auxiliary scalar passed on.

Such a leaf (a mean, an auxiliary loss) is replicated on the slices rather than split over
their data axis, and gets its gradient from the next stages; the step matches plain jax.jit
of the same per-microbatch computation. forward, which concatenates the microbatches'
outputs along the batch, refuses a last-stage output holding one when there are several.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)

BATCH, DIN, HIDDEN, DOUT, MICRO = 8, 4, 6, 3, 2


class Encoder(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = jnp.tanh(self.linear(x))
        return h, jnp.mean(h**2)  # an auxiliary loss, a scalar


class Head(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(1))

    def __call__(self, inputs):
        h, aux = inputs
        return self.linear(h) * (1.0 + aux), aux


def loss_fn(outputs, y):
    out, aux = outputs
    return jnp.mean((out - y) ** 2) + 0.1 * aux


def test_a_scalar_stage_output_is_replicated_and_differentiated_as_under_jax_jit():
    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(2)]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, DIN)).astype(np.float32)
    y = rng.normal(size=(BATCH, DOUT)).astype(np.float32)
    pipe = pipeline.Pipeline(
        [Encoder(), Head()], slices, loss_fn=loss_fn, optimizer=optax.sgd(0.1), num_microbatches=MICRO
    )
    step_loss = pipe.train_step(x, y)

    params, apply = pipeline.sequential([Encoder(), Head()])

    @jax.jit
    def reference(params):  # the step's loss: the mean over microbatches of each one's
        pieces = zip(jnp.split(x, MICRO), jnp.split(y, MICRO), strict=True)
        return sum(loss_fn(apply(params, xm), ym) for xm, ym in pieces) / MICRO

    want_loss, want_grads = jax.value_and_grad(reference)(params)
    np.testing.assert_allclose(float(step_loss.result(timeout=60)), float(want_loss), rtol=1e-6)
    want_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, want_grads)
    got_leaves, want_leaves = jax.tree.leaves(pw.results(pipe.params)), jax.tree.leaves(want_params)
    assert len(got_leaves) == len(want_leaves) == 4
    for got, want in zip(got_leaves, want_leaves, strict=True):  # the gradients reached every stage
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    with pytest.raises(pw.errors.PlacementError, match=r"float32\[\].*do not lead with the microbatch"):
        pipe.forward(x)
