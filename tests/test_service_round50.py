"""Client processes written from the README alone, ending at any moment (round 50).

One service (one host of two devices) serves the module's service tests: a service start costs
seconds. Results are compared with plain ``jax.jit`` on the same inputs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw
from pathways_jax._src.runtime import clusters
from pathways_jax._src.runtime import context as context_lib

pytestmark = pytest.mark.timeout(180)

SERVICE = "test-round50"


@pytest.fixture(scope="module")
def service(ray_cluster):
    svc = pw.serve(SERVICE, hosts=1, devices_per_host=2)
    try:
        yield svc
    finally:
        pw.shutdown()
        svc.stop()


def _slow(v):
    return jax.lax.fori_loop(0, 30000, lambda i, u: jnp.sin(u) + 1.0, v)


def test_a_client_exiting_with_a_long_queue_leaves_at_once(service, monkeypatch):
    # The README: a service client's exit leaves the service at once, as pw.shutdown() does, "so a
    # process that ends with 1,000 runs queued exits in a second or two". The exit hook first
    # waited for the runs queued here to finish (as the local backend does, for their host
    # callbacks' side effects): each was sent only for the service to drop it as the process left,
    # a window at a time behind the hosts' work; the exit took up to its minute.
    pw.init(backend="ray", address=service.address, service=service.name, client_name="exits")
    slow = pw.jit(_slow, devices=pw.devices(mesh={"x": 1}))
    x = jnp.ones(256)
    np.testing.assert_array_equal(slow(x).result(timeout=60), jax.jit(_slow)(x))
    queued = [slow(x) for _ in range(1000)]
    monkeypatch.setattr(context_lib, "exiting", False)  # the hook marks the process as exiting
    started = time.monotonic()
    clusters._shutdown_at_exit()
    took = time.monotonic() - started
    context_lib.exiting = False
    assert took < 5.0, took
    with pytest.raises(pw.errors.ClusterError, match="this process left the controller service"):
        queued[-1].result(timeout=10)


def test_a_chain_of_runs_behind_a_failure_says_the_first_failure_once(caplog):
    # A loop of steps queued behind one that fails (a host callback raising, a host lost): each
    # step's error was 'run N got an input from a failed run: ' + the previous step's whole error +
    # the cause's text again, and each was logged as a WARNING: 1,000 steps held about 1.2 GB of
    # messages, and the log as much.
    pw.init(num_cpu_devices=8)
    fail = [False]

    def maybe_raise(v):
        if fail[0]:
            fail[0] = False
            raise ValueError("the callback failed")
        return v

    def fn(v):
        return jax.pure_callback(maybe_raise, jax.ShapeDtypeStruct(v.shape, v.dtype), v) + 1

    step = pw.jit(fn, devices=pw.devices(mesh={"x": 1}))
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(step(x).result(timeout=30), jax.jit(fn)(x))
    fail[0] = True
    first = step(x)
    with pytest.raises(pw.errors.ProgramFailedError) as failed:
        first.result(timeout=30)
    root = str(failed.value)
    fail[0] = True
    v = x
    caplog.clear()
    with caplog.at_level("WARNING"):
        for _ in range(200):
            v = step(v)
        with pytest.raises(pw.errors.ProgramFailedError, match="got an input from a failed run") as last:
            v.result(timeout=30)
    message = str(last.value)
    assert "the callback failed" in message
    assert len(message) < len(root) + 200, len(message)
    assert sum(r.getMessage().startswith("program 'fn' run") for r in caplog.records) == 1
    # The next call is served.
    np.testing.assert_array_equal(step(x).result(timeout=30), jax.jit(fn)(x))


def test_leaving_a_service_that_is_gone_ends_the_ray_session_the_join_made(service, monkeypatch):
    # A service pw.serve started without a Ray cluster takes the cluster it started along when its
    # process ends. A client whose join had connected it to that cluster did what the README says
    # (pw.shutdown(), start the service again, pw.init) and was killed by Ray a minute later ("Failed
    # to connect to GCS within 60 seconds", exit status 1), still connected to the dead cluster.
    # Its close now ends the Ray session its join made when the service is gone; a session of the
    # user's own (this test process's) is left alone while its cluster lives.
    import ray

    from pathways_jax._src.backends import service_client

    ended: list[bool] = []
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: ended.append(True))
    for made_by_the_join in (False, True):
        cluster = pw.init(backend="ray", address=service.address, service=service.name, client_name="gone")
        backend = cluster.backend
        if made_by_the_join:
            joined = {str(ray.get_runtime_context().gcs_address)}
            monkeypatch.setattr(service_client, "_JOINED_RAY", joined, raising=False)
        f = pw.jit(lambda v: v * 3, devices=pw.devices(mesh={"x": 1}))
        x = jnp.arange(3.0)
        np.testing.assert_array_equal(f(x).result(timeout=60), jax.jit(lambda v: v * 3)(x))
        backend._gone("its Ray actor died: ActorDiedError")  # as the health monitor finds it
        with pytest.raises(pw.errors.ClusterError, match="is gone"):
            f(x).result(timeout=10)
        pw.shutdown()
        assert ended == ([True] if made_by_the_join else []), made_by_the_join


def test_a_read_cut_short_by_the_close_says_the_cluster_closed_not_that_a_host_died(ray_cluster, monkeypatch):
    # A daemon thread reading a large value as the process exits (or another thread calls
    # pw.shutdown()): the close kills the hosts, and the read said "HostLostError: ... island 0
    # (host 0), which was lost: it died ... calling the program again runs there".
    import concurrent.futures
    import threading

    pw.init(backend="ray", hosts=1, devices_per_host=1)
    f = pw.jit(lambda v: v * 2 + 1, devices=pw.devices(mesh={"x": 1}))
    x = np.arange(4096, dtype=np.float32)
    out = f(x)
    np.testing.assert_array_equal(f(x).result(timeout=60), jax.jit(lambda v: v * 2 + 1)(x))
    route = pw.cluster().backend.dispatcher.route
    real = route.message
    asked = threading.Event()
    closed = threading.Event()

    def after_the_close(host, kind, args):  # the fetch reaches the host as the close kills it
        if kind != "fetch":
            return real(host, kind, args)
        late: concurrent.futures.Future = concurrent.futures.Future()

        def send() -> None:
            closed.wait(30)
            try:
                late.set_result(real(host, kind, args).result(timeout=30))
            except Exception as exc:
                late.set_exception(exc)

        threading.Thread(target=send, daemon=True).start()
        asked.set()
        return late

    monkeypatch.setattr(route, "message", after_the_close)
    seen: list[BaseException] = []

    def read() -> None:
        try:
            out.result(timeout=60)
        except BaseException as exc:
            seen.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert asked.wait(30)
    pw.shutdown()
    closed.set()
    reader.join(60)
    assert len(seen) == 1 and type(seen[0]) is pw.errors.ClusterError, seen
    assert "shut down" in str(seen[0]), seen


def test_a_client_a_stopping_service_dropped_is_told_to_start_it_again(service):
    # A service that stops drops its clients ("the service stopped") before it goes: their reads
    # said "Call pw.shutdown() and pw.init(...) to join it again", of a service that is no more.
    pw.init(backend="ray", address=service.address, service=service.name, client_name="dropped")
    try:
        route = pw.cluster().backend.route
        said = route.dropped_message("the service stopped")
        assert said.endswith("Call pw.shutdown(), start the service again and pw.init(...) to join it."), said
        said = route.dropped_message("its channel sent nothing")  # a service that runs on
        assert said.endswith("Call pw.shutdown() and pw.init(...) to join it again."), said
    finally:
        pw.shutdown()


def test_a_ctrl_c_as_ray_init_runs_waits_for_it_to_return(monkeypatch):
    # A Ctrl-C landing in ray.init as Ray builds its core worker (pw.init joining a cluster or a
    # service) left Ray half made: the next pw.init aborted the whole process in Ray's native code
    # ("An unexpected system state has occurred"), a notebook's kernel with it. It waits until
    # ray.init returned now, then raises as it would have; a second Ctrl-C raises at once.
    import os
    import signal

    import ray

    from pathways_jax._src.backends import service_client

    done: list[bool] = []

    def init(**kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # pressed while Ray starts its worker
        for _ in range(1000):  # a signal's handler runs between bytecodes: soon
            pass
        done.append(True)

    # The hold acts only under Python's own handler (a handler of the user's is left to do its
    # work): set here, as a fresh process has it, whatever an earlier test of the suite's left.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_in_ray_init(monkeypatch, ray, service_client, init, done)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_in_ray_init(monkeypatch, ray, service_client, init, done) -> None:
    import os
    import signal

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(service_client, "check_reachable", lambda address: None)
    monkeypatch.setattr(service_client, "send_saved_token", lambda address: None)
    with pytest.raises(KeyboardInterrupt):
        service_client.connect("192.0.2.1:6379")
    assert done == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def pressed_twice(**kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
        done.append(True)

    monkeypatch.setattr(ray, "init", pressed_twice)
    with pytest.raises(KeyboardInterrupt):
        service_client.connect("192.0.2.1:6379")
    assert done == [True]  # the second press did not wait
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_exit_waits_for_a_daemon_thread_compiling_a_program(monkeypatch):
    # A background thread (daemon) calling a new program as the main thread ended: the exit hook
    # closed the cluster and the interpreter finalised while the thread was inside XLA's compiler,
    # which aborted the process ("terminate called after throwing an instance of ''", status 134).
    # The hook now waits for the compile; the call returns and runs, and the thread is held after.
    import threading

    from pathways_jax._src.compile import node_compiler

    pw.init(num_cpu_devices=8)
    real = node_compiler.compile_node
    compiling = threading.Event()
    go = threading.Event()

    def slowly(*args, **kwargs):
        compiling.set()
        go.wait(30)  # the compile, long enough for the main thread to end meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(node_compiler, "compile_node", slowly)
    f = pw.jit(lambda v: jnp.sin(v) * 3 + 1, devices=pw.devices(mesh={"x": 1}))
    x = jnp.arange(4.0)
    got: list = []
    thread = threading.Thread(target=lambda: got.append(f(x).result(timeout=30)), daemon=True)
    thread.start()
    assert compiling.wait(30)
    timer = threading.Timer(0.3, go.set)
    timer.start()
    monkeypatch.setattr(context_lib, "exiting", False)  # the hook marks the process as exiting
    clusters._shutdown_at_exit()
    context_lib.exiting = False
    assert go.is_set()  # the hook returned only once the compile had
    thread.join(30)
    np.testing.assert_array_equal(got[0], jax.jit(lambda v: jnp.sin(v) * 3 + 1)(x))
