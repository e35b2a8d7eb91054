"""NNX stages drawing from their own RNG streams: reseeded by the step's rngs, or a named error.

A pipelined stage runs from the same module state on every step and microbatch, so a stream
the step's ``rngs`` do not reseed would give the same dropout mask every time (``nnx.jit``
advances it call by call). Flax's docs build layers with ``nnx.Rngs(0)``, whose Dropout then
draws from the ``"default"`` stream, which ``rngs={"dropout": key}`` does not reach.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_pipeline_dropin import island_slices

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)


class Dropped(nnx.Module):
    """A Flax-docs block: the constructor's rngs build both the Linear and the Dropout."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


X = np.ones((4, 4), np.float32)


def test_a_stream_the_rngs_do_not_reseed_is_a_named_error_not_one_mask_for_every_step():
    slices = island_slices(2, mesh={"data": 1})
    pipe = pipeline.Pipeline([Dropped(nnx.Rngs(0))], slices[:1], num_microbatches=2)
    # The Dropout draws from "default": rngs={"dropout": ...} would leave it at the same key.
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"stage 0 \(nnx Dropped\) draws from its stream 'default'"
    ):
        pipe.forward(X, train=True, rngs={"dropout": jax.random.key(1)})
    # No rngs at all: the stage's own "dropout" stream would repeat its mask on every call.
    own = pipeline.Pipeline(
        [Dropped(nnx.Rngs(0, dropout=1))],
        slices[:1],
        loss_fn=mse,
        optimizer=optax.sgd(0.1),
        num_microbatches=2,
    )
    with pytest.raises(pw.errors.ProgramTraceError, match=r"'dropout'.*rngs=\{'dropout': jax.random.fold_in"):
        own.train_step(X, X)  # no train=: nnx.Dropout trains by default
    dp = pipeline.DataParallel(Dropped(nnx.Rngs(0, dropout=1)), slices, loss_fn=mse, optimizer=optax.sgd(0.1))
    with pytest.raises(pw.errors.ProgramTraceError, match=r"DataParallel.train_step: stage 0 .* 'dropout'"):
        dp.train_step(X, X, train=True)


def test_reseeded_streams_and_train_false_run_as_the_plain_module():
    slices = island_slices(2, mesh={"data": 1})
    module = Dropped(nnx.Rngs(0, dropout=1))
    pipe = pipeline.Pipeline([module], slices[:1], num_microbatches=2)
    np.testing.assert_array_equal(pipe.forward(X, train=False).result(timeout=60), module.linear(X))
    # A mapping of keys, then an nnx.Rngs as Flax code passes it (was: refused), from which each
    # call draws one key per stream, advancing it as a module would: derive_rngs of an nnx.Rngs
    # gives what the next call draws.
    stream = nnx.Rngs(dropout=7)
    masks = []
    for rngs in ({"dropout": jax.random.key(7)}, stream, stream):
        keys = [pipeline.derive_rngs(rngs, 0, m) for m in range(2)]
        got = np.asarray(pipe.forward(X, train=True, rngs=rngs).result(timeout=60))
        want = []
        for m, xm in enumerate(np.split(X, 2)):
            plain = nnx.clone(module)
            nnx.reseed(plain, **keys[m])
            want.append(plain(xm))
        np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-6)
        assert not np.array_equal(got[:2] == 0, got[2:] == 0)  # each microbatch its own mask
        masks.append(got == 0)
    assert not np.array_equal(masks[1], masks[2])  # the second call drew the stream's next key


class Sampling(nnx.Module):
    """A stage that draws from its own stream whatever its mode (as nnx.RNN draws its initial carry)."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        return self.linear(x) + 0.0 * jax.random.normal(self.rngs.noise(), x.shape)


def test_a_stage_drawing_under_train_false_is_not_told_to_pass_train_false():
    # Refused as any stale draw is, but its advice was to pass train=False, which the call had.
    slices = island_slices(2, mesh={"data": 1})
    pipe = pipeline.Pipeline([Sampling(nnx.Rngs(0, noise=1))], slices[:1], num_microbatches=2)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"'noise'") as refused:
        pipe.forward(X, train=False)
    assert "pass train=False" not in str(refused.value)
    assert "under train=False too" in str(refused.value)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"or pass train=False"):
        pipe.forward(X)  # no train=: the advice stands
