"""The per-call machinery of a program called in a loop: what a repeat call skips, counted, not timed.

Performance figures live in benchmarks/ (nnx_model.py, many_leaves.py); these
tests check that the shortcuts a repeat call takes are taken, and that they
change no result: a drop-in NNX train step stays bit-identical to ``nnx.jit``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pathways_jax as pw
from pathways_jax._src.api import tracing

pytestmark = pytest.mark.timeout(120)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc(self.norm(x))


class Tower(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(3)])
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


_TX = optax.adamw(1e-2)


def train_step(model: Tower, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: Tower) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _make() -> tuple[Tower, nnx.Optimizer]:
    model = Tower(nnx.Rngs(0))
    return model, nnx.Optimizer(model, _TX, wrt=nnx.Param)


def _batches(n: int) -> list[tuple[jax.Array, jax.Array]]:
    rng = np.random.default_rng(0)
    return [
        (jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), jnp.asarray(rng.normal(size=(4, 1)), jnp.float32))
        for _ in range(n)
    ]


def _assert_same(ours, theirs) -> None:
    ours, theirs = jax.tree.leaves(ours), jax.tree.leaves(theirs)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(a, b)


def test_nnx_train_loop_is_bit_identical_to_nnx_jit_and_traces_once():
    ours, reference = pw.program(train_step), nnx.jit(train_step)
    model, optimizer = _make()
    ref_model, ref_optimizer = _make()
    batches = _batches(8)
    ours(model, optimizer, *batches[0])
    reference(ref_model, ref_optimizer, *batches[0])
    before = pw.counters()
    for x, y in batches[1:]:
        loss = ours(model, optimizer, x, y)
        ref_loss = reference(ref_model, ref_optimizer, x, y)
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(ref_loss))
        # As after nnx.jit: the caller's Variables hold arrays, uncommitted as jax.jit's outputs.
        value = model.head.kernel.get_value()
        assert isinstance(value, jax.Array)
        assert value.committed == ref_model.head.kernel.get_value().committed
    after = pw.counters()
    assert after["traces"] == before["traces"]
    assert after["lowerings"] == before["lowerings"]
    assert after["runs"] - before["runs"] == len(batches) - 1
    _assert_same(nnx.state(model), nnx.state(ref_model))
    _assert_same(nnx.state(optimizer), nnx.state(ref_optimizer))


def test_repeat_call_with_arrays_of_the_same_types_takes_the_fast_path():
    step = pw.program(lambda p, x: jax.tree.map(lambda v: v * 0.5 + x, p))
    params = {"a": jnp.ones(3), "b": jnp.zeros((2, 2))}
    arrays = pw.results(step(params, jnp.float32(1.0)))
    assert step._last_leaves is not None  # the call's leaves were all arrays
    before = pw.counters()
    out = arrays
    for _ in range(3):
        out = pw.results(step(out, jnp.float32(1.0)))
    after = pw.counters()
    assert after["traces"] == before["traces"] and after["lowerings"] == before["lowerings"]
    expected = params
    for _ in range(4):
        expected = jax.jit(lambda p, x: jax.tree.map(lambda v: v * 0.5 + x, p))(expected, jnp.float32(1.0))
    _assert_same(out, expected)


def test_fast_path_misses_on_another_type_and_traces_it():
    step = pw.program(lambda v: v * 2)
    first = step(jnp.ones(3)).result()
    traced = pw.counters()["traces"]
    step(jnp.ones(3)).result()  # the same type: no trace
    assert pw.counters()["traces"] == traced
    other = step(jnp.ones(4)).result()  # another shape: its own trace
    assert pw.counters()["traces"] == traced + 1
    assert other.shape == (4,) and first.shape == (3,)
    wide = step(jnp.ones(3, jnp.int32)).result()  # another dtype, same shape
    assert wide.dtype == jnp.int32
    assert pw.counters()["traces"] == traced + 2


def test_marks_take_only_arrays_and_futures():
    assert tracing._marks([jnp.ones(2)]) is not None
    assert tracing._marks([np.ones(2)]) is None  # numpy: put on devices per call, by the slow path
    assert tracing._marks([1.0]) is None


def _decay(p):
    return jax.tree.map(lambda v: v * 0.99 + 0.01, p)


def test_second_call_with_the_futures_of_the_first_does_not_trace_again():
    step = pw.program(_decay)
    params = {"w": jnp.full((4,), 2.0), "b": jnp.zeros(())}  # uncommitted, as jnp makes them
    out = step(params)
    pw.results(out)  # dispatched and computed: the futures stand for arrays of the first call's types
    before = pw.counters()
    for _ in range(3):
        out = step(out)  # futures, of the types of the first call's arrays
    after = pw.counters()
    assert after["traces"] == before["traces"]
    assert after["lowerings"] == before["lowerings"]
    assert after["compiles"] == before["compiles"]
    expected = params
    for _ in range(4):
        expected = jax.jit(_decay)(expected)
    _assert_same(pw.results(out), expected)
    # As jax.jit's: the outputs of uncommitted arguments stay uncommitted.
    assert all(not leaf.committed for leaf in jax.tree.leaves(out))


def test_futures_of_other_types_than_the_arrays_trace_their_own_plan():
    step = pw.program(_decay)
    step({"w": jnp.ones(3)})
    traced = pw.counters()["traces"]
    other = step({"w": jnp.ones(5)})  # another shape: traced
    assert pw.counters()["traces"] == traced + 1
    step(other)  # the futures of the (5,) call: its plan, no trace
    assert pw.counters()["traces"] == traced + 1


def test_a_donating_program_traces_the_futures_signature():
    # A plan that donates its arguments consumes the buffers it reads: futures are
    # spent through their own plan (a read afterwards says so), never the arrays'.
    step = pw.program(_decay, donate_argnums=0)
    out = step({"w": jnp.ones(3)})
    traced = pw.counters()["traces"]
    out = step(out)
    assert pw.counters()["traces"] == traced + 1
    np.testing.assert_allclose(np.asarray(out["w"]), (1.0 * 0.99 + 0.01) * 0.99 + 0.01, rtol=1e-6)
