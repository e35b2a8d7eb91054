"""pipeline.DiLoCo: islands that train alone and sync every k steps; and pw.elastic running steps again."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_apply, mlp_batches, mlp_params, mse

import pathways_jax as pw
from pathways_jax.pipeline import DataParallel, DiLoCo

pytestmark = pytest.mark.timeout(120)

K = 4
BATCH = 12


def _diloco_reference(xs, ys, sync_every, inner, outer, counts=None):
    """DiLoCo in plain jax.jit: replica i steps on shard i; every sync_every-th step, the global
    parameters take the outer step on the mean of (global - local), and every replica restarts there."""

    @jax.jit
    def local(p, o, x, y):
        loss, grads = jax.value_and_grad(lambda p: mse(mlp_apply(p, x), y))(p)
        updates, o = inner.update(grads, o, p)
        return loss, optax.apply_updates(p, updates), o

    @jax.jit
    def sync(start, outer_state, *locals_):
        total = jax.tree.map(jnp.subtract, start, locals_[0])
        for loc in locals_[1:]:
            total = jax.tree.map(jnp.add, total, jax.tree.map(jnp.subtract, start, loc))
        pseudo = jax.tree.map(lambda g: g / len(locals_), total)
        updates, outer_state = outer.update(pseudo, outer_state, start)
        return optax.apply_updates(start, updates), outer_state

    start = mlp_params()
    replicas = [(start, inner.init(start)) for _ in range(K)]
    outer_state = outer.init(start)
    losses = []
    for step, (x, y) in enumerate(zip(xs, ys, strict=True)):
        k = K if counts is None else counts[step]
        replicas = replicas[:k]
        results = [
            local(p, o, xi, yi)
            for (p, o), xi, yi in zip(replicas, np.split(x, k), np.split(y, k), strict=True)
        ]
        replicas = [(p, o) for _, p, o in results]
        if (step + 1) % sync_every == 0:
            start, outer_state = sync(start, outer_state, *(p for p, _ in replicas))
            replicas = [(start, o) for _, o in replicas]
        step_losses = [loss for loss, _, _ in results]
        losses.append(float(sum(step_losses[1:], step_losses[0]) / k))
    return [p for p, _ in replicas], losses


@pytest.fixture
def islands():
    pw.init(islands=K)
    yield [pw.devices(mesh={"data": 1}, island=i) for i in range(K)]
    pw.shutdown()


def _fetch(tree):
    return jax.tree.map(lambda f: np.asarray(f.result(timeout=60)), tree)


def test_diloco_matches_plain_jax_and_its_replicas_meet_at_every_sync(islands):
    inner, outer = optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True)
    model = DiLoCo((mlp_params(), mlp_apply), islands, loss_fn=mse, optimizer=inner, sync_every=3)
    xs, ys = mlp_batches(7, BATCH, seed=1)
    losses = [model.train_step(x, y) for x, y in zip(xs[:6], ys[:6], strict=True)]
    after_sync = [_fetch(p) for p in model.params_per_island]
    for other in after_sync[1:]:  # step 6 synced: every replica at the new global parameters
        jax.tree.map(np.testing.assert_array_equal, after_sync[0], other)
    losses.append(model.train_step(xs[6], ys[6]))
    apart = [_fetch(p) for p in model.params_per_island]
    assert not np.array_equal(apart[0]["w1"], apart[1]["w1"])  # a local step: each on its shard

    want_replicas, want_losses = _diloco_reference(xs, ys, 3, inner, outer)
    np.testing.assert_allclose([float(loss.result()) for loss in losses], want_losses, rtol=1e-5)
    for got, want in zip(apart, want_replicas, strict=True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_only_a_sync_step_moves_parameters_between_islands(islands):
    model = DiLoCo((mlp_params(), mlp_apply), islands, loss_fn=mse, optimizer=optax.sgd(0.1), sync_every=2)
    x, y = mlp_batches(1, BATCH, seed=1)
    shapes = {p.shape for p in jax.tree.leaves(mlp_params())}
    for sync in (False, True):
        graph = model.graph(x[0], y[0])
        moved = [t for t in graph.transfers if t.kind == "dcn"]
        params_moved = [t for t in moved if tuple(graph.values[t.value].aval.shape) in shapes]
        # Local: only the K - 1 shard losses reach the first island. Sync: every island's
        # parameters reach every other island as well.
        assert len(moved) - len(params_moved) == K - 1
        assert len(params_moved) == (K * (K - 1) * len(shapes) if sync else 0)
        model.train_step(x[0], y[0])


def test_diloco_syncing_every_step_with_plain_sgd_is_data_parallel(islands):
    xs, ys = mlp_batches(4, BATCH, seed=1)
    diloco = DiLoCo(
        (mlp_params(), mlp_apply),
        islands,
        loss_fn=mse,
        optimizer=optax.sgd(0.1),
        sync_every=1,
        outer_optimizer=optax.sgd(1.0),
    )
    dp = DataParallel((mlp_params(), mlp_apply), islands, loss_fn=mse, optimizer=optax.sgd(0.1))
    for x, y in zip(xs, ys, strict=True):
        a, b = diloco.train_step(x, y), dp.train_step(x, y)
        np.testing.assert_allclose(float(a.result()), float(b.result()), rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        _fetch(diloco.params),
        _fetch(dp.params),
    )


def test_diloco_refuses_bad_options(islands):
    for bad in (0, True, 1.5):
        with pytest.raises(pw.errors.ProgramTraceError, match="sync_every must be an int >= 1"):
            DiLoCo((mlp_params(), mlp_apply), islands, loss_fn=mse, optimizer=optax.sgd(0.1), sync_every=bad)
    with pytest.raises(pw.errors.ProgramTraceError, match="outer_optimizer"):
        DiLoCo(
            (mlp_params(), mlp_apply),
            islands,
            loss_fn=mse,
            optimizer=optax.sgd(0.1),
            sync_every=2,
            outer_optimizer="sgd",
        )


def test_the_manager_runs_a_lost_replicas_steps_again_on_the_survivors_diloco_syncs_in_step(islands):
    """The replay itself, in one process: island 3 is taken out by hand (as a lost host's island
    is) and the manager is told a step failed; the steps still open run again on the three
    survivors from the state kept, DiLoCo keeps its sync schedule, and the result equals plain
    JAX with 4 replicas, then 3."""
    inner, outer = optax.sgd(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True)
    model = DiLoCo((mlp_params(), mlp_apply), islands, loss_fn=mse, optimizer=inner, sync_every=2)
    manager = pw.elastic.Manager(model, minimum_islands=2, window=2)
    xs, ys = mlp_batches(8, BATCH, seed=1)
    losses = [manager.train_step(xs[s], ys[s]) for s in range(3)]
    manager.wait(timeout=60)
    losses += [manager.train_step(xs[s], ys[s]) for s in range(3, 5)]
    reopened = manager._pending[0]
    assert reopened.params is not None  # the oldest open step keeps its starting state
    pw.cluster().host_lost(3)  # the local backend keeps the values; the manager must not use them
    manager._recover(pw.errors.HostLostError("island 3 was lost (by the test)"))
    assert manager.islands == (0, 1, 2) and manager.events[0].step == reopened.index
    losses += [manager.train_step(xs[s], ys[s]) for s in range(5, 8)]
    manager.wait(timeout=60)
    counts = [4] * reopened.index + [3] * (8 - reopened.index)
    want_replicas, want_losses = _diloco_reference(xs, ys, 2, inner, outer, counts)
    np.testing.assert_allclose([float(loss) for loss in losses], want_losses, rtol=1e-5)
    got = [_fetch(p) for p in model.params_per_island]
    for a, b in zip(got, want_replicas, strict=True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), a, b)
    jax.tree.map(np.testing.assert_array_equal, got[0], got[1])  # step 8 synced
