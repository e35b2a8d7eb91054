"""Checkpoints of pipelined models: save ``.state`` with Orbax, restore into a fresh model, go on.

The restored model, built anew as a new process would build it, continues exactly as the saved
one would have: bit-identical to the uninterrupted run, which matches plain jax.jit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)

BATCH, DIN, HIDDEN, DOUT, STEPS, SAVED = 8, 4, 5, 3, 4, 2


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def batches():
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(BATCH, DIN)).astype(np.float32), rng.normal(size=(BATCH, DOUT)).astype(np.float32))
        for _ in range(STEPS)
    ]


def stages(hidden=HIDDEN):
    return [nnx.Linear(DIN, hidden, rngs=nnx.Rngs(0)), nnx.Linear(hidden, DOUT, rngs=nnx.Rngs(1))]


def leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(pw.results(tree))]


def assert_identical(got, want):
    got, want = leaves(got), leaves(want)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def save_and_restore(tmp_path, state, target=None):
    """What a new process would read: ``state`` saved by Orbax and restored (with a target or without)."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    if target is None:
        return checkpointer.restore(tmp_path / "ckpt")
    return checkpointer.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, target))


def test_pipeline_restored_into_a_fresh_pipeline_trains_on_as_uninterrupted(tmp_path):
    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(2)]

    def make(hidden=HIDDEN):
        return pipeline.Pipeline(
            stages(hidden), slices, loss_fn=mse, optimizer=optax.adam(1e-2), num_microbatches=2
        )

    data = batches()
    run = make()
    losses = [float(run.train_step(x, y).result()) for x, y in data[:SAVED]]
    state = save_and_restore(tmp_path, run.state, target=run.state)  # before the next step
    losses += [float(run.train_step(x, y).result()) for x, y in data[SAVED:]]  # uninterrupted
    fresh = make()  # as a new process builds it: fresh parameters and Adam moments
    fresh.load_state(state)
    resumed = [float(fresh.train_step(x, y).result()) for x, y in data[SAVED:]]
    assert resumed == losses[SAVED:]
    assert_identical(fresh.params, run.params)
    assert_identical(fresh.opt_states, run.opt_states)

    # A pipeline built for inference serves the trained parameters, as plain jax.jit computes.
    serving = pipeline.Pipeline(stages(), slices, num_microbatches=2)
    serving.load_state(state)
    x = data[0][0]
    apply = pipeline.sequential(stages())[1]
    want = jax.jit(apply)(jax.device_get(tuple(state["params"])), x)
    np.testing.assert_allclose(
        np.asarray(serving.forward(x).result(timeout=60)), np.asarray(want), rtol=1e-5, atol=1e-6
    )

    # A checkpoint of another model is refused, naming the array that differs.
    other = {
        **state,
        "params": [{**state["params"][0], "kernel": np.zeros((DIN, 6), np.float32)}, state["params"][1]],
    }
    with pytest.raises(
        pw.errors.PlacementError,
        match=r"params/0/kernel is float32\[4, 6\], but this model's is float32\[4, 5\]",
    ):
        fresh.load_state(other)


def test_data_parallel_and_diloco_restored_go_on_from_their_step(tmp_path):
    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 1}, island=i) for i in range(2)]
    data = batches()

    def model():
        return pipeline.sequential(stages())

    # DataParallel, restored without a target (matched by names), under a new pw.elastic.Manager.
    def data_parallel():
        return pipeline.DataParallel(model(), slices, loss_fn=mse, optimizer=optax.adam(1e-2))

    run = data_parallel()
    for x, y in data[:SAVED]:
        run.train_step(x, y)
    state = save_and_restore(tmp_path / "dp", run.state)
    for x, y in data[SAVED:]:
        run.train_step(x, y)  # uninterrupted
    fresh = data_parallel()
    fresh.load_state(state)
    manager = pw.elastic.Manager(fresh)
    assert manager.step == SAVED
    for x, y in data[manager.step :]:
        manager.train_step(x, y)
    manager.wait(timeout=60)
    for replica in fresh.params_per_island:
        assert_identical(replica, run.params)
    assert_identical(fresh.state["opt_state"], run.state["opt_state"])

    # DiLoCo saved between syncs: every replica's own parameters and inner state, and the step
    # that decides which steps sync.
    def diloco():
        return pipeline.DiLoCo(model(), slices, loss_fn=mse, optimizer=optax.adam(1e-2), sync_every=3)

    run = diloco()
    for x, y in data[:SAVED]:
        run.train_step(x, y)
    state = save_and_restore(tmp_path / "diloco", run.state, target=run.state)
    for x, y in data[SAVED:]:
        run.train_step(x, y)
    fresh = diloco()
    fresh.load_state(state)
    for x, y in data[SAVED:]:
        fresh.train_step(x, y)
    assert_identical(fresh.state, run.state)
