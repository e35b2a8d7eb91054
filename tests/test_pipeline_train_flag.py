"""pathways_jax.pipeline passes ``train`` under the name a stage's call takes it.

``train`` (Flax Linen style), ``training`` (nanoGPT), ``deterministic`` (the opposite sense,
Flax's Dropout) or a name given as ``train_kw=``; each against the same stages called in
plain Python with the same RNG streams. A stage that takes no flag is a named error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from test_pipeline_dropin import assert_tree_close, island_slices, make_data, mse

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)

DIN, HIDDEN, DOUT, MICRO = 4, 8, 3, 2


class _Block(nnx.Module):
    """Linear, tanh, dropout; the subclass's ``__call__`` sets the dropout from its flag.

    The call's own ``deterministic=`` overrides the Dropout's attribute, as in nanoGPT, so
    switching attributes (``module.train()``) alone does not turn dropout on.
    """

    def __init__(self, din, dout, seed):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=seed))

    def hidden(self, x):
        return jnp.tanh(self.linear(x))


class TrainBlock(_Block):
    def __call__(self, x, train: bool = False):
        return self.dropout(self.hidden(x), deterministic=not train)


class TrainingBlock(_Block):
    def __call__(self, x, *, training: bool = False):
        return self.dropout(self.hidden(x), deterministic=not training)


class DeterministicBlock(_Block):
    def __call__(self, x, deterministic: bool = True):
        return self.dropout(self.hidden(x), deterministic=deterministic)


class CustomBlock(_Block):
    def __call__(self, x, mode_is_training: bool = False):
        return self.dropout(self.hidden(x), deterministic=not mode_is_training)


class KwargsBlock(_Block):
    def __call__(self, x, **kwargs):
        return self.dropout(self.hidden(x), deterministic=not kwargs.get("train", False))


# (stage class, train_kw given to the pipeline, the keyword and value its call gets for train=True/False)
NAMINGS = {
    "train": (TrainBlock, None, lambda train: {"train": train}),
    "training": (TrainingBlock, None, lambda train: {"training": train}),
    "deterministic": (DeterministicBlock, None, lambda train: {"deterministic": not train}),
    "train_kw": (CustomBlock, "mode_is_training", lambda train: {"mode_is_training": train}),
    "kwargs": (KwargsBlock, None, lambda train: {"train": train}),
}


def make_blocks(cls):
    return [cls(DIN, HIDDEN, 0), cls(HIDDEN, DOUT, 1)]


def reference(blocks, x, key, flag, *, micro, derive):
    """The stages called in plain Python: microbatch m of stage s reseeded with ``derive(s, m)``."""
    outs = []
    for m, xm in enumerate(np.split(x, micro)):
        h = xm
        for s, block in enumerate(blocks):
            copy = nnx.clone(block)
            if key is not None:
                nnx.reseed(copy, **derive(s, m))
            h = copy(h, **flag)
        outs.append(h)
    return outs


def flag_options(train_kw):
    return {} if train_kw is None else {"train_kw": train_kw}


@pytest.mark.parametrize("naming", list(NAMINGS))
def test_pipeline_stage_gets_train_under_its_own_name(naming):
    cls, train_kw, flag = NAMINGS[naming]
    slices = island_slices(2)
    blocks = make_blocks(cls)
    x, _ = make_data(2)
    key = jax.random.key(3)
    rngs = {"dropout": key}
    pipe = pipeline.Pipeline(blocks, slices, num_microbatches=MICRO)
    options = flag_options(train_kw)

    got_train = pipe.forward(x, train=True, rngs=rngs, **options)
    want_train = reference(
        blocks, x, key, flag(True), micro=MICRO, derive=lambda s, m: pipeline.derive_rngs(rngs, s, m)
    )
    assert_tree_close(got_train, jnp.concatenate(want_train))
    got_eval = pipe.forward(x, train=False, **options)
    want_eval = reference(blocks, x, None, flag(False), micro=1, derive=None)[0]
    assert_tree_close(got_eval, want_eval)
    # Dropout really is on in training (and off in evaluation): the two outputs differ.
    assert not np.allclose(np.asarray(got_train.result()), np.asarray(got_eval.result()))


@pytest.mark.parametrize("naming", ["training", "train_kw"])
def test_data_parallel_model_gets_train_under_its_own_name(naming):
    cls, train_kw, flag = NAMINGS[naming]
    slices = island_slices(2, mesh={"data": 1})
    blocks = make_blocks(cls)
    x, y = make_data(4)
    rngs = {"dropout": jax.random.key(5)}
    dp = pipeline.DataParallel(blocks, slices, loss_fn=mse, optimizer=optax.sgd(0.1))

    def derive(s, i):  # shard i, then stage s of the composed model (see pipeline.sequential)
        return {name: jax.random.fold_in(k, s) for name, k in pipeline.derive_rngs(rngs, 0, i).items()}

    outs = reference(blocks, x, rngs["dropout"], flag(True), micro=2, derive=derive)
    want = np.mean([mse(out, ym) for out, ym in zip(outs, np.split(y, 2), strict=True)])
    loss = dp.train_step(x, y, rngs=rngs, train=True, **flag_options(train_kw))
    np.testing.assert_allclose(float(loss.result()), float(want), rtol=1e-5)
    eval_want = mse(reference(blocks, x, None, flag(False), micro=1, derive=None)[0], y)
    assert not np.isclose(float(want), float(eval_want))  # dropout changed the loss


def test_sequential_passes_train_under_the_stages_name():
    blocks = make_blocks(TrainingBlock)
    params, apply = pipeline.sequential(blocks)
    x, _ = make_data(6)
    rngs = {"dropout": jax.random.key(1)}
    got = nnx.jit(lambda p, x: apply(p, x, rngs=rngs, train=True))(params, x)
    want = reference(
        blocks,
        x,
        rngs["dropout"],
        {"training": True},
        micro=1,
        derive=lambda s, m: {"dropout": jax.random.fold_in(rngs["dropout"], s)},
    )[0]
    assert_tree_close(got, want)


class ManualDropoutBlock(nnx.Module):
    """Randomness of its own and a flag under a name the pipeline cannot guess."""

    def __init__(self, din, dout, seed):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
        self.rngs = nnx.Rngs(dropout=seed)

    def __call__(self, x, use_dropout: bool = False):
        h = jnp.tanh(self.linear(x))
        if use_dropout:
            h = jnp.where(jax.random.bernoulli(self.rngs.dropout(), 0.5, h.shape), h * 2, 0.0)
        return h


def test_train_true_for_a_stage_that_cannot_take_it_is_a_named_error():
    slices = island_slices(2)
    blocks = [ManualDropoutBlock(DIN, HIDDEN, 0), ManualDropoutBlock(HIDDEN, DOUT, 1)]
    x, y = make_data(3)
    rngs = {"dropout": jax.random.key(0)}
    pipe = pipeline.Pipeline(blocks, slices, loss_fn=mse, optimizer=optax.sgd(0.1), num_microbatches=MICRO)
    before = pw.counters()
    with pytest.raises(pw.errors.ProgramTraceError, match=r"train=True") as info:
        pipe.forward(x, train=True, rngs=rngs)
    message = str(info.value)
    assert "stage 0 (nnx ManualDropoutBlock)" in message
    assert "ManualDropoutBlock.__call__(self, x, use_dropout: bool = False)" in message
    assert "train, training or deterministic" in message and "train_kw=" in message
    with pytest.raises(pw.errors.ProgramTraceError, match=r"train_kw="):
        pipe.train_step(x, y, train=True, rngs=rngs)
    with pytest.raises(TypeError, match=r"train_kw="):  # also a TypeError, as Python's own
        pipe.loss_and_grads(x, y, train=True, rngs=rngs, train_kw="dropout_on")
    assert pw.counters()["runs"] == before["runs"]  # refused before anything ran

    # train=False (evaluation, what a stage without a flag does) and train=None pass nothing.
    want = reference(blocks, x, None, {}, micro=1, derive=None)[0]
    assert_tree_close(pipe.forward(x, train=False), want)
    assert_tree_close(pipe.forward(x), want)
    # Named, the flag arrives.
    got = pipe.forward(x, train=True, rngs=rngs, train_kw="use_dropout")
    want_train = reference(
        blocks,
        x,
        rngs["dropout"],
        {"use_dropout": True},
        micro=MICRO,
        derive=lambda s, m: pipeline.derive_rngs(rngs, s, m),
    )
    assert_tree_close(got, jnp.concatenate(want_train))


def test_data_parallel_and_function_stages_refuse_train_they_cannot_take():
    slices = island_slices(2, mesh={"data": 1})
    params = {"w": jnp.ones((DIN, DOUT))}
    dp = pipeline.DataParallel(
        (params, lambda p, x, dropout_on=False: x @ p["w"]), slices, loss_fn=mse, optimizer=optax.sgd(0.1)
    )
    x, y = make_data(0)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"apply_fn '<lambda>'.*\(p, x, dropout_on=False\)"):
        dp.train_step(x, y, train=True)
    float(dp.train_step(x, y, train=False).result())  # evaluation mode needs no flag
    params, apply = pipeline.sequential([ManualDropoutBlock(DIN, DOUT, 0)])
    with pytest.raises(pw.errors.ProgramTraceError, match=r"stage 0 \(nnx ManualDropoutBlock\)"):
        apply(params, x, train=True)
    assert_tree_close(
        apply(params, x, train=False),
        reference([ManualDropoutBlock(DIN, DOUT, 0)], x, None, {}, micro=1, derive=None)[0],
    )


def test_a_stage_class_signature_is_read_once(monkeypatch):
    from pathways_jax._src.pipeline import flags

    reads = []
    real = flags._read
    monkeypatch.setattr(flags, "_read", lambda fn: reads.append(fn) or real(fn))
    monkeypatch.setattr(flags, "_SIGNATURES", type(flags._SIGNATURES)())
    for seed in range(3):
        pipeline.as_stage(TrainingBlock(DIN, DOUT, seed))
    assert reads == [TrainingBlock.__call__]


class NormBlock(nnx.Module):
    """Linear then BatchNorm: running statistics that training updates."""

    def __init__(self, din, dout, seed):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
        self.norm = nnx.BatchNorm(dout, rngs=nnx.Rngs(seed))

    def __call__(self, x, train: bool = False):
        return jnp.tanh(self.norm(self.linear(x), use_running_average=not train))


def test_running_statistics_a_step_would_hold_fixed_are_a_named_error_and_evaluation_runs():
    from flax import linen

    slices = island_slices(2)
    blocks = [NormBlock(DIN, HIDDEN, 0), NormBlock(HIDDEN, DOUT, 1)]
    x, y = make_data(7)
    pipe = pipeline.Pipeline(blocks, slices, loss_fn=mse, optimizer=optax.sgd(0.1), num_microbatches=MICRO)
    before = pw.counters()
    with pytest.raises(pw.errors.ProgramTraceError, match=r"train=True was asked") as info:
        pipe.train_step(x, y, train=True)
    message = str(info.value)
    assert "stage 0 (nnx NormBlock)" in message and "norm.mean, norm.var" in message
    assert "train=False" in message and "nnx.LayerNorm" in message
    # No flag, with a BatchNorm in training mode by its own attribute (NNX's default): the same.
    with pytest.raises(pw.errors.ProgramTraceError, match=r"use_running_average=False"):
        pipe.forward(x)
    assert pw.counters()["runs"] == before["runs"]  # refused before anything ran
    dp = pipeline.DataParallel(blocks, slices, loss_fn=mse, optimizer=optax.sgd(0.1))
    with pytest.raises(pw.errors.ProgramTraceError, match=r"DataParallel.train_step: train=True"):
        dp.train_step(x, y, train=True)

    # Evaluation reads the running statistics as they are, as the plain model does.
    want = reference(blocks, x, None, {"train": False}, micro=1, derive=None)[0]
    assert_tree_close(pipe.forward(x, train=False), want)
    for block in blocks:
        block.eval()
    assert_tree_close(pipeline.Pipeline(blocks, slices, num_microbatches=MICRO).forward(x), want)

    # Linen's batch_stats collection: refused alike, rather than Linen's error from inside the trace.
    class LinenNorm(linen.Module):
        @linen.compact
        def __call__(self, x, train: bool = False):
            return linen.BatchNorm(use_running_average=not train)(linen.Dense(DOUT)(x))

    module = LinenNorm()
    dp = pipeline.DataParallel(
        (module, module.init(jax.random.key(0), x)), slices, loss_fn=mse, optimizer=optax.sgd(0.1)
    )
    with pytest.raises(pw.errors.ProgramTraceError, match=r"batch_stats\['BatchNorm_0'\]\['mean'\]"):
        dp.train_step(x, y, train=True)


class RequiredTrainBlock(_Block):
    def __call__(self, x, train: bool):  # no default: every call must say which
        return self.dropout(self.hidden(x), deterministic=not train)


def test_a_flag_the_stage_requires_and_the_call_leaves_out_is_a_named_error():
    slices = island_slices(1)
    pipe = pipeline.Pipeline(
        [RequiredTrainBlock(DIN, DOUT, 0)],
        slices,
        loss_fn=mse,
        optimizer=optax.sgd(0.1),
        num_microbatches=MICRO,
    )
    x, y = make_data(0)
    before = pw.counters()
    message = r"stage 0 \(nnx RequiredTrainBlock\) requires the flag: .*no default for 'train'.*train=True"
    with pytest.raises(pw.errors.ProgramTraceError, match=message):
        pipe.train_step(x, y)
    with pytest.raises(pw.errors.ProgramTraceError, match=message):
        pipe.forward(x)
    assert pw.counters()["runs"] == before["runs"]  # refused before anything ran
    params, apply = pipeline.sequential([(pipe.stages[0].params, lambda p, x, train: x)])
    with pytest.raises(pw.errors.ProgramTraceError, match=r"apply_fn '<lambda>'.*no default for 'train'"):
        apply(params, x)


def test_an_nnx_sequential_stage_is_switched_as_model_train_and_eval_switch_it():
    """nnx.Sequential hands keywords to its first layer only: the flag switches its Dropout."""

    def model():
        return nnx.Sequential(
            nnx.Linear(DIN, HIDDEN, rngs=nnx.Rngs(0)),
            nnx.relu,
            nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)),
            nnx.Linear(HIDDEN, DOUT, rngs=nnx.Rngs(1)),
        )

    pipe = pipeline.Pipeline([model()], island_slices(1, mesh={"data": 1}))
    x, _ = make_data(0)
    rngs = {"dropout": jax.random.key(3)}
    got_train = pipe.forward(x, train=True, rngs=rngs)
    got_eval = pipe.forward(x, train=False)

    @nnx.jit
    def plain(module, x, key):
        module.train()
        return module(x, rngs=nnx.Rngs(dropout=key))

    want_train = plain(model(), x, pipeline.derive_rngs(rngs, 0, 0)["dropout"])
    reference = model()
    reference.eval()
    want_eval = nnx.jit(lambda module, x: module(x))(reference, x)
    assert_tree_close(got_train, want_train)
    assert_tree_close(got_eval, want_eval)
    assert not np.allclose(np.asarray(want_train), np.asarray(want_eval))  # dropout was on


def linen_head_stages():
    """A Linen body that takes ``train`` (its dropout) and a plain ``linen.Dense`` head that takes no flag."""
    from test_pipeline_dropin import DropoutDense

    body, head = DropoutDense(HIDDEN), linen.Dense(DOUT)
    return [
        (body, body.init(jax.random.key(0), jnp.zeros((1, DIN)))),
        (head, head.init(jax.random.key(1), jnp.zeros((1, HIDDEN)))),
    ]


def test_a_linen_stage_the_flag_cannot_change_trains_with_train_true_as_plain_jit():
    """A Linen stage without a flag parameter, Dropout or BatchNorm is exempt, as an NNX one is."""
    stages = linen_head_stages()
    (body, _), (head, _) = stages
    x, y = make_data(4)
    key = jax.random.key(9)
    tx = optax.sgd(0.1)
    pipe = pipeline.Pipeline(stages, island_slices(2), loss_fn=mse, optimizer=tx, num_microbatches=MICRO)
    loss = pipe.train_step(x, y, rngs={"dropout": key}, train=True)

    @jax.jit
    def step(params, x, y):
        def loss_fn(params):
            total = 0.0
            for m, (xm, ym) in enumerate(zip(jnp.split(x, MICRO), jnp.split(y, MICRO), strict=True)):
                rngs = pipeline.derive_rngs({"dropout": key}, 0, m)
                h = body.apply({"params": params[0]}, xm, train=True, rngs=rngs)
                total = total + mse(head.apply({"params": params[1]}, h), ym)
            return total / MICRO

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return loss, optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])

    want_loss, want_params = step(tuple(variables["params"] for _, variables in stages), x, y)
    np.testing.assert_allclose(float(loss.result()), float(want_loss), rtol=1e-5)
    assert_tree_close(pipe.params, want_params)
    # In sequential() under jax.jit: the same exemption.
    variables = stages[1][1]
    h = np.asarray(body.apply(stages[0][1], x))
    params, apply = pipeline.sequential([stages[1]])
    assert_tree_close(jax.jit(lambda p, h: apply(p, h, train=True))(params, h), head.apply(variables, h))


class LinenCompactDropout(linen.Module):
    """Dropout always on, and no flag to switch it."""

    @linen.compact
    def __call__(self, x):
        return linen.Dropout(0.5, deterministic=False)(linen.Dense(DOUT)(x))


class LinenSetupDropout(linen.Module):
    """Dropout made in setup and held off by its attribute: train=True cannot turn it on."""

    def setup(self):
        self.dense = linen.Dense(DOUT)
        self.dropout = linen.Dropout(0.5, deterministic=True)

    def __call__(self, x):
        return self.dropout(self.dense(x))


def test_a_linen_stage_holding_dropout_without_a_flag_refuses_train_true():
    x, y = make_data(5)
    rngs = {"dropout": jax.random.key(0)}
    compact, setup = LinenCompactDropout(), LinenSetupDropout()
    stages = [(module, module.init(jax.random.key(2), x)) for module in (compact, setup)]
    pipe = pipeline.Pipeline(
        stages[:1], island_slices(2)[:1], loss_fn=mse, optimizer=optax.sgd(0.1), num_microbatches=MICRO
    )
    before = pw.counters()
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"Pipeline.train_step: train=True was asked"
    ) as info:
        pipe.train_step(x, y, rngs=rngs, train=True)
    message = str(info.value)
    assert "stage 0 (linen LinenCompactDropout)" in message and "Dropout at Dropout_0" in message
    assert "its call a `train` parameter" in message and "train=False" in message
    assert pw.counters()["runs"] == before["runs"]  # refused before anything ran
    dp = pipeline.DataParallel(
        stages[1], island_slices(2, mesh={"data": 1}), loss_fn=mse, optimizer=optax.sgd(0.1)
    )
    before = pw.counters()
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"DataParallel.train_step: train=True.*Dropout at dropout"
    ):
        dp.train_step(x, y, rngs=rngs, train=True)
    assert pw.counters()["runs"] == before["runs"]
    params, apply = pipeline.sequential(stages)
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"stage 0 \(linen LinenCompactDropout\).*Dropout_0"
    ):
        apply(params, x, rngs=rngs, train=True)
    # Evaluation needs no flag: the same as plain jax.jit.
    want = mse(jax.jit(setup.apply)(stages[1][1], x), y)
    np.testing.assert_allclose(float(dp.train_step(x, y, train=False).result()), float(want), rtol=1e-5)
