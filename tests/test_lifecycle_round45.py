"""Moments of failure on the local backend: exceptions a signal handler raises inside the runtime's work.

A handler of ``SIGALRM`` or ``SIGUSR1`` that raises an ordinary exception (a
time budget: ``signal.alarm`` raising ``TimeoutError``) runs on the main thread
wherever it is, pathways_jax's own dispatch included: what it raises is the
user's, and must reach the user's ``except``, as it would under ``jax.jit``.
"""

import random
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches

import pathways_jax as pw
from pathways_jax._src.core import arrays


class _OutOfTime(Exception):  # what a time budget's SIGALRM handler raises (TimeoutError and the like)
    pass


def _landing_in(names: set[str], frame) -> bool:
    """Whether ``frame`` runs inside a function of ``names``, and not in a finalizer (whose
    exceptions Python itself only reports as unraisable)."""
    inside = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith("weakref.py"):
            return False
        inside = inside or code.co_name in names
        frame = frame.f_back
    return inside


def _case(where: str):
    """A call whose work includes ``where`` (a function of pathways_jax), its input, and jax.jit's answer."""
    body = lambda v: v * 0.5 + 1  # noqa: E731
    x = jnp.arange(8.0)
    return pw.program(body), (x,), jax.jit(body)(x)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["_try_inline"])
def test_an_exception_a_signal_handler_raises_inside_a_call_reaches_the_caller(where):
    # Inside the inline dispatch it was taken for a bug of the controller's own: the run failed
    # with "This is a bug of pathways_jax", the handler's exception was swallowed and the caller's
    # loop went on; inside a host input's transfer it was dropped.
    pw.init(num_cpu_devices=8)
    step, args, want = _case(where)
    step(*args).result()
    landed = []

    def on_signal(signum, frame):
        # Raises only where it landed inside ``where``: elsewhere it returns.
        if _landing_in({where}, frame):
            landed.append(True)
            raise _OutOfTime("the step's time budget is spent")

    stop = threading.Event()

    def signaller():
        rng = random.Random(0)
        while not stop.is_set():
            time.sleep(rng.uniform(0, 5e-4))
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    thread = threading.Thread(target=signaller, daemon=True)
    caught, futures = 0, []
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while caught < 2 and time.monotonic() < deadline:
            try:
                futures.append(step(*args))
            except _OutOfTime:
                caught += 1
    finally:
        stop.set()
        thread.join(10)
        signal.signal(signal.SIGUSR1, previous)
    # (Several may land while one unwinds, as Ctrl-C's do: the caller gets one of them.)
    assert caught >= 2, f"{len(landed)} exceptions raised inside {where}, {caught} reached the caller"
    for future in futures:  # every call that returned: its run was not failed by a handler
        assert_matches(future, want)
    assert_matches(step(*args), want)  # and the controller keeps serving


@pytest.mark.timeout(60)
def test_an_exception_a_signal_handler_raises_inside_a_host_values_transfer_reaches_the_caller(monkeypatch):
    # A host value goes to its devices through JAX's own call for host data (arrays.put: fetched
    # values, host inputs under a transfer guard), whose failures it hands to jax.device_put to
    # name: a handler's exception landing inside that call was dropped there.
    x = np.arange(8.0, dtype=np.float32)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shard = arrays._shard

    def interrupted(*args):  # the alarm lands while JAX's call runs
        signal.raise_signal(signal.SIGUSR1)
        return shard(*args)

    def on_signal(signum, frame):
        raise _OutOfTime("the step's time budget is spent")

    monkeypatch.setattr(arrays, "_shard", interrupted)
    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        with pytest.raises(_OutOfTime):
            arrays.put(x, sharding)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    monkeypatch.setattr(arrays, "_shard", shard)
    assert_matches(arrays.put(x, sharding), jnp.asarray(x))


@pytest.mark.timeout(120)
def test_an_exception_a_signal_handler_raises_while_an_nnx_model_is_split_reaches_the_caller():
    # It became a ProgramTraceError ("got Flax NNX objects it cannot split"), which the caller's
    # `except TimeoutError` misses. The handler lands inside the split (Flax's, as nnx.jit's).
    from flax import nnx

    from pathways_jax._src.api import nnx_graph

    pw.init(num_cpu_devices=8)
    program = pw.program(lambda m, v: m(v))
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def split():
        signal.raise_signal(signal.SIGUSR1)  # the alarm, landing while Flax splits the model
        return nnx.split(model)

    def on_signal(signum, frame):
        raise _OutOfTime("the step's time budget is spent")

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        with pytest.raises(_OutOfTime) as raised:
            nnx_graph._to_tree(program, split)
        assert not isinstance(raised.value, pw.errors.PathwaysError), type(raised.value).__mro__
    finally:
        signal.signal(signal.SIGUSR1, previous)
    x = jnp.ones((2, 4))
    assert_matches(program(model, x), nnx.jit(lambda m, v: m(v))(model, x))


@pytest.mark.timeout(120)
def test_an_exception_a_signal_handler_raises_while_result_waits_reaches_the_caller_as_it_is(monkeypatch):
    # It came back as ProgramFailedError("... failed while executing"), as though the run had failed.
    pw.init(num_cpu_devices=8)
    from pathways_jax._src.runtime import futures

    step = pw.program(lambda v: v * 2)
    x = jnp.arange(4.0)
    future = step(x)
    waited = futures._wait_ready

    def interrupted(array, deadline):  # the wait for the value, with the alarm landing in it
        signal.raise_signal(signal.SIGUSR1)
        return waited(array, deadline)

    def on_signal(signum, frame):
        raise _OutOfTime("the step's time budget is spent")

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        monkeypatch.setattr(futures, "_wait_ready", interrupted)
        with pytest.raises(_OutOfTime) as raised:
            future.result(timeout=30)
        assert not isinstance(raised.value, pw.errors.PathwaysError), type(raised.value).__mro__
    finally:
        signal.signal(signal.SIGUSR1, previous)
        monkeypatch.undo()
    assert_matches(future, x * 2)  # the run was not failed by it


def test_a_refused_argument_leaf_is_named_by_its_place_in_the_call_as_jax_jit_names_it():
    # It said only "argument leaf 0", which in a large train state is hard to find; jax.jit names
    # the path ("at path state['config']").
    class Config:  # a value that is no array: passed in the state by mistake
        pass

    def body(state, batch, *, scale):
        return state["w"] * batch * scale

    step = pw.program(body)
    with pytest.raises(TypeError, match=r"^program 'body' got argument leaf 0 of type Config") as info:
        step({"w": jnp.ones(2), "config": Config()}, jnp.ones(2), scale=1.0)
    assert isinstance(info.value, pw.errors.ProgramTraceError)
    assert "(Argument leaf 0 is args[0]['config'] in the call.)" in str(info.value)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"leaf 2 is kwargs\['scale'\] in the call"):
        step({"w": jnp.ones(2)}, jnp.ones(2), scale=Config())
    with pytest.raises(TypeError, match=r"at path"):  # as jax.jit names it
        jax.jit(body)({"w": jnp.ones(2), "config": Config()}, jnp.ones(2), scale=1.0)
