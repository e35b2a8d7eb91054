"""Drop-in use: training code as users write it, with ``@pw.program`` where ``jax.jit`` was.

Every test runs the same code under plain ``jax.jit`` (or ``nnx.jit``) on the
same data and compares losses and parameters.
"""

import os
import subprocess
import sys
import textwrap
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import assert_matches
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_jax as pw
from pathways_jax import errors

pytestmark = pytest.mark.timeout(180)


def _data(n=32, d=8, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int32)
    return x, y


def _close(a, b, rtol=2e-5, atol=2e-6):
    jax.tree.map(
        lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol), a, b
    )


# --- a functional MLP with Optax and explicit shardings ------------------------------------


def test_functional_mlp_with_optax_and_explicit_shardings():
    s = pw.devices(mesh={"data": 4})
    mesh = s.physical_mesh
    opt = optax.adam(1e-2)

    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (8, 16)) * 0.3,
            "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, 4)) * 0.3,
            "b2": jnp.zeros(4),
        }

    def loss_fn(params, x, y):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data"))
    params = jax.device_put(init(jax.random.key(0)), replicated)
    ref_params, ref_state = params, opt.init(params)
    pw_params, pw_state = params, opt.init(params)
    step_pw = pw.program(train_step, devices=s)
    step_ref = jax.jit(train_step)
    for i in range(5):
        x, y = _data(seed=i)
        x, y = jax.device_put(x, batch), jax.device_put(y, batch)
        ref_params, ref_state, ref_loss = step_ref(ref_params, ref_state, x, y)
        pw_params, pw_state, pw_loss = step_pw(pw_params, pw_state, x, y)
        np.testing.assert_allclose(float(pw_loss), float(ref_loss), rtol=2e-5)
    assert_matches(pw_params, ref_params, rtol=2e-5, atol=2e-6)
    assert_matches(pw_state, ref_state, rtol=2e-5, atol=2e-6)


# --- NNX: a model and nnx.Optimizer updated in place --------------------------------------


class _NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _nnx_train_step(model, optimizer, x, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_nnx_model_and_optimizer_updated_in_place():
    s = pw.devices(mesh={"x": 1})
    ref_model = _NnxMLP(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.adamw(1e-2), wrt=nnx.Param)
    model = _NnxMLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    step_ref = nnx.jit(_nnx_train_step)
    step_pw = pw.program(_nnx_train_step, devices=s)
    before = np.asarray(model.l1.kernel[...])
    for i in range(6):
        x, y = _data(seed=i)
        ref_loss = step_ref(ref_model, ref_opt, x, y)
        loss = step_pw(model, opt, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    assert not np.allclose(np.asarray(model.l1.kernel[...]), before)  # the caller's model moved
    _close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
    x, _ = _data(seed=9)
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(ref_model(x)), rtol=2e-5, atol=2e-6)


# --- NNX on a 2-axis mesh with sharded parameters -----------------------------------------


class _ShardedMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (8, 16)), out_sharding=(None, "model"))
        self.w2 = nnx.Param(init(rngs.params(), (16, 4)), out_sharding=("model", None))

    def __call__(self, x):
        return jax.nn.relu(x @ self.w1) @ self.w2


def _sharded_model(mesh):
    with jax.set_mesh(mesh):  # Flax places annotated parameters on the mesh as it makes them
        return _ShardedMLP(nnx.Rngs(1))


def test_nnx_on_a_two_axis_mesh_with_sharded_parameters():
    s = pw.devices(mesh={"data": 2, "model": 2})
    mesh = s.physical_mesh
    ref_model = _sharded_model(mesh)
    model = _sharded_model(mesh)
    assert model.w1[...].sharding.spec == P(None, "model")
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, optimizer, x, y):
        x = jax.lax.with_sharding_constraint(x, P("data"))

        def loss_fn(model):
            return ((model(x) - y) ** 2).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    step_ref = nnx.jit(step)
    step_pw = pw.program(step, devices=s)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x = rng.standard_normal((8, 8)).astype(np.float32)
        y = rng.standard_normal((8, 4)).astype(np.float32)
        with jax.set_mesh(mesh):
            ref_loss = step_ref(ref_model, ref_opt, x, y)
        loss = step_pw(model, opt, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    _close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
    kernel = model.w1[...]
    kernel = kernel.result() if isinstance(kernel, pw.Future) else kernel
    assert kernel.sharding.spec == P(None, "model")  # sharded as annotated, after training


# --- Linen with TrainState, dropout RNGs and a train flag ---------------------------------


class _Dropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(4)(x)


def test_linen_train_state_with_dropout_and_train_flag():
    s = pw.devices(mesh={"x": 2})
    model = _Dropout()
    x0, _ = _data()
    params = model.init(jax.random.key(0), x0, train=False)["params"]

    def make_state():
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2))

    def train_step(state, x, y, key):
        dropout_key = jax.random.fold_in(key, state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def eval_step(state, x):
        return state.apply_fn({"params": state.params}, x, train=False)

    ref_state, pw_state = make_state(), make_state()
    key = jax.random.key(42)
    step_ref, step_pw = jax.jit(train_step), pw.program(train_step, devices=s)
    for i in range(5):
        x, y = _data(seed=i)
        ref_state, ref_loss = step_ref(ref_state, x, y, key)
        pw_state, loss = step_pw(pw_state, x, y, key)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    assert int(pw_state.step) == 5
    assert_matches(pw_state.params, ref_state.params, rtol=2e-5, atol=2e-6)
    x, _ = _data(seed=7)
    assert_matches(
        pw.program(eval_step, devices=s)(pw_state, x), jax.jit(eval_step)(ref_state, x), 2e-5, 2e-6
    )
    # Dropout is really on in training: another key gives another loss.
    _, other = step_pw(pw_state, x0, _data()[1], jax.random.key(7))
    _, same = step_pw(pw_state, x0, _data()[1], key)
    assert float(other) != float(same)


# --- a typed PRNG key threaded through many calls -----------------------------------------


def test_typed_prng_key_threaded_through_many_calls():
    s = pw.devices(mesh={"x": 4})

    def step(key, x):
        key, sub = jax.random.split(key)
        return key, x + jax.random.normal(sub, x.shape)

    key_pw = key_ref = jax.random.key(0)
    x_pw = x_ref = jnp.zeros(8)
    step_pw, step_ref = pw.program(step, devices=s), jax.jit(step)
    for _ in range(130):  # past the in-flight window many times over
        key_pw, x_pw = step_pw(key_pw, x_pw)
        key_ref, x_ref = step_ref(key_ref, x_ref)
    assert key_pw.dtype == key_ref.dtype
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(key_pw.result())), np.asarray(jax.random.key_data(key_ref))
    )
    np.testing.assert_allclose(np.asarray(x_pw), np.asarray(x_ref), rtol=1e-5, atol=1e-5)
    assert pw.cluster().controller.alive
    # Other extended and unusual dtypes as inputs and outputs.
    odd = [
        jnp.asarray(True),
        jnp.zeros((0, 3)),
        jnp.arange(4, dtype=jnp.bfloat16),
        jnp.arange(4, dtype=jnp.int4),
        jax.random.key(3, impl="rbg"),
        jax.random.PRNGKey(5),
    ]
    ident = pw.program(lambda *v: v, devices=s)
    for got, want in zip(ident(*odd), jax.jit(lambda *v: v)(*odd), strict=True):
        got = got.result()
        assert got.dtype == want.dtype and got.shape == want.shape
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- faults inside the controller's own bookkeeping fail only their run -------------------


def test_an_internal_error_fails_only_its_run():
    pw.init(num_cpu_devices=8, inline_dispatch=False)
    s = pw.devices(mesh={"x": 2})
    double = pw.program(lambda v: v * 2, devices=s)
    controller = pw.cluster().controller
    assert_matches(double(jnp.arange(4.0)), jnp.arange(4.0) * 2)

    def broken_once(original):
        calls = []

        def wrapper(*args, **kwargs):
            if not calls:
                calls.append(1)
                raise RuntimeError("injected bookkeeping fault")
            return original(*args, **kwargs)

        return wrapper

    # The scheduling policy's pick, then the readiness check of a queued head.
    for name, owner in (("pick", controller._policy), ("_blocker", controller)):
        setattr(owner, name, broken_once(getattr(owner, name)))
        bad = double(jnp.arange(4.0))
        with pytest.raises(errors.ProgramFailedError, match="failed in the controller") as info:
            bad.result(timeout=60)
        assert isinstance(info.value.__cause__, errors.PathwaysError)
        assert "injected bookkeeping fault" in str(info.value.__cause__)
        assert_matches(double(jnp.arange(3.0)), jnp.arange(3.0) * 2)  # the next program runs
        assert controller.alive
    # The accounting watcher: the runs it held fail, and it goes on accounting.
    accounting = controller.accounting
    deadline = time.monotonic() + 60
    while not accounting.idle() and time.monotonic() < deadline:
        time.sleep(0.005)  # earlier runs accounted: the fault hits the next run
    accounting._account = broken_once(accounting._account)
    first = double(jnp.ones(2))
    deadline = time.monotonic() + 60
    while type(first._entry.state).__name__ != "Failed" and time.monotonic() < deadline:
        time.sleep(0.005)  # the watcher fails the run once it looked at it
    with pytest.raises(errors.ProgramFailedError) as info:
        first.result(timeout=60)
    assert "accounting failed" in str(info.value.__cause__)
    before = sum(c["programs"] for c in pw.stats()["clients"].values())
    assert_matches(double(jnp.ones(2)), jnp.ones(2) * 2)
    deadline = time.monotonic() + 60
    while (
        sum(c["programs"] for c in pw.stats()["clients"].values()) == before and time.monotonic() < deadline
    ):
        time.sleep(0.005)
    assert sum(c["programs"] for c in pw.stats()["clients"].values()) > before  # the watcher kept accounting


# --- exit without pw.shutdown() -----------------------------------------------------------

_EXIT_SCRIPT = """
import sys
import pathways_jax as pw
if sys.argv[3] == "ray":  # two host processes; the slice lives on host 0
    pw.init(backend="ray", hosts=2, devices_per_host=int(sys.argv[1]))
else:
    pw.init(num_cpu_devices=4)
import jax, jax.numpy as jnp

s = pw.devices(mesh={"x": int(sys.argv[1])})

@pw.program(devices=s)
def slow(x):
    return jax.lax.fori_loop(0, 40, lambda i, x: jnp.tanh(x @ x.T) / 600.0, x)

x = jnp.ones((600, 600))
outs = [slow(x) for _ in range(int(sys.argv[2]))]  # one executing, the others queued
print("submitted", flush=True)
"""


_EXIT_CASES = [(4, 3, "local"), (1, 2, "local"), (2, 3, "ray")]


@pytest.fixture(scope="module")
def exit_runs(tmp_path_factory):
    """Every case's process, all started at the first case that asks: each mostly waits."""
    script = tmp_path_factory.mktemp("exit") / "exit_mid_run.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    runs = {
        case: subprocess.Popen(
            [sys.executable, str(script), *map(str, case)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for case in _EXIT_CASES
    }
    try:
        yield runs
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.communicate(timeout=30)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("devices", "runs", "backend"), _EXIT_CASES)
def test_exit_without_shutdown_mid_run_is_clean(exit_runs, devices, runs, backend):
    out, err = exit_runs[devices, runs, backend].communicate(timeout=150)
    assert "submitted" in out, err[-2000:]
    assert exit_runs[devices, runs, backend].returncode == 0, err[-2000:]


_EXIT_WITH_CALLBACK_SCRIPT = """
import pathways_jax as pw
pw.init(num_cpu_devices=4)
import jax, jax.numpy as jnp

seen = []

@pw.program(devices=pw.devices(mesh={"x": 4}))
def body(v):
    jax.debug.callback(lambda z: seen.append(float(z.sum())), v)
    return v + 1

out = body(jnp.arange(4.0))  # never read: its callback runs on XLA's threads as Python exits
print("submitted", flush=True)
"""


def test_exit_with_a_run_s_host_callback_still_to_come_is_clean(tmp_path):
    # The process aborted ("terminate called without an active exception"), every time;
    # under jax.jit the same script exits with 0.
    script = tmp_path / "exit_with_callback.py"
    script.write_text(textwrap.dedent(_EXIT_WITH_CALLBACK_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=150, env=env
        )
        assert "submitted" in done.stdout, done.stderr[-2000:]
        assert done.returncode == 0, done.stderr[-2000:]


# --- donation -----------------------------------------------------------------------------


def test_program_donate_argnums_consumes_inputs_like_jax_jit():
    s = pw.devices(mesh={"x": 2})

    def update(p, g):
        return p - 0.1 * g

    upd = pw.program(update, devices=s, donate_argnums=0)
    on_slice = s.sharding(P())
    x = jax.device_put(jnp.ones(8), on_slice)
    g = jnp.ones(8)
    y = upd(x, g)
    assert_matches(y, jnp.ones(8) * 0.9)
    assert x.is_deleted()  # as jax.jit(update, donate_argnums=0) leaves it
    z = upd(y, g)  # a future donated: spent once the run is dispatched
    assert_matches(z, jnp.ones(8) * 0.9 - 0.1)
    with pytest.raises(errors.ProgramFailedError, match="donated"):
        y.result(timeout=30)
    assert not g.is_deleted()


def test_inner_jit_donation_is_honoured_or_warned_once():
    s = pw.devices(mesh={"x": 1})
    inner = jax.jit(lambda p, g: p - g, donate_argnums=0)

    def step(p, g):
        return inner(p, g)

    x = jax.device_put(jnp.ones(4), s.sharding(P()))
    assert_matches(pw.program(step, devices=s)(x, jnp.ones(4)), jnp.zeros(4))
    assert not x.is_deleted()  # as under jax.jit: a nested call's donation leaves the caller's array
    assert_matches(pw.program(step, devices=s, donate_argnums=0)(x, jnp.ones(4)), jnp.zeros(4))
    assert x.is_deleted()  # the program donates it, and its only reader takes it

    @pw.program(devices=s, fuse=False)
    def made_inside(g):
        return inner(g * 2, g)  # g * 2 is made here: the inner donation reuses its buffer

    assert_matches(made_inside(jnp.ones(4)), jnp.ones(4))

    @pw.program(devices=s, fuse=False, donate_argnums=0)
    def twice(p, g):
        return inner(p, g) + p  # p is read again: its buffer must stay

    x = jax.device_put(jnp.ones(4), s.sharding(P()))
    with pytest.warns(UserWarning, match="not its only reader"):
        assert_matches(twice(x, jnp.ones(4)), jnp.ones(4))
    assert not x.is_deleted()
    with pytest.raises(errors.ProgramTraceError, match="cannot intersect") as caught:
        pw.program(lambda a: a, static_argnums=0, donate_argnums=0)
    assert isinstance(caught.value, ValueError)  # as jax.jit's


# --- pw.jit inside jax.jit keeps its placement --------------------------------------------


def test_pw_jit_inside_jax_jit_keeps_its_placement():
    s = pw.devices(mesh={"x": 4}, device_ids=[4, 5, 6, 7])
    f = pw.jit(lambda v: v * 2, devices=s)
    out = jax.jit(lambda v: f(v) + 1)(np.ones(8, np.float32))
    assert {d.id for d in out.sharding.device_set} == {4, 5, 6, 7}
    np.testing.assert_allclose(np.asarray(out), np.full(8, 3.0))
    grad = jax.grad(lambda v: f(v).sum())(jnp.ones(8))
    np.testing.assert_allclose(np.asarray(grad), np.full(8, 2.0))


# --- whole-slice compilation by default ---------------------------------------------------


def test_programs_fuse_by_default_and_split_where_another_slice_reads():
    a = pw.devices(mesh={"x": 2})
    b = pw.devices(mesh={"x": 2}, device_ids=[6, 7])
    mul = jax.jit(lambda v: v * 3)
    add = jax.jit(lambda v: v + 1)

    def body(v):
        with a:
            u = mul(v)
            w = add(u)
            w = mul(w)
        with b:
            t = add(u)  # u leaves slice a after the first node
        return w, t

    fused, unfused = pw.program(body), pw.program(body, fuse=False)
    v = jnp.arange(4.0)
    graph = fused.graph(v)
    assert len(unfused.graph(v).nodes) == 4
    assert [n.kind for n in graph.nodes] == ["jit", "fused", "jit"]
    assert graph.nodes[1].source_info.startswith("test_dropin.py:")  # the user's line
    assert_matches(fused(v), jax.jit(lambda v: ((v * 3 + 1) * 3, v * 3 + 1))(v))


def test_a_python_if_on_a_traced_value_names_the_users_line():
    s = pw.devices(mesh={"x": 1})

    @pw.program(devices=s)
    def branchy(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(errors.ProgramTraceError) as info:
        branchy(jnp.ones(3))
    message = str(info.value)
    assert "test_dropin.py" in message and "branchy" in message
    assert "pathways_jax" not in message.replace("pathways_jax.", "")
    assert "dynamic_leaves" not in message and "flat_fun" not in message


def test_functional_nnx_state_keeps_jax_jit_semantics():
    # nnx.split's State of Variables is a plain pytree, as under jax.jit: the
    # caller's input state is not rewritten; the program returns a new one.
    s = pw.devices(mesh={"x": 1})
    graphdef, state = nnx.split(_NnxMLP(nnx.Rngs(0)))

    def sgd(state, x, y):
        def loss_fn(state):
            logits = nnx.merge(graphdef, state)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), loss

    x, y = _data()
    before = jax.tree.map(np.asarray, state)
    got_state, got_loss = pw.program(sgd, devices=s)(state, x, y)
    want_state, want_loss = jax.jit(sgd)(state, x, y)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))  # untouched inputs
    _close(jax.tree.map(np.asarray, state), before)
    assert all(isinstance(leaf, pw.Future) for leaf in jax.tree.leaves(got_state))
    _close(got_state, want_state)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-5)


def test_a_bare_program_runs_where_jax_jit_would():
    # No slice, no pw.jit: the decorator swapped for @jax.jit and nothing else.
    @jax.jit
    def inner(v):
        return v + 1

    def step(x, y):
        return inner(x) * 2 + y.sum()

    x, y = np.ones(4, np.float32), jnp.arange(3.0)
    got = pw.program(step)(x, y)
    assert_matches(got, jax.jit(step)(x, y))
    assert {d.id for d in got.sharding.device_set} == {jax.devices()[0].id}
    # Arguments on a mesh of the user's: the program runs there, traced on that mesh.
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    m = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data")))

    def constrained(v):
        return jax.lax.with_sharding_constraint(v * 2, P("data")).sum(axis=1)

    prog = pw.program(constrained)
    out = prog(m)
    with jax.set_mesh(mesh):
        want = jax.jit(constrained)(m)
    assert_matches(out, want)
    assert out.sharding.device_set == set(mesh.devices.flat)
    assert out.sharding.spec == want.sharding.spec
    traces = pw.counters()["traces"]
    assert prog(m).sharding == out.sharding  # the same slice and plan again: no new trace
    assert pw.counters()["traces"] == traces


def test_program_takes_jax_jit_shardings_and_donate_argnames():
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))

    def step(params, x, lr):
        grads = jax.grad(lambda p: ((x @ p["w"]) ** 2).mean())(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    options = {"in_shardings": (rep, batch, None), "out_shardings": rep, "donate_argnames": "params"}
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    want = jax.jit(step, **options)({"w": jnp.ones((4, 2))}, x, 0.1)
    params = {"w": jax.device_put(jnp.ones((4, 2)), rep)}
    got = pw.program(step, **options)(params, x, 0.1)
    assert_matches(got, want)
    assert got["w"].sharding == want["w"].sharding  # the shardings, and so the mesh, of jax.jit
    assert params["w"].is_deleted()  # donated by name
