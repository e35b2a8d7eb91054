"""The transfer servers as a Ray host starts them (``ray_host.transfer_options``), in one process.

Each host sends values to the others through ``jax.experimental.transfer``
with the options chosen for its platform. These tests pin what the hosts rely
on, with two servers on this process's CPU devices: a value is received
whole and exact whatever its dtype, a pull may come before its post, a value
freed after its post is still sent, and an error posted in a value's place
(or a value computed from one) reaches the puller as an error, never as
data. No Ray: the same calls the hosts make.
"""

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import transfer

from pathways_jax._src.backends import ray_host

TIMEOUT_S = 60  # a pull that never completes fails the test instead of hanging CI


def test_cpu_hosts_send_from_the_value_s_own_buffer_and_accelerators_keep_the_staged_copy():
    assert ray_host.transfer_options("cpu") == {"use_raw_buffers": True}
    assert ray_host.transfer_options("gpu") == {"use_raw_buffers": False}


class _Hosts(NamedTuple):
    """Two hosts' servers, each connected to the other, and their devices."""

    source: Any
    dest: Any
    from_source: Any  # the destination's connection to the source's server
    from_dest: Any  # the source's connection to the destination's server
    source_device: Any
    dest_device: Any


@pytest.fixture(scope="module")
def hosts():
    source_device, dest_device = jax.devices()[:2]
    options = ray_host.transfer_options(source_device.platform)
    source, dest = (
        transfer.start_transfer_server(source_device.client, "127.0.0.1:0", ["127.0.0.1:0"], **options)
        for _ in range(2)
    )
    return _Hosts(
        source,
        dest,
        dest.connect(source.address()),
        source.connect(dest.address()),
        source_device,
        dest_device,
    )


def _spec(shape, dtype, device):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def _read(array):
    """The pulled array's data (raising its error), waiting at most TIMEOUT_S for it."""
    deadline = time.monotonic() + TIMEOUT_S
    while not array.is_ready():
        assert time.monotonic() < deadline, "the pull did not complete"
        time.sleep(0.001)
    return np.asarray(array)


@pytest.mark.parametrize(
    ("uuid", "value"),
    [
        (10, np.arange(12, dtype=np.float32).reshape(3, 4)),
        (11, np.ones(5, jnp.bfloat16)),
        (12, np.array([True, False, True])),
        (13, np.arange(-3, 4, dtype=np.int8)),
        (14, np.float32(2.5)),
        (15, np.arange(3, dtype=np.complex64) * (1 + 2j)),
    ],
    ids=["float32", "bfloat16", "bool", "int8", "scalar", "complex64"],
)
def test_a_value_arrives_whole_and_exact(hosts, uuid, value):
    posted = jax.device_put(value, hosts.source_device)
    hosts.source.await_pull(uuid, [posted])
    (got,) = hosts.from_source.pull(uuid, [_spec(posted.shape, posted.dtype, hosts.dest_device)])
    assert (got.shape, got.dtype, got.devices()) == (posted.shape, posted.dtype, {hosts.dest_device})
    np.testing.assert_array_equal(_read(got), np.asarray(value))


def test_a_value_still_computing_or_freed_after_its_post_is_sent_whole(hosts):
    base = jax.device_put(np.arange(1 << 20, dtype=np.float32), hosts.source_device)
    expected = np.sin(np.arange(1 << 20, dtype=np.float32)) * 2
    computing = jax.jit(lambda v: jnp.sin(v) * 2)(base)  # posted before it is ready
    hosts.source.await_pull(1, [computing])
    del computing  # the server keeps what it was given
    others = [jax.device_put(np.full(1 << 20, 7.0, np.float32), hosts.source_device) for _ in range(4)]
    (got,) = hosts.from_source.pull(1, [_spec((1 << 20,), np.float32, hosts.dest_device)])
    np.testing.assert_allclose(_read(got), expected, rtol=1e-6)
    assert [float(o[-1]) for o in others] == [7.0] * 4


def test_a_pull_may_come_before_its_post(hosts):
    (got,) = hosts.from_source.pull(2, [_spec((2, 3), np.int32, hosts.dest_device)])
    time.sleep(0.05)
    hosts.source.await_pull(
        2, [jax.device_put(np.arange(6, dtype=np.int32).reshape(2, 3), hosts.source_device)]
    )
    np.testing.assert_array_equal(_read(got), np.arange(6).reshape(2, 3))


def test_an_error_posted_in_a_value_s_place_or_computed_from_one_reaches_the_puller_as_an_error(hosts):
    # A host whose run failed posts errors in its values' place (RayHost._abandon).
    hosts.source.await_pull(
        3, [transfer.make_error_array(_spec((3,), np.float32, hosts.source_device), "run failed")]
    )
    (got,) = hosts.from_source.pull(3, [_spec((3,), np.float32, hosts.dest_device)])
    with pytest.raises(jax.errors.JaxRuntimeError, match="run failed"):
        _read(got)
    # A value the source computes from a pull that then fails (its peer was lost): the error goes on.
    (incoming,) = hosts.from_dest.pull(4, [_spec((3,), np.float32, hosts.source_device)])
    hosts.source.await_pull(5, [jax.jit(lambda v: v * 2)(incoming)])
    (got,) = hosts.from_source.pull(5, [_spec((3,), np.float32, hosts.dest_device)])
    hosts.dest.await_pull(
        4, [transfer.make_error_array(_spec((3,), np.float32, hosts.dest_device), "peer lost")]
    )
    with pytest.raises(jax.errors.JaxRuntimeError, match="peer lost"):
        _read(got)
