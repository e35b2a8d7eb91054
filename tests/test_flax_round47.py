"""Flax idioms with pathways_jax where ``nnx.jit`` stood: each against the same code under ``nnx.jit``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)


def _mse(out, y):
    return jnp.mean((out - y) ** 2)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)


def _lora_stages():
    """A LoRA layer over a Linear base, then a plain Linear head: fine-tuned with wrt=nnx.LoRAParam."""
    base = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    return [nnx.LoRA(4, 2, 4, base_module=base, rngs=nnx.Rngs(1)), nnx.Linear(4, 2, rngs=nnx.Rngs(2))]


@pytest.mark.parametrize("kind", ["pipeline", "data_parallel"])
def test_an_nnx_optimizer_with_wrt_trains_only_what_it_selects_as_under_nnx_jit(kind):
    # nnx.Optimizer(model, tx, wrt=nnx.LoRAParam) updates the LoRA parameters only; given as the
    # optimizer of a Pipeline or DataParallel, its tx trained every nnx.Param, the LoRA layer's
    # frozen base kernel and the head too, a fine-tune silently unlike the plain one.
    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(2)]
    batches = [_batch(0)]  # one step moves every parameter the optimizer updates
    tx = optax.adamw(1e-2)

    reference = nnx.Sequential(*_lora_stages())
    frozen = nnx.state(reference, nnx.Not(nnx.LoRAParam))
    reference_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: _mse(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    want = [step(reference, reference_optimizer, x, y) for x, y in batches]

    stages = _lora_stages()
    optimizer = nnx.Optimizer(nnx.Sequential(*stages), tx, wrt=nnx.LoRAParam)
    if kind == "pipeline":
        model = pipeline.Pipeline(stages, slices, loss_fn=_mse, optimizer=optimizer)
    else:
        model = pipeline.DataParallel(stages, slices, loss_fn=_mse, optimizer=optimizer)
    got = [model.train_step(x, y) for x, y in batches]
    np.testing.assert_allclose([float(loss) for loss in got], [float(loss) for loss in want], rtol=1e-5)

    for stage, params in zip(stages, pw.results(model.params), strict=True):
        nnx.update(stage, jax.device_get(params))
    trained = nnx.Sequential(*stages)
    for got_leaf, want_leaf in zip(
        jax.tree.leaves(nnx.state(trained, nnx.LoRAParam)),
        jax.tree.leaves(nnx.state(reference, nnx.LoRAParam)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), rtol=1e-5, atol=1e-6)
    # The base kernel and the head, which wrt= leaves out, are those the model started with.
    for got_leaf, want_leaf in zip(
        jax.tree.leaves(nnx.state(trained, nnx.Not(nnx.LoRAParam))), jax.tree.leaves(frozen), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got_leaf), np.asarray(want_leaf))


class _Count(nnx.Variable):
    pass


class _Centred(nnx.Module):
    """A Linear whose output is centred on a moving average it keeps in a Variable of its own."""

    def __init__(self):
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.average = _Count(jnp.zeros((4,)))

    def __call__(self, x):
        y = self.linear(x)
        self.average[...] = 0.9 * self.average[...] + 0.1 * jax.lax.stop_gradient(y.mean(0))
        return y - self.average[...]


@pytest.mark.parametrize("kind", ["pipeline", "data_parallel"])
def test_a_stage_writing_a_variable_it_would_hold_is_a_named_error_not_a_silent_difference(kind):
    # Pipelines train parameters and hold every other Variable: a moving average the stage's call
    # writes stayed at zero on every step (nnx.jit writes it back), and the losses silently
    # differed from the plain model's. BatchNorm's statistics were refused by name; this was not.
    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(2)]
    stages = [_Centred(), nnx.Linear(4, 2, rngs=nnx.Rngs(2))]
    x, y = _batch(0)
    if kind == "pipeline":
        model = pipeline.Pipeline(stages, slices, loss_fn=_mse, optimizer=optax.sgd(0.1))
        with pytest.raises(
            pw.errors.ProgramTraceError, match=r"Pipeline.forward: stage 0 .*writes average \(_Count\)"
        ):
            model.forward(x)
    else:
        model = pipeline.DataParallel(stages, slices, loss_fn=_mse, optimizer=optax.sgd(0.1))
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"train_step: stage 0 .*writes average \(_Count\)"
    ) as info:
        model.train_step(x, y)
    assert "@pw.program" in str(info.value)
    # A stage whose call writes nothing but its RNG streams (Dropout) still trains.
    stages = [
        nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))),
        nnx.Linear(4, 2, rngs=nnx.Rngs(2)),
    ]
    if kind == "pipeline":
        model = pipeline.Pipeline(stages, slices, loss_fn=_mse, optimizer=optax.sgd(0.1))
    else:
        model = pipeline.DataParallel(stages, slices, loss_fn=_mse, optimizer=optax.sgd(0.1))
    assert np.isfinite(float(model.train_step(x, y, rngs={"dropout": jax.random.key(0)}, train=True)))


def test_a_linen_stage_writing_a_collection_it_would_hold_says_so_not_to_fix_shapes_or_rngs():
    # A Linen stage counting its calls in a collection of its own failed with Flax's
    # ModifyScopeVariableError under advice to fix the stage sizes (Pipeline) or to pass rngs
    # (DataParallel); it now names the write and what to do, as for BatchNorm's statistics.
    from flax import linen

    class Counting(linen.Module):
        @linen.compact
        def __call__(self, x):
            calls = self.variable("counter", "calls", lambda: jnp.zeros((), jnp.int32))
            if not self.is_initializing():
                calls.value += 1
            return linen.Dense(4)(x)

    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(2)]
    x, y = _batch(0)
    head = linen.Dense(2)
    stages = [(Counting(), Counting().init(jax.random.key(0), x)), (head, head.init(jax.random.key(1), x))]
    pipe = pipeline.Pipeline(stages, slices, loss_fn=_mse, optimizer=optax.sgd(0.1))
    dp = pipeline.DataParallel(list(stages), slices, loss_fn=_mse, optimizer=optax.sgd(0.1))
    for model, name in ((pipe, "Pipeline"), (dp, "DataParallel")):
        with pytest.raises(
            pw.errors.ProgramTraceError,
            match=rf"{name}.train_step: stage 0 \(linen Counting\) writes a variable",
        ) as info:
            model.train_step(x, y)
        assert '"counter"' in str(info.value) and "mutable=" in str(info.value)
        assert "stage sizes" not in str(info.value) and "rngs=" not in str(info.value)


def test_stages_sharing_a_parameter_the_optimizer_leaves_out_train_as_under_nnx_jit():
    # Two stages holding one Linear as the frozen base of their LoRA layers were refused as tied
    # weights that would drift apart; with nnx.Optimizer(..., wrt=nnx.LoRAParam) both hold it as
    # it is, and training matches nnx.jit's. A tie of parameters that train is still refused.
    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(2)]
    batches = [_batch(0), _batch(1)]

    def make():
        base = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        first = nnx.LoRA(4, 2, 4, base_module=base, rngs=nnx.Rngs(1))
        second = nnx.Sequential(
            nnx.LoRA(4, 2, 4, base_module=base, rngs=nnx.Rngs(2)), nnx.Linear(4, 2, rngs=nnx.Rngs(3))
        )
        return [first, second]

    reference = nnx.Sequential(*make())
    reference_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: _mse(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    want = [float(step(reference, reference_optimizer, x, y)) for x, y in batches]
    stages = make()
    optimizer = nnx.Optimizer(nnx.Sequential(*stages), optax.sgd(0.1), wrt=nnx.LoRAParam)
    pipe = pipeline.Pipeline(stages, slices, loss_fn=_mse, optimizer=optimizer)
    np.testing.assert_allclose([float(pipe.train_step(x, y)) for x, y in batches], want, rtol=1e-5)
    with pytest.raises(pw.errors.PlacementError, match=r"hold the same nnx\.Param"):
        pipeline.Pipeline(make(), slices, loss_fn=_mse, optimizer=optax.sgd(0.1))
