"""The controller service (pw.serve): client processes sharing one controller's hosts.

Client processes are subprocesses running tests/service_client.py; this
process starts the local Ray cluster and the services, and joins one itself
where a test needs a client in-process. Results are compared with numpy /
plain ``jax.jit`` on the same inputs.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

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
    """Client subprocesses of one test, reporting through JSON files in ``folder``."""

    def __init__(self, svc: pw.Service, folder: pathlib.Path):
        self.svc = svc
        self.folder = folder
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, mode: str, *args: str) -> subprocess.Popen:
        with (self.folder / f"{name}.log").open("w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, CLIENT, self.svc.address, self.svc.name, name, str(self.folder), mode, *args],
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


def test_sigkilled_client_is_cleaned_up_and_the_other_goes_on(clients):
    svc = clients.svc
    baseline = sum(h["values"] for h in svc.host_stats().values())
    victim = clients.start("victim", "hold", "20")
    clients.start("survivor", "busy", "1.0")
    clients.wait_state("victim", "holding")
    clients.wait_state("survivor", "running")
    assert wait_for(lambda: sum(h["values"] for h in svc.host_stats().values()) >= baseline + 20, timeout=30)
    assert _client_rows(svc)["victim"]["bytes_held"] >= 20 * 256 * 4
    before = clients.report("survivor")["runs"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    killed_at = time.monotonic()

    def cleaned() -> bool:
        row = _client_rows(svc)["victim"]
        return not row["alive"] and row["bytes_held"] == 0 and row["queued"] == 0 and row["slices"] == {}

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
