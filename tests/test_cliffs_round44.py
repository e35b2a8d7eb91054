"""Patterns an outside benchmarker runs besides the steady repeat call, against plain ``jax.jit``.

First calls, new signatures, many programs and JAX's own caches: each test
compares the results with ``jax.jit`` on the same inputs, and counts the
machinery (traces, cached entries, live objects) where a cost could grow.
"""

import jax
import jax.numpy as jnp
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
