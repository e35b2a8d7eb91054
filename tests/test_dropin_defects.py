"""Drop-in defects of the local backend, each against plain ``jax.jit`` on the same inputs.

Tests that must control the process (its CPU device count, its import order,
an abort inside XLA) run their program in a fresh interpreter.
"""

import functools
import json
import os
import subprocess
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, run_source
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_jax as pw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(source: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Runs ``source`` in a fresh interpreter (8 CPU devices); fails the test on a hang or a crash."""
    try:
        proc = run_source(source, *args, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the program did not finish within {timeout}s (a hang):\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, (
        f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return proc


# --- 1. Donation and the in-flight window --------------------------------------------------

_DATA_PARALLEL = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import pathways_jax as pw

steps = int(sys.argv[1])
pw.init(num_cpu_devices=8)
mesh = jax.make_mesh((8,), ("batch",))

def update(w, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - 1.0) ** 2))(w)
    return w - 0.1 * grad, loss

x = jax.device_put(jnp.linspace(-1.0, 1.0, 64).reshape(16, 4), NamedSharding(mesh, P("batch")))
for name, step in [
    ("outer", pw.program(update, donate_argnums=0)),
    ("inner", pw.program(jax.jit(update, donate_argnums=0))),
    ("set_mesh", None),
]:
    w = jax.device_put(np.full((4, 4), 0.1, np.float32), NamedSharding(mesh, P()))
    losses = []
    if step is None:  # a pure drop-in: @pw.program where @jax.jit stood, under jax.set_mesh
        with jax.set_mesh(mesh):
            step = pw.program(update, donate_argnums=0)
            for _ in range(steps):
                w, loss = step(w, x)
                losses.append(loss)
    else:
        for _ in range(steps):
            w, loss = step(w, x)
            losses.append(loss)
    # Every run's loss too: a run whose donated output was waited for as the donation took
    # it was reported failed ("BlockHostUntilReady() called on deleted or donated buffer").
    result = [np.asarray(w.result(timeout=60)).tolist(), [float(v.result(timeout=60)) for v in losses]]
    print(name, json.dumps(result), flush=True)
"""


@pytest.mark.timeout(150)
def test_a_donating_data_parallel_step_called_in_a_loop_stays_inside_the_in_flight_window():
    # Each call's output is the next call's donated input: a window that tracked runs by
    # it saw every run but the newest as done, let hundreds of all-reduces into XLA, and
    # the process aborted in XLA's rendezvous (before the fix: 6 of 6 runs hung at 500
    # steps, 3 of 3 at 400, within the first loop).
    steps = 400
    proc = _run_python(_DATA_PARALLEL, str(steps), timeout=120)
    mesh = jax.make_mesh((8,), ("batch",))
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 64).reshape(16, 4), NamedSharding(mesh, P("batch")))

    @functools.partial(jax.jit, donate_argnums=0)
    def update(w, x):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - 1.0) ** 2))(w)
        return w - 0.1 * grad, loss

    w = jax.device_put(np.full((4, 4), 0.1, np.float32), NamedSharding(mesh, P()))
    losses = []
    for i in range(steps):
        w, loss = update(w, x)
        losses.append(loss)
        if i % 8 == 7:  # jax.jit itself deadlocks with that many all-reduces in flight
            w.block_until_ready()
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert sorted(lines) == ["inner", "outer", "set_mesh"]
    for name, got in lines.items():
        got_w, got_losses = json.loads(got)
        np.testing.assert_allclose(
            np.array(got_w, np.float32), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=name
        )
        np.testing.assert_allclose(got_losses, [float(v) for v in losses], rtol=1e-5, atol=1e-6, err_msg=name)


# --- 4. pw.jit of a jax.jit function donates as it does ---------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options", [{"donate_argnums": 0}, {"donate_argnames": "x"}], ids=["argnums", "argnames"]
)
def test_pw_jit_of_a_donating_jax_jit_deletes_its_input_as_jax_jit_does(options):
    import pathways_jax as pw

    def f(x, y):
        return x * 2 + y, y - 1

    want_jit = jax.jit(f, **options)
    got_jit = pw.jit(jax.jit(f, **options))
    for step in range(2):  # the first call traces, the second takes the cached plan
        x, y = jnp.arange(8.0) + step, jnp.ones(8)
        want = want_jit(x, y)
        assert x.is_deleted() and not y.is_deleted()
        x = jnp.arange(8.0) + step
        got = got_jit(x, y)
        assert x.is_deleted(), "pw.jit(jax.jit(f, donate_...)) left its donated input alive"
        assert not y.is_deleted()
        for g, w in zip(got, want, strict=True):
            value = g.result(timeout=30)
            assert (value.shape, value.dtype) == (w.shape, w.dtype)
            np.testing.assert_array_equal(np.asarray(value), np.asarray(w))


# --- 2. Orbax imported after the first program call --------------------------------------

_ORBAX_AFTER_THE_FIRST_CALL = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
import pathways_jax as pw

assert "orbax.checkpoint" not in sys.modules
s = pw.devices(mesh={"x": 2})
step = pw.jit(lambda w, b: {"w": w * 2 + 1, "b": b - w.sum()}, devices=s, in_specs=(pw.P("x"), None))
state = step(jnp.arange(8.0), jnp.float32(3.0))
state["w"].result()
import orbax.checkpoint as ocp  # only now, after the program was traced and called

ckpt = ocp.StandardCheckpointer()
ckpt.save(sys.argv[1], state)
ckpt.wait_until_finished()
restored = ckpt.restore(sys.argv[1], state)  # a target of futures: their shapes, dtypes, shardings
print(json.dumps({k: np.asarray(v).tolist() for k, v in restored.items()}))
"""


@pytest.mark.timeout(120)
def test_orbax_imported_after_the_first_program_call_saves_and_restores_futures(tmp_path):
    # Before: "ValueError: Unsupported type: <class '...Future'>" from the save.
    proc = _run_python(_ORBAX_AFTER_THE_FIRST_CALL, str(tmp_path / "ckpt"), timeout=100)
    want = jax.jit(lambda w, b: {"w": w * 2 + 1, "b": b - w.sum()})(jnp.arange(8.0), jnp.float32(3.0))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(got) == ["b", "w"]
    for key in got:
        np.testing.assert_array_equal(np.asarray(got[key], np.float32), np.asarray(want[key]))


# --- 5. Queued host inputs under a memory budget are bounded in bytes ----------------------


@pytest.mark.timeout(120)
def test_queued_host_inputs_under_a_memory_budget_stay_within_a_byte_bound():
    import threading

    import pathways_jax as pw
    from pathways_jax._src.runtime import submission
    from tests.helpers import wait_for

    budget = 1 << 20  # per device: 8 MiB over the cluster, the bound on staged host inputs
    cl = pw.init(num_cpu_devices=8, memory_budget=budget, backpressure_timeout=60.0)
    s = pw.devices(mesh={"x": 1})
    fill = pw.jit(lambda: jnp.zeros(budget // 4, jnp.int32), devices=s)
    step = pw.jit(lambda x, i: (x * 2 + i).sum(), devices=s)
    inputs = [np.arange(16384, dtype=np.int32) + i for i in range(200)]  # 64 KiB each, 12.5 MiB in all
    reference = jax.jit(lambda x, i: (x * 2 + i).sum())
    want = [reference(x, i) for i, x in enumerate(inputs)]
    got: list = []

    def submit():
        got.extend(step(x, i) for i, x in enumerate(inputs))

    held = fill()  # the device's whole budget: no run is admitted, every call queues
    held.result(timeout=30)
    thread = threading.Thread(target=submit, daemon=True)
    thread.start()
    staging = lambda: getattr(submission, "host_staging", lambda _: None)(cl)  # noqa: E731
    # Either all 200 calls queue (no bound: 12.5 MiB of copies held) or the caller waits
    # for room at the bound.
    assert wait_for(lambda: not thread.is_alive() or (staging() is not None and staging().waits > 0), 30)
    with cl.controller._lock:  # what the queued runs hold, counted apart from the bound's own counter
        queued_bytes = sum(
            value.nbytes
            for queue in cl.controller._queues.values()
            for run in queue
            for value in run.env
            if isinstance(value, np.ndarray)
        )
    bound = 8 * budget
    assert 0 < queued_bytes <= bound, f"{queued_bytes} bytes held by queued calls, bound {bound}"
    assert staging().held <= bound and staging().waits >= 1
    del held  # the budget frees: the queued runs are admitted and the caller goes on
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert staging().peak <= bound
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        value = g.result(timeout=60)
        assert (value.shape, value.dtype) == (w.shape, w.dtype)
        assert int(value) == int(w)
    assert staging().held == 0  # every run was admitted: its copies left the bound then


# --- 6. Deleting a future that runs read ----------------------------------------------------


_DELETE_WHILE_READ = """
import json, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
import pathways_jax as pw

def slow(v):
    time.sleep(0.2)
    return v

def double(x):
    return jax.pure_callback(slow, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2

value = pw.program(lambda: jnp.arange(4.0) + 1)()
value.result()
outs = [pw.program(double)(value) for _ in range(3)]  # one running its callback, two queued
value.delete()
print(json.dumps({
    "outs": [np.asarray(o).tolist() for o in outs],
    "expected": np.asarray(jax.jit(double)(jnp.arange(4.0) + 1)).tolist(),
    "deleted": value.is_deleted(),
}))
"""


@pytest.mark.timeout(120)
def test_deleting_a_future_that_runs_read_lets_them_finish_as_jax_array_delete_does():
    # delete() hung: it deleted the buffer inside XLA, holding the interpreter lock, while a
    # run's host callback that reads it waited for that lock; and queued runs then failed.
    result = json.loads(_run_python(_DELETE_WHILE_READ, timeout=60).stdout.strip().splitlines()[-1])
    assert result["outs"] == [result["expected"]] * 3
    assert result["deleted"] is True


# --- 7. A jax.Array deleted or donated before its queued run was dispatched ------------------


@pytest.mark.timeout(60)
def test_an_argument_deleted_before_its_queued_run_is_dispatched_fails_that_run_saying_why():
    # A queued run reads the caller's arrays at dispatch (jax.jit's call holds them from the
    # call on): donating one to a jax.jit call in between fails the run, with an error that
    # says so, and the controller keeps serving.
    gate = threading.Event()

    def held(x):
        jax.debug.callback(lambda v: gate.wait(30), x)  # the controller's thread waits here
        return x + 1

    def evaluate(w, x):
        return jnp.tanh(x @ w).sum()

    update = jax.jit(lambda w, x: w - 0.01 * (x.T @ jnp.tanh(x @ w)), donate_argnums=0)
    x, w = jnp.ones((8, 4)), jnp.full((4, 4), 0.1)
    want = float(jax.jit(evaluate)(w, x))
    first = pw.program(held)(jnp.zeros(2))  # dispatched by the controller's thread, which waits
    loss = pw.program(evaluate)(w, x)  # queued behind it
    w = update(w, x)  # donates the array the queued run reads
    gate.set()
    with pytest.raises(
        pw.errors.ProgramFailedError, match=r"argument 0 of the call \(float32\[4,4\]\)"
    ) as info:
        loss.result(timeout=30)
    assert isinstance(info.value, RuntimeError) and "deleted or donated" in str(info.value)
    assert_matches(first, jnp.ones(2))
    # Kept until the run is done, the array is read as it was.
    w = jnp.full((4, 4), 0.1)
    loss = pw.program(evaluate)(w, x)
    jax.block_until_ready(loss)
    w = update(w, x)
    assert float(loss) == want
