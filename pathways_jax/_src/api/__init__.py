"""API: what user code calls, under the public names of ``pathways_jax``.

``@pw.program`` (tracing a function into a graph and calling its plan),
``pw.jit`` (a jitted function placed on a slice), graph building from
jaxprs, NNX objects run as ``nnx.jit`` runs them, and ``pw.stats()``.
May import: every layer but ``views``.
"""
