"""Pipeline(max_grad_norm=...) clips by the whole model's gradient norm, as
optax.chain(optax.clip_by_global_norm(c), tx) does for the unpipelined model under jax.jit.

Each stage's optimizer sees only its own gradients, so optax.clip_by_global_norm inside
``optimizer=`` would clip every stage by its own norm instead.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_pipeline_dropin import assert_tree_close, island_slices

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)

MICRO, CLIP = 2, 0.05


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def stages():
    return [nnx.Linear(4, 6, rngs=nnx.Rngs(0)), nnx.Linear(6, 3, rngs=nnx.Rngs(1))]


def batch(step):
    rng = np.random.default_rng(step)
    return rng.normal(size=(4, 4)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)


def test_max_grad_norm_clips_by_the_models_global_norm_as_plain_jit():
    slices = island_slices(2, mesh={"data": 1})
    inner = optax.adam(1e-2)
    pipe = pipeline.Pipeline(
        stages(), slices, loss_fn=mse, optimizer=inner, num_microbatches=MICRO, max_grad_norm=CLIP
    )
    losses = [pipe.train_step(*batch(i)) for i in range(2)]

    params, apply = pipeline.sequential(stages())
    tx = optax.chain(optax.clip_by_global_norm(CLIP), inner)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(params):
            parts = zip(jnp.split(x, MICRO), jnp.split(y, MICRO), strict=True)
            return sum(mse(apply(params, xm), ym) for xm, ym in parts) / MICRO

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    want = []
    for i in range(2):
        loss, params, opt_state = step(params, opt_state, *batch(i))
        want.append(loss)
    assert_tree_close(losses, want)
    assert_tree_close(pipe.params, params)
    # The batch's gradient norm is far above CLIP: the clip mattered.
    grads = pipe.loss_and_grads(*batch(0))[1]
    norm = np.sqrt(sum(np.sum(np.asarray(g) ** 2) for g in jax.tree.leaves(pw.results(grads))))
    assert norm > 4 * CLIP

    with pytest.raises(pw.errors.ProgramTraceError, match="max_grad_norm must be a number > 0"):
        pipeline.Pipeline(stages(), slices, loss_fn=mse, optimizer=inner, max_grad_norm=-1.0)


def test_an_optimizer_taking_the_loss_as_value_gets_the_steps_loss_as_under_jax_jit():
    """optax.contrib.reduce_on_plateau needs update(..., value=loss), as Flax's examples pass it:
    every stage's optimizer (and every DataParallel replica's) gets the step's mean loss."""
    slices = island_slices(2, mesh={"data": 1})
    # A step too large: the loss grows, so the plateau halves the scale after one step.
    tx = optax.chain(optax.sgd(0.6), optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0))
    pipe = pipeline.Pipeline(stages(), slices, loss_fn=mse, optimizer=tx, num_microbatches=MICRO)
    dp = pipeline.DataParallel(stages(), slices, loss_fn=mse, optimizer=tx)
    params, apply = pipeline.sequential(stages())
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: mse(apply(p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state

    for i in range(4):
        x, y = batch(i)
        pipe.train_step(x, y)
        dp.train_step(x, y)
        params, opt_state = step(params, opt_state, x, y)
    assert float(opt_state[1].scale) < 1.0  # the plateau acted on the losses
    assert_tree_close(pipe.params, list(params), rtol=1e-4, atol=1e-5)
    assert_tree_close(dp.params, params, rtol=1e-4, atol=1e-5)
    assert_tree_close([state[1].scale for state in pipe.opt_states], [opt_state[1].scale] * 2)
