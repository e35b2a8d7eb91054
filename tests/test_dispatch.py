"""The dispatch hot path: chain fusion, caches, the last-call fast path, the benchmark."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, wait_for

import pathways_jax as pw

P = pw.P
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _chain(slice_, length):
    step = pw.jit(lambda x, k: jnp.sin(x) * k + 1.0, devices=slice_)

    def chained(x):
        outs = []
        for k in range(length):
            x = step(x, float(k + 1))
            outs.append(x)
        return x, outs[length // 2]

    return chained


def _reference(length):
    def ref(x):
        outs = []
        for k in range(length):
            x = jnp.sin(x) * (k + 1) + 1.0
            outs.append(x)
        return x, outs[length // 2]

    return jax.jit(ref)


@pytest.mark.parametrize("size", [1, 4])
def test_fused_chain_equals_unfused_and_plain_jit(size):
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": size})
    plain = pw.program(_chain(s, 16), fuse=False)
    fused = pw.program(_chain(s, 16), fuse=True)
    x = jnp.linspace(-1.0, 1.0, 8)
    got_plain, got_fused = plain(x), fused(x)
    for a, b in zip(got_plain, got_fused, strict=True):
        np.testing.assert_array_equal(np.asarray(a.result()), np.asarray(b.result()))
    assert_matches(got_fused, _reference(16)(x), rtol=1e-5)
    unfused_graph, fused_graph = plain.graph(x), fused.graph(x)
    assert len(unfused_graph.nodes) == 16
    assert [n.kind for n in fused_graph.nodes] == ["fused"]
    # The middle value is returned, so it is an output of the fused node.
    assert len(fused_graph.nodes[0].outputs) == 2
    pw.reset_counters()
    fused(x).__getitem__(0).result()
    assert pw.counters()["dispatches"] == 1


def _double(v):
    return v * 2


def _cut(a, b):
    return jnp.concatenate([a, b])[:3]


def test_nodes_xla_cannot_compile_fused_run_as_traced_with_a_warning(caplog):
    # Two data-sharded outputs concatenated and cut to 3 rows, replicated: XLA's SPMD
    # partitioner fails on the fused executable ("Expected f32[4,3], actual f32[3,3]"; the same
    # constraints under one jax.jit fail alike). It failed the call; its nodes compile apart.
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"data": 2})
    double = pw.jit(_double, devices=s, out_specs=pw.P("data"))
    cut = pw.jit(_cut, devices=s, out_specs=pw.P())

    @pw.program
    def prog(a, b):
        return cut(double(a), double(b))

    a, b = np.arange(6.0, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    want = jax.jit(_cut)(jax.jit(_double)(a), jax.jit(_double)(b))
    with caplog.at_level("WARNING"):
        got = prog(a, b)
    assert_matches(got, want)
    assert "could not compile its nodes fused" in caplog.text
    assert len(prog.graph(a, b).nodes) == 3  # as traced: what runs
    pw.reset_counters()
    assert_matches(prog(a * 2, b), jax.jit(_cut)(jax.jit(_double)(a * 2), jax.jit(_double)(b)))
    assert pw.counters()["traces"] == 0


def test_fusion_stops_at_slice_boundaries_and_keeps_transfers():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    fa = pw.jit(lambda v: v * 2.0, devices=a)
    fb = pw.jit(lambda v: v - 1.0, devices=b)

    def body(x):
        y = fa(fa(x))
        return fb(fb(y)), fa(y)

    plain, fused = pw.program(body, fuse=False), pw.program(body, fuse=True)
    x = jnp.arange(4.0)
    for got in (plain(x), fused(x)):
        assert_matches(got, jax.jit(lambda v: ((v * 4.0) - 2.0, v * 8.0))(x))
    graph = fused.graph(x)
    assert [(n.kind, n.slice) for n in graph.nodes] == [("fused", a), ("fused", b), ("jit", a)]
    assert [t.kind for t in graph.transfers] == ["dcn"]


def test_a_cached_call_does_no_tracing_lowering_or_compiling():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    chained = pw.program(_chain(s, 8), fuse=False)
    fused = pw.program(_chain(s, 8), fuse=True)
    x = jnp.ones(4)
    for prog in (chained, fused):
        out = prog(x)[0]
        out = prog(out)[0]  # futures in: the second signature
        out.result()
    pw.reset_counters()
    for prog in (chained, fused):
        out = prog(x)[0]
        for _ in range(5):
            out = prog(out)[0]
        out.result()
    counts = pw.counters()
    assert (counts["traces"], counts["lowerings"], counts["compiles"]) == (0, 0, 0)
    assert counts["runs"] == 12 and counts["dispatches"] == 6 * 8 + 6


def test_identical_nodes_compile_once():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    pw.reset_counters()
    pw.program(_chain(s, 32))(jnp.ones(3))[0].result()
    assert pw.counters()["compiles"] == 1


def test_the_last_call_fast_path_still_notices_released_slices():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    double = pw.jit(lambda v: v * 2.0, devices=s)
    out = double(jnp.ones(2))
    for _ in range(3):
        out = double(out)  # same future signature each time: the fast path
    np.testing.assert_array_equal(np.asarray(out.result()), [16.0, 16.0])
    s.release()
    with pytest.raises(pw.errors.PlacementError, match="released"):
        double(out)


def test_the_last_call_fast_path_follows_the_ambient_slice():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    add_one = jax.jit(lambda v: v + 1.0)
    add = pw.program(lambda v: add_one(v))  # a jit node: placed by the ambient slice
    with a:
        first = add(jnp.zeros(2))
        second = add(first)
    with b:
        third = add(second)
    assert second.slice is a and third.slice is b
    np.testing.assert_array_equal(np.asarray(third.result()), [3.0, 3.0])


def test_pw_jit_inside_a_plain_jax_transformation_behaves_as_jax_jit():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    square = pw.jit(lambda v: v * v, devices=s)
    square(jnp.ones(2)).result()  # the program path is cached first
    grad = jax.grad(lambda v: square(v).sum())(jnp.arange(3.0))
    np.testing.assert_allclose(np.asarray(grad), [0.0, 2.0, 4.0])
    # A program inside jax.jit runs as jax.jit would (traced into the caller's computation).
    out = jax.jit(pw.program(lambda v: v + 1, devices=s))(jnp.ones(2))
    assert isinstance(out, jax.Array)
    np.testing.assert_array_equal(np.asarray(out), [2.0, 2.0])


@pytest.mark.timeout(300)
def test_dispatch_benchmark_runs_in_quick_mode(tmp_path, ray_cluster):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # -W error: like the suite's own filterwarnings, a warning in the run fails it.
    script = str(ROOT / "benchmarks" / "dispatch.py")
    # Its Ray section joins the suite's Ray cluster (starting one costs seconds).
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            script,
            "--quick",
            "--sweep",
            f"--ray_address={address}",
            f"--out={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "dispatch_quick.json").read_text())
    for by_mode in report["computations_per_second"].values():
        assert set(by_mode) == {"jax-O", "jax-F", "pw-O", "pw-C", "pw-C+fuse", "pw-F"}
        assert all(v["median"] > 0 and v["ratio_to_jax_O"] > 0 for v in by_mode.values())
    assert set(report["submit_latency_us"]) == {"pw-O", "pw-C"}
    assert report["sweep"]
    # The Ray section (on by default) ran in the same process, after the local one.
    ray_modes = report["ray"]["computations_per_second"]
    assert set(ray_modes) == {"ray-O", "pw-ray-O", "pw-ray-C", "pw-ray-C16", "pw-ray-C1", "xfer-C"}
    assert report["ray"]["pw_ray_C_ratio_to_floor"] > 0
    assert all(v["median"] > 0 and v["ratio_to_ray_O"] > 0 for v in ray_modes.values())
    assert ray_modes["ray-O"]["ratio_to_ray_O"] == 1.0
    assert report["ray"]["us_per_computation"]["pw-ray-C"] > 0
    assert isinstance(report["ray"]["target"]["met"], bool)
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "dispatch_quick.png").exists()
    cpus = ray_cluster.cluster_resources()["CPU"]
    assert wait_for(lambda: ray_cluster.available_resources().get("CPU") == cpus, timeout=10), (
        "a host was left"
    )
