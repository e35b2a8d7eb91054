"""pathways_jax.pipeline takes batches that are pytrees: a dict of inputs, a tuple of targets.

Each leaf is split along its leading (batch) dimension, as one array is; results are
compared with the same model trained by plain jax.jit on the whole batch.
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

BATCH, DIN, HIDDEN, DOUT, MICRO = 8, 4, 6, 3, 2


class DictInput(nnx.Module):
    """A first stage reading a dict batch, as Flax's examples feed {"image": ..., "mask": ...}."""

    def __init__(self):
        self.linear = nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0))

    def __call__(self, batch):
        return jnp.tanh(self.linear(batch["x"])) * batch["mask"][:, None]


def weighted_mse(out, targets):
    y, weight = targets
    return jnp.mean(weight[:, None] * (out - y) ** 2)


def make_batch(step):
    rng = np.random.default_rng(step)
    x = {
        "x": rng.normal(size=(BATCH, DIN)).astype(np.float32),
        "mask": (rng.random(BATCH) > 0.2).astype(np.float32),
    }
    targets = (rng.normal(size=(BATCH, DOUT)).astype(np.float32), rng.random(BATCH).astype(np.float32))
    return x, targets


def model():
    return [DictInput(), nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(1))]


def reference(tx, steps, parts):
    """Plain jax.jit: the batch's loss as the mean over ``parts`` equal pieces, as the step takes it."""
    params, apply = pipeline.sequential(model())
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, targets):
        def loss_fn(params):
            pieces = [jax.tree.map(lambda a, i=i: jnp.split(a, parts)[i], (x, targets)) for i in range(parts)]
            return sum(weighted_mse(apply(params, xm), tm) for xm, tm in pieces) / parts

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    losses = []
    for i in range(steps):
        loss, params, opt_state = step(params, opt_state, *make_batch(i))
        losses.append(loss)
    return losses, params, apply


def test_pipeline_trains_on_dict_batches_and_tuple_targets_as_plain_jit():
    slices = island_slices(2)
    tx = optax.adam(1e-2)
    pipe = pipeline.Pipeline(model(), slices, loss_fn=weighted_mse, optimizer=tx, num_microbatches=MICRO)
    losses = [pipe.train_step(*make_batch(i)) for i in range(2)]
    want_losses, want_params, apply = reference(tx, 2, MICRO)
    assert_tree_close(losses, want_losses)
    assert_tree_close(pipe.params, want_params)
    x, _ = make_batch(5)
    assert_tree_close(pipe.forward(x), apply(want_params, x))


def test_data_parallel_trains_on_dict_batches_and_tuple_targets_as_plain_jit():
    slices = island_slices(2)
    tx = optax.sgd(0.1)
    dp = pipeline.DataParallel(model(), slices, loss_fn=weighted_mse, optimizer=tx)
    losses = [dp.train_step(*make_batch(i)) for i in range(2)]
    want_losses, want_params, _ = reference(tx, 2, len(slices))
    assert_tree_close(losses, want_losses)
    for params in dp.params_per_island:
        assert_tree_close(params, want_params)


def test_batch_pytrees_of_unequal_batch_sizes_are_named_errors():
    slices = island_slices(2)
    pipe = pipeline.Pipeline(
        model(), slices, loss_fn=weighted_mse, optimizer=optax.sgd(0.1), num_microbatches=MICRO
    )
    x, (y, weight) = make_batch(0)
    with pytest.raises(pw.errors.PlacementError, match=r"different batch sizes.*\[1\]': 4"):
        pipe.train_step(x, (y, weight[:4]))
    with pytest.raises(pw.errors.PlacementError, match=r"x\['mask'\] is a scalar"):
        pipe.forward({**x, "mask": 1.0})


def test_data_parallel_x_and_y_of_different_batches_are_a_named_error_not_a_broadcast():
    slices = island_slices(2, mesh={"data": 1})
    dp = pipeline.DataParallel(
        nnx.Linear(DIN, DOUT, rngs=nnx.Rngs(0)),
        slices,
        loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
        optimizer=optax.sgd(0.1),
    )
    x, (y, _) = make_batch(0)
    # Shards of 4 inputs and 1 target: the loss would broadcast the target over the shard.
    with pytest.raises(pw.errors.PlacementError, match="x has a batch of 8 but y of 2; they must match"):
        dp.train_step(x["x"], y[:2])


class Embedder(nnx.Module):
    """Passes the batch's integer positions on to the next stages, as transformer stages do."""

    def __init__(self):
        self.linear = nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0))

    def __call__(self, batch):
        return jnp.tanh(self.linear(batch["x"])), batch["pos"]


class Block(nnx.Module):
    def __init__(self, dout, seed, last=False):
        self.linear = nnx.Linear(HIDDEN, dout, rngs=nnx.Rngs(seed))
        self.last = last

    def __call__(self, carry):
        h, pos = carry
        out = self.linear(h) * (pos[:, None] % 3 > 0)
        return out if self.last else (jnp.tanh(out), pos)


@pytest.mark.parametrize("remat", [False, True])
def test_integer_values_passed_between_stages_train_as_plain_jit(remat):
    slices = island_slices(2, mesh={"data": 1})
    stages = lambda: [Embedder(), Block(HIDDEN, 1), Block(DOUT, 2, last=True)]  # noqa: E731
    rng = np.random.default_rng(0)
    x = {"x": rng.normal(size=(BATCH, DIN)).astype(np.float32), "pos": np.arange(BATCH, dtype=np.int32)}
    y = rng.normal(size=(BATCH, DOUT)).astype(np.float32)
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    tx = optax.adam(1e-2)
    pipe = pipeline.Pipeline(
        stages(),
        [slices[0], slices[1], slices[1]],
        loss_fn=mse,
        optimizer=tx,
        num_microbatches=MICRO,
        remat=remat,
    )
    loss = pipe.train_step(x, y)

    params, apply = pipeline.sequential(stages())

    def loss_fn(params):
        pieces = [jax.tree.map(lambda a, i=i: jnp.split(a, MICRO)[i], (x, y)) for i in range(MICRO)]
        return sum(mse(apply(params, xm), ym) for xm, ym in pieces) / MICRO

    want_loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert_tree_close(loss, want_loss)
    assert_tree_close(pipe.params, optax.apply_updates(params, updates))
