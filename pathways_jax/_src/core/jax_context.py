"""What JAX's own state says about the caller: its trace configuration, and whether it traces.

Both from JAX's private modules (``jax.jit`` keys its cache on the first): read
here once, so the tracer and the executable cache agree on them.
"""

from __future__ import annotations

try:  # the configuration a trace and a lowering depend on (x64, promotion, precision, meshes)
    from jax._src.config import trace_context
except ImportError:  # pragma: no cover - a JAX without it: every context is the same
    trace_context = tuple

try:  # JAX's current trace (its eager trace at top level)
    from jax._src.core import EvalTrace as _EvalTrace
    from jax._src.core import trace_ctx as _trace_ctx
except ImportError:  # pragma: no cover - a JAX without them: tracer arguments tell
    _EvalTrace = _trace_ctx = None  # type: ignore[assignment, misc]


def inside_jax_trace() -> bool:
    """True while JAX traces the caller (``checkify``, ``jax.jit``), even with concrete arguments.

    ``checkify.checkify(f)`` and ``jax.make_jaxpr`` of a function closing over
    its arguments call the program with arrays, not tracers, inside their trace.
    """
    return _trace_ctx is not None and not isinstance(_trace_ctx.trace, _EvalTrace)


__all__ = ["inside_jax_trace", "trace_context"]
