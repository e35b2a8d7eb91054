"""pw.elastic: data-parallel training that goes on through a lost island, and takes it back."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import mlp_apply, mlp_batches, mlp_params, mse, wait_for

import pathways_jax as pw
from pathways_jax.pipeline import DataParallel

pytestmark = pytest.mark.timeout(240)

BATCH = 12  # splits evenly over 1, 2 and 3 replicas


def _reference(xs, ys, counts):
    """Plain jax.jit: step s averages the gradients of counts[s] equal shards, as DataParallel does."""
    tx = optax.adam(1e-2)

    @functools.partial(jax.jit, static_argnums=4)
    def step(p, o, x, y, k):
        results = [
            jax.value_and_grad(lambda p, xi=xi, yi=yi: mse(mlp_apply(p, xi), yi))(p)
            for xi, yi in zip(jnp.split(x, k), jnp.split(y, k), strict=True)
        ]
        total = results[0][1]
        for _, g in results[1:]:
            total = jax.tree.map(jnp.add, total, g)
        updates, o = tx.update(jax.tree.map(lambda g: g / k, total), o, p)
        losses = [loss for loss, _ in results]
        return optax.apply_updates(p, updates), o, sum(losses[1:], losses[0]) / k

    p = mlp_params()
    o = tx.init(p)
    losses = []
    for x, y, k in zip(xs, ys, counts, strict=True):
        p, o, loss = step(p, o, x, y, k)
        losses.append(float(loss))
    return p, losses


def _replica_params(dp):
    return [jax.tree.map(lambda f: np.asarray(f.result(timeout=60)), p) for p in dp.params_per_island]


def _counts(manager, steps, full):
    """How many replicas ran each step, from the manager's events."""
    counts = [full] * steps
    for event in manager.events:
        for s in range(event.step, steps):
            counts[s] = len(event.islands)
    return counts


def test_lost_islands_cost_no_step_and_their_replicas_rejoin_when_they_are_rebuilt(ray_cluster, monkeypatch):
    """Host 2 killed in the middle of a step: the step runs again on the two surviving replicas,
    with the same global batch. Then, with its replica not yet back, host 1 hung in the middle of
    the next one (found hung after ``PATHWAYS_JAX_HUNG_S``, 4 s here): training goes on, on one
    replica. No step is lost and every step's loss is readable; once the islands are rebuilt,
    replicas join them again at a step boundary from bit-identical copies; every loss equals
    plain JAX run with the same replica counts.

    Island 2's rebuild races step 3's run again (both take seconds), so the manager is told not
    to rejoin until steps 4-6 are taken: a replica back on island 2 before them would make the second
    loss leave two replicas, not one. On a loaded machine a rebuild's new hosts took longer to
    start than a try gave them (60 s) and the island never came back: see
    test_rebuild_round49.py."""
    monkeypatch.setenv("PATHWAYS_JAX_HUNG_S", "4")  # heartbeats come every second; 10 s by default
    cluster = pw.init(backend="ray", hosts=3, devices_per_host=1)
    slices = [pw.devices(mesh={"data": 1}, island=i) for i in range(3)]
    dp = DataParallel((mlp_params(), mlp_apply), slices, loss_fn=mse, optimizer=optax.adam(1e-2))
    manager = pw.elastic.Manager(dp, minimum_islands=1, window=2)
    steps = 12
    xs, ys = mlp_batches(steps, BATCH, seed=1)
    losses = [manager.train_step(xs[step], ys[step]) for step in range(3)]
    manager.wait(timeout=120)
    pw.faults.kill_host(2, at_run=1)
    losses.append(manager.train_step(xs[3], ys[3]))
    manager.wait(timeout=120)  # step 3 ran again on islands 0 and 1
    first = manager.events[0]
    assert (first.kind, first.step, first.islands) == ("lost", 3, (0, 1)), manager.events
    manager.rejoin = False  # island 2's replica stays out until the second loss (see above)
    pw.faults.hang_host(1, at_run=1)
    losses += [manager.train_step(xs[step], ys[step]) for step in range(4, 7)]
    manager.wait(timeout=120)
    manager.rejoin = True
    second = manager.events[1]
    assert (second.kind, second.islands) == ("lost", (0,)) and 4 <= second.step <= 6, manager.events

    assert wait_for(lambda: not cluster.resources.lost, 120), "the islands were not rebuilt"
    losses += [manager.train_step(xs[step], ys[step]) for step in range(7, steps)]
    manager.wait(timeout=120)
    assert manager.islands == (0, 1, 2) and manager.step == steps, manager.events
    rejoins = manager.events[2:]
    assert rejoins and all(e.kind == "rejoined" and 6 < e.step < steps for e in rejoins), manager.events
    assert [loss.step for loss in losses] == list(range(steps))
    replicas = _replica_params(dp)
    for other in replicas[1:]:
        jax.tree.map(np.testing.assert_array_equal, replicas[0], other)
    counts = _counts(manager, steps, 3)
    assert counts[:4] == [3, 3, 3, 2] and min(counts) == 1 and counts[-1] == 3, counts
    want_params, want_losses = _reference(xs, ys, counts)
    np.testing.assert_allclose([float(loss) for loss in losses], want_losses, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), replicas[0], want_params
    )


@pytest.fixture
def two_islands():
    pw.init(islands=2)
    yield
    pw.shutdown()


def _dropout_apply(p, x, *, rngs=None):
    """The tiny MLP behind an inverted dropout of its input, drawing from rngs["dropout"]."""
    keep = jax.random.bernoulli(rngs["dropout"], 0.5, x.shape)
    return mlp_apply(p, jnp.where(keep, 2 * x, 0.0))


def _dp(islands=(0, 1), apply=mlp_apply):
    slices = [pw.devices(mesh={"data": 1}, island=i) for i in islands]
    return DataParallel((mlp_params(), apply), slices, loss_fn=mse, optimizer=optax.adam(1e-2))


def test_without_a_loss_the_manager_trains_as_its_model_does_bit_for_bit(two_islands):
    xs, ys = mlp_batches(6, BATCH, seed=0)
    plain, managed = _dp(), _dp()
    manager = pw.elastic.Manager(managed, window=2)
    want = [plain.train_step(x, y) for x, y in zip(xs, ys, strict=True)]
    got = []
    for x, y in zip(xs, ys, strict=True):
        got.append(manager.train_step(x, y))
        # What it keeps to run steps again: at most 2 window's worth of steps, and 2 states.
        assert len(manager._pending) <= 4
        assert sum(step.params is not None for step in manager._pending) <= 2
    assert [float(g) for g in got] == [float(w.result()) for w in want]
    assert got[2].step == 2 and manager.step == 6 and manager.events == []
    assert np.asarray(got[-1]).shape == () and got[-1].done()
    jax.tree.map(np.testing.assert_array_equal, _replica_params(managed)[1], _replica_params(plain)[1])
    _, ref_losses = _reference(xs, ys, [2] * 6)
    np.testing.assert_allclose([float(g) for g in got], ref_losses, rtol=1e-5)


def test_the_manager_refuses_what_it_cannot_keep_going_with(two_islands):
    dp = _dp()
    with pytest.raises(pw.errors.PlacementError, match=r"drives a pathways_jax\.pipeline\.DataParallel"):
        pw.elastic.Manager(object())
    for bad in (0, 3, True, 1.0):
        with pytest.raises(pw.errors.PlacementError, match="minimum_islands must be an int from 1 to"):
            pw.elastic.Manager(dp, minimum_islands=bad)
    with pytest.raises(pw.errors.PlacementError, match="window must be an int >= 1"):
        pw.elastic.Manager(dp, window=0)
    with pytest.raises(pw.errors.PlacementError, match=r"replicas are on islands \[0, 0\]"):
        pw.elastic.Manager(_dp((0, 0)))
    manager = pw.elastic.Manager(dp)
    x, y = np.ones((4, 8), np.float32), np.ones((4, 2), np.float32)
    with pytest.raises(pw.errors.PlacementError, match=r"over every replica count .*\[1, 2\].*multiple of 2"):
        manager.train_step(x[:3], y[:3])
    assert manager.step == 0  # nothing was taken
    float(manager.train_step(x, y))
    with pytest.raises(ValueError, match="max_retries or retry_policy, not both"):
        manager.elastic_retry(max_retries=1, retry_policy=lambda attempt, error: True)
    with pytest.raises(ValueError, match="max_retries must be an int >= 1"):
        manager.elastic_retry(max_retries=0)


def test_a_batch_whose_shard_on_fewer_islands_cannot_split_over_the_data_axis_is_refused_at_once():
    """3 replicas with data axes of 2: 6 examples split as 3 x 2, but a loss leaves 2 replicas of 3
    examples, which 2 devices cannot split: refused at the first step, not when a loss replays it."""
    pw.init(num_cpu_devices=8, islands=4)
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(3)]
    dp = DataParallel((mlp_params(), mlp_apply), slices, loss_fn=mse, optimizer=optax.adam(1e-2))
    manager = pw.elastic.Manager(dp, minimum_islands=2)
    x, y = np.ones((6, 8), np.float32), np.ones((6, 2), np.float32)
    with pytest.raises(
        pw.errors.PlacementError,
        match=r"\[2, 3\]\), and each shard over its slice's data axis 'data' \(2 devices\).*multiple of 12",
    ):
        manager.train_step(x, y)
    assert manager.step == 0  # nothing was taken


def test_elastic_retry_runs_the_function_again_from_the_managers_step(two_islands):
    """Shaped as pathwaysutils' elastic_retry: a HostLostError the manager could not absorb runs
    the function again (the callback first), from the step the manager has reached; other
    errors, and failures past max_retries, reach the caller."""
    manager = pw.elastic.Manager(_dp())
    xs, ys = mlp_batches(6, BATCH, seed=0)
    calls, callbacks = [], []

    @manager.elastic_retry(max_retries=2, on_elastic_event_callback=lambda: callbacks.append(manager.step))
    def train(total):
        calls.append(manager.step)
        for step in range(manager.step, total):
            manager.train_step(xs[step], ys[step])
            if step == 2 and len(calls) == 1:
                raise pw.errors.HostLostError("island 1 was lost (raised by the test)")
        return manager.step

    assert train(6) == 6
    assert calls == [0, 3] and callbacks == [3]

    @manager.elastic_retry(max_retries=1)
    def always_lost():
        raise pw.errors.HostLostError("lost again")

    with pytest.raises(pw.errors.HostLostError, match="lost again"):
        always_lost()

    @manager.elastic_retry()
    def broken():
        raise ValueError("not a lost host")

    with pytest.raises(ValueError, match="not a lost host"):
        broken()


def test_below_minimum_islands_training_waits_with_the_survivors_state_and_goes_on_when_islands_return(
    two_islands,
):
    """One of two replicas lost with minimum_islands=2 (island 1 taken out by hand, as a lost
    host's island is, and the manager told a step failed): train_step refuses with a named
    error and takes no step; elastic_retry waits for the island, a replica rejoins it from the
    survivor's kept state, the open steps run again on both, and the whole run equals the same
    model trained without the loss, bit for bit. The model draws dropout masks from an nnx.Rngs
    passed to every step: a step run again reuses the keys its call drew (not the stream's next)."""
    import threading

    xs, ys = mlp_batches(8, BATCH)
    plain, rngs = _dp(apply=_dropout_apply), nnx.Rngs(dropout=0)
    want = [float(plain.train_step(x, y, rngs=rngs).result()) for x, y in zip(xs, ys, strict=True)]
    manager, rngs = (
        pw.elastic.Manager(_dp(apply=_dropout_apply), minimum_islands=2, window=2),
        nnx.Rngs(dropout=0),
    )
    losses = [manager.train_step(xs[s], ys[s], rngs=rngs) for s in range(3)]
    manager.wait(timeout=60)
    losses += [manager.train_step(xs[s], ys[s], rngs=rngs) for s in range(3, 5)]
    cluster = pw.cluster()
    cluster.host_lost(1)  # the local backend keeps the values; the manager must not use them
    assert pw.stats()["islands"][1]["lost"] and pw.stats()["islands"][0]["lost"] is None
    with pytest.raises(pw.errors.HostLostError, match="fewer than minimum_islands=2"):
        manager._recover(pw.errors.HostLostError("island 1 was lost (by the test)"))
    with pytest.raises(pw.errors.HostLostError, match=r"1 replicas are left \(islands \[0\]\)"):
        manager.train_step(xs[5], ys[5], rngs=rngs)  # refused: draws nothing
    assert manager.step == 5
    with pytest.raises(pw.errors.HostLostError, match="fewer than minimum_islands"):
        manager.wait(timeout=60)

    attempts = []

    @manager.elastic_retry(timeout=60, on_elastic_event_callback=lambda: attempts.append(manager.step))
    def train(total):
        for step in range(manager.step, total):
            losses.append(manager.train_step(xs[step], ys[step], rngs=rngs))
        return manager.step

    threading.Timer(0.3, cluster.island_restored, (1,)).start()
    assert train(8) == 8
    assert pw.stats()["islands"][1]["lost"] is None
    assert attempts == [5]
    assert [e.kind for e in manager.events] == ["lost", "rejoined"] and manager.islands == (0, 1)
    assert [float(loss) for loss in losses] == want
    jax.tree.map(np.testing.assert_array_equal, _replica_params(manager.model)[1], _replica_params(plain)[0])
