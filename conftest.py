"""Test set-up shared by tests/ and the doctests in pathways_jax/.

JAX must see its CPU device count before its backend starts (DESIGN §5), so
this runs before any test module imports JAX code.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

import pathways_jax as pw  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_cluster():
    """Every test starts and ends without a running cluster."""
    pw.shutdown()
    yield
    pw.shutdown()
