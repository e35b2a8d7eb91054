"""Clients: ownership, close(), failure isolation and accounting."""

import concurrent.futures
import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw


def _explode(x):
    raise ValueError("boom in a node")


@pytest.mark.timeout(120)
def test_a_failing_node_fails_its_run_only_and_frees_what_it_owned():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4}, island=0)
    bad = pw.jit(lambda x: jax.pure_callback(_explode, jax.ShapeDtypeStruct(x.shape, x.dtype), x), devices=a)
    good = pw.jit(lambda x: x * 2 + x.sum(), devices=a)
    x = jnp.arange(4.0)
    good(x).result(timeout=30)
    gc.collect()
    baseline = pw.cluster().store.live_count()
    results, errors = [], []

    def other_client():
        try:
            with pw.client("good"):
                outs = [good(x) for _ in range(50)]
                results.extend(np.asarray(o.result(timeout=60)) for o in outs)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=other_client)
    thread.start()
    with pw.client("bad") as bad_client:
        failed = bad(x)
        with pytest.raises(pw.errors.ProgramFailedError, match="failed while executing") as info:
            failed.result(timeout=60)
    assert "boom in a node" in repr(info.value.__cause__) or "boom in a node" in str(info.value)
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    want = np.asarray(jax.jit(lambda v: v * 2 + v.sum())(x))
    assert len(results) == 50 and all(np.allclose(r, want) for r in results)
    del failed
    gc.collect()
    assert pw.cluster().store.live_count() == baseline
    stats = pw.stats()["clients"]
    assert stats["bad"]["failures"] == 1 and stats["good"]["failures"] == 0
    assert stats["good"]["programs"] == 50 and stats["good"]["device_time_s"] > 0
    bad_client.close()
    a.release()


@pytest.mark.timeout(60)
def test_close_cancels_queued_runs_and_frees_values():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 1}, island=0)
    double = pw.jit(lambda v: v * 2, devices=s)
    gc.collect()
    baseline = pw.cluster().store.live_count()
    c = pw.client("temp")
    with c:
        outs = [double(jnp.ones(3)) for _ in range(20)]
    assert pw.cluster().store.live_count() == baseline + 20
    c.close()
    assert pw.cluster().store.live_count() == baseline
    for out in outs:
        with pytest.raises(pw.errors.PathwaysError):
            out.result(timeout=10)  # raises, never hangs
    with pytest.raises(pw.errors.ClusterError, match="closed"), c:
        pass
    # Closed while entered (by another thread, say): a call inside it is refused for the close,
    # even one given a value the close freed; another client given that value hears why it went.
    inside = pw.client("closed-inside")
    with inside:
        done = double(jnp.ones(3))
        np.testing.assert_array_equal(np.asarray(done.result(timeout=30)), np.full(3, 2.0, np.float32))
        inside.close()
        for arg in (done, jnp.ones(3)):
            with pytest.raises(pw.errors.ClusterError, match="closed; programs cannot be submitted"):
                double(arg)
    with pytest.raises(pw.errors.PathwaysError, match="when its client 'closed-inside' was closed"):
        double(done)
    s.release()


@pytest.mark.timeout(60)
def test_a_threads_default_client_is_retired_when_the_thread_ends_and_its_futures_stay_valid():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 1}, island=0)
    double = pw.jit(lambda v: v * 2, devices=s)
    gc.collect()
    baseline = pw.cluster().store.live_count()
    kept = []
    thread = threading.Thread(target=lambda: kept.append(double(jnp.ones(3))), name="worker-7")
    thread.start()
    thread.join(30)
    del thread
    gc.collect()
    # The thread handed its future on: the value is still there, as a jax.jit result would be.
    np.testing.assert_array_equal(kept[0].result(timeout=10), jax.jit(lambda v: v * 2)(jnp.ones(3)))
    clients = _settled_clients(lambda c: "worker-7" not in c)
    assert "worker-7" not in clients  # its usage went to the row of closed clients
    assert clients["(closed clients)"]["programs"] == 1
    kept.clear()  # and once its futures are gone, nothing of it is left
    gc.collect()
    pw.cluster().store.collect()
    assert pw.cluster().store.live_count() == baseline
    s.release()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheduler", ["fifo", "fair", "priority"])
def test_runs_a_worker_thread_queued_before_it_ended_still_run(scheduler):
    # A pool thread submits a chain of steps and ends while they are queued; the
    # caller reads the last one. Under every policy the chain completes, exactly.
    pw.init(num_cpu_devices=8, scheduler=scheduler)
    s = pw.devices(mesh={"x": 2})
    step = pw.program(lambda w: jnp.tanh(w @ w) + 1.0, devices=s)
    reference = jax.jit(lambda w: jnp.tanh(w @ w) + 1.0)
    w0 = jnp.ones((384, 384)) / 384

    def chain(w):
        for _ in range(60):
            w = step(w)
        return w

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        outs = [pool.submit(chain, w0 * (i + 1)).result(timeout=60) for i in range(3)]
    expected = []
    for i in range(3):
        w = w0 * (i + 1)
        for _ in range(60):
            w = reference(w)
        expected.append(w)
    for out, want in zip(outs, expected, strict=True):
        np.testing.assert_allclose(np.asarray(out.result(timeout=60)), np.asarray(want), rtol=1e-5, atol=1e-6)
    # The controller keeps serving, and forgot the pool's clients once their runs were gone.
    np.testing.assert_allclose(np.asarray(step(w0).result(timeout=30)), np.asarray(reference(w0)), rtol=1e-6)
    assert pw.cluster().controller._admission.retiring == set()
    s.release()


def _settled_clients(done, timeout: float = 10.0) -> dict:
    """pw.stats()'s clients once ``done(clients)`` (the accounting thread folds rows in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        clients = pw.stats()["clients"]
        if done(clients) or time.monotonic() > deadline:
            return clients
        time.sleep(0.05)


def test_client_arguments_are_checked():
    with pytest.raises(pw.errors.ResourceError, match="weight"):
        pw.client("x", weight=0)
    with pytest.raises(pw.errors.ResourceError, match="name"):
        pw.client("")
    c = pw.client("named", priority=3, weight=2)
    assert (c.name, c.priority, c.weight) == ("named", 3, 2.0)
    assert isinstance(c, pw.Client)


@pytest.mark.timeout(60)
def test_stats_report_busy_time_queues_and_clients():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 4}, island=1)
    f = pw.jit(lambda v: jnp.tanh(v @ v.T).sum() + v, devices=s)
    x = jnp.ones((64, 64))
    pw.stats(reset=True)
    with pw.client("acct"):
        outs = [f(x) for _ in range(10)]
    for o in outs:
        o.result(timeout=30)
    st = pw.stats()
    busy = [st["devices"][d.id]["busy_s"] for d in s.devices]
    assert all(b > 0 for b in busy)
    assert all(0 < st["devices"][d.id]["utilisation"] <= 1 for d in s.devices)
    assert st["clients"]["acct"]["programs"] == 10
    assert st["clients"]["acct"]["device_time_s"] == pytest.approx(sum(busy), rel=0.05)
    assert set(st["islands"]) == {0, 1} and st["islands"][1]["queued"] == 0
    s.release()
