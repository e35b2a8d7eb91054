"""The controller service (pw.serve): client processes sharing one controller's hosts.

Client processes are subprocesses running tests/service_client.py; this
process starts the local Ray cluster and the services, and joins one itself
where a test needs a client in-process. Results are compared with numpy /
plain ``jax.jit`` on the same inputs.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import wait_for

import pathways_jax as pw

pytestmark = pytest.mark.timeout(300)

CLIENT = str(pathlib.Path(__file__).with_name("service_client.py"))
CLEANUP_BOUND_S = 15.0  # a killed client's values are freed within this


@pytest.fixture(scope="module")
def island_service(ray_cluster):
    """One service: an island of 2 hosts x 2 devices, FIFO."""
    svc = pw.serve("test-island", hosts=2, devices_per_host=2, islands=1)
    try:
        yield svc
    finally:
        svc.stop()


class Clients:
    """Client subprocesses of one test, reporting through JSON files in ``folder``.

    ``svc``: the service they join (a ``pw.Service``), or its ``(address, name)``
    when they start before it: each waits for it to run.
    """

    def __init__(self, svc: pw.Service | tuple[str, str], folder: pathlib.Path):
        self.address, self.name = (svc.address, svc.name) if isinstance(svc, pw.Service) else svc
        self.svc = svc
        self.folder = folder
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, mode: str, *args: str) -> subprocess.Popen:
        with (self.folder / f"{name}.log").open("w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [
                    sys.executable,
                    CLIENT,
                    self.address,
                    self.name,
                    name,
                    str(self.folder),
                    mode,
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs[name] = proc
        return proc

    def report(self, name: str) -> dict:
        path = self.folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def wait_state(self, name: str, *states: str, timeout: float = 120.0) -> dict:
        ok = wait_for(lambda: self.report(name).get("state") in (*states, "error"), timeout=timeout)
        got = self.report(name)
        log = (self.folder / f"{name}.log").read_text()[-3000:]
        assert ok, f"client {name} did not reach {states} in {timeout}s: {got}\n{log}"
        assert got["state"] != "error", f"client {name} failed: {got.get('trace')}\n{log}"
        return got

    def stop(self) -> None:
        (self.folder / "stop").write_text("")

    def close(self) -> None:
        self.stop()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def clients(island_service, tmp_path):
    group = Clients(island_service, tmp_path)
    try:
        yield group
    finally:
        group.close()


def _client_rows(svc: pw.Service) -> dict[str, dict]:
    return {row["name"]: row for row in svc.stats()["clients"].values()}


def test_two_processes_run_collectives_in_opposite_device_orders_exactly(clients):
    # In different orders on the two hosts these programs would pair each other's
    # all-reduces: wrong sums or a hang. The service sends every host one order.
    clients.start("fwd", "collective", "forward", "200")
    clients.start("rev", "collective", "reverse", "200")
    for name in ("fwd", "rev"):
        got = clients.wait_state(name, "done", timeout=240)
        assert got["runs"] == 200
        assert got["bad"] == [], f"{name}: wrong results {got['bad'][:5]}"
    rows = _client_rows(clients.svc)
    assert rows["fwd"]["runs"] >= 200 and rows["rev"]["runs"] >= 200
    assert rows["fwd"]["failures"] == 0 and rows["rev"]["failures"] == 0


def test_one_function_on_the_same_devices_in_opposite_orders_is_exact(clients):
    # The hosts compile a computation per device order: one executable shared by
    # both orders got buffers on the wrong devices and took both hosts down.
    clients.start("orders", "orders")
    got = clients.wait_state("orders", "done", timeout=180)
    assert got["bad"] == [], f"wrong results: {got['bad']}"
    assert _client_rows(clients.svc)["orders"]["failures"] == 0


def test_different_collectives_of_two_processes_on_overlapping_orders_never_hang(clients):
    # Process a: [0, 1, 2, 3] and [2, 0]; process b: [3, 2, 1, 0] and [0, 2]; each
    # round starts in both at once. A hang shows as a round that never ends.
    rounds, per_round = 12, 40
    for side in ("a", "b"):
        clients.start(side, "mixed", side, str(rounds), str(per_round))
    for r in range(rounds):
        (clients.folder / f"go-{r}").write_text("")
        for side in ("a", "b"):
            ok = wait_for(
                lambda side=side, r=r: (
                    clients.report(side).get("round", 0) > r or clients.report(side).get("state") == "error"
                ),
                timeout=90,
            )
            got = clients.report(side)
            log = (clients.folder / f"{side}.log").read_text()[-3000:]
            assert ok, f"round {r} of client {side} never ended: {got}\n{log}"
            assert got["state"] != "error", f"client {side} failed: {got.get('trace')}\n{log}"
            assert got["bad"] == [], f"client {side}: wrong results {got['bad'][:5]}"
    for side in ("a", "b"):
        assert clients.wait_state(side, "done")["round"] == rounds


def test_sigkilled_client_with_runs_in_flight_is_cleaned_up_and_the_other_goes_on(clients):
    svc = clients.svc
    baseline = sum(h["values"] for h in svc.host_stats().values())
    victim = clients.start("victim", "hold", "20")
    clients.start("survivor", "busy", "1.0")
    clients.wait_state("victim", "holding")
    clients.wait_state("survivor", "running")
    assert wait_for(lambda: sum(h["values"] for h in svc.host_stats().values()) >= baseline + 20, timeout=30)
    assert _client_rows(svc)["victim"]["bytes_held"] >= 20 * 256 * 4
    before = clients.report("survivor")["runs"]
    # Killed with runs in flight on the hosts, and more queued at the service.
    assert wait_for(lambda: _client_rows(svc)["victim"]["in_flight"] > 0, timeout=30), _client_rows(svc)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    killed_at = time.monotonic()

    def cleaned() -> bool:
        row = _client_rows(svc)["victim"]
        return (
            not row["alive"]
            and row["bytes_held"] == 0
            and row["queued"] == 0
            and row["in_flight"] == 0
            and row["slices"] == {}
        )

    assert wait_for(cleaned, timeout=CLEANUP_BOUND_S), _client_rows(svc)["victim"]
    # The hosts' counts are back to the baseline, but for the survivor's own values.
    survivor_values = _client_rows(svc)["survivor"]["values"]
    assert wait_for(
        lambda: sum(h["values"] for h in svc.host_stats().values()) <= baseline + survivor_values + 8,
        timeout=CLEANUP_BOUND_S,
    ), svc.host_stats()
    assert time.monotonic() - killed_at < CLEANUP_BOUND_S + 5
    assert "died" in _client_rows(svc)["victim"]["gone"]
    # The other client was untouched: it goes on, and its results are exact.
    assert wait_for(lambda: clients.report("survivor").get("runs", 0) >= before + 20, timeout=60)
    clients.stop()
    got = clients.wait_state("survivor", "done")
    assert got["exact"]
    assert _client_rows(svc)["survivor"]["failures"] == 0


def test_a_handle_is_refused_unless_shared(clients):
    # The owner shares once the reader has joined; the reader reads once the handles are there.
    clients.start("reader", "read", "owner")
    clients.start("owner", "share", "reader")
    got = clients.wait_state("reader", "done", timeout=120)
    want = np.arange(8.0) * 3 + 1
    np.testing.assert_array_equal(got["shared"], want)
    np.testing.assert_array_equal(got["doubled"], want * 2)
    assert len(got["refused"]) == 2, got["refused"]
    assert all("not shared" in why or "another client" in why for why in got["refused"])
    assert _client_rows(clients.svc)["reader"]["refused"] >= 2
    # A second pw.receive of the handle outlives the first future's drop, and the owner's death.
    np.testing.assert_array_equal(got["again"], want * 2)
    # Donating a shared value consumes a copy on the hosts, in its reader (the owner's value
    # stays) as in its owner (the reader's stays: read below, once the owner is gone).
    np.testing.assert_array_equal(got["consumed"], jax.jit(lambda v: v * 2)(want))
    np.testing.assert_array_equal(got["still"], want)
    np.testing.assert_array_equal(clients.wait_state("owner", "shared")["consumed"], want * 2)
    clients.procs["owner"].kill()
    clients.procs["owner"].wait(timeout=30)
    assert wait_for(lambda: not _client_rows(clients.svc)["owner"]["alive"], timeout=CLEANUP_BOUND_S)
    (clients.folder / "owner-gone").write_text("")
    np.testing.assert_array_equal(clients.wait_state("reader", "after", timeout=60)["after"], want)


def _shares(svc: pw.Service, names: tuple[str, ...], seconds: float) -> dict[str, float]:
    """Each client's share of the device time the service measured over ``seconds`` of contention."""
    before = {n: _client_rows(svc)[n]["device_time_s"] for n in names}
    time.sleep(seconds)
    after = {n: _client_rows(svc)[n]["device_time_s"] for n in names}
    used = {n: after[n] - before[n] for n in names}
    total = sum(used.values())
    assert total > 0.5 * seconds, f"the device was mostly idle: {used}"
    return {n: used[n] / total for n in names}


# Each policy once, the slice sizes shared between them; the policies themselves, at every size,
# are test_policies.py's. (scheduler, (light's share, heavy's share), slice size, light's and heavy's
# (weight, priority)): under "fifo" neither counts.
_POLICIES = (
    ("fair", (0.25, 0.75), 4, ((1.0, 0), (3.0, 0))),
    ("priority", (0.0, 1.0), 1, ((1.0, 0), (1.0, 5))),
    ("fifo", (0.5, 0.5), 4, ((3.0, 0), (1.0, 5))),
)


@pytest.mark.timeout(600)  # the three policies in one: see below
def test_policies_hold_between_client_processes(ray_cluster, tmp_path):
    # A 1- or 4-device slice, two client processes always having runs queued: under "fair"
    # with weights 1:3 they get 1/4 and 3/4 of the device time (within 30%, below);
    # under "priority" the higher one gets all of it but what the starvation
    # bound gives the other; under "fifo", runs go in arrival order: halves.
    # One service per policy, one after the other; the same two client processes go from each to
    # the next (a process start costs seconds). They start first (Python and JAX take seconds)
    # and join each service once it runs.
    names = {scheduler: f"test-{scheduler}-{size}" for scheduler, _, size, _ in _POLICIES}
    group = Clients((ray_cluster.get_runtime_context().gcs_address, names["fair"]), tmp_path)
    try:
        for client, index in (("light", 0), ("heavy", 1)):
            group.start(
                client,
                "busy-series",
                *(
                    f"{names[scheduler]}:{who[index][0]}:{who[index][1]}:{size}"
                    for scheduler, _, size, who in _POLICIES
                ),
            )
        for scheduler, expected, size, _ in _POLICIES:
            name = names[scheduler]
            svc = pw.serve(name, hosts=1, devices_per_host=size, scheduler=scheduler, window=2)
            try:
                group.wait_state("light", f"running {name}")
                group.wait_state("heavy", f"running {name}")
                shares = _shares(svc, ("light", "heavy"), 6.0)
                if scheduler == "priority":
                    assert shares["heavy"] >= 0.9, (scheduler, shares)
                else:
                    # Within 30%: a client process the machine starves of CPU lets its queue run dry
                    # and cedes device time (0.22 and 0.31 of 0.25 were seen on a loaded 2-core
                    # machine); the policies' exact shares are test_policies.py's. Fair's 1:3 and
                    # fifo's 1:1 stay apart.
                    assert shares["light"] == pytest.approx(expected[0], rel=0.30), (scheduler, shares)
                    assert shares["heavy"] == pytest.approx(expected[1], rel=0.30), (scheduler, shares)
                (tmp_path / f"stop-{name}").write_text("")
                for client in ("light", "heavy"):
                    assert group.wait_state(client, f"done {name}")["exact"], (scheduler, client)
                assert _client_rows(svc)["light"]["by_client"].keys() == {"light"}
            finally:
                svc.stop()
    finally:
        group.close()


@pytest.fixture
def joined(island_service):
    """This test process as a client of the island service."""
    cluster = pw.init(
        backend="ray", address=island_service.address, service=island_service.name, client_name="me"
    )
    try:
        yield cluster
    finally:
        pw.shutdown()


def _run_count(svc: pw.Service) -> int:
    return sum(h["runs"] for h in svc.host_stats().values())


def test_a_fetched_value_goes_straight_from_its_hosts_to_the_client(joined, island_service):
    """The service checks the handle; the bytes go host -> client on the client's own channel. A
    client channel that takes nothing in time gets the value through the service instead."""
    s = pw.devices(mesh={"x": 4})
    make = pw.jit(lambda x: jnp.sin(x) * 3, devices=s, in_specs=pw.P("x"), out_specs=pw.P("x"))
    x = np.random.default_rng(0).standard_normal((4, 65536)).astype(np.float32)  # 1 MiB: no small value
    want = np.asarray(jax.jit(lambda x: jnp.sin(x) * 3)(x))
    before = island_service.stats()["fetches"]
    np.testing.assert_array_equal(np.asarray(make(x).result(timeout=60)), want)
    # One per host of the island (the hosts' word that the value went may come after it).
    assert wait_for(lambda: island_service.stats()["fetches"]["direct"] >= before["direct"] + 2, timeout=30)
    after = island_service.stats()["fetches"]
    assert after["relayed"] == before["relayed"], (before, after)
    # This process's channel closed: the hosts cannot send there, the service passes the value on.
    joined.backend.route.inbox.close()
    np.testing.assert_array_equal(
        np.asarray(make(x * 2).result(timeout=60)), np.asarray(jax.jit(lambda x: jnp.sin(x) * 3)(x * 2))
    )
    assert island_service.stats()["fetches"]["relayed"] >= after["relayed"] + 2


def test_client_in_process_matches_jax_and_appears_in_stats(joined, island_service):
    s = pw.devices(mesh={"x": 4})

    @pw.program(devices=s)
    def step(x, w):
        h = jnp.tanh(x @ w)
        return h.sum(axis=0), h

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 16)), jnp.float32)
    total, h = step(x, w)
    want_total, want_h = jax.jit(lambda x, w: (jnp.tanh(x @ w).sum(axis=0), jnp.tanh(x @ w)))(x, w)
    np.testing.assert_allclose(np.asarray(total.result(timeout=60)), want_total, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(h.result(timeout=60)), want_h, rtol=1e-5, atol=1e-5)
    again = step(h.sum(axis=1, keepdims=True) * jnp.ones((8, 16)), w)[0]  # a future fed back in
    want = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=0))(
        want_h.sum(axis=1, keepdims=True) * jnp.ones((8, 16)), w
    )
    np.testing.assert_allclose(np.asarray(again.result(timeout=60)), want, rtol=1e-4, atol=1e-4)
    stats = pw.stats()
    mine = [row for row in stats["service"]["clients"].values() if row["name"] == "me" and row["alive"]]
    assert len(mine) == 1
    assert mine[0]["runs"] >= 2 and mine[0]["programs"] >= 1 and mine[0]["failures"] == 0
    assert mine[0]["bytes_held"] >= total.nbytes + h.nbytes
    # The service's hosts serve every client: one of them cannot fail them (pw.faults).
    with pytest.raises(pw.errors.ClusterError, match="client of a controller service") as refused:
        pw.faults.kill_host(0)
    # What it says to do can be done: the service's hosts' processes, by pid.
    assert "host_stats()[h]['pid']" in str(refused.value)
    assert all(row["pid"] > 0 for row in island_service.host_stats().values())

    def my_slices() -> list:
        rows = island_service.stats()["clients"].values()
        return [row["slices"] for row in rows if row["name"] == "me" and row["alive"]]

    assert wait_for(lambda: my_slices() == [{s.id: [d.id for d in s.devices]}], timeout=10), my_slices()


def test_an_output_returned_twice_is_two_values_on_the_service_s_hosts(joined, island_service):
    # One value under one key: donating both (an EMA started from the parameters) failed every
    # step, and deleting one freed the other.
    s = pw.devices(mesh={"x": 4})
    place = pw.jit(lambda v: v * 1, devices=s, in_specs=pw.P("x"), out_specs=pw.P("x"))
    p = place(jnp.arange(8.0))
    state = pw.program(lambda p: {"params": p, "ema": p})(p)
    step = pw.program(
        lambda st: {"params": st["params"] - 1, "ema": 0.5 * st["ema"] + 0.5 * st["params"]}, donate_argnums=0
    )
    want = {"params": jnp.arange(8.0), "ema": jnp.arange(8.0)}
    for _ in range(2):
        state = step(state)
        want = {"params": want["params"] - 1, "ema": 0.5 * want["ema"] + 0.5 * want["params"]}
    np.testing.assert_array_equal(state["params"].result(timeout=60), want["params"])
    np.testing.assert_array_equal(state["ema"].result(timeout=60), want["ema"])
    np.testing.assert_array_equal(p.result(timeout=60), np.arange(8.0))  # not donated: returned as a copy


def test_programs_in_stats_are_those_the_hosts_hold_now(joined, island_service):
    # A program whose function went is forgotten on the hosts; the service's count of the
    # client's programs kept it for ever (a process making functions in a loop: 1 held, 200 said).
    s = pw.devices(mesh={"x": 2})

    def mine() -> dict:
        return island_service.stats()["clients"][joined.backend.client_id]

    for k in range(3):
        f = pw.jit(lambda v, k=k: v * k, devices=s)
        np.testing.assert_array_equal(f(jnp.arange(4.0)).result(timeout=60), np.arange(4.0) * k)
    assert mine()["programs"] >= 1
    del f
    gc.collect()
    assert wait_for(lambda: mine()["programs"] == 0, timeout=10), mine()
    keep = pw.jit(lambda v: v + 1, devices=s)
    np.testing.assert_array_equal(keep(jnp.arange(4.0)).result(timeout=60), np.arange(4.0) + 1)
    assert mine()["programs"] == 1


def test_a_program_dropped_while_a_new_one_of_its_function_is_queued_still_runs(joined, island_service):
    # A computation goes to a host once per client and goes from it with the Forget of the last
    # plan that runs it. A Forget goes ahead of the client's queued runs: it must not go ahead of
    # a queued run whose plan counts on the computation being there (it failed: "KeyError").
    s = pw.devices(mesh={"x": 1})
    f = lambda v: v * 5  # noqa: E731
    first = pw.jit(f, devices=s)
    want = jax.jit(f)(jnp.arange(4.0))
    np.testing.assert_array_equal(first(jnp.arange(4.0)).result(timeout=60), want)
    slow = pw.jit(_slow, devices=s)
    queued = [slow(jnp.ones(256)) for _ in range(8)]  # past the service's window of 4
    second = pw.jit(f, devices=s)(jnp.arange(4.0))  # a new plan, the computation not sent again
    del first
    gc.collect()  # its Forget goes at the next flush, while the second run waits at the service
    np.testing.assert_array_equal(second.result(timeout=60), want)
    for out in queued:
        out.result(timeout=60)
    del queued, out, slow
    gc.collect()
    assert wait_for(lambda: [h["executables"] for h in island_service.host_stats().values()] == [0, 0])


def test_forged_and_stale_handles_are_refused_and_touch_nothing(joined, island_service):
    s = pw.devices(mesh={"x": 2})
    make = pw.jit(lambda v: v + 1, devices=s)
    kept = make(jnp.arange(4.0))
    handle = pw.share(kept)
    assert pickle.loads(pickle.dumps(handle)) == handle
    np.testing.assert_array_equal(pw.receive(handle).result(timeout=60), np.arange(4.0) + 1)
    # A pytree of futures (a program's outputs) shares as the same pytree of handles.
    outputs = {"a": kept, "b": [make(jnp.ones(2)), 3]}  # held: a handle does not keep its value
    tree = pickle.loads(pickle.dumps(pw.share(outputs)))
    got = pw.results(pw.receive(tree))
    assert got["b"][1] == 3
    np.testing.assert_array_equal(got["a"], np.arange(4.0) + 1)
    np.testing.assert_array_equal(got["b"][0], np.ones(2) + 1)
    # Bad input: a named error that is also the builtin a jax user catches, pointing at this line.
    with pytest.raises(pw.errors.PathwaysError, match=r"test_service\.py.*holding no pw\.Future"):
        pw.share({"a": 1})
    with pytest.raises(TypeError, match=r"holding no pw\.Future"):
        pw.share({"a": 1})
    with pytest.raises(pw.errors.PathwaysError, match=r"test_service\.py.*pw\.Handle .*got int holding none"):
        pw.receive(5)
    with pytest.raises(TypeError):
        pw.receive([1, 2])
    for bad in (-1, "30", float("nan"), True):
        with pytest.raises(pw.errors.PathwaysError, match=r"timeout must be None or a number of seconds"):
            pw.share(kept, timeout=bad)
    runs = _run_count(island_service)
    forged = [
        dataclasses.replace(handle, key=handle.key + 10_000),
        dataclasses.replace(handle, owner=handle.owner + 1),
    ]
    for bad in forged:
        with pytest.raises(pw.errors.AccessError, match=r"names no value|another client"):
            pw.receive(bad).result(timeout=60)
        with pytest.raises(pw.errors.AccessError):
            make(pw.receive(bad)).result(timeout=60)
    stale = pw.share(make(jnp.zeros(4)))  # its future is dropped at once: the value is freed
    gc.collect()
    pw.stats()  # collects dropped futures; their frees go out with the next message

    def refused() -> bool:
        try:
            pw.receive(stale).result(timeout=60)
        except pw.errors.AccessError as exc:
            return "stale" in str(exc) or "names no value" in str(exc)
        return False

    assert wait_for(refused, timeout=10)
    # Nothing the refused runs named ran on a host (the one run that made `stale` did).
    assert _run_count(island_service) == runs + 1
    np.testing.assert_array_equal(kept.result(timeout=60), np.arange(4.0) + 1)  # the real one is untouched


def test_forged_replayed_truncated_and_malformed_frames_are_refused_and_counted(joined, island_service):
    import secrets

    import zmq

    from pathways_jax._src import wire

    endpoint = joined.backend.channel  # the service's channel, as this process joined it
    f = pw.jit(lambda v: v * 2 + 1, devices=pw.devices(mesh={"x": 2}))
    np.testing.assert_array_equal(f(jnp.arange(4.0)).result(timeout=60), np.arange(4.0) * 2 + 1)
    context = zmq.Context()

    def refused(reason: str, send, again: bool = False) -> None:
        """Sends what ``send`` sends; the service counts it as ``reason`` (and goes on). ``again``:
        sent anew at each look until counted (a connection under a name ZeroMQ has not yet seen
        leave is turned away: the first connection under a name keeps it)."""
        before = island_service.stats()["refused"]["clients"].get(reason, 0)
        closing = [send()]

        def counted() -> bool:
            if island_service.stats()["refused"]["clients"].get(reason, 0) > before:
                return True
            if again and len(closing) < 20:
                closing.append(send())
            return False

        try:
            assert wait_for(counted, timeout=20), (reason, island_service.stats()["refused"]["clients"])
        finally:
            for sock in closing:
                if sock is not None:
                    sock.close()

    def raw(identity: bytes, frames: list) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(endpoint.address.up)
        sock.send_multipart(frames)
        return sock

    def peer(key: bytes, identity: bytes, captured: list | None = None) -> wire.Peer:
        channel = wire.Peer(endpoint.address, key, identity=identity, heartbeat=None)
        if captured is not None:  # the frames as they go, to send them again
            send = channel._send_sock.send_multipart

            def capture(parts, *args, **kwargs):
                captured.append([bytes(p) for p in parts])
                return send(parts, *args, **kwargs)

            channel._send_sock.send_multipart = capture
        channel.send(wire.Submit(0, [], None))
        return channel

    refused("malformed", lambda: raw(b"garbage", [b"not a signature", b"junk"]))
    refused(
        "truncated", lambda: raw(b"garbage-2", [b"x"])
    )  # another name: the first may not be seen gone yet
    refused("forged", lambda: peer(secrets.token_bytes(32), b"forger"))
    sent: list = []
    # The right key, but a name no client joined under; then the same frames again.
    refused("unknown_client", lambda: peer(endpoint.key, b"stranger", sent))
    refused("replayed", lambda: raw(b"stranger", sent[0]), again=True)
    context.term()
    # This process's own channel: a message that is not a batch; then a batch carrying a message
    # that is not a request (typed: the frame does not decode, and is refused as malformed).
    refused("not_a_batch", lambda: joined.backend.route.peer.send(wire.Done(0)) and None)
    not_a_request = wire.Submit(10**6, [wire.Routed(0, wire.Done(0))], None)  # type: ignore[arg-type]
    refused("malformed", lambda: joined.backend.route.peer.send(not_a_request) and None)
    # The service and this client go on as if nothing happened.
    np.testing.assert_array_equal(f(jnp.arange(6.0)).result(timeout=60), np.arange(6.0) * 2 + 1)


def test_join_errors_are_clear(joined, island_service, ray_cluster):
    with pytest.raises(pw.errors.ClusterError, match="is running"):
        pw.init(backend="ray", address=island_service.address, service="another")
    pw.shutdown()
    with pytest.raises(pw.errors.ClusterError, match=r"no controller service named 'no-such-service'"):
        pw.init(backend="ray", address=island_service.address, service="no-such-service")
    with pytest.raises(
        pw.errors.ClusterError, match=r"service='x' was given to the local backend.*Add backend='ray'"
    ):
        pw.init(service="x")  # the local backend has no service
    with pytest.raises(pw.errors.ClusterError, match="client_name"):
        pw.init(backend="ray", hosts=1, client_name="me")
    with pytest.raises(pw.errors.ClusterError, match=r"hosts=3 \(the service has 2\)"):
        pw.init(backend="ray", address=island_service.address, service=island_service.name, hosts=3)
    # An address naming another Ray cluster than the one this process joined was ignored: the
    # service was looked for, and hosts started, in the one joined.
    elsewhere = "127.0.0.1:1"
    for call in (
        lambda: pw.init(backend="ray", address=elsewhere, service=island_service.name),
        lambda: pw.init(backend="ray", address=elsewhere, hosts=1),
        lambda: pw.serve("never-started", hosts=1, address=elsewhere),
    ):
        with pytest.raises(
            pw.errors.ClusterError, match=r"names another Ray cluster .* call ray.shutdown\(\) first"
        ):
            call()
    # The hosts' shape given is checked against the service's, defaults told apart from values
    # given (platform="gpu" and devices_per_host=1 were taken silently), and a client cannot
    # decide how the service's lost islands go.
    for given, said in (
        ({"platform": "gpu"}, r"platform='gpu' \(the service's hosts are 'cpu'\)"),
        ({"devices_per_host": 1}, r"devices_per_host=1 \(the service has 2\)"),
        ({"replace_lost_hosts": False}, r"replace_lost_hosts=False \(the service rebuilds its lost islands"),
    ):
        with pytest.raises(pw.errors.ClusterError, match=said + ".*Leave them out to take the service's"):
            pw.init(backend="ray", address=island_service.address, service=island_service.name, **given)
    with pytest.raises(pw.errors.ClusterError, match="already running"):
        pw.serve(island_service.name, hosts=1)
    for bad in (0, -1.0, True, "30"):
        with pytest.raises(
            pw.errors.ClusterError, match=rf"silent_client_timeout must be None or .* got {bad!r}"
        ):
            pw.serve("never-started", hosts=1, silent_client_timeout=bad)
    started = time.monotonic()
    for option, bad, said in (
        ("backpressure_timeout", "x", "backpressure_timeout must be None"),
        ("max_in_flight", 0, "max_in_flight must be an int >= 1"),
        ("starvation_limit", -1, "starvation_limit must be an int >= 0"),
        ("platform", "tpu", "platform must be 'cpu' or 'gpu'"),
        ("replace_lost_hosts", "no", "replace_lost_hosts must be True or False"),
        ("address", 10001, "address must be None or a Ray address string"),
    ):
        with pytest.raises(pw.errors.ClusterError, match=said):
            pw.serve("never-started", hosts=1, **{option: bad})
    # More hosts than the Ray cluster has CPUs for: refused at once, not after placement's timeout.
    cpus = int(ray_cluster.cluster_resources()["CPU"])
    with pytest.raises(pw.errors.ClusterError, match=rf"{cpus + 1} hosts ask Ray for a logical CPU each"):
        pw.serve("never-started", hosts=cpus + 1)
    assert time.monotonic() - started < 10
    pw.init(backend="ray", address=island_service.address, service=island_service.name, client_name="me")
    out = _join_in_subprocess(island_service, "me")  # names are how pw.share finds a client
    assert "REFUSED" in out and "named 'me' is connected already" in out, out
    pw.shutdown()


def test_init_again_in_a_joined_process_checks_the_hosts_shape_given_and_the_service_again(
    joined, island_service, monkeypatch
):
    """A joined process's pw.init with the same join: the shape given is checked as a first join checks
    it (devices_per_host=1 and platform='cpu' compared equal to the defaults and were taken; hosts=2 was
    "other arguments"), and a service that dropped this process is said so, not its old cluster returned."""
    join = {"backend": "ray", "address": island_service.address, "service": island_service.name}
    join["client_name"] = "me"
    shape = {"hosts": 2, "devices_per_host": 2, "islands": 1, "platform": "cpu", "replace_lost_hosts": True}
    assert pw.init(**join, **shape) is joined  # the service's shape given: the same cluster
    assert pw.init(**join) is joined
    for given, said in (
        ({"devices_per_host": 1}, r"devices_per_host=1 \(the service has 2\)"),
        ({"hosts": 4, "islands": 2}, r"hosts=4 \(the service has 2\), islands=2 \(the service has 1\)"),
        ({"replace_lost_hosts": False}, r"replace_lost_hosts=False \(the service rebuilds"),
        ({"islands": [[0, 1, 2, 3]]}, r"islands=\[\[0, 1, 2, 3\]\] \(the Ray backend takes None or a number"),
    ):
        with pytest.raises(pw.errors.ClusterError, match=said + r".*Leave them out .*stays joined"):
            pw.init(**join, **given)
    monkeypatch.setitem(joined.backend.shape, "platform", "gpu")  # as a service of GPU hosts answers
    with pytest.raises(pw.errors.ClusterError, match=r"platform='cpu' \(the service's hosts are 'gpu'\)"):
        pw.init(**join, platform="cpu")
    with pytest.raises(pw.errors.ClusterError, match="is running"):  # another join: another cluster
        pw.init(**{**join, "client_name": "someone-else"})
    monkeypatch.undo()
    step = pw.jit(lambda v: v * 2, devices=pw.devices(mesh={"x": 2}))
    np.testing.assert_array_equal(step(jnp.arange(2.0)).result(timeout=60), np.arange(2.0) * 2)
    # The service dropped this process: its health answer for a client it does not hold (to this
    # thread's question only: the client's own health checks go on as they were).
    real, me = joined.backend.service, threading.get_ident()

    class Dropping:
        def __getattr__(self, name):
            if name == "health" and threading.get_ident() == me:
                return types.SimpleNamespace(remote=lambda client_id: real.health.remote(10**6))
            return getattr(real, name)

    monkeypatch.setattr(joined.backend, "service", Dropping())
    with pytest.raises(
        pw.errors.ClusterError, match=r"dropped this process \(it is not joined.*pw\.shutdown\(\) first"
    ):
        pw.init(**join)


def test_replace_lost_hosts_true_given_against_a_service_that_does_not_rebuild_is_refused(
    island_service, monkeypatch
):
    """A bool default cannot be told from a True given: pw.init's sentinel default tells them apart.

    The island service's answer to the join says what one started with
    pw.serve(replace_lost_hosts=False) says (starting such a service costs seconds).
    """
    from pathways_jax._src.backends import service_client

    real_join = service_client.join

    def join_without_rebuilding(*args):
        actor, token, joined = real_join(*args)
        assert joined["replace_lost_hosts"] is True  # the fixture's own, edited below
        return actor, token, {**joined, "replace_lost_hosts": False}

    monkeypatch.setattr(service_client, "join", join_without_rebuilding)
    join = {"backend": "ray", "address": island_service.address, "service": island_service.name}
    with pytest.raises(
        pw.errors.ClusterError,
        match=r"replace_lost_hosts=True \(the service does not rebuild lost islands: "
        r"pw.serve\(replace_lost_hosts=False\) started it.*start the service with "
        r"pw.serve\(replace_lost_hosts=True\)\)\. Leave them out to take the service's",
    ):
        pw.init(**join, replace_lost_hosts=True)
    # Left out (the documented default, True) or given as the service has it: joined.
    for given in ({}, {"replace_lost_hosts": False}):
        cluster = pw.init(**join, **given)
        assert pw.init(**join, **given) is cluster  # the same arguments: the same cluster
        assert len(cluster.devices) == 4
        pw.shutdown()
    pw.init()  # the local backend
    with pytest.raises(pw.errors.ClusterError, match="controller service"):
        pw.share(pw.jit(lambda v: v * 2, devices=pw.devices(mesh={"x": 1}))(jnp.ones(2)))


def test_service_handle_arguments_of_the_wrong_kind_are_refused_saying_what_was_expected(
    joined, island_service
):
    # They reached Ray as they came: a ValueError from deep inside it ("invalid literal for int()"),
    # a TypeError ("expected bytes, int found"), or "no controller service named None".
    for bad in ("30", -1, float("nan"), True):
        with pytest.raises(
            pw.errors.ClusterError, match=r"Service\.stats\(timeout=\.\.\.\) must be None .* got"
        ):
            island_service.stats(timeout=bad)
    with pytest.raises(pw.errors.ClusterError, match=r"Service\.host_stats\(timeout=\.\.\.\) must be"):
        island_service.host_stats(timeout="30")
    with pytest.raises(pw.errors.ClusterError, match=r"^host_stats\(timeout=\.\.\.\) must be None"):
        joined.backend.host_stats(timeout="30")
    with pytest.raises(pw.errors.ClusterError, match=r"Service\.stop\(timeout=\.\.\.\) must be"):
        pw.Service("not-stopped", island_service.address, None).stop(timeout="30")
    for name in (5, "", None):
        with pytest.raises(
            pw.errors.ClusterError, match=rf"a service's name must be a non-empty string, got {name!r}"
        ):
            pw.service(name)
    with pytest.raises(
        pw.errors.ClusterError, match="address must be None or a Ray address string, got 10001"
    ):
        pw.service(island_service.name, address=10001)
    assert island_service.stats(timeout=30)["name"] == island_service.name


def test_hosts_whose_cpus_others_hold_are_refused_in_seconds_saying_what_is_free(
    island_service, ray_cluster, monkeypatch
):
    """The cluster has the CPUs, but the island service's hosts hold some: a service (or pw.init)
    asking for more than are free is refused once none came free for a grace period, naming
    what it needs and what is free, not after placement's 120 s timeout."""

    total = int(ray_cluster.cluster_resources()["CPU"])
    free = total - 2  # the island service's 2 hosts hold the rest
    assert wait_for(lambda: ray_cluster.available_resources().get("CPU", 0) == free, timeout=10)
    said = rf"they need {free + 1} CPU \(the cluster has {total}, {free} of them free\)"
    # The grace (10 s by default) is the starter's PATHWAYS_JAX_ROOM_GRACE_S: the service's actor,
    # which places the hosts, takes it from this process. Not a number of seconds: refused first.
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("PATHWAYS_JAX_ROOM_GRACE_S", bad)
        with pytest.raises(pw.errors.ClusterError, match=rf"PATHWAYS_JAX_ROOM_GRACE_S must be .*'{bad}'"):
            pw.serve("never-placed", hosts=free + 1)
    monkeypatch.setenv("PATHWAYS_JAX_ROOM_GRACE_S", "1.5")
    started = time.monotonic()
    with pytest.raises(pw.errors.ClusterError, match=said + r", and no more came free for 1.5s"):
        pw.serve("never-placed", hosts=free + 1)
    assert time.monotonic() - started < 1.5 + 15
    with pytest.raises(pw.errors.ClusterError, match="no controller service named 'never-placed'"):
        pw.service("never-placed")
    monkeypatch.setenv("PATHWAYS_JAX_ROOM_GRACE_S", "0.5")  # this process places pw.init's hosts itself
    started = time.monotonic()
    with pytest.raises(pw.errors.ClusterError, match=said + r", and no more came free for 0.5s"):
        pw.init(backend="ray", address=island_service.address, hosts=free + 1)
    assert time.monotonic() - started < 10
    # Nothing of either was left holding CPUs; the service serves on.
    assert wait_for(lambda: ray_cluster.available_resources().get("CPU", 0) == free, timeout=10)
    assert island_service.stats()["lost"] == {}


def test_a_join_interrupted_as_the_service_admits_it_leaves_no_client_behind(
    island_service, ray_cluster, monkeypatch
):
    """Ctrl-C while pw.init waits for the service's answer, once the service admitted the process:
    the admitted client goes at once, so pw.init again under the same name joins (it was refused
    for silent_client_timeout, 30 s, or for ever with None)."""
    real_get = ray_cluster.get
    interrupted = []

    def get(*args, **kwargs):
        got = real_get(*args, **kwargs)
        if not interrupted and isinstance(got, dict) and "client" in got:
            interrupted.append(got["client"])
            raise KeyboardInterrupt  # as the service's answer came
        return got

    monkeypatch.setattr(ray_cluster, "get", get)
    with pytest.raises(KeyboardInterrupt):
        pw.init(backend="ray", address=island_service.address, service=island_service.name, client_name="nb")
    monkeypatch.setattr(ray_cluster, "get", real_get)
    admitted = island_service.stats()["clients"]
    assert wait_for(lambda: not island_service.stats()["clients"][interrupted[0]]["alive"], timeout=10), (
        admitted
    )
    pw.init(backend="ray", address=island_service.address, service=island_service.name, client_name="nb")
    f = pw.jit(lambda v: v + 1, devices=pw.devices(mesh={"x": 1}))
    np.testing.assert_array_equal(f(jnp.arange(3.0)).result(timeout=60), np.arange(3.0) + 1)


def test_a_service_start_cut_short_by_ctrl_c_leaves_no_service(ray_cluster, monkeypatch):
    """The service's actor is detached: a pw.serve (or `python -m pathways_jax serve`) interrupted
    while it waits for the hosts must end it, or it serves on unseen, holding its hosts' CPUs."""
    real_get = ray_cluster.get

    def get(*args, **kwargs):
        got = real_get(*args, **kwargs)
        if isinstance(got, dict) and "incarnation" in got:  # the service's word that it is ready
            raise KeyboardInterrupt
        return got

    cpus = ray_cluster.available_resources().get("CPU", 0)
    monkeypatch.setattr(ray_cluster, "get", get)
    with pytest.raises(KeyboardInterrupt):
        pw.serve("test-interrupted", hosts=1)
    monkeypatch.setattr(ray_cluster, "get", real_get)

    def gone() -> bool:
        try:
            pw.service("test-interrupted")
        except pw.errors.ClusterError:
            return True
        return False

    assert wait_for(gone, timeout=10)
    assert wait_for(lambda: ray_cluster.available_resources().get("CPU", 0) == cpus, timeout=10)


def test_a_service_started_without_ray_sizes_its_local_cluster_for_its_hosts(monkeypatch):
    """pw.serve with no Ray session starts one with a logical CPU for each host (the machine's count
    could not place more hosts: placement would wait for minutes and fail)."""
    from pathways_jax._src.backends import service_client

    started = {}

    class NoRay:
        def is_initialized(self) -> bool:
            return False

        def init(self, **kwargs) -> None:
            started.update(kwargs)

    monkeypatch.setattr(service_client, "import_ray", NoRay)
    service_client.connect(None, start=True, hosts=(os.cpu_count() or 1) + 3)
    assert started["address"] == "local" and started["num_cpus"] == (os.cpu_count() or 1) + 3


def _join_in_subprocess(svc: pw.Service, name: str | None = None) -> str:
    code = (
        "import pathways_jax as pw\n"
        "try:\n"
        f"    pw.init(backend='ray', address={svc.address!r}, service={svc.name!r}, client_name={name!r})\n"
        "    print('JOINED')\n"
        "except pw.errors.ClusterError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout


def test_admission_max_clients_and_memory_budget(ray_cluster):
    svc = pw.serve(
        "test-admission",
        hosts=1,
        devices_per_host=1,
        max_clients=1,
        memory_budget=4096,
        backpressure_timeout=1.0,
    )
    try:
        pw.init(backend="ray", address=svc.address, service=svc.name, client_name="first")
        out = _join_in_subprocess(svc)
        assert "REFUSED" in out and "admits 1 client processes" in out, out
        s = pw.devices(mesh={"x": 1})
        fill = pw.jit(lambda v: jnp.zeros((1024,), jnp.float32) + v, devices=s)
        held = fill(jnp.float32(1))  # 4096 bytes: the whole budget
        np.testing.assert_array_equal(held.result(timeout=60), np.ones(1024))
        with pytest.raises(pw.errors.BackPressureTimeout, match="exceed the service's whole memory budget"):
            pw.jit(lambda v: jnp.zeros((2048,), jnp.float32) + v, devices=s)(jnp.float32(1)).result(
                timeout=60
            )
        small = pw.jit(lambda v: v + 1, devices=s)
        with pytest.raises(pw.errors.BackPressureTimeout, match="waited"):
            small(jnp.float32(1)).result(timeout=60)  # the budget is full: it waits 1 s, then fails
        del held
        gc.collect()
        pw.stats()
        assert wait_for(lambda: svc.stats()["bytes_held"] == 0, timeout=10), svc.stats()["bytes_held"]
        assert float(small(jnp.float32(1)).result(timeout=60)) == 2.0
        pw.shutdown()
        # Room again once the first one left: this process joins again (another process would too).
        pw.init(backend="ray", address=svc.address, service=svc.name, client_name="second")
        assert [r["name"] for r in svc.stats()["clients"].values() if r["alive"]] == ["second"]
    finally:
        pw.shutdown()
        svc.stop()


def test_command_line_starts_reports_and_stops_a_service(ray_cluster, capsys):
    # The service is started by a command of its own (its process ends; the service lives on);
    # stats and stop are the same command line run in this process (a Python start costs seconds).
    from pathways_jax.__main__ import main

    address = ray_cluster.get_runtime_context().gcs_address
    where = ["--address", address, "--name", "test-cli"]
    started = subprocess.run(
        [sys.executable, "-m", "pathways_jax", *where, "serve", "--hosts", "1", "--scheduler", "fair"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert started.returncode == 0, started.stderr
    assert "service='test-cli'" in started.stdout

    def cli(*args: str) -> tuple[int, str, str]:
        code = main([*where, *args])
        said = capsys.readouterr()
        return code, said.out, said.err

    # The service outlived the command that started it: a client joins it.
    pw.init(backend="ray", address=address, service="test-cli", client_name="cli-user")
    try:
        out = pw.jit(lambda v: v * 2 + 1, devices=pw.devices(mesh={"x": 1}))(jnp.arange(3.0))
        np.testing.assert_array_equal(out.result(timeout=60), np.arange(3.0) * 2 + 1)
        code, stats, err = cli("stats")
        assert code == 0, err
        rows = json.loads(stats)["clients"].values()
        assert [r["runs"] for r in rows if r["name"] == "cli-user"] == [1]
        assert json.loads(stats)["scheduler"] == "fair"
    finally:
        pw.shutdown()
    code, stopped, err = cli("stop")
    assert code == 0 and "stopped" in stopped, err
    code, _, err = cli("stats")
    assert code == 1 and "no controller service named 'test-cli'" in err


def test_command_line_arguments_out_of_range_are_refused_not_replaced(capsys):
    from pathways_jax.__main__ import main

    assert main(["--name", "never-started", "serve", "--hosts", "1", "--window", "0"]) == 1
    assert "window must be an int >= 1, got 0" in capsys.readouterr().err


def _slow(v):
    return jax.lax.fori_loop(0, 30000, lambda i, u: jnp.sin(u) + 1.0, v)


def test_a_client_leaving_with_a_long_queue_leaves_at_once_and_the_service_keeps_nothing_of_it(
    joined, island_service
):
    # A process that ends (sys.exit, its script's end: the exit hook) or calls pw.shutdown()
    # with 1,000 runs queued: they were sent one window at a time for as long as the hosts took
    # to compute the runs ahead of them, only to be dropped by the service: up to 60s to exit.
    slow = pw.jit(_slow, devices=pw.devices(mesh={"x": 1}))
    np.testing.assert_allclose(
        slow(jnp.ones(256)).result(timeout=60), jax.jit(_slow)(jnp.ones(256)), rtol=1e-5
    )
    queued = [slow(jnp.ones(256)) for _ in range(1000)]
    me = joined.backend.client_id
    runs_before = island_service.stats()["clients"][me]["runs"]
    started = time.monotonic()
    pw.shutdown()
    assert time.monotonic() - started < 5.0
    # Sent or not, a run's value went with this process's leave; the service and its hosts serve
    # on (the Ray backend's 'the cluster was shut down and its Ray hosts with it' is wrong here).
    for run in (queued[0], queued[-1]):
        with pytest.raises(pw.errors.ClusterError, match="this process left the controller service"):
            run.result(timeout=10)

    def left() -> bool:
        row = island_service.stats()["clients"][me]
        return (
            not row["alive"] and row["queued"] == row["in_flight"] == row["bytes_held"] == row["values"] == 0
        )

    assert wait_for(left, timeout=10), island_service.stats()["clients"][me]
    assert island_service.stats()["clients"][me]["runs"] - runs_before < 100  # the rest were never run


def test_a_client_leaves_a_stopped_service_in_the_time_it_gives_the_leave(
    joined, island_service, ray_cluster, monkeypatch
):
    # A service that answers nothing (stopped, hung): pw.shutdown() (and the exit hook) waited for
    # the health check in flight, 10s, after the leave's own wait. The token's end tells the
    # service once it runs again.
    from pathways_jax._src.backends import service_client

    monkeypatch.setattr(service_client, "_LEAVE_TIMEOUT_S", 0.5)
    f = pw.jit(lambda v: v * 3, devices=pw.devices(mesh={"x": 1}))
    np.testing.assert_array_equal(f(jnp.arange(3.0)).result(timeout=60), np.arange(3.0) * 3)
    me = joined.backend.client_id
    pid = ray_cluster.get(island_service.actor.info.remote(), timeout=30)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:

        def stopped() -> bool:  # half a second unanswered: this process's health check (4 a second) waits too
            try:
                ray_cluster.get(island_service.actor.health.remote(), timeout=0.5)
            except ray_cluster.exceptions.GetTimeoutError:
                return True
            return False

        assert wait_for(stopped, timeout=10)
        started = time.monotonic()
        pw.shutdown()
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < 3.0, took
    assert wait_for(lambda: not island_service.stats()["clients"][me]["alive"], timeout=10)


def test_ctrl_c_as_pw_shutdown_waits_for_the_leave_still_leaves_the_service(
    joined, island_service, ray_cluster, monkeypatch
):
    # The interrupt cut the close short: the token actor lived on and the channel kept its
    # heartbeat, so the service kept the process (and its name: pw.init again was refused).
    f = pw.jit(lambda v: v - 1, devices=pw.devices(mesh={"x": 1}))
    np.testing.assert_array_equal(f(jnp.arange(3.0)).result(timeout=60), np.arange(3.0) - 1)
    me = joined.backend.client_id
    service, leave, real_get = joined.backend.service, object(), ray_cluster.get

    class Service:  # the service's actor, whose leave is interrupted as it is waited for
        def __getattr__(self, method):
            return getattr(service, method)

    Service.leave = types.SimpleNamespace(remote=lambda *args: leave)

    def get(ref, *args, **kwargs):
        if ref is leave:
            raise KeyboardInterrupt
        return real_get(ref, *args, **kwargs)

    monkeypatch.setattr(joined.backend, "service", Service())
    monkeypatch.setattr(ray_cluster, "get", get)
    with pytest.raises(KeyboardInterrupt):
        pw.shutdown()
    monkeypatch.setattr(ray_cluster, "get", real_get)
    assert wait_for(lambda: not island_service.stats()["clients"][me]["alive"], timeout=10)
    pw.init(backend="ray", address=island_service.address, service=island_service.name, client_name="me")
    f = pw.jit(lambda v: v - 1, devices=pw.devices(mesh={"x": 1}))
    np.testing.assert_array_equal(f(jnp.arange(3.0)).result(timeout=60), np.arange(3.0) - 1)


def test_a_client_whose_service_dies_gets_clear_errors_and_shuts_down(ray_cluster):
    svc = pw.serve("test-dies", hosts=1)
    pw.init(backend="ray", address=svc.address, service=svc.name)
    try:
        step = pw.jit(lambda v: v + 1, devices=pw.devices(mesh={"x": 1}))
        kept = step(jnp.float32(1))
        assert float(kept.result(timeout=60)) == 2.0
        stale = pw.share(kept)  # kept past the service's death, as a pickled handle would be
        slow = pw.jit(_slow, devices=pw.devices(mesh={"x": 1}))
        queued = [slow(jnp.ones(256)) for _ in range(40)]  # the last still queued as the service dies
        ray_cluster.kill(svc.actor)  # the service and, with it, its hosts

        def gone() -> bool:  # a kill is asynchronous: a call may still be served just after it
            try:
                ray_cluster.get(svc.actor.info.remote(), timeout=10)
            except ray_cluster.exceptions.RayActorError:
                return True
            return False

        assert wait_for(gone, timeout=60)
        # As the README says: ClusterError (not a failed program's error), saying what to do.
        for future in (queued[-1], step(jnp.float32(1))):
            with pytest.raises(
                pw.errors.ClusterError, match=r"service 'test-dies' is gone.*start the service again"
            ):
                future.result(timeout=60)
        with pytest.raises(
            pw.errors.ClusterError, match=r"pw\.share: the controller service 'test-dies' is gone"
        ):
            pw.share(kept, client="other")
        with pytest.raises(pw.errors.ClusterError, match=r"pw\.share: .*service 'test-dies' is gone"):
            pw.share(queued[-1], client="other")  # a value whose run the service's death failed
        with pytest.raises(pw.errors.ClusterError, match=r"pw\.share: .*service 'test-dies' is gone"):
            pw.share(kept)  # a handle for this process only: nothing asked of the service, made all the same
        # A client's own view of it says so too, and its handle: not Ray's exception.
        for ask in (pw.stats, svc.stats, svc.host_stats, pw.cluster().backend.host_stats):
            with pytest.raises(pw.errors.ClusterError, match="controller service 'test-dies' is gone"):
                ask()
        # pw.init again with the same arguments: refused saying what to do, not the dead join returned.
        with pytest.raises(
            pw.errors.ClusterError,
            match=r"pw\.init\(service='test-dies'\): the controller service 'test-dies' is gone .*joined it "
            r"before: call pw\.shutdown\(\) first",
        ):
            pw.init(backend="ray", address=svc.address, service=svc.name)
    finally:
        started = time.monotonic()
        pw.shutdown()
        assert time.monotonic() - started < 15
    with pytest.raises(pw.errors.ClusterError, match="no controller service"):
        pw.service("test-dies")
    # Started again under its name (a new channel, a new key): a client joins it and runs exactly.
    again = pw.serve("test-dies", hosts=1)
    try:
        pw.init(backend="ray", address=again.address, service=again.name)
        step = pw.jit(lambda v: v * 2 + 1, devices=pw.devices(mesh={"x": 1}))
        fresh = step(jnp.arange(4.0))
        np.testing.assert_array_equal(fresh.result(timeout=60), np.arange(4.0) * 2 + 1)
        # A handle of the service's first run: its client and value numbers are this run's own
        # again (this process's first value, of client 1): refused, not read as that value.
        with pytest.raises(pw.errors.AccessError, match="earlier run of controller service 'test-dies'"):
            pw.receive(stale).result(timeout=60)
        pw.shutdown()
    finally:
        again.stop()


def test_a_host_lost_under_the_service_fails_its_runs_and_the_next_call_moves(ray_cluster):
    svc = pw.serve("test-loss", hosts=2, devices_per_host=1)  # two islands of one host
    cluster = pw.init(backend="ray", address=svc.address, service=svc.name)
    try:
        s = pw.devices(mesh={"x": 1}, island=0)
        slow = pw.jit(lambda v: jax.lax.fori_loop(0, 3000, lambda i, u: jnp.sin(u) + 1.0, v), devices=s)
        want = jax.jit(lambda v: jax.lax.fori_loop(0, 3000, lambda i, u: jnp.sin(u) + 1.0, v))(jnp.ones(256))
        np.testing.assert_allclose(slow(jnp.ones(256)).result(timeout=60), want, rtol=1e-5)
        pending = [slow(jnp.ones(256)) for _ in range(8)]
        os.kill(cluster.backend.info[0]["pid"], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(pw.errors.HostLostError, match="host 0"):
            for f in pending:
                f.result(timeout=30)
        assert time.monotonic() - killed < 5.0 + 1.0
        # The slice moved to the other island: the next call runs there, lowered again, not traced again.
        assert wait_for(lambda: s.island == 1, timeout=10)
        np.testing.assert_allclose(slow(jnp.ones(256)).result(timeout=60), want, rtol=1e-5)
        # The service rebuilds island 0 on a new host, and this process hears of it.
        assert wait_for(lambda: 0 not in cluster.backend.lost, timeout=60)
        assert svc.stats()["lost"] == {}
    finally:
        pw.shutdown()
        svc.stop()


def test_a_client_that_stops_reading_waits_in_a_bounded_outbox_others_are_served_then_it_is_dropped(
    ray_cluster,
):
    """A slow consumer: a client whose channel stops taking answers (its queue at the high-water
    mark) never makes the service wait; its answers wait in its outbox, the other clients are
    answered at once, and after ``stalled_client_timeout`` it is dropped as if it had died."""
    import queue
    import threading

    import ray

    from pathways_jax._src import wire
    from pathways_jax._src.backends.channel_link import answer_value
    from pathways_jax._src.backends.service_client import NAMESPACE, Token, versions

    svc = pw.serve("test-slow-reader", hosts=1, devices_per_host=1, stalled_client_timeout=4.0)
    actor = ray.get_actor(svc.name, namespace=NAMESPACE)
    tokens: list = []
    peers: list = []
    stuck = threading.Event()
    try:

        def join(name: str, **kwargs) -> wire.Peer:
            token = ray.remote(Token).options(num_cpus=0).remote()
            tokens.append(token)
            x64 = bool(jax.config.read("jax_enable_x64"))
            end = ray.get(
                actor.join.remote(name, os.getpid(), "test", token, x64, versions=versions()), timeout=60
            )["channel"]
            peer = wire.Peer(end.address, end.key, identity=end.identity, heartbeat=None, **kwargs)
            peers.append(peer)
            return peer

        def share(seq: int) -> wire.Submit:  # answered at once by the service (a Refused: no such value)
            return wire.Submit(seq, [wire.Routed(-1, wire.Share(seq, "nobody"))], None)

        # The slow reader's handler never returns: its channel stops reading, its socket fills.
        slow = join("slow", on_message=lambda received: stuck.wait(), hwm=1, queue_size=1)
        answers: queue.Queue = queue.Queue()
        fast = join("fast", on_message=answers.put)
        flood = 25_000  # more answers than the service's socket and the kernel buffer hold
        for first in range(0, flood, 1000):
            slow.send_many([share(seq) for seq in range(first, first + 1000)], timeout=30)

        def waiting() -> int:
            return _client_rows(svc)["slow"]["answers_waiting"]

        assert wait_for(lambda: waiting() > 0, timeout=60), _client_rows(svc)["slow"]
        # The loop never waits for the slow reader: the other client is answered at once.
        latencies = []
        for seq in range(20):
            started = time.monotonic()
            fast.send(share(seq))
            got = answers.get(timeout=30)
            latencies.append(time.monotonic() - started)
            assert got.body.batch == seq
            assert "not on the hosts" in str(answer_value(got.body.answers[0]))
        assert max(latencies) < 1.0, latencies
        assert waiting() <= flood  # bounded: what it owes, no more
        # The slow reader is dropped once it took nothing for stalled_client_timeout.
        assert wait_for(lambda: not _client_rows(svc)["slow"]["alive"], timeout=30), _client_rows(svc)["slow"]
        row = _client_rows(svc)["slow"]
        assert "stopped reading" in row["gone"] and row["answers_waiting"] == 0, row
        fast.send(share(20))  # (a client's batches are numbered: the next one)
        assert answers.get(timeout=30).body.batch == 20
        assert _client_rows(svc)["fast"]["alive"]
    finally:
        stuck.set()
        for peer in peers:
            peer.close()
        for token in tokens:
            ray.kill(token)
        svc.stop()


def test_a_stopped_client_is_dropped_by_its_silence_and_then_told_so_a_quiet_one_stays(ray_cluster, tmp_path):
    """A client process stopped by SIGSTOP (its Ray token actor lives on: Ray sees nothing) is
    found by its channel's silence and dropped, its values freed; resumed, its next program
    fails with a named error saying so instead of waiting forever. A client that only
    heartbeats is kept."""
    import ray

    from pathways_jax._src import wire
    from pathways_jax._src.backends.service_client import NAMESPACE, Token, versions

    # The client process starts first (Python and JAX take seconds) and joins once the service runs.
    group = Clients((ray_cluster.get_runtime_context().gcs_address, "test-silent"), tmp_path)
    proc = group.start("sleeper", "pause", "4")
    try:
        svc = pw.serve("test-silent", hosts=1, devices_per_host=1, silent_client_timeout=2.0)
    except BaseException:
        group.close()  # it stops waiting for the service
        raise
    actor = ray.get_actor(svc.name, namespace=NAMESPACE)
    token = ray.remote(Token).options(num_cpus=0).remote()
    quiet = None
    try:
        x64 = bool(jax.config.read("jax_enable_x64"))
        end = ray.get(
            actor.join.remote("quiet", os.getpid(), "test", token, x64, versions=versions()), timeout=60
        )["channel"]
        # Says nothing but its heartbeat (as every client's channel does, from its own thread).
        quiet = wire.Peer(end.address, end.key, identity=end.identity, heartbeat=0.3)
        group.wait_state("sleeper", "holding")
        assert _client_rows(svc)["sleeper"]["bytes_held"] >= 4 * 256 * 4
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            assert wait_for(lambda: not _client_rows(svc)["sleeper"]["alive"], timeout=30), _client_rows(svc)
            found_in = time.monotonic() - stopped_at
            row = _client_rows(svc)["sleeper"]
            assert "not even a heartbeat" in row["gone"] and row["bytes_held"] == 0, row
            assert wait_for(lambda: sum(h["values"] for h in svc.host_stats().values()) == 0, timeout=15)
            # Silence counts from the last heartbeat, up to a second (and a tick) before the stop.
            assert 0.5 <= found_in < 10.0, found_in
        finally:
            (tmp_path / "resume").write_text("")
            os.kill(proc.pid, signal.SIGCONT)
        got = group.wait_state("sleeper", "refused", "served", timeout=60)
        assert got["state"] == "refused", got
        assert got["error"] == "ClusterError", got  # the service's word, not a failed program's
        assert "dropped this process: its channel sent nothing" in got["message"], got
        assert "is gone" not in got["message"], got  # the service runs on
        assert got["seconds"] < 10.0, got
        # The quiet client outlived several timeouts by its heartbeats alone, and is still served.
        row = _client_rows(svc)["quiet"]
        assert row["alive"], row
        quiet.send(wire.Submit(0, [wire.Routed(-1, wire.Share(0, "nobody"))], None))
        answer = quiet.recv(timeout=30)
        assert answer is not None and answer.body.batch == 0
    finally:
        if quiet is not None:
            quiet.close()
        group.close()
        ray.kill(token)
        svc.stop()
