"""pw.Future: passing values between programs, waiting, freeing, metadata."""

import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import pathways_jax as pw


def _delta(before: dict, after: dict) -> dict:
    return {name: after[name] - before[name] for name in before}


def _check(got, want):
    """Shape and dtype first, then values (STYLE §11)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def _gated(event: threading.Event, scale: float):
    """A function whose output waits for ``event`` inside a host callback."""

    def wait_then_scale(x):
        if not event.wait(30):
            raise TimeoutError("the test never set the event")
        return np.asarray(x) * scale

    def body(x):
        return jax.pure_callback(wait_then_scale, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    return body


# --- passing futures between programs -----------------------------------------------------


@pytest.mark.timeout(60)
def test_future_feeds_later_programs_without_recomputing():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4})

    @pw.jit(devices=a, out_specs=pw.P("x"))
    def produce(x):
        return jnp.sin(x) * 2

    @pw.jit(devices=a)
    def scale(y):
        return y * 3 + 1

    @pw.jit(devices=a)
    def combine(y, w):
        return y @ w

    @pw.program
    def second(y):
        return scale(y)

    @pw.program(fuse=False)
    def third(y, w):
        return combine(y, w), y.sum()

    x = jnp.arange(16.0)
    w = jnp.ones((16, 3)) * 0.5
    before = pw.counters()
    y = produce(x)
    assert isinstance(y, pw.Future)
    out2 = second(y)
    out3, total = third(y, w)
    assert all(isinstance(f, pw.Future) for f in (out2, out3, total))

    ref_y = jax.jit(lambda v: jnp.sin(v) * 2)(x)
    _check(out2.result(timeout=30), jax.jit(lambda v: v * 3 + 1)(ref_y))
    _check(out3.result(timeout=30), jax.jit(lambda v, m: v @ m)(ref_y, w))
    _check(total.result(timeout=30), jax.jit(jnp.sum)(ref_y))
    _check(y.result(timeout=30), ref_y)  # still readable after being passed twice

    delta = _delta(before, pw.counters())
    assert delta["runs"] == 3
    # `produce` runs once (1), second has one node (1), third a jit node and a glue node (2).
    assert delta["dispatches"] == 4, delta
    assert delta["transfers_ici"] == 0 and delta["transfers_dcn"] == 0, delta


@pytest.mark.timeout(60)
def test_cross_island_future_is_one_dcn_transfer_and_island_local_none():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)

    @pw.jit(devices=a, out_specs=pw.P("x"))
    def produce(x):
        return jnp.cos(x) + 1

    @pw.jit(devices=b)
    def on_b(y):
        return y * 2

    @pw.jit(devices=a)
    def on_a(y):
        return y - 1

    @pw.program
    def remote(y):
        return on_b(y)

    @pw.program
    def local(y):
        return on_a(y)

    x = jnp.arange(8.0)
    ref_y = jax.jit(lambda v: jnp.cos(v) + 1)(x)
    y = produce(x)
    y.block_until_ready()

    before = pw.counters()
    far = remote(y)
    _check(far.result(timeout=30), jax.jit(lambda v: v * 2)(ref_y))
    crossed = _delta(before, pw.counters())
    assert crossed["transfers_dcn"] == 1, crossed
    assert crossed["transfers_ici"] == 0, crossed
    assert far.sharding.device_set == set(b.devices)
    assert far.slice is b

    before = pw.counters()
    near = local(y)
    _check(near.result(timeout=30), jax.jit(lambda v: v - 1)(ref_y))
    stayed = _delta(before, pw.counters())
    assert stayed["transfers_dcn"] == 0, stayed
    assert stayed["transfers_ici"] == 0, stayed
    assert near.sharding.device_set == set(a.devices)


# --- waiting ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_result_timeout_expires_then_value_arrives():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4})
    release = threading.Event()
    gated = pw.jit(_gated(release, 3.0), devices=a)
    x = jnp.arange(4.0)
    try:
        fut = gated(x)
        start = time.monotonic()
        with pytest.raises(pw.errors.FutureTimeoutError, match=r"timeout=0\.2") as info:
            fut.result(timeout=0.2)
        waited = time.monotonic() - start
        assert isinstance(info.value, TimeoutError)
        assert 0.2 <= waited < 5, waited
        assert not fut.done()
        release.set()
        _check(fut.result(timeout=30), x * 3)
        assert fut.done()
    finally:
        release.set()


@pytest.mark.timeout(60)
def test_metadata_known_before_the_value():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4})
    release = threading.Event()
    hold = pw.jit(_gated(release, 2.0), devices=a)

    @pw.jit(devices=a, out_specs=pw.P("x"))
    def spread(y):
        return y + 1

    @pw.program
    def gated_step(x):
        return spread(hold(x))

    x = jnp.arange(8.0, dtype=jnp.float32)
    try:
        out = gated_step(x)
        assert not out.done()
        assert out.shape == (8,)
        assert out.dtype == np.float32
        assert isinstance(out.sharding, NamedSharding)
        assert out.sharding.spec == pw.P("x")
        assert out.sharding.device_set == set(a.devices)
        assert not out.done()  # all of the above came without waiting for the value
        release.set()
        assert out.block_until_ready() is out
        assert out.done()
        want = jax.jit(lambda v: v * 2 + 1)(x)
        got = np.asarray(out)
        assert isinstance(got, np.ndarray)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, np.asarray(want))
        np.testing.assert_allclose(np.asarray(out, dtype=np.float64), np.asarray(want, dtype=np.float64))
        assert np.asarray(out, dtype=np.float64).dtype == np.float64
        _check(out.result(), want)
    finally:
        release.set()


def test_asarray_and_block_until_ready():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    square = pw.jit(lambda v: v * v, devices=s)
    x = jnp.arange(6.0).reshape(3, 2)
    fut = square(x)
    assert fut.shape == (3, 2) and fut.dtype == np.float32
    assert fut.block_until_ready() is fut
    assert fut.done()
    got = np.asarray(fut)
    assert isinstance(got, np.ndarray) and got.shape == (3, 2) and got.dtype == np.float32
    np.testing.assert_allclose(got, np.asarray(jax.jit(lambda v: v * v)(x)))


# --- freeing ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_live_count_follows_futures():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4})
    store = pw.cluster().store

    @pw.jit(devices=a)
    def inc(v):
        return v + 1

    @pw.program
    def pair(v):
        return inc(v), inc(inc(v))

    gc.collect()
    baseline = store.live_count()
    singles = [inc(jnp.full((4,), float(i))) for i in range(30)]
    pairs = [pair(f) for f in singles[:10]]  # futures fed back in: 2 outputs each
    futures = singles + [f for p in pairs for f in p]
    del pairs
    assert len(futures) == 50
    assert store.live_count() == baseline + 50

    for i, fut in enumerate(singles):
        _check(fut.result(timeout=30), jnp.full((4,), float(i) + 1))
    for i in range(10):
        _check(futures[30 + 2 * i].result(timeout=30), jnp.full((4,), float(i) + 2))
        _check(futures[31 + 2 * i].result(timeout=30), jnp.full((4,), float(i) + 3))
    assert store.live_count() == baseline + 50

    del singles
    del futures[:25]
    gc.collect()
    assert store.live_count() == baseline + 25
    del futures, fut
    gc.collect()
    assert store.live_count() == baseline


@pytest.mark.timeout(60)
def test_deleted_future_still_feeds_the_queued_program():
    # One executable in flight per island: while the gated one runs, the controller waits,
    # so the programs submitted after it stay queued.
    pw.init(num_cpu_devices=8, islands=2, max_in_flight=1)
    a = pw.devices(mesh={"x": 4})
    store = pw.cluster().store
    release = threading.Event()
    hold = pw.jit(_gated(release, 2.0), devices=a)

    @pw.jit(devices=a)
    def inc(v):
        return v + 1

    @pw.program
    def consume(v):
        return inc(v) * 10

    x = jnp.arange(4.0)
    try:
        blocker = hold(x)
        baseline = store.live_count()
        fed = inc(x)  # queued behind the gated run
        out = consume(fed)  # queued, holding `fed`
        assert store.live_count() == baseline + 2
        del fed
        gc.collect()
        assert not out.done()
        assert store.live_count() == baseline + 2  # the queued run keeps `fed` alive
        release.set()
        _check(out.result(timeout=30), jax.jit(lambda v: (v + 2) * 10)(x))
        _check(blocker.result(timeout=30), x * 2)
        assert store.live_count() == baseline + 1  # `fed` went with its last user
        del out
        gc.collect()
        assert store.live_count() == baseline
    finally:
        release.set()
