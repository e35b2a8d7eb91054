"""User code at trace time cannot stall the runtime or fill its caches (issue 17).

A trace runs the user's Python: a thread it starts may call the same program,
and a static argument may be a value no cache can key on. Each test carries a
deadline, so a deadlock fails fast instead of hanging the suite.
"""

import math
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw
from tests.helpers import assert_matches

JOIN_S = 10  # how long a trace waits for the thread it started


def _run_in_thread(call) -> tuple[threading.Thread, list, list]:
    """Starts ``call`` on a thread; returns the thread, its results and its failures."""
    results: list = []
    failures: list[BaseException] = []

    def target():
        try:
            results.append(call())
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, results, failures


# --- a thread started inside a trace calls the same program ---------------------------------


@pytest.mark.timeout(60)
def test_thread_started_in_a_trace_calls_the_same_program_with_the_same_arguments():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    x = jnp.arange(4.0)
    inner: dict = {}

    @pw.program(devices=s)
    def step(v):
        if not inner:  # only the first trace starts a thread; its own trace does not
            inner["started"] = True
            thread, results, failures = _run_in_thread(lambda: step(x).result(timeout=JOIN_S))
            thread.join(JOIN_S)
            inner.update(alive=thread.is_alive(), results=results, failures=failures)
        return jnp.sin(v) * 2 + 1

    pw.reset_counters()
    out = step(x)
    assert not inner["alive"], "the thread's call of the program waited on the trace that joined it"
    assert not inner["failures"], inner["failures"]
    want = jax.jit(lambda v: jnp.sin(v) * 2 + 1)(x)
    assert_matches(out, want)
    assert_matches(inner["results"][0], want)
    # Both traces ran; one graph is kept and lowered once, so a third call neither traces nor lowers.
    assert pw.counters()["lowerings"] == 1
    before = pw.counters()
    assert_matches(step(x), want)
    after = pw.counters()
    assert after["traces"] == before["traces"] and after["lowerings"] == before["lowerings"]


@pytest.mark.timeout(60)
def test_a_trace_waiting_on_other_threads_first_calls_lets_them_finish_and_lowers_each_once():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    tracing, others_done = threading.Event(), threading.Event()
    seen: dict = {}

    @pw.program(devices=s)
    def total(v):
        if not seen:  # the first trace waits until the other threads' calls have finished
            seen["waiting"] = True
            tracing.set()
            seen["others_finished"] = others_done.wait(JOIN_S)
        return (v * v).sum()

    pw.reset_counters()
    first = _run_in_thread(lambda: total(jnp.arange(4.0)).result(timeout=2 * JOIN_S))
    assert tracing.wait(JOIN_S)  # the first trace is under way
    inputs = [jnp.arange(4.0), jnp.arange(4.0) + 1, jnp.ones(6)]  # two of its signature, one other
    others = [_run_in_thread(lambda v=v: total(v).result(timeout=JOIN_S)) for v in inputs]
    for thread, _, _ in others:
        thread.join(2 * JOIN_S)
    others_done.set()
    first[0].join(2 * JOIN_S)
    threads = [first, *others]
    assert not any(thread.is_alive() for thread, _, _ in threads)
    assert not any(failures for _, _, failures in threads), [f for _, _, f in threads]
    assert seen["others_finished"], "the other calls waited on the trace that was waiting for them"
    reference = jax.jit(lambda v: (v * v).sum())
    for (_, results, _), v in zip(threads, [jnp.arange(4.0), *inputs], strict=True):
        assert_matches(results[0], reference(v))
    # A signature traced twice at once keeps one graph: each signature is lowered and compiled once.
    assert pw.counters()["lowerings"] == 2
    assert pw.counters()["compiles"] == 2


@pytest.mark.timeout(60)
def test_thread_started_inside_a_pw_jit_function_calls_it_again():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    x = jnp.arange(4.0)
    inner: dict = {}

    def body(v):
        if not inner:
            inner["started"] = True
            thread, results, failures = _run_in_thread(lambda: double(x).result(timeout=JOIN_S))
            thread.join(JOIN_S)
            inner.update(alive=thread.is_alive(), results=results, failures=failures)
        return v * 2

    double = pw.jit(body, devices=s)
    pw.reset_counters()
    out = double(x)
    assert not inner["alive"], "the thread's call of the pw.jit function waited on the trace that joined it"
    assert not inner["failures"], inner["failures"]
    want = jax.jit(lambda v: v * 2)(x)
    assert_matches(out, want)
    assert_matches(inner["results"][0], want)
    # The two traces make one graph, lowered and compiled once.
    assert pw.counters()["lowerings"] == 1 and pw.counters()["compiles"] == 1


# --- static arguments that cannot be cache keys ---------------------------------------------


class _RaisingEq:
    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing this")


class _RaisingHash:
    def __hash__(self) -> int:
        raise RuntimeError("no hashing this")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (float("nan"), "nan"),
        (np.float64("nan"), "nan"),
        (np.float32("nan"), "nan"),
        (complex(math.nan, 0.0), "nan"),
        ((1.0, (2, float("nan"))), r"\[1\]\[1\]"),
        (frozenset({float("nan")}), "nan"),
    ],
    ids=["float", "numpy-float64", "numpy-float32", "complex", "nested-tuple", "frozenset"],
)
def test_nan_static_argument_is_refused_instead_of_retracing(value, shown):
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})

    @pw.program(devices=s, static_argnums=1)
    def scaled(x, eps):
        return x * 2

    pw.reset_counters()
    with pytest.raises(pw.errors.ProgramTraceError) as info:
        scaled(jnp.ones(2), value)  # the call the message points at
    message = str(info.value)
    assert "static argument 1 of program 'scaled'" in message
    assert "not equal to itself" in message and "cache key" in message
    assert "test_faults_trace.py" in message and "test_nan_static_argument" in message
    assert "static_argnums" in message  # what to do
    assert re.search(shown, message), message
    assert isinstance(info.value, TypeError)
    assert pw.counters()["traces"] == 0
    # The same computation with the value traced instead matches jax.jit.
    plain = pw.program(lambda x, eps: x * 2, devices=s)
    assert_matches(plain(jnp.ones(2), 0.5), jax.jit(lambda x, eps: x * 2)(jnp.ones(2), 0.5))


@pytest.mark.timeout(60)
def test_nan_static_argname_and_pw_jit_static_argnum_are_refused():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})

    @pw.program(devices=s, static_argnames="eps")
    def scaled(x, eps=1.0):
        return x + eps

    with pytest.raises(pw.errors.ProgramTraceError, match=r"static argument 'eps' of program 'scaled'.*nan"):
        scaled(jnp.ones(2), eps=math.nan)
    assert_matches(scaled(jnp.ones(2), eps=2.0), jax.jit(lambda x: x + 2.0)(jnp.ones(2)))

    add = pw.jit(lambda x, k: x + k, devices=s, static_argnums=1)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"static argument 1 .*not equal to itself"):
        add(jnp.ones(2), float("nan"))
    assert_matches(add(jnp.ones(2), 3.0), jax.jit(lambda x: x + 3.0)(jnp.ones(2)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("value", "raised"),
    [
        (_RaisingEq(), "comparing it with itself raised RuntimeError: no comparing this"),
        (_RaisingHash(), "hashing it raised RuntimeError: no hashing this"),
        ((1, _RaisingEq()), "comparing it with itself raised RuntimeError"),
    ],
    ids=["eq-raises", "hash-raises", "nested-eq-raises"],
)
def test_static_argument_whose_eq_or_hash_raises_gets_a_trace_error(value, raised):
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})

    @pw.program(devices=s, static_argnums=1)
    def scaled(x, how):
        return x * 3

    with pytest.raises(pw.errors.ProgramTraceError) as info:
        scaled(jnp.ones(2), value)
    message = str(info.value)
    assert "static argument 1 of program 'scaled'" in message and raised in message, message
    assert "_Raising" in message  # what arrived
    assert "cache key" in message and "test_faults_trace.py" in message
    assert isinstance(info.value.__cause__, RuntimeError)
