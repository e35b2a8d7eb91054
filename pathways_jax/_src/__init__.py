"""pathways_jax's implementation, in layers; the public API is ``pathways_jax/__init__.py``.

Imports run one way, down this list (a module may import its own layer and
those below it, never above, and no import cycle exists; ``tests/test_layers.py``
checks it, lazy imports included):

- ``api``: what the user calls: programs and ``pw.jit`` (tracing), graph
  building, NNX objects, ``pw.stats()``, ``pw.trace()`` (the recorder).
- ``compat``: every patch of JAX, Flax and Orbax (futures where they take
  arrays), installed explicitly.
- ``runtime``: slices, clients, submission, the controller, the scheduler, the
  object store and futures, accounting, the resource manager and the cluster.
- ``backends``: the ``Backend`` protocol and where devices live (local, Ray).
- ``compile``: lowering a graph to a plan for physical devices; executables.
- ``ir``: the dataflow graph, its fusion and argument signatures.
- ``wire``: the control plane's typed messages and the signed ZeroMQ channels
  that carry them between processes.
- ``core``: errors, counters, source lines, readiness, formatting, memory
  charges, meshes, trace events.

``views`` (pictures, notebook HTML, plots) may import anything; nothing imports
it except lazily inside ``_repr_*`` methods (and ``Graph.to_dot``, the DOT text
of the picture). ``pipeline`` is built on the public API only.
"""
