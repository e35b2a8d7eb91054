"""Patterns an outside benchmarker runs besides the steady repeat call, against plain ``jax.jit``.

First calls, new signatures, many programs and JAX's own caches: each test
compares the results with ``jax.jit`` on the same inputs, and counts the
machinery (traces, cached entries, live objects) where a cost could grow.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches

import pathways_jax as pw
from pathways_jax._src.runtime import clusters

_SCALE = [2.0]


def _scaled(v):
    return v * _SCALE[0]


def test_jax_clear_caches_makes_programs_trace_again_as_jax_jit_does():
    # A notebook changes a global a jitted function reads, then calls jax.clear_caches() so that
    # the next call traces again. jax.jit then gives the new result; programs and pw.jit kept
    # their traced graphs and plans (the old result), and held the compiled executables.
    x = jnp.arange(3.0)
    want = jax.jit(_scaled)
    s = pw.devices(mesh={"x": 1})
    ours = [pw.program(_scaled), pw.jit(_scaled), pw.program(_scaled, devices=s), pw.jit(_scaled, devices=s)]
    try:
        for f in ours:
            assert_matches(f(x), want(x))
        assert len(clusters.cluster().executables) > 0
        traces = pw.counters()["traces"]
        _SCALE[0] = 3.0
        jax.clear_caches()
        assert len(clusters.cluster().executables) == 0
        for f in ours:
            assert_matches(f(x), want(x))
            assert_matches(f(x), x * 3.0)
        assert pw.counters()["traces"] == traces + len(ours)
    finally:
        _SCALE[0] = 2.0


def _layer(w, x):
    return jnp.tanh(x @ w), (x @ w).sum()


@pytest.mark.parametrize("placed", [False, True], ids=["no slice", "slice"])
def test_a_pw_jit_lowered_and_compiled_ahead_of_time_compiles_nothing_at_its_first_call(placed):
    # The AOT guide's warm-up, f.lower(...).compile(), makes jax.jit's first call compile nothing;
    # pw.jit lowered jax.jit's function only, so its first call traced and compiled its plan again
    # (as long again as the warm-up for a large function). A program's lower() prepares its plan.
    w = jnp.full((8, 8), 0.1, jnp.float32)
    x = jnp.arange(16.0).reshape(2, 8)
    want = jax.jit(_layer)
    s = pw.devices(mesh={"x": 2}) if placed else None
    ours = pw.jit(_layer, devices=s)
    pw.reset_counters()
    for args in [(w, x), (jax.ShapeDtypeStruct(w.shape, w.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype))]:
        # Placed, it lowers as jax.jit under jax.set_mesh of the slice's devices.
        with jax.set_mesh(s.physical_mesh) if placed else contextlib.nullcontext():
            text = want.lower(*args).as_text()
        assert ours.lower(*args).as_text() == text
    ours.lower(w, x).compile()
    warmed = pw.counters()
    assert warmed["traces"] == 1  # one plan: the abstract arguments stand for these arrays
    assert_matches(ours(w, x), want(w, x))
    after = pw.counters()
    assert (after["traces"], after["lowerings"], after["compiles"]) == (
        warmed["traces"],
        warmed["lowerings"],
        warmed["compiles"],
    )


def _sgd_step(params, x):
    grads = jax.grad(lambda p: ((x @ p["w"] + p["b"]) ** 2).mean())(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), (x @ params["w"]).sum()


@pytest.mark.parametrize("placed", [False, True], ids=["no slice", "slice"])
def test_a_donating_train_step_fed_its_own_futures_is_traced_once_as_under_jax_jit(placed):
    # A train loop donates its state (donate_argnums=0) and feeds each step the futures of the
    # step before. The second call, with futures where the first had arrays, traced the whole
    # function again (seconds for a large model, where jax.jit's second call takes
    # milliseconds): only a step that donates nothing ran the first call's plan.
    params = {"w": jnp.eye(4) * 0.5, "b": jnp.zeros(4)}
    x = jnp.arange(8.0).reshape(2, 4) / 8
    want, want_losses = params, []
    for _ in range(3):
        want, loss = jax.jit(_sgd_step, donate_argnums=0)(jax.tree.map(jnp.copy, want), x)
        want_losses.append(loss)
    s = pw.devices(mesh={"x": 2}) if placed else None
    if placed:  # the state put on the slice first, as the outputs are
        params = jax.device_put(params, s.sharding())
    step = pw.program(_sgd_step, donate_argnums=0, devices=s)
    pw.reset_counters()
    state, losses, fed = params, [], []
    for _ in range(3):
        state, loss = step(state, x)
        fed.append(state)
        losses.append(loss)
    assert_matches(state, want)
    assert_matches(losses, want_losses)
    assert pw.counters()["traces"] == 1
    assert params["w"].is_deleted()  # donated, as under jax.jit
    for spent in fed[:-1]:  # each step's state was donated to the next
        assert spent["w"].is_deleted()
        with pytest.raises(pw.errors.PathwaysError, match="was donated to program '_sgd_step'"):
            spent["w"].result()


def _sine(v):
    return jnp.sin(v) * 2


def _times(v, n):
    return v * n


def test_pw_jit_made_again_inline_traces_once_as_jax_jit_made_again_does():
    # jax.jit(f)(x) written inline in a loop traces f once: jax.jit keys its caches by the
    # function. pw.jit(f)(x) traced and lowered anew at every call (some 30x jax.jit's time
    # per call); pw.program(f)(x) already took the program made before.
    x = jnp.arange(4.0)
    pw.reset_counters()
    for _ in range(3):
        assert_matches(pw.jit(_sine)(x), jax.jit(_sine)(x))
        assert_matches(pw.jit(_times, static_argnums=1)(x, 3), jax.jit(_times, static_argnums=1)(x, 3))
    assert pw.counters()["traces"] == 2
    for _ in range(2):  # other options: another function, as for jax.jit
        assert_matches(pw.jit(_times, static_argnums=1, donate_argnums=0)(x + 1, 3), (x + 1) * 3)
    assert pw.counters()["traces"] == 3


def _sine_on_ambient_slice(s, x):
    with s:
        return pw.program(_sine)(x).result()


def test_a_dropped_slice_a_program_made_again_ran_on_gives_its_devices_back():
    # pw.program(f)(x) inline under `with slice:` (a top-level f, so the program is kept to be
    # made again); the user then drops the slice, as a lambda's program gives its slice back.
    import gc

    x = jnp.arange(8.0)
    s = pw.devices(mesh={"x": 8}, exclusive=True)
    assert_matches(_sine_on_ambient_slice(s, x), jax.jit(_sine)(x))
    del s
    gc.collect()
    again = pw.devices(mesh={"x": 8}, exclusive=True, timeout=0.5)
    again.release()


def _decay_counting(p, x, step):
    return p * 0.9 + x, step


def test_a_step_returning_a_python_argument_as_it_is_runs_its_first_plan_with_futures():
    # A loop passes the step number (a Python int) and gets it back unchanged. Its second call,
    # with the futures of the first, traced the whole function again: the plan returns a host
    # argument as it is, and such plans were not run with futures where they took arrays.
    x = jnp.arange(3.0)
    step = pw.program(_decay_counting)
    pw.reset_counters()
    ours, want = x, x
    for i in range(3):
        ours, got = step(ours, x, i)
        want, expected = jax.jit(_decay_counting)(want, x, i)
        assert_matches(got, expected)
    assert_matches(ours, want)
    assert pw.counters()["traces"] == 1


def _scale_by(v, k):
    return v * k


@pytest.mark.parametrize(
    "host",
    [
        np.ones((4, 4), np.float32),
        np.arange(6.0).reshape(2, 3),  # float64: float32 without x64, as jax.jit makes it
        np.arange(5, dtype=np.int8),
        np.ones(3, jnp.bfloat16),
        np.array([True, False]),
        np.ones(2, np.complex64),
        np.float32(1.5),
    ],
    ids=["f32", "f64", "i8", "bf16", "bool", "c64", "np-scalar"],
)
def test_host_inputs_each_call_go_to_devices_without_device_put_s_python_path(host, monkeypatch):
    # A batch fed as numpy each call (a data loader's) went through jax.device_put's Python path,
    # 50-300 us a leaf: 9-17x jax.jit's call. JAX's own call for host data is taken instead.
    step = pw.program(_scale_by)
    want = jax.jit(_scale_by)
    assert_matches(step(host, 2), want(host, 2))  # traced, compiled
    puts = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real(*a, **k))
    for k in (3, 0.5, True):
        got = step(host, k)
        expected = want(host, k)
        assert_matches(got, expected)
        assert got.dtype == expected.dtype and got.aval.weak_type == expected.aval.weak_type
    assert puts == []
