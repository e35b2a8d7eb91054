"""Compile: lowering a graph to a plan for physical devices, and the compiled executables.

Binds each node to its slice's current devices, compiles it (cached,
bounded), and lays out steps, transfers and byte counts. It submits
nothing and never looks the cluster up: a plan is data the runtime runs.
May import: ``ir``, ``core``.

Modules: ``lowering`` (a graph and the slices' devices become a plan); ``executable_cache`` (the
compiled executables plans share).
"""
