"""``jax.Ref`` s and Flax hijax Variables a program's function closes over: inputs of its run.

A Ref the function closes over (the Ref guide's ``x_ref`` read and written by
``@jax.jit def f(): x_ref[1] += 1.``), or a Flax ref-mode or hijax-mode model a
step uses without taking it, is a constant of its trace. ``jax.jit`` takes such
constants as inputs and writes them back; so does a program: the trace that
finds them raises :class:`ClosedRefs`, and the call runs an inner program whose
function takes their values as inputs (:func:`call_closed`), reads and writes a
Ref (or Variable) made inside from each wherever the function names the
caller's, and returns their last values, written back as ``ref_arguments``
and ``hijax_arguments`` write arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from pathways_jax._src.api import hijax_arguments, ref_arguments
from pathways_jax._src.core import errors

try:  # JAX's tracing context (private): where a trace finds the tracer of a constant it closes over
    from jax._src.core import trace_ctx as _TRACE_CTX
except ImportError:  # pragma: no cover - another JAX: a closed-over Ref is refused, naming the fix
    _TRACE_CTX = None  # type: ignore[assignment]

# The keyword the inner program of a call closing over Refs takes their values by.
_CLOSED_VALUES = "_pw_closed_over_ref_values"


class ClosedRefs(Exception):
    """Raised by a trace whose function closes over ``jax.Ref`` s (constants of its jaxpr): the call runs through :func:`call_closed`."""

    def __init__(self, refs: tuple[Any, ...]) -> None:
        super().__init__(f"the traced function closes over {len(refs)} jax.Ref(s)")
        self.refs = refs


def closed_over(consts: list[Any]) -> tuple[Any, ...]:
    """The ``jax.Ref`` s and Flax hijax Variables among a traced jaxpr's constants (those its
    function closes over), in their order."""
    return tuple(c for c in consts if isinstance(c, jax.Ref) or hijax_arguments.is_hijax_variable(c))


def _with_closed_refs(
    fun: Callable[..., Any], refs: tuple[Any, ...], trees: tuple[Any, ...]
) -> Callable[..., Any]:
    """``fun`` reading and writing, wherever it names one of ``refs``, a Ref made inside from its value.

    ``trees``: None for a ``jax.Ref``; for a Flax hijax Variable, the tree of
    the plain Variable holding its array, from which a hijax one is made inside
    (as ``hijax_arguments`` makes them). The values come by the keyword
    ``_CLOSED_VALUES``; returns ``fun``'s output and those Refs' last values.
    JAX's trace finds the tracer of a constant by the constant's id (as it
    finds one it met before), so the caller's Ref, named in the function, an
    inner ``jax.jit`` or a loop body, is the Ref made here: no equation of the
    trace holds the caller's, as none of ``jax.jit``'s does.
    """

    @functools.wraps(fun)  # errors and labels name the user's function, not this one
    def with_closed_refs(*args: Any, **kwargs: Any) -> Any:
        values = kwargs.pop(_CLOSED_VALUES)
        frame = getattr(_TRACE_CTX.trace, "frame", None)  # the program's trace (jax.make_jaxpr)
        if frame is None:  # run op by op (not traced): the function writes the Refs themselves
            return fun(*args, **kwargs), tuple(ref_arguments.read(ref) for ref in refs)
        made = [_made(value, tree) for value, tree in zip(values, trees, strict=True)]
        for ref, inner in zip(refs, made, strict=True):
            frame.constid_to_tracer[id(ref)] = inner
        try:
            out = fun(*args, **kwargs)
        finally:
            for ref in refs:
                frame.constid_to_tracer.pop(id(ref), None)
        return out, tuple(_last(inner, tree) for inner, tree in zip(made, trees, strict=True))

    return with_closed_refs


def _made(value: Any, tree: Any) -> Any:
    """A Ref (``tree`` None) or a hijax Variable of ``tree`` made inside a trace from ``value``."""
    if tree is None:
        return jax.new_ref(value)
    return jax.tree_util.tree_unflatten(tree, [value]).copy(hijax=True)


def _last(inner: Any, tree: Any) -> Any:
    """The array a Ref or hijax Variable made by :func:`_made` ends the trace with."""
    if tree is None:
        return inner[...]
    return jax.tree_util.tree_leaves(inner.copy(hijax=False))[0]


def _closed_states(program: Any, refs: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Each closed-over Ref's or hijax Variable's array, and its tree (None for a Ref)."""
    states = [
        (ref_arguments.read(ref), None)
        if isinstance(ref, jax.Ref)
        else hijax_arguments.state(ref, program.name)
        for ref in refs
    ]
    return tuple(value for value, _ in states), tuple(tree for _, tree in states)


def _closed_inner(program: Any, refs: tuple[Any, ...], trees: tuple[Any, ...]) -> Any:
    """The inner program over ``program``'s function with ``refs`` made inside (one per set of Refs)."""
    if _TRACE_CTX is None:  # pragma: no cover - another JAX
        raise errors.also(errors.ProgramTraceError, TypeError)(
            f"program {program.name!r} ({program.source_info}) closes over a jax.Ref: pass it as an "
            "argument instead (a program writes a Ref argument as jax.jit does)."
        )
    inners = program.__dict__.setdefault("_closed_ref_inners", {})
    key = (tuple(id(ref) for ref in refs), trees)
    inner = inners.get(key)
    if inner is None:
        inner = inners.setdefault(
            key, program.inner_program(_with_closed_refs(program._info.fun, refs, trees))
        )
    return inner


def call_closed(program: Any, refs: tuple[Any, ...], args: tuple, kwargs: dict) -> Any:
    """Runs ``program`` whose function closes over ``refs``, writing each as ``jax.jit`` does; its output."""
    values, trees = _closed_states(program, refs)
    inner = _closed_inner(program, refs, trees)
    try:
        out, ends = inner(*args, **kwargs, **{_CLOSED_VALUES: values})
    except ClosedRefs as exc:  # a Ref the trace met some other way than by its id: not taken
        raise errors.also(errors.ProgramTraceError, TypeError)(
            f"program {program.name!r} ({program.source_info}) closes over a jax.Ref "
            f"({exc.refs[0].aval.str_short()}) that it could not take as an input: pass it as an "
            "argument instead (a program writes a Ref argument as jax.jit does)."
        ) from None
    for ref, end in zip(refs, ref_arguments.dispatched_ends(ends), strict=True):
        if isinstance(ref, jax.Ref):
            ref_arguments.write(ref, end)
        else:  # a Flax hijax Variable
            hijax_arguments.write_back([ref], (end,))
    return out


def graph_closed(program: Any, refs: tuple[Any, ...], args: tuple, kwargs: dict) -> Any:
    """The graph a call of ``program`` closing over ``refs`` runs (its outputs end with their last values)."""
    values, trees = _closed_states(program, refs)
    return _closed_inner(program, refs, trees).graph(*args, **kwargs, **{_CLOSED_VALUES: values})


def prepare_closed(program: Any, refs: tuple[Any, ...], args: tuple, kwargs: dict) -> None:
    """Traces and lowers the plan of a call of ``program`` closing over ``refs`` (``program.lower``); nothing runs."""
    values, trees = _closed_states(program, refs)
    _closed_inner(program, refs, trees)._prepare(args, {**kwargs, _CLOSED_VALUES: values})


__all__ = ["ClosedRefs", "call_closed", "closed_over", "graph_closed", "prepare_closed"]
