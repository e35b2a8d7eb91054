"""Host values fed to a program each call (a step number, a learning rate, a numpy batch): the repeat
call skips signing and hands them to the executable as ``jax.jit``'s call takes them.

What is counted here, not timed (figures live in ``benchmarks/cliffs.py``): the calls that sign
their arguments and the runs' own transfers of host values. Every result is compared with
``jax.jit`` on the same inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, gated

import pathways_jax as pw
from pathways_jax._src.api import program_info
from pathways_jax._src.core import arrays

pytestmark = pytest.mark.timeout(120)

# One host value per call, of each kind a train loop passes: (the value of call i, its kind's name).
_HOST_VALUES = {
    "float": lambda i: 0.25 * i,
    "int": lambda i: i,
    "bool": lambda i: i % 2 == 0,
    "complex": lambda i: complex(i, -i),
    "numpy float32": lambda i: np.float32(0.5 * i),
    "numpy int32": lambda i: np.int32(3 * i),
    "numpy array": lambda i: np.full((4,), 0.5 * i, np.float32),
}


def _step(v, s):
    return v * 0.5 + jnp.real(s) * 2 if jnp.iscomplexobj(s) else v * 0.5 + s * 2


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls that sign their arguments and the runs' own transfers of host values."""
    seen = {"signed": 0, "put": 0}
    sign, put = program_info._signed, arrays.put

    def signing(*args, **kwargs):
        seen["signed"] += 1
        return sign(*args, **kwargs)

    def putting(*args, **kwargs):
        seen["put"] += 1
        return put(*args, **kwargs)

    monkeypatch.setattr(program_info, "_signed", signing)
    monkeypatch.setattr(arrays, "put", putting)
    return seen


@pytest.mark.parametrize("kind", list(_HOST_VALUES))
def test_a_loop_fed_a_host_value_each_call_signs_once_and_matches_jax_jit(kind, counted):
    pw.init(num_cpu_devices=8)
    make = _HOST_VALUES[kind]
    program, reference = pw.program(_step), jax.jit(_step)
    x = jnp.arange(4.0)
    got, want = program(x, make(0)), reference(x, make(0))
    got, want = program(got, make(1)), reference(want, make(1))  # the first with a future
    assert_matches(got, want, rtol=0, atol=0)
    signed = counted["signed"]
    outs = []
    for i in range(2, 12):
        got, want = program(got, make(i)), reference(want, make(i))
        outs.append((got, want))
    # Futures of the call before and a host value of the same type: the first call's plan, unsigned.
    assert counted["signed"] == signed
    # The host values went to the executable as they are, as jax.jit's call takes them.
    assert counted["put"] == 0
    for got, want in outs:
        assert_matches(got, want, rtol=0, atol=0)
        assert got.dtype == want.dtype and got.weak_type == want.weak_type


def test_a_host_value_of_another_type_or_shape_is_signed_and_traced_as_jax_jit_traces_it(counted):
    pw.init(num_cpu_devices=8)
    program, reference = pw.program(_step), jax.jit(_step)
    x = jnp.arange(4.0)
    calls = [
        0.5,
        1.5,
        2,
        np.float32(2.5),
        np.float64(1.0),
        np.ones(4, np.float32),
        np.ones((1, 4), np.float32),
    ]
    for value in calls:
        signed = counted["signed"]
        got, want = program(x, value), reference(x, value)
        assert counted["signed"] == signed + (value is not calls[1])  # only a repeat of the type skips it
        assert_matches(got, want, rtol=0, atol=0)
        assert got.shape == want.shape and got.dtype == want.dtype and got.weak_type == want.weak_type
    with pytest.raises(OverflowError):  # checked per call, as jax.jit checks it
        program(x, 2**40)
    with pytest.raises(OverflowError):
        reference(x, 2**40)
    assert_matches(program(x, 7), reference(x, 7))  # and the program still serves


def test_host_values_on_a_sharded_slice_and_on_two_slices_match_jax_jit(counted):
    pw.init(num_cpu_devices=8)
    four = pw.devices(mesh={"x": 4})
    one = pw.devices(mesh={"x": 1})
    sharded = pw.jit(_step, devices=four, in_specs=(pw.P("x"), None), out_specs=pw.P("x"))
    mesh = jax.sharding.Mesh(np.array(four.devices), ("x",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    reference = jax.jit(_step, in_shardings=(rows, None), out_shardings=rows)

    @pw.program
    def across(v, s):  # the host value is read on two slices
        with four:
            a = jax.jit(lambda t, k: t * k)(v, s)
        with one:
            b = jax.jit(lambda t, k: t + k)(v, s)
        return a, b

    x = jnp.arange(8.0)
    got, want = sharded(x, 0.0), reference(x, 0.0)
    pair = across(x, np.float32(0.0))
    for i in range(1, 6):
        got, want = sharded(got, 0.5 * i), reference(want, 0.5 * i)
        pair = across(x, np.float32(i))
        assert_matches(pair, (x * np.float32(i), x + np.float32(i)), rtol=0, atol=0)
    assert_matches(got, want, rtol=0, atol=0)
    assert got.sharding.is_equivalent_to(want.sharding, 1)
    assert counted["put"] == 0


def test_a_numpy_array_changed_after_the_call_while_its_run_is_queued_is_read_as_it_was():
    pw.init(num_cpu_devices=8, islands=2, max_in_flight=1)
    s = pw.devices(mesh={"x": 1}, island=0)
    plug, gate, entered = gated(s)
    add = pw.jit(lambda v, b: v + b, devices=s)
    x = jnp.arange(4.0)
    batch = np.full(4, 1.0, np.float32)
    assert_matches(add(x, batch), x + 1)  # the plan, made before the plug
    held = plug(x)  # holds the island's one window place until the gate opens
    assert entered.wait(20)
    scale = 3.0
    queued = (add(x, batch), pw.jit(lambda v, k: v * k, devices=s)(x, scale))
    assert type(queued[0]._entry.state).__name__ == "Pending"
    batch[:] = 100.0  # the caller reuses its buffer for the next batch, as loaders do
    gate.set()
    assert_matches(queued, (x + 1, x * 3.0), rtol=0, atol=0)
    assert_matches(held, x)
    s.release()


def test_a_transfer_guard_sees_host_values_at_the_call_as_under_jax_jit():
    pw.init(num_cpu_devices=8)
    program, reference = pw.program(_step), jax.jit(_step)
    x = jnp.arange(4.0)
    assert_matches(program(x, 1.0), reference(x, 1.0))  # compiled outside the guards
    assert_matches(program(x, np.float32(1.0)), reference(x, np.float32(1.0)))
    for value in (2.0, np.float32(2.0), np.ones(4, np.float32)):
        with jax.transfer_guard("disallow_explicit"):  # jax.jit refuses these at the call too
            with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
                reference(x, value)
            with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
                program(x, value)
        with jax.transfer_guard("log_explicit"):
            assert_matches(program(x, value), reference(x, value))
    assert_matches(program(x, 3.0), reference(x, 3.0))


def test_a_loop_fed_batches_put_on_devices_each_call_signs_once_and_matches_jax_jit(counted):
    # jax.device_put(batch) gives each array a sharding object of its own, equal to the last.
    pw.init(num_cpu_devices=8)

    def step(params, batch):
        return jax.tree.map(lambda v: v * 0.9 + batch.mean(), params), batch.sum()

    program, reference = pw.program(step), jax.jit(step)
    params = {"w": jnp.ones(4), "b": jnp.zeros(())}
    got = want = params
    batches = [jax.device_put(np.full((8,), i, np.float32)) for i in range(12)]
    assert batches[0].sharding is not batches[1].sharding
    signed = 0
    for i, batch in enumerate(batches):
        if i == 2:
            signed = counted["signed"]  # after the first call with arrays and the first with futures
        got, loss = program(got, batch)
        want, want_loss = reference(want, batch)
    assert counted["signed"] == signed
    assert_matches((got, loss), (want, want_loss), rtol=0, atol=0)
    other = jax.device_put(np.ones(8, np.float32), jax.devices()[1])  # another device: signed anew
    assert_matches(program(params, other), reference(params, other), rtol=0, atol=0)
    assert counted["signed"] == signed + 1


def test_a_loop_fed_a_new_typed_prng_key_each_call_signs_once_and_matches_jax_jit(counted):
    # The key a loop splits off eagerly each step (jax.random.key, as JAX's docs advise) is an
    # array of its own type: it was signed each call, the whole call with it.
    pw.init(num_cpu_devices=8)

    def step(params, key):
        return jax.tree.map(lambda v: v + 0.1 * jax.random.normal(key, v.shape), params)

    program, reference = pw.program(step), jax.jit(step)
    got = want = {"w": jnp.ones(4), "b": jnp.zeros(())}
    key = jax.random.key(0)
    signed = 0
    for i in range(12):
        if i == 2:
            signed = counted["signed"]
        key, sub = jax.random.split(key)
        got, want = program(got, sub), reference(want, sub)
    assert counted["signed"] == signed
    assert_matches(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["static_argnums", "static_argnames"])
def test_a_loop_with_static_arguments_signs_once_and_each_static_value_runs_its_own_trace(how, counted):
    pw.init(num_cpu_devices=8)

    def step(params, batch, train=False):
        return jax.tree.map(lambda v: v * (0.5 if train else 2.0) + batch.mean(), params)

    options = {"static_argnums": (2,)} if how == "static_argnums" else {"static_argnames": ("train",)}
    program, reference = pw.program(step, **options), jax.jit(step, **options)

    def call(fn, params, batch, train):
        return fn(params, batch, train) if how == "static_argnums" else fn(params, batch, train=train)

    got = want = {"w": jnp.ones(4), "b": jnp.zeros(())}
    batch = jnp.arange(8.0)
    signed = 0
    for i in range(10):
        if i == 2:
            signed = counted["signed"]
        got, want = call(program, got, batch, True), call(reference, want, batch, True)
    assert counted["signed"] == signed  # the same static value: the call before's plan, unsigned
    assert_matches(got, want, rtol=0, atol=0)
    for train in (False, True, False, 1, 1.0):  # another value, or an equal one of another type
        before = counted["signed"]
        got, want = call(program, got, batch, train), call(reference, want, batch, train)
        assert counted["signed"] == before + 1
        assert_matches(got, want, rtol=0, atol=0)
    if how == "static_argnames":  # left to its default after it was given True: the default's trace
        got, want = call(program, got, batch, True), call(reference, want, batch, True)
        before = counted["signed"]
        got, want = program(got, batch), reference(want, batch)
        assert counted["signed"] == before + 1
        assert_matches(got, want, rtol=0, atol=0)
