"""``jax.Ref`` arguments (``jax.new_ref``): written in place, as ``jax.jit`` writes them.

``jax.jit(f)(ref, x)`` reads and writes the caller's Ref; Flax's ref mode
(``nnx.var_defaults(ref=True)``) keeps every Variable's value in one. A
program takes each Ref's value as an input array, traces the function on a
Ref made from it inside (a Ref passed twice is refused, as jax.jit refuses
it), returns the value each Ref ends with, and writes it into the
caller's Ref once the run is dispatched, on the devices the Ref held its
value on. Only calls whose arguments hold a Ref come here (the argument
signature refuses Refs, and Flax takes one for an NNX object), so other calls
pay nothing for it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax

from pathways_jax._src.core import errors

try:  # the type of every concrete jax.Array (private to JAX), whose buffers a Ref holds
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover - another JAX: Refs are read and written as ref[...]
    _ArrayImpl = type(None)  # type: ignore[assignment, misc]


class RefArguments(Exception):
    """Raised by a program's call for arguments that hold a ``jax.Ref``: it runs through :func:`call`."""


def given_refs(args: tuple, kwargs: dict) -> bool:
    """True when an argument itself (not nested) is a ``jax.Ref``: a cheap look for a call Flax would route."""
    return any(isinstance(arg, jax.Ref) for arg in (*args, *kwargs.values()))


def takes_refs(program: Any, args: tuple, kwargs: dict) -> bool:
    """True when the arguments hold a ``jax.Ref`` and no NNX object or Variable (they run as ``nnx.jit``).

    Flax takes a Ref for an NNX graph node; a program made for NNX objects
    (``nnx_graph``'s inner program) takes their states, whose values may be
    Refs (Flax's ref mode), as plain pytrees.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or program._info.nnx_inner:
        return any(isinstance(leaf, jax.Ref) for leaf in jax.tree_util.tree_leaves((args, kwargs)))
    from flax.nnx import graphlib

    found = False
    for leaf in jax.tree_util.tree_leaves((args, kwargs), is_leaf=graphlib.is_graph_node):
        if isinstance(leaf, jax.Ref):
            found = True
        elif graphlib.is_graph_node(leaf):
            return False
    return found


def _slots(leaves: list[Any], program: str) -> tuple[tuple[int, ...], list[Any]]:
    """Per leaf the index of its Ref among the call's Refs (-1: not a Ref), and those Refs.

    A Ref passed twice is refused, as ``jax.jit`` refuses it.
    """
    refs: list[Any] = []
    seen: dict[int, int] = {}
    slots = []
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Ref):
            if id(leaf) in seen:
                raise errors.also(errors.ProgramTraceError, ValueError)(
                    f"program {program!r} got one jax.Ref as argument leaves {seen[id(leaf)]} and "
                    f"{position}: as under jax.jit, only one reference to a mutable array may be "
                    "passed to a call. Pass it once and use it twice inside."
                )
            seen[id(leaf)] = position
            slots.append(len(refs))
            refs.append(leaf)
        else:
            slots.append(-1)
    return tuple(slots), refs


def _with_refs(fun: Callable[..., Any], slots: tuple[int, ...], count: int) -> Callable[..., Any]:
    """``fun`` on Refs made inside from the values at ``slots``; returns its output and their last values."""

    @functools.wraps(fun)  # errors and labels name the user's function, not this one
    def with_refs(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        made: dict[int, Any] = {}
        for position, slot in enumerate(slots):
            if slot >= 0:
                leaves[position] = made[slot] = jax.new_ref(leaves[position])
        inner_args, inner_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        out = fun(*inner_args, **inner_kwargs)
        return out, tuple(made[slot][...] for slot in range(count))

    return with_refs


def read(ref: Any) -> Any:
    """The array ``ref`` holds: its buffer, as ``jax.jit`` reads it, where JAX's Ref shows it; else ``ref[...]``.

    ``ref[...]`` outside a trace is a computation of its own (about 0.4 ms on
    CPU): Flax's ref mode keeps every Variable in a Ref, so a model of hundreds
    would pay it hundreds of times a step.
    """
    buffer = getattr(getattr(ref, "_refs", None), "_buf", None)  # JAX's private layout
    return buffer if isinstance(buffer, _ArrayImpl) else ref[...]


def write(ref: Any, value: Any) -> None:
    """``ref[...] = value``, the value first moved to where the Ref holds its own (as jax.jit leaves it).

    The Ref takes the value's array itself, with no computation, where JAX's
    Ref shows its buffer; else ``ref[...] = value``. The array it held before
    is left as it is: the run (and any later node of it) read that one.
    """
    from pathways_jax._src.runtime.futures import Future

    if type(value) is Future:  # no array at dispatch (a remote host, a memory budget): its value
        value = value.result()
    held = ref.sharding
    if value.sharding != held:
        value = jax.device_put(value, held)
    impl: Any = getattr(ref, "_refs", None)
    if isinstance(getattr(impl, "_buf", None), _ArrayImpl) and type(value) is _ArrayImpl:
        impl._buf = value  # JAX's private layout: the array a Ref holds
    else:
        ref[...] = value


def _inner_call(program: Any, args: tuple, kwargs: dict) -> tuple[Any, list[Any], tuple, dict]:
    """The inner program for these arguments' Refs, the Refs, and the arguments with their values instead."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    slots, refs = _slots(leaves, program.name)
    values = [read(ref) for ref in refs]
    plain = [values[slot] if slot >= 0 else leaf for leaf, slot in zip(leaves, slots, strict=True)]
    plain_args, plain_kwargs = jax.tree_util.tree_unflatten(treedef, plain)
    inners = program.__dict__.setdefault("_ref_inners", {})
    inner = inners.get(slots)
    if inner is None:
        inner = inners.setdefault(
            slots, program.inner_program(_with_refs(program._info.fun, slots, len(refs)))
        )
    return inner, refs, plain_args, plain_kwargs


def call(program: Any, args: tuple, kwargs: dict) -> Any:
    """Runs ``program`` on arguments holding Refs, writing each Ref as ``jax.jit`` does; its output."""
    inner, refs, plain_args, plain_kwargs = _inner_call(program, args, kwargs)
    out, ends = inner(*plain_args, **plain_kwargs)
    for ref, end in zip(refs, dispatched_ends(ends), strict=True):
        write(ref, end)
    return out


def dispatched_ends(ends: tuple) -> list[Any]:
    """The last values of a call's mutable arguments (an inner program's ``ends``), each future's
    as an array once its run is dispatched (``futures.dispatched_all``): what is written back."""
    from pathways_jax._src.runtime.futures import Future, dispatched_all

    settled = iter(dispatched_all([end for end in ends if type(end) is Future]))
    return [next(settled) if type(end) is Future else end for end in ends]


InnerCall = Callable[[Any, tuple, dict], tuple[Any, list[Any], tuple, dict]]


def graph_with(inner_call: InnerCall, program: Any, args: tuple, kwargs: dict) -> Any:
    """The graph a call runs through the inner program ``inner_call`` makes for its arguments
    (its outputs end with the mutable arguments' last values)."""
    inner, _, plain_args, plain_kwargs = inner_call(program, args, kwargs)
    return inner.graph(*plain_args, **plain_kwargs)


def prepare_with(inner_call: InnerCall, program: Any, args: tuple, kwargs: dict) -> None:
    """Traces and lowers the plan of that inner program for these arguments (``program.lower``); nothing runs."""
    inner, _, plain_args, plain_kwargs = inner_call(program, args, kwargs)
    inner._prepare(plain_args, plain_kwargs)


graph = functools.partial(graph_with, _inner_call)
prepare = functools.partial(prepare_with, _inner_call)


__all__ = [
    "RefArguments",
    "call",
    "dispatched_ends",
    "given_refs",
    "graph",
    "graph_with",
    "prepare",
    "prepare_with",
    "read",
    "takes_refs",
    "write",
]
