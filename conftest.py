"""Test set-up shared by tests/ and the doctests in pathways_jax/.

JAX must see its CPU device count before its backend starts (DESIGN §5), so
this runs before any test module imports JAX code.
"""

import atexit
import os
import shutil
import tempfile
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

# XLA's executables, kept for the session's process (its own folder, removed at its exit; not
# the processes it starts, nor the Ray hosts): every test starts a fresh cluster, and a program
# an earlier test compiled (the same computation on the same devices with the same options:
# JAX's cache key) is read back instead of compiled again, about a third of this process's
# compiles. What a test compiles, and what a compile returns, are those of a compile.
_XLA_CACHE = tempfile.mkdtemp(prefix="pathways_jax_tests_xla_")
atexit.register(shutil.rmtree, _XLA_CACHE, True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

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


# The local Ray cluster this test session started, and its logical CPUs: kept for the next module.
_RAY_CPUS: list[int] = []


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster for the test modules that ask for one (``ray.init`` costs seconds).

    Its logical CPUs (one per host actor) are 4, or the module's ``RAY_CPUS``.
    The cluster outlives the module and serves the next one that asks for the
    same size, if every CPU of it is free again (nothing leaked: a leftover
    actor or placement group would take its hosts' room); otherwise a fresh
    one starts. The session's end shuts it down.

    Ray is a dependency of the test suite (``pip install -e '.[test,ray]'``): a
    missing Ray fails the tests that use it rather than skipping them.
    """
    import ray

    _shutdown_as_a_fresh_process()
    cpus = getattr(request.module, "RAY_CPUS", 4)
    if ray.is_initialized() and not (cpus in _RAY_CPUS and _all_free(ray, cpus)):
        ray.shutdown()
    if not ray.is_initialized():
        _RAY_CPUS[:] = [cpus]
        with warnings.catch_warnings():
            # Ray starts its processes with fork + exec (see _src/backends/ray.py).
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
    try:
        yield ray
    finally:
        _shutdown_as_a_fresh_process()


def _all_free(ray, cpus: int, timeout: float = 10.0) -> bool:
    """Whether all ``cpus`` of the running cluster are free (a killed actor's return within seconds)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = [g for g in ray.util.placement_group_table().values() if g.get("state") != "REMOVED"]
        if ray.available_resources().get("CPU", 0) == cpus and not live:
            return True
        time.sleep(0.2)
    return False


# Scripts a test runs in a process of its own (examples, quick benchmark runs), by test id: they
# run in the background from the session's start, one at a time, longest first (helpers.Backlog),
# and each test reads its own run. A benchmark also gets ``--out=`` a folder of its own.
_TRANSFORMER_FLAGS = ("--steps=16", "--log_every=5", "--check_steps=2")
BACKGROUND = {
    "tests/test_pipeline.py::test_transformer_examples_train_and_match_plain_jit[pipeline_transformer.py]": (
        "examples/pipeline_transformer.py",
        *_TRANSFORMER_FLAGS,
        "--microbatches=2",
    ),
    "tests/test_examples.py::test_flax_mlp_trains_and_matches_plain_jax[ray]": (
        "examples/flax_mlp.py",
        "--steps=60",
        "--log_every=10",
        "--backend=ray",
    ),
    "tests/test_pipeline.py::test_transformer_examples_train_and_match_plain_jit[two_island_data_parallel.py]": (
        "examples/two_island_data_parallel.py",
        *_TRANSFORMER_FLAGS,
    ),
    "tests/test_benchmarks_multitenancy.py::test_multitenancy_benchmark_quick_mode_reports_every_mode": (
        "benchmarks/multitenancy.py",
        "--quick",
    ),
    "tests/test_benchmarks_pipeline.py::test_pipeline_benchmark_quick_mode_reports_every_mode": (
        "benchmarks/pipeline.py",
        "--quick",
        "--stages=2",
    ),
    "tests/test_benchmarks_demo.py::test_demo_benchmark_quick_mode_reports_every_mode": (
        "benchmarks/demo.py",
        "--quick",
    ),
    "tests/test_examples.py::test_flax_mlp_trains_and_matches_plain_jax[local]": (
        "examples/flax_mlp.py",
        "--steps=60",
        "--log_every=10",
        "--backend=local",
    ),
    "tests/test_benchmarks_soak.py::test_soak_benchmark_quick_mode_samples_both_sides": (
        "benchmarks/soak.py",
        "--quick",
    ),
    "tests/test_benchmarks_many_leaves.py::test_many_leaves_benchmark_quick_mode_reports_every_phase": (
        "benchmarks/many_leaves.py",
        "--quick",
    ),
    "tests/test_sim.py::test_sim_predict_example_runs": ("examples/sim_predict.py",),
    "tests/test_sim.py::test_scale_benchmark_quick_mode_writes_every_figure": (
        "benchmarks/sim_scale.py",
        "--quick",
    ),
    "tests/test_sim.py::test_validation_benchmark_quick_mode_reports_every_point": (
        "benchmarks/sim_validate.py",
        "--quick",
    ),
    "tests/test_examples.py::test_quickstart": ("examples/quickstart.py",),
}


@pytest.fixture(scope="session", autouse=True)
def _background(request, tmp_path_factory):
    """The session's background scripts (``BACKGROUND``, those of its selected tests), started
    with its first test."""
    from helpers import Backlog

    selected = {item.nodeid for item in request.session.items}
    backlog = Backlog({k: v for k, v in BACKGROUND.items() if k in selected}, tmp_path_factory.mktemp("bg"))
    try:
        yield backlog
    finally:
        backlog.stop()


@pytest.fixture
def background_run(request, _background):
    """This test's background script and its ``--out`` folder: ``(helpers.Script, folder)``."""
    return _background.get(request.node.nodeid)


@pytest.fixture(scope="session", autouse=True)
def _ray_shut_at_the_end():
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
