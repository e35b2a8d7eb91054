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

from pathways_jax._src.core import version as _version

# The public names, each imported on its first use (this module's __getattr__): a process that
# imports only part of the package (a Ray host actor: ``_src.backends.ray_host``, which imports
# nothing else of pathways_jax) does not load the rest, about 0.3 s of its start. The one patch of
# JAX (``jax.jit`` and ``jnp`` take futures) is installed with ``_src.api``, which everything that
# makes a future imports (``_src/api/__init__.py``). name -> (module, attribute; None: the module).
_PUBLIC = {
    "colocated_python": ("pathways_jax.colocated_python", None),
    "errors": ("pathways_jax.errors", None),
    "faults": ("pathways_jax.faults", None),
    "program": ("pathways_jax._src.api.decorator", "program"),
    "Graph": ("pathways_jax._src.api.graph_view", "GraphView"),
    "Node": ("pathways_jax._src.api.graph_view", "NodeView"),
    "Transfer": ("pathways_jax._src.api.graph_view", "TransferView"),
    "JitFunction": ("pathways_jax._src.api.placed_jit", "JitFunction"),
    "jit": ("pathways_jax._src.api.placed_jit", "jit"),
    "start_trace": ("pathways_jax._src.api.recording", "start_trace"),
    "stop_trace": ("pathways_jax._src.api.recording", "stop_trace"),
    "trace": ("pathways_jax._src.api.recording", "trace"),
    "receive": ("pathways_jax._src.api.sharing", "receive"),
    "share": ("pathways_jax._src.api.sharing", "share"),
    "stats": ("pathways_jax._src.api.stats", "stats"),
    "Program": ("pathways_jax._src.api.tracing", "Program"),
    "Handle": ("pathways_jax._src.backends.service_client", "Handle"),
    "counters": ("pathways_jax._src.core.counts", "counters"),
    "reset_counters": ("pathways_jax._src.core.counts", "reset_counters"),
    "Client": ("pathways_jax._src.runtime.clients", "Client"),
    "client": ("pathways_jax._src.runtime.clients", "client"),
    "Cluster": ("pathways_jax._src.runtime.clusters", "Cluster"),
    "cluster": ("pathways_jax._src.runtime.clusters", "cluster"),
    "init": ("pathways_jax._src.runtime.clusters", "init"),
    "shutdown": ("pathways_jax._src.runtime.clusters", "shutdown"),
    "Future": ("pathways_jax._src.runtime.futures", "Future"),
    "results": ("pathways_jax._src.runtime.futures", "results"),
    "Service": ("pathways_jax._src.runtime.serving", "Service"),
    "serve": ("pathways_jax._src.runtime.serving", "serve"),
    "service": ("pathways_jax._src.runtime.serving", "service"),
    "VirtualSlice": ("pathways_jax._src.runtime.slices", "VirtualSlice"),
    "devices": ("pathways_jax._src.runtime.slices", "devices"),
    # The simulator, the elastic trainer (Flax and Optax) and a view (matplotlib): loaded by their
    # own first use only, as every name here.
    "sim": ("pathways_jax.sim", None),
    "elastic": ("pathways_jax.elastic", None),
    "plot_timeline": ("pathways_jax._src.views.plotting", "plot_timeline"),
}

if TYPE_CHECKING:  # what __getattr__ below gives, named for type checkers
    from pathways_jax import colocated_python as colocated_python
    from pathways_jax import elastic as elastic
    from pathways_jax import errors as errors
    from pathways_jax import faults as faults
    from pathways_jax import sim as sim
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
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'pathways_jax' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(where[0])
    value = module if where[1] is None else getattr(module, where[1])
    globals()[name] = value  # later uses read it as any module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*(n for n in globals() if not n.startswith("_") and n != "TYPE_CHECKING"), *_PUBLIC})
