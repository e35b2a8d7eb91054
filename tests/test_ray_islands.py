"""Ray backend, islands of several hosts: gang order, host loss and the host-to-host data plane.

An island of several hosts is one ``jax.distributed`` system; its slices span
hosts and every host runs the island's programs in the controller's order.
Results are compared with plain ``jax.jit`` on this process.
"""

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, wait_for

import pathways_jax as pw

pytestmark = pytest.mark.timeout(240)

DETECTION_BOUND_S = 5.0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# Steps of _slow that keep island 1 busy for seconds (3000 took about 0.5 s here: the kill came late).
_LONG = 12000
_SHORT = 8  # steps of the runs that only need to compute right (a traced count: the same program)


def _slow(v, m, steps):
    return jax.lax.fori_loop(0, steps, lambda i, u: jnp.tanh(u @ m) + 0.5, v)


@pytest.mark.parametrize("scheduler", ["fifo", "priority", "fair"])
def test_two_clients_collectives_in_opposite_device_orders_are_exact(ray_cluster, scheduler):
    # Run in different orders on the two hosts, these programs would pair each
    # other's collectives: wrong sums, or a hang. Through one controller every
    # host runs them in its one order.
    cluster = pw.init(backend="ray", hosts=2, devices_per_host=2, islands=1, scheduler=scheduler)
    assert [len(isl.devices) for isl in cluster.islands] == [4]
    forward = pw.devices(mesh={"x": 4}, device_ids=[0, 1, 2, 3])
    reverse = pw.devices(mesh={"x": 4}, device_ids=[3, 2, 1, 0])

    @pw.jit(devices=forward, in_specs=(pw.P("x"),), out_specs=pw.P())
    def total(x):
        return jnp.sum(x, keepdims=True)  # an all-reduce (sum) over both hosts

    @pw.jit(devices=reverse, in_specs=(pw.P("x"),), out_specs=pw.P())
    def largest(x):
        return jnp.max(x, keepdims=True) * 2  # an all-reduce (max) in the other device order

    n = 200
    results: dict[str, list] = {}
    failures: list[BaseException] = []

    def client_thread(name: str, fn, priority: int, weight: float) -> None:
        try:
            with pw.client(name, priority=priority, weight=weight):
                outs = [fn(jnp.arange(8.0) + j) for j in range(n)]
                results[name] = [np.asarray(o.result(timeout=180)) for o in outs]
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [
        threading.Thread(target=client_thread, args=("sums", total, 1, 1.0)),
        threading.Thread(target=client_thread, args=("maxes", largest, 0, 3.0)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not failures, failures
    want_sum = jax.jit(lambda v: jnp.sum(v, keepdims=True))
    want_max = jax.jit(lambda v: jnp.max(v, keepdims=True) * 2)
    for j in range(n):
        np.testing.assert_array_equal(results["sums"][j], np.asarray(want_sum(jnp.arange(8.0) + j)))
        np.testing.assert_array_equal(results["maxes"][j], np.asarray(want_max(jnp.arange(8.0) + j)))
    # Both hosts ran every program: 2 x 200 runs each (collectives need both).
    stats = cluster.backend.host_stats()
    assert stats[0]["runs"] >= 2 * n and stats[1]["runs"] >= 2 * n, stats


@pytest.mark.timeout(360)  # several checks of the module's in one: see below
def test_values_cross_hosts_then_a_killed_member_loses_its_island_and_the_next_call_moves(ray_cluster):
    # Two checks on one cluster of two islands of two hosts (starting four hosts costs seconds
    # each): values cross the islands' hosts through the transfer servers, then a member dies.
    cluster = pw.init(backend="ray", hosts=4, devices_per_host=1, islands=2)
    assert [len(isl.devices) for isl in cluster.islands] == [2, 2]
    _values_cross_hosts_through_the_transfer_servers(cluster)
    _killed_member_loses_its_island_and_the_next_call_moves(cluster)


def _killed_member_loses_its_island_and_the_next_call_moves(cluster):
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    m = jax.random.normal(jax.random.key(0), (256, 256)) / 16

    @pw.program
    def step(x, scale, steps):
        with a:
            h = jnp.sin(x) + 1
        with b:
            y = jax.lax.with_sharding_constraint(_slow(h, m, steps) * scale, pw.P("x"))
            return y, y.sum()  # the sum is a collective across island 1's two hosts

    def plain(x, scale, steps):
        y = _slow(jnp.sin(x) + 1, m, steps) * scale
        return y, y.sum()

    x = jnp.ones((256, 256))
    short, long = jnp.int32(_SHORT), jnp.int32(_LONG)
    step(x, 1.0, short)[1].result(timeout=180)  # compiled and registered everywhere
    kept_on_island0 = pw.jit(lambda v: v * 3, devices=a)(jnp.arange(4.0))
    kept_on_island1 = pw.jit(lambda v: v * 2, devices=b)(jnp.arange(4.0))
    assert wait_for(kept_on_island1.done, 60)
    before = pw.counters()
    pids = [info["pid"] for info in cluster.backend.info]

    pw.faults.kill_host(3, at_run=1)  # host 3 dies in the middle of its next run
    slow_out, slow_sum = step(x, 2.0, long)  # seconds of work on island 1 (hosts 2 and 3)
    killed = time.monotonic()
    for out in (slow_out, slow_sum):
        with pytest.raises(pw.errors.HostLostError, match="host 3") as caught:
            out.result(timeout=30)
        assert "island 1" in str(caught.value)
    assert time.monotonic() - killed <= DETECTION_BOUND_S, "the island's loss took too long to surface"
    with pytest.raises(pw.errors.HostLostError, match="host 3"):
        kept_on_island1.result(timeout=30)
    # The island went as a unit: its other member was stopped too.
    assert wait_for(lambda: _gone(pids[2]), DETECTION_BOUND_S), "the lost island's other host still runs"
    assert not _gone(pids[0]) and not _gone(pids[1])
    assert cluster.backend.lost.keys() == {1}
    assert_matches(kept_on_island0, jnp.arange(4.0) * 3)  # island 0's values are untouched

    # The slice moved to the surviving island; the program lowers again, no re-trace.
    assert b.island == 0, b
    out = step(x, 3.0, short)
    want = jax.jit(plain)(x, 3.0, short)
    assert_matches(out, want, rtol=1e-4)
    after = pw.counters()
    assert after["traces"] == before["traces"]
    assert after["lowerings"] - before["lowerings"] == 1

    # Ray has room (the lost hosts' bundles): the island is rebuilt on two new hosts.
    assert wait_for(lambda: not cluster.backend.lost and 1 not in cluster.resources.lost, 90), "not rebuilt"
    new_pids = [info["pid"] for info in cluster.backend.info]
    assert new_pids[:2] == pids[:2] and not set(new_pids[2:]) & set(pids)
    c = pw.devices(mesh={"x": 2}, island=1)
    spread_sum = pw.jit(lambda v: v - v.mean(), devices=c, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    assert_matches(spread_sum(jnp.arange(8.0)), jnp.arange(8.0) - 3.5)
    with pytest.raises(pw.errors.HostLostError, match="host 3"):  # old values stay lost
        kept_on_island1.result(timeout=30)
    with pytest.raises(pw.errors.HostLostError, match="host 3"):  # and cannot feed the new hosts
        pw.jit(lambda v: v + 1, devices=c)(kept_on_island1).result(timeout=30)
    assert_matches(spread_sum(jnp.ones(8)), jnp.zeros(8))  # which keep serving


def _values_cross_hosts_through_the_transfer_servers(cluster):
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)

    @pw.program
    def two_islands(x):
        with a:
            h = jax.lax.with_sharding_constraint(jnp.cos(x) * 2, pw.P("x"))
        with b:
            return jax.lax.with_sharding_constraint(jnp.tanh(h) + h.sum(), pw.P("x"))

    x = jnp.linspace(-1, 1, 16)
    want = jax.jit(lambda v: jnp.tanh(jnp.cos(v) * 2) + (jnp.cos(v) * 2).sum())(x)
    two_islands(x).result(timeout=120)
    before, stats_before = pw.counters(), cluster.backend.host_stats()
    runs = 10
    outs = [two_islands(x) for _ in range(runs)]
    for out in outs:
        assert_matches(out, want, rtol=1e-5, atol=1e-6)
    after, stats_after = pw.counters(), cluster.backend.host_stats()

    def delta(key: str, hosts) -> int:
        return sum(stats_after[h][key] - stats_before[h][key] for h in hosts)

    # Each run: each of island 1's two hosts pulls the one shard of h its own
    # shard needs, from the island 0 host holding it; only the argument came
    # with a message, and nothing reached island 1 through a Ray call.
    assert after["host_pulls"] - before["host_pulls"] == 2 * runs
    assert delta("pulls", (2, 3)) == 2 * runs and delta("posts", (0, 1)) == 2 * runs
    assert delta("pulls", (0, 1)) == 0 and delta("posts", (2, 3)) == 0
    assert delta("fed", (0, 1)) == 2 * runs  # x, to both hosts of island 0
    assert delta("fed", (2, 3)) == 0
    assert after["transfers_dcn"] - before["transfers_dcn"] == runs

    # A replicated reader needs every shard on each of its hosts: 2 hosts x 2 shards.
    on_a = pw.jit(jnp.cos, devices=a, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    replicated = pw.jit(lambda v: v * 2 + v[::-1], devices=b, in_specs=(pw.P(),), out_specs=pw.P())
    h = on_a(x)
    h.result(timeout=60)
    before = pw.counters()
    assert_matches(replicated(h), jnp.cos(x) * 2 + jnp.cos(x)[::-1], rtol=1e-6)
    assert pw.counters()["host_pulls"] - before["host_pulls"] == 4


def test_source_killed_mid_transfer_fails_the_run_cleanly(ray_cluster):
    cluster = pw.init(backend="ray", hosts=4, devices_per_host=1, islands=2, replace_lost_hosts=False)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    m = jax.random.normal(jax.random.key(1), (256, 256)) / 16

    @pw.program
    def produce_then_consume(x):
        with a:
            h = _slow(x, m, 3000)  # seconds on island 0, then moved to island 1
        with b:
            return jnp.tanh(h) * 2

    x = jnp.ones((256, 256))
    produce_then_consume(x).result(timeout=180)
    island1_alone = pw.jit(lambda v: v * 5 + 1, devices=b)
    pids = [info["pid"] for info in cluster.backend.info]

    out = produce_then_consume(x * 0.5)
    time.sleep(0.5)
    assert not out.done()  # island 1 waits for the value island 0 is still computing
    os.kill(pids[0], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(pw.errors.HostLostError, match="host 0"):
        out.result(timeout=30)
    assert time.monotonic() - killed <= DETECTION_BOUND_S
    # Island 1's hosts did not hang on the pull: they serve the next program.
    assert_matches(island1_alone(jnp.arange(6.0)), jnp.arange(6.0) * 5 + 1)
    assert cluster.backend.lost.keys() == {0}
    assert set(cluster.backend.host_stats()) == {2, 3}
    # Not to be rebuilt: the island stays out of placement.
    time.sleep(1.0)
    with pytest.raises(pw.errors.ResourceError, match=r"island 0.*lost"):
        pw.devices(mesh={"x": 1}, island=0)
    assert a.island == 1  # moved to the surviving island


def _init_checks_the_island_layout(start_cluster):
    with pytest.raises(pw.errors.ClusterError, match=r"divides hosts=4"):
        pw.init(backend="ray", hosts=4, islands=3)
    cluster = start_cluster()
    # One island of both hosts' devices: a value spanning the hosts is fetched whole.
    s = pw.devices(mesh={"x": 4})
    assert len(s.devices) == 4
    spread = pw.jit(lambda v: v * 3, devices=s, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    x = jnp.arange(12.0).reshape(4, 3)
    assert_matches(spread(x), x * 3)
    assert [info["island_devices"] for info in cluster.backend.info] == [4, 4]


def _host_pools_of_two_threads(monkeypatch) -> None:
    """The hosts' XLA:CPU thread pools have 2 threads (``PJRT_NPROC``), as on a 2-core machine.

    XLA:CPU runs a host's executables on ``max(cores, devices)`` threads: with
    2 devices per host, the fewest any machine gives. The island hang below
    needs every thread of a host taken, so the test asks for that few.
    """
    from pathways_jax._src.backends import ray_fleet

    new_actor = ray_fleet.HostActors.new_actor

    class _WithTwoThreads:
        def __init__(self, actor_class):
            self.actor_class = actor_class

        def options(self, **options):
            return self.actor_class.options(runtime_env={"env_vars": {"PJRT_NPROC": "2"}}, **options)

    def new_actor_of_two_threads(fleet, host):
        actor_class = fleet._actor_class
        fleet._actor_class = _WithTwoThreads(actor_class)
        try:
            return new_actor(fleet, host)
        finally:
            fleet._actor_class = actor_class

    monkeypatch.setattr(ray_fleet.HostActors, "new_actor", new_actor_of_two_threads)


@pytest.mark.timeout(360)  # several checks of the module's in one: see below
def test_init_checks_the_island_layout_and_a_program_on_one_device_of_each_host_then_one_on_all_do_not_hang(
    ray_cluster, monkeypatch
):
    # Two checks on one island of two hosts (starting hosts costs seconds each): pw.init's check
    # of the layout and an island spanning both hosts, then the hang below.
    # Host 0 has devices 0 and 1, host 1 devices 2 and 3. Run N: ``lone`` on
    # devices [1, 3] (one per host: XLA:CPU orders it only on its device),
    # waiting for a slow input. Run N+1: ``gang`` on all four (XLA orders it
    # among each host's several-device executables). Host 1 launched the gang
    # on both its pool threads while its part of ``lone`` waited for one;
    # host 0, in its part of ``lone`` waiting for host 1's, never launched the
    # gang: the island hung for good. The hosts now wait for ``lone`` first.
    _host_pools_of_two_threads(monkeypatch)
    _init_checks_the_island_layout(lambda: pw.init(backend="ray", hosts=2, devices_per_host=2, islands=1))
    one = pw.devices(mesh={"x": 1}, device_ids=[1])
    pair = pw.devices(mesh={"x": 2}, device_ids=[1, 3])
    four = pw.devices(mesh={"x": 4}, device_ids=[0, 1, 2, 3])

    def slow(v, m):
        return jax.lax.fori_loop(0, 20000, lambda i, u: jnp.tanh(u @ m) + 0.5, v)  # tenths of a second

    def lone_fn(v):
        return jnp.cumsum(v) + 1  # an all-gather across the two hosts

    def gang_fn(v):
        return jnp.cumsum(v) * 2

    slow_on_one = pw.jit(slow, devices=one)
    lone = pw.jit(lone_fn, devices=pair, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    gang = pw.jit(gang_fn, devices=four, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    x = jnp.ones((8, 64)) / 64
    m = jnp.eye(64)
    y = jnp.arange(8.0)
    lone(slow_on_one(x, m)).result(timeout=120)  # compiled and registered everywhere
    gang(y).result(timeout=120)
    want_lone = jax.jit(lambda v, w: lone_fn(slow(v, w)))(x, m)
    want_gang = jax.jit(gang_fn)(y)
    for attempt in range(3):  # the hosts used to hang in the first or second
        pair_out = lone(slow_on_one(x, m))
        four_out = gang(y)
        try:
            # The hang is for good: a long timeout costs only a failing run, and a loaded machine
            # may take seconds for the slow input.
            assert_matches(four_out.result(timeout=30), want_gang)
            assert_matches(pair_out.result(timeout=30), want_lone, rtol=1e-5)
        except pw.errors.FutureTimeoutError:
            pw.shutdown(timeout=1.0)  # its hosts are killed: nothing waits for them
            pytest.fail(
                f"the island hung in attempt {attempt}: its hosts let XLA:CPU run the two programs "
                "in an order that deadlocks"
            )
