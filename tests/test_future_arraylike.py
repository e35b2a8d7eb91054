"""pw.Future stands for its jax.Array: conversions, operators, methods, jnp, jax.jit, NNX.

Every check runs the same operation on the future and on the plain jax.Array that
``jax.jit`` computes from identical inputs, and compares type, shape, dtype, then values.
"""

import copy
import operator
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pathways_jax as pw

FLOATS = np.array([1.5, 2.0, 3.25], np.float32)
INTS = np.array([5, 12, 7], np.int32)
OTHER_FLOATS = np.array([0.5, 4.0, 1.25], np.float32)
OTHER_INTS = np.array([3, 2, 1], np.int32)


def _double(v):
    return v * 2


def _pair(fun, *args, devices):
    """A future computed by ``fun`` in a program, and the same value from plain ``jax.jit``."""
    return pw.jit(fun, devices=devices)(*args), jax.jit(fun)(*args)


def _same(got, want):
    """Type, then shape and dtype, then values (STYLE §11)."""
    if isinstance(want, tuple | list):
        assert type(got) is type(want), (type(got), type(want))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
        return
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, jax.Array | np.ndarray | np.generic):
        assert got.shape == want.shape, (got.shape, want.shape)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        if jnp.issubdtype(want.dtype, jnp.inexact):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        assert got == want, (got, want)


@pytest.fixture
def one():
    """A one-device slice: the futures of a test live together, as arrays on one device do."""
    return pw.devices(mesh={"x": 1})


@pytest.fixture
def floats(one):
    """A float vector future and its plain value."""
    return _pair(_double, FLOATS, devices=one)


@pytest.fixture
def matrix(one):
    return _pair(lambda m: m * 2 + 1, np.arange(6.0, dtype=np.float32).reshape(2, 3), devices=one)


# --- conversions ---------------------------------------------------------------------------

CONVERSIONS = {
    "float": (float, "float"),
    "int": (int, "int"),
    "bool": (bool, "float"),
    "complex": (complex, "float"),
    "index": (operator.index, "int"),
}


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_scalar_conversion(one, name):
    convert, kind = CONVERSIONS[name]
    fut, want = _pair(lambda v: v.sum(), FLOATS if kind == "float" else INTS, devices=one)
    assert fut.shape == ()
    _same(convert(fut), convert(want))


def test_item(one, floats):
    fut, want = floats
    _same(fut.item(1), want.item(1))
    scalar, plain = _pair(lambda v: v.max(), FLOATS, devices=one)
    _same(scalar.item(), plain.item())


def test_tolist(matrix):
    fut, want = matrix
    _same(fut.tolist(), want.tolist())


# --- operators -----------------------------------------------------------------------------

BINARY = {
    "add": (operator.add, "float"),
    "sub": (operator.sub, "float"),
    "mul": (operator.mul, "float"),
    "truediv": (operator.truediv, "float"),
    "floordiv": (operator.floordiv, "float"),
    "mod": (operator.mod, "float"),
    "divmod": (divmod, "float"),
    "pow": (operator.pow, "float"),
    "matmul": (operator.matmul, "float"),
    "and": (operator.and_, "int"),
    "or": (operator.or_, "int"),
    "xor": (operator.xor, "int"),
    "lshift": (operator.lshift, "int"),
    "rshift": (operator.rshift, "int"),
    "eq": (operator.eq, "float"),
    "ne": (operator.ne, "float"),
    "lt": (operator.lt, "float"),
    "le": (operator.le, "float"),
    "gt": (operator.gt, "float"),
    "ge": (operator.ge, "float"),
}


def _other(kind, form, devices):
    """The other operand, as the future test sees it and as the reference sees it."""
    values = OTHER_FLOATS if kind == "float" else OTHER_INTS
    match form:
        case "jax":
            plain = jnp.asarray(values)
            return plain, plain
        case "numpy":
            return values, values
        case "scalar":
            scalar = 2.5 if kind == "float" else 2
            return scalar, scalar
        case "future":
            return _pair(lambda v: v + 0, values, devices=devices)
    raise AssertionError(form)


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_operator(one, name):
    # The future on either side of the operator; the other operand a jax.Array, a numpy array,
    # a Python scalar or another future (one test per operator: a cluster each, not each case).
    op, kind = BINARY[name]
    fut, want = _pair(_double, FLOATS if kind == "float" else INTS, devices=one)
    for form in ("jax", "numpy", "scalar", "future"):
        if name == "matmul" and form == "scalar":  # nor does jax.Array's matmul take a scalar
            continue
        other, other_plain = _other(kind, form, one)
        for side in ("left", "right"):
            if side == "left":
                got, expected = op(fut, other), op(want, other_plain)
            else:
                got, expected = op(other, fut), op(other_plain, want)
            try:
                _same(got, expected)
            except AssertionError as exc:
                raise AssertionError(
                    f"{name} with the future on the {side}, the other a {form}: {exc}"
                ) from exc


UNARY = {
    "neg": (operator.neg, "float"),
    "pos": (operator.pos, "float"),
    "abs": (abs, "float"),
    "invert": (operator.invert, "int"),
    "round": (round, "float"),
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_operator(one, name):
    op, kind = UNARY[name]
    if kind == "float":
        fut, want = _pair(lambda v: 1.5 - v * 2, FLOATS, devices=one)
    else:
        fut, want = _pair(_double, INTS, devices=one)
    _same(op(fut), op(want))


def test_inplace_add_on_python_float_accumulator(one):
    losses = [_pair(lambda v, i=i: (v * i).mean(), FLOATS, devices=one) for i in range(3)]
    total, expected = 0.0, 0.0
    for fut, want in losses:
        total += fut
        expected += want
    _same(total, expected)


def test_inplace_ops_on_a_future_variable_make_a_new_array(floats):
    fut, want = floats
    variable, plain = fut, want
    variable += 1
    plain += 1
    _same(variable, plain)
    variable *= fut
    plain *= want
    _same(variable, plain)
    assert type(fut) is pw.Future  # the future itself is untouched, as a jax.Array would be
    _same(fut.result(), want)


def test_future_is_unhashable_like_an_array(floats):
    fut, want = floats
    for value in (fut, want):
        with pytest.raises(TypeError, match="unhashable"):
            hash(value)


# --- indexing, length, iteration -----------------------------------------------------------


@pytest.mark.parametrize(
    "index",
    [0, -1, 1, slice(1, None), slice(None, None, -1), (Ellipsis, 0), (0, slice(0, 2)), "array", "mask"],
    ids=repr,
)
def test_indexing(matrix, index):
    fut, want = matrix
    match index:
        case "array":
            index = jnp.array([1, 0, 1])
        case "mask":
            index = np.array([True, False])
    _same(fut[index], want[index])


def test_indexing_a_future_with_futures_and_at_with_futures():
    def f(x):
        return x * 2, jnp.argmax(x), x > 2, jnp.argsort(x)

    x = jnp.arange(6.0)
    vals, i, mask, order = jax.jit(f)(x)
    fvals, fi, fmask, forder = pw.program(f)(x)
    _same(fvals[fi], vals[i])  # an integer future
    _same(fvals[fmask], vals[mask])  # a boolean future
    _same(fvals[forder], vals[order])  # an integer array future
    _same(fvals[fi, ...], vals[i, ...])  # inside a tuple
    _same(fvals.at[fi].set(0.0), vals.at[i].set(0.0))
    _same(fvals.at[fmask].get(), vals.at[mask].get())
    # A plain jax.Array indexed by futures, as by the arrays they stand for.
    _same(x[fi], x[i])
    _same(x[fmask], x[mask])
    _same(x[forder], x[order])
    _same(x[fi, ...], x[i, ...])
    _same(x.at[forder].set(1.0), x.at[order].set(1.0))
    _same(x.at[fi].add(5.0), x.at[i].add(5.0))


def test_setitem_raises_as_for_an_array(floats):
    fut, _ = floats
    with pytest.raises(TypeError, match="immutable") as info:
        fut[0] = 1.0
    assert any(".at[index].set" in note for note in info.value.__notes__)  # what to write instead


def test_len(one, matrix):
    fut, want = matrix
    assert len(fut) == len(want) == 2
    scalar, _ = _pair(lambda v: v.sum(), FLOATS, devices=one)
    with pytest.raises(TypeError, match="unsized"):
        len(scalar)


def test_iteration(matrix, floats):
    fut, want = matrix
    _same(list(fut), list(want))
    _same([float(v) for v in fut[0]], [float(v) for v in want[0]])
    vector, plain = floats
    _same(list(vector), list(plain))
    _same(6.5 in vector, 6.5 in plain)  # __contains__
    _same(5.0 in vector, 5.0 in plain)


# --- formatting ----------------------------------------------------------------------------


def test_format_and_str_show_the_value_repr_shows_the_future(one, floats):
    fut, want = floats
    scalar, plain = _pair(lambda v: v.mean(), FLOATS, devices=one)
    assert f"{scalar:.3f}" == f"{plain:.3f}" == "2.250"
    assert f"{scalar}" == f"{plain}"
    assert format(fut, "") == format(want, "")
    assert str(fut) == str(want)
    assert repr(fut).startswith("Future(program ")
    assert "shape=(3,)" in repr(fut) and "ready" in repr(fut)


# --- numpy and jax.numpy -------------------------------------------------------------------


def test_jnp_asarray(floats):
    fut, want = floats
    _same(jnp.asarray(fut), jnp.asarray(want))
    _same(jnp.asarray(fut, dtype=jnp.int32), jnp.asarray(want, dtype=jnp.int32))
    _same(jnp.array([fut, want]), jnp.array([want, want]))


def test_np_asarray_with_numpy2_copy_semantics(floats):
    fut, want = floats
    _same(np.asarray(fut), np.asarray(want))
    _same(np.asarray(fut, dtype=np.float64), np.asarray(want, dtype=np.float64))
    _same(np.array(fut, copy=True), np.array(want, copy=True))
    _same(np.asarray(fut, copy=False), np.asarray(want, copy=False))
    with pytest.raises(ValueError):  # a dtype change needs a copy, as for the array
        np.asarray(fut, dtype=np.float64, copy=False)
    with pytest.raises(ValueError):
        np.asarray(want, dtype=np.float64, copy=False)


@pytest.mark.parametrize("name", ["mean", "dot", "where", "concatenate", "stack_axis"])
def test_jnp_functions(one, floats, name):
    fut, want = floats
    other, other_plain = _pair(lambda v: v + 0, OTHER_FLOATS, devices=one)
    match name:
        case "mean":
            got, expected = jnp.mean(fut), jnp.mean(want)
        case "dot":
            got, expected = jnp.dot(fut, other), jnp.dot(want, other_plain)
        case "where":
            got = jnp.where(fut > other, fut, other)
            expected = jnp.where(want > other_plain, want, other_plain)
        case "concatenate":
            got, expected = jnp.concatenate([fut, other]), jnp.concatenate([want, other_plain])
        case "stack_axis":
            got, expected = jnp.stack([fut, other], axis=1), jnp.stack([want, other_plain], axis=1)
    _same(got, expected)


# --- jax.jit and pytrees -------------------------------------------------------------------


def test_jit_of_a_future(floats):
    fut, want = floats
    traces = []

    def g(v):
        traces.append(v.aval)
        return jnp.sin(v) * 3

    jitted = jax.jit(g)
    _same(jitted(fut), jax.jit(g)(want))
    # The future traces as its own array would: the same cache entry, no retrace.
    traces.clear()
    _same(jitted(fut.result()), jitted(fut))
    _same(jitted(fut), jitted(fut))
    assert traces == [], traces


def test_jit_of_an_array_and_a_future(floats):
    fut, want = floats
    x = jnp.asarray(OTHER_FLOATS)

    @jax.jit
    def g(a, b):
        return a @ b + a * b

    _same(g(x, fut), g(x, want))
    _same(g(fut, fut), g(want, want))


def test_jit_of_a_sharded_future():
    pw.init(num_cpu_devices=8, islands=2)
    devices = pw.devices(mesh={"x": 4})
    fut = pw.jit(lambda v: v * 2, devices=devices, out_specs=pw.P("x"))(jnp.arange(8.0))
    want = jax.jit(lambda v: v * 2)(jnp.arange(8.0))
    got = jax.jit(lambda v: v.sum() + v)(fut)
    _same(got, jax.jit(lambda v: v.sum() + v)(want))
    assert got.sharding.device_set == set(devices.devices)  # computed where the value lives
    _same(list(fut), list(want))


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_jax_random_and_device_get_take_a_future_of_a_key_as_the_key(one, make_key):
    """A program that returns its next key (``state, key = step(state, key)``): jax.random takes it."""

    def advance(key):
        new, _ = jax.random.split(key)
        return new

    fut, want = _pair(advance, make_key(3), devices=one)
    assert isinstance(fut, pw.Future)
    for use in (
        lambda k: jax.random.split(k),
        lambda k: jax.random.split(k, (2, 3)),
        lambda k: jax.random.fold_in(k, 7),
        lambda k: jax.random.normal(k, (4,)),
        lambda k: jax.random.randint(k, (3,), 0, 10),
        lambda k: jax.random.bernoulli(k, 0.3, (5,)),
        lambda k: jax.random.permutation(k, 6),
        lambda k: jax.random.key_data(k),
    ):
        got, expected = use(fut), use(want)
        if jax.dtypes.issubdtype(expected.dtype, jax.dtypes.prng_key):
            got, expected = jax.random.key_data(got), jax.random.key_data(expected)
        _same(got, expected)
    assert jax.random.key_impl(fut) == jax.random.key_impl(want)
    # jax.device_get of a state holding it (a TrainState's key): what it gives for the array.
    got, expected = jax.device_get({"key": fut}), jax.device_get({"key": want})
    assert type(got["key"]) is type(expected["key"])
    _same(jax.random.key_data(got["key"]), jax.random.key_data(expected["key"]))
    # The key goes on to the next call, as the array would.
    again = pw.jit(advance, devices=one)(fut)
    _same(jax.random.key_data(again.result(timeout=60)), jax.random.key_data(advance(want)))


def test_is_ready_platform_clone_traceback_and_flat_answer_as_the_arrays_do(floats):
    fut, want = floats
    fut.result(timeout=60)
    assert fut.is_ready() is want.is_ready() is True
    assert fut.platform() == want.platform() == "cpu"
    _same(fut.clone(), want.clone())
    assert type(fut.traceback) is type(want.traceback)
    with pytest.raises(NotImplementedError, match="flatten"):
        jnp.ones(2).flat  # noqa: B018
    with pytest.raises(NotImplementedError, match="flatten"):
        fut.flat  # noqa: B018
    # Neither is_ready nor platform waits: a run held back by an unfinished input answers at once.
    gate = threading.Event()

    def slow(v):
        gate.wait(30)
        return v

    held = pw.jit(
        lambda v: jax.pure_callback(slow, jax.ShapeDtypeStruct(v.shape, v.dtype), v), devices=fut.slice
    )(want)
    try:
        assert held.is_ready() is False
        assert held.platform() == "cpu"
    finally:
        gate.set()
    assert held.result(timeout=60).is_ready()


def test_tree_map_over_futures_keeps_them_leaves(one):
    pairs = {"a": _pair(_double, FLOATS, devices=one), "b": _pair(_double, INTS, devices=one)}
    futures = {name: fut for name, (fut, _) in pairs.items()}
    plain = {name: want for name, (_, want) in pairs.items()}
    assert all(type(leaf) is pw.Future for leaf in jax.tree.leaves(futures))
    _same(
        list(jax.tree.map(lambda x: x * 2, futures).values()),
        list(jax.tree.map(lambda x: x * 2, plain).values()),
    )
    _same(list(jax.tree.map(lambda f: f.result(), futures).values()), list(plain.values()))


# --- methods and properties ----------------------------------------------------------------

METHODS = {
    "astype": lambda a: a.astype(jnp.int32),
    "reshape": lambda a: a.reshape(3, 2),
    "reshape_tuple": lambda a: a.reshape((-1,)),
    "T": lambda a: a.T,
    "mT": lambda a: a.mT,
    "ndim": lambda a: a.ndim,
    "size": lambda a: a.size,
    "nbytes": lambda a: a.nbytes,
    "itemsize": lambda a: a.itemsize,
    "sum": lambda a: a.sum(),
    "sum_axis": lambda a: a.sum(axis=0),
    "mean": lambda a: a.mean(axis=1),
    "max": lambda a: a.max(),
    "argmax": lambda a: a.argmax(),
    "cumsum": lambda a: a.cumsum(),
    "transpose": lambda a: a.transpose(1, 0),
    "flatten": lambda a: a.flatten(),
    "clip": lambda a: a.clip(2, 8),
    "at_set": lambda a: a.at[0, 1].set(-1.0),
    "real": lambda a: a.real,
    "weak_type": lambda a: a.weak_type,
    "copy": lambda a: a.copy(),
    "copy.copy": copy.copy,
    "copy.deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("name", list(METHODS))
def test_method(matrix, name):
    fut, want = matrix
    _same(METHODS[name](fut), METHODS[name](want))


# --- Flax NNX ------------------------------------------------------------------------------


def test_nnx_linear_with_future_parameters_outside_a_program(one):
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    kernel, bias = model.kernel.get_value(), model.bias.get_value()
    x = jnp.arange(8.0, dtype=jnp.float32).reshape(2, 4)

    def update(k, b):
        return k * 2, b + 1

    @jax.jit
    def reference(k, b, x):
        k, b = update(k, b)
        return x @ k + b

    new_kernel, new_bias = pw.jit(update, devices=one)(kernel, bias)
    model.kernel.set_value(new_kernel)
    model.bias.set_value(new_bias)
    assert type(model.kernel.get_value()) is pw.Future
    _same(model(x), reference(kernel, bias, x))
    _same(nnx.jit(lambda m, v: m(v))(model, x), reference(kernel, bias, x))


# --- errors and waiting --------------------------------------------------------------------


def _explode(x):
    raise ValueError("boom")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "use",
    ["add", "radd", "float", "jnp.asarray", "np.asarray", "jax.jit", "method", "format"],
)
def test_failed_run_raises_the_result_error(one, use):
    failing = pw.jit(
        lambda v: jax.pure_callback(_explode, jax.ShapeDtypeStruct(v.shape, v.dtype), v), devices=one
    )
    fut = failing(jnp.ones(()))
    with pytest.raises(pw.errors.ProgramFailedError):
        fut.result(timeout=30)
    uses = {
        "add": lambda: fut + 1,
        "radd": lambda: 1.0 + fut,
        "float": lambda: float(fut),
        "jnp.asarray": lambda: jnp.asarray(fut),
        "np.asarray": lambda: np.asarray(fut),
        "jax.jit": lambda: jax.jit(lambda v: v + 1)(fut),
        "method": lambda: fut.sum(),
        "format": lambda: f"{fut:.3f}",
    }
    with pytest.raises(pw.errors.ProgramFailedError):
        uses[use]()


def _gated(event: threading.Event):
    """A function whose output waits for ``event`` inside a host callback."""

    def wait(x):
        if not event.wait(30):
            raise TimeoutError("the test never set the event")
        return np.asarray(x) * 3

    return lambda x: jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


@pytest.mark.timeout(60)
def test_future_passed_to_a_program_is_not_waited_on(one):
    devices = one
    release = threading.Event()
    hold = pw.jit(_gated(release), devices=devices)
    after = pw.jit(lambda v: v * 2 + 1, devices=devices)
    x = jnp.arange(4.0)
    try:
        pending = hold(x)
        out = after(pending)
        assert not release.is_set()
        assert not pending.done(), "the second call waited for its input"
        assert not out.done()
        # Metadata and repr come without waiting either.
        assert (pending.shape, pending.ndim, pending.size, len(pending)) == ((4,), 1, 4, 4)
        assert repr(pending).startswith("Future(program ")
        # The held run is inside its dispatch (its callback waits); the next one is queued.
        assert repr(pending).endswith("pending: queued, or being dispatched)"), repr(pending)
        assert repr(out).endswith("pending: queued, or being dispatched)"), repr(out)
        assert not pending.done()
        release.set()
        _same(out.result(timeout=30), jax.jit(lambda v: v * 3 * 2 + 1)(x))
        _same(pending + 0, jax.jit(lambda v: v * 3 + 0)(x))
    finally:
        release.set()


def test_results_replaces_every_future_of_a_tree_and_keeps_other_leaves(one):
    fut, want = _pair(lambda v: v * 2, FLOATS, devices=one)
    plain = jnp.ones(2)
    got = pw.results({"a": fut, "b": [plain, 3, None]})
    assert type(got["a"]) is type(want) and got["b"][0] is plain and got["b"][1] == 3
    _same(got["a"], want)


def test_an_uncommitted_future_combines_in_jax_jit_and_pmap_as_jax_jits_output_does():
    # jax.jit places a call by its arguments' `_committed` (True when missing): a future nothing
    # placed counted as committed to device 0 and clashed with an array committed elsewhere.
    twice = pw.program(_double)
    x = jnp.ones((8, 2))
    fut, arr = twice(x), jax.jit(_double)(x)
    assert fut.committed is arr.committed is False
    elsewhere = jax.device_put(jnp.ones((8, 2)), jax.devices()[3])
    add = jax.jit(lambda a, b: a + b)
    got, want = add(fut, elsewhere), add(arr, elsewhere)
    assert got.devices() == want.devices() == {jax.devices()[3]}
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    bump = jax.pmap(lambda a: a + 1)
    np.testing.assert_array_equal(np.asarray(bump(fut)), np.asarray(bump(arr)))


def test_reading_a_future_whose_buffer_a_jax_jit_donation_consumed_raises_as_jax_does():
    twice = pw.program(_double)
    consume = jax.jit(lambda a: a + 1, donate_argnums=0)
    arr = jax.jit(_double)(jnp.ones(3))
    consume(arr)
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(arr)
    fut = twice(jnp.ones(3))
    fut.result()
    consume(fut)
    with pytest.raises(RuntimeError, match="has been deleted: a computation it was donated to") as info:
        fut.result()
    assert isinstance(info.value, pw.errors.PathwaysError)
    assert not isinstance(info.value, pw.errors.ProgramFailedError)  # the program did not fail


def test_repr_of_a_future_whose_run_failed_on_its_devices_says_failed(one):
    # The run's array exists (its store state is ready) but raises when read: repr said "ready".
    def boom(v):
        raise ValueError("no value here")

    fails = pw.jit(lambda v: jax.pure_callback(boom, jax.ShapeDtypeStruct(v.shape, v.dtype), v), devices=one)
    out = fails(jnp.ones(3))
    with pytest.raises(pw.errors.ProgramFailedError):
        out.result(timeout=30)
    assert ", failed: " in repr(out) and "\n" not in repr(out), repr(out)
    assert repr(pw.jit(lambda v: v + 1, devices=one)(jnp.ones(3))).endswith(("ready)", "computing)"))
