"""JAX/Flax/Optax code with ``jax.jit`` swapped for ``pw.program``, compared with plain JAX."""

import jax
import jax.numpy as jnp
import numpy as np

import pathways_jax as pw


def _train_step(params):
    return {"w": params["w"] * 2, "layers": [params["layers"][0] + 1], "n": params["n"] + 1}


def test_flax_msgpack_serialize_takes_futures_as_their_arrays():
    # Flax's low-level msgpack_serialize (to_bytes without a state dict) raised
    # "can not serialize 'Future' object" on a tree of futures; jax.Arrays it packs.
    from flax import serialization
    from flax.serialization import msgpack_serialize  # bound before the first program call

    params = {"w": jnp.arange(3.0), "layers": [jnp.ones((2, 2))], "n": jnp.int32(0)}
    ours, theirs = pw.program(_train_step)(params), jax.jit(_train_step)(params)
    want = serialization.msgpack_serialize(theirs)
    assert serialization.msgpack_serialize(ours) == want
    assert msgpack_serialize(ours) == want
    assert serialization.msgpack_serialize({"step": ours["n"]}, in_place=True) == (
        serialization.msgpack_serialize({"step": theirs["n"]})
    )
    np.testing.assert_array_equal(serialization.msgpack_restore(want)["layers"][0], np.full((2, 2), 2.0))


def test_eager_writes_into_nnx_variables_holding_futures_work_as_after_nnx_jit():
    # Under a memory_budget (as on Ray hosts or a service) the Variables a program updates hold
    # futures; metrics.reset() and variable[...] = v between steps raised TypeError there.
    import optax
    from flax import nnx

    pw.init(memory_budget=1 << 30)

    class Model(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
            self.calls = nnx.Variable(jnp.int32(0))

        def __call__(self, x):
            self.calls[...] += 1
            return self.linear(x)

    def step(model, optimizer, metrics, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        metrics.update(values=loss)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(0), (8, 4))
    y = (x[:, 0] > 0).astype(jnp.int32)

    def train(jit):
        model = Model()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        metrics, seen, train_step = nnx.metrics.Average(), [], jit(step)
        for _ in range(2):
            train_step(model, optimizer, metrics, x, y)
            held = type(model.linear.bias.get_value())
            seen.append(float(metrics.compute()))
            metrics.reset()
            model.calls[...] = 10
            model.linear.bias[...] += 1.0
            model.linear.kernel[0] = jnp.zeros(2)
        return held, seen, jax.tree.map(np.asarray, nnx.state(model))

    held, mine, state = train(pw.program)
    assert held is pw.Future  # what the writes met
    _, theirs, want = train(nnx.jit)
    assert mine == theirs
    jax.tree.map(np.testing.assert_array_equal, state, want)


def test_flax_takes_a_future_of_a_key_where_it_takes_the_key():
    # A key a program returned (a TrainState's, or key, sub = split(key)) raised in Flax's own
    # key checks: nnx.Rngs "Invalid rng value", nnx.Dropout a TypeError, Linen "should be a jax.PRNGKey".
    import flax.linen as nn
    from flax import nnx

    def split(key):
        return tuple(jax.random.split(key))

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.Dropout(0.5, deterministic=not train)(nn.Dense(4)(x))

    def use(key):
        x = jnp.ones((2, 3))
        linen = Linen().init(key, x, False)
        return [
            nnx.Linear(3, 2, rngs=nnx.Rngs(key)).kernel[...],
            nnx.Rngs(dropout=key).dropout(),
            nnx.Dropout(0.5)(x, rngs=key),
            linen,
            Linen().apply(linen, x, True, rngs={"dropout": key}),
        ]

    for key in (jax.random.key(0), jax.random.PRNGKey(1)):
        (_, ours), (_, theirs) = pw.program(split)(key), jax.jit(split)(key)
        got, want = use(ours), use(theirs)
        got[1], want[1] = jax.random.key_data(got[1]), jax.random.key_data(want[1])
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_future_assigned_to_an_nnx_module_attribute_is_data_as_an_array_is():
    # A table a program computed, kept by a module: NNX took the future as static (left out of
    # nnx.state, so out of checkpoints and nnx.update; a constant of every nnx.jit trace).
    from flax import nnx

    class Embed(nnx.Module):
        def __init__(self, table):
            self.table = table
            self.scale = nnx.Param(jnp.ones(2))

        def __call__(self, i):
            return self.table[i] * self.scale[...]

    def table():
        return jnp.arange(6.0).reshape(3, 2)

    ours, theirs = Embed(pw.program(table)()), Embed(jax.jit(table)())
    state, want = nnx.state(ours), nnx.state(theirs)
    assert jax.tree.structure(state) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, state, want)
    for jit in (nnx.jit, pw.program):
        np.testing.assert_array_equal(jit(Embed.__call__)(ours, 1), jit(Embed.__call__)(theirs, 1))


def test_jnp_split_takes_a_future_of_indices_as_their_array():
    # jnp.split(x, indices) with the indices a program computed raised "Only scalar arrays can be
    # converted to Python scalars": JAX checks for an index array with isinstance(..., jax.Array).
    def cuts():
        return jnp.array([1, 3])

    x = jnp.arange(8.0).reshape(4, 2)
    ours, theirs = pw.program(cuts)(), jax.jit(cuts)()
    for split in (jnp.split, jnp.array_split, jnp.vsplit):
        for got, want in zip(split(x, ours), split(x, theirs), strict=True):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(jnp.hsplit(x.T, ours), jnp.hsplit(x.T, [1, 3]), strict=True):
        np.testing.assert_array_equal(got, want)


def _sgd_step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)


def test_a_program_made_again_of_the_same_function_traces_once_as_jax_jit_does():
    # jax.jit(step)(w, x) written inline in a loop traces once; pw.program(step)(w, x) traced and
    # lowered again at every call (a large model's trace, every step).
    pw.init()
    w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
    ours, theirs, traced = w, w, []
    for _ in range(4):
        ours, theirs = pw.program(_sgd_step)(ours, x), jax.jit(_sgd_step)(theirs, x)
        traced.append(pw.counters()["traces"])
    np.testing.assert_array_equal(ours, theirs)
    assert traced[1] == traced[-1]  # at most arrays, then futures: a program's two signatures
    assert pw.program(_sgd_step) is pw.program(_sgd_step)
    assert pw.program(_sgd_step, donate_argnums=0) is not pw.program(_sgd_step)  # other options
    kept = pw.program(_sgd_step)
    pw.shutdown()
    pw.init()
    assert pw.program(_sgd_step) is not kept  # made for the cluster since shut down


def test_a_function_defined_again_under_its_name_lets_its_old_program_go():
    # A notebook cell run again defines its step anew: the program kept for the old function
    # (and its compiled executables) goes, where it stayed until 64 others pushed it out.
    import gc
    import weakref

    pw.init()
    namespace = {"__name__": __name__}
    source = "def cell_step(x):\n    return x * {}\n"
    exec(source.format(2), namespace)  # the cell, run once
    first = namespace["cell_step"]
    gone = weakref.ref(first)
    np.testing.assert_array_equal(pw.program(first)(jnp.ones(3)), jnp.full(3, 2.0))
    assert pw.program(first) is pw.program(first)  # kept while it is the cell's function
    exec(source.format(3), namespace)  # the cell, run again
    np.testing.assert_array_equal(pw.program(namespace["cell_step"])(jnp.ones(3)), jnp.full(3, 3.0))
    del first
    gc.collect()
    assert gone() is None
