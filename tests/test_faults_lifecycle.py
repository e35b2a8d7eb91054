"""The runtime's life cycle under misuse: clients come and go, shutdown is bounded, arguments are checked.

Issue 17: nothing a user does can kill, stall or slowly fill the runtime.
"""

import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw
from pathways_jax._src.backends import ray as ray_backend
from pathways_jax._src.backends import ray_dispatch, ray_fleet, ray_losses
from pathways_jax._src.runtime import accounting as accounting_lib
from pathways_jax._src.runtime import clusters, init_args
from pathways_jax._src.runtime import context as context_lib

CLOSED = accounting_lib.CLOSED_CLIENTS


def _settled_stats(done, timeout: float = 30.0) -> dict:
    """``pw.stats()`` once ``done(stats)`` holds (the watcher accounts off the hot path)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = pw.stats()
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


# --- per-client state goes with the client (item 6) ---------------------------------------


@pytest.mark.timeout(120)
def test_closed_clients_are_summed_in_one_row_and_leave_no_state():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    double = pw.jit(lambda v: v * 2, devices=s)
    x = jnp.arange(4.0)
    accounting = pw.cluster().controller.accounting
    want = np.asarray(jax.jit(lambda v: v * 2)(x))  # compiled once (a new lambda a call compiles again)
    for i in range(200):
        c = pw.client(f"request-{i}")
        with c:
            out = double(x)
        np.testing.assert_allclose(np.asarray(out.result(timeout=30)), want)
        c.close()
    stats = _settled_stats(lambda st: st["clients"].get(CLOSED, {}).get("programs") == 200)
    assert not any(name.startswith("request-") for name in stats["clients"]), sorted(stats["clients"])
    row = stats["clients"][CLOSED]
    assert row["programs"] == 200 and row["clients"] == 200
    assert row["failures"] == 0 and row["queued"] == 0 and row["device_time_s"] > 0
    assert set(row) == {"device_time_s", "programs", "failures", "queued", "clients"}
    # No per-client entry stays behind in the accounting or the controller's queues.
    assert accounting.usage == {}
    assert pw.cluster().controller._queues == {}
    s.release()


def _gated(started: threading.Event, gate: threading.Event):
    def wait(v):
        started.set()
        gate.wait(30)
        return v

    return lambda v: jax.pure_callback(wait, jax.ShapeDtypeStruct(v.shape, v.dtype), v) + 1


@pytest.mark.timeout(120)
def test_a_run_finishing_after_its_client_closed_counts_in_the_closed_row():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    started, gate = threading.Event(), threading.Event()
    slow = pw.jit(_gated(started, gate), devices=s)
    c = pw.client("late")
    try:
        with c:
            out = slow(jnp.ones(3))
        assert started.wait(30), "the run was not dispatched"
        c.close()  # the run is on the device now: it finishes after the close
    finally:
        gate.set()
    with pytest.raises(pw.errors.PathwaysError):
        out.result(timeout=30)  # its value was freed with its client
    stats = _settled_stats(lambda st: st["clients"].get(CLOSED, {}).get("programs") == 1)
    assert "late" not in stats["clients"]
    assert stats["clients"][CLOSED]["programs"] == 1 and stats["clients"][CLOSED]["clients"] == 1
    assert pw.cluster().controller.accounting.usage == {}
    assert pw.cluster().controller.alive
    s.release()


@pytest.mark.timeout(120)
def test_a_thread_s_default_client_leaves_the_table_when_the_thread_ends():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    inc = pw.jit(lambda v: v + 1, devices=s)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(np.asarray(inc(jnp.zeros(2)).result(timeout=30))))
        for _ in range(20)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and len(results) == 20
    names = {t.name for t in threads}
    stats = _settled_stats(
        lambda st: st["clients"].get(CLOSED, {}).get("clients") == 20 and not names & set(st["clients"])
    )
    assert not names & set(stats["clients"])
    assert stats["clients"][CLOSED]["clients"] == 20
    assert stats["clients"][CLOSED]["programs"] <= 20
    assert pw.cluster().controller.accounting.usage == {}  # the main thread ran nothing
    s.release()


def test_reset_starts_the_closed_row_again():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    c = pw.client("once")
    with c:
        pw.jit(lambda v: v - 1, devices=s)(jnp.ones(2)).result(timeout=30)
    c.close()
    assert _settled_stats(lambda st: CLOSED in st["clients"])["clients"][CLOSED]["clients"] == 1
    pw.stats(reset=True)
    assert CLOSED not in pw.stats()["clients"]
    s.release()


# --- shutdown honours its timeout (item 9) -------------------------------------------------


@pytest.mark.timeout(60)
def test_shutdown_returns_within_its_timeout_while_the_watcher_hangs(monkeypatch, caplog):
    entered, gate = threading.Event(), threading.Event()
    account = accounting_lib.Accounting._account

    def hung(self, batch, t):
        entered.set()
        gate.wait(30)  # a host that never answers
        return account(self, batch, t)

    monkeypatch.setattr(accounting_lib.Accounting, "_account", hung)
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    pw.jit(lambda v: v * 3, devices=s)(jnp.ones(2)).result(timeout=30)
    watcher = pw.cluster().controller.accounting._thread
    try:
        assert entered.wait(30), "the watcher never took the run"
        start = time.monotonic()
        pw.shutdown(timeout=1)
        took = time.monotonic() - start
        assert took < 3.0, f"pw.shutdown(timeout=1) took {took:.1f}s"
        assert watcher.is_alive() and watcher.daemon  # left behind as a daemon thread, and logged
        assert "accounting watcher did not stop" in caplog.text
    finally:
        gate.set()
        watcher.join(30)
    assert not watcher.is_alive()


class _FakeRay:
    def __init__(self):
        self.killed = []

    def kill(self, actor):
        self.killed.append(actor)


@pytest.mark.timeout(30)
def test_the_ray_backend_s_close_never_waits_past_its_timeout():
    backend = object.__new__(ray_backend.RayBackend)
    backend.ray = _FakeRay()
    backend.dispatcher = object.__new__(ray_dispatch.Dispatcher)
    backend.fleet = fleet = object.__new__(ray_fleet.HostActors)
    fleet.ray, fleet.actors = backend.ray, ["host0", "host1"]
    fleet.pg, fleet.remove_pg = None, lambda pg: None
    release = threading.Event()
    backend._threads = [threading.Thread(target=release.wait, args=(30,), daemon=True)]
    backend._threads[0].start()
    try:
        start = time.monotonic()
        backend.close(timeout=0.5)
        took = time.monotonic() - start
        assert took < 2.0, f"close(timeout=0.5) took {took:.1f}s"
        assert backend.closed and backend.ray.killed == ["host0", "host1"]  # killed without waiting
    finally:
        release.set()
        backend._threads[0].join(10)


def test_shutdown_checks_its_timeout():
    for bad in (math.nan, math.inf, -1, None, "5"):
        with pytest.raises(pw.errors.ClusterError, match="timeout"):
            pw.shutdown(timeout=bad)


# --- after pw.shutdown() nothing starts a cluster by itself (item 10) ----------------------


@pytest.mark.timeout(60)
def test_after_shutdown_uses_raise_until_init():
    literal = pw.program(lambda: 3.0)
    assert float(literal().result(timeout=30)) == 3.0  # the first use starts the default cluster
    pw.shutdown()
    calls = {
        "stats": pw.stats,
        "cluster": pw.cluster,
        "devices": lambda: pw.devices(mesh={"x": 1}),
        "literal program": literal,
        "unplaced program": lambda: pw.program(lambda v: v * 2)(jnp.ones(2)),
    }
    for what, call in calls.items():
        with pytest.raises(pw.errors.ClusterError, match=r"shut down.*pw\.init") as info:
            call()
        assert isinstance(info.value, RuntimeError), what
        assert clusters.running() is None, f"{what} started a cluster"
    # pw.init starts the next one, with any arguments.
    cl = pw.init(num_cpu_devices=8, islands=2)
    assert pw.cluster() is cl and "clients" in pw.stats()
    assert float(literal().result(timeout=30)) == 3.0


def test_the_exit_hook_and_a_shutdown_with_nothing_running_do_not_count(monkeypatch):
    pw.shutdown()  # nothing ran: the first use still starts the default cluster
    first = pw.cluster()
    # The hook marks the process as exiting; the test process goes on, so the mark is undone after.
    monkeypatch.setattr(context_lib, "exiting", False)
    clusters._shutdown_at_exit()
    assert first.closed and context_lib.exiting
    context_lib.exiting = False
    assert pw.cluster() is not first  # the exit hook is not a user's pw.shutdown()


# --- arguments are checked (item 11) --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"backpressure_timeout": math.nan}, r"backpressure_timeout must be .*got nan"),
        ({"backpressure_timeout": math.inf}, r"backpressure_timeout must be .*got inf"),
        ({"backpressure_timeout": -1.0}, r"backpressure_timeout must be .*got -1\.0"),
        ({"backpressure_timeout": True}, r"backpressure_timeout must be .*got True"),
        ({"backpressure_timeout": "5"}, r"backpressure_timeout must be .*got '5'"),
        ({"max_in_flight": True}, r"max_in_flight must be an int >= 1, got True"),
        ({"max_in_flight": 2.0}, r"max_in_flight must be an int >= 1, got 2\.0"),
        ({"max_in_flight": 0}, r"max_in_flight must be an int >= 1, got 0"),
        ({"max_queued": 0}, r"max_queued must be an int >= 1, got 0"),
        ({"max_queued": True}, r"max_queued must be an int >= 1, got True"),
        ({"max_queued": math.nan}, r"max_queued must be an int >= 1, got nan"),
        ({"max_queued": None}, r"max_queued must be an int >= 1, got None"),
        ({"starvation_limit": -1}, r"starvation_limit must be an int >= 0, got -1"),
        ({"starvation_limit": False}, r"starvation_limit must be an int >= 0, got False"),
        ({"num_cpu_devices": True}, r"num_cpu_devices must be an int >= 1 or None, got True"),
        ({"num_cpu_devices": 8.0}, r"num_cpu_devices must be an int >= 1 or None, got 8\.0"),
        ({"num_cpu_devices": -8}, r"num_cpu_devices must be an int >= 1 or None, got -8"),
        ({"inline_dispatch": 1}, r"inline_dispatch must be True or False, got 1"),
        ({"inline_dispatch": None}, r"inline_dispatch must be True or False, got None"),
        ({"scheduler": ["fifo"]}, r"scheduler=\['fifo'\] is not a scheduling policy"),
        ({"backend": None}, r"backend=None is not a backend"),
        ({"memory_budget": math.nan}, r"memory_budget must be in \(0, 1\], got nan"),
        ({"memory_budget": math.inf}, r"memory_budget must be in \(0, 1\], got inf"),
        ({"memory_budget": True}, r"memory_budget must be None, an int .*got True"),
        ({"memory_budget": 0}, r"memory_budget must be > 0 bytes, got 0"),
        ({"islands": True}, r"islands must be None, an int, or a list of lists of int device ids; got True"),
        ({"islands": [[0, True]]}, r"islands must be .*got \(\(0, True\),\)"),
        ({"islands": [[0.0, 1.0]]}, r"islands must be .*got \(\(0\.0, 1\.0\),\)"),
        ({"islands": "01"}, r"islands must be .*got '01'"),
        ({"devices_per_host": True}, r"devices_per_host must be a positive int, got True"),
        ({"address": "auto"}, r"describe Ray hosts"),
        ({"backend": "ray", "hosts": True}, r"needs hosts=N, a positive int .*got True"),
        ({"backend": "ray", "hosts": 2.0}, r"needs hosts=N, a positive int .*got 2\.0"),
        (
            {"backend": "ray", "hosts": 2, "devices_per_host": True},
            r"devices_per_host must be a positive int, got True",
        ),
        (
            {"backend": "ray", "hosts": 2, "devices_per_host": 1.5},
            r"devices_per_host must be a positive int, got 1\.5",
        ),
        (
            {"backend": "ray", "hosts": 2, "address": 5},
            r"address must be None or a Ray address string, got 5",
        ),
    ],
)
def test_init_refuses_bad_arguments(kwargs, pattern):
    with pytest.raises(pw.errors.ClusterError, match=pattern):
        pw.init(**kwargs)
    assert clusters.running() is None  # nothing half-started


def test_init_takes_max_queued():
    assert init_args.DEFAULT_MAX_QUEUED == 1024
    assert pw.init(num_cpu_devices=8).max_queued == init_args.DEFAULT_MAX_QUEUED
    with pytest.raises(pw.errors.ClusterError, match=r"max_queued=4.*max_queued=1024.*is running"):
        pw.init(num_cpu_devices=8, max_queued=4)
    pw.shutdown()
    cl = pw.init(num_cpu_devices=8, max_queued=np.int64(4), backpressure_timeout=2)
    assert cl.max_queued == 4 and type(cl.max_queued) is int
    assert cl.backpressure_timeout == 2.0
    assert pw.init(num_cpu_devices=8, max_queued=4, backpressure_timeout=2.0) is cl


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"timeout": math.nan}, r"timeout must be None or a number >= 0, got nan"),
        ({"timeout": math.inf}, r"timeout must be None or a number >= 0, got inf"),
        ({"timeout": -1}, r"timeout must be None or a number >= 0, got -1"),
        ({"timeout": True}, r"timeout must be None or a number >= 0, got True"),
        ({"timeout": "1"}, r"timeout must be None or a number >= 0, got '1'"),
        ({"exclusive": 1}, r"exclusive must be True or False, got 1"),
        ({"exclusive": None}, r"exclusive must be True or False, got None"),
        ({"island": True}, r"asked for island True"),
        ({"island": -1}, r"asked for island -1"),
        ({"island": 0.0}, r"asked for island 0\.0"),
        ({"island": 5}, r"asked for island 5"),
        ({"mesh": {"x": True}}, r"mesh sizes must be positive ints"),
        ({"mesh": {"x": 1.0}}, r"mesh sizes must be positive ints"),
        ({"device_ids": [True]}, r"names True, which is not a device id"),
    ],
)
def test_devices_refuses_bad_arguments(kwargs, pattern):
    pw.init(num_cpu_devices=8, islands=2)
    kwargs = {"mesh": {"x": 1}, **kwargs}
    with pytest.raises(pw.errors.ResourceError, match=pattern):
        pw.devices(**kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "pattern"),
    [
        ((CLOSED,), {}, r"must not be '\(closed clients\)'"),
        ((3,), {}, r"name must be a non-empty string, got 3"),
        (("a",), {"priority": 1.5}, r"priority must be an int, got 1\.5"),
        (("a",), {"priority": True}, r"priority must be an int, got True"),
        (("a",), {"weight": math.nan}, r"weight must be a finite number > 0, got nan"),
        (("a",), {"weight": math.inf}, r"weight must be a finite number > 0, got inf"),
        (("a",), {"weight": -1}, r"weight must be a finite number > 0, got -1"),
        (("a",), {"weight": True}, r"weight must be a finite number > 0, got True"),
        (("a",), {"weight": "2"}, r"weight must be a finite number > 0, got '2'"),
    ],
)
def test_client_refuses_bad_arguments(args, kwargs, pattern):
    with pytest.raises(pw.errors.ResourceError, match=pattern):
        pw.client(*args, **kwargs)
    c = pw.client("ok", priority=np.int64(2), weight=np.float32(0.5))
    assert (c.priority, c.weight) == (2, 0.5) and type(c.priority) is int


# --- a HostLostError when no host survives (item 12) ---------------------------------------


def test_host_lost_message_says_when_no_host_survives():
    losses = ray_losses.Losses(ray_backend.Layout(hosts=4, devices_per_host=1, per_island=2))
    losses.record(0, "host 1 died (the actor died)")
    some = losses.message(0, "program 'step'")
    assert "program 'step' needed island 0 (hosts 0-1), which was lost: host 1 died" in some
    assert "moved to surviving islands" in some and "no island survives" not in some
    losses.record(1, "host 2 died (the actor died)")
    none = losses.message(1, "program 'step'")
    assert "program 'step' needed island 1 (hosts 2-3), which was lost: host 2 died" in none
    assert "no island survives" in none and "surviving islands" not in none
    assert "pw.shutdown()" in none and "pw.init(" in none
