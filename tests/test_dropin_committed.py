"""Committed and uncommitted outputs, as jax.jit's: where nothing placed a call, its outputs follow others."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw


def _placement(array):
    return type(array.sharding).__name__, array.committed, array.devices()


@pytest.mark.parametrize(
    "args",
    [
        (),
        (jnp.arange(4.0),),
        (np.arange(4.0, dtype=np.float32),),
        (3.0,),
    ],
    ids=["no-arguments", "jnp-array", "numpy", "python-scalar"],
)
def test_outputs_of_a_call_nothing_placed_are_uncommitted_as_jax_jit_s(args):
    def f(*xs):
        return jnp.ones(4) * (xs[0] if xs else 1.0) + 1

    expected = jax.jit(f)(*args)
    future = pw.program(f)(*args)
    assert future.committed is False
    assert future.sharding == expected.sharding
    got = future.result()
    assert _placement(got) == _placement(expected)
    np.testing.assert_array_equal(got, expected)
    assert future.result() is got  # one array per future


def test_an_uncommitted_output_combines_with_an_array_committed_elsewhere():
    other = jax.device_put(jnp.ones(4), jax.devices()[1])
    expected = jax.jit(jnp.sin)(jnp.arange(4.0)) + other
    got = pw.program(jnp.sin)(jnp.arange(4.0)).result() + other  # ValueError while it was committed
    assert got.devices() == expected.devices() == {jax.devices()[1]}
    np.testing.assert_array_equal(got, expected)
    # A future combines as its array does.
    np.testing.assert_array_equal(pw.program(jnp.sin)(jnp.arange(4.0)) + other, expected)


def test_an_uncommitted_output_is_typed_as_jax_jit_s_and_mixes_with_values_on_a_mesh_of_the_user_s():
    # Its type held the default slice's mesh: jnp.add and jax.jit refused "Mesh for all inputs should be equal".
    mesh = jax.make_mesh((1,), ("data",))  # Explicit axes
    on_mesh = jax.device_put(
        jnp.ones(4), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    )
    expected = jax.jit(lambda v: v * 2)(jnp.arange(4.0))
    future = pw.program(lambda v: v * 2)(jnp.arange(4.0))
    assert jax.typeof(future) == jax.typeof(expected)
    assert jax.typeof(future.result()) == jax.typeof(expected)
    for combine in (jnp.add, jax.jit(jnp.add)):
        want = combine(expected, on_mesh)
        got = combine(future, on_mesh)
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(got, want)


def test_an_uncommitted_output_feeds_a_pmap():
    batch = jnp.arange(16.0).reshape(8, 2)
    doubled = jax.pmap(lambda v: v * 2)
    expected = doubled(jax.jit(lambda v: v + 1)(batch))
    np.testing.assert_array_equal(doubled(pw.program(lambda v: v + 1)(batch).result()), expected)


def test_a_train_loop_of_futures_stays_uncommitted_and_traces_twice():
    @pw.program
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    @jax.jit
    def reference(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    x = jnp.ones((3, 2))
    w, ref = jnp.full((2,), 0.5), jnp.full((2,), 0.5)
    before = pw.counters()["traces"]
    for _ in range(4):
        w, ref = step(w, x), reference(ref, x)
    assert pw.counters()["traces"] - before == 2  # arrays, then futures
    assert w.committed is False
    assert _placement(w.result()) == _placement(ref)
    np.testing.assert_allclose(w.result(), ref, rtol=1e-6)


@pytest.mark.parametrize(
    "arg",
    [jnp.arange(3.0), np.arange(3.0, dtype=np.float32), 1.5, jax.random.key(0)],
    ids=["jnp-array", "numpy", "python-scalar", "typed-key"],
)
def test_an_argument_or_a_constant_returned_as_it_is_stays_uncommitted_as_jax_jit_s(arg):
    # They came back committed on the default device: `out + other` raised "incompatible devices".
    def f(v):
        return v, (v, 7)

    other = jax.device_put(jnp.ones(3), jax.devices()[2])
    expected = jax.jit(f)(arg)
    got = pw.program(f)(arg)
    for want, future in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        assert future.committed is want.committed is False
        assert _placement(future.result()) == _placement(want)
        if not jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.jit(jnp.add)(future, other), jax.jit(jnp.add)(want, other))


def test_a_train_state_returning_its_key_as_it_is_traces_once_as_under_jax_jit():
    # The key came back committed, so the next call's outputs were committed: a third signature.
    # The futures of the first call (a Python int, an array) stand for values of its types:
    # as jax.jit, one trace.
    def step(count, key):
        return count + 1, key, jax.random.fold_in(key, count)

    program = pw.program(step)
    count, key = 0, jax.random.key(3)
    before = pw.counters()["traces"]
    for _ in range(4):
        count, key, _ = program(count, key)
    assert pw.counters()["traces"] - before == 1
    assert count.committed is False and key.committed is False
    assert int(count) == 4


def test_under_jax_default_device_outputs_are_uncommitted_there():
    device = jax.devices()[3]
    with jax.default_device(device):
        expected = jax.jit(lambda: jnp.ones(3))()
        got = pw.program(lambda: jnp.ones(3))().result()
    assert _placement(got) == _placement(expected) == ("SingleDeviceSharding", False, {device})


def test_a_committed_argument_or_a_slice_commits_the_outputs():
    committed = jax.device_put(jnp.ones(3), jax.devices()[2])
    expected = jax.jit(lambda v: v * 2)(committed)
    got = pw.program(lambda v: v * 2)(committed)
    assert got.committed and got.result().committed and expected.committed
    assert got.result().devices() == expected.devices()
    s = pw.devices(mesh={"x": 1})
    on_slice = pw.jit(lambda v: v * 2, devices=s)(jnp.ones(3))
    assert on_slice.committed and on_slice.result().committed
    assert on_slice.sharding == s.sharding()


def test_deleting_a_future_deletes_the_array_result_gave():
    future = pw.program(lambda v: v * 2)(jnp.arange(4.0))
    array = future.result()
    future.delete()
    assert array.is_deleted()
    with pytest.raises(pw.errors.PathwaysError):
        future.result()


def test_an_nnx_model_made_in_a_program_holds_uncommitted_arrays_as_under_nnx_jit():
    nnx = pytest.importorskip("flax.nnx")

    def make():
        return nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    expected, got = nnx.jit(make)(), pw.program(make)()
    assert _placement(got.kernel[...]) == _placement(expected.kernel[...])
    np.testing.assert_array_equal(got.kernel[...], expected.kernel[...])
