"""Values, shardings and wrappers as ``jax.jit`` gives them, with only the decorator changed.

Each test calls ``jax.jit`` and pathways_jax on the same inputs and compares
results: values, dtypes, types (shardings on Explicit axes) and placements.
"""

import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)


def _double(v):
    return v * 2


def _assert_same_array(have, want):
    assert (have.shape, have.dtype, have.weak_type) == (want.shape, want.dtype, want.weak_type)
    assert jax.typeof(have) == jax.typeof(want)
    assert have.sharding.is_equivalent_to(want.sharding, want.ndim)
    assert have.committed == want.committed
    np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize(
    "how", ["pw.jit(jax.jit(out_shardings=NamedSharding))", "pw.jit(jax.jit(out_shardings=P))", "program(P)"]
)
def test_out_shardings_on_a_set_explicit_mesh_type_the_outputs_as_jax_jit_does(how):
    # The outputs came back replicated (float32[8], not float32[8@x]): pw.jit did not take a
    # wrapped jax.jit's out_shardings on Explicit axes, and a bare P named no mesh to retype on.
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    x = jnp.arange(8.0)
    # A NamedSharding names its mesh: no mesh need be set.
    with contextlib.nullcontext() if "NamedSharding" in how else jax.set_mesh(mesh):
        if how == "program(P)":
            want = jax.jit(_double, out_shardings=P("x"))(x)
            have = pw.program(_double, out_shardings=P("x"))(x).result()
        else:
            shardings = NamedSharding(mesh, P("x")) if "NamedSharding" in how else P("x")
            want = jax.jit(_double, out_shardings=shardings)(x)
            have = pw.jit(jax.jit(_double, out_shardings=shardings))(x).result()
    assert str(jax.typeof(want)) == "float32[8@x]"
    _assert_same_array(have, want)


def _products(v, w):
    return v * w, jnp.outer(v, w), v.sum()


@pytest.mark.parametrize(
    "how", ["program(in_shardings=)", "pw.jit(jax.jit(in_shardings=))", "inner jax.jit(out_shardings=)"]
)
def test_shardings_on_an_explicit_mesh_place_uncommitted_arguments_as_jax_jit_does(how):
    # With no mesh set, jax.jit traces uncommitted arguments untyped and lets the compiler place
    # its outputs from the shardings it names (float32[8@x]); the program traced them typed
    # replicated on that mesh, so every output came back replicated.
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    x, w = jnp.arange(8.0), jnp.ones(8)
    split = NamedSharding(mesh, P("x"))
    shardings = (split, None)

    def inner(v, w):  # fused with the glue after it
        return _products(jax.jit(lambda u: u * 3, out_shardings=split)(v) + 1, w)

    if how == "inner jax.jit(out_shardings=)":
        want, have = jax.jit(inner)(x, w), pw.program(inner)(x, w)
    elif how.startswith("pw.jit"):
        want = jax.jit(_products, in_shardings=shardings)(x, w)
        have = pw.jit(jax.jit(_products, in_shardings=shardings))(x, w)
    else:
        want = jax.jit(_products, in_shardings=shardings)(x, w)
        have = pw.program(_products, in_shardings=shardings)(x, w)
    assert str(jax.typeof(want[0])) == "float32[8@x]"
    for h, wa in zip(pw.results(have), want, strict=True):
        _assert_same_array(h, wa)  # the same types, and equivalent shardings (P("x") or P("x", None))


def _grads_with_int(x, i):
    return jax.grad(lambda x, i: (x * i).sum(), argnums=(0, 1), allow_int=True)(x, i)


@pytest.mark.parametrize("decorator", [pw.jit, pw.program], ids=["pw.jit", "pw.program"])
def test_float0_values_go_in_and_come_out_as_through_jax_jit(decorator):
    # pw.jit refused a float0 argument (the gradient of an integer input) while compiling; a
    # program making a float0 output failed its run in the accounting watcher, which waited
    # for that host value as for a device array: the other outputs' futures then raised.
    x, i = jnp.ones(3), jnp.arange(3)
    zero = jax.jit(_grads_with_int)(x, i)[1]
    assert zero.dtype == jax.dtypes.float0

    def step(x, z):
        return jnp.zeros_like(z), x * 2, _grads_with_int(x, i)

    want = jax.jit(step)(x, zero)
    out = decorator(step)(x, zero)
    controller = pw.cluster().controller
    assert controller.wait_dispatched(timeout=60)
    deadline = time.monotonic() + 60
    while not controller.accounting.idle() and time.monotonic() < deadline:
        time.sleep(0.001)  # the watcher has seen the run: a failure there has failed its outputs
    have = pw.results(out)
    for h, w in zip(jax.tree.leaves(have), jax.tree.leaves(want), strict=True):
        assert (type(h), h.dtype, h.shape) == (type(w), w.dtype, w.shape)
        if w.dtype != jax.dtypes.float0:
            _assert_same_array(h, w)


@pytest.mark.parametrize("placed", [False, True], ids=["as jax.jit", "on a slice"])
def test_pw_jit_clear_cache_traces_again_as_jax_jit_s_does(placed):
    # pw.jit had no clear_cache (AttributeError), where jax.jit's and pw.program's have one.
    traced = []

    def f(v):
        traced.append(1)
        return v * 2

    x = jnp.arange(3.0)
    jitted = jax.jit(f)
    jitted(x)
    assert jitted.clear_cache() is None
    jitted(x)
    assert len(traced) == 2
    traced.clear()
    fun = pw.jit(f, devices=pw.devices(mesh={"x": 1})) if placed else pw.jit(f)
    np.testing.assert_array_equal(fun(x).result(), jitted(x))
    before = pw.counters()["traces"]
    assert fun.clear_cache() is None
    np.testing.assert_array_equal(fun(x).result(), jitted(x))
    assert pw.counters()["traces"] == before + 1


@pytest.mark.parametrize("where", ["a device", "an Explicit mesh"])
def test_an_uncommitted_future_follows_a_committed_argument_as_an_uncommitted_array_does(where):
    # The future of a program nothing placed (uncommitted, on JAX's default device) decided where
    # the next program ran: on its device, where jax.jit runs on the committed argument's (with a
    # mesh of several devices, compiling failed on the meshes' mismatch).
    if where == "a device":
        committed = jax.device_put(jnp.ones(4), jax.devices()[3])
    else:
        mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
        committed = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("x")))
    made = pw.program(_double)(jnp.arange(4.0))
    assert not made.committed

    def add(a, b):
        return a + b

    for args in ((made, committed), (committed, made)):
        want = jax.jit(add)(*(a.result() if isinstance(a, pw.Future) else a for a in args))
        have = pw.program(add)(*args).result()
        if where == "a device":  # a one-device NamedSharding for jax.jit's SingleDeviceSharding (README)
            assert (have.shape, have.dtype, have.committed) == (want.shape, want.dtype, want.committed)
            np.testing.assert_array_equal(have, want)
        else:
            _assert_same_array(have, want)
        assert have.devices() == want.devices()


@pytest.mark.parametrize("option", ["in_shardings", "out_shardings"])
@pytest.mark.parametrize("wrap", [pw.program, pw.jit], ids=["pw.program", "pw.jit"])
def test_a_wrapped_jax_jit_s_one_device_shardings_place_it_on_that_device_committed(wrap, option):
    # pw.program(jax.jit(f, out_shardings=SingleDeviceSharding(d))) ran on JAX's default device and
    # pw.jit's ran on d, both returning uncommitted values where jax.jit's are committed to d.
    device = jax.devices()[5]
    jitted = jax.jit(_double, **{option: jax.sharding.SingleDeviceSharding(device)})
    x = jnp.arange(4.0)
    want = jitted(x)
    have = wrap(jitted)(x).result()
    assert want.committed and want.devices() == {device}
    assert (have.committed, have.devices()) == (want.committed, want.devices())
    np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize("option", ["in_shardings", "out_shardings"])
def test_pw_jit_takes_jax_jit_s_shardings_as_jax_jit_does(option):
    # pw.jit(f, out_shardings=...) raised TypeError (an unexpected keyword argument).
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    split = NamedSharding(mesh, P("x"))
    sharding = split if option == "in_shardings" else (split, split, NamedSharding(mesh, P()))
    x = jnp.arange(8.0)
    want = jax.jit(_products, **{option: sharding})(x, x)
    have = pw.results(pw.jit(_products, **{option: sharding})(x, x))
    assert str(jax.typeof(want[0])) == "float32[8@x]"
    for h, w in zip(have, want, strict=True):
        _assert_same_array(h, w)


@pytest.mark.parametrize("option", ["device", "backend"])
@pytest.mark.parametrize("wrap", ["pw.jit(f, ...)", "pw.jit(jax.jit(f, ...))", "pw.program(jax.jit(f, ...))"])
def test_jax_jit_s_device_and_backend_place_pw_jit_as_jax_jit(wrap, option):
    # pw.jit(f, device=d) raised TypeError; a wrapped jax.jit(f, device=d) failed to trace (a mesh
    # set around it) or ran uncommitted, or on JAX's default device.
    value = jax.devices()[2] if option == "device" else "cpu"
    x = jnp.arange(4.0)
    with pytest.warns(DeprecationWarning, match="backend and device argument on jit is deprecated"):
        want = jax.jit(_double, **{option: value})(x)
    with pytest.warns(DeprecationWarning, match="backend and device argument on jit is deprecated"):
        if wrap == "pw.jit(f, ...)":
            fun = pw.jit(_double, **{option: value})
        else:
            jitted = jax.jit(_double, **{option: value})
            fun = pw.jit(jitted) if wrap.startswith("pw.jit") else pw.program(jitted)
    have = fun(x).result()
    assert want.committed
    assert (have.committed, have.devices()) == (want.committed, want.devices())
    np.testing.assert_array_equal(have, want)


def test_pw_jit_refuses_a_slice_s_placement_and_jax_jit_s_together():
    s = pw.devices(mesh={"x": 2})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(pw.errors.PlacementError, match="devices and out_shardings"):
        pw.jit(_double, devices=s, out_shardings=sharding)


@pytest.mark.parametrize(
    "value",
    [
        np.ma.masked_array([1.0, 2.0], mask=[False, True]),
        np.array(["a", "b"]),
        np.array([1, "a"], dtype=object),
        np.arange(3).astype(">i4"),
    ],
    ids=["masked", "str", "object", "byte-swapped"],
)
@pytest.mark.parametrize("wrap", [pw.program, pw.jit], ids=["pw.program", "pw.jit"])
def test_numpy_arguments_jax_jit_refuses_are_refused_at_the_call_as_by_jax_jit(wrap, value):
    # A masked array ran with its mask silently dropped; other dtypes JAX does not take failed
    # deep inside tracing or compiling (pw.jit: a PlacementError, a ValueError, for jax.jit's TypeError).
    with pytest.raises((TypeError, ValueError)) as refused:
        jax.jit(_double)(value)
    with pytest.raises(pw.errors.ProgramTraceError, match="argument leaf 0, a numpy") as info:
        wrap(_double)(value)
    assert isinstance(info.value, type(refused.value))


@pytest.mark.parametrize("kind", ["jax.Array", "pw.Future"])
def test_a_value_deleted_before_the_call_fails_saying_so(kind):
    # A jax.Array deleted before the call failed its run saying it was deleted "after this call
    # returned"; a deleted future's run said only "got an input that was freed".
    value = jnp.ones(3) if kind == "jax.Array" else pw.program(_double)(jnp.ones(3))
    program = pw.program(_double)
    if kind == "jax.Array":
        program(value).result()  # the next call with it repeats this one
    value.delete()
    deleted = jnp.ones(3)
    deleted.delete()
    with pytest.raises(RuntimeError, match="deleted"):  # jax.jit refuses it at the call
        jax.jit(_double)(deleted)
    if kind == "jax.Array":  # so does a program: a first call, and one that repeats the call before
        for wrap in (pw.program(_double), program, pw.jit(_double)):
            with pytest.raises(pw.errors.PathwaysError, match=r"argument leaf 0.*has been deleted") as info:
                wrap(value)
            assert isinstance(info.value, RuntimeError)
        return
    # A future deleted before the call is refused at the call too (it was taken, and its run failed).
    with pytest.raises(pw.errors.PathwaysError, match=r"argument leaf 0.*was freed") as info:
        pw.program(_double)(value)
    assert isinstance(info.value, RuntimeError)
    assert "after this call returned and" not in str(info.value)


@pytest.mark.parametrize("read", ["np.asarray", "float", "jax.jit", "result"])
def test_reading_a_deleted_future_is_a_runtime_error_as_reading_a_deleted_array(read):
    # It raised a bare PathwaysError, which `except RuntimeError` written for jax.Array misses.
    readers = {
        "np.asarray": np.asarray,
        "float": lambda v: float(v[0]),
        "jax.jit": jax.jit(_double),
        "result": lambda v: v.result() if isinstance(v, pw.Future) else v.block_until_ready(),
    }
    array = jax.jit(_double)(jnp.ones(3))
    future = pw.program(_double)(jnp.ones(3))
    for value in (array, future):
        value.delete()
        assert value.is_deleted()
        with pytest.raises(RuntimeError, match="deleted"):
            readers[read](value)
    with pytest.raises(pw.errors.PathwaysError, match=r"was freed.*delete"):
        readers[read](future)


def _triple(v):
    return v * 3


@pytest.mark.parametrize("how", ["deleted", "donated"])
@pytest.mark.parametrize("where", ["no slice", "a slice"])
def test_a_future_deleted_or_donated_before_a_call_is_refused_at_the_call_as_a_deleted_array(how, where):
    # It was taken, and the run failed later with a ProgramFailedError read from its outputs;
    # jax.jit refuses a deleted or donated array at the call (a RuntimeError).
    devices = pw.devices(mesh={"x": 2}) if where == "a slice" else None
    make, use = pw.jit(_double, devices=devices), pw.jit(_triple, devices=devices)
    consume = pw.jit(_double, devices=devices, donate_argnums=0)
    reference = jax.jit(_double)(jnp.ones(4))
    arrays = {"reference": reference}
    for name, value in (("future", make(jnp.ones(4))), ("array", jax.jit(_double)(jnp.ones(4)))):
        use(value)  # the repeat call below takes the fast path of a call with these types
        if how == "deleted":
            value.delete()
        else:
            (consume if name == "future" else jax.jit(_double, donate_argnums=0))(value).block_until_ready()
        assert value.is_deleted()
        arrays[name] = value
    # jax.jit's own path says RuntimeError ("Array has been deleted"), its C++ fast path ValueError.
    with pytest.raises((RuntimeError, ValueError), match="deleted"):
        jax.jit(_triple)(arrays["array"])
    with pytest.raises(RuntimeError, match=r"refuses it at the call") as info:
        use(arrays["future"])
    assert isinstance(info.value, pw.errors.PathwaysError)
    assert ("donated to an earlier run" if how == "donated" else "was freed") in str(info.value)
    np.testing.assert_array_equal(np.asarray(use(make(jnp.ones(4)))), np.asarray(jax.jit(_triple)(reference)))


_TABLE = jnp.arange(3.0)  # closed over: a constant of the program


def _constants(h, v):
    return v + 1, 3.0, np.ones(2, np.float32), _TABLE, h, 7


@pytest.mark.parametrize("where", ["a device", "an Explicit mesh", "nothing committed"])
@pytest.mark.parametrize("host", ["numpy", "uncommitted array"])
def test_constant_outputs_land_where_a_committed_argument_placed_the_call_as_jax_jit_s(where, host):
    # Literals, constants and uncommitted arguments the program returned as they are came back
    # uncommitted on JAX's default device, where jax.jit's are committed to the argument's devices
    # (`out + x` then worked under jax.jit and failed with the program's outputs on a mesh). And
    # each was one array every call returned: deleted (or donated), the next call failed.
    h = np.arange(4.0, dtype=np.float32) if host == "numpy" else jnp.arange(4.0)
    if where == "an Explicit mesh":
        mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
        v = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("x")))
    elif where == "a device":
        v = jax.device_put(jnp.ones(8), jax.devices()[3])
    else:  # uncommitted: so are jax.jit's outputs, on JAX's default device
        v = jnp.ones(8)
    want = jax.jit(_constants)(h, v)
    program = pw.program(_constants)
    for _ in range(2):  # a new array each call, as jax.jit's: deleting one leaves the next call's
        have = pw.results(program(h, v))
        for position, (got, expected) in enumerate(zip(have, want, strict=True)):
            if where == "an Explicit mesh":
                _assert_same_array(got, expected)
            else:  # a one-device NamedSharding for jax.jit's SingleDeviceSharding (README)
                assert (got.committed, got.devices(), got.dtype, got.weak_type) == (
                    expected.committed,
                    expected.devices(),
                    expected.dtype,
                    expected.weak_type,
                )
                np.testing.assert_array_equal(got, expected)
            if position != 4:  # h returned as it is: that may be the caller's array, as under jax.jit
                got.delete()


def test_constant_outputs_of_a_program_on_a_slice_are_on_its_devices():
    # They came back uncommitted on JAX's default device, wherever the slice was.
    s = pw.devices(mesh={"x": 2}, device_ids=[6, 7])
    have = pw.results(pw.program(lambda v: (v * 2, 3.0, _TABLE), devices=s)(jnp.ones(4)))
    for got, want in zip(have, (jnp.ones(4) * 2, 3.0, _TABLE), strict=True):
        assert got.committed and got.devices() == set(jax.devices()[6:8])
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("keep_unused", [False, True])
@pytest.mark.parametrize("wrap", ["pw.program", "pw.jit", "pw.program(jax.jit)"])
def test_a_committed_argument_the_function_does_not_use_places_it_only_with_keep_unused(wrap, keep_unused):
    # As jax.jit prunes unused arguments, a committed one it does not read places nothing: the
    # outputs came back committed to its device, where jax.jit's are uncommitted on the default
    # one (unless keep_unused=True). A function of its own per call: JAX caches jax.jit(f)'s
    # placement of one function across keep_unused.
    x = jnp.arange(4.0)
    unused = jax.device_put(jnp.ones(4), jax.devices()[3])
    want = jax.jit(lambda v, u: (v * 2, 1.0), keep_unused=keep_unused)(x, unused)
    fun = lambda v, u: (v * 2, 1.0)  # noqa: E731
    if wrap == "pw.program(jax.jit)":
        program = pw.program(jax.jit(fun, keep_unused=keep_unused))
    else:
        program = (pw.program if wrap == "pw.program" else pw.jit)(fun, keep_unused=keep_unused)
    have = pw.results(program(x, unused))
    assert want[0].committed is keep_unused
    for got, expected in zip(have, want, strict=True):
        assert (got.committed, got.devices()) == (expected.committed, expected.devices())
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("devices", [[4, 5], [3]], ids=["two devices", "one device"])
def test_code_reading_only_uncommitted_values_runs_where_a_committed_future_is_as_under_jax_jit(devices):
    # A program with no slice, given a committed future (an output of a program on a slice) and an
    # uncommitted array, ran what reads only the array on JAX's default device, committed there:
    # jax.jit runs it all on the devices of the committed array the future stands for.
    s = pw.devices(mesh={"x": len(devices)}, device_ids=devices)
    params = pw.jit(lambda v: v + 1, devices=s)(jnp.ones(4))
    batch = jnp.arange(4.0)

    def step(b, p):
        return b * 2, b.mean() + 1, p.sum()

    want = jax.jit(step)(batch, params.result())
    have = pw.results(pw.program(step)(batch, params))
    for got, expected in zip(have, want, strict=True):
        assert (got.committed, got.devices()) == (expected.committed, expected.devices())
        assert got.sharding.is_equivalent_to(expected.sharding, expected.ndim)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_arguments_on_a_one_device_mesh_keep_it_in_the_outputs_as_under_jax_jit(axis_type):
    # A one-accelerator machine's jax.make_mesh((1,), ("data",)): the outputs came back on a
    # mesh of the program's own (float32[8] on 'x': 1, not float32[8@data] on 'data': 1), so
    # adding them to an array on the user's mesh raised "Mesh for all inputs should be equal".
    mesh = jax.make_mesh((1,), ("data",), axis_types=(axis_type,))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    w = jax.device_put(jnp.full(8, 2.0), NamedSharding(mesh, P()))

    def step(a, b):
        return a * b, (a @ b) / 8

    want = jax.jit(step)(x, w)
    have = pw.results(pw.program(step)(x, w))
    for got, expected in zip(have, want, strict=True):
        _assert_same_array(got, expected)
        assert got.sharding == expected.sharding
        _assert_same_array(got + w, expected + w)


@pytest.mark.parametrize("names", ["with_sharding_constraint", "jax.device_put", "shard_map"])
def test_a_one_device_mesh_the_function_names_places_it_as_under_jax_jit(names):
    # Named only inside the function, a one-device mesh placed nothing: the outputs came back
    # uncommitted on JAX's default device, where jax.jit's are committed on that mesh.
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
    on_mesh = NamedSharding(mesh, P("data"))
    inner = {
        "with_sharding_constraint": lambda v: jax.lax.with_sharding_constraint(v, on_mesh),
        "jax.device_put": lambda v: jax.device_put(v, on_mesh),
        "shard_map": jax.shard_map(lambda v: v * 3, mesh=mesh, in_specs=P("data"), out_specs=P("data")),
    }[names]

    def step(v):
        return inner(v * 2) + 1

    want = jax.jit(step)(jnp.arange(8.0))
    have = pw.program(step)(jnp.arange(8.0)).result()
    assert want.committed
    _assert_same_array(have, want)
    assert have.sharding == want.sharding


@pytest.mark.parametrize("size", [4, 1])
def test_a_future_on_explicit_axes_is_traced_typed_by_a_program_it_first_meets(size):
    # A program with no slice first called with such a future (an evaluation step fed the train
    # step's outputs) traced it untyped: jax.typeof inside said float32[8], a reshape jax.jit
    # refuses for want of an out_sharding was taken, and on one device the output lost its type.
    mesh = jax.make_mesh((size,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    made = pw.program(_double)(x)
    seen = {}

    def evaluate(v):
        seen[len(seen)] = str(jax.typeof(v))
        return v + 1

    want = jax.jit(evaluate)(made.result())
    have = pw.program(evaluate)(made).result()
    assert seen == {0: "float32[8@data]", 1: "float32[8@data]"}
    _assert_same_array(have, want)
    if size == 1:
        return  # on one device JAX takes the reshape
    with pytest.raises(Exception, match="out_sharding") as refused:  # JAX's ShardingTypeError
        jax.jit(lambda v: v.reshape(2, 4))(made.result())
    with pytest.raises(pw.errors.ProgramTraceError, match="out_sharding") as caught:
        pw.program(lambda v: v.reshape(2, 4))(made)
    assert isinstance(caught.value, type(refused.value))


def _by_host(v):
    return jax.pure_callback(np.negative, jax.ShapeDtypeStruct(v.shape, v.dtype), v) + 1


@pytest.mark.parametrize(
    "step",
    [
        lambda v, u: v * 2,
        lambda v, u: (v * u, u),  # an (uncommitted) argument returned as it is: moved to v's device
        lambda v, u: _by_host(v),
    ],
    ids=["computed", "argument returned", "host callback"],
)
def test_outputs_of_a_call_committed_one_device_arguments_placed_are_typed_as_jax_jit_s(step):
    # They came back committed with a NamedSharding on a one-device mesh 'x' of the program's
    # own, typed with that mesh: adding them to an array on a user's one-device mesh over the
    # same device raised "Mesh for all inputs should be equal", and their sharding was not the
    # argument's (a call with them traced again).
    device = jax.devices()[5]
    x5, u = jax.device_put(jnp.arange(8.0), device), jnp.ones(8)
    q = jax.device_put(jnp.ones(8), NamedSharding(jax.make_mesh((1,), ("q",), devices=[device]), P()))
    program = pw.program(step)
    want = jax.jit(step)(x5, u)
    made = program(x5, u)
    for future, expected in zip(jax.tree.leaves(made), jax.tree.leaves(want), strict=True):
        assert future.sharding == expected.sharding == x5.sharding and future.committed
        _assert_same_array(future.result(), expected)
        _assert_same_array(future.result() + q, expected + q)
    if not isinstance(want, tuple):  # fed back, as a future and as its array: the first call's plan
        before = pw.counters()["traces"]
        for fed in (made, made.result()):
            _assert_same_array(program(fed, u).result(), jax.jit(step)(want, u))
        assert pw.counters()["traces"] == before
    with pw.devices(mesh={"x": 1}) as one:  # a slice's outputs stay on its mesh
        on_slice = jax.tree.leaves(program(x5, u))[0]
    assert on_slice.slice is one and on_slice.sharding.mesh.shape == {"x": 1}
