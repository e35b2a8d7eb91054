"""Test set-up shared by tests/ and the doctests in pathways_jax/.

JAX must see its CPU device count before its backend starts (DESIGN §5), so
this runs before any test module imports JAX code.
"""

import os
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

import pathways_jax as pw  # noqa: E402
from pathways_jax._src.runtime import clusters as cluster_lib  # noqa: E402


def _shutdown_as_a_fresh_process() -> None:
    """Ends any cluster; the next use starts a default one, as a process's first use does."""
    pw.shutdown()
    cluster_lib._forget_shutdown()


@pytest.fixture(autouse=True)
def _fresh_cluster():
    """Every test starts and ends without a running cluster, as if in a fresh process."""
    _shutdown_as_a_fresh_process()
    yield
    _shutdown_as_a_fresh_process()


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster for one test module (``ray.init`` costs seconds: once per module).

    Its logical CPUs (one per host actor) are 4, or the module's ``RAY_CPUS``.

    Ray is a dependency of the test suite (``pip install -e '.[test,ray]'``): a
    missing Ray fails the tests that use it rather than skipping them.
    """
    import ray

    _shutdown_as_a_fresh_process()
    if ray.is_initialized():
        ray.shutdown()
    with warnings.catch_warnings():
        # Ray starts its processes with fork + exec (see _src/backends/ray.py).
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(
            address="local",
            num_cpus=getattr(request.module, "RAY_CPUS", 4),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        yield ray
    finally:
        _shutdown_as_a_fresh_process()
        ray.shutdown()
