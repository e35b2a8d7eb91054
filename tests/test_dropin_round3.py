"""Drop-in use met by third-party code: what ``jax.jit`` user code does around its jitted functions.

Each test runs the same code with ``jax.jit`` and with ``@pw.program`` /
``pw.jit`` in its place, on identical inputs, and compares what comes back.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

pytestmark = pytest.mark.timeout(60)


class _Trainer:
    """Training code keeping its jitted step on itself, as many trainers do."""

    def __init__(self, wrap):
        self.scale = 3.0
        self.step = wrap(self._step)

    def _step(self, x):
        return x * self.scale


@pytest.mark.parametrize("wrap", [pw.program, pw.jit], ids=["pw.program", "pw.jit"])
def test_an_object_holding_a_program_deep_copies_as_one_holding_a_jax_jit_function(wrap):
    # copy.deepcopy of a trainer, a config or an nnx.Module holding a program raised TypeError:
    # "cannot pickle '_thread.RLock' object"; one holding a jax.jit function copies, and its
    # copy runs the function as the original does.
    x = jnp.arange(4.0)
    want = copy.deepcopy(_Trainer(jax.jit))
    have = copy.deepcopy(_Trainer(wrap))
    np.testing.assert_array_equal(pw.results(have.step(x)), want.step(x))
    assert copy.deepcopy({"step": have.step})["step"](x).dtype == want.step(x).dtype


class _ConfigError(ValueError):
    """An exception of the user's that carries what went wrong, as many libraries' do."""

    def __init__(self, field, detail):
        super().__init__(f"{field}: {detail}")
        self.field = field


def _raising(exc):
    def step(x):
        if x.ndim:  # raised while tracing, as a bad configuration or a missing file is
            raise exc
        return x

    return step


@pytest.mark.parametrize(
    "exc, read",
    [
        (_ConfigError("lr", "must be positive"), lambda e: e.field),
        (FileNotFoundError(2, "No such file or directory", "vocab.txt"), lambda e: (e.errno, e.filename)),
        (StopIteration(7), lambda e: e.value),
        (ExceptionGroup("two checks failed", [ValueError("a"), KeyError("b")]), lambda e: len(e.exceptions)),
    ],
    ids=["own attribute", "OSError", "StopIteration", "ExceptionGroup"],
)
def test_an_exception_raised_while_tracing_carries_its_attributes_as_under_jax_jit(exc, read):
    # The error raised was of the exception's class but lost what except clauses read of it
    # (e.field, errno and filename were None, StopIteration.value None), and an ExceptionGroup
    # raised a TypeError from its wrapping instead (BaseExceptionGroup.__new__ takes 2 arguments).
    x = jnp.arange(3.0)
    with pytest.raises(type(exc)) as want:
        jax.jit(_raising(exc))(x)
    with pytest.raises(type(exc)) as have:
        pw.program(_raising(exc))(x)
    assert isinstance(have.value, pw.errors.ProgramTraceError)
    assert read(have.value) == read(want.value)


@pytest.mark.parametrize("placed", [False, True], ids=["no sharding", "NamedSharding"])
def test_lowering_with_shape_dtype_structs_warms_the_call_as_jax_jits_aot_lowering_does(placed):
    # jax.jit(f).lower(sds).compile() (the AOT guide's warm-up) makes jax.jit(f)(x) compile
    # nothing; the program traced, lowered and compiled again at its first call with arrays.
    mesh = jax.make_mesh((2,), ("i",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i")) if placed else None
    x = jnp.arange(8.0) if sharding is None else jax.device_put(jnp.arange(8.0), sharding)

    def step(v, scale):
        return jnp.tanh(v) * scale, v.sum()

    abstract = (
        jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    program = pw.program(step)
    assert program.lower(*abstract).as_text() == jax.jit(step).lower(*abstract).as_text()
    program.lower(*abstract).compile()
    pw.reset_counters()
    have = pw.results(program(x, jnp.float32(2.0)))
    assert (pw.counters()["traces"], pw.counters()["compiles"]) == (0, 0)
    for got, want in zip(have, jax.jit(step)(x, jnp.float32(2.0)), strict=True):
        np.testing.assert_array_equal(got, want)
        assert (got.sharding, got.committed) == (want.sharding, want.committed)


def _three(v):
    return v * 2, v.sum(), jnp.sin(v)


@pytest.mark.parametrize("wrap", [jax.jit, pw.program], ids=["jax.jit", "pw.program"])
def test_a_calls_outputs_go_once_its_futures_and_arrays_are_dropped_as_jax_jits_do(wrap):
    # The controller's windows kept an output of each of the last runs (what they watch to bound
    # the work queued on a device) until a later call looked at them, and a dropped future's
    # value went at the next call: after a loop, 2-3 arrays stayed alive that the user had
    # dropped, where jax.jit's go at once.
    import gc

    from helpers import wait_for

    def quiet() -> None:  # the runtime let go of what it watched (its windows settled)
        if wrap is pw.program:
            assert wait_for(lambda: not pw.cluster().controller.windows.markers(), timeout=10)
        gc.collect()

    def alive() -> int:
        gc.collect()
        return len(jax.live_arrays())

    step, x = wrap(_three), jnp.arange(1000.0)
    jax.block_until_ready(pw.results(step(x)))  # compiled, off the count
    quiet()
    base = alive()
    for _ in range(10):
        got = pw.results(step(x))
        np.testing.assert_array_equal(np.asarray(got[0]), np.arange(1000.0, dtype=np.float32) * 2)
        del got
    assert wait_for(lambda: alive() == base, timeout=10), alive() - base
    # Dropped once the runtime went quiet (training ended, say), they go at once, not at the
    # next program call.
    outs = step(x)
    jax.block_until_ready(pw.results(outs))
    quiet()
    assert alive() == base + 3
    del outs
    assert alive() == base
