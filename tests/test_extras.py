"""The core needs only JAX: Flax and Optax come with the `pipeline` extra; Ray, pyzmq and
msgspec (the Ray backend and the controller service's channels) with the `ray` extra."""

import subprocess
import sys
import textwrap

import pytest

# Flax, Optax, Ray, pyzmq and msgspec are made unimportable (a None entry in
# sys.modules), as in an environment without the extras.
_WITHOUT_FLAX = textwrap.dedent(
    """
    import sys
    for name in ("flax", "optax", "ray", "zmq", "msgspec"):
        sys.modules[name] = None
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import jax.numpy as jnp
    import pathways_jax as pw
    s = pw.devices(mesh={"x": 2})
    add = pw.jit(lambda v: v + 1, devices=s)
    assert add(jnp.arange(4.0)).result().tolist() == [1.0, 2.0, 3.0, 4.0]
    loaded = [m for m in sys.modules if sys.modules[m] is not None]
    assert not {"flax", "ray", "zmq", "msgspec"} & set(loaded), loaded
    try:
        import pathways_jax.pipeline
    except ImportError as exc:
        print("ImportError:", exc)
    pw.shutdown()
    """
)


@pytest.mark.timeout(120)
def test_the_core_runs_without_the_extras_and_the_pipeline_says_which_extra_it_needs():
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_FLAX],
        capture_output=True,
        text=True,
        timeout=110,
        env={"JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ImportError: pathways_jax.pipeline is built on Flax and Optax" in proc.stdout
    assert "pip install 'pathways-jax[pipeline]'" in proc.stdout
