"""The controller service as client processes written from the README meet it (round 48).

One service (an island of two hosts of two devices) serves the module's tests: a service start
costs seconds. Results are compared with plain ``jax.jit`` on the same inputs.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

pytestmark = pytest.mark.timeout(180)

SERVICE = "test-round48"


@pytest.fixture(scope="module")
def service(ray_cluster):
    svc = pw.serve(SERVICE, hosts=2, devices_per_host=2, islands=1)
    try:
        yield svc
    finally:
        pw.shutdown()
        svc.stop()


def _join(svc, name: str) -> None:
    pw.init(backend="ray", address=svc.address, service=svc.name, client_name=name)


def test_a_client_of_another_version_is_refused_at_join_saying_both_versions(
    service, ray_cluster, monkeypatch
):
    # A client process of another pathways_jax (or wire format) joined and failed later, with a
    # garbled error or a hang, when it and the service misread each other's messages.
    from pathways_jax._src import wire
    from pathways_jax._src.backends import service_client
    from pathways_jax._src.core import version

    ours = pw.__version__
    monkeypatch.setattr(version, "VERSION", "0.0.9")
    with pytest.raises(
        pw.errors.ClusterError,
        match=rf"the service runs pathways_jax {ours} \(wire format \d+, jax {jax.__version__}\), this "
        rf"process pathways_jax 0.0.9 .*\(pip install pathways-jax=={ours} jax=={jax.__version__}\)",
    ):
        _join(service, "other-version")
    monkeypatch.undo()
    monkeypatch.setattr(wire, "WIRE_VERSION", wire.WIRE_VERSION + 1)
    with pytest.raises(pw.errors.ClusterError, match=rf"wire format {wire.WIRE_VERSION}, jax"):
        _join(service, "other-wire")
    monkeypatch.undo()

    # A client from before the check (its join names no versions) is refused too, saying so.
    token = ray_cluster.remote(service_client.Token).options(num_cpus=0).remote()
    try:
        old = ray_cluster.get(service.actor.join.remote("old", 1, "node", token, False), timeout=30)
    finally:
        ray_cluster.kill(token)
    assert "older than its version check" in old["refused"], old

    # And a service from before the check (its join takes no versions) is named so at join.
    @ray_cluster.remote(num_cpus=0)
    class OldService:
        async def join(self, name, pid, node, token, x64):
            return {"client": 1}

    old_service = OldService.options(name="test-round48-old", namespace=service_client.NAMESPACE).remote()
    try:
        with pytest.raises(
            pw.errors.ClusterError,
            match=r"service='test-round48-old'\): the service runs a pathways_jax older than its version check .* this process "
            rf"pathways_jax {pw.__version__}",
        ):
            pw.init(backend="ray", service="test-round48-old", client_name="new")
    finally:
        ray_cluster.kill(old_service)

    # Refused, none of them holds a name at the service: the same one joins, and computes.
    _join(service, "other-version")
    f = pw.jit(lambda v: jnp.cumsum(v) * 2, devices=pw.devices(mesh={"x": 2}))
    x = np.arange(8.0, dtype=np.float32)
    np.testing.assert_array_equal(f(x).result(timeout=60), jax.jit(lambda v: jnp.cumsum(v) * 2)(x))


def _spy_on_fed_bytes(monkeypatch) -> list[int]:
    """The bytes of every argument this process puts on the wire from now (a run's fed data, per host)."""
    from pathways_jax._src.backends import channel_link

    sent: list[int] = []
    real = channel_link._feed

    def counted(slot, kind, payload):
        feed = real(slot, kind, payload)
        if feed.data is not None:
            sent.append(len(feed.data))
        return feed

    monkeypatch.setattr(channel_link, "_feed", counted)
    return sent


def _each_host_gets_its_own_blocks(monkeypatch) -> None:
    """An argument sharded over the island's two hosts goes to each as its own blocks only, where it
    went whole to each (sent once to both, or once to each); results bit-identical to jax.jit."""
    x = np.arange(256 * 128, dtype=np.int32).reshape(256, 128)  # over ray_places.SPLIT_BYTES

    def fn(v):
        return v * 3 + v.sum()

    want = np.asarray(jax.jit(fn)(x))
    rows = pw.devices(mesh={"x": 4})  # devices 0, 1 on host 0; 2, 3 on host 1
    grid = pw.devices(mesh={"x": 2, "y": 2})  # "x": the host; a host's two blocks per value
    cases = [
        (rows, pw.P("x"), x.nbytes),
        (grid, pw.P("y", "x"), x.nbytes),
        (grid, pw.P(None, "x"), x.nbytes),
    ]
    before = pw.cluster().backend.host_stats()
    for devices, spec, wanted in cases:
        f = pw.jit(fn, devices=devices, in_specs=(spec,), out_specs=spec)
        f(x).block_until_ready()  # its plan goes to the hosts with the first run
        sent = _spy_on_fed_bytes(monkeypatch)
        got = f(x).result(timeout=60)
        monkeypatch.undo()
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        # Each host's part, and a few hundred bytes of framing each.
        assert len(sent) == 2 and wanted <= sum(sent) <= wanted + 2048, (spec, sent, x.nbytes)
    after = pw.cluster().backend.host_stats()  # the hosts' own count: half the value each, each run
    fed = [after[h]["fed_bytes"] - before[h]["fed_bytes"] for h in (0, 1)]
    assert fed == [len(cases) * x.nbytes] * 2, fed


def test_each_host_is_sent_only_its_shards_of_an_argument_on_the_ray_backend(ray_cluster, monkeypatch):
    pw.init(backend="ray", hosts=2, devices_per_host=2, islands=1)
    _each_host_gets_its_own_blocks(monkeypatch)


def test_each_host_is_sent_only_its_shards_of_an_argument_through_a_service(service, monkeypatch):
    _join(service, "blocks")
    _each_host_gets_its_own_blocks(monkeypatch)


def _slow_fetches(monkeypatch, seconds: float) -> list[int]:
    """Every fetch's answers come ``seconds`` late from now, as a large value's transfer does; the
    hosts asked (one entry per host asked)."""
    import concurrent.futures
    import threading

    route = pw.cluster().backend.dispatcher.route
    real = route.message
    asked: list[int] = []

    def slowly(host, kind, args):
        answer = real(host, kind, args)
        if kind != "fetch":
            return answer
        asked.append(host)
        late: concurrent.futures.Future = concurrent.futures.Future()

        def come(done):
            timer = threading.Timer(seconds, lambda: late.set_result(done.result()))
            timer.daemon = True
            timer.start()

        answer.add_done_callback(come)
        return late

    monkeypatch.setattr(route, "message", slowly)
    return asked


def _made_on_two_hosts():
    x = np.arange(4096, dtype=np.float32)
    f = pw.jit(
        lambda v: v * 2 + 1, devices=pw.devices(mesh={"x": 4}), in_specs=pw.P("x"), out_specs=pw.P("x")
    )
    out = f(x)
    out.block_until_ready()
    return out, np.asarray(jax.jit(lambda v: v * 2 + 1)(x))


def test_a_fetch_cut_short_by_its_deadline_goes_on_and_the_next_read_takes_what_came(service, monkeypatch):
    # The backend's part of result(timeout=...) during a large fetch: the hosts' answers are waited
    # for until the deadline only, and what comes after is read by the next fetch (not asked again).
    import time

    _join(service, "deadline")
    out, want = _made_on_two_hosts()
    asked = _slow_fetches(monkeypatch, 1.2)
    array = out._entry.array  # the value's handle on the hosts
    started = time.monotonic()
    with pytest.raises(pw.errors.FutureTimeoutError, match="2 of 2 parts owed"):
        array.fetch(time.monotonic() + 0.1)
    assert time.monotonic() - started < 0.9
    got = np.asarray(array.fetch(time.monotonic() + 30))
    assert asked == [0, 1]  # one fetch, not two
    np.testing.assert_array_equal(got, want)
    monkeypatch.undo()
    # Nothing left half-read: the next value's fetch is a plain one.
    again, want = _made_on_two_hosts()
    np.testing.assert_array_equal(again.result(timeout=60), want)


def test_result_with_a_timeout_ends_at_about_its_deadline_during_a_large_fetch(service, monkeypatch):
    # A value computed on a service's hosts whose transfer here takes longer than the timeout:
    # result(timeout=0.1) waited for the whole transfer (the fetch was not bounded by the deadline).
    import time

    _join(service, "timeout")
    out, want = _made_on_two_hosts()
    _slow_fetches(monkeypatch, 1.2)
    started = time.monotonic()
    with pytest.raises(pw.errors.FutureTimeoutError):
        out.result(timeout=0.1)
    assert time.monotonic() - started < 0.9
    np.testing.assert_array_equal(out.result(timeout=30), want)


def test_a_run_done_before_pw_shutdown_is_not_failed_by_it(service, caplog):
    # A client that read its last run's value and called pw.shutdown() (or exited) was told, in a
    # WARNING, that the run "failed while executing: ClusterError: this process left the controller
    # service", and it counted as failed: the run's completion, still to be accounted, was read
    # after the close as the close's error.
    import logging

    _join(service, "clean-exit")
    f = pw.jit(lambda v: v * 2, devices=pw.devices(mesh={"x": 4}), in_specs=pw.P("x"), out_specs=pw.P("x"))
    x = np.arange(8.0, dtype=np.float32)
    out = f(x)
    np.testing.assert_array_equal(out.result(timeout=60), np.asarray(jax.jit(lambda v: v * 2)(x)))
    value = out._entry.array
    dispatcher = pw.cluster().backend.dispatcher
    with caplog.at_level(logging.WARNING):
        pw.shutdown()
    assert [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
    ] == []  # a clean exit says nothing
    assert dispatcher.closed
    assert [
        dispatcher.outcome(h, d, value.generation) for h, d in zip(value.hosts, value.dones, strict=True)
    ] == [
        None,
        None,
    ]
    # A run still owed at the close is the close's error, as before.
    import concurrent.futures

    owed: concurrent.futures.Future = concurrent.futures.Future()
    with pytest.raises(pw.errors.ClusterError, match="left the controller service"):
        raise dispatcher.outcome(0, owed, value.generation)


# --- round 49: client processes written from the README's service sections ----------------------


def test_a_client_leaving_with_runs_in_flight_says_so_in_one_line(service, caplog):
    # A process that left (pw.shutdown(), or its exit) with runs in flight logged a WARNING per run
    # ("run N failed while executing: ClusterError: this process left ..."), as many as it had.
    import logging

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    def fn(v):
        return v * 2 + 1

    x = np.arange(4096, dtype=np.float32)  # as _made_on_two_hosts: its executables again
    _join(service, "leaves")
    step = pw.jit(fn, devices=pw.devices(mesh={"x": 4}), in_specs=pw.P("x"), out_specs=pw.P("x"))
    first = step(x)
    np.testing.assert_array_equal(first.result(timeout=60), jax.jit(fn)(x))
    outs = [step(first) for _ in range(48)]
    with caplog.at_level(logging.WARNING):
        pw.shutdown()
    said = lines()
    assert len(said) == 1 and "left the controller service" in said[0] and "in flight there" in said[0], said
    runs = int(said[0].split(" with ")[1].split()[0])
    assert 0 < runs <= 48, said
    with pytest.raises(pw.errors.ClusterError, match="left the controller service"):
        outs[-1].result(timeout=30)


def _one_line_as_the_service_goes(service, name: str, caplog, seen_as) -> list[str]:
    """Joins as ``name``, sends runs, then sees its service (``seen_as``: the actor this process asks
    from then on) go or drop it, and sends more: the WARNING lines logged meanwhile."""
    import logging

    from helpers import wait_for

    _join(service, name)
    step = pw.jit(
        lambda v: v * 2 + 1, devices=pw.devices(mesh={"x": 4}), in_specs=pw.P("x"), out_specs=pw.P("x")
    )
    x = np.arange(4096, dtype=np.float32)
    backend = pw.cluster().backend
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        outs = [step(x) for _ in range(48)]
        backend.service = seen_as
        assert wait_for(lambda: backend.route.gone_now() is not None, timeout=20)
        outs += [step(x) for _ in range(8)]  # (and the runs sent after it went)
        for out in outs:
            with contextlib.suppress(pw.errors.ClusterError):
                out.result(timeout=30)
        with pytest.raises(pw.errors.ClusterError, match=r"is gone|dropped this process"):
            outs[-1].result(timeout=30)
    pw.shutdown()
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_service_gone_or_dropping_this_process_with_runs_in_flight_is_said_in_one_line(
    service, ray_cluster, caplog
):
    # The runs a gone service owed (or one that dropped this process) each logged "failed while
    # executing: ... is gone" beside the line saying it went (with Ray's multi-line death notice).
    class Dropping:  # as this process sees a service that dropped it (no actor: no worker to start)
        class health:
            @staticmethod
            def remote(client=None):
                return ray_cluster.put({"lost": {}, "generations": [0], "dropped": "it was silent for 31.0s"})

    said = _one_line_as_the_service_goes(service, "dropped", caplog, Dropping())
    assert len(said) == 1 and "'test-round48' dropped this process (it was silent for 31.0s)" in said[0], said

    @ray_cluster.remote(num_cpus=0)
    class Gone:  # the service's methods a client's health monitor calls
        def health(self, client=None):
            return {}

        def slices(self, client, slices):
            return None

    gone = Gone.remote()
    ray_cluster.kill(gone)  # as this process sees a service that died: its actor is gone
    said = _one_line_as_the_service_goes(service, "sees-it-go", caplog, gone)
    assert len(said) == 1 and "'test-round48' is gone (its Ray actor died: " in said[0], said
    assert "\n" not in said[0]


def test_typed_keys_sharded_over_hosts_go_to_each_host_as_its_own_blocks(service, monkeypatch):
    # Typed PRNG keys (jax.random.key) over the island's two hosts went whole to each host: their
    # raw data was not cut as numpy arguments are. Results bit-identical to jax.jit.
    _join(service, "key-blocks")
    keys = jax.random.split(jax.random.key(7), 8192)  # raw data: 64 KiB (ray_places.SPLIT_BYTES)
    raw = np.asarray(jax.random.key_data(keys))

    def fn(k):  # each host's keys as they came (a random draw would compile for seconds)
        return jax.random.key_data(k) * 3 + 1

    want = np.asarray(jax.jit(fn)(keys))
    f = pw.jit(fn, devices=pw.devices(mesh={"x": 4}), in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    f(keys).block_until_ready()  # its plan goes to the hosts with the first run
    before = pw.cluster().backend.host_stats()
    sent = _spy_on_fed_bytes(monkeypatch)
    got = f(keys).result(timeout=60)
    monkeypatch.undo()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert len(sent) == 2 and raw.nbytes <= sum(sent) <= raw.nbytes + 2048, (sent, raw.nbytes)
    after = pw.cluster().backend.host_stats()
    assert [after[h]["fed_bytes"] - before[h]["fed_bytes"] for h in (0, 1)] == [raw.nbytes // 2] * 2


class _Answer:
    """A host actor's method: ``.remote()`` gives its answer (or the error it raises) at once."""

    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args):
        return self.answer


class _Ray:
    def get(self, ref, timeout=None):
        if isinstance(ref, BaseException):
            raise ref
        return ref


def test_ray_hosts_of_another_version_are_refused_at_start_naming_both():
    # Ray starts a host actor with the pathways_jax and jax of the node it lands on, another
    # version where that node's environment is older: nothing compared them with the controller's
    # (a service's client processes are checked at join), so they misread each other later.
    # Hosts that answer as another version does (a real one costs a host start: seconds).
    from pathways_jax._src.backends import ray_fleet
    from pathways_jax._src.backends.ray_boot import Layout
    from pathways_jax._src.backends.service_client import versions

    ours = versions()
    other = dict(ours, pathways_jax="0.0.9")

    def start(*answers):
        fleet = object.__new__(ray_fleet.HostActors)
        fleet.ray, fleet.layout = _Ray(), Layout(len(answers), 1, len(answers))
        fleet.actors = [type("Host", (), {"versions": _Answer(answer)})() for answer in answers]
        fleet.start()

    with pytest.raises(
        pw.errors.ClusterError,
        match=r"host 1 \(on node node-b\) runs pathways_jax 0\.0\.9 \(wire format \d+, jax "
        rf"{jax.__version__}\), this process pathways_jax {pw.__version__} .*install this process's on "
        rf"every node .*\(pip install pathways-jax=={pw.__version__} jax=={jax.__version__}\)",
    ):
        start((ours, "node-a"), (other, "node-b"))
    # A node whose pathways_jax lacks a method of this one's host actor (an older one: Ray loads the
    # class there by name, its methods too) or has none: Ray's import failure, named for what it is.
    failed = RuntimeError(
        "The actor with name Host failed to import on the worker. This may be because needed library "
        "dependencies are not installed in the worker environment:\n\nAttributeError: Can't get "
        "attribute 'Host.versions' on <module 'pathways_jax._src.backends.ray_host.actor'>"
    )
    with pytest.raises(
        pw.errors.ClusterError,
        match=r"host 0 could not load this process's host actor on its node \(AttributeError: Can't get "
        rf"attribute 'Host.versions' .*\): the node has another pathways_jax, or none, .*pip install "
        rf"pathways-jax=={pw.__version__}",
    ):
        start(failed)
