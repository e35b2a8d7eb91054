"""A notebook's moments of exit and failure: Ctrl-C in a set-up cell, programs of cells run again.

A Ctrl-C is landed deterministically where Python could first run a signal
handler once a condition holds (as tests/test_exit_round47.py does): a profile
function raises ``KeyboardInterrupt`` there, as the SIGINT handler would.
"""

import gc
import sys
import threading
import weakref

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_matches
from helpers import interrupt_once as _interrupt_once

import pathways_jax as pw
from pathways_jax._src.runtime import accounting, clusters


def _body(v):
    return v * 0.5 + 1.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forgotten", "controller_taken", "controller_stopping"])
def test_ctrl_c_during_shutdown_still_stops_the_cluster(where):
    # Re-running a set-up cell (pw.shutdown(); pw.init(...)) and pressing Ctrl-C as the shutdown
    # waited: the cluster was forgotten at once, but its controller and accounting threads were
    # never told to stop (a thread more each time, for the kernel's life, each holding its old
    # cluster, its values and executables), and on the Ray backend its hosts stayed up.
    cl = pw.init(num_cpu_devices=8)
    x = jnp.arange(8.0)
    assert_matches(pw.program(_body)(x), jax.jit(_body)(x))
    controller = cl._controller
    threads = [controller._thread, controller.accounting._thread]
    assert all(t is not None and t.is_alive() for t in threads)
    when = {
        "forgotten": lambda: clusters._current is None,  # in pw.shutdown, once the cluster is forgotten
        "controller_taken": lambda: cl._controller is None,  # in Cluster.close, the controller taken
        "controller_stopping": lambda: controller._stopped,  # in Controller.stop, once it began
    }[where]
    with pytest.raises(KeyboardInterrupt), _interrupt_once(when) as fired:
        pw.shutdown()
    assert fired
    assert clusters.running() is None and cl.closed
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), f"{thread.name} of the shut-down cluster still runs"
    pw.init(num_cpu_devices=8)  # the set-up cell run again
    assert_matches(pw.program(_body)(x), jax.jit(_body)(x))
    gc.collect()


@pytest.mark.timeout(60)
def test_a_dropped_program_lets_an_exclusive_slice_have_its_device():
    # A cell defines and calls @pw.program def step (no slice: it runs where jax.jit would, on
    # device 0, a shared slice); a later cell drops it and asks for every device exclusively:
    # with timeout=None that waited for ever, as the registry of programs made again still held
    # the dropped program and its slice (only jax.clear_caches() let it go).
    pw.init(num_cpu_devices=8)
    x = jnp.arange(8.0)
    step = pw.program(_body)
    assert_matches(step(x), jax.jit(_body)(x))
    del step
    s = pw.devices(mesh={"x": 8}, exclusive=True, timeout=1)
    assert_matches(pw.jit(_body, devices=s)(x), jax.jit(_body)(x))
    s.release()


@pytest.mark.timeout(120)
def test_ctrl_c_anywhere_in_stopping_the_accounting_watcher_lets_a_second_stop_end_it():
    # A close cut short by Ctrl-C is finished by a second one. The watcher was woken with a
    # threading.Event, whose set() takes its Condition's lock in a Python frame: a Ctrl-C landing
    # as that lock was taken left it held, the watcher never woke again, and the second stop
    # waited for the lock for ever (the main thread of a notebook's kernel, hung).
    points = 0
    for n in range(1, 200):
        acc = accounting.Accounting([0], on_done=lambda *args: None)
        acc._start()
        watcher = acc._thread
        seen = []

        def hook(frame, event, arg, n=n, seen=seen):
            if event in ("call", "c_return"):
                seen.append(event)
                if len(seen) == n:
                    raise KeyboardInterrupt

        sys.setprofile(hook)
        try:
            acc.stop(timeout=1.0)
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        if len(seen) < n:  # stop() ran to its end before the n-th point: every point was tried
            break
        points += 1
        second = threading.Thread(target=acc.stop, kwargs={"timeout": 5.0}, daemon=True)
        second.start()
        second.join(10)
        assert not second.is_alive(), f"a second stop() waited for ever (Ctrl-C at point {n})"
        watcher.join(10)
        assert not watcher.is_alive(), f"the watcher still runs (Ctrl-C at point {n})"
    assert points >= 3


@pytest.mark.timeout(60)
def test_a_slice_request_that_times_out_names_the_slices_holding_its_devices():
    # A cell calls a program given no slice; a later one asks for every device exclusively and
    # is told "1 used by shared slices. Release slices you no longer need": the user asked for no
    # slice, and had none to release. The slices in the way are named, with what lets them go.
    pw.init(num_cpu_devices=8)
    x = jnp.arange(8.0)
    step = pw.program(lambda v: _body(v))
    out = step(x)
    assert_matches(out, jax.jit(_body)(x))
    mine = pw.devices(mesh={"x": 2})
    with pytest.raises(pw.errors.ResourceError) as info:
        pw.devices(mesh={"x": 8}, exclusive=True, timeout=0.1)
    said = str(info.value)
    assert f"{out.slice!r}: the slice of programs and pw.jit functions given no slice" in said, said
    assert f"{mine!r}: asked for with pw.devices(); .release() gives it back" in said, said
    mine.release()
    del step, out
    gc.collect()
    whole = pw.devices(mesh={"x": 8}, exclusive=True, timeout=5)  # nothing holds them now
    with pytest.raises(pw.errors.ResourceError) as info:
        pw.devices(mesh={"x": 2}, timeout=0.1)
    assert f"Held by {whole!r}: asked for with pw.devices()" in str(info.value), str(info.value)
    assert_matches(pw.jit(_body, devices=whole)(x), jax.jit(_body)(x))
    whole.release()


def test_init_again_with_other_arguments_says_which_differ():
    # A set-up cell edited and run again: the error spelled out both calls' dozen arguments and
    # left the user to find the one that changed.
    pw.init(num_cpu_devices=8)
    with pytest.raises(pw.errors.ClusterError) as info:
        pw.init(num_cpu_devices=8, islands=2, scheduler="fair")
    said = str(info.value)
    assert "(they differ in islands=2 (running: None), scheduler='fair' (running: 'fifo'))" in said, said
    assert "Call pw.shutdown() first" in said
    x = jnp.arange(8.0)
    assert_matches(pw.program(_body)(x), jax.jit(_body)(x))  # the running cluster serves on


def _kept_body(v):
    return v * 3 - 1


def test_a_program_still_held_stays_shared_when_devices_are_reclaimed():
    # Reclaiming lets go only of the programs nothing but the registry holds: one the user still
    # holds is the program pw.program(f) makes again (no new trace), and its results are jax.jit's.
    from pathways_jax._src.api import decorator

    pw.init(num_cpu_devices=8)
    x = jnp.arange(8.0)
    held = pw.program(_kept_body)
    assert_matches(held(x), jax.jit(_kept_body)(x))
    dropped = weakref.ref(pw.program(_body))
    decorator._release_unheld()
    assert dropped() is None
    traces = pw.counters()["traces"]
    again = pw.program(_kept_body)
    assert again is held
    assert_matches(again(x), jax.jit(_kept_body)(x))
    assert pw.counters()["traces"] == traces
