"""The examples run end to end and agree with plain jax.jit.

Each example runs in its own process: it sets its own CPU device count, which
JAX fixes when its backend starts (DESIGN §5).
"""

import re

import pytest
from helpers import start_script

RUNS = {
    "quickstart": ("quickstart.py",),
    "flax-local": ("flax_mlp.py", "--steps=60", "--log_every=10", "--backend=local"),
    "flax-ray": ("flax_mlp.py", "--steps=60", "--log_every=10", "--backend=ray"),
}


@pytest.fixture(scope="module")
def example_runs():
    """Every example run starts at once: each mostly compiles, on one core (the machine may have more)."""
    runs = {
        name: start_script(f"examples/{script}", *args, timeout=240) for name, (script, *args) in RUNS.items()
    }
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.timeout(300)
def test_quickstart(example_runs):
    out = example_runs["quickstart"].output()
    assert "matches plain jax.jit" in out
    assert "Graph('step', 2 nodes, 1 transfers)" in out
    assert "dcn" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_flax_mlp_trains_and_matches_plain_jax(example_runs, backend):
    out = example_runs[f"flax-{backend}"].output()
    losses = [float(v) for v in re.findall(r"^step\s+\d+\s+loss\s+([0-9.eE+-]+)", out, flags=re.MULTILINE)]
    assert len(losses) >= 3, out
    assert losses[0] > losses[-1], f"loss did not fall: {losses}"
    assert "no new traces, lowerings or compiles after step 1" in out
    assert "params and loss match plain jax.jit" in out
