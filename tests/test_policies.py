"""Policies hold on every slice: fair device-time shares on 1-device and 4-device slices."""

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw


def _program(x, w):
    return jnp.sum(jnp.tanh(x @ w))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 4])
def test_fair_one_to_three_shares_hold_on_every_slice(size):
    pw.init(num_cpu_devices=8, scheduler="fair")
    s = pw.devices(mesh={"x": size})
    rng = np.random.default_rng(0)
    m = 128
    x = jnp.asarray(rng.normal(size=(size * m, m)) / np.sqrt(m), jnp.float32)
    w = jnp.asarray(rng.normal(size=(m, m)) / np.sqrt(m), jnp.float32)
    f = pw.jit(_program, devices=s, in_specs=(pw.P("x"), pw.P()), out_specs=pw.P())
    np.testing.assert_allclose(
        np.asarray(f(x, w).result(timeout=30)), np.asarray(jax.jit(_program)(x, w)), rtol=1e-5
    )
    clients = [pw.client("w1", weight=1.0), pw.client("w3", weight=3.0)]
    stop, barrier, errors = threading.Event(), threading.Barrier(3), []

    def work(client):
        pending = collections.deque()
        try:
            barrier.wait()
            with client:
                while not stop.is_set():
                    pending.append(f(x, w))
                    if len(pending) >= 8:
                        pending.popleft().result(timeout=30)
                for out in pending:
                    out.result(timeout=30)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    barrier.wait()
    time.sleep(0.5)
    pw.stats(reset=True)
    time.sleep(2.0)
    st = pw.stats()
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    times = {c.name: st["clients"][c.name]["device_time_s"] for c in clients}
    share = times["w3"] / sum(times.values())
    assert abs(share - 0.75) / 0.75 < 0.10, times
    for c in clients:
        c.close()
    s.release()
