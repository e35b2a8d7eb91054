"""pathways_jax: a single controller for asynchronous, sharded dataflow programs in JAX.

Example:
  >>> import jax.numpy as jnp, pathways_jax as pw
  >>> s = pw.devices(mesh={"x": 1})
  >>> @pw.program(devices=s)
  ... def double(v):
  ...     return v * 2
  >>> double(jnp.ones(2)).result().tolist()
  [2.0, 2.0]
  >>> s.release()
"""

from typing import TYPE_CHECKING

from jax.sharding import PartitionSpec as P

from pathways_jax import colocated_python as colocated_python
from pathways_jax import errors as errors
from pathways_jax import faults as faults
from pathways_jax._src.api.decorator import program as program
from pathways_jax._src.api.graph_view import GraphView as Graph
from pathways_jax._src.api.graph_view import NodeView as Node
from pathways_jax._src.api.graph_view import TransferView as Transfer
from pathways_jax._src.api.placed_jit import JitFunction as JitFunction
from pathways_jax._src.api.placed_jit import jit as jit
from pathways_jax._src.api.recording import start_trace as start_trace
from pathways_jax._src.api.recording import stop_trace as stop_trace
from pathways_jax._src.api.recording import trace as trace
from pathways_jax._src.api.sharing import receive as receive
from pathways_jax._src.api.sharing import share as share
from pathways_jax._src.api.stats import stats as stats
from pathways_jax._src.api.tracing import Program as Program
from pathways_jax._src.backends.service_client import Handle as Handle
from pathways_jax._src.compat import install as _install_compat
from pathways_jax._src.core import version as _version
from pathways_jax._src.core.counts import counters as counters
from pathways_jax._src.core.counts import reset_counters as reset_counters
from pathways_jax._src.runtime.clients import Client as Client
from pathways_jax._src.runtime.clients import client as client
from pathways_jax._src.runtime.clusters import Cluster as Cluster
from pathways_jax._src.runtime.clusters import cluster as cluster
from pathways_jax._src.runtime.clusters import init as init
from pathways_jax._src.runtime.clusters import shutdown as shutdown
from pathways_jax._src.runtime.futures import Future as Future
from pathways_jax._src.runtime.futures import results as results
from pathways_jax._src.runtime.serving import Service as Service
from pathways_jax._src.runtime.serving import serve as serve
from pathways_jax._src.runtime.serving import service as service
from pathways_jax._src.runtime.slices import VirtualSlice as VirtualSlice
from pathways_jax._src.runtime.slices import devices as devices

_install_compat()  # jax.jit and jnp take futures (the one patch made at import)

if TYPE_CHECKING:  # imported on first use (__getattr__ below); named here for type checkers
    from pathways_jax._src.views.plotting import plot_timeline as plot_timeline

__version__ = _version.VERSION

__all__ = [
    "Client",
    "Cluster",
    "Future",
    "Graph",
    "Handle",
    "JitFunction",
    "Node",
    "P",
    "Program",
    "Service",
    "Transfer",
    "VirtualSlice",
    "client",
    "cluster",
    "colocated_python",
    "counters",
    "devices",
    "errors",
    "faults",
    "init",
    "jit",
    "plot_timeline",
    "program",
    "receive",
    "reset_counters",
    "results",
    "serve",
    "service",
    "share",
    "shutdown",
    "start_trace",
    "stats",
    "stop_trace",
    "trace",
]


def __getattr__(name: str):
    # pw.sim, the simulator, pw.elastic (Flax and Optax) and pw.plot_timeline (a view: matplotlib) are imported on first
    # use: `import pathways_jax` loads neither.
    if name == "sim":
        import importlib

        return importlib.import_module("pathways_jax.sim")
    if name == "elastic":  # the pipeline extra (Flax, Optax)
        import importlib

        return importlib.import_module("pathways_jax.elastic")
    if name == "plot_timeline":
        from pathways_jax._src.views.plotting import plot_timeline

        return plot_timeline
    raise AttributeError(f"module 'pathways_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*(name for name in globals() if name != "TYPE_CHECKING"), *__all__, "sim", "elastic"})
