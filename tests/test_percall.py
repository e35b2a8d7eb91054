"""The per-call machinery of a program called in a loop: what a repeat call skips, counted, not timed.

Performance figures live in benchmarks/ (nnx_model.py, many_leaves.py); these
tests check that the shortcuts a repeat call takes are taken, and that they
change no result: a drop-in NNX train step stays bit-identical to ``nnx.jit``.
"""

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import jax_config

import pathways_jax as pw
from pathways_jax._src.api import arguments, nnx_graph
from pathways_jax._src.backends import local
from pathways_jax._src.runtime import clusters

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
    assert step._repeats.last_leaves is not None  # the call's leaves were all arrays
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


def _halve_and_add(p, x):
    return jax.tree.map(lambda v: v * 0.5 + x, p)


def test_a_repeat_call_of_plain_leaves_looks_for_no_nnx_object(monkeypatch):
    """The repeat of a call that took no NNX object runs its plan before looking for NNX objects."""
    step = pw.program(_halve_and_add)
    params = {"a": jnp.ones(3), "b": jnp.zeros((2, 2))}
    out = step(step(params, jnp.float32(1.0)), jnp.float32(1.0))  # arrays, then futures: both kept
    looked = []
    real = nnx_graph.takes_objects
    monkeypatch.setattr(nnx_graph, "takes_objects", lambda *a: looked.append(a) or real(*a))
    for _ in range(3):
        out = step(out, jnp.float32(1.0))
    assert not looked  # it was looked for on every call
    expected = params
    for _ in range(5):
        expected = jax.jit(_halve_and_add)(expected, jnp.float32(1.0))
    _assert_same(pw.results(out), expected)
    # The same program handed a model where its plain leaves were is still run as nnx.jit runs it.
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    total = lambda m, x: sum(jnp.sum(v) for v in jax.tree.leaves(nnx.state(m))) + x  # noqa: E731
    mixed = pw.program(total)
    mixed({"w": jnp.ones(2)}, jnp.float32(1.0)).result()
    mixed({"w": jnp.ones(2)}, jnp.float32(1.0)).result()
    _assert_same(mixed(model, jnp.float32(1.0)).result(), nnx.jit(total)(model, jnp.float32(1.0)))
    assert looked  # a call that repeats no plain-leaf call looks


def test_a_plan_of_one_executable_runs_by_the_local_backends_direct_path(monkeypatch):
    """One executable, nothing pinned, donated or staged: the local backend runs it in fewer steps."""
    ran = []
    real = local._direct
    monkeypatch.setattr(local, "_direct", lambda run, *rest: ran.append(run.id) or real(run, *rest))
    step = pw.program(lambda v: jnp.tanh(v) * 2.0 + 1.0)
    out, expected = jnp.linspace(-1.0, 1.0, 5), jnp.linspace(-1.0, 1.0, 5)
    for _ in range(3):
        out = step(out)
        expected = jax.jit(lambda v: jnp.tanh(v) * 2.0 + 1.0)(expected)
    _assert_same(out.result(), expected)
    assert len(ran) == 3
    # Its failure reads as the loop's did: under jax_debug_infs, the operation that made the inf.
    divide = pw.program(lambda v: 1.0 / v)
    with (
        jax_config("jax_debug_infs", True),
        pytest.raises(FloatingPointError, match=r"invalid value \(inf\) encountered in div"),
    ):
        divide(jnp.zeros(2)).result(timeout=60)
    assert len(ran) == 4


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


def test_marks_take_arrays_futures_and_host_values_of_exact_types():
    import enum

    class Level(enum.IntEnum):
        LOW = 1

    assert arguments._marks([jnp.ones(2)]) is not None
    assert arguments._marks([1.0, 2, True]) == (float, int, bool)  # a Python scalar's key is its type
    pw.program(lambda v: v)(np.ones(2, np.float32))  # a numpy kind is marked once a call took it
    assert arguments._marks([np.ones(2, np.float32)]) is not None
    assert arguments._marks([Level.LOW]) is None  # subclasses are signed each call
    assert arguments._marks([np.ma.masked_array(np.ones(2, np.float32))]) is None


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


def test_the_second_call_finds_the_first_calls_plan_by_the_keys_of_that_plan_itself(monkeypatch):
    # Each output's array key is noted when its plan is made: the second call (the first with
    # futures) makes no key per leaf, and finds keys that are the objects of the plan's own key.
    step = pw.program(_decay)
    params = {"w": jnp.full((4,), 2.0), "b": jnp.zeros(()), "c": jnp.zeros(())}
    out = step(params)
    (first_key,) = list(step._plans)
    futures = tuple(leaf._entry.signature for leaf in jax.tree.leaves(out))
    made = []
    monkeypatch.setattr(arguments, "_as_array_key", lambda key: made.append(key))
    keys = arguments._as_array_keys(futures)
    assert made == []
    assert all(found is mine for found, mine in zip(keys, first_key[1], strict=True))
    traced = pw.counters()["traces"]
    out = step(out)
    assert pw.counters()["traces"] == traced and made == []
    _assert_same(pw.results(out), jax.jit(_decay)(jax.jit(_decay)(params)))


def test_an_array_key_noted_for_a_future_key_gone_is_not_taken_for_another():
    # Noted by the identity of the future's key: a key made later at the same address is not it.
    step = pw.program(_decay)
    out = step({"w": jnp.ones(3)})
    key = jax.tree.leaves(out)[0]._entry.signature
    other = key._replace(shape=(5,))
    arguments._ARRAY_KEYS[id(other)] = arguments._ARRAY_KEYS[id(key)]  # as if other took key's place
    (found,) = arguments._as_array_keys((other,))
    assert found.shape == (5,)


def test_futures_of_other_types_than_the_arrays_trace_their_own_plan():
    step = pw.program(_decay)
    step({"w": jnp.ones(3)})
    traced = pw.counters()["traces"]
    other = step({"w": jnp.ones(5)})  # another shape: traced
    assert pw.counters()["traces"] == traced + 1
    step(other)  # the futures of the (5,) call: its plan, no trace
    assert pw.counters()["traces"] == traced + 1


def test_a_donating_program_runs_the_arrays_plan_with_futures_and_spends_them():
    # A plan that donates its arguments consumes the buffers it reads: futures fed where it
    # takes arrays are spent as a donated array is deleted (a read afterwards says so), with
    # no second trace (as jax.jit's second call).
    step = pw.program(_decay, donate_argnums=0)
    first = step({"w": jnp.ones(3)})
    traced = pw.counters()["traces"]
    out = step(first)
    assert pw.counters()["traces"] == traced
    np.testing.assert_allclose(np.asarray(out["w"]), (1.0 * 0.99 + 0.01) * 0.99 + 0.01, rtol=1e-6)
    with pytest.raises(pw.errors.PathwaysError, match="was donated"):
        first["w"].result()


def _live_values() -> int:
    return clusters.cluster().store.live_count()


def test_nnx_repeat_call_writes_states_back_without_futures():
    # A repeat call runs the call before's plan and reads the states it writes back
    # straight from the run: no future, and no store entry outliving the call, for them.
    ours, reference = pw.program(train_step), nnx.jit(train_step)
    model, optimizer = _make()
    ref_model, ref_optimizer = _make()
    batches = _batches(7)
    for x, y in batches[:3]:  # the first call's arrays, then twice the types written back
        ours(model, optimizer, x, y).result()
        reference(ref_model, ref_optimizer, x, y)
    inner = next(iter(ours._nnx_calls.values()))
    assert inner._written is not None  # the third call took the repeat path
    states = len(jax.tree.leaves(nnx.state((model, optimizer))))
    before = _live_values()
    store = clusters.cluster().store
    first = next(store._ids)
    losses = [ours(model, optimizer, x, y) for x, y in batches[3:]]
    made = next(store._ids) - first - 1
    ref_losses = [reference(ref_model, ref_optimizer, x, y) for x, y in batches[3:]]
    # Only the losses are held: the states' entries went when the call returned.
    assert _live_values() - before <= len(losses) < states
    # A run has one entry for all its outputs, and its loss one more: not one per state.
    assert made == 2 * len(losses)
    assert all(isinstance(loss, pw.Future) for loss in losses)
    for state in jax.tree.leaves(nnx.state((model, optimizer))):
        assert isinstance(state, jax.Array) and not isinstance(state, pw.Future)
    for loss, ref_loss in zip(losses, ref_losses, strict=True):
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(ref_loss))
    _assert_same(nnx.state(model), nnx.state(ref_model))
    _assert_same(nnx.state(optimizer), nnx.state(ref_optimizer))


def test_nnx_repeat_path_retraces_when_the_graph_or_a_state_type_changes():
    ours, reference = pw.program(train_step), nnx.jit(train_step)
    model, optimizer = _make()
    ref_model, ref_optimizer = _make()
    (x, y), (x2, y2), (x3, y3), (x4, y4), (x5, y5) = _batches(5)
    for step, m, o in ((ours, model, optimizer), (reference, ref_model, ref_optimizer)):
        step(m, o, x, y)
        step(m, o, x2, y2)
        step(m, o, x5, y5)
    assert next(iter(ours._nnx_calls.values()))._written is not None
    traced = pw.counters()["traces"]
    # Another structure: a new attribute holding a Variable, as nnx.jit retraces for.
    for m in (model, ref_model):
        m.extra = nnx.BatchStat(jnp.zeros(()))
    loss = ours(model, optimizer, x3, y3)
    ref_loss = reference(ref_model, ref_optimizer, x3, y3)
    assert pw.counters()["traces"] == traced + 1
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(ref_loss))
    # Another dtype of one state (same shape): traced again, as under nnx.jit.
    for m in (model, ref_model):
        m.extra.set_value(jnp.zeros((), jnp.int32))
    loss = ours(model, optimizer, x4, y4)
    ref_loss = reference(ref_model, ref_optimizer, x4, y4)
    assert pw.counters()["traces"] == traced + 2
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(ref_loss))
    assert model.extra.get_value().dtype == jnp.int32
    _assert_same(nnx.state(model), nnx.state(ref_model))
    _assert_same(nnx.state(optimizer), nnx.state(ref_optimizer))


def test_nnx_repeat_path_keeps_returned_objects_and_outputs():
    # A step that returns an NNX object and a tuple: the returned object's states are
    # arrays (as after nnx.jit), the other outputs futures, on the repeat path as on the first.
    def step(model: Tower, x: jax.Array) -> tuple:
        out = model(x)
        model.head.bias.set_value(model.head.bias.get_value() + 1.0)
        return model, (out.sum(), out)

    ours, reference = pw.program(step), nnx.jit(step)
    model, ref_model = Tower(nnx.Rngs(0)), Tower(nnx.Rngs(0))
    for batch, _ in _batches(4):
        returned, (total, out) = ours(model, batch)
        ref_returned, (ref_total, ref_out) = reference(ref_model, batch)
        assert returned is model and ref_returned is ref_model
        assert isinstance(total, pw.Future) and isinstance(out, pw.Future)
        np.testing.assert_array_equal(np.asarray(total), np.asarray(ref_total))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    assert next(iter(ours._nnx_calls.values()))._written is not None
    bias = model.head.bias.get_value()
    assert isinstance(bias, jax.Array) and not bias.committed
    _assert_same(nnx.state(model), nnx.state(ref_model))


def _scale(p, x):
    return jax.tree.map(lambda v: v * 0.5 + x, p)


def test_outputs_of_a_call_nothing_placed_come_uncommitted_from_the_executable():
    # Compiled as jax.jit compiles such a call: the executable's own outputs are what
    # jax.jit returns (uncommitted, no mesh in their type), so none is remade per call.
    step = pw.program(_scale)
    params = {"a": jnp.ones(3), "b": jnp.zeros((2, 2), jnp.bfloat16)}
    out = step(params, jnp.float32(1.0))
    for _ in range(3):
        out = step(out, jnp.float32(1.0))
    expected = params
    for _ in range(4):
        expected = jax.jit(_scale)(expected, jnp.float32(1.0))
    for future, reference in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        value = future.result()
        assert value is future._entry.array  # the executable's output itself
        assert not value.committed and value.committed == reference.committed
        assert value.aval == reference.aval and value.sharding == reference.sharding
        np.testing.assert_array_equal(np.asarray(value), np.asarray(reference))


@pytest.mark.parametrize("kind", ["numpy", "python", "committed"])
def test_loose_executables_take_host_and_committed_inputs_as_jax_jit(kind):
    def f(x, y):
        return x * 2 + y, 0.1 * y

    x = {"numpy": np.arange(3.0, dtype=np.float32), "python": 2.0}.get(kind)
    if x is None:
        x = jax.device_put(jnp.arange(3.0), jax.devices()[0])
    ours = pw.program(f)
    for _ in range(2):  # the first call and the repeat
        got = pw.results(ours(x, 1.5))
        want = jax.jit(f)(x, 1.5)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type)
            assert a.committed == b.committed
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_values_read_without_futures_are_freed_when_the_wait_is_interrupted(monkeypatch):
    # Only the caller holds a batched run's entry while submit_values waits for its dispatch:
    # an interrupt there frees it, so the run publishes into nothing and its values go.
    from pathways_jax._src.runtime import futures, object_store

    store = object_store.ObjectStore()
    batch = store.new_batch(object_store.Owner("client", 0), "a run")

    def interrupted(entry, timeout):
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "wait_settled", interrupted)
    with pytest.raises(KeyboardInterrupt):
        futures.batch_values(batch, None, [None, None], store, [True, False])
    assert store.live_count() == 0
    assert type(batch.state) is object_store.Freed


@pytest.mark.parametrize("bad", [0, 3])  # the first call (traced), and a repeat call
def test_a_step_whose_run_fails_at_dispatch_raises_and_leaves_the_model_as_nnx_jit(bad):
    # A host callback that raises on one batch fails the run as it is dispatched: under nnx.jit
    # the call raises and the model keeps its states, so the loop goes on. A program wrote the
    # failed run's futures into the Variables, and every later step failed on them.
    def check(total):
        if float(total) < 0:
            raise ValueError("a bad batch")
        return np.zeros((), np.float32)

    def step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        flag = jax.experimental.io_callback(check, jax.ShapeDtypeStruct((), jnp.float32), x.sum())
        optimizer.update(model, grads)
        return loss + flag

    results = []
    for wrap in (nnx.jit, pw.program):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        f, losses = wrap(step), []
        for i in range(6):
            x = jnp.full((2, 3), -1.0 if i == bad else 1.0)
            try:
                losses.append(float(f(model, optimizer, x, jnp.ones((2, 1)))))
            except jax.errors.JaxRuntimeError as exc:
                assert "a bad batch" in str(exc)
                losses.append(None)
        results.append((losses, nnx.state((model, optimizer))))
    (want, want_state), (got, got_state) = results
    assert want[bad] is None and got == want
    _assert_same(got_state, want_state)
