"""The controller service as client processes written from the README meet it: a service whose
process stops (SIGSTOP, a debugger, a wedged machine) while a client waits on it.

This process starts the module's service on the shared local Ray cluster and joins it as a
client; results are compared with plain ``jax.jit`` on the same inputs.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def service(ray_cluster):
    """One service of one host (one device), FIFO."""
    svc = pw.serve("test-round44", hosts=1)
    try:
        yield svc
    finally:
        svc.stop()


def _slow(v):
    return jax.lax.fori_loop(0, 30000, lambda i, u: jnp.sin(u) + 1.0, v)


def _service_pid(ray, svc: pw.Service) -> int:
    return ray.get(svc.actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)


def test_a_reader_of_a_stopped_service_gets_a_cluster_error_within_seconds(ray_cluster, service, monkeypatch):
    # A client reading a future while the service's process was stopped waited for ever: its
    # health checks went unanswered (logged every 10 s) and nothing failed what the service owed.
    # The service's channel heartbeats once a second of quiet, so its silence is seen as a hung
    # host's is (PATHWAYS_JAX_HUNG_S of the client's process), and the README's ClusterError comes.
    monkeypatch.setenv("PATHWAYS_JAX_HUNG_S", "2")
    pw.init(backend="ray", address=service.address, service=service.name, client_name="reader")
    try:
        s = pw.devices(mesh={"x": 1})
        step = pw.jit(lambda v: jnp.cos(v) * 3 + 1, devices=s)
        x = jnp.arange(8.0)
        want = np.asarray(jax.jit(lambda v: jnp.cos(v) * 3 + 1)(x))
        np.testing.assert_array_equal(np.asarray(step(x).result(timeout=60)), want)
        slow = pw.jit(_slow, devices=s)
        queued = [slow(jnp.ones(256)) for _ in range(12)]  # seconds of work: the last is owed
        pid = _service_pid(ray_cluster, service)
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(pw.errors.ClusterError, match=r"service 'test-round44'.*stopped or hung"):
                queued[-1].result(timeout=60)
            assert time.monotonic() - started < 30
            with pytest.raises(pw.errors.ClusterError, match="stopped or hung"):
                step(x).result(timeout=10)  # a later call says so at once, not a wait
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        pw.shutdown()
    # Resumed, the service serves again: joined anew, a client runs exactly.
    pw.init(backend="ray", address=service.address, service=service.name, client_name="reader")
    try:
        step = pw.jit(lambda v: jnp.cos(v) * 3 + 1, devices=pw.devices(mesh={"x": 1}))
        np.testing.assert_array_equal(np.asarray(step(x).result(timeout=60)), want)
    finally:
        pw.shutdown()


def test_a_batch_naming_a_host_the_service_lacks_is_refused_and_counted(service):
    # A signed batch whose messages name host 99 or -1 (a client of another version, a bug): the
    # service dropped it without an answer, so its sender waited for ever, and counted nothing.
    from pathways_jax._src import wire

    cluster = pw.init(backend="ray", address=service.address, service=service.name, client_name="odd")
    try:
        step = pw.jit(lambda v: v * 2 + 1, devices=pw.devices(mesh={"x": 1}))
        x = jnp.arange(6.0)
        want = np.asarray(jax.jit(lambda v: v * 2 + 1)(x))
        np.testing.assert_array_equal(np.asarray(step(x).result(timeout=60)), want)
        route = cluster.backend.route

        def refused() -> int:
            rows = service.stats()["clients"].values()
            return sum(row["refused"] for row in rows if row["name"] == "odd" and row["alive"])

        meta = wire.RunMeta([0], 0, {}, "odd", "", 1.0, 0, -1)
        for host, kind, args, run in (
            (99, "free", ([],), None),
            (-1, "fetch", (1,), None),
            (99, "run", (1, 0, 0, [], [], []), meta),
        ):
            before = refused()
            (answer,) = route.submit([(host, kind, args)], run)
            got = answer.result(timeout=20)  # before: no answer ever came
            assert "host" in got.message and "hosts 0 to 0" in got.message, got
            assert refused() == before + 1
        # The service and this client go on as if nothing happened.
        np.testing.assert_array_equal(np.asarray(step(x + 1).result(timeout=60)), want + 2)
    finally:
        pw.shutdown()


def test_a_connection_claiming_a_joined_client_s_name_does_not_take_its_channel(service):
    # Anyone who can reach the service's channel could connect under a joined client's name (it is
    # no secret: the topic of every answer sent to it) without the key: the channel handed that
    # name's route to the newcomer, so the real client's frames went nowhere and its runs waited
    # for ever, the newcomer's frames all refused. The first connection under a name keeps it.
    import zmq

    cluster = pw.init(backend="ray", address=service.address, service=service.name, client_name="victim")
    context = zmq.Context()
    try:
        step = pw.jit(lambda v: jnp.sin(v) * 2, devices=pw.devices(mesh={"x": 1}))
        x = jnp.arange(5.0)
        want = np.asarray(jax.jit(lambda v: jnp.sin(v) * 2)(x))
        np.testing.assert_array_equal(np.asarray(step(x).result(timeout=60)), want)
        endpoint = cluster.backend.channel
        squatter = context.socket(zmq.DEALER)
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.setsockopt(zmq.ROUTING_ID, endpoint.identity)
        squatter.connect(endpoint.address.up)
        squatter.send_multipart([b"not a signature", b"junk"])
        for i in range(3):  # before: FutureTimeoutError, the batches lost on the way
            want = np.asarray(jax.jit(lambda v: jnp.sin(v) * 2)(x + i))
            np.testing.assert_array_equal(np.asarray(step(x + i).result(timeout=30)), want)
        squatter.close()
    finally:
        context.term()
        pw.shutdown()


def test_a_channel_peer_keeps_its_name_against_a_newcomer_claiming_it():
    # The wire itself: a connection under a connected peer's name, with no key, took the name's
    # route, and the peer's signed messages after it never arrived.
    import secrets

    import zmq

    from pathways_jax._src import wire

    key = secrets.token_bytes(32)
    context = zmq.Context()
    with (
        wire.Server(key, heartbeat=None) as server,
        wire.Peer(server.address, key, identity=b"host-0", heartbeat=None) as host,
    ):
        host.send(wire.Done(1))
        assert server.recv(timeout=10).body == wire.Done(1)
        squatter = context.socket(zmq.DEALER)
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.setsockopt(zmq.ROUTING_ID, b"host-0")
        squatter.connect(server.address.up)
        squatter.send_multipart([b"x" * 3, b"junk"])
        for seq in range(2, 5):
            host.send(wire.Done(seq))
            got = server.recv(timeout=10)  # before: None, the frame gone to a closed route
            assert got is not None and got.peer == b"host-0" and got.body == wire.Done(seq), got
        squatter.close()
    context.term()


def test_sharing_with_a_process_not_joined_yet_says_to_share_once_it_joined(service):
    # The README's order (share with "train", then "train" receives) run with the owner started
    # first: the refusal named the processes connected but not what to do.
    pw.init(backend="ray", address=service.address, service=service.name, client_name="eval")
    try:
        out = pw.jit(lambda v: v + 1, devices=pw.devices(mesh={"x": 1}))(jnp.arange(3.0))
        np.testing.assert_array_equal(np.asarray(out.result(timeout=60)), np.arange(3.0) + 1)
        with pytest.raises(
            pw.errors.AccessError,
            match=r"no client process named 'train' is connected .*share it once that process has joined "
            r"\(pw\.init\(\.\.\., client_name='train'\)\)",
        ):
            pw.share(out, client="train")
    finally:
        pw.shutdown()
