"""The Ray cluster of a test module: started once per module (``ray.init`` costs seconds).

Ray is a dependency of the test suite (``pip install -e '.[test,ray]'``): a
missing Ray fails these tests rather than skipping them.
"""

import warnings

import pytest

import pathways_jax as pw


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    pw.shutdown()
    if ray.is_initialized():
        ray.shutdown()
    with warnings.catch_warnings():
        # Ray starts its processes with fork + exec (see backends/ray.py).
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        pw.shutdown()
        ray.shutdown()
