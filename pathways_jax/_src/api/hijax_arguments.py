"""Flax's hijax Variables (``nnx.var_defaults(hijax=True)``): updated in place, as ``jax.jit`` updates them.

In Flax's hijax mode a Variable is a JAX mutable "hijax" type: ``jax.jit(step)(model, x)``
takes the model as a pytree whose leaves are its Variables and writes what the
step sets into them (Flax's ``nnx.jit`` does not take them). A program does the
same: each Variable's value goes in as an input array, the function runs on a
model whose Variables are hijax Variables made inside from those values (one
per Variable: a Variable the model holds twice stays one), the values they end
with come out, and each is written into the caller's Variable once the run is
dispatched. Only calls whose arguments hold a hijax Variable come here.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.core import Tracer as _Tracer

from pathways_jax._src.api import ref_arguments
from pathways_jax._src.core import arrays, errors
from pathways_jax._src.runtime.futures import Future


class HijaxArguments(Exception):
    """Raised by a program's call for arguments that hold a hijax Variable: it runs through :func:`call`."""


class _Flax(NamedTuple):
    """Flax's classes this module looks for, read once Flax is imported."""

    hijax: type  # HijaxVariable
    variable: type  # nnx.Variable
    abstract: type  # the abstract value of a hijax Variable's tracer
    pytree: type  # nnx.Pytree: modules, optimizers, Rngs, nnx.List


_FLAX: list[_Flax] = []
# Values with nothing inside to look into: a model's settings (sizes, names, dtypes).
_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None)})
# Arguments that are values themselves (a train loop's futures and arrays): passed over at once.
_VALUES = _PLAIN | {Future, arrays.array_impl}


def _flax() -> _Flax | None:
    """Flax's classes, where Flax is imported and has hijax Variables; else None."""
    if _FLAX:
        return _FLAX[0]
    variablelib = sys.modules.get("flax.nnx.variablelib")
    if variablelib is None or not hasattr(variablelib, "HijaxVariable"):
        return None
    from flax.nnx import pytreelib

    _FLAX.append(
        _Flax(variablelib.HijaxVariable, variablelib.Variable, variablelib.AbstractVariable, pytreelib.Pytree)
    )
    return _FLAX[0]


def _hijax_type() -> type | None:
    """Flax's ``HijaxVariable`` class, where Flax is imported and has one."""
    flax = _flax()
    return flax.hijax if flax is not None else None


def _is_hijax(value: Any, flax: _Flax) -> bool:
    """A hijax Variable, or its tracer inside a trace (without Flax's slower ``isinstance``)."""
    kind = type(value)
    if kind is flax.hijax:
        return True
    return issubclass(kind, _Tracer) and isinstance(getattr(value, "aval", None), flax.abstract)


def takes_hijax(args: tuple, kwargs: dict) -> bool:
    """True when the arguments hold a Flax hijax Variable (a model made under ``nnx.var_defaults(hijax=True)``)."""
    flax = _flax()
    if flax is None:
        return False
    return any(_is_hijax(leaf, flax) for leaf in jax.tree_util.tree_leaves((args, kwargs)))


def given_hijax(args: tuple, kwargs: dict) -> bool:
    """A cheap look at the NNX objects among the arguments: True when the first Variable found in one is hijax.

    A model's Variables are made in one mode, so its first says how it was
    made: the look stops there, not at every Variable (flattening a model of a
    hundred Variables costs a call a third of a millisecond).
    """
    flax = _flax()
    if flax is None:
        return False
    for arg in (*args, *kwargs.values()):
        if type(arg) in _VALUES:
            continue
        if _is_hijax(arg, flax):
            return True
        if not issubclass(type(arg), flax.pytree):  # arrays, pytrees of them: no model to look into
            continue
        found = _first_variable(arg, flax, [64])
        if found is not None:
            return _is_hijax(found, flax)
    return False


def _first_variable(node: Any, flax: _Flax, budget: list[int]) -> Any:
    """The first Variable (hijax or not) in ``node``'s attributes, depth first; None past ``budget`` nodes."""
    kind = type(node)
    if kind in _PLAIN:
        return None
    budget[0] -= 1
    if budget[0] < 0:
        return None
    if kind is flax.hijax or issubclass(kind, flax.variable) or _is_hijax(node, flax):
        return node
    if kind is list or kind is tuple:
        children: Any = node
    elif kind is dict:
        children = node.values()
    elif issubclass(kind, flax.pytree):
        children = vars(node).values()
    else:
        return None
    for child in children:
        found = _first_variable(child, flax, budget)
        if found is not None or budget[0] < 0:
            return found
    return None


def _slots(leaves: list[Any], flax: _Flax) -> tuple[tuple[int, ...], list[Any]]:
    """Per leaf the index of its Variable among the call's hijax Variables (-1: none), and those Variables."""
    variables: list[Any] = []
    seen: dict[int, int] = {}
    slots = []
    for leaf in leaves:
        if _is_hijax(leaf, flax):  # their tracers too, inside a program's trace
            if id(leaf) not in seen:
                seen[id(leaf)] = len(variables)
                variables.append(leaf)
            slots.append(seen[id(leaf)])
        else:
            slots.append(-1)
    return tuple(slots), variables


def is_hijax_variable(value: Any) -> bool:
    """A Flax hijax Variable itself (not its tracer): one a traced function closes over is a constant of its jaxpr."""
    flax = _flax()
    return flax is not None and type(value) is flax.hijax


def _state(variable: Any, program: str) -> tuple[Any, Any]:
    """The array a hijax Variable holds, and the tree of the plain Variable that holds it (its type, metadata)."""
    plain = variable.copy(hijax=False)
    leaves, tree = jax.tree_util.tree_flatten(plain)
    if len(leaves) != 1:
        raise errors.ProgramTraceError(
            f"program {program!r} got a Flax hijax {type(plain).__name__} holding {len(leaves)} arrays "
            f"({plain!r}); a program takes hijax Variables that hold one array each. Give it a Variable "
            "of one array, or the model in Flax's default mode (nnx.var_defaults(hijax=False))."
        )
    return leaves[0], tree


def with_variables(
    fun: Callable[..., Any], slots: tuple[int, ...], trees: tuple[Any, ...]
) -> Callable[..., Any]:
    """``fun`` on hijax Variables made inside from the values at ``slots``; returns its output and their last values."""

    @functools.wraps(fun)  # errors and labels name the user's function, not this one
    def with_variables(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        made: dict[int, Any] = {}
        for position, slot in enumerate(slots):
            if slot >= 0:
                if slot not in made:
                    plain = jax.tree_util.tree_unflatten(trees[slot], [leaves[position]])
                    made[slot] = plain.copy(hijax=True)
                leaves[position] = made[slot]
        inner_args, inner_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        out = fun(*inner_args, **inner_kwargs)
        flax = _flax()
        if flax is not None and any(_is_hijax(leaf, flax) for leaf in jax.tree_util.tree_leaves(out)):
            raise errors.ProgramTraceError(
                f"{getattr(fun, '__name__', 'the function')!r} returns Flax hijax Variables (a model made "
                "under nnx.var_defaults(hijax=True), or one of its Variables); jax.jit cannot return "
                "them either. The call updates the caller's model in place: return arrays "
                "(variable[...]) or nothing."
            )
        ends = tuple(jax.tree_util.tree_leaves(made[slot].copy(hijax=False))[0] for slot in range(len(trees)))
        return out, ends

    return with_variables


def as_values(args: tuple, kwargs: dict, name: str) -> tuple[tuple, tuple, list[Any], tuple, dict]:
    """The call's hijax Variables taken out: their slots and trees (see ``with_variables``), the
    Variables, and the arguments with each Variable's array in its place."""
    flax = _flax()
    if flax is None:  # not called so: given_hijax or takes_hijax found a hijax Variable first
        raise errors.PathwaysError("pathways_jax: hijax arguments looked for with Flax not imported")
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    slots, variables = _slots(leaves, flax)
    states = [_state(variable, name) for variable in variables]
    plain = [states[slot][0] if slot >= 0 else leaf for leaf, slot in zip(leaves, slots, strict=True)]
    plain_args, plain_kwargs = jax.tree_util.tree_unflatten(treedef, plain)
    return slots, tuple(tree for _, tree in states), variables, plain_args, plain_kwargs


def _inner_call(program: Any, args: tuple, kwargs: dict) -> tuple[Any, list[Any], tuple, dict]:
    """The inner program for these arguments' Variables, the Variables, and the arguments with their values instead."""
    slots, trees, variables, plain_args, plain_kwargs = as_values(args, kwargs, program.name)
    inners = program.__dict__.setdefault("_hijax_inners", {})
    inner = inners.get((slots, trees))
    if inner is None:
        inner = inners.setdefault(
            (slots, trees), program.inner_program(with_variables(program._info.fun, slots, trees))
        )
    return inner, variables, plain_args, plain_kwargs


def call(program: Any, args: tuple, kwargs: dict) -> Any:
    """Runs ``program`` on arguments holding hijax Variables, writing each as ``jax.jit`` does; its output."""
    inner, variables, plain_args, plain_kwargs = _inner_call(program, args, kwargs)
    out, ends = inner(*plain_args, **plain_kwargs)
    write_back(variables, ends)
    return out


def write_back(variables: list[Any], ends: tuple) -> None:
    """Each Variable takes the array its run ended with (a future's once the run is dispatched)."""
    for variable, value in zip(variables, ref_arguments.dispatched_ends(ends), strict=True):
        if type(value) is Future:  # no array at dispatch (a remote host, a memory budget): its value
            value = value.result()
        variable.set_raw_value(value)


state = _state  # a closed-over Variable's array and tree (ref_arguments.call_closed)

# The graph a call runs, and its plan traced and lowered (program.lower), as for jax.Ref arguments.
graph = functools.partial(ref_arguments.graph_with, _inner_call)
prepare = functools.partial(ref_arguments.prepare_with, _inner_call)


__all__ = [
    "HijaxArguments",
    "as_values",
    "call",
    "given_hijax",
    "graph",
    "is_hijax_variable",
    "prepare",
    "state",
    "takes_hijax",
    "with_variables",
    "write_back",
]
