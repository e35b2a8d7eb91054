"""Moments of exit and failure on the local backend: forks, interrupts, notebooks, threads.

Each test runs what a user writes (in a process of its own where the process's
life is the point), under a deadline, and compares results with plain ``jax.jit``.
"""

import contextlib
import random
import signal
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_matches, gated, run_source

import pathways_jax as pw

_FORKED_CHILD = """
import faulthandler, os, sys, threading, warnings
warnings.filterwarnings("ignore", message=r"os\\.fork\\(\\) was called", category=RuntimeWarning)
import jax, jax.numpy as jnp, numpy as np
import pathways_jax as pw

pw.init(num_cpu_devices=4)
gate = threading.Event()

def wait(v):
    gate.wait(120)
    return v

slow = pw.program(lambda v: jax.pure_callback(wait, jax.ShapeDtypeStruct(v.shape, v.dtype), v) + 1)
step = pw.program(lambda v: v * 2)
step(np.arange(4.0, dtype=np.float32)).result()
placed = pw.program(lambda v: v * 2, devices=pw.devices(mesh={"x": 2}))
x = jnp.arange(4.0)
placed(x).result()
placed(np.arange(4.0, dtype=np.float32)).result()  # the child's call: traced here
pending = slow(np.arange(4.0, dtype=np.float32))  # its run still queued at the fork

def in_child(case):
    if case == "compiled signature":  # on a slice, traced and compiled in the parent
        placed(np.arange(4.0, dtype=np.float32)).result(timeout=20)
    elif case == "new signature":  # traced and compiled in the child: JAX's compiler hangs there
        step(np.arange(5.0, dtype=np.float32)).result(timeout=20)
    elif case == "lower":
        step.lower(np.arange(6.0, dtype=np.float32))
    elif case == "pending future":  # its run would never be dispatched here
        pending.result()
    elif case == "new cluster":
        pw.shutdown(timeout=5)
        pw.init(num_cpu_devices=4)
        step(np.arange(4.0, dtype=np.float32)).result(timeout=20)

for case in ("compiled signature", "pending future", "new signature", "lower", "new cluster"):
    pid = os.fork()
    if pid == 0:
        faulthandler.dump_traceback_later(30, exit=True)  # a hang ends the child with 1
        try:
            in_child(case)
            os._exit(3)  # it ran
        except pw.errors.ClusterError as exc:
            os._exit(0 if "forked" in str(exc) and "'spawn'" in str(exc) else 4)
        except BaseException:
            os._exit(5)
    _, status = os.waitpid(pid, 0)
    print(case, "->", os.waitstatus_to_exitcode(status), flush=True)
gate.set()
print("parent", pending.result(timeout=60).tolist(), step(np.arange(5.0, dtype=np.float32)).result().tolist())
print("placed", placed(x + 2).result().tolist() == jax.jit(lambda v: v * 2)(x + 2).tolist())
"""


@pytest.mark.timeout(200)
def test_a_forked_child_is_told_it_cannot_run_programs_whatever_it_calls():
    # Before: only a call of a signature already compiled in the parent said so; a new signature,
    # program.lower, a future still queued at the fork and a cluster started anew in the child hung
    # for ever (JAX's compiler, and the wait for a dispatch no thread would make, never return).
    # The parent's programs go on, with jax.jit's results.
    done = run_source(_FORKED_CHILD, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in ("compiled signature", "pending future", "new signature", "lower", "new cluster"):
        assert f"{case} -> 0" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "parent [1.0, 2.0, 3.0, 4.0] [0.0, 2.0, 4.0, 6.0, 8.0]" in done.stdout, done.stdout
    assert "placed True" in done.stdout, done.stdout


@pytest.mark.timeout(120)
def test_abstract_uses_of_a_future_still_computing_wait_for_nothing():
    # A notebook user looks at the shapes of the next step while a run is in flight, as they would
    # of a jax.Array still computing. Before: each of these waited for the run to finish, because
    # JAX reads an argument's abstract value and format, which the future took from its array.
    s = pw.devices(mesh={"x": 1})
    slow, gate, entered = gated(s, plus=1.0)
    fut = slow(jnp.arange(4.0))
    try:
        assert entered.wait(60)
        add = pw.program(lambda v: v * 2 + 1)
        g = jax.jit(lambda v: jnp.tanh(v).sum())
        want = jax.ShapeDtypeStruct((4,), jnp.float32)
        assert add.eval_shape(fut) == jax.eval_shape(lambda v: v * 2 + 1, want)
        assert jax.eval_shape(g, fut) == jax.eval_shape(g, want)
        assert str(jax.make_jaxpr(g)(fut)) == str(jax.make_jaxpr(g)(want))
        lowered = g.lower(fut)
        add.lower(fut)
        assert not fut.done(), "an abstract use waited for the run"
    finally:
        gate.set()
    x = jnp.arange(4.0) + 1.0
    assert_matches(fut, x)
    assert_matches(g(fut), g(x))
    assert_matches(lowered.compile()(fut.result()), g(x))
    assert_matches(add(fut), x * 2 + 1)
    s.release()


_DELETE_WHILE_THE_WATCHER_ASKS = """
import dis, sys, threading, time
import jax, jax.numpy as jnp
import pathways_jax as pw

reads = {}  # code -> offsets of its instructions that read an attribute named is_ready

def reads_is_ready(frame):
    code = frame.f_code
    if code not in reads:
        reads[code] = {
            i.offset for i in dis.get_instructions(code) if i.opname.startswith("LOAD_") and i.argval == "is_ready"
        }
    return frame.f_lasti in reads[code]

def on_opcode(frame, event, arg):
    # A thread switch can happen between any two bytecodes: here, the one just before the runtime's
    # thread reads is_ready, where the user deletes the run's output (held open until it has).
    if frame.f_code.co_qualname != asker or not armed.is_set():
        return on_opcode
    if event == "opcode" and not asked.is_set() and reads_is_ready(frame):
        asked.set()
        deleted.wait(30)
    elif event == "return" and asked.is_set():
        went_on.set()
    return on_opcode

def on_call(frame, event, arg):
    if threading.current_thread().name != thread or "pathways_jax" not in frame.f_code.co_filename:
        return None
    frame.f_trace_opcodes = True
    return on_opcode

threading.settrace(on_call)  # the runtime's threads start after it
for case in sys.argv[1:]:  # each on a cluster of its own, one after the other
    thread, asker = case.split(":")  # the runtime's thread that asks, and the function it asks in
    armed, asked, deleted, went_on = (threading.Event() for _ in range(4))
    pw.init(num_cpu_devices=4)
    step = pw.program(lambda v: v * 2)
    x = jax.device_put(jnp.arange(4.0), jax.devices()[1])  # committed: result() is the run's own array
    step(x).result()
    controller = pw.cluster().controller
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (controller.accounting.idle() and not controller.windows.markers()):
        time.sleep(0.01)  # done with the first run (accounted, and out of its window): next, the second
    armed.set()
    out = step(x)
    assert asked.wait(30), f"the runtime's thread {thread} never asked"
    value = out.result()
    value.delete()  # as jax.jit(..., donate_argnums=0)(value) would
    deleted.set()
    assert went_on.wait(30), f"the runtime's thread {thread} never went on"
    print("next", thread, step(x).result().tolist(), flush=True)
    pw.shutdown()
    print("shut down", thread, flush=True)
"""

_ASKERS = [
    ("pathways-accounting", "settled"),  # the watcher, about a run's outputs
    ("pathways-controller", "LocalBackend.settle"),  # the controller, about its windows once idle
]


@pytest.fixture(scope="module")
def watcher_runs():
    """Every case in one process (a Python and JAX start costs seconds), each on a cluster of its own."""
    return run_source(_DELETE_WHILE_THE_WATCHER_ASKS, *(f"{t}:{a}" for t, a in _ASKERS), timeout=110)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("thread, asker", _ASKERS)
def test_deleting_a_result_while_the_accounting_watcher_asks_about_it_does_not_crash(
    watcher_runs, thread, asker
):
    # The watcher asked the user's own jax.Array is_deleted() then is_ready(): a delete() (or
    # donation) on another thread between the two crashed the process with a segfault in XLA
    # (about one run of test_dropin_values.py in four under load). The controller asks so too.
    done = watcher_runs
    said = done.stdout + done.stderr[-3000:]
    assert f"next {thread} [0.0, 2.0, 4.0, 6.0]" in done.stdout, (done.returncode, said)
    assert f"shut down {thread}" in done.stdout, (done.returncode, said)
    if (thread, asker) == _ASKERS[-1]:
        assert done.returncode == 0, (done.returncode, said)


class _Preempted(BaseException):  # as SystemExit: what a preemption handler raises
    pass


@pytest.mark.timeout(150)
def test_shutdown_in_a_signal_handler_that_lands_in_a_dispatch_returns_at_once():
    # A preemption handler (SIGTERM: save, pw.shutdown(), exit) that lands while the main thread
    # dispatches its own run waited for that very dispatch, which could only go on once the handler
    # returned: it spent shutdown's whole timeout (60 s by default, past a preemption's notice).
    pw.init(num_cpu_devices=8)
    step = pw.program(lambda v: v * 0.5 + 1)
    x = jnp.arange(8.0)
    step(x).result()
    dispatching = pw.cluster().controller._dispatch
    started, took = [], []

    def on_signal(signum, frame):
        names = set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        if started or "_try_inline" not in names or not dispatching.locked():
            return  # not inside this thread's own dispatch (or inside this handler): the next one
        started.append(True)
        start = time.monotonic()
        pw.shutdown(timeout=60)
        took.append(time.monotonic() - start)
        raise _Preempted

    stop = threading.Event()

    def signaller():
        rng = random.Random(0)
        while not stop.is_set():
            time.sleep(rng.uniform(0, 5e-4))  # lands anywhere, dispatch included
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    thread = threading.Thread(target=signaller, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        with contextlib.suppress(_Preempted):
            while time.monotonic() < deadline:
                step(x)
    finally:
        stop.set()
        thread.join(10)
        signal.signal(signal.SIGUSR1, previous)
    assert took, "no signal landed inside a dispatch"
    assert took[0] < 30, f"pw.shutdown(timeout=60) took {took[0]:.1f}s"
    with pytest.raises(pw.errors.ClusterError, match=r"pw\.init"):
        step(x)


def test_shutdown_in_a_host_callback_stops_the_cluster_without_an_error():
    # On the controller's thread it joined that very thread: "cannot join current thread".
    pw.init(num_cpu_devices=8)
    seen = []

    def stop_here(v):
        try:
            pw.shutdown(timeout=30)
            seen.append("stopped")
        except Exception as exc:
            seen.append(repr(exc))
        return v

    step = pw.program(lambda v: jax.pure_callback(stop_here, jax.ShapeDtypeStruct(v.shape, v.dtype), v) + 1)
    assert_matches(step(jnp.arange(4.0)), jnp.arange(4.0) + 1)
    assert seen == ["stopped"]
    with pytest.raises(pw.errors.ClusterError, match=r"pw\.init"):
        step(jnp.arange(4.0))
