"""Flax NNX objects as arguments of ``@pw.program`` and ``pw.jit``: the semantics of ``nnx.jit``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.layer1 = nnx.Linear(din, hidden, rngs=rngs)
        self.layer2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layer2(nnx.relu(self.layer1(x)))


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def _batches(n: int, batch: int = 8, din: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(batch, din)).astype(np.float32), rng.normal(size=(batch, 1)).astype(np.float32))
        for _ in range(n)
    ]


def _value(variable: nnx.Variable) -> np.ndarray:
    return np.asarray(variable.get_value())


# One transformation for every optimizer: the optimizer's static structure (what a
# trace is cached on, here as in nnx.jit) includes its functions.
_TX = optax.adamw(1e-2)


def _make(seed: int = 0) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(4, 16, 1, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, _TX, wrt=nnx.Param)


def _assert_states_close(state, reference, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ours, theirs = jax.tree.leaves(state), jax.tree.leaves(reference)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def test_training_matches_nnx_jit_and_updates_the_callers_model():
    s = pw.devices(mesh={"x": 1})
    ours, reference = pw.program(train_step, devices=s), nnx.jit(train_step)
    model, optimizer = _make()
    ref_model, ref_optimizer = _make()
    kernel = model.layer1.kernel
    for x, y in _batches(10):
        before = _value(model.layer1.kernel)
        loss = ours(model, optimizer, x, y)
        ref_loss = reference(ref_model, ref_optimizer, x, y)
        assert isinstance(loss, pw.Future)
        # The caller's Variables (the same objects) now hold the step's arrays, as after nnx.jit.
        assert model.layer1.kernel is kernel
        assert isinstance(model.layer1.kernel.get_value(), jax.Array)
        assert not np.allclose(_value(model.layer1.kernel), before)
        np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            _value(model.layer1.kernel), _value(ref_model.layer1.kernel), rtol=1e-5, atol=1e-6
        )
    _assert_states_close(nnx.state(model), nnx.state(ref_model))
    _assert_states_close(nnx.state(optimizer), nnx.state(ref_optimizer))
    assert int(np.asarray(optimizer.step.get_value())) == 10
    s.release()


def test_second_call_neither_retraces_nor_relowers():
    ours = pw.program(train_step, devices=pw.devices(mesh={"x": 1}))
    model, optimizer = _make()
    batches = _batches(4)
    ours(model, optimizer, *batches[0])  # arrays in the caller's Variables
    traced = pw.counters()["traces"]
    other_model, other_optimizer = _make(seed=1)  # same structure, other objects
    ours(other_model, other_optimizer, *batches[0])
    assert pw.counters()["traces"] == traced
    ours(model, optimizer, *batches[1])  # the slice's arrays from here on: at most one more signature
    before = pw.counters()
    losses = [ours(model, optimizer, x, y) for x, y in batches[2:]]
    after = pw.counters()
    assert after["traces"] == before["traces"]
    assert after["lowerings"] == before["lowerings"]
    assert after["compiles"] == before["compiles"]
    assert all(np.isfinite(np.asarray(loss)) for loss in losses)


def test_call_returns_once_dispatched_with_arrays_in_the_callers_variables():
    # As nnx.jit: the call waits for the step's dispatch, not for its result. The output is a
    # future; the caller's Variables hold the step's arrays (which may still be computing).
    ours = pw.program(train_step, devices=pw.devices(mesh={"x": 1}))
    model, optimizer = _make()
    for x, y in _batches(3):
        loss = ours(model, optimizer, x, y)
    assert isinstance(loss, pw.Future)
    leaves = [leaf for leaf in jax.tree.leaves(nnx.state((model, optimizer)))]
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    assert np.isfinite(loss.result())


def test_eager_code_mutates_the_model_between_program_steps_as_after_nnx_jit():
    # Eager NNX code between steps (a counter bumped by hand, BatchNorm and Dropout in train
    # mode, nnx.clone) reads and writes the Variables a program step left.
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.seen = nnx.BatchStat(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.seen[...] = self.seen[...] + 1
            return self.drop(self.norm(self.linear(x)))

    def step(net, x):
        return net(x).sum()

    x = jnp.arange(8.0).reshape(2, 4) / 8
    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    program, reference = pw.program(step, devices=pw.devices(mesh={"x": 1})), nnx.jit(step)
    for _ in range(3):
        got, want = program(ours, x), reference(theirs, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        # Eager, in train mode, between steps.
        np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(theirs(x)), rtol=1e-5, atol=1e-6)
        ours.seen[...] += 10
        theirs.seen[...] += 10
    clone = nnx.clone(ours)
    np.testing.assert_allclose(np.asarray(clone(x)), np.asarray(nnx.clone(theirs)(x)), rtol=1e-5, atol=1e-6)
    _assert_states_close(
        nnx.state(ours, nnx.Param, nnx.BatchStat), nnx.state(theirs, nnx.Param, nnx.BatchStat)
    )
    assert int(ours.seen[...]) == 3 + 3 + 3 * 10  # 3 program steps, 3 eager calls, 3 bumps of 10


def test_trained_model_runs_outside_any_program():
    s = pw.devices(mesh={"x": 1})
    ours, reference = pw.program(train_step, devices=s), nnx.jit(train_step)
    model, optimizer = _make()
    ref_model, ref_optimizer = _make()
    for x, y in _batches(5):
        ours(model, optimizer, x, y)
        reference(ref_model, ref_optimizer, x, y)
    x = _batches(1)[0][0]
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(ref_model(x)), rtol=1e-5, atol=1e-6)
    # And nnx.jit takes the model whose Variables hold futures.
    np.testing.assert_allclose(
        np.asarray(nnx.jit(lambda m, v: m(v))(model, x)), np.asarray(ref_model(x)), rtol=1e-5, atol=1e-6
    )


def test_sharded_model_on_a_two_axis_slice_matches_nnx_jit_on_a_mesh():
    s = pw.devices(mesh={"data": 2, "model": 2})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))

    class Sharded(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(4, 8, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
            self.down = nnx.Linear(8, 1, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    def make(on):
        with jax.set_mesh(on):  # Flax shards each annotated parameter as it is made
            model = Sharded(nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    model, optimizer = make(s.physical_mesh)
    ref_model, ref_optimizer = make(mesh)
    assert model.up.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "model")
    ours, reference = pw.program(train_step, devices=s), nnx.jit(train_step)
    for x, y in _batches(3):
        loss = ours(
            model, optimizer, jax.device_put(x, s.sharding("data")), jax.device_put(y, s.sharding("data"))
        )
        ref_loss = reference(
            ref_model,
            ref_optimizer,
            jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))),
            jax.device_put(y, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))),
        )
        np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5, atol=1e-6)
    _assert_states_close(nnx.state(model), nnx.state(ref_model))
    kernel = model.up.kernel.get_value()
    assert isinstance(kernel, jax.Array)
    assert len(kernel.sharding.device_set) == 4
    s.release()


class Holder(nnx.Module):
    def __init__(self, variable: nnx.Variable):
        self.v = variable


def test_shared_variables_stay_shared_and_new_attributes_reach_the_caller():
    s = pw.devices(mesh={"x": 1})

    def bump(a, b):
        a.v.set_value(a.v.get_value() + 1.0)
        b.v.set_value(b.v.get_value() + 10.0)  # the same Variable: one input, both updates
        a.extra = nnx.BatchStat(jnp.ones(2))
        return b

    shared = nnx.Param(jnp.zeros(3))
    a, b = Holder(shared), Holder(shared)
    ref_shared = nnx.Param(jnp.zeros(3))
    ref_a, ref_b = Holder(ref_shared), Holder(ref_shared)
    ours, reference = pw.program(bump, devices=s), nnx.jit(bump)
    graph = ours.graph(a, b)
    assert len(graph.inputs) == 1  # the shared Variable is one input, as in nnx.jit
    for _ in range(2):
        out = ours(a, b)
        ref_out = reference(ref_a, ref_b)
        assert a.v is shared and b.v is shared
        assert out is b and ref_out is ref_b
        np.testing.assert_allclose(_value(shared), _value(ref_shared))
    np.testing.assert_allclose(_value(shared), np.full(3, 22.0))
    np.testing.assert_allclose(_value(a.extra), _value(ref_a.extra))


def test_rngs_advance_like_nnx_jit():
    s = pw.devices(mesh={"x": 1})

    class Dropped(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(4, 8, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    def forward(model, x):
        return model(x)

    def noise(x, *, rngs):
        return x + jax.random.normal(rngs.params(), x.shape)

    x = jnp.ones((2, 4))
    model, ref_model = Dropped(nnx.Rngs(0, dropout=1)), Dropped(nnx.Rngs(0, dropout=1))
    rngs, ref_rngs = nnx.Rngs(params=3), nnx.Rngs(params=3)
    outs, ref_outs = [], []
    for _ in range(3):
        outs.append(np.asarray(pw.program(forward, devices=s)(model, x)))
        ref_outs.append(np.asarray(nnx.jit(forward)(ref_model, x)))
        np.testing.assert_allclose(
            np.asarray(pw.program(noise, devices=s)(x, rngs=rngs)),
            np.asarray(nnx.jit(noise)(x, rngs=ref_rngs)),
        )
    np.testing.assert_allclose(np.stack(outs), np.stack(ref_outs))
    assert not np.allclose(outs[0], outs[1])  # the dropout mask moved on
    assert int(np.asarray(rngs.params.count.get_value())) == 3
    assert int(np.asarray(model.dropout.rngs.count.get_value())) == int(
        np.asarray(ref_model.dropout.rngs.count.get_value())
    )


def test_nested_containers_keywords_and_returned_objects():
    s = pw.devices(mesh={"x": 1})

    def fn(pair, *, table):
        first, second = pair
        first.v.set_value(first.v.get_value() * 2.0)
        table["h"].v.set_value(table["h"].v.get_value() + second.v.get_value())
        return {"same": first, "new": Holder(nnx.Param(jnp.full(2, 5.0)))}

    one, two, three = (Holder(nnx.Param(jnp.full(2, float(i)))) for i in (1, 2, 3))
    out = pw.program(fn, devices=s)([one, two], table={"h": three})
    assert out["same"] is one
    assert isinstance(out["new"], Holder)
    np.testing.assert_allclose(_value(one.v), [2.0, 2.0])
    np.testing.assert_allclose(_value(three.v), [5.0, 5.0])
    np.testing.assert_allclose(_value(out["new"].v), [5.0, 5.0])


def test_pw_jit_updates_nnx_objects_in_place():
    s = pw.devices(mesh={"x": 1})
    step = pw.jit(train_step, devices=s)
    model, optimizer = _make()
    ref_model, ref_optimizer = _make()
    for x, y in _batches(3):
        loss = step(model, optimizer, x, y)  # outside a program: a one-node program
        np.testing.assert_allclose(
            np.asarray(loss), np.asarray(nnx.jit(train_step)(ref_model, ref_optimizer, x, y)), rtol=1e-5
        )

    @pw.program(devices=s)
    def twice(model, optimizer, x, y):  # inside a program: a node per call
        step(model, optimizer, x, y)
        return step(model, optimizer, x, y)

    x, y = _batches(1)[0]
    twice(model, optimizer, x, y)
    for _ in range(2):
        nnx.jit(train_step)(ref_model, ref_optimizer, x, y)
    _assert_states_close(nnx.state(model), nnx.state(ref_model))
    assert any("train_step" in node.name for node in twice.graph(model, optimizer, x, y).nodes)


def test_node_labels_point_at_the_users_line_not_flax():
    s = pw.devices(mesh={"x": 1})
    jitted = nnx.jit(train_step)

    @pw.program(devices=s)
    def step(model, optimizer, x, y):
        return jitted(model, optimizer, x, y)  # the label's line

    model, optimizer = _make()
    graph = step.graph(model, optimizer, *_batches(1)[0])
    line = step.__wrapped__.__code__.co_firstlineno + 2
    labels = [node.source_info for node in graph.nodes]
    assert any(label.startswith(f"test_nnx.py:{line} (") for label in labels), labels
    assert not any("compilation.py" in label or "linear.py" in label for label in labels), labels


def test_unsupported_nnx_state_is_a_named_error():
    s = pw.devices(mesh={"x": 1})
    holder = Holder(nnx.Variable("not an array"))
    with pytest.raises(pw.errors.ProgramTraceError, match=r"NNX.*argument \[0\]\.v holds a str"):
        pw.program(lambda h: h.v.get_value(), devices=s)(holder)


def test_modules_that_are_not_pytrees_and_static_arguments():
    s = pw.devices(mesh={"x": 1})

    class Graph(nnx.Module, pytree=False):  # a leaf of jax.tree: found by the signature
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))

    def scale(module, factor, offset):
        module.w.set_value(module.w.get_value() * factor + offset)
        return module.w.get_value().sum()

    module, ref_module = Graph(), Graph()
    ours, reference = pw.program(scale, devices=s, static_argnums=2), nnx.jit(scale, static_argnums=2)
    for _ in range(3):
        out, ref_out = ours(module, 2.0, 1), reference(ref_module, 2.0, 1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_allclose(_value(module.w), _value(ref_module.w))


class Tied(nnx.Module):
    """One layer used twice (weight tying): a graph, not a tree."""

    def __init__(self, rngs: nnx.Rngs):
        self.shared = nnx.Linear(2, 2, rngs=rngs)
        self.seq = nnx.Sequential(self.shared, nnx.relu, self.shared)

    def __call__(self, x):
        return self.seq(x)


def _make_tied_and_optimizer():
    model = Tied(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _tied_run(jit):
    model, opt = jit(_make_tied_and_optimizer)()
    shape = (model.seq.layers[0] is model.shared, model.seq.layers[2] is model.shared)

    @jit
    def step(m, o, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).sum())(m)
        o.update(m, grads)
        return loss

    losses = [float(step(model, opt, jnp.ones((1, 2)))) for _ in range(3)]
    return shape, len(jax.tree.leaves(nnx.state(model, nnx.Param))), losses


def test_a_model_made_inside_a_program_keeps_its_sharing_as_under_nnx_jit():
    # Returned NNX objects are merged as nnx.jit merges them; flattened as pytrees, the tied
    # layer became two copies (6 parameter leaves) and training diverged from nnx.jit's.
    want = _tied_run(nnx.jit)
    got = _tied_run(pw.program)
    assert want[0] == (True, True) and want[1] == 2
    assert got == want


def test_objects_a_program_returns_hold_arrays_for_eager_code():
    class Stats(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.zeros(3))

    cases = [
        (Stats, lambda s: s.count.__setitem__(..., s.count[...] + 1), lambda s: s.count[...]),
        (lambda: nnx.BatchNorm(3, rngs=nnx.Rngs(0)), lambda bn: bn(jnp.arange(6.0).reshape(2, 3)), None),
        (lambda: nnx.Dropout(0.5, rngs=nnx.Rngs(0)), lambda d: d(jnp.ones((2, 3))), None),
        (
            lambda: nnx.MultiMetric(loss=nnx.metrics.Average("loss")),
            lambda m: m.update(loss=jnp.array(2.0)),
            lambda m: m.compute()["loss"],
        ),
    ]
    for make, use, read in cases:
        want_obj, got_obj = nnx.jit(make)(), pw.program(make)()
        want, got = use(want_obj), use(got_obj)
        if read is not None:
            want, got = read(want_obj), read(got_obj)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        state = jax.tree.leaves(nnx.state(got_obj))
        assert all(isinstance(leaf, jax.Array) for leaf in state), [type(leaf) for leaf in state]


def test_a_program_returning_objects_and_values_keeps_the_values_futures():
    def make(x):
        return nnx.Linear(2, 2, rngs=nnx.Rngs(0)), x * 2

    layer, doubled = pw.program(make)(jnp.ones(2))
    want_layer, want = nnx.jit(make)(jnp.ones(2))
    assert isinstance(doubled, pw.Future)
    np.testing.assert_array_equal(doubled.result(), want)
    np.testing.assert_array_equal(layer.kernel[...], want_layer.kernel[...])
    graph = pw.program(make).graph(jnp.ones(2))  # the graph of the nnx.jit path
    assert graph.nodes
