"""JAX's configuration and context managers around program calls, as ``jax.jit`` honours them.

``jax.jit`` keys its cache on the configuration a trace depends on (64-bit mode,
promotion rules, matmul precision, the default device, the caller's mesh) and
runs op by op under ``jax.disable_jit()``. Each test changes one of them between
calls of the same program and compares with ``jax.jit`` on the same inputs.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, jax_config
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)


def _result(out):
    return out.result(timeout=60) if isinstance(out, pw.Future) else out


def test_64_bit_mode_switched_on_after_a_call_retraces_as_jax_jit_does():
    def add(x, y):
        return jnp.arange(3) + x + y

    prog, jitted = pw.program(add), jax.jit(add)
    assert _result(prog(1.0, 2)).dtype == jitted(1.0, 2).dtype == jnp.float32
    with jax_config("jax_enable_x64", True):
        want = jitted(1.0, 2)
        got = _result(prog(1.0, 2))
        assert got.dtype == want.dtype == jnp.float64
        assert got.weak_type == want.weak_type
        assert_matches(got, want, rtol=0, atol=0)
    # Back in 32-bit mode, the first trace serves again.
    assert _result(prog(1.0, 2)).dtype == jnp.float32


def test_values_made_in_64_bit_mode_passed_after_it_is_switched_off_are_narrowed_as_jax_jit_does():
    # A notebook toggles jax_enable_x64: arrays (and futures) made meanwhile stay float64.
    def affine(x):
        return x * 2 + 1

    prog = pw.program(affine)
    with jax_config("jax_enable_x64", True):
        wide, wide_future = jnp.arange(3.0), prog(jnp.arange(3.0))
        assert _result(wide_future).dtype == jnp.float64
    assert jax.typeof(wide_future) == jax.typeof(wide)
    for arg in (wide, wide_future):
        # JAX warns as it traces: once here, as the future is typed as the array (a cache hit).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = jax.jit(affine)(arg)
        with pytest.warns(UserWarning, match="truncated to dtype float32"):
            got = _result(prog(arg))
        assert got.dtype == want.dtype == jnp.float32
        assert_matches(got, want, rtol=0, atol=0)
    assert wide.dtype == jnp.float64  # the caller's array is left as it was


def test_strict_dtype_promotion_set_after_a_call_is_applied():
    def add(a, b):
        return a + b

    f32, i32 = jnp.ones(3, jnp.float32), jnp.ones(3, jnp.int32)
    prog = pw.program(add)
    assert_matches(prog(f32, i32), jax.jit(add)(f32, i32))
    with jax_config("jax_numpy_dtype_promotion", "strict"):
        with pytest.raises(jax.dtypes.TypePromotionError):
            jax.jit(add)(f32, i32)
        # Caught as jax.jit's error is, and as pathways_jax's.
        with pytest.raises(jax.dtypes.TypePromotionError, match="add") as caught:
            prog(f32, i32)
        assert isinstance(caught.value, pw.errors.ProgramTraceError)


def test_default_matmul_precision_is_part_of_the_cache_key():
    prog = pw.program(lambda a: a @ a)
    x = jnp.ones((8, 8))
    _result(prog(x))
    traces = pw.counters()["traces"]
    _result(prog(x))
    assert pw.counters()["traces"] == traces
    with jax_config("jax_default_matmul_precision", "highest"):
        _result(prog(x))
        text = prog.lower(x).as_text()
    assert pw.counters()["traces"] == traces + 1
    assert "HIGHEST" in text.upper()


def test_a_program_called_again_under_default_device_runs_there():
    def inc(x):
        return x + 1

    prog = pw.program(inc)
    host = np.ones(2, np.float32)
    assert _result(prog(host)).devices() == jax.jit(inc)(host).devices()
    target = jax.devices()[3]
    with jax.default_device(target):
        got = _result(prog(host))
        want = jax.jit(inc)(host)
    assert want.devices() == {target}
    assert got.devices() == {target}
    assert_matches(got, want)


def test_futures_only_calls_see_a_config_change_too():
    # The fast path of a call whose arguments are the last call's futures checks the configuration.
    prog = pw.program(lambda x: x * 2 + jnp.arange(2))
    x = prog(jnp.ones(2, jnp.int32))
    x = prog(x)
    x = prog(x)  # now the fast path
    with jax_config("jax_enable_x64", True):
        y = _result(prog(x))
        want = jax.jit(lambda v: v * 2 + jnp.arange(2))(_result(x))
    assert y.dtype == want.dtype == jnp.int64
    assert_matches(y, want, rtol=0, atol=0)


def _mesh(axis_type):
    return jax.make_mesh((2, 4), ("X", "Y"), axis_types=(axis_type,) * 2)


@pytest.mark.parametrize(
    ("name", "axis_type", "fun", "make_args"),
    [
        (
            "constraint with a bare spec on an unsharded argument",
            AxisType.Auto,
            lambda x: jax.lax.with_sharding_constraint(x * 2, P("X")),
            lambda: (jnp.arange(32.0).reshape(8, 4),),
        ),
        (
            "shard_map with no mesh given",
            AxisType.Auto,
            lambda x: jax.shard_map(lambda b: b * 2, in_specs=P("X"), out_specs=P("X"))(x),
            lambda: (jnp.arange(32.0).reshape(8, 4),),
        ),
        (
            "an init from a key with out_sharding",
            AxisType.Explicit,
            lambda k: jax.random.normal(k, (8, 4), out_sharding=P("X")),
            lambda: (jax.random.key(0),),
        ),
        (
            "no arguments at all",
            AxisType.Explicit,
            lambda: jnp.zeros((8, 4), out_sharding=P("X")) + 1,
            lambda: (),
        ),
        (
            "the abstract mesh read inside",
            AxisType.Auto,
            lambda x: x + len(jax.sharding.get_abstract_mesh().axis_names),
            lambda: (np.ones(8, np.float32),),
        ),
    ],
)
def test_a_program_with_no_slice_runs_on_the_callers_set_mesh(name, axis_type, fun, make_args):
    mesh = _mesh(axis_type)
    args = make_args()
    with jax.set_mesh(mesh):
        want = jax.jit(fun)(*args)
        got = _result(pw.program(fun)(*args))
    assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (got.sharding, want.sharding)
    assert_matches(got, want, rtol=0, atol=0)


def test_flax_scale_up_tutorial_creates_a_sharded_model_under_set_mesh():
    from flax import nnx

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    class DotReluDot(nnx.Module):
        def __init__(self, depth, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.dot1 = nnx.Linear(depth, depth, kernel_init=init, use_bias=False, rngs=rngs)

    def create_sharded_model():
        model = DotReluDot(16, rngs=nnx.Rngs(0))
        state = nnx.state(model)
        sharded = jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state))
        nnx.update(model, sharded)
        return model

    with jax.set_mesh(mesh):
        want = nnx.jit(create_sharded_model)().dot1.kernel[...]
        got = _result(pw.program(create_sharded_model)().dot1.kernel[...])
    assert got.sharding.is_equivalent_to(want.sharding, 2)
    assert got.sharding.spec == want.sharding.spec == P(None, "model")
    assert_matches(got, want, rtol=0, atol=0)


def test_under_disable_jit_a_program_runs_op_by_op_in_the_caller():
    seen = []

    def g(x):
        if x > 0:  # a Python branch on a value: only possible op by op
            seen.append(float(x))
            return x * 2
        return -x

    prog = pw.program(g)
    with jax.disable_jit():
        want = jax.jit(g)(jnp.float32(3.0))
        out = prog(jnp.float32(3.0))
        assert seen == [3.0, 3.0]  # ran in the call, as jax.jit's did
    assert isinstance(out, pw.Future)  # code reading .result() works unchanged
    assert_matches(out, want, rtol=0, atol=0)
    runs = pw.counters()["runs"]
    # Outside the context the program is traced and run by the controller as usual.
    with pytest.raises(pw.errors.ProgramTraceError):
        prog(jnp.float32(3.0))
    assert_matches(pw.program(lambda v: v * 2)(2.0), jnp.float32(4.0))
    assert pw.counters()["runs"] == runs + 1


class ShapeCheckError(Exception):
    """A user's exception class whose constructor takes other arguments than a message."""

    def __init__(self, expected, got):
        super().__init__(f"expected {expected}, got {got}")
        self.expected = expected


def _validate(kind):
    def f(x):
        if x.ndim != 2:
            if kind == "value":
                raise ValueError(f"expected a 2-D batch, got shape {x.shape}")
            if kind == "key":
                raise KeyError("missing_feature")
            if kind == "custom":
                raise ShapeCheckError(2, x.ndim)
            raise FileNotFoundError(2, "no such table", "vocab.txt")
        return x / x.sum(1, keepdims=True)

    return f


@pytest.mark.parametrize(
    ("kind", "caught_as"), [("value", ValueError), ("key", KeyError), ("custom", ShapeCheckError)]
)
def test_an_exception_the_function_raises_while_traced_is_caught_as_under_jax_jit(kind, caught_as):
    f = _validate(kind)
    with pytest.raises(caught_as):
        jax.jit(f)(jnp.ones(3))
    with pytest.raises(caught_as) as caught:
        pw.program(f)(jnp.ones(3))
    err = caught.value
    assert isinstance(err, pw.errors.ProgramTraceError)
    assert type(err.__cause__) is caught_as
    text = str(err)  # pathways_jax's message: the program, the user's line, the original text
    assert "tracing program 'f'" in text and "test_dropin_context.py:" in text
    assert str(err.__cause__) in text
    # It pickles (to another process) as the plain pathways_jax error.
    import pickle

    back = pickle.loads(pickle.dumps(err))
    assert type(back) is pw.errors.ProgramTraceError and str(back) == text
    # The program still serves a good call.
    assert_matches(pw.program(f)(jnp.ones((2, 2))), jax.jit(f)(jnp.ones((2, 2))))


def test_an_exception_class_that_cannot_be_combined_stays_a_program_trace_error():
    f = _validate("os")
    with pytest.raises(pw.errors.ProgramTraceError, match="no such table") as caught:
        pw.program(f)(jnp.ones(3))
    assert type(caught.value.__cause__) is FileNotFoundError


def test_an_unhashable_static_argument_is_a_value_error_as_under_jax_jit():
    def f(x, n):
        return x + len(n)

    with pytest.raises(ValueError, match=r"[Nn]on-hashable"):
        jax.jit(f, static_argnames="n")(jnp.ones(2), [1, 2])
    with pytest.raises(ValueError, match="must be hashable") as caught:
        pw.program(f, static_argnames="n")(jnp.ones(2), [1, 2])
    assert isinstance(caught.value, pw.errors.ProgramTraceError)


def test_checkify_sees_into_a_program_as_into_jax_jit():
    from jax.experimental import checkify

    x = jnp.arange(4.0) - 1.0

    def body(v):
        checkify.check(jnp.all(v > 0), "v must be positive")
        return jnp.log(v + 2)

    for errors_kind in (checkify.user_checks, checkify.float_checks):
        want_err, want = checkify.checkify(jax.jit(body), errors=errors_kind)(x)
        got_err, got = checkify.checkify(pw.program(body), errors=errors_kind)(x)
        assert got_err.get() == want_err.get()
        assert_matches(got, want, rtol=0, atol=0)
    err, _ = checkify.checkify(pw.program(lambda v: jnp.log(v)), errors=checkify.float_checks)(x)
    assert "nan generated by primitive: log" in err.get()
    s = pw.devices(mesh={"x": 1})
    err, out = checkify.checkify(pw.jit(body, devices=s))(x + 5)
    assert err.get() is None
    assert_matches(out, jnp.log(x + 7))


def test_a_program_called_with_concrete_arrays_inside_a_jax_trace_is_traced_in():
    prog = pw.program(lambda v: v * 3)
    captured = jnp.arange(3.0)
    runs = pw.counters()["runs"]
    jaxpr = jax.make_jaxpr(lambda: prog(captured) + 1)()
    assert pw.counters()["runs"] == runs  # traced into the caller's computation, not run
    assert "mul" in str(jaxpr)
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):  # the caller's mesh is read outside traces only
        out = jax.jit(lambda: prog(captured))()
    assert_matches(out, captured * 3)


@pytest.mark.parametrize("kind", ["io_callback", "debug.callback", "ordered debug.callback"])
def test_jax_effects_barrier_waits_for_the_callbacks_of_queued_runs(kind):
    from jax.experimental import io_callback

    def make(seen):
        def f(x):
            if kind == "io_callback":
                io_callback(lambda v: seen.append(float(v)), None, x.sum(), ordered=True)
            else:
                jax.debug.callback(
                    lambda v: seen.append(float(v)), x.sum(), ordered=kind.startswith("ordered")
                )
            return x

        return f

    counts = {}
    for name, wrap in (("jax", jax.jit), ("pw", pw.program)):
        seen = []
        step = wrap(make(seen))
        for i in range(30):
            step(jnp.full(2, float(i)))
        jax.effects_barrier()
        counts[name] = sorted(seen)
    assert counts["pw"] == counts["jax"] == [2.0 * i for i in range(30)]


def test_jax_effects_barrier_waits_for_the_callbacks_of_runs_dispatched_on_several_devices():
    # On several devices XLA calls back on its own threads after the run is dispatched: the
    # barrier came back before the first call's callback had run.
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    replicated = jax.sharding.NamedSharding(mesh, P())

    def make(seen):
        def body(v):
            jax.debug.callback(lambda z: seen.append(float(z.sum())), v)
            return v + 1

        return body

    counts = {}
    for name, wrap in (  # pw first: after a jax.jit callback has run, the miss was rarer
        ("pw", lambda f: pw.program(f, devices=pw.devices(mesh={"x": 4}))),
        ("jax", lambda f: jax.jit(f, in_shardings=replicated)),
    ):
        seen = []
        step = wrap(make(seen))
        counts[name] = []
        for i in range(3):
            step(jnp.full(4, float(i)))
            jax.effects_barrier()
            counts[name].append(sorted(seen))
    assert counts["pw"] == counts["jax"] == [[4.0 * j for j in range(i + 1)] for i in range(3)]


def _local_step(w, x):
    return w - 0.1 * jax.lax.pmean((x * w).sum(0), "batch")


def test_a_shard_map_over_its_own_mesh_places_a_program_with_no_slice():
    # The usual port of pmap code: shard_map(mesh=...) inside the step, plain arrays in.
    mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))

    def step(w, x):
        return jax.shard_map(_local_step, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())(w, x)

    w, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3)
    got = pw.program(step)(w, x)
    assert_matches(got, jax.jit(step)(w, x), rtol=0, atol=0)
    assert got.devices() == set(mesh.devices.flat)


@pytest.mark.parametrize("memory_kind", [None, "pinned_host"])
def test_a_device_put_onto_a_mesh_places_a_program_with_no_slice(memory_kind):
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    target = jax.sharding.NamedSharding(mesh, P("d"), memory_kind=memory_kind)

    def f(a):
        return jax.device_put(a * 2, target)

    x = jnp.arange(16.0)
    expected, got = jax.jit(f)(x), pw.program(f)(x)
    assert_matches(got, expected, rtol=0, atol=0)
    assert got.result().sharding == expected.sharding


def test_a_pmap_called_inside_a_program_runs_as_inside_jax_jit():
    from flax import jax_utils

    p_step = jax.pmap(_local_step, axis_name="batch")

    def outer(w, x):
        return p_step(w, x)

    x = jnp.arange(24.0).reshape(8, 1, 3)
    for w in (jax_utils.replicate(jnp.ones(3)), jnp.ones((8, 3))):  # on pmap's own mesh, or plain
        assert_matches(pw.program(outer)(w, x), jax.jit(outer)(w, x), rtol=0, atol=0)


def test_pw_jit_under_disable_jit_runs_op_by_op_too():
    s = pw.devices(mesh={"x": 2})
    double = pw.jit(lambda v: v * 2, devices=s)
    runs = pw.counters()["runs"]
    with jax.disable_jit():
        out = double(jnp.arange(4.0))
        nested = pw.program(lambda v: double(v) + 1)(jnp.arange(4.0))
    assert pw.counters()["runs"] == runs  # nothing went through the controller
    assert isinstance(out, pw.Future)
    assert_matches(out, jnp.arange(4.0) * 2, rtol=0, atol=0)
    assert_matches(nested, jnp.arange(4.0) * 2 + 1, rtol=0, atol=0)
    assert_matches(double(jnp.arange(4.0)), jnp.arange(4.0) * 2)  # and compiled again outside


def test_a_disallowing_transfer_guard_refuses_host_arguments_as_under_jax_jit():
    f = pw.program(lambda x: x * 2)
    host = np.ones(3, np.float32)
    on_device = jnp.ones(3)
    doubled = on_device * 2
    assert_matches(f(host), host * 2)  # compiled outside the guard
    for guard in (jax.transfer_guard, jax.transfer_guard_host_to_device):
        with guard("disallow"):
            with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
                jax.jit(lambda x: x * 2)(host)
            with pytest.raises(pw.errors.TransferError, match=r"transfer_guard\('disallow'\)") as raised:
                f(host)
            # Of jax.jit's class too: `except jax.errors.JaxRuntimeError` written for jax.jit catches it.
            assert isinstance(raised.value, jax.errors.JaxRuntimeError)
            assert isinstance(raised.value, RuntimeError)
            with pytest.raises(jax.errors.JaxRuntimeError):
                f(2.0)
            got = f(on_device)  # arrays on devices move nothing
        assert_matches(got, doubled)
    assert_matches(f(host), host * 2)
