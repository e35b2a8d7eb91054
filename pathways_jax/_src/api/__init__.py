"""API: what user code calls, under the public names of ``pathways_jax``.

``@pw.program`` (tracing a function into a graph and calling its plan),
``pw.jit`` (a jitted function placed on a slice), graph building from
jaxprs, NNX objects run as ``nnx.jit`` runs them, ``pw.stats()``, and
``pw.trace()`` (recording the runtime's events as a timeline).
May import: every layer but ``views``.

Modules: ``decorator`` (``@pw.program``, its options checked as ``jax.jit`` checks them);
``tracing`` (``pw.Program``: its graphs and plans by signature, and its calls); ``program_info``
(a program's configuration as one record: a call's key, static and donated arguments);
``function_trace`` (a function traced into a graph); ``repeat_calls`` (a repeated call takes the
plan of the one before); ``arguments`` (a call's signature and checks); ``placement`` (where an
unplaced program runs); ``jit_options`` (``jax.jit``'s options as a program takes them);
``placed_jit`` (``pw.jit`` on a slice); ``pickling`` (programs and ``pw.jit`` functions pickled as
``jax.jit`` functions are); ``graph_builder`` (a jaxpr becomes a graph);
``graph_view`` (``pw.Graph``: a traced graph with its slices where they are now);
``jit_shardings`` (``in_shardings``/``out_shardings``); ``nnx_graph`` (NNX objects as
arguments); ``ref_arguments`` (``jax.Ref`` arguments, written in place as ``jax.jit`` writes them);
``hijax_arguments`` (Flax's hijax Variables, updated in place as ``jax.jit`` updates them);
``closed_refs`` (Refs and hijax Variables the function closes over, taken as inputs); ``sharing`` (``pw.share``/``pw.receive``); ``stats`` (``pw.stats()``);
``recording`` (``pw.trace``: the runtime's events laid out as a trace); ``faults``
(``pw.faults``: a Ray host killed or hung on purpose); ``colocated``
(``pw.colocated_python``: Python run on the hosts that own devices); ``colocated_class``
(``colocated_python_class``: objects living on the hosts); ``host_input``
(``HostIterator``: batches made by an iterator on each host).
"""

from pathways_jax._src import compat as _compat

# The one patch of JAX made at import: jax.jit, jnp and JAX's checks take futures, JAX's barrier
# waits for programs and its cache clearing clears them. Installed with the API, which everything
# that makes a future imports (``pathways_jax`` loads its public names on first use).
_compat.install()
