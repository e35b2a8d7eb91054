"""Stress: many clients, collectives on overlapping slices, DCN transfers, one controller."""

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

THREADS, PROGRAMS = 8, 200


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["fifo", "priority", "fair"])
def test_many_clients_with_collectives_on_overlapping_slices(policy):
    pw.init(num_cpu_devices=8, islands=2, scheduler=policy, memory_budget=1 << 20)
    a = pw.devices(mesh={"x": 4}, island=0)  # devices 0-3
    b = pw.devices(mesh={"x": 2}, island=0)  # two of the same devices
    r = pw.devices(mesh={"x": 4}, device_ids=[3, 2, 1, 0])  # a's devices, in the other order
    c = pw.devices(mesh={"x": 4}, island=1)
    assert [d.id for d in a.devices] == [0, 1, 2, 3] and [d.id for d in r.devices] == [3, 2, 1, 0]

    def body(v, k):
        return v * 0.5 + v.sum() / 8 + k  # the sum over a sharded vector is an all-reduce

    on_a = pw.jit(body, devices=a, in_specs=(pw.P("x"), None), out_specs=pw.P("x"))
    on_b = pw.jit(body, devices=b, in_specs=(pw.P("x"), None), out_specs=pw.P("x"))
    on_c = pw.jit(body, devices=c, in_specs=(pw.P("x"), None), out_specs=pw.P("x"))
    on_r = pw.jit(body, devices=r, in_specs=(pw.P("x"), None), out_specs=pw.P("x"))

    @pw.program
    def spanning(v, k):  # island 0, then island 1 over DCN
        return on_c(on_a(v, k), k)

    programs = [on_a, on_b, spanning, on_r]
    reference = jax.jit(body)
    gc.collect()
    baseline = pw.cluster().store.live_count()
    results, errors = {}, []

    def client(index):
        try:
            with pw.client(f"c{index}", weight=1 + index % 4):
                acc = jnp.full((8,), float(index))
                for step in range(PROGRAMS):
                    acc = programs[(index + step) % 4](acc, jnp.float32(step % 5))
                results[index] = np.asarray(acc.result(timeout=200))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(220)
    assert not any(t.is_alive() for t in threads), "client threads did not finish"
    assert not errors, errors
    for index in range(THREADS):
        want = jnp.full((8,), float(index))
        for step in range(PROGRAMS):
            k = jnp.float32(step % 5)
            want = reference(want, k)
            if (index + step) % 4 == 2:
                want = reference(want, k)
        np.testing.assert_allclose(results[index], np.asarray(want), rtol=1e-5, atol=1e-5)
    assert pw.counters()["transfers_dcn"] > 0
    gc.collect()
    assert pw.cluster().store.live_count() == baseline
    st = pw.stats()
    assert sum(st["clients"][f"c{i}"]["programs"] for i in range(THREADS)) == THREADS * PROGRAMS
    assert all(d["bytes_in_use"] == 0 for d in st["devices"].values())
    for s in (a, b, r, c):
        s.release()
