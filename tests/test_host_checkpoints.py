"""Orbax checkpoints of futures written and read by the Ray hosts themselves, as Orbax users write them."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import wait_for

import pathways_jax as pw

pytestmark = pytest.mark.timeout(240)

ROWS = 64  # leaves of 64 x 256 float32: 64 KiB, well above what rides back with a run's completion


def _init_state(key):
    """Parameters, an optimizer-like moment, typed PRNG keys and a step counter, made on the devices."""
    k1, k2 = jax.random.split(key)
    return {
        "w": jax.random.normal(k1, (ROWS, 256)),
        "m": jnp.zeros((ROWS, 256)),
        "b": jnp.arange(256.0),
        "keys": jax.random.split(k2, 4),
        "step": jnp.int32(0),
    }


def _train(state, x):
    grad = jnp.tanh(state["w"] * x)
    m = 0.9 * state["m"] + grad
    return {
        "w": state["w"] - 0.01 * m,
        "m": m,
        "b": state["b"] + x,
        "keys": jax.vmap(lambda k: jax.random.fold_in(k, 1))(state["keys"]),
        "step": state["step"] + 1,
    }


def _specs(axis):
    return {"w": pw.P(axis), "m": pw.P(axis), "b": pw.P(), "keys": pw.P(axis), "step": pw.P()}


def _numpy(state):
    """A state's values here, typed keys as their raw data: what bit-for-bit compares."""

    def one(value):
        value = value.result() if isinstance(value, pw.Future) else value
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            return ("keys", str(jax.random.key_impl(value)), np.asarray(jax.random.key_data(value)))
        return np.asarray(value)

    return jax.tree.map(one, state)


def _assert_same(got, want):
    flat_got, flat_want = jax.tree.leaves(_numpy(got)), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for a, b in zip(flat_got, flat_want, strict=True):
        assert type(a) is type(b)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b


def _plain(steps_before, steps_after=0):
    """Plain jax.jit: the state after ``steps_before`` steps, and after ``steps_after`` more."""
    train = jax.jit(_train)
    state = jax.jit(_init_state)(jax.random.key(0))
    for i in range(steps_before):
        state = train(state, jnp.float32(i))
    saved = _numpy(state)
    for i in range(steps_before, steps_before + steps_after):
        state = train(state, jnp.float32(i))
    return saved, _numpy(state)


def test_the_hosts_write_a_training_state_and_read_it_back_bit_for_bit_on_any_mesh(ray_cluster, tmp_path):
    """One island of two hosts (a value's shards on both): an async save while training donates the
    state, nothing fetched here, each host's own OCDBT subdirectory merged by Orbax; restored as
    futures on the same mesh and on another, bit for bit equal to plain jax.jit's state."""
    pw.init(backend="ray", hosts=2, devices_per_host=2, islands=1)
    s = pw.devices(mesh={"x": 4})
    init = pw.jit(_init_state, devices=s, out_specs=_specs("x"))
    train = pw.jit(_train, devices=s, out_specs=_specs("x"), donate_argnums=0)
    state = init(jax.random.key(0))
    for i in range(3):
        state = train(state, jnp.float32(i))
    saved, later = _plain(3, 2)

    before, counted = pw.counters()["fetches"], pw.counters()
    manager = ocp.CheckpointManager(tmp_path)
    manager.save(3, args=ocp.args.StandardSave(state))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    for i in range(3, 5):  # training goes on while the hosts write; the steps donate the saved state
        state = train(state, jnp.float32(i))
    manager.wait_until_finished()
    assert pw.counters()["fetches"] == before  # no value came to the controller
    assert manager.all_steps() == [3]
    assert pw.counters()["host_saves"] - counted["host_saves"] == 1
    written = {p.name for p in (tmp_path / "3" / "default").iterdir()}
    assert {"ocdbt.process_pwhost0", "ocdbt.process_pwhost1"} <= written, written
    _assert_same(state, later)  # (fetches the values)

    before = pw.counters()["fetches"]
    restored = manager.restore(3, args=ocp.args.StandardRestore(abstract))
    assert all(isinstance(leaf, pw.Future) for leaf in jax.tree.leaves(restored))
    assert pw.counters()["fetches"] == before
    assert pw.counters()["host_restores"] - counted["host_restores"] == 5
    _assert_same(restored, saved)  # read before the steps below donate it (as under jax.jit)
    # The restored futures feed a program directly, on their hosts.
    continued = restored
    for i in range(3, 5):
        continued = train(continued, jnp.float32(i))
    _assert_same(continued, later)

    # Another mesh: the hosts read the parts their devices hold under the new sharding.
    s2 = pw.devices(mesh={"a": 2, "b": 2})
    other = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s2.sharding(*(("b",) if v.ndim else ())))
        for k, v in abstract.items()
    }
    resharded = manager.restore(3, args=ocp.args.StandardRestore(other))
    for key, leaf in resharded.items():
        assert leaf.sharding == other[key].sharding, key
    _assert_same(resharded, saved)

    # A target of another shape is refused before anything is read, pointing at the caller.
    wrong = dict(
        abstract, w=jax.ShapeDtypeStruct((2 * ROWS, 256), jnp.float32, sharding=abstract["w"].sharding)
    )
    with pytest.raises(pw.errors.PlacementError, match=r"test_host_checkpoints.py.*holds shape \(64, 256\)"):
        manager.restore(3, args=ocp.args.StandardRestore(wrong))
    manager.close()


def test_a_checkpoint_restores_onto_fewer_islands_and_trains_on(ray_cluster, tmp_path):
    """Saved from the second of two islands, with leaves here beside it (an array, numpy, a scalar:
    one handler writes the tree's metadata once), restored into a cluster of one island with
    another mesh; the restored state trains on as plain jax.jit's does."""
    pw.init(backend="ray", hosts=2, devices_per_host=2, islands=2)
    s = pw.devices(mesh={"x": 2}, island=1)
    state = pw.jit(_init_state, devices=s, out_specs=_specs("x"))(jax.random.key(0))
    state = pw.jit(_train, devices=s, out_specs=_specs("x"))(state, jnp.float32(0))
    abstract = jax.tree.map(lambda f: jax.ShapeDtypeStruct(f.shape, f.dtype), state)
    tree = {"state": state, "here": jnp.arange(5.0), "numpy": np.arange(3), "lr": 0.5}
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.StandardSave(tree))
    pw.shutdown()
    saved, later = _plain(1, 1)

    pw.init(backend="ray", hosts=1, devices_per_host=2)
    one = pw.devices(mesh={"y": 2})
    target = {
        k: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=one.sharding(*(() if k in ("b", "step") else (None,)))
        )
        for k, v in abstract.items()
    }
    extras = {
        "here": jax.ShapeDtypeStruct((5,), jnp.float32, sharding=one.sharding()),
        "numpy": np.arange(3),
        "lr": 0.0,
    }
    with ocp.CheckpointManager(tmp_path) as manager:
        restored = manager.restore(1, args=ocp.args.StandardRestore({"state": target, **extras}))
    step = pw.jit(_train, devices=one)
    _assert_same(restored["state"], saved)
    _assert_same(step(restored["state"], jnp.float32(1)), later)
    np.testing.assert_array_equal(np.asarray(restored["here"]), np.arange(5.0))
    np.testing.assert_array_equal(restored["numpy"], np.arange(3))
    assert restored["lr"] == 0.5


def test_a_host_killed_while_it_writes_fails_that_save_and_the_next_one_is_whole(ray_cluster, tmp_path):
    """The save's commit raises HostLostError, the step is never marked saved, nothing hangs; once the
    island is rebuilt a new save of a recomputed state is complete and restores exactly."""
    cluster = pw.init(backend="ray", hosts=2, devices_per_host=1, islands=2)
    s = pw.devices(mesh={"x": 1}, island=1)
    init = pw.jit(_init_state, devices=s, out_specs=_specs(None))
    manager = ocp.CheckpointManager(tmp_path)
    pw.faults.kill_host(1, at_save=1)
    manager.save(0, args=ocp.args.StandardSave(init(jax.random.key(0))))
    with pytest.raises(Exception) as failed:
        manager.wait_until_finished()
    chain, error = [], failed.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, pw.errors.HostLostError) for e in chain), chain
    assert manager.all_steps() == []
    assert pw.counters()["host_save_failures"] >= 1
    assert wait_for(lambda: 1 not in cluster.backend.lost, timeout=60)

    s = pw.devices(mesh={"x": 1}, island=1)
    state = pw.jit(_init_state, devices=s, out_specs=_specs(None))(jax.random.key(0))
    manager.save(1, args=ocp.args.StandardSave(state), force=True)
    manager.wait_until_finished()
    assert manager.all_steps() == [1]
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    _assert_same(manager.restore(1, args=ocp.args.StandardRestore(abstract)), _plain(0)[0])
    manager.close()


def test_the_local_backend_saves_and_restores_futures_with_a_checkpoint_manager(tmp_path):
    """Where Orbax already works: the same code, futures saved as their arrays, restored as arrays."""
    s = pw.devices(mesh={"x": 2})
    init = pw.jit(_init_state, devices=s, out_specs=_specs("x"))
    state = init(jax.random.key(0))
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(0, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(0, args=ocp.args.StandardRestore(abstract))
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(restored))
    _assert_same(restored, _plain(0)[0])
    assert not any(
        p.name.startswith("ocdbt.process_pwhost") for p in pathlib.Path(tmp_path, "0", "default").iterdir()
    )
    assert os.path.isdir(tmp_path / "0")
