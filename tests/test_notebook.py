"""Notebook views: Cluster, VirtualSlice, Program and Future render valid HTML of their state."""

import threading
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw
from pathways_jax._src.runtime import clusters


def _parse(page: str) -> tuple[ET.Element, str]:
    root = ET.fromstring(page)  # well-formed: every tag closed, every text escaped
    return root, " ".join("".join(root.itertext()).split())


def _rows(root: ET.Element) -> list[list[str]]:
    return [["".join(td.itertext()) for td in tr.iter("td")] for tr in root.iter("tr")]


def test_cluster_view_shows_islands_devices_and_live_slices(monkeypatch):
    cl = pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    root, text = _parse(cl._repr_html_())
    assert "Cluster (local backend, running): 2 islands, 8 devices, 2 live slices" in text
    assert "island 0" in text and "island 1" in text
    rows = {r[0]: r for r in _rows(root) if r and r[0].isdigit()}  # device rows: id first
    assert sorted(map(int, rows)) == list(range(8))
    for d in a.devices:
        assert rows[str(d.id)][3] == f"#{a.id}" and rows[str(d.id)][4] == "1"
    for d in b.devices:
        assert rows[str(d.id)][3] == f"#{b.id}"
    slice_rows = [r for r in _rows(root) if r and r[0].startswith("#")]
    assert [r[0] for r in slice_rows] == [f"#{a.id}", f"#{b.id}"]
    assert slice_rows[0][1:] == ["{x: 4}", "0", ",".join(str(d.id) for d in a.devices), "shared"]

    b.release()
    del b
    _, text = _parse(cl._repr_html_())
    assert "1 live slices" in text

    # Utilisation and memory from pw.stats(), once the cluster has run work.
    stats = {
        "elapsed_s": 2.0,
        "scheduler": "fifo",
        "devices": {
            d.id: {"utilisation": d.id / 10, "bytes_in_use": 2048 * d.id, "budget": None} for d in cl.devices
        },
        "islands": {0: {"queued": 3, "in_flight": 1}, 1: {"queued": 0, "in_flight": 0}},
        "clients": {"alice": {"device_time_s": 1.5, "programs": 4, "failures": 0, "queued": 3}},
    }
    monkeypatch.setattr(pw, "stats", lambda: stats)
    assert "utilisation" not in _parse(cl._repr_html_())[1]  # no controller yet: no stats asked
    pw.jit(lambda v: v + 1, devices=a)(jnp.ones(4)).result(timeout=30)
    root, text = _parse(cl._repr_html_())
    assert "island 0 (hosts 0; 3 queued, 1 in flight)" in text
    device_rows = {r[0]: r for r in _rows(root) if r and r[0].isdigit()}
    assert device_rows["3"][-2:] == ["6.0 KiB", "30%"]
    assert ["alice", "1.5", "0", "4", "3"] in _rows(root)
    assert ["scheduler", "fifo"] in _rows(root)
    monkeypatch.undo()
    pw.shutdown()
    assert "utilisation" not in _parse(cl._repr_html_())[1]  # a closed cluster: no stats, none started
    assert clusters._current is None


@pytest.mark.timeout(60)
def test_cluster_view_reads_the_real_stats():
    cl = pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 2}, island=1)
    pw.jit(lambda v: v * 2, devices=s)(jnp.ones(4)).result(timeout=30)
    root, text = _parse(cl._repr_html_())
    rows = {r[0]: r for r in _rows(root) if r and r[0].isdigit()}
    assert all(rows[str(d.id)][-1].endswith("%") for d in cl.devices)
    assert "clients (pw.stats())" in text and "default" in text


def test_slice_view_lays_devices_out_in_mesh_shape():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"data": 2, "model": 2}, island=1, exclusive=True)
    root, text = _parse(s._repr_html_())
    assert f"VirtualSlice #{s.id} mesh {{data: 2, model: 2}}, island 1, exclusive" in text
    grid = np.array([d.id for d in s.devices]).reshape(2, 2)
    assert _rows(root) == [[str(v) for v in row] for row in grid]
    s.release()
    assert "released" in _parse(s._repr_html_())[1]


def test_program_view_shows_its_graphs():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)
    f = pw.jit(lambda x: x * 2, devices=a)
    g = pw.jit(lambda x: x.sum(), devices=b)

    @pw.program
    def step(x):
        return g(f(x))

    _, text = _parse(step._repr_html_())
    assert f"pw.program step defined at {step.source_info}" in text and "not traced yet" in text
    step(jnp.ones(8)).result(timeout=30)
    _, text = _parse(step._repr_html_())
    assert "1 traced signatures, 1 lowered plans" in text
    graph = step.graph(jnp.ones(8))
    for node in graph.nodes:
        assert node.name in text
    assert "DCN transfer" in text and "v1 -> v2" in text


@pytest.mark.timeout(60)
def test_future_view_pending_ready_and_failed():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 1})
    gate = threading.Event()

    def wait_for_gate(x):
        assert gate.wait(30), "the test never opened the gate"
        return x

    @pw.jit(devices=s)
    def slow(x):
        return jax.pure_callback(wait_for_gate, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    def explode(x):
        raise ValueError("boom in the callback")

    @pw.jit(devices=s)
    def broken(x):
        return jax.pure_callback(explode, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    fut = slow(jnp.arange(3.0))
    _, text = _parse(fut._repr_html_())
    assert text.startswith("Future pending 3 float32 on slice"), text
    gate.set()
    fut.result(timeout=30)
    _, text = _parse(fut._repr_html_())
    assert text.startswith("Future ready 3 float32") and "[1. 2. 3.]" in text

    bad = broken(jnp.arange(3.0))
    with pytest.raises(pw.errors.ProgramFailedError):
        bad.result(timeout=30)
    _, text = _parse(bad._repr_html_())
    assert text.startswith("Future failed") and "boom in the callback" in text
