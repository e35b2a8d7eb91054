"""Pipelines and data parallelism as a Flax + Optax user writes them, checked against plain jax.jit.

Each test is a model or an optimizer the README promises to take: a parameterless stage
(``nnx.relu`` between two Linears) under optimizers that read the parameters, an
``nnx.Sequential`` nested in another, and so on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.nnx import bridge

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)

BATCH, DIN, HIDDEN, DOUT = 8, 4, 6, 3


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(BATCH, DIN)).astype(np.float32),
        rng.normal(size=(BATCH, DOUT)).astype(np.float32),
    )


def island_slices(count, islands=2):
    pw.init(num_cpu_devices=8, islands=islands)
    return [pw.devices(mesh={"data": 1}, island=i % islands) for i in range(count)]


def values(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(pw.results(tree))]


def reference_steps(model, tx, x, y, steps, loss_fn=mse):
    """``steps`` steps of ``model`` under plain ``jax.jit``: the losses and the final params."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    def loss(p, x, y):
        return loss_fn(nnx.merge(graphdef, p, rest)(x), y)

    @jax.jit
    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for _ in range(steps):
        params, opt_state, value = step(params, opt_state, x, y)
        losses.append(float(value))
    return losses, params


def relu_mlp():
    return [nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(1))]


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.adamw(1e-2, weight_decay=0.1),
        lambda: optax.chain(optax.clip(0.5), optax.lion(1e-2, weight_decay=0.1)),
    ],
    ids=["adamw", "chain_lion"],
)
def test_a_parameterless_stage_trains_under_optimizers_that_read_the_params(make_tx):
    # nnx.relu between two Linears, as in nnx.Sequential: optax.adamw (weight decay reads the
    # params) refused the stage's params=None; under jax.jit the stage has no params at all.
    x, y = batch()
    want_losses, want_params = reference_steps(nnx.Sequential(*relu_mlp()), make_tx(), x, y, steps=3)
    pipe = pipeline.Pipeline(
        relu_mlp(), island_slices(3), loss_fn=mse, optimizer=make_tx(), num_microbatches=1
    )
    losses = [float(pipe.train_step(x, y).result(timeout=60)) for _ in range(3)]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    assert pipe.params[1] is None
    got = values([pipe.params[0], pipe.params[2]])
    want = values([want_params["layers"][0], want_params["layers"][2]])
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def nested_dropout_model():
    """A block (Linear then Dropout) nested in the model's nnx.Sequential, as nnx code composes it."""
    block = nnx.Sequential(
        nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
    )
    return nnx.Sequential(block, nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(2)))


def test_data_parallel_switches_a_nested_sequential_as_model_train_does():
    # The outer Sequential's first layer is a Sequential (it takes **kwargs): the flag was
    # handed down as train=True to its first layer, nnx.Linear, which takes no such keyword.
    x, y = batch()
    key = jax.random.key(7)
    tx = optax.adam(1e-2)
    slices = island_slices(2)
    dp = pipeline.DataParallel(nested_dropout_model(), slices, loss_fn=mse, optimizer=tx)
    loss = float(dp.train_step(x, y, rngs={"dropout": key}, train=True).result(timeout=60))

    # Plain nnx under jax.jit: model.train(), shard i called with rngs=nnx.Rngs(derive_rngs(rngs, 0, i)),
    # which nnx.Sequential hands on to every layer that takes rngs (the Dropout).
    model = nested_dropout_model()
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def shard_loss_and_grads(params, x, y, shard_key):
        def loss_of(p):
            module = nnx.merge(graphdef, p, rest, copy=True)
            return mse(module(x, rngs=nnx.Rngs(dropout=shard_key)), y)

        return jax.value_and_grad(loss_of)(params)

    half = BATCH // 2
    shards = [
        shard_loss_and_grads(
            params,
            x[i * half : (i + 1) * half],
            y[i * half : (i + 1) * half],
            pipeline.derive_rngs({"dropout": key}, 0, i)["dropout"],
        )
        for i in range(2)
    ]
    want_loss = (shards[0][0] + shards[1][0]) / 2
    grads = jax.tree.map(lambda a, b: (a + b) / 2, shards[0][1], shards[1][1])
    updates, _ = tx.update(grads, tx.init(params), params)
    want_params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(loss, float(want_loss), rtol=1e-6)
    for g, w in zip(values(dp.params), values(want_params), strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    # train=False evaluates: every unit kept, the same as model.eval() under jax.jit.
    eval_loss = float(dp.train_step(x, y, train=False).result(timeout=60))
    evaluated = nnx.merge(graphdef, want_params, rest, copy=True)
    evaluated.eval()
    want_eval = nnx.jit(lambda m, x, y: mse(m(x), y))(evaluated, x, y)
    np.testing.assert_allclose(eval_loss, float(want_eval), rtol=1e-6)


def test_slice_sharding_takes_one_partition_spec_as_named_sharding_does(tmp_path):
    # A restore target on a slice, as the README's checkpoint section builds it: the spec was
    # read as one entry, "names axis P('data',)", and s.sharding(pw.P()) gave P(None,).
    import orbax.checkpoint as ocp

    pw.init(num_cpu_devices=8, islands=2)
    wide = pw.devices(mesh={"data": 2, "model": 2}, island=0)
    want = jax.sharding.NamedSharding(wide.physical_mesh, pw.P("data", None))
    assert wide.sharding(pw.P("data", None)) == want == wide.sharding("data", None)
    assert wide.sharding(pw.P()).spec == pw.P() == wide.sharding().spec
    assert wide.sharding(pw.P(("data", "model"))).spec == pw.P(("data", "model"))
    with pytest.raises(pw.errors.PlacementError, match=r"has the entry P\('data',\).*one pw.P"):
        wide.sharding(pw.P("data"), None)
    with pytest.raises(pw.errors.PlacementError, match=r"names axis 'x'"):
        wide.sharding(pw.P("x"))
    x, _ = batch()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"x": x})
    checkpointer.wait_until_finished()
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=wide.sharding(pw.P("data", "model")))}
    restored = checkpointer.restore(tmp_path / "ckpt", target)["x"]
    assert restored.sharding == wide.sharding("data", "model")
    np.testing.assert_array_equal(np.asarray(restored), x)


VOCAB, WIDTH = 7, 4


class Embedder(nnx.Module):
    def __init__(self, embed):
        self.embed = embed

    def __call__(self, tokens):
        return self.embed(tokens)


class Mixer(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(1))

    def __call__(self, h):
        return nnx.tanh(self.linear(h))


class TiedHead(nnx.Module):
    """The output head of a tied-embedding language model: the embedding's ``attend``."""

    def __init__(self, embed):
        self.embed = embed

    def __call__(self, h):
        return self.embed.attend(h)


class TiedModel(nnx.Module):
    def __init__(self):
        embed = nnx.Embed(VOCAB, WIDTH, rngs=nnx.Rngs(0))
        self.layers = nnx.List([Embedder(embed), Mixer(), TiedHead(embed)])

    def __call__(self, tokens):
        for layer in self.layers:
            tokens = layer(tokens)
        return tokens


def token_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_stages_sharing_a_tied_parameter_are_a_named_error_not_two_copies():
    # Under jax.jit the embedding gets both uses' gradients; as two stages it trained as two
    # copies (losses apart from the second step on), silently.
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, 3)).astype(np.int32)
    labels = rng.integers(0, VOCAB, (BATCH, 3)).astype(np.int32)
    tx = optax.sgd(0.5)
    slices = island_slices(3)
    with pytest.raises(
        pw.errors.PlacementError,
        match=r"stage 0 \(Embedder\) at embed.embedding and stage 2 \(TiedHead\) at embed.embedding "
        r"hold the same nnx.Param",
    ):
        pipeline.Pipeline(list(TiedModel().layers), slices, loss_fn=token_loss, optimizer=tx)
    with pytest.raises(pw.errors.PlacementError, match="tied weights"):
        pipeline.DataParallel(TiedModel().layers, slices[:2], loss_fn=token_loss, optimizer=tx)
    with pytest.raises(pw.errors.PlacementError, match="tied weights"):
        pipeline.sequential(TiedModel().layers)
    # The model as one module keeps the tie, as jax.jit does.
    dp = pipeline.DataParallel(TiedModel(), slices[:2], loss_fn=token_loss, optimizer=tx)
    losses = [float(dp.train_step(tokens, labels).result(timeout=60)) for _ in range(3)]
    want, _ = reference_steps(TiedModel(), tx, tokens, labels, steps=3, loss_fn=token_loss)
    np.testing.assert_allclose(losses, want, rtol=1e-6)


def test_elastic_losses_answer_as_the_futures_data_parallel_returns():
    # manager.train_step is "as dp.train_step": a loop logging f"{loss:.4f}" or stacking the
    # losses got TypeErrors from pw.elastic.Loss, which only had float() and np.asarray().
    x, y = batch()
    slices = island_slices(2)
    plain = pipeline.DataParallel(
        nnx.Linear(DIN, DOUT, rngs=nnx.Rngs(0)), slices, loss_fn=mse, optimizer=optax.adam(1e-2)
    )
    futures = [plain.train_step(x, y) for _ in range(3)]
    elastic = pipeline.DataParallel(
        nnx.Linear(DIN, DOUT, rngs=nnx.Rngs(0)), slices, loss_fn=mse, optimizer=optax.adam(1e-2)
    )
    manager = pw.elastic.Manager(elastic)
    losses = [manager.train_step(x, y) for _ in range(3)]
    want = np.asarray(jnp.stack([f.result(timeout=60) for f in futures]))
    assert losses[0].shape == () and losses[0].dtype == np.float32  # known without waiting
    np.testing.assert_array_equal(np.asarray(jnp.stack(losses)), want)
    assert [f"{loss:.4f}" for loss in losses] == [f"{w:.4f}" for w in want]
    assert [loss.item() for loss in losses] == want.tolist()
    np.testing.assert_array_equal(np.asarray(losses[1] + 1), want[1] + 1)
    assert bool(losses[2] < losses[0])
    doubled = jax.jit(lambda a: a * 2)(losses[0])
    np.testing.assert_array_equal(np.asarray(doubled), want[0] * 2)
    read = pw.results({"losses": losses})["losses"]  # as a tree of dp.train_step's futures
    assert all(type(r) is type(f.result()) for r, f in zip(read, futures, strict=True))
    np.testing.assert_array_equal(np.asarray(jnp.stack(read)), want)
    manager.wait(timeout=60)


def test_a_data_axis_no_slice_has_is_a_named_error_not_every_example_on_every_device():
    # data_axis="batch" on mesh={"data": 2}: every device of each slice ran the whole batch.
    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(2)]
    stages = [nnx.Linear(DIN, DOUT, rngs=nnx.Rngs(0)), nnx.relu]
    with pytest.raises(
        pw.errors.PlacementError,
        match=r"Pipeline: data_axis='batch' names an axis that none of the slices has \(their axes: \['data'\]\)",
    ):
        pipeline.Pipeline(stages, slices, data_axis="batch")
    for cls, extra in ((pipeline.DataParallel, {}), (pipeline.DiLoCo, {"sync_every": 2})):
        with pytest.raises(
            pw.errors.PlacementError, match=rf"{cls.__name__}: data_axis='batch' names an axis"
        ):
            cls(stages[0], slices, loss_fn=mse, optimizer=optax.sgd(0.1), data_axis="batch", **extra)
    with pytest.raises(pw.errors.PlacementError, match=r"data_axis is int 0; expected the name"):
        pipeline.Pipeline(stages, slices, data_axis=0)
    # The default "data" on slices without it, and None, replicate the batch as before.
    x, _ = batch()
    for axis, mesh in (("data", {"model": 2}), (None, {"data": 2})):
        pipe = pipeline.Pipeline(stages, [pw.devices(mesh=mesh, island=i) for i in range(2)], data_axis=axis)
        out = pipe.forward(x).result(timeout=60)
        assert out.sharding.spec == pw.P()
        np.testing.assert_allclose(np.asarray(out), np.asarray(nnx.relu(stages[0](x))), rtol=1e-6, atol=1e-7)


def test_data_parallel_given_one_optimizer_per_stage_says_it_takes_one():
    # A list of three stages with three optimizers was told "there are 1 stages".
    slices = island_slices(2)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"optimizer is a sequence of 3; a data-parallel"):
        pipeline.DataParallel(relu_mlp(), slices, loss_fn=mse, optimizer=[optax.sgd(0.1)] * 3)


class LinenDropoutBlock(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool = False):
        return linen.Dropout(0.5, deterministic=not train)(linen.Dense(DIN)(x))


def bridged_stages():
    """Linen modules wrapped for NNX (``bridge.ToNNX``), as a model half migrated to NNX holds them."""
    x, _ = batch()
    block = bridge.ToNNX(LinenDropoutBlock(), rngs=nnx.Rngs(0))
    bridge.lazy_init(block, x)
    head = bridge.ToNNX(linen.Dense(DOUT), rngs=nnx.Rngs(1))
    bridge.lazy_init(head, x)
    return [block, head]


def test_bridged_linen_stages_take_the_flag_and_rngs_as_linen_stages_do():
    # A ToNNX stage draws a key from each of its own streams at every call, used or not: that
    # was refused as a stale stream (even for a Dense, and under train=False), and train=False
    # reached Linen's Dense as an unexpected keyword.
    x, y = batch()
    key = jax.random.key(3)
    slices = island_slices(2)
    pipe = pipeline.Pipeline(bridged_stages(), slices, loss_fn=mse, optimizer=optax.sgd(0.1))
    evaluated = float(pipe.train_step(x, y, train=False).result(timeout=60))
    trained = float(pipe.loss_and_grads(x, y, train=True, rngs={"dropout": key})[0].result(timeout=60))
    with pytest.raises(pw.errors.ProgramTraceError, match=r"stage 0 \(nnx ToNNX\) needs an RNG stream"):
        pipe.train_step(x, y, train=True)

    block, head = bridged_stages()
    want_eval = mse(head(block(x, train=False)), y)
    np.testing.assert_allclose(evaluated, float(want_eval), rtol=1e-6)

    # After that step (sgd), the same model under plain JAX with the stage's derived keys.
    def run(stage, params, h, **kwargs):
        rest = nnx.state(stage, nnx.Not(nnx.Param))
        return nnx.merge(nnx.graphdef(stage), params, rest, copy=True)(h, **kwargs)

    stage_params = [nnx.state(stage, nnx.Param) for stage in (block, head)]
    eval_grads = jax.grad(lambda ps: mse(run(head, ps[1], run(block, ps[0], x)), y))(stage_params)
    for stage, params, grad in zip((block, head), stage_params, eval_grads, strict=True):
        nnx.update(stage, jax.tree.map(lambda p, g: p - 0.1 * g, params, grad))
    keys = [pipeline.derive_rngs({"dropout": key}, s, 0)["dropout"] for s in range(2)]
    hidden = block(x, train=True, rngs=nnx.Rngs(dropout=keys[0]))
    want_train = mse(head(hidden, rngs=nnx.Rngs(dropout=keys[1])), y)
    np.testing.assert_allclose(trained, float(want_train), rtol=1e-6)


def test_an_elastic_batch_error_suggests_raising_minimum_islands_only_where_it_can_be_raised():
    # A batch of 3 over 2 replicas: with minimum_islands=1 the counts are [1, 2] and raising it
    # helps; at minimum_islands=2 (all of them) the message said to raise it all the same.
    x, y = batch()
    x, y = x[:3], y[:3]
    slices = island_slices(2)
    for minimum, hint in ((1, True), (2, False)):
        model = pipeline.DataParallel(
            nnx.Linear(DIN, DOUT, rngs=nnx.Rngs(0)), slices, loss_fn=mse, optimizer=optax.sgd(0.1)
        )
        manager = pw.elastic.Manager(model, minimum_islands=minimum)
        with pytest.raises(pw.errors.PlacementError, match="use a multiple of 2") as caught:
            manager.train_step(x, y)
        assert ("raise minimum_islands" in str(caught.value)) is hint
