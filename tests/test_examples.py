"""The examples run end to end and agree with plain jax.jit.

Each example runs in its own process: it sets its own CPU device count, which
JAX fixes when its backend starts (DESIGN §5).
"""

import re

import pytest


@pytest.mark.timeout(300)
def test_quickstart(background_run):  # run in the background (conftest.py, BACKGROUND)
    out = background_run[0].output()
    assert "matches plain jax.jit" in out
    assert "Graph('step', 2 nodes, 1 transfers)" in out
    assert "dcn" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_flax_mlp_trains_and_matches_plain_jax(background_run, backend):
    out = background_run[0].output()
    losses = [float(v) for v in re.findall(r"^step\s+\d+\s+loss\s+([0-9.eE+-]+)", out, flags=re.MULTILINE)]
    assert len(losses) >= 3, out
    assert losses[0] > losses[-1], f"loss did not fall: {losses}"
    assert "no new traces, lowerings or compiles after step 1" in out
    assert "params and loss match plain jax.jit" in out
