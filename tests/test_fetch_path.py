"""A fetch's path, controller -> host -> controller: its wire form, its order on the host, its failure."""

import os
import signal
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import wait_for

import pathways_jax as pw
from pathways_jax._src.backends import channel_link
from pathways_jax._src.backends.ray_host import KeyData, MessageFailed
from pathways_jax._src.runtime.object_store import Ready
from pathways_jax._src.wire.messages import Codec

pytestmark = pytest.mark.timeout(180)

STEPS = 1500  # a run of a second or more (256 x 256 matrices)


def _crossed(value):
    """A host's answer ``value`` as the controller reads it, once through the wire's codec."""
    header, buffers = Codec().encode(channel_link.answer_message(7, value))
    return channel_link.answer_value(
        Codec().decode(memoryview(header), [memoryview(bytes(b)) for b in buffers])
    )


@pytest.mark.parametrize(
    "value",
    [
        np.arange(64, dtype=np.float32),
        np.array(2.5, dtype=np.float32),  # no dimension
        np.zeros((2, 0, 3), dtype=np.uint64),  # nothing in it
        np.array([[True, False, True]]),
        np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        np.arange(12.0).reshape(3, 4)[:, 1],  # not contiguous
        np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        np.arange(4, dtype=">i4"),  # not this machine's byte order: pickled
        np.arange(8, dtype=ml_dtypes.bfloat16),  # not numpy's own dtype: pickled
        np.array(["a", "bc"]),
    ],
    ids=lambda v: f"{v.dtype}{list(v.shape)}",
)
def test_a_fetched_array_crosses_whole_and_writable(value):
    got = _crossed(value)
    assert type(got) is np.ndarray
    assert got.dtype == value.dtype and got.shape == value.shape
    np.testing.assert_array_equal(got, value)
    assert got.flags.writeable  # the controller's own memory, not the frame's (read-only)


def test_the_other_answers_of_a_fetch_still_cross_pickled():
    keys = KeyData(np.arange(4, dtype=np.uint32).reshape(2, 2), "threefry2x32")
    got = _crossed(keys)
    assert isinstance(got, KeyData) and got.impl == "threefry2x32"
    np.testing.assert_array_equal(got.data, keys.data)
    error = _crossed(MessageFailed("host 0: KeyError: 5", "trace"))
    assert (
        isinstance(error, MessageFailed) and error.message == "host 0: KeyError: 5" and error.trace == "trace"
    )


def _slow(v, m, steps=STEPS):
    return jax.lax.fori_loop(0, steps, lambda i, u: jnp.tanh(u @ m) + 0.5, v)


def _handle(future):
    """The future's value on its host (the backend's handle), once the controller dispatched it."""
    assert wait_for(lambda: isinstance(future._entry.state, Ready), timeout=60)
    return future._entry.array


def _fetch(handle):
    return handle.backend.fetch(handle.hosts, handle.key, handle.generation)


@pytest.fixture
def one_host(ray_cluster):
    cluster = pw.init(backend="ray", hosts=1, replace_lost_hosts=False)
    s = pw.devices(mesh={"x": 1})
    m = jax.random.normal(jax.random.key(0), (256, 256)) / 16
    slow = pw.jit(lambda v: _slow(v, m), devices=s)
    x = jnp.ones((256, 256))
    slow(x).block_until_ready()  # compiled and registered
    return cluster, s, slow, x, m


def test_a_fetch_sent_behind_the_run_making_its_value_waits_for_that_run(one_host):
    # The host answers a fetch of a computed value at once, from the channel's thread; a value
    # that is not made yet, or not computed yet, waits for its run in the host's order.
    _cluster, _s, slow, x, m = one_host
    out = _handle(slow(x))
    assert not out.dones[0].done(), "the run was over before the fetch was sent: the test shows nothing"
    got = _fetch(out)
    # One channel, one order: the run's completion was answered before the fetch was.
    assert out.dones[0].done(), "the fetch was answered before the run that makes its value"
    np.testing.assert_allclose(got, jax.jit(lambda v: _slow(v, m))(x), rtol=1e-4)
    chained = _handle(slow(slow(x)))  # made from a value still being computed: two runs ahead
    got = _fetch(chained)
    assert chained.dones[0].done(), "the fetch was answered before the run that makes its value"
    np.testing.assert_allclose(got, jax.jit(lambda v: _slow(_slow(v, m), m))(x), rtol=1e-4)


def test_a_fetch_of_a_computed_value_is_not_held_behind_one_still_being_computed(one_host):
    # The first fetch, of a value the host holds but has not computed, waits for its run off the
    # channel's thread; the second, of a computed value, is answered while that run goes on.
    cluster, s, slow, x, m = one_host
    small = pw.jit(lambda v: v * 2, devices=s)(jnp.arange(64.0))
    small.block_until_ready()  # computed; not brought to the controller
    ready = _handle(small)
    busy = _handle(slow(x))
    backend = cluster.backend
    with backend.dispatcher.lock:  # a message answered once the host's executor is past the run
        past = backend.route.message(0, "free", ([],))
    past.result(timeout=60)  # so the run's value is on the host, not computed yet
    assert not busy.dones[0].done(), "the run was over before the fetches were sent: the test shows nothing"
    link = backend.link
    sent = link.stats()["messages"]
    waiting: list = []
    first = threading.Thread(target=lambda: waiting.append(_fetch(busy)))
    first.start()
    assert wait_for(lambda: link.stats()["messages"] > sent, timeout=10)  # the first fetch went
    np.testing.assert_array_equal(_fetch(ready), np.arange(64.0, dtype=np.float32) * 2)
    assert not busy.dones[0].done(), "a fetch of a computed value waited for a run it does not read"
    first.join(timeout=60)
    np.testing.assert_allclose(waiting[0], jax.jit(lambda v: _slow(v, m))(x), rtol=1e-4)


def test_values_of_other_dtypes_and_typed_keys_come_back_from_the_host(one_host):
    _cluster, s, _slow_fn, _x, _m = one_host
    halves = pw.jit(lambda: jnp.arange(64, dtype=jnp.bfloat16) / 4, devices=s)()
    keys = pw.jit(lambda: jax.random.split(jax.random.key(3), 16), devices=s)()
    got = _fetch(_handle(halves))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.arange(64, dtype=np.float32) / 4)
    got_keys = _fetch(_handle(keys))
    want_keys = jax.random.split(jax.random.key(3), 16)
    np.testing.assert_array_equal(jax.random.key_data(got_keys), jax.random.key_data(want_keys))


def test_a_host_lost_while_a_fetch_waits_fails_it_with_host_lost(one_host):
    cluster, s, _slow_fn, x, m = one_host
    out = _handle(pw.jit(lambda v: _slow(v, m, 20 * STEPS), devices=s)(x))  # the fetch waits behind it
    killer = threading.Timer(0.5, os.kill, (cluster.backend.info[0]["pid"], signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(pw.errors.HostLostError, match="host 0"):
            _fetch(out)
    finally:
        killer.join()
