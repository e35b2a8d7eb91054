"""``pw.program(in_shardings=..., out_shardings=...)``: the function compiled with them, as ``jax.jit`` does.

A program is traced with its mesh set (``tracing.only_mesh``), and under a set
mesh ``jax.jit`` matches ``out_shardings`` against the output tree strictly,
node metadata included. Code written for ``jax.jit`` without a mesh may rely
on the looser match: Flax's sharded-initialisation recipe takes
``out_shardings`` from a ``jax.eval_shape`` of an init function that builds
its ``TrainState`` anew on each call, whose ``apply_fn`` (a bound method of a
new module) then differs from the one the shardings came from. Where the
strict match fails only on such metadata, the shardings are applied to the
outputs as sharding constraints instead (the same placements), and outputs
the shardings cover whole take the shardings' metadata, as ``jax.jit``'s do
(its trace of the ``jax.eval_shape`` is reused, outputs and all).

On Explicit axes (``jax.make_mesh``'s default) a sharding is part of a value's
type, and the program is traced on its mesh, where an inner ``jax.jit``'s
outputs keep the types of their computation whatever its ``out_shardings``
say. ``jax.jit`` called as it is gives its outputs its ``out_shardings``; so
the program reshards its outputs to them (a program's own, or those of the
``jax.jit`` function it wraps).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding

from pathways_jax._src.api.placement import _single_device_of

# Containers whose metadata is their structure (dict keys, a namedtuple's
# class): these must match exactly; other nodes' metadata (static fields) may differ.
_STRUCTURAL = (dict, list, tuple, type(None))


def jit_with_shardings(
    fun: Callable,
    *,
    in_shardings: Any,
    out_shardings: Any,
    static_argnums: tuple[int, ...],
    static_argnames: tuple[str, ...],
) -> Callable:
    """``jax.jit(fun, in_shardings=..., out_shardings=...)``, matching ``out_shardings`` as ``jax.jit`` does without a mesh."""
    strict = jax.jit(
        # Typed inside the computation, its outputs' types are its out_shardings: the node
        # then keeps their very specs (P("x"), where a reshard outside it types P("x", None)).
        with_output_types(fun, out_shardings),
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
    )
    given = GivenShardings(fun, in_shardings, out_shardings)
    if out_shardings is None:
        wrapped = functools.wraps(fun)(strict)
        wrapped.given_shardings = given  # type: ignore[attr-defined]
        return wrapped
    loose = jax.jit(
        fun, in_shardings=in_shardings, static_argnums=static_argnums, static_argnames=static_argnames
    )

    @functools.wraps(fun)
    def compiled(*args: Any, **kwargs: Any) -> Any:
        try:
            return strict(*args, **kwargs)
        except ValueError as exc:
            if "pytree metadata" not in str(exc):
                raise
            failure = exc
        out = loose(*args, **kwargs)
        leaves, tree = jax.tree_util.tree_flatten(out)
        matched = broadcast_prefix(out_shardings, tree)
        if matched is None:  # not only metadata: jax.jit's own error says what
            raise failure
        shardings = matched[0]
        placed = [_placed(leaf, sharding) for leaf, sharding in zip(leaves, shardings, strict=True)]
        # The outputs' nodes take the shardings' metadata, as jax.jit's do when its trace of the
        # jax.eval_shape they came from is reused: the same shardings then match them as
        # in_shardings of the next program.
        return _with_metadata_of(out_shardings, jax.tree_util.tree_unflatten(tree, placed))

    compiled.given_shardings = given  # type: ignore[attr-defined]
    return compiled


@dataclasses.dataclass(frozen=True)
class GivenShardings:
    """A program's ``in_shardings``/``out_shardings`` and the function they compile (``jit_with_shardings``'s)."""

    fun: Callable
    in_shardings: Any
    out_shardings: Any


def ahead_of_time(fun: Callable, **options: Any) -> Any:
    """``jax.jit`` of ``fun`` with ``options``, and with the shardings ``jit_with_shardings`` gave it, if any.

    What ``lower``, ``trace`` and ``eval_shape`` answer for a program made with
    ``in_shardings``/``out_shardings``: one ``jax.jit`` given them, as the
    user's own would be. Wrapping the compiled function in a second
    ``jax.jit`` instead lowered its inputs with the compiler's choice
    (``GSPMDSharding``), not the ``NamedSharding`` given.
    """
    given = getattr(fun, "given_shardings", None)
    if not isinstance(given, GivenShardings):
        return jax.jit(fun, **options)
    return jax.jit(given.fun, in_shardings=given.in_shardings, out_shardings=given.out_shardings, **options)


def with_output_types(fun: Callable, out_shardings: Any) -> Callable:
    """``fun`` whose outputs that ``out_shardings`` put on Explicit axes are typed (resharded) so.

    ``out_shardings`` is a pytree prefix of ``fun``'s outputs; a bare
    ``PartitionSpec`` names the mesh the function is traced under (as
    ``jax.jit``'s does under ``jax.set_mesh``). Its other leaves (None,
    shardings on Auto axes, ``jax.jit``'s unspecified) leave their outputs as
    the computation makes them.
    """
    given = jax.tree_util.tree_leaves(out_shardings, is_leaf=_is_leaf)
    if not any(_explicit(s) or isinstance(s, PartitionSpec) for s in given):
        return fun

    @functools.wraps(fun)
    def typed(*args: Any, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        leaves, tree = jax.tree_util.tree_flatten(out)
        matched = broadcast_prefix(out_shardings, tree)
        if matched is None:  # not a prefix: jax.jit's own check said so already, or takes it loosely
            return out
        mesh = jax.sharding.get_abstract_mesh()
        retyped = []
        for leaf, sharding in zip(leaves, matched[0], strict=True):
            if isinstance(sharding, PartitionSpec) and not mesh.empty:
                sharding = NamedSharding(mesh, sharding)
            retyped.append(_retyped(leaf, sharding) if _explicit(sharding) else leaf)
        return jax.tree_util.tree_unflatten(tree, retyped)

    typed.lowers_as = lowered_jit(fun)  # type: ignore[attr-defined]
    return typed


def lowered_jit(fun: Callable) -> Any:
    """The ``jax.jit`` function ``fun`` is, or that :func:`with_output_types` wrapped into ``fun``; else None.

    What ``lower``, ``trace`` and ``eval_shape`` of a program or ``pw.jit``
    made of a ``jax.jit`` function use as it is: ``with_output_types``'s
    wrapper carries the ``jax.jit`` function's attributes (its ``_jit_info``)
    but has no ``lower`` of its own.
    """
    if getattr(fun, "_jit_info", None) is not None and callable(getattr(fun, "lower", None)):
        return fun
    return getattr(fun, "lowers_as", None)


def with_jits_out_shardings(fun: Callable) -> Callable:
    """``fun``, and if it is a ``jax.jit`` function given ``out_shardings``, one whose outputs take them as types."""
    info = getattr(fun, "_jit_info", None)  # jax.jit's own record of its options (private)
    leaves = getattr(info, "out_shardings_leaves", None)
    if info is None or leaves is None:
        return fun
    return with_output_types(fun, jax.tree_util.tree_unflatten(info.out_shardings_treedef, leaves))


def jits_keep_unused(fun: Callable) -> bool:
    """Whether ``fun`` is a ``jax.jit`` function made with ``keep_unused=True``."""
    return bool(getattr(getattr(fun, "_jit_info", None), "keep_unused", False))


def jits_device(fun: Callable) -> jax.Device | None:
    """The one device a ``jax.jit`` function ``fun`` runs on whatever its arguments, if any.

    Its ``device=`` or ``backend=`` (deprecated in ``jax.jit``), or shardings
    on one device (``SingleDeviceSharding``); None for anything else.
    """
    info = getattr(fun, "_jit_info", None)  # jax.jit's own record of its options (private)
    if info is None:
        return None
    if getattr(info, "device", None) is not None:
        return info.device
    if getattr(info, "backend", None) is not None:
        return jax.devices(info.backend)[0]
    leaves = (*getattr(info, "in_shardings_leaves", ()), *getattr(info, "out_shardings_leaves", ()))
    return _single_device_of(leaves)


def _explicit(sharding: Any) -> bool:
    return isinstance(sharding, NamedSharding) and AxisType.Explicit in sharding.mesh.axis_types


def _retyped(leaf: Any, sharding: NamedSharding) -> Any:
    """``leaf`` resharded to ``sharding``'s spec on the mesh it is traced on, unless its type has it."""
    typed = getattr(jax.typeof(leaf), "sharding", None)
    if isinstance(typed, NamedSharding) and typed.mesh.empty:
        # Traced with no mesh, as jax.jit traces a call no mesh types: placed, not typed.
        return jax.sharding.reshard(leaf, sharding)
    if not isinstance(typed, NamedSharding) or typed.mesh.shape_tuple != sharding.mesh.shape_tuple:
        return leaf  # traced on another mesh (a slice's): placement there is the slice's
    ndim = len(leaf.shape)
    if _padded(typed.spec, ndim) == _padded(sharding.spec, ndim):
        return leaf
    if jax.sharding.get_abstract_mesh().empty:  # traced as jax.jit traces it, with no context mesh
        return jax.sharding.reshard(leaf, sharding)
    return jax.sharding.reshard(leaf, sharding.spec)


def _placed(leaf: Any, sharding: Any) -> Any:
    """``leaf`` placed by ``sharding``: a reshard on Explicit axes (a constraint there is an assertion), else a constraint."""
    if sharding is None:
        return leaf
    if _explicit(sharding):
        return _retyped(leaf, sharding)
    return jax.lax.with_sharding_constraint(leaf, sharding)


def _padded(spec: PartitionSpec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _with_metadata_of(prefix: Any, value: Any) -> Any:
    """``value`` with the node metadata of the pytree prefix ``prefix`` down to its leaves (they match)."""
    if _is_leaf(prefix):
        return value
    kids, node = jax.tree_util.tree_flatten(prefix, is_leaf=lambda x: x is not prefix)
    values, _ = jax.tree_util.tree_flatten(value, is_leaf=lambda x: x is not value)
    return jax.tree_util.tree_unflatten(
        node, [_with_metadata_of(k, v) for k, v in zip(kids, values, strict=True)]
    )


def _is_leaf(x: Any) -> bool:
    return x is None or isinstance(x, Sharding | PartitionSpec)


def broadcast_prefix(prefix: Any, tree: Any) -> tuple[list, bool] | None:
    """The leaves of the pytree prefix ``prefix`` (of shardings) broadcast over the leaves of treedef ``tree``.

    Metadata of nodes other than dicts, lists, tuples and None (a dataclass's
    static fields) is not compared. Returns the broadcast leaves and whether
    ``prefix`` is a whole tree of ``tree`` (each of its leaves one of
    ``tree``'s); None where the two do not match otherwise.

    Example:
      >>> import jax
      >>> tree = jax.tree_util.tree_structure({"a": (1, 2), "b": 3})
      >>> broadcast_prefix({"a": "s", "b": "t"}, tree)
      (['s', 's', 't'], False)
      >>> broadcast_prefix({"a": ("s", "u"), "b": "t"}, tree)
      (['s', 'u', 't'], True)
      >>> broadcast_prefix({"a": "s"}, tree) is None
      True
    """
    prefix_tree = jax.tree_util.tree_structure(prefix, is_leaf=_is_leaf)
    leaves = iter(jax.tree_util.tree_leaves(prefix, is_leaf=_is_leaf))
    whole = True

    def walk(p: Any, f: Any) -> list:
        nonlocal whole
        if p.num_nodes == 1 and p.num_leaves == 1:  # a leaf of the prefix: its whole subtree
            whole = whole and f.num_nodes == 1 and f.num_leaves == 1
            return [next(leaves)] * f.num_leaves
        if f.num_nodes == 1 and f.num_leaves == 1:
            raise ValueError("the prefix is deeper than the tree")
        (p_type, p_data), (f_type, f_data) = p.node_data(), f.node_data()
        p_kids, f_kids = p.children(), f.children()
        if p_type is not f_type or len(p_kids) != len(f_kids):
            raise ValueError("different nodes")
        if issubclass(p_type, _STRUCTURAL) and p_data != f_data:
            raise ValueError("different containers")
        return [s for a, b in zip(p_kids, f_kids, strict=True) for s in walk(a, b)]

    try:
        return walk(prefix_tree, tree), whole
    except ValueError:
        return None
