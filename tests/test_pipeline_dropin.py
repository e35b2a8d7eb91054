"""pathways_jax.pipeline for Flax users: dropout RNGs and train flags, sharded DataParallel
parameters, and optimizers beyond optax.GradientTransformation — each against plain jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)

BATCH, DIN, HIDDEN, DOUT, MICRO = 8, 4, 8, 3, 2


class DropoutDense(linen.Module):
    features: int
    rate: float = 0.5

    @linen.compact
    def __call__(self, x, train: bool = False):
        x = jnp.tanh(linen.Dense(self.features)(x))
        return linen.Dropout(self.rate, deterministic=not train)(x)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def make_data(step=0):
    rng = np.random.default_rng(step)
    return rng.normal(size=(BATCH, DIN)).astype(np.float32), rng.normal(size=(BATCH, DOUT)).astype(np.float32)


def linen_stages():
    stages = []
    for i, (din, dout) in enumerate([(DIN, HIDDEN), (HIDDEN, DOUT)]):
        module = DropoutDense(dout)
        stages.append((module, module.init(jax.random.key(i), jnp.zeros((1, din)))))
    return stages


def island_slices(count, mesh=None):
    pw.init(num_cpu_devices=8, islands=count)
    return [pw.devices(mesh=mesh or {"data": 2}, island=i) for i in range(count)]


def assert_tree_close(got, want, rtol=1e-5, atol=1e-6):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves, strict=True):
        value = np.asarray(g.result(timeout=60) if isinstance(g, pw.Future) else g)
        assert value.shape == w.shape and value.dtype == w.dtype, (value.shape, w.shape)
        np.testing.assert_allclose(value, np.asarray(w), rtol=rtol, atol=atol)


def linen_reference(stages, tx, batches, *, train, keys):
    """Plain jax.jit of the pipelined step: microbatch m of stage s uses derive_rngs(rngs, s, m)."""
    modules = [module for module, _ in stages]
    params = tuple(variables["params"] for _, variables in stages)
    opt_state = tx.init(params)

    def model(params, x, rngs_per_stage):
        for module, p, rngs in zip(modules, params, rngs_per_stage, strict=True):
            x = module.apply({"params": p}, x, train=train, rngs=rngs)
        return x

    @jax.jit
    def step(params, opt_state, x, y, key):
        def loss_fn(params):
            total = 0.0
            for m, (xm, ym) in enumerate(zip(jnp.split(x, MICRO), jnp.split(y, MICRO), strict=True)):
                rngs = [
                    None if key is None else pipeline.derive_rngs({"dropout": key}, s, m)
                    for s in range(len(modules))
                ]
                total = total + mse(model(params, xm, rngs), ym)
            return total / MICRO

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    out = []
    for (x, y), key in zip(batches, keys, strict=True):
        loss, params, opt_state = step(params, opt_state, x, y, key)
        out.append((loss, params))
    return out, model


@pytest.mark.parametrize("remat", [False, True])
def test_linen_dropout_pipeline_matches_plain_jit_with_derived_keys(remat):
    slices = island_slices(2)
    tx = optax.sgd(0.1)
    batches = [make_data(0), make_data(1)]
    base = jax.random.key(7)
    keys = [jax.random.fold_in(base, step) for step in range(len(batches))]
    want, _ = linen_reference(linen_stages(), tx, batches, train=True, keys=keys)
    pipe = pipeline.Pipeline(
        linen_stages(), slices, loss_fn=mse, optimizer=tx, num_microbatches=MICRO, remat=remat
    )
    for (x, y), key, (want_loss, want_params) in zip(batches, keys, want, strict=True):
        loss = pipe.train_step(x, y, rngs={"dropout": key}, train=True)
        np.testing.assert_allclose(float(loss.result()), float(want_loss), rtol=1e-5)
        assert_tree_close(pipe.params, want_params)
    # The same key again: the same loss (reproducible); another key: another loss (dropout applies).
    x, y = batches[0]
    again = [pipe.loss_and_grads(x, y, rngs={"dropout": keys[0]}, train=True)[0] for _ in range(2)]
    other = pipe.loss_and_grads(x, y, rngs={"dropout": jax.random.key(8)}, train=True)[0]
    plain = pipe.loss_and_grads(x, y, train=False)[0]
    values = [float(f.result()) for f in (*again, other, plain)]
    assert values[0] == values[1]
    assert len({values[0], values[2], values[3]}) == 3, values


def test_linen_eval_needs_no_rng_and_equals_deterministic_reference():
    slices = island_slices(2)
    tx = optax.sgd(0.1)
    batches = [make_data(0)]
    want, model = linen_reference(linen_stages(), tx, batches, train=False, keys=[None])
    pipe = pipeline.Pipeline(linen_stages(), slices, loss_fn=mse, optimizer=tx, num_microbatches=MICRO)
    x, y = batches[0]
    params = tuple(variables["params"] for _, variables in linen_stages())
    assert_tree_close(
        pipe.forward(x, train=False), jax.jit(lambda p, x: model(p, x, [None, None]))(params, x)
    )
    np.testing.assert_allclose(
        float(pipe.train_step(x, y, train=False).result()), float(want[0][0]), rtol=1e-5
    )
    assert_tree_close(pipe.params, want[0][1])
    # Dropout in the forward pass: a key makes it random, and reproducible.
    out_a = pipe.forward(x, train=True, rngs={"dropout": jax.random.key(1)}).result()
    out_b = pipe.forward(x, train=True, rngs={"dropout": jax.random.key(1)}).result()
    out_eval = pipe.forward(x, train=False).result()
    np.testing.assert_array_equal(out_a, out_b)
    assert not np.allclose(out_a, out_eval)


def test_train_without_the_rng_a_stage_needs_is_a_named_error():
    slices = island_slices(2)
    pipe = pipeline.Pipeline(
        linen_stages(), slices, loss_fn=mse, optimizer=optax.sgd(0.1), num_microbatches=2
    )
    before = pw.counters()
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"stage 0 \(linen DropoutDense\) needs an RNG"
    ) as info:
        pipe.train_step(*make_data(0), train=True)
    assert "no streams" in str(info.value) and "rngs={'dropout': key}" in str(info.value)
    with pytest.raises(pw.errors.ProgramTraceError, match="rngs must be a non-empty mapping"):
        pipe.train_step(*make_data(0), train=True, rngs=jax.random.key(0))
    with pytest.raises(pw.errors.ProgramTraceError, match="train must be True, False or None"):
        pipe.forward(make_data(0)[0], train="yes")
    assert pw.counters()["runs"] == before["runs"]


class NnxDropoutBlock(nnx.Module):
    def __init__(self, din, dout, seed):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=seed))

    def __call__(self, x):
        return self.dropout(jnp.tanh(self.linear(x)))


def test_nnx_dropout_stage_is_reseeded_per_stage_and_microbatch_and_eval_is_deterministic():
    slices = island_slices(2)
    blocks = [NnxDropoutBlock(DIN, HIDDEN, 0), NnxDropoutBlock(HIDDEN, DOUT, 1)]
    x, _ = make_data(2)
    key = jax.random.key(3)
    want = []
    for m, xm in enumerate(np.split(x, MICRO)):
        h = xm
        for s, block in enumerate(blocks):
            copy = nnx.clone(block)
            nnx.reseed(copy, **pipeline.derive_rngs({"dropout": key}, s, m))
            h = copy(h)
        want.append(h)
    copies = [nnx.clone(b) for b in blocks]
    for copy in copies:
        copy.eval()
    want_eval = copies[1](copies[0](x))
    pipe = pipeline.Pipeline(blocks, slices, num_microbatches=MICRO)
    assert_tree_close(pipe.forward(x, train=True, rngs={"dropout": key}), jnp.concatenate(want))
    assert_tree_close(pipe.forward(x, train=False), want_eval)


def test_data_parallel_param_specs_keep_shardings_and_match_plain_jit():
    slices = island_slices(2, mesh={"data": 2, "model": 2})
    params = {
        "w": jax.random.normal(jax.random.key(0), (DIN, HIDDEN)) / 2,
        "b": jnp.zeros(HIDDEN),
        "v": jax.random.normal(jax.random.key(1), (HIDDEN, DOUT)) / 3,
    }

    def apply(p, x):
        return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]

    tx = optax.adam(1e-2)
    batches = [make_data(0), make_data(1)]
    state, ref = tx.init(params), params

    @jax.jit
    def step(p, o, x, y):
        loss, g = jax.value_and_grad(lambda p: mse(apply(p, x), y))(p)
        updates, o = tx.update(g, o, p)
        return loss, optax.apply_updates(p, updates), o

    specs = {"w": pw.P(None, "model"), "b": pw.P("model"), "v": None}
    dp = pipeline.DataParallel((params, apply), slices, loss_fn=mse, optimizer=tx, param_specs=specs)
    for x, y in batches:
        want_loss, ref, state = step(ref, state, x, y)
        np.testing.assert_allclose(float(dp.train_step(x, y).result()), float(want_loss), rtol=1e-5)
        for island_params in dp.params_per_island:
            assert_tree_close(island_params, ref)
            assert island_params["w"].sharding.spec == pw.P(None, "model")
            assert island_params["b"].sharding.spec == pw.P("model")
            assert island_params["v"].sharding.spec == pw.P()
    mu = dp.opt_states_per_island[1][0].mu
    assert mu["w"].sharding.spec == pw.P(None, "model")
    # Gradients travel leaf by leaf, sharded: 3 leaves each way plus the loss.
    assert len([t for t in dp.graph(*batches[0]).transfers if t.kind == "dcn"]) == 2 * 3 + 1


def test_param_specs_that_do_not_match_params_are_named_errors():
    slices = island_slices(2, mesh={"data": 2, "model": 2})
    params = {"w": jnp.ones((DIN, HIDDEN)), "b": jnp.zeros(HIDDEN), "c": jnp.zeros(DOUT)}
    model = (params, lambda p, x: x @ p["w"] + p["b"])

    def make(specs):
        return pipeline.DataParallel(model, slices, loss_fn=mse, optimizer=optax.sgd(0.1), param_specs=specs)

    with pytest.raises(pw.errors.PlacementError, match=r"parameters \['b', 'c'\] have no spec"):
        make({"w": pw.P(None, "model")})
    with pytest.raises(pw.errors.PlacementError, match=r"entries \['bias'\] match no parameter"):
        make({"w": None, "b": None, "c": None, "bias": None})
    with pytest.raises(pw.errors.PlacementError, match="names axis 'nope'"):
        make({"w": pw.P("nope"), "b": None, "c": None})
    with pytest.raises(pw.errors.PlacementError, match=r"splits a dimension of size 3 \(shape \(3,\)\)"):
        make({"w": None, "b": None, "c": pw.P("model")})
    with pytest.raises(pw.errors.PlacementError, match=r"expected pw\.P"):
        make({"w": "model", "b": None, "c": None})
    # NNX params (an nnx.State) take a plain dict prefix; a Pipeline stage takes it too.
    block = nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0))
    pipe = pipeline.Pipeline(
        [block], slices[:1], param_specs=[{"kernel": pw.P(None, "model"), "bias": None}], num_microbatches=1
    )
    assert pipe.params[0]["kernel"].sharding.spec == pw.P(None, "model")


class DuckSGD:
    """An optimizer that is not an optax.GradientTransformation, only shaped like one."""

    def __init__(self, learning_rate):
        self._tx = optax.sgd(learning_rate, momentum=0.9)

    def init(self, params):
        return self._tx.init(params)

    def update(self, grads, state, params=None):
        return self._tx.update(grads, state, params)


def two_stage_reference(tx, batches):
    stages = [nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0)), nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(1))]
    params, apply = pipeline.sequential(stages)
    opt_state, out = tx.init(params), []
    for x, y in batches:
        loss, grads = jax.value_and_grad(lambda p, x=x, y=y: mse(apply(p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        out.append((loss, params))
    return out


@pytest.mark.parametrize("kind", ["duck", "nnx"])
def test_duck_typed_and_nnx_optimizers_train_like_optax(kind):
    slices = island_slices(2)
    batches = [make_data(0), make_data(1)]
    want = two_stage_reference(optax.sgd(0.1, momentum=0.9), batches)
    stages = [nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0)), nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(1))]
    if kind == "duck":
        optimizer = DuckSGD(0.1)
        assert not isinstance(optimizer, optax.GradientTransformation)
    else:
        optimizer = nnx.Optimizer(stages[0], optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    pipe = pipeline.Pipeline(stages, slices, loss_fn=mse, optimizer=optimizer, num_microbatches=2)
    for (x, y), (want_loss, want_params) in zip(batches, want, strict=True):
        np.testing.assert_allclose(float(pipe.train_step(x, y).result()), float(want_loss), rtol=1e-5)
        assert_tree_close(pipe.params, want_params)
    dp = pipeline.DataParallel(
        [nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0)), nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(1))],
        slices,
        loss_fn=mse,
        optimizer=optimizer,
    )
    for (x, y), (want_loss, want_params) in zip(batches, want, strict=True):
        np.testing.assert_allclose(float(dp.train_step(x, y).result()), float(want_loss), rtol=1e-5)
        assert_tree_close(dp.params, want_params)


def test_an_object_without_init_and_update_is_a_named_error():
    slices = island_slices(2)
    stages = [nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0)), nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(1))]

    class OnlyUpdate:
        def update(self, grads, state, params=None):
            return grads, state

    with pytest.raises(pw.errors.ProgramTraceError, match=r"is OnlyUpdate.*no callable 'init'") as info:
        pipeline.Pipeline(stages, slices, loss_fn=mse, optimizer=OnlyUpdate())
    assert "init(params) -> state" in str(info.value) and "nnx.Optimizer" in str(info.value)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"optimizer 1 is str"):
        pipeline.Pipeline(stages, slices, loss_fn=mse, optimizer=[optax.sgd(0.1), "adam"])
    with pytest.raises(pw.errors.ProgramTraceError, match="a sequence of 3, but there are 2 stages"):
        pipeline.Pipeline(stages, slices, loss_fn=mse, optimizer=[optax.sgd(0.1)] * 3)
    with pytest.raises(pw.errors.ProgramTraceError, match="no callable 'init' or 'update'"):
        pipeline.DataParallel(stages, slices, loss_fn=mse, optimizer=0.1)
