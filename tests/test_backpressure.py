"""Memory back-pressure: per-device byte budgets, waiting runs, and runs that can never fit."""

import gc
import time

import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

N = 1024  # float32 elements: 4096 bytes per output on one device


def _double():
    s = pw.devices(mesh={"x": 1}, island=0)
    return s, pw.jit(lambda v: v * 2, devices=s)


@pytest.mark.timeout(60)
def test_third_run_waits_until_a_value_is_freed():
    # Room for two outputs, plus the host input of the run being admitted.
    pw.init(num_cpu_devices=8, islands=2, memory_budget=int(3.5 * N * 4))
    s, double = _double()
    x = np.ones(N, np.float32)
    device = s.devices[0].id
    first = double(x)
    second = double(x)
    first.result(timeout=30), second.result(timeout=30)
    assert pw.stats()["devices"][device]["bytes_in_use"] == 2 * N * 4
    third = double(x)
    time.sleep(0.3)
    assert not third.done()  # waits: its output does not fit the budget
    assert pw.stats()["islands"][0]["queued"] == 1
    del first
    gc.collect()
    np.testing.assert_array_equal(np.asarray(third.result(timeout=30)), x * 2)
    assert pw.stats()["devices"][device]["bytes_in_use"] == 2 * N * 4
    del second, third
    gc.collect()
    assert pw.stats()["devices"][device]["bytes_in_use"] == 0
    s.release()


@pytest.mark.timeout(60)
def test_an_output_returned_twice_holds_its_bytes_twice():
    # Every output is a buffer of its own: a value returned twice is two buffers on its device,
    # and both count against the budget (one was counted).
    pw.init(num_cpu_devices=8, islands=2, memory_budget=int(3.5 * N * 4))
    s = pw.devices(mesh={"x": 1}, island=0)
    place = pw.jit(lambda v: v * 1, devices=s)
    device = s.devices[0].id
    x = place(np.ones(N, np.float32))  # N * 4 bytes held
    first, second = pw.program(lambda v: (v, v))(x)  # two copies: room for both, just
    first.result(timeout=30)
    assert pw.stats()["devices"][device]["bytes_in_use"] == 3 * N * 4
    again = pw.program(lambda v: (v, v), name="again")(x)
    assert not again[0].done()  # waits: its two copies do not fit beside the first two
    del first, second
    gc.collect()
    np.testing.assert_array_equal(np.asarray(again[1].result(timeout=30)), np.ones(N, np.float32))
    assert pw.stats()["devices"][device]["bytes_in_use"] == 3 * N * 4
    s.release()


@pytest.mark.timeout(60)
def test_backpressure_timeout_raises():
    # Room for one output, plus the host input of the run being admitted.
    pw.init(num_cpu_devices=8, islands=2, memory_budget=int(2.5 * N * 4), backpressure_timeout=0.3)
    s, double = _double()
    x = np.ones(N, np.float32)
    held = double(x)
    held.result(timeout=30)
    late = double(x)
    with pytest.raises(pw.errors.BackPressureTimeout, match=r"backpressure_timeout=0\.3") as info:
        late.result(timeout=30)
    assert isinstance(info.value, TimeoutError)
    assert "4096 B" in str(info.value)
    # The controller keeps serving once memory is back.
    del held
    gc.collect()
    np.testing.assert_array_equal(np.asarray(double(x).result(timeout=30)), x * 2)
    s.release()


def test_a_node_that_can_never_fit_fails_at_once():
    pw.init(num_cpu_devices=8, islands=2, memory_budget=1000)
    s, double = _double()
    start = time.monotonic()
    with pytest.raises(
        pw.errors.ResourceError, match=r"need 4096 bytes on device \d+, but its memory budget is 1000"
    ):
        double(np.ones(N, np.float32))
    assert time.monotonic() - start < 10
    s.release()


def test_fractional_budget_needs_devices_that_report_memory():
    with pytest.raises(pw.errors.ClusterError, match="does not report its memory"):
        pw.init(num_cpu_devices=8, islands=2, memory_budget=0.5)
    with pytest.raises(pw.errors.ClusterError, match="memory_budget"):
        pw.init(num_cpu_devices=8, islands=2, memory_budget=-3)


@pytest.mark.timeout(60)
def test_intermediates_are_released_when_the_run_completes():
    pw.init(num_cpu_devices=8, islands=2, memory_budget=10 * N * 4)
    s = pw.devices(mesh={"x": 1}, island=0)
    f = pw.jit(lambda v: v + 1, devices=s)
    g = pw.jit(lambda v: v * 3, devices=s)

    @pw.program
    def step(v):
        return g(f(v))

    out = step(jnp.ones(N))
    out.result(timeout=30)
    deadline = time.monotonic() + 10
    device = s.devices[0].id
    while pw.stats()["devices"][device]["bytes_in_use"] != N * 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pw.stats()["devices"][device]["bytes_in_use"] == N * 4  # only the output stays
    del out
    gc.collect()
    assert pw.stats()["devices"][device]["bytes_in_use"] == 0
    s.release()
