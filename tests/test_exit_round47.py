"""Moments of exit or failure on the local backend: Ctrl-C landing inside the runtime's work.

A signal handler runs between two bytecodes of the main thread, among them
right after a call returns. Landing just after the runtime took one of its
locks, it must not leave the lock held: every later call would wait for ever,
and so would the process's exit. The interrupt is made to land there
deterministically: a profile function raises ``KeyboardInterrupt`` (as the
SIGINT handler does) at the first point where Python may run a handler
(a C call returning, a Python function starting) once the lock is held.
"""

import contextlib
import gc
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches
from helpers import interrupt_once as _interrupt_once

import pathways_jax as pw
from pathways_jax._src.runtime import clusters, submission


def _body(v):
    return v * 0.5 + 1.0


@contextlib.contextmanager
def _interrupt_once_held(lock):
    """Raises KeyboardInterrupt where a handler could first run once ``lock`` is held (on this thread)."""
    with _interrupt_once(lock.locked) as fired:
        yield fired


def _program_and_lock():
    pw.init(num_cpu_devices=8)
    step = pw.program(_body)
    x = jnp.arange(8.0)
    assert_matches(step(x), jax.jit(_body)(x))  # traced, compiled, settled
    return step, x, clusters.running()._controller._dispatch


def _serves_on(step, x, lock):
    assert not lock.locked()
    got = step(x)
    assert_matches(got.result(timeout=30), jax.jit(_body)(x))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["effects_barrier", "delete"])
def test_ctrl_c_as_a_wait_for_dispatched_runs_takes_the_dispatch_lock_leaves_it_free(where):
    # jax.effects_barrier() and Future.delete() wait for the runs dispatched so far, taking the
    # controller's dispatch lock a moment. A Ctrl-C landing just as they took it left it held:
    # every later call hung, and so did the process's exit (60 s, then a warning).
    step, x, lock = _program_and_lock()
    kept = step(x)
    kept.result()
    with pytest.raises(KeyboardInterrupt), _interrupt_once_held(lock) as fired:
        if where == "effects_barrier":
            jax.effects_barrier()
        else:
            kept.delete()
    assert fired
    _serves_on(step, x, lock)


@pytest.mark.timeout(120)
def test_ctrl_c_as_a_call_takes_the_dispatch_lock_leaves_it_free():
    # A loop of short calls interrupted by Ctrl-C: 1 in about 200 interrupts landed there, after
    # which the next call's result never came and exit waited 60 s for the controller.
    step, x, lock = _program_and_lock()
    with pytest.raises(KeyboardInterrupt), _interrupt_once_held(lock) as fired:
        step(x)
    assert fired
    try:
        _serves_on(step, x, lock)
    finally:
        if lock.locked():  # left held: let the cluster stop at once all the same
            lock.release()


@pytest.mark.timeout(120)
def test_ctrl_c_as_a_call_makes_its_outputs_leaves_no_value_behind():
    # 2 values were left in 400 interrupts of a loop of short calls: counted live for ever
    # (pw.stats()), pending, held by nothing.
    step, x, _ = _program_and_lock()
    store = clusters.running().store
    assert store.live_count() == 0
    with pytest.raises(KeyboardInterrupt), _interrupt_once(lambda: bool(store._live)) as fired:
        step(x)
    assert fired
    gc.collect()
    assert store.live_count() == 0
    assert_matches(step(x), jax.jit(_body)(x))


@pytest.mark.timeout(120)
def test_ctrl_c_landing_as_a_future_is_freed_reaches_the_user():
    # A value went through Future.__del__, a Python finalizer: Python runs a signal handler as
    # a finalizer starts, and as a call in it returns, and an exception raised in a finalizer
    # is only reported (12 in 400 Ctrl-C on a loop of short calls never reached the user).
    # Re-raising it there is no way out: _thread.interrupt_main() runs the handler as that very
    # call returns, still inside the finalizer. A value now goes with no Python frame at all.
    step, x, _ = _program_and_lock()
    out = step(x)
    out.result()
    store = clusters.running().store
    fired = []

    def in_finalizer(frame):
        while frame is not None:
            code = frame.f_code
            if code.co_name == "__del__" and "pathways_jax" in code.co_filename:
                return True
            frame = frame.f_back
        return False

    def hook(frame, event, arg):
        # Where Python may run a handler once a finalizer of the library's started: the
        # finalizer starting, a call in it returning, a Python function in it starting.
        if not fired and event in ("call", "c_return") and in_finalizer(frame):
            fired.append(event)
            raise KeyboardInterrupt

    reached = False
    unraisable = []
    previous = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    sys.setprofile(hook)
    try:
        del out  # the future goes: its finalizer runs here
        for _ in range(1000):  # where Python runs a signal handler (calls, loops)
            _body(1.0)
    except KeyboardInterrupt:
        reached = True
    finally:
        sys.setprofile(None)
        sys.unraisablehook = previous
    assert reached or not fired, unraisable
    gc.collect()
    assert store.live_count() == 0
    assert_matches(step(x), jax.jit(_body)(x))


@pytest.mark.timeout(120)
def test_ctrl_c_as_a_slice_is_asked_for_leaves_the_resource_manager_free():
    # pw.devices() took the resource manager's lock through its Condition, whose __enter__ is a
    # Python frame: a Ctrl-C landing as it returned left the lock held by the main thread, and
    # every other thread asking for or releasing a slice (a finalizer on the controller's
    # thread included) waited for ever.
    pw.init(num_cpu_devices=8)
    resources = clusters.running().resources
    with pytest.raises(KeyboardInterrupt), _interrupt_once(resources._cond._is_owned) as fired:
        pw.devices(mesh={"x": 2})
    assert fired
    got = []
    thread = threading.Thread(
        target=lambda: got.append(pw.devices(mesh={"x": 2}, exclusive=True, timeout=5)), daemon=True
    )
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and len(got) == 1
    got[0].release()
    s = pw.devices(mesh={"x": 8}, exclusive=True, timeout=5)  # nothing left reserved
    assert_matches(pw.jit(_body, devices=s)(jnp.arange(8.0)), jax.jit(_body)(jnp.arange(8.0)))
    s.release()


@pytest.mark.timeout(120)
def test_ctrl_c_as_a_call_reserves_room_for_its_host_inputs_leaves_the_room_free():
    # Under a memory budget a call reserves room for its NumPy inputs (HostStaging), taking a lock
    # through a Condition, whose __enter__ is a Python frame: a Ctrl-C landing as it returned
    # left the lock held by the main thread, and every other thread's call waited for ever.
    pw.init(num_cpu_devices=8, memory_budget=1 << 20)
    step = pw.program(_body)
    x = np.arange(8.0, dtype=np.float32)
    assert_matches(step(x), jax.jit(_body)(x))
    staging = submission.host_staging(clusters.running())
    assert staging is not None
    with pytest.raises(KeyboardInterrupt), _interrupt_once(staging._room._is_owned) as fired:
        step(x)
    assert fired
    took = []

    def other_thread():
        if staging._room.acquire(timeout=10):
            took.append(True)
            staging._room.release()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(30)
    assert took, "the main thread still holds the room's lock"
    assert_matches(step(x), jax.jit(_body)(x))
