"""Drop-in idioms third-party code uses with ``jax.jit``, under ``@pw.program`` and ``pw.jit``.

Each test runs the same code under plain ``jax.jit`` and pathways_jax on identical
inputs and compares the results (and what happens to the inputs).
"""

import enum
import functools
import os
import pickle
import subprocess
import sys
import warnings

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)


class Scaler:
    """A class whose methods are jitted with ``self`` static (hashable by its factor)."""

    def __init__(self, k):
        self.k = k

    def __hash__(self):
        return hash(self.k)

    def __eq__(self, other):
        return isinstance(other, Scaler) and other.k == self.k

    @functools.partial(jax.jit, static_argnums=0)
    def by_jax(self, a):
        return a * self.k

    @functools.partial(pw.program, static_argnums=0)
    def by_program(self, a):
        return a * self.k

    @functools.partial(pw.jit, static_argnums=0)
    def by_pw_jit(self, a):
        return a * self.k + 1


@flax.struct.dataclass
class Linear:
    """A pytree whose method is jitted with ``self`` traced (its arrays are arguments)."""

    w: jax.Array

    @jax.jit
    def by_jax(self, x):
        return x @ self.w

    @pw.program
    def by_program(self, x):
        return x @ self.w


def test_programs_and_pw_jit_bind_self_as_methods_like_jax_jit():
    x = jnp.arange(3.0)
    s = pw.devices(mesh={"x": 1})
    for k in (2.0, 3.0):
        assert_matches(Scaler(k).by_program(x), Scaler(k).by_jax(x))
        with s:  # pw.jit without devices= runs on the enclosing slice
            assert_matches(Scaler(k).by_pw_jit(x), Scaler(k).by_jax(x) + 1)
    s.release()
    w = jnp.arange(6.0).reshape(3, 2)
    assert_matches(Linear(w).by_program(x), Linear(w).by_jax(x))
    assert_matches(Linear(w * 2).by_program(x), Linear(w * 2).by_jax(x))
    # On the class, the program itself: self passed by hand, as with jax.jit.
    assert_matches(Linear.by_program(Linear(w), x), Linear.by_jax(Linear(w), x))
    assert isinstance(Linear.by_program, pw.Program)
    pw.reset_counters()
    Linear(w + 1).by_program(x)  # another instance of the same structure: no new trace
    assert pw.counters()["traces"] == 0


def _update(p, g):
    return p - 0.1 * g


_ONES = np.ones(2, np.float32)


def _scaled_default(p=_ONES, g=1.0):
    return p * g


@pytest.mark.parametrize("options", [{"donate_argnames": "p"}, {"donate_argnums": 0}], ids=["names", "nums"])
def test_a_donated_parameter_passed_by_keyword_is_donated_as_under_jax_jit(options):
    results, deleted = [], []
    for make in (jax.jit, pw.program):
        p, g = jnp.ones(8), jnp.ones(8)
        results.append(np.asarray(make(_update, **options)(p=p, g=g)))
        deleted.append((p.is_deleted(), g.is_deleted()))
    np.testing.assert_array_equal(results[1], results[0])
    assert deleted[1] == deleted[0] == (True, False)
    # By position too; a keyword call that leaves nothing to donate is not an error.
    p = jnp.ones(8)
    assert_matches(pw.program(_update, **options)(p, jnp.ones(8)), jax.jit(_update)(jnp.ones(8), jnp.ones(8)))
    assert p.is_deleted()
    assert_matches(pw.program(_scaled_default, **options)(g=jnp.float32(2.0)), 2 * _ONES)


def test_futures_answer_the_jax_array_attributes_code_uses():
    s = pw.devices(mesh={"x": 2})
    f = pw.program(lambda v: v * 2, devices=s)
    x = jax.device_put(jnp.arange(4.0), s.sharding("x"))
    fut, arr = f(x), jax.jit(lambda v: v * 2)(x)
    # Known at once, without waiting.
    assert fut.devices() == arr.devices() and len(fut.devices()) == 2
    assert fut.is_fully_replicated == arr.is_fully_replicated is False
    assert fut.aval == arr.aval
    assert not fut.is_deleted()
    # The rest waits for the value.
    assert fut.committed == arr.committed
    assert fut.on_device_size_in_bytes() == arr.on_device_size_in_bytes()
    assert [sh.index for sh in fut.addressable_shards] == [sh.index for sh in arr.addressable_shards]
    for i in range(2):
        np.testing.assert_array_equal(fut.addressable_data(i), arr.addressable_data(i))
    fut.copy_to_host_async()  # the async-logging idiom: start the copy, read later
    np.testing.assert_array_equal(np.asarray(fut), np.asarray(arr))
    # Pickled as the array it stands for.
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(fut)), np.asarray(arr))
    # delete() frees it, as jax.Array.delete() does.
    fut.delete()
    assert fut.is_deleted()
    with pytest.raises(pw.errors.PathwaysError, match="freed"):
        fut.result(timeout=10)
    s.release()


_EXIT_WITH_QUEUED_SIDE_EFFECTS = """
import sys, time
import pathways_jax as pw
pw.init(num_cpu_devices=2)
import jax, jax.numpy as jnp
from jax.experimental import io_callback

def write(v):
    time.sleep(0.005)
    with open(sys.argv[1], "a") as fh:
        fh.write(f"{float(v)}\\n")
    return v

@pw.program
def step(x):
    return io_callback(write, jax.ShapeDtypeStruct((), jnp.float32), x + 1, ordered=True)

x = jnp.float32(0)
for _ in range(40):
    x = step(x)
print("submitted", flush=True)
"""


def _run_script(tmp_path, text: str, *args: str) -> subprocess.CompletedProcess:
    """``text`` run as a script of its own (its own device count, its own exit), with ``args``."""
    script = tmp_path / "script.py"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=100, env=env
    )


def test_runs_queued_at_exit_without_shutdown_still_run_as_jax_jit_calls_would(tmp_path):
    # A script that ends right after queueing steps with side effects (logging, checkpoints):
    # under jax.jit every call was dispatched and its callback runs; so under pathways_jax.
    log = tmp_path / "log.txt"
    done = _run_script(tmp_path, _EXIT_WITH_QUEUED_SIDE_EFFECTS, str(log))
    assert "submitted" in done.stdout and done.returncode == 0, done.stderr[-2000:]
    assert log.read_text().split() == [f"{float(i)}" for i in range(1, 41)]
    assert "cancelled" not in done.stderr, done.stderr[-2000:]


_EXIT_HOOK_BEFORE_IMPORT = """
import atexit, os, sys, threading
seen = []

def check():  # runs last
    print("seen", seen, "threads", sorted(t.name for t in threading.enumerate()), flush=True)

def hook():  # registered before pathways_jax was imported: runs after its exit hook
    step(jnp.float32(99))  # its result not read: a last log line
    print("twice", float(step(step(early)).result()), flush=True)

atexit.register(check)
atexit.register(hook)

import jax, jax.numpy as jnp, numpy as np
import pathways_jax as pw
from jax.experimental import io_callback

def record(v):
    seen.append(float(v))
    return v

@pw.program
def step(x):
    return io_callback(record, jax.ShapeDtypeStruct((), jnp.float32), x) * 2

early = step(jnp.float32(1))
early.result()
"""


def test_a_program_called_by_an_exit_hook_after_pathways_jaxs_runs_as_jax_jit_would(tmp_path):
    # Exit hooks run last first: one registered before the import runs after pathways_jax's
    # (which stopped the controller). Its calls ran on a new default cluster nothing stopped:
    # their callbacks were lost, and the process sometimes aborted as it finalised.
    for _ in range(2):
        done = _run_script(tmp_path, _EXIT_HOOK_BEFORE_IMPORT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "twice 8.0" in done.stdout, done.stdout + done.stderr[-2000:]
        assert "seen [1.0, 99.0, 2.0, 4.0]" in done.stdout, done.stdout
        assert "pathways" not in done.stdout.split("threads")[1].lower(), done.stdout  # no controller started


_EXIT_WITH_A_DAEMON_THREAD = """
import atexit, sys, threading
joined = []

# Both registered before pathways_jax was imported: they run after its exit hook.
def join_worker():  # waits for the thread
    stop.set()
    go.set()
    worker.join(timeout=30)
    joined.append(not worker.is_alive())
    print("joined", joined, "last", last, flush=True)

def leave_worker():  # lets the thread call programs, and returns without waiting for it
    go.set()

atexit.register(join_worker if sys.argv[1] == "join" else leave_worker)

import jax, jax.numpy as jnp
import pathways_jax as pw
from pathways_jax._src.runtime import context
if sys.argv[1] == "join":  # an exit hook waits for the thread: hold its calls briefly
    context.EXIT_PARK_S = 0.5

@pw.program
def step(x):
    return jnp.tanh(x @ x.T) * 0.5

x = jnp.ones((256, 256)) * 0.01
stop, started, go, last = threading.Event(), threading.Event(), threading.Event(), []

def loop():  # a background loop that never ends by itself (an evaluator, a server)
    y = step(x)
    y.result()
    started.set()
    go.wait()  # pathways_jax's exit hook has run
    while not stop.is_set():
        y = step(y)  # held
        y.result()
    last.append(float(step(x).sum()))  # held, then run in place

worker = threading.Thread(target=loop, daemon=True)
worker.start()
started.wait(60)  # its first call traced and compiled
print("end of main", flush=True)
"""


def test_a_daemon_thread_still_calling_programs_at_exit_does_not_crash_the_process(tmp_path):
    # Plain jax.jit aborts here (a daemon thread inside XLA as the interpreter finalises: "terminate
    # called without an active exception", SIGABRT or SIGSEGV, 4 runs in 5 before this fix). After
    # pathways_jax's exit hook a daemon thread's call is held, so finalisation stops it cleanly.
    # What is promised, exactly: a daemon thread's calls made once that hook ran are held
    # (EXIT_PARK_S, 10 s), and a call under way finishes dispatching or is refused before the hook
    # returns. A thread inside XLA on its own account as the interpreter finalises (a first call
    # still compiling, a buffer being freed) aborts as under jax.jit, so the script lets the first
    # call finish and lets the thread call again only once the hook ran. (Before: the thread called
    # in a loop throughout, and calls were held only 0.5 s: 3 in 20 runs aborted with both cores busy.)
    for _ in range(3):
        done = _run_script(tmp_path, _EXIT_WITH_A_DAEMON_THREAD, "plain")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "end of main" in done.stdout and "Fatal" not in done.stderr, done.stderr[-2000:]
    # An exit hook that waits for such a thread gets it back: its call is held only EXIT_PARK_S,
    # then runs in place, with jax.jit's result.
    done = _run_script(tmp_path, _EXIT_WITH_A_DAEMON_THREAD, "join")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "joined [True]" in done.stdout, done.stdout + done.stderr[-2000:]
    got = float(done.stdout.split("last [")[1].split("]")[0])
    x = jnp.ones((256, 256)) * 0.01
    assert got == pytest.approx(float(jax.jit(lambda x: jnp.tanh(x @ x.T) * 0.5)(x).sum()), rel=1e-6)


def test_program_in_and_out_shardings_place_values_as_jax_jit_does():
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    NS, P = jax.sharding.NamedSharding, jax.sharding.PartitionSpec
    x, y = jnp.arange(64.0).reshape(8, 8), jnp.ones((8, 4))
    cases = [
        (lambda a: a * 2, (x,), {"in_shardings": NS(mesh, P("a", "b"))}),
        (lambda a: a * 2, (x,), {"out_shardings": NS(mesh, P("b", "a"))}),
        (
            lambda a, b: a @ b,
            (x, y),
            {
                "in_shardings": (NS(mesh, P("a", None)), NS(mesh, P(None, "b"))),
                "out_shardings": NS(mesh, P("a", "b")),
            },
        ),
    ]
    for fun, args, options in cases:
        want = jax.jit(fun, **options)(*args)
        got = pw.program(fun, **options)(*args)
        assert got.sharding.spec == want.sharding.spec  # known when the call returns
        assert_matches(got, want)
        assert got.result().sharding == want.sharding


def test_pw_jit_of_a_jax_jit_function_keeps_its_options():
    # pw.jit(jax.jit(f, static_argnums=1)): the jitted function's own options still hold.
    s = pw.devices(mesh={"x": 1})
    inner = jax.jit(lambda v, n: v * n, static_argnums=1)
    outer = pw.jit(inner, devices=s, static_argnums=1)
    assert_matches(outer(jnp.arange(3.0), 3), inner(jnp.arange(3.0), 3))
    assert outer._fun is inner
    s.release()


def test_a_program_inside_the_callers_grad_jit_or_vmap_runs_as_jax_jit():
    # Where @jax.jit stood, the caller may differentiate, jit or vmap the function.
    s = pw.devices(mesh={"x": 1})
    square = pw.jit(lambda v: v * v, devices=s)

    def loss(w, x, scale):
        return jnp.sum(jnp.sin(square(w) * x)) * scale

    ours = pw.program(loss, static_argnums=2)
    theirs = jax.jit(loss, static_argnums=2)
    w, x = jnp.arange(3.0), jnp.linspace(0.0, 1.0, 3)
    assert_matches(jax.grad(ours)(w, x, 2.0), jax.grad(theirs)(w, x, 2.0))
    value, grad = jax.value_and_grad(ours)(w, x, 3.0)
    want_value, want_grad = jax.value_and_grad(theirs)(w, x, 3.0)
    assert_matches(value, want_value)
    assert_matches(grad, want_grad)
    assert_matches(
        jax.vmap(ours, in_axes=(0, None, None))(jnp.stack([w, w + 1]), x, 1.0),
        jax.vmap(theirs, in_axes=(0, None, None))(jnp.stack([w, w + 1]), x, 1.0),
    )
    assert_matches(jax.jit(lambda a: ours(a, x, 1.0) + 1)(w), theirs(w, x, 1.0) + 1)
    # Called from Python it is still a program: a future, run by the controller.
    out = ours(w, x, 2.0)
    assert isinstance(out, pw.Future)
    assert_matches(out, theirs(w, x, 2.0))
    s.release()


def test_a_program_with_no_slice_runs_on_the_mesh_its_sharding_constraints_name():
    # @pw.program where @jax.jit was, arguments from jnp (on no mesh), the mesh named only inside.
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    NS, P = jax.sharding.NamedSharding, jax.sharding.PartitionSpec

    def constrained(x):
        return jax.lax.with_sharding_constraint(x * 2, NS(mesh, P("b", "a"))).sum(axis=0)

    inner = jax.jit(lambda x: x + 1, out_shardings=NS(mesh, P("a")))

    def through_inner(x):
        return inner(x) * 3

    x = jnp.arange(64.0).reshape(8, 8)
    for fun in (constrained, through_inner):
        want, got = jax.jit(fun)(x), pw.program(fun)(x)
        assert_matches(got, want)
        assert got.result().sharding.mesh.devices.size == want.sharding.mesh.devices.size == 8


def test_an_error_jax_finds_only_when_compiling_is_a_pathways_error_with_its_builtin_base():
    @jax.custom_vjp
    def ident(x):
        return x

    ident.defvjp(lambda x: (x, None), lambda _, g: (g,))

    def forward_mode(w):
        return jax.jvp(ident, (w,), (jnp.ones_like(w),))[1]

    with pytest.raises(TypeError, match="custom_vjp") as jax_error:
        jax.jit(forward_mode)(jnp.ones(3))
    with pytest.raises(pw.errors.ProgramTraceError, match="custom_vjp") as ours:
        pw.program(forward_mode)(jnp.ones(3))
    assert isinstance(ours.value, TypeError) and type(ours.value.__cause__) is type(jax_error.value)
    assert "test_dropin_idioms.py" in str(ours.value)  # the caller's line
    assert_matches(pw.program(lambda x: x + 1)(jnp.ones(2)), jnp.full(2, 2.0))  # still serving


def test_flax_serialization_takes_futures_as_their_arrays():
    # A TrainState-style checkpoint mid-training: to_bytes of the step's outputs, then restore.
    from flax import serialization

    def step(p):
        return {"w": p["w"] * 2, "b": p["b"] + 1, "n": p["n"] + 1}

    params = {"w": jnp.arange(3.0), "b": jnp.zeros(()), "n": jnp.int32(0)}
    ours, theirs = pw.program(step)(params), jax.jit(step)(params)
    data = serialization.to_bytes(ours)
    assert data == serialization.to_bytes(theirs)
    restored = serialization.from_bytes(ours, data)
    assert jax.tree.structure(restored) == jax.tree.structure(theirs)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(got, want)
    assert serialization.to_state_dict(ours)["w"].tolist() == [0.0, 2.0, 4.0]


def test_lower_trace_and_eval_shape_answer_as_jax_jit_and_lower_warms_the_plan():
    def fun(x, w):
        return jnp.tanh(x @ w).sum()

    x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
    ours, theirs = pw.program(fun), jax.jit(fun)
    assert ours.eval_shape(x, w) == theirs.eval_shape(x, w)
    assert str(ours.trace(x, w).jaxpr) == str(theirs.trace(x, w).jaxpr)
    pw.reset_counters()
    lowered = ours.lower(x, w)
    assert lowered.as_text() == theirs.lower(x, w).as_text()
    assert lowered.compile().cost_analysis() == theirs.lower(x, w).compile().cost_analysis()
    warmed = pw.counters()
    assert warmed["traces"] == 1 and warmed["lowerings"] == 1  # the program's own plan
    assert_matches(ours(x, w), theirs(x, w))
    after = pw.counters()
    assert (after["traces"], after["lowerings"], after["compiles"]) == (
        warmed["traces"],
        warmed["lowerings"],
        warmed["compiles"],
    )  # the call compiled nothing more
    s = pw.devices(mesh={"x": 1})
    placed = pw.jit(fun, devices=s)
    assert placed.eval_shape(x, w) == theirs.eval_shape(x, w)
    assert placed.lower(x, w).as_text() == theirs.lower(x, w).as_text()
    s.release()


def test_a_future_of_a_cluster_shut_down_since_is_passed_as_its_array():
    g = pw.program(lambda v: v + 1)
    old = g(jnp.arange(4.0))
    old.result()
    pw.shutdown()
    pw.init(num_cpu_devices=8)
    want = jax.jit(lambda v: v + 2)(jnp.arange(4.0))
    assert_matches(g(old) + 0, jnp.arange(4.0) + 2)  # the same program, the new cluster
    s = pw.devices(mesh={"x": 2})
    assert_matches(pw.program(lambda v: v + 1, devices=s)(old), want)  # a new program, a new slice
    s.release()


def test_a_program_of_many_arguments_builds_no_error_message_while_checking_its_graph(monkeypatch):
    # graph.check() made each node's repr (every input listed) for every input it checked:
    # quadratic, seconds for a model of a thousand parameters. Messages are made on failure only.
    from pathways_jax._src.ir import graph as graph_lib

    def no_repr(self):
        raise AssertionError("a node's repr was made while nothing failed")

    monkeypatch.setattr(graph_lib.Node, "__repr__", no_repr)
    params = {f"layer{i}": {"w": jnp.full((2,), float(i)), "b": jnp.zeros(())} for i in range(300)}
    step = pw.program(lambda p: jax.tree.map(lambda v: v * 0.5 + 1.0, p))
    got, want = step(params), jax.jit(lambda p: jax.tree.map(lambda v: v * 0.5 + 1.0, p))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(step.graph(params).nodes) >= 1


def test_the_call_with_futures_after_the_first_with_arrays_compiles_nothing_more():
    # The second signature (futures of the first call's array types) runs the first call's
    # plan, as jax.jit runs its second call: nothing is traced or compiled again.
    step = pw.program(lambda p: jax.tree.map(lambda v: v * 0.99 + 0.01, p))
    params = {"w": jnp.full((4,), 2.0), "b": jnp.zeros(())}
    first = step(params)
    pw.reset_counters()
    second = step(first)
    assert pw.counters()["traces"] == 0 and pw.counters()["compiles"] == 0
    reference = jax.jit(lambda p: jax.tree.map(lambda v: v * 0.99 + 0.01, p))
    want = reference(reference(params))
    for got, expected in zip(jax.tree.leaves(second), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_donating_a_train_state_whose_key_is_read_and_returned_unchanged_warns_nothing():
    # The usual idiom: donate the whole state; its PRNG key is read (dropout) and returned as is.
    def step(state):
        noise = jax.random.normal(jax.random.fold_in(state["key"], 1), (16,))
        return {"w": state["w"] - 0.1 * noise, "key": state["key"]}

    want = jax.jit(step, donate_argnums=0)({"w": jnp.ones(16), "key": jax.random.key(0)})
    state = {"w": jnp.ones(16), "key": jax.random.key(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "buffer is kept" warning
        got = pw.program(step, donate_argnums=0)(state)
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
    assert state["w"].is_deleted()  # the buffer a computation consumed went
    # The key is the output itself: kept, and equal to jax.jit's.
    np.testing.assert_array_equal(jax.random.key_data(got["key"].result()), jax.random.key_data(want["key"]))


def _times(k):
    return lambda a: (np.asarray(a) * k).astype(np.asarray(a).dtype)


def test_host_callbacks_that_print_alike_call_their_own_functions():
    # Lambdas of one factory make jaxprs of one text; sharing an executable ran the first one's.
    from jax.experimental import io_callback

    x = jnp.arange(4.0)
    for k in (2.0, 3.0, 5.0):
        cb = _times(k)
        fun = jax.jit(lambda v, cb=cb: jax.pure_callback(cb, jax.ShapeDtypeStruct(v.shape, v.dtype), v))
        assert_matches(pw.program(lambda v, fun=fun: fun(v))(x), fun(x))
    seen = []

    def recorder(tag):
        def fun(v):
            io_callback(lambda a: seen.append((tag, float(a[1]))), None, v)
            jax.debug.callback(lambda a: seen.append((tag + "-debug", float(a[1]))), v)
            return v + 1

        return jax.jit(fun)

    for tag in "ab":
        step = recorder(tag)
        pw.program(lambda v, step=step: step(v))(x).result()
    assert sorted(seen) == [("a", 1.0), ("a-debug", 1.0), ("b", 1.0), ("b-debug", 1.0)]


def test_static_arguments_equal_but_of_other_types_trace_apart_as_under_jax_jit():
    def fun(v, n):
        return v * n, jnp.asarray(n)

    ours, theirs = pw.program(fun, static_argnums=1), jax.jit(fun, static_argnums=1)
    x = jnp.arange(3)
    for n in (1, 1.0, True, 2, 2.0):  # 1 == 1.0 == True, and they hash alike
        for got, want in zip(ours(x, n), theirs(x, n), strict=True):
            assert got.dtype == want.dtype, (n, got.dtype, want.dtype)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 3


class Ratio(float):
    pass


def test_scalar_subclasses_are_traced_arguments_as_under_jax_jit():
    def fun(v, a, b):
        return v * a + b

    x = jnp.arange(4.0)
    for a, b in [(Level.HIGH, Ratio(0.5)), (Level.LOW, True), (3, Ratio(2.0))]:
        got, want = pw.program(fun)(x, a, b), jax.jit(fun)(x, a, b)
        assert got.dtype == want.dtype and got.weak_type == want.weak_type
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", ["int4", "uint4", "int2"])
def test_sub_byte_inputs_on_a_slice_of_several_devices_compute_as_under_jax_jit(dtype):
    def fun(v):
        return v[1:3].astype(jnp.int32) * 2, v

    x = jnp.arange(8, dtype=dtype) % 2
    s = pw.devices(mesh={"x": 2})
    for got, want in zip(pw.program(fun, devices=s)(x), jax.jit(fun)(x), strict=True):
        got = got.result()
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.int32), np.asarray(want, np.int32))
    s.release()


def test_a_static_argument_made_abstract_by_eval_shape_is_refused_clearly():
    def fun(v, n):
        return jnp.tile(v, n)

    ours = pw.program(fun, static_argnums=1)
    x = jnp.ones(3)
    assert ours.eval_shape(x, 2) == jax.jit(fun, static_argnums=1).eval_shape(x, 2)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"static argument 1 .* is a JAX tracer") as info:
        jax.eval_shape(ours, x, 2)
    assert isinstance(info.value, ValueError)  # what jax.jit raises for an unhashable static
    assert "fun.eval_shape(...)" in str(info.value) and "test_dropin_idioms.py" in str(info.value)


class _HasJaxArray:
    def __init__(self, value):
        self.value = value

    def __jax_array__(self):
        return self.value


def test_an_argument_with_only_jax_array_is_refused_with_jax_jits_error_class():
    def fun(v):
        return jnp.asarray(v) * 2

    with pytest.raises(ValueError, match="__jax_array__"):
        jax.jit(fun)(_HasJaxArray(jnp.ones(3)))
    with pytest.raises(ValueError, match=r"has __jax_array__.*jnp\.asarray") as info:
        pw.program(fun)(_HasJaxArray(jnp.ones(3)))
    assert isinstance(info.value, pw.errors.ProgramTraceError)
    assert_matches(pw.program(fun)(jnp.asarray(_HasJaxArray(jnp.ones(3)))), jax.jit(fun)(jnp.ones(3)))
