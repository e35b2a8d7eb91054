"""Compile: lowering a graph to a plan for physical devices, and the compiled executables.

Binds each node to the devices a placement gives its slice, compiles it
(cached, bounded), and lays out steps, transfers and byte counts. It
submits nothing and reads no slice, cluster or backend: it is given a
placement of plain data, and a plan is data the runtime runs.
May import: ``ir``, ``core``.

Modules: ``lowering`` (a graph and a placement become a frozen plan); ``binding`` (a graph's
values bound to slots and steps); ``steps`` (a plan's records: its steps, outputs and accounting
groups); ``node_compiler`` (one node compiled for a mesh, or exported for hosts); ``placement``
(where a graph's slices are, and what runs them, as plain data); ``executable_cache`` (the
compiled executables plans share); ``lowering_log`` (compiles, lowerings and remaps, logged and
sent to the trace).
"""
