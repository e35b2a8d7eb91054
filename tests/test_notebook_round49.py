"""A notebook's cells run again, interrupted, or ended: what a kernel keeps and what it is told.

Cells re-run redefine their functions; Ctrl-C lands at any moment (made to land
deterministically, as in tests/test_notebook_round48.py); a kernel's exit must
not wait for ever on a run that never ends; a program's view says what its last
trace did.
"""

import contextlib
import gc
import html
import re
import sys
import time
import weakref

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_matches, interrupt_once, run_source, wait_for

import pathways_jax as pw
from pathways_jax._src.api import arguments
from pathways_jax._src.runtime import clusters

_OUTPUTS = 4


def _many(v):
    return [v * i for i in range(_OUTPUTS)]


@pytest.mark.timeout(120)
def test_placed_jit_redefined_in_a_cell_again_and_again_keeps_nothing_of_the_old_ones():
    # A cell run again and again: f = pw.jit(lambda ..., devices=s); f(x). Each dropped
    # function's plan left the array key of each of its outputs in a table of the argument
    # layer, for good (about 1.2 MB a hundred redefinitions of a dozen outputs, up to 65536 entries).
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    x = jnp.arange(8.0)
    want = jax.jit(_many)(x)

    def cell():
        f = pw.jit(lambda v: _many(v), devices=s)  # a new function each time, as a cell makes
        assert_matches(f(x), want)

    cell()
    gc.collect()
    cell()
    before = len(arguments._ARRAY_KEYS)
    for _ in range(8):
        cell()
    gc.collect()
    cell()  # what went since is forgotten as the next plan is made
    assert len(arguments._ARRAY_KEYS) - before <= 2 * _OUTPUTS, (before, len(arguments._ARRAY_KEYS))
    s.release()


def _text(html):
    return re.sub(r"<[^>]+>", " ", html)


@pytest.mark.timeout(60)
def test_program_view_after_a_failed_trace_says_it_failed_and_why():
    # A cell calls a program whose trace fails (a shape error); the next cell shows the program
    # to see why, and its view said "not traced yet: call it", as if it had never been called.
    pw.init(num_cpu_devices=8)

    @pw.program
    def step(x):
        return x @ jnp.ones((3, 3))

    with pytest.raises(pw.errors.ProgramTraceError) as info:
        step(jnp.ones(8))
    text = _text(step._repr_html_())
    assert "not traced yet" not in text, text
    first = str(info.value).splitlines()[0]
    assert "its trace failed: " in text and "contracting dimensions" in first, text
    assert html.escape(first) in step._repr_html_(), (first, text)
    step(jnp.ones(3))  # fixed: the view shows its graph, and no failure
    text = _text(step._repr_html_())
    assert "trace failed" not in text and "1 traced signatures" in text, text
    with pytest.raises(pw.errors.ProgramTraceError):
        step(jnp.ones(5))  # another signature fails: said beside the graph traced before
    assert "its last trace failed: " in _text(step._repr_html_())


@pytest.mark.timeout(120)
def test_exit_with_a_run_stuck_in_a_host_callback_is_bounded_and_says_what_it_abandoned():
    # A kernel's exit (or a script's end) with a run whose host callback waits for ever: the
    # exit waited a minute for it. It now gives up once the callback ran exit_wait.STUCK_S
    # (3 s; 0.3 here) with the process idle, and a warning names the callback. A callback that
    # works longer than that (a checkpoint written) is waited for: its side effect happens.
    # The exit is timed from its first hook.
    proc = run_source(
        """
        import atexit, threading, time
        import jax, jax.numpy as jnp
        import pathways_jax as pw
        from pathways_jax._src.runtime import exit_wait

        exit_wait.STUCK_S, exit_wait.ABANDON_S = 0.3, 0.1
        pw.init(num_cpu_devices=2)
        working = threading.Event()

        def work_then_save(v):
            working.set()
            start = time.thread_time()
            while time.thread_time() - start < 0.6:  # CPU work: 2 STUCK_S of it, whatever the load
                sum(range(1000))
            print("saved", flush=True)
            return v

        def wait_for_ever(v):
            threading.Event().wait()
            return v

        shape = jax.ShapeDtypeStruct((4,), jnp.float32)
        save = pw.jit(lambda x: jax.pure_callback(work_then_save, shape, x) + 1, devices=pw.devices(mesh={"x": 1}))
        stuck = pw.jit(lambda x: jax.pure_callback(wait_for_ever, shape, x) + 1, devices=pw.devices(mesh={"x": 1}))
        out = stuck(save(jnp.arange(4.0)))
        assert working.wait(60)
        atexit.register(lambda: print("exit at", time.monotonic(), flush=True))  # the first to run
        """,
        timeout=50,
    )
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-3000:]
    began = float(proc.stdout.split("exit at")[-1].split()[0])
    assert ended - began < 15, (ended - began, proc.stderr[-3000:])
    assert "saved" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert "waiting for the host callback work_then_save (<string>:" in proc.stderr, proc.stderr[-3000:]
    assert "the host callback wait_for_ever (<string>:" in proc.stderr, proc.stderr[-3000:]
    assert "abandons it and its run" in proc.stderr, proc.stderr[-3000:]
    assert "work_then_save (<string>:10) has not returned" not in proc.stderr, proc.stderr[-3000:]


def _in_a_finalizer(frame):
    """Whether ``frame`` runs inside a ``weakref.finalize`` callback or a ``__del__``."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (
            code.co_name == "__call__" and code.co_filename.endswith("weakref.py")
        ):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _ctrl_c_in_a_finalizer():
    """A Ctrl-C where a finalizer's Python code could first take it, in the block or just after.

    Fails unless it reached the block's caller, or no finalizer's Python code ran at all.
    """
    unraisable = []
    previous = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    reached = False
    try:
        # The frame the profile function was called for: two below the condition's.
        with interrupt_once(lambda: _in_a_finalizer(sys._getframe(2))) as fired:
            yield
            for _ in range(1000):  # where Python runs a signal handler (calls, loops)
                _many(1.0)
    except KeyboardInterrupt:
        reached = True
    finally:
        sys.unraisablehook = previous
    assert reached or not fired, (fired, [u.exc_value for u in unraisable])


@pytest.mark.timeout(60)
def test_ctrl_c_as_a_dropped_slice_gives_its_devices_back_reaches_the_user():
    # A cell drops a slice (del s, or s = pw.devices(...) run again): its devices went back in a
    # weakref.finalize callback, Python code where a Ctrl-C landing is only reported ("Exception
    # ignored in: <finalize object>"), never raised to the user, and where it could stop the
    # release half-way, the devices held for good. They now go with no Python frame at all.
    pw.init(num_cpu_devices=8)
    resources = clusters.running().resources
    s = pw.devices(mesh={"x": 4}, exclusive=True)
    assert_matches(pw.jit(_many, devices=s)(jnp.arange(4.0)), jax.jit(_many)(jnp.arange(4.0)))
    gc.collect()  # the pw.jit function made here (it holds the slice) is gone
    with _ctrl_c_in_a_finalizer():
        del s  # the slice goes: its devices go back here
    gc.collect()
    assert set(resources.load().values()) == {0}, resources.load()
    whole = pw.devices(mesh={"x": 8}, exclusive=True, timeout=5)
    assert_matches(pw.jit(_many, devices=whole)(jnp.arange(8.0)), jax.jit(_many)(jnp.arange(8.0)))
    whole.release()


@pytest.mark.timeout(60)
def test_ctrl_c_as_a_dropped_program_is_forgotten_reaches_the_user():
    # A cell drops a program that ran (del step, or step = pw.jit(...) run again): the
    # accounting and the executable cache learnt it in weakref.finalize callbacks, whose
    # __call__ is a Python frame on the thread that dropped it: a Ctrl-C landing there was only
    # reported, and one landing as it started lost the callback (the plan's figures kept).
    pw.init(num_cpu_devices=8)
    accounting = clusters.running().controller.accounting
    s = pw.devices(mesh={"x": 2})
    x = jnp.arange(4.0)
    step = pw.jit(lambda v: v * 3.0 + 1, devices=s)
    assert_matches(step(x), jax.jit(lambda v: v * 3.0 + 1)(x))
    other = pw.jit(lambda v: v - 1, devices=s)
    assert_matches(other(x), x - 1)  # the watcher looks at another run after: step's plan is ours
    assert wait_for(lambda: len(accounting._tracked) == 2)
    with _ctrl_c_in_a_finalizer():
        del step
        gc.collect()  # a pw.jit function lives in a reference cycle: it goes here, with its plan
    assert_matches(other(x), x - 1)
    assert wait_for(lambda: len(accounting._tracked) == 1)  # step's plan forgotten


def _twice(v):
    return v * 2 + 1


@pytest.mark.timeout(60)
def test_a_placed_jit_deleted_in_a_cell_gives_its_slice_back_at_once():
    # del f (f = pw.jit(..., devices=s)) and del s: the function and its program held each other,
    # so the slice, its devices and the executables stayed until the garbage collector's next
    # full pass, which a long-lived kernel (its objects in the oldest generation) seldom makes.
    pw.init(num_cpu_devices=8)
    resources = clusters.running().resources
    x = jnp.arange(8.0)
    s = pw.devices(mesh={"x": 8}, exclusive=True)
    f = pw.jit(_twice, devices=s)
    assert_matches(f(x), jax.jit(_twice)(x))
    gone = weakref.ref(f)
    gc.collect()  # f is long-lived now, as a kernel's objects are
    del f, s
    assert gone() is None
    assert set(resources.load().values()) == {0}, resources.load()
    g = pw.jit(_twice, devices=pw.devices(mesh={"x": 8}, exclusive=True, timeout=0))
    assert_matches(g(x), jax.jit(_twice)(x))
