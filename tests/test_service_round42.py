"""The controller service as a demanding client uses it: values of every kind shared between
processes, a failed run's outputs under the service's memory budget.

One service (two islands of one host, a small memory budget) serves the
module; this test process joins it as a client. Results are compared with
plain ``jax.jit`` on the same inputs.
"""

from __future__ import annotations

import gc
import pickle
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, wait_for

import pathways_jax as pw
from pathways_jax import colocated_python as colocated

pytestmark = pytest.mark.timeout(180)

BUDGET = 4 << 20  # bytes of values the service's hosts may hold for all its clients
BACKPRESSURE_S = 3.0  # how long a run may wait for memory there


@pytest.fixture(scope="module")
def service(ray_cluster):
    """Two islands of one host each, under a 4 MiB memory budget."""
    svc = pw.serve(
        "test-round42", hosts=2, devices_per_host=1, memory_budget=BUDGET, backpressure_timeout=BACKPRESSURE_S
    )
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def joined(service):
    """This test process as a client of the module's service."""
    cluster = pw.init(backend="ray", address=service.address, service=service.name, client_name="me")
    try:
        yield cluster
    finally:
        pw.shutdown()


def _state(seed):
    return {"key": jax.random.key(seed), "raw": jax.random.PRNGKey(seed), "w": jnp.arange(4.0)}


def _draw(state):
    return jax.random.uniform(state["key"], (4,)) + jax.random.uniform(state["raw"], (4,)) + state["w"]


def test_a_shared_state_holding_a_typed_key_is_received_and_draws_what_jax_draws(joined):
    # A train state with its typed PRNG key, shared as a pytree of handles: pw.receive failed on the
    # key ("TypeError: data type 'key<fry>' not understood"), which numpy cannot name.
    s0 = pw.devices(mesh={"x": 1}, island=0)
    s1 = pw.devices(mesh={"x": 1}, island=1)
    seed = jnp.uint32(7)
    state = pw.jit(_state, devices=s0)(seed)
    received = pw.receive(pickle.loads(pickle.dumps(pw.share(state))))
    assert received["key"].dtype == state["key"].dtype and received["key"].shape == ()
    want = jax.jit(_draw)(jax.jit(_state)(seed))
    assert_matches(pw.jit(_draw, devices=s0)(received), want, rtol=0, atol=0)
    assert_matches(pw.jit(_draw, devices=s1)(received), want, rtol=0, atol=0)  # moved to the other island
    assert_matches(
        jax.random.key_data(received["key"].result(timeout=60)), jax.random.key_data(_state(seed)["key"])
    )


def _too_big_to_make(v):
    # 3 MiB of outputs, computed through a 4 TiB intermediate no host can allocate.
    return jnp.cumsum(jnp.broadcast_to(v, (1 << 40,)))[: 3 << 18]


def _service_bytes(service: pw.Service) -> int:
    return service.stats()["bytes_held"]


def test_a_failed_run_s_outputs_give_their_bytes_back_to_the_service_s_budget(joined, service):
    # A run that fails on its host made nothing: its outputs' bytes stayed on the service's budget
    # while their futures lived, so the next run waited for memory no host held and failed with
    # BackPressureTimeout (in-process, a failed run's bytes go back at once).
    s = pw.devices(mesh={"x": 1}, island=0)
    failed = pw.jit(_too_big_to_make, devices=s)(jnp.float32(1))
    reader = pw.jit(lambda v: v[:4] + 1, devices=s)(failed)
    with pytest.raises(pw.errors.ProgramFailedError, match="Out of memory"):
        failed.result(timeout=60)
    assert wait_for(lambda: _service_bytes(service) == 0, timeout=10), service.stats()["clients"]
    # 2 MiB more fits the 4 MiB budget: nothing is held.
    fill = pw.jit(lambda v: jnp.full((1 << 19,), v), devices=s)
    assert_matches(fill(jnp.float32(2)), jax.jit(lambda v: jnp.full((1 << 19,), v))(jnp.float32(2)))
    # The failed value is still known for what it is: read, or read by a run, it says why it is missing.
    with pytest.raises(pw.errors.ProgramFailedError, match="Out of memory"):
        reader.result(timeout=60)
    with pytest.raises(pw.errors.ProgramFailedError, match="Out of memory"):
        failed.result(timeout=60)
    del failed, reader
    gc.collect()
    assert wait_for(lambda: _service_bytes(service) == 0, timeout=10)


def test_a_run_that_fails_on_its_hosts_raises_the_class_jax_jit_raises(joined):
    # Out of memory on a host: jax.jit raises a JaxRuntimeError, and so does a program in-process
    # (a ProgramFailedError that is also one); from the service's hosts it was a ProgramFailedError
    # only, so `except jax.errors.JaxRuntimeError` (catching an OOM to shrink the batch) missed it.
    with pytest.raises(jax.errors.JaxRuntimeError, match="Out of memory"):
        jax.jit(_too_big_to_make)(jnp.float32(1)).block_until_ready()
    s = pw.devices(mesh={"x": 1}, island=0)
    failed = pw.jit(_too_big_to_make, devices=s)(jnp.float32(1))
    with pytest.raises(jax.errors.JaxRuntimeError, match="Out of memory") as caught:
        failed.result(timeout=60)
    assert isinstance(caught.value, pw.errors.ProgramFailedError)
    assert_matches(pw.jit(lambda v: v * 2, devices=s)(jnp.arange(3.0)), jnp.arange(3.0) * 2)  # serving on


def _slow(v):
    return jax.lax.fori_loop(0, 20000, lambda i, u: jnp.sin(u) + 1.0, v)


def _host_runs(service: pw.Service) -> int:
    return sum(h["runs"] for h in service.host_stats().values())


def test_closing_a_client_cancels_its_runs_queued_at_the_service(joined, service):
    # pw.client.close() cancels the client's queued runs. In a client process of a service most of
    # them wait in the service's queue (4 in flight per island): they ran all the same, on hosts
    # other processes share, and a run of another client came only after every one of them.
    s = pw.devices(mesh={"x": 1}, island=0)
    slow = pw.jit(_slow, devices=s)
    x = jnp.ones(256)
    assert_matches(slow(x), jax.jit(_slow)(x), rtol=1e-5, atol=1e-5)
    before = _host_runs(service)
    batch = pw.client("batch")
    with batch:
        queued = [slow(x) for _ in range(40)]
    batch.close()
    with pytest.raises(pw.errors.PathwaysError, match=r"freed|cancelled"):
        queued[-1].result(timeout=60)
    assert_matches(pw.jit(lambda v: v * 3, devices=s)(x), x * 3)  # another client's run
    done = _host_runs(service) - before
    assert done <= 12, f"{done} runs went to the hosts after their client was closed with 40 queued"
    mine = lambda: service.stats()["clients"][joined.backend.client_id]  # noqa: E731
    assert wait_for(lambda: mine()["queued"] == 0 and mine()["in_flight"] == 0, timeout=30), mine()
    del queued
    gc.collect()
    assert wait_for(lambda: _service_bytes(service) == 0, timeout=10)


def test_pw_share_refuses_a_client_that_is_no_name_at_once_saying_what_it_takes(joined):
    # A client id from the service's stats given as an int (or a name that is empty) was an
    # AccessError (a PermissionError), raised only once the run making the value was sent.
    s = pw.devices(mesh={"x": 1}, island=0)
    out = pw.jit(lambda v: v + 1, devices=s)(jnp.arange(3.0))
    with pytest.raises(pw.errors.PathwaysError, match=r"client must be None .* got 1 \(int\)") as caught:
        pw.share(out, client=1)
    assert isinstance(caught.value, TypeError)
    with pytest.raises(pw.errors.PathwaysError, match=r"got '' \(str\)") as caught:
        pw.share({"out": out}, client="")
    assert isinstance(caught.value, ValueError)
    with pytest.raises(pw.errors.AccessError, match="no client process named 'nobody'"):
        pw.share(out, client="nobody")
    me = str(joined.backend.client_id)  # its id in the stats, as a str: taken
    assert_matches(pw.receive(pw.share(out, client=me)), jnp.arange(3.0) + 1)


def test_the_command_line_takes_every_option_pw_serve_takes(monkeypatch, capsys):
    # `python -m pathways_jax serve` is pw.serve from a shell, yet it took no timeouts, no
    # replace_lost_hosts, max_in_flight or starvation_limit: a service for notebooks that may be
    # stopped a while (silent_client_timeout=None) could not be started from it.
    import types

    from pathways_jax.__main__ import main

    given = {}

    def serve(name, **kwargs):
        given.update(kwargs, name=name)
        return types.SimpleNamespace(name=name, address="here:1")

    monkeypatch.setattr(pw, "serve", serve)
    argv = ["--name", "cli42", "serve", "--hosts", "2", "--backpressure_timeout", "none"]
    argv += ["--stalled_client_timeout", "12.5", "--silent_client_timeout", "None"]
    argv += ["--replace_lost_hosts", "false", "--max_in_flight", "3", "--starvation_limit", "7"]
    assert main(argv) == 0, capsys.readouterr().err
    assert given["name"] == "cli42" and given["hosts"] == 2
    assert given["backpressure_timeout"] is None and given["silent_client_timeout"] is None
    assert given["stalled_client_timeout"] == 12.5 and given["replace_lost_hosts"] is False
    assert given["max_in_flight"] == 3 and given["starvation_limit"] == 7
    given.clear()
    assert main(["serve", "--hosts", "1"]) == 0  # left out: pw.serve's defaults
    assert (given["silent_client_timeout"], given["stalled_client_timeout"], given["replace_lost_hosts"]) == (
        30.0,
        30.0,
        True,
    )
    assert "max_in_flight" not in given and "starvation_limit" not in given
    with pytest.raises(SystemExit):
        main(["serve", "--hosts", "1", "--silent_client_timeout", "soon"])
    assert "a number of seconds or 'none', got 'soon'" in capsys.readouterr().err


def _numbered_rows(shard):
    for i in range(6):
        yield np.full((2,), i, np.float32)


class _Unreadable:
    """An iterator with a position (as Grain's) that cannot be put back where a checkpoint says."""

    def __init__(self):
        self.rows = _numbered_rows(None)

    def __next__(self):
        return next(self.rows)

    def __iter__(self):
        return self

    def get_state(self):
        return {"unused": True}

    def set_state(self, state):
        raise OSError("checkpointed position unreadable")


def _in_thread(fn, timeout: float = 30.0):
    """``fn()`` on a thread of its own, joined within ``timeout`` (a hang fails, it does not hang)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} did not return within {timeout}s"
    return out[0]


def test_a_host_iterator_given_a_position_it_cannot_take_stays_where_it_was():
    # set_state with a list of the wrong length, a position of the wrong kind, or one the
    # iterator's own set_state refuses: the host had stopped its iterator first, so the next
    # batch waited for ever (and a raw IndexError / KeyError / TypeError came from the host).
    s = pw.devices(mesh={"x": 1})
    spec = jax.ShapeDtypeStruct((2,), np.float32, sharding=s.sharding())
    batches = colocated.HostIterator(_numbered_rows, spec)
    assert float(next(batches)[0]) == 0.0
    for bad in ([], [{}], [{"taken": "x"}], [{"taken": 1}, {"taken": 1}]):
        with pytest.raises(pw.errors.PathwaysError, match="stays where it was") as caught:
            batches.set_state(bad)
        assert isinstance(caught.value, ValueError)
    assert _in_thread(lambda: [float(b[0]) for b in batches]) == [1.0, 2.0, 3.0, 4.0, 5.0]
    unreadable = colocated.HostIterator(lambda shard: _Unreadable(), spec)
    assert float(next(unreadable)[0]) == 0.0
    with pytest.raises(OSError, match="checkpointed position unreadable"):
        unreadable.set_state(unreadable.get_state())
    assert _in_thread(lambda: float(next(unreadable)[0])) == 1.0
    s.release()


def test_pw_serve_takes_numpy_counts_and_seconds_as_pw_init_does(monkeypatch):
    # pw.init(backend="ray", hosts=np.int64(2)) is taken; pw.serve refused the same count (and a
    # memory_budget computed with NumPy) saying "hosts must be an int >= 1, got np.int64(2)".
    from pathways_jax._src.runtime.serving import handle

    class Reached(Exception):
        """pw.serve took its arguments and went on to join the Ray cluster."""

    def connect(address, **kwargs):
        raise Reached(kwargs)

    monkeypatch.setattr(handle, "connect", connect)
    with pytest.raises(Reached) as reached:
        pw.serve(
            "numpy-counts",
            hosts=np.int64(4),
            devices_per_host=np.int32(2),
            islands=np.int64(2),
            window=np.int64(3),
            max_clients=np.int16(5),
            memory_budget=np.prod([256, 1024, 1024]),
            stalled_client_timeout=np.float64(12.5),
            silent_client_timeout=np.float32(7.0),
        )
    assert reached.value.args[0]["hosts"] == 4 and type(reached.value.args[0]["hosts"]) is int
    with pytest.raises(pw.errors.ClusterError, match=r"hosts must be an int >= 1, got np.int64\(0\)"):
        pw.serve("numpy-counts", hosts=np.int64(0))
    with pytest.raises(pw.errors.ClusterError, match="window must be an int >= 1, got True"):
        pw.serve("numpy-counts", hosts=1, window=True)


def test_values_on_a_lost_island_give_their_bytes_back_to_the_service_s_budget(joined, service):
    # Last in the module: it kills a host of the service (which rebuilds its island). The values the
    # island held went with it, yet their bytes stayed on the budget while their futures lived: runs on
    # the islands left waited for that memory and failed with BackPressureTimeout.
    import os
    import signal

    s0 = pw.devices(mesh={"x": 1}, island=0)
    s1 = pw.devices(mesh={"x": 1}, island=1)
    fill = lambda v: jnp.full((3 << 18,), v)  # noqa: E731  (3 MiB)
    held = pw.jit(fill, devices=s1)(jnp.float32(1))
    assert_matches(held, fill(jnp.float32(1)))
    assert wait_for(lambda: _service_bytes(service) == 3 << 20, timeout=10), service.stats()["clients"]
    os.kill(service.host_stats()[1]["pid"], signal.SIGKILL)
    assert wait_for(lambda: 1 in service.stats()["lost"], timeout=30)
    assert wait_for(lambda: _service_bytes(service) == 0, timeout=10), service.stats()["clients"]
    # 2 MiB on the island left fits the 4 MiB budget: nothing is held.
    half = lambda v: jnp.full((1 << 19,), v)  # noqa: E731
    assert_matches(pw.jit(half, devices=s0)(jnp.float32(2)), half(jnp.float32(2)))
    with pytest.raises(pw.errors.HostLostError):  # the lost value still says what became of it
        pw.jit(lambda v: v + 1, devices=s1)(held).result(timeout=60)
