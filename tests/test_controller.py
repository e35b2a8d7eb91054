"""The controller: consistent order per island and bounded in-flight dispatch.

Both workloads below abort or hang plain JAX on CPU (DESIGN §5); through the
controller they must finish, correctly, within the timeout.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import wait_for

import pathways_jax as pw

P = pw.P


def _allreduce_program(slice_):
    @pw.jit(devices=slice_, in_specs=(P(), None))
    def node(acc, x):
        total = jax.shard_map(lambda a: jax.lax.psum(a.sum(), "x"), in_specs=P("x"), out_specs=P())(
            jnp.broadcast_to(x, (slice_.size,))
        )
        return acc + total

    return pw.program(lambda acc, x: node(acc, x))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("inline", [True, False], ids=["inline-dispatch", "thread-only"])
def test_two_threads_300_allreduce_programs_each_on_one_island(inline):
    pw.init(num_cpu_devices=8, inline_dispatch=inline)
    slices = [pw.devices(mesh={"x": 4}), pw.devices(mesh={"x": 4})]
    assert set(slices[0].devices) & set(slices[1].devices) == set()  # least-loaded spread
    slices.append(pw.devices(mesh={"x": 4}))  # overlaps the first
    assert set(slices[2].devices) == set(slices[0].devices)
    programs = [_allreduce_program(s) for s in slices]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def client(index):
        try:
            acc = jnp.zeros(())
            outs = []
            for step in range(300):
                acc = programs[(index + step) % 3](acc, float(index + 1))
                outs.append(acc)
            results[index] = [o.result(timeout=180) for o in outs[-1:]]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert not any(t.is_alive() for t in threads), "client threads did not finish"
    assert not errors, errors
    # Each step adds size * (index + 1) with size 4; compare with plain jax.jit sequentially.
    reference = jax.jit(lambda acc, x: acc + 4 * x)
    for index in range(2):
        want = jnp.zeros(())
        for _ in range(300):
            want = reference(want, float(index + 1))
        np.testing.assert_allclose(np.asarray(results[index][0]), np.asarray(want), rtol=1e-6)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("inline", [True, False], ids=["inline-dispatch", "thread-only"])
def test_chain_of_256_allreduce_programs_submitted_without_waiting(inline):
    pw.init(num_cpu_devices=8, inline_dispatch=inline)
    s = pw.devices(mesh={"x": 8})
    program = _allreduce_program(s)
    acc = jnp.zeros(())
    futures = []
    for _ in range(256):
        acc = program(acc, 0.5)
        futures.append(acc)
    assert float(acc.result(timeout=200)) == pytest.approx(256 * 8 * 0.5)
    assert all(f.done() for f in futures)
    assert pw.cluster().controller.alive


def test_in_flight_window_is_configurable_and_validated():
    cl = pw.init(num_cpu_devices=8, max_in_flight=2)
    assert cl.in_flight == 2
    s = pw.devices(mesh={"x": 8})
    program = _allreduce_program(s)
    acc = jnp.zeros(())
    for _ in range(20):
        acc = program(acc, 1.0)
    assert float(acc.result(timeout=60)) == 20 * 8
    pw.shutdown()
    with pytest.raises(pw.errors.ClusterError, match="max_in_flight"):
        pw.init(num_cpu_devices=8, max_in_flight=0)


def test_controller_thread_starts_lazily_and_shutdown_drains_the_queue():
    cl = pw.init(num_cpu_devices=8)
    assert cl._controller is None
    s = pw.devices(mesh={"x": 2})
    step = pw.program(lambda x: x + 1, devices=s)
    outs = [step(jnp.full(3, float(i))) for i in range(50)]
    assert cl._controller is not None
    pw.shutdown()
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(np.asarray(out.result(timeout=30)), np.full(3, i + 1.0))
    with pytest.raises(pw.errors.PlacementError, match="shut down"):
        step(jnp.zeros(3))


def test_runs_that_call_back_into_python_never_block_the_caller():
    import threading

    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    gate = threading.Event()

    def wait(v):
        gate.wait(30)
        return v

    held = pw.jit(lambda x: jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x), devices=s)
    try:
        out = held(jnp.ones(2))  # would block here if dispatched on this thread
        assert not out.done()
    finally:
        gate.set()
    np.testing.assert_array_equal(np.asarray(out.result(timeout=30)), [1.0, 1.0])


def test_inline_dispatch_keeps_submission_order_with_a_busy_controller():
    import threading

    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    gate = threading.Event()

    def wait(v):
        gate.wait(30)
        return v

    held = pw.jit(lambda x: jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x), devices=s)
    bump = pw.jit(lambda x: x * 2 + 1, devices=s)
    try:
        first = held(jnp.ones(2))  # occupies the controller thread
        chain = [bump(first)]
        for _ in range(20):  # queued behind it, in order, though the caller is free
            chain.append(bump(chain[-1]))
        assert not chain[-1].done()
    finally:
        gate.set()
    want = jnp.ones(2)
    for _ in range(21):
        want = want * 2 + 1
    np.testing.assert_allclose(np.asarray(chain[-1].result(timeout=60)), np.asarray(want))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inline", [True, False], ids=["inline-dispatch", "thread-only"])
def test_programs_that_place_nothing_run_between_single_device_runs(inline):
    # Their plans were prepared by no backend (nothing to dispatch, no window
    # lanes), yet the cluster's backend executes their runs like any other.
    pw.init(num_cpu_devices=8, inline_dispatch=inline)
    s = pw.devices(mesh={"x": 1})
    bump = pw.jit(lambda v: v + 1, devices=s)
    literal = pw.program(lambda: 3.0)
    ident = pw.program(lambda *v: v, devices=s)
    x = jnp.zeros(3)
    for i in range(12):  # past the device's window, both inline and queued
        x = bump(x)
        assert float(literal().result(timeout=30)) == 3.0
        same, flag = ident(jnp.full(2, float(i)), np.bool_(i % 2))
        np.testing.assert_array_equal(np.asarray(same.result(timeout=30)), np.full(2, float(i)))
        assert bool(flag.result(timeout=30)) == bool(i % 2)
    np.testing.assert_array_equal(np.asarray(x.result(timeout=30)), np.full(3, 12.0))


def _dispatching_threads(monkeypatch, controller):
    """The thread that dispatched each run from now on, in order."""
    threads: list[int] = []
    execute = controller._execute

    def recorded(run):
        threads.append(threading.get_ident())
        return execute(run)

    monkeypatch.setattr(controller, "_execute", recorded)
    return threads


def _heavy(x):
    return jax.lax.fori_loop(0, 60, lambda _, v: jnp.tanh(v @ v) * 0.5, x)


def _measured_on_one_device(fun, size):
    """``pw.jit(fun)`` on a 1-device slice, run for arrays and for futures (two plans) and measured."""
    pw.init(num_cpu_devices=8)
    program = pw.jit(fun, devices=pw.devices(mesh={"x": 1}))
    x = jnp.eye(size) * 0.5
    program(program(x)).result(timeout=60)
    controller = pw.cluster().controller
    assert wait_for(lambda: len(controller.accounting.medians) == 2, 30)
    return program, x, controller


def _twelve_calls_dispatched(monkeypatch, controller, program, fun, x):
    """The threads that dispatched 12 chained calls of ``program`` (three device windows), checked against ``jax.jit(fun)``."""
    threads = _dispatching_threads(monkeypatch, controller)
    y = want = x
    for _ in range(12):  # back to back: the window fills
        y = program(y)
    for _ in range(12):
        want = jax.jit(fun)(want)
    np.testing.assert_allclose(np.asarray(y.result(timeout=60)), np.asarray(want), rtol=1e-6)
    return threads


def _milliseconds(x):  # runs of a few milliseconds (a small train step): past _SHORT_RUN_S
    return jax.lax.fori_loop(0, 120, lambda _, v: jnp.tanh(v @ v) * 0.5, x)


@pytest.mark.timeout(120)
def test_a_caller_that_finds_its_device_window_full_of_short_runs_waits_for_it_and_dispatches_inline(
    monkeypatch,
):
    from pathways_jax._src.runtime import controller as controller_lib

    monkeypatch.setattr(controller_lib, "_SHORT_RUN_S", 10.0)  # these runs of milliseconds count as short
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 1})
    heavy = pw.jit(_heavy, devices=s)
    x = jnp.eye(64) * 0.5
    heavy(heavy(x)).result(timeout=60)  # compiled for arrays and for futures, and their costs measured
    controller = pw.cluster().controller
    assert wait_for(lambda: len(controller.accounting.costs) == 2, 30)
    threads = _dispatching_threads(monkeypatch, controller)
    y = x
    for _ in range(12):  # three times the device's window: queued, each would wait for the controller
        y = heavy(y)
    want = x
    for _ in range(12):
        want = jax.jit(_heavy)(want)
    np.testing.assert_allclose(np.asarray(y.result(timeout=60)), np.asarray(want), rtol=1e-6)
    assert threads == [threading.get_ident()] * 12


@pytest.mark.timeout(120)
@pytest.mark.parametrize("caller_wait_s", [100.0, 0.0])
def test_a_caller_waits_for_its_window_of_runs_of_milliseconds_only_within_the_caller_bound(
    monkeypatch, caller_wait_s
):
    # Runs of milliseconds (a small train step) are past _SHORT_RUN_S: queued, each was handed
    # to the controller's thread. A caller waits for half a window of its own runs when that
    # takes at most _CALLER_WAIT_S (here: any time, or none), and dispatches them itself.
    from pathways_jax._src.runtime import accounting as accounting_lib
    from pathways_jax._src.runtime import controller as controller_lib

    monkeypatch.setattr(controller_lib, "_CALLER_WAIT_S", caller_wait_s, raising=False)
    fold_median = accounting_lib.fold_median
    monkeypatch.setattr(
        accounting_lib, "fold_median", lambda medians, recent, key, _: fold_median(medians, recent, key, 5e-3)
    )  # every run measured 5 ms, whatever this machine makes of it
    heavy, x, controller = _measured_on_one_device(_milliseconds, 128)
    assert all(
        median == 5e-3 > controller_lib._SHORT_RUN_S for median in controller.accounting.medians.values()
    )
    threads = _twelve_calls_dispatched(monkeypatch, controller, heavy, _milliseconds, x)
    if caller_wait_s:
        assert threads == [threading.get_ident()] * 12
    else:  # longer than the caller waits for: queued once the window is full
        assert controller._thread.ident in threads


@pytest.mark.timeout(120)
def test_runs_measured_short_lately_dispatch_inline_though_slow_looks_inflate_their_smoothed_estimate(
    monkeypatch,
):
    # The watcher's look at finished runs waits for the GIL, and a queued loop's pace is the
    # hand-over's: its smoothed estimate grew with the slowness queueing caused, and a loop of
    # short steps stayed queued. Whether runs are short is the median of the latest measurements.
    from pathways_jax._src.runtime import accounting as accounting_lib
    from pathways_jax._src.runtime import controller as controller_lib

    monkeypatch.setattr(controller_lib, "_SHORT_RUN_S", 10.0)  # these runs of milliseconds count as short
    fold = accounting_lib.fold
    monkeypatch.setattr(
        accounting_lib, "fold", lambda estimates, once, key, _: fold(estimates, once, key, 100.0)
    )  # every look came late: the smoothed estimate says 100 s a run
    heavy, x, controller = _measured_on_one_device(_heavy, 64)
    assert all(cost == 100.0 for cost in controller.accounting.costs.values())
    assert all(median < 10.0 for median in controller.accounting.medians.values())
    threads = _twelve_calls_dispatched(monkeypatch, controller, heavy, _heavy, x)
    assert threads == [threading.get_ident()] * 12


@pytest.mark.timeout(120)
def test_a_caller_whose_short_runs_are_queued_waits_for_them_then_dispatches_inline(monkeypatch):
    from pathways_jax._src.runtime import controller as controller_lib

    monkeypatch.setattr(controller_lib, "_SHORT_RUN_S", 10.0)  # however long the machine makes it
    monkeypatch.setattr(controller_lib, "_CATCH_UP_S", 60.0, raising=False)
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    bump = pw.jit(lambda v: v * 2 + 1, devices=s)
    bump(bump(jnp.ones(2))).result(
        timeout=60
    )  # compiled for arrays and for futures, and their costs measured
    controller = pw.cluster().controller
    assert wait_for(lambda: len(controller.accounting.costs) == 2, 30)
    threads = _dispatching_threads(monkeypatch, controller)
    holding, seen = threading.Event(), []

    def hold_dispatch_until_a_caller_waits():
        with controller._dispatch:  # no run is dispatched meanwhile: the caller's runs queue
            holding.set()
            seen.append(wait_for(lambda: getattr(controller, "_catching_up", 0) > 0, 10))

    holder = threading.Thread(target=hold_dispatch_until_a_caller_waits)
    holder.start()
    assert holding.wait(30)
    y = jnp.ones(2)
    for _ in range(3):  # the first is queued; a later one waits for what is queued, then goes inline
        y = bump(y)
    holder.join(30)
    np.testing.assert_array_equal(np.asarray(y.result(timeout=30)), [15.0, 15.0])
    assert seen == [True]
    assert threads[0] == controller._thread.ident
    assert threads[-1] == threading.get_ident()
