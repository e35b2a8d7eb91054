"""The examples run end to end and agree with plain jax.jit.

Each example runs in its own process: it sets its own CPU device count, which
JAX fixes when its backend starts (DESIGN §5).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the example picks its own device count
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{name} exited with {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc.stdout


@pytest.mark.timeout(300)
def test_quickstart():
    out = run_example("quickstart.py")
    assert "matches plain jax.jit" in out
    assert "Graph('step', 2 nodes, 1 transfers)" in out
    assert "dcn" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_flax_mlp_trains_and_matches_plain_jax(backend):
    out = run_example("flax_mlp.py", "--steps=60", "--log_every=10", f"--backend={backend}")
    losses = [float(v) for v in re.findall(r"^step\s+\d+\s+loss\s+([0-9.eE+-]+)", out, flags=re.MULTILINE)]
    assert len(losses) >= 3, out
    assert losses[0] > losses[-1], f"loss did not fall: {losses}"
    assert "no new traces, lowerings or compiles after step 1" in out
    assert "params and loss match plain jax.jit" in out
