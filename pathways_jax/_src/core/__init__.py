"""Core: what every layer uses and that depends on nothing of pathways_jax.

Errors, counters, the user's source lines, readiness of arrays, text
formatting, memory charges, mesh helpers, and the trace events the layers
above emit (typed records of plain values, and the one sink a recorder sets).
May import: nothing of pathways_jax outside ``core``.

Modules: ``errors`` (the error types); ``counts`` (``pw.counters()``); ``checks`` (checks of
user arguments); ``source`` (the user's line); ``readiness`` (is a value computed); ``arrays``
(arrays over another's buffers); ``charges`` (bytes per device); ``formatting`` (text for
people); ``host_memory`` (the C allocator and CPU buffers); ``jax_context`` (JAX's trace state);
``meshes`` (mesh helpers); ``gone`` (keys of objects garbage-collected, noted with no Python
code run); ``reentry`` (the runtime's own threads); ``locks`` (locks taken where
Ctrl-C may land); ``events`` (trace events and their sink); ``trace_format`` (the trace layout
``pw.sim`` shares); ``version`` (``pw.__version__``).
"""
