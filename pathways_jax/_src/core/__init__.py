"""Core: what every layer uses and that depends on nothing of pathways_jax.

Errors, counters, the user's source lines, readiness of arrays, text
formatting, memory charges, mesh helpers, and the timeline recorder (the
hooks that record a trace, when one is on). May import: nothing of
pathways_jax outside ``core``.
"""
