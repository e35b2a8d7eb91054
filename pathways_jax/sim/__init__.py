"""``pw.sim``: a discrete-event simulator of the controller, calibrated by measurement.

It runs a program's graph (or a synthetic workload) on a simulated cluster of
hosts and devices whose every cost comes from a :class:`Profile`: the
controller's per-run and per-node costs, one message per host per run, host
enqueue, device time, ICI collectives, DCN transfers, the in-flight window and
the scheduler's interleaving of clients. SimPy (``pip install
'pathways-jax[sim]'``) is imported only when a simulation runs.

Example:
  >>> import jax.numpy as jnp, pathways_jax as pw
  >>> s = pw.devices(mesh={"x": 2})
  >>> @pw.program(devices=s)
  ... def step(v):
  ...     return v * 2
  >>> pred = pw.sim.predict(step, jnp.ones(8), cluster=pw.sim.SimCluster(hosts=4, profile="tpu_v4"))
  >>> pred.step_time_s > 0 and 0 <= pred.utilisation <= 1
  True
  >>> s.release()

``python -m pathways_jax.sim calibrate`` measures this machine into a profile.

Modules: ``_cluster`` (``SimCluster``); ``_profile`` (what everything costs); ``_calibrate``
(measuring a profile); ``_workload`` (programs of steps, their builders, ``Workload``);
``_predict`` (a traced program as a ``SimProgram``, ``predict``); ``_engine`` (the
discrete-event model, ``simulate``); ``_state`` (runs, dispatched steps, in-flight windows);
``_fanout`` (how a run's message reaches its hosts); ``_host_load`` (hosts' costs on a shared
machine); ``_timeline`` (trace events); ``_results`` (``SimResult`` and the figures in it);
``_errors`` (its errors).
"""

from pathways_jax.sim._cluster import SimCluster as SimCluster
from pathways_jax.sim._engine import simulate as simulate
from pathways_jax.sim._errors import ProfileError as ProfileError
from pathways_jax.sim._errors import SimulatorUnavailable as SimulatorUnavailable
from pathways_jax.sim._fanout import fanout_tree as fanout_tree
from pathways_jax.sim._predict import Prediction as Prediction
from pathways_jax.sim._predict import from_graph as from_graph
from pathways_jax.sim._predict import predict as predict
from pathways_jax.sim._profile import ControllerCosts as ControllerCosts
from pathways_jax.sim._profile import DeviceCosts as DeviceCosts
from pathways_jax.sim._profile import HostCosts as HostCosts
from pathways_jax.sim._profile import LinkCosts as LinkCosts
from pathways_jax.sim._profile import Profile as Profile
from pathways_jax.sim._profile import builtin_profiles as builtin_profiles
from pathways_jax.sim._profile import load_profile as load_profile
from pathways_jax.sim._results import ClientStats as ClientStats
from pathways_jax.sim._results import RunRecord as RunRecord
from pathways_jax.sim._results import SimResult as SimResult
from pathways_jax.sim._workload import PREVIOUS_RUN as PREVIOUS_RUN
from pathways_jax.sim._workload import SimProgram as SimProgram
from pathways_jax.sim._workload import Step as Step
from pathways_jax.sim._workload import Workload as Workload
from pathways_jax.sim._workload import chain as chain
from pathways_jax.sim._workload import concat as concat
from pathways_jax.sim._workload import dispatch_mode as dispatch_mode
from pathways_jax.sim._workload import pipeline as pipeline
from pathways_jax.sim._workload import spmd as spmd
from pathways_jax.sim._workload import two_islands as two_islands

__all__ = [
    "PREVIOUS_RUN",
    "ClientStats",
    "ControllerCosts",
    "DeviceCosts",
    "HostCosts",
    "LinkCosts",
    "Prediction",
    "Profile",
    "ProfileError",
    "RunRecord",
    "SimCluster",
    "SimProgram",
    "SimResult",
    "SimulatorUnavailable",
    "Step",
    "Workload",
    "builtin_profiles",
    "chain",
    "concat",
    "dispatch_mode",
    "fanout_tree",
    "from_graph",
    "load_profile",
    "pipeline",
    "predict",
    "simulate",
    "spmd",
    "two_islands",
]


def __getattr__(name: str) -> object:
    # pw.sim.Cluster was renamed SimCluster so that one name, pw.Cluster, means the running cluster.
    if name == "Cluster":
        import warnings

        warnings.warn(
            "pw.sim.Cluster is now pw.sim.SimCluster (pw.Cluster is the running cluster); the old name "
            "goes in a later release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return SimCluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
