"""A program's configuration as one frozen record, and what it makes of a call.

:class:`ProgramInfo` holds what ``pw.program`` was given (as JAX's ``PjitInfo``
holds a ``jax.jit``'s): the function, its static and donated arguments, its
default slice. From a call's arguments it makes the cache key (static
arguments split off and checked), the donated leaves, and JAX's trace errors
in the user's words.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax

from pathways_jax._src.api.arguments import TraceInputs, _key_fault, _short_repr, _signed
from pathways_jax._src.api.jit_options import _parameters, _resolve_statics, from_end
from pathways_jax._src.core import errors, source
from pathways_jax._src.core.jax_context import trace_context as _trace_context
from pathways_jax._src.runtime import slices
from pathways_jax._src.runtime.slices import VirtualSlice


@dataclasses.dataclass(frozen=True, slots=True)
class ProgramInfo:
    """What a program was made with; fixed for its life.

    Attributes:
      fun: the user's function (or ``pw.jit``'s call of it).
      name: the program's name in graphs and errors.
      source_info: where ``fun`` is defined (``file.py:12 (fn)``).
      devices: the default slice (None: placed by the call's context or arguments).
      static: static positions (sorted; a negative one counts from the end of each call's positional
        arguments, as under ``jax.jit``: see ``static_positions``); ``static_names``: static parameter
        names, each completed from the other.
      donate: donated positions; ``donate_names``: donated names, each completed from the other.
      fuse: chains of nodes on one slice are compiled as one.
      mesh_hint: the mesh of ``in_shardings``/``out_shardings``, if any.
      device: ``jax.jit``'s ``device=``: where a program with no slice runs.
      compiler_options: XLA options every node is compiled with.
      nnx_inner: the inner program ``nnx_graph`` makes (NNX objects come as pytrees).
      nnx_modes: ``nnx.jit``'s ``graph=`` and ``graph_updates=`` (None: Flax's
        setting at the call, ``nnx.set_graph_mode`` / ``nnx.set_graph_updates``).
      under_transforms: called with tracers (inside the caller's ``jax.jit``, ``grad``
        or ``vmap``), it runs as ``jax.jit`` would; False for ``pw.jit``'s own
        programs, which handle that themselves.
      keep_unused: ``jax.jit``'s: an argument the function does not use still
        places the call (False: as under ``jax.jit``, a committed argument it
        does not use commits nothing).
    """

    fun: Callable[..., Any]
    name: str
    source_info: str
    devices: VirtualSlice | None
    static: tuple[int, ...]
    static_names: tuple[str, ...]
    donate: tuple[int, ...]
    donate_names: tuple[str, ...]
    fuse: bool = True
    mesh_hint: jax.sharding.Mesh | None = None
    device: jax.Device | None = None
    compiler_options: tuple[tuple[str, Any], ...] = ()
    nnx_inner: bool = False
    nnx_modes: tuple[bool | None, bool | None] = (None, None)
    under_transforms: bool = True
    keep_unused: bool = False

    @classmethod
    def of(
        cls,
        fun: Callable[..., Any],
        *,
        name: str,
        source_info: str,
        devices: VirtualSlice | None,
        static_argnums: tuple[int, ...],
        static_argnames: tuple[str, ...],
        donate_argnums: tuple[int, ...],
        donate_argnames: tuple[str, ...],
        argnums_completed: bool = False,
        **options: Any,
    ) -> ProgramInfo:
        """The record of a program over ``fun``, its static and donated arguments completed as ``jax.jit`` does.

        ``argnums_completed``: they are completed already (``jit_options.complete_argnums``),
        so taken as they are: ``()`` beside a non-empty other is one given empty.
        """
        static, static_names = _resolve_statics(
            fun, static_argnums, static_argnames, given_both=argnums_completed
        )
        # Donated positions and names, each completed from the other as jax.jit does: an
        # argument is donated whether it arrives by position or by keyword.
        donate, donate_names = _resolve_statics(
            fun, donate_argnums, donate_argnames, given_both=argnums_completed
        )
        return cls(
            fun,
            name,
            source_info,
            devices,
            static,
            static_names,
            donate,
            donate_names,
            **options,
        )

    def split(self, args: tuple, kwargs: dict, flat: tuple | None = None) -> tuple[tuple, TraceInputs]:
        """The cache key of a call and what tracing it needs (``flat``: its leaves and treedef, if known)."""
        if not self.static and not (kwargs and self.static_names):
            leaves, treedef = flat if flat is not None else jax.tree_util.tree_flatten((args, kwargs))
            ambient = slices.current_slice() if self.devices is None else None
            try:
                signature = _signed(leaves, self.name)
            except errors.ProgramTraceError as exc:
                _name_the_path(exc, treedef)
                raise
            # As jax.jit's, the key holds the configuration the trace depends on.
            key: tuple = (
                treedef,
                signature,
                (),
                ambient.id if ambient is not None else None,
                _trace_context(),
            )
            return key, TraceInputs(treedef, (), signature, ambient, leaves)
        statics, dynamic, kwargs = self.take_statics(args, kwargs)
        for where, value in statics:
            self.check_static(where, value)
        leaves, treedef = jax.tree_util.tree_flatten((dynamic, kwargs))
        ambient = slices.current_slice() if self.devices is None else None
        try:
            signature = _signed(leaves, self.name)
        except errors.ProgramTraceError as exc:
            taken = {where for where, _ in statics if isinstance(where, int)}
            _name_the_path(exc, treedef, [p for p in range(len(args)) if p not in taken])
            raise
        key = (
            treedef,
            signature,
            static_key(statics),
            ambient.id if ambient is not None else None,
            _trace_context(),
        )
        ordered = tuple(reversed([s for s in statics if isinstance(s[0], int)]))
        named = tuple(s for s in statics if isinstance(s[0], str))
        return key, TraceInputs(treedef, ordered + named, signature, ambient, leaves)

    def take_statics(self, args: tuple, kwargs: dict) -> tuple[list[tuple[int | str, Any]], tuple, dict]:
        """A call's static arguments, ``(position or keyword name, value)`` (positions last to first),
        and its dynamic positional and keyword arguments."""
        statics: list[tuple[int | str, Any]] = []
        dynamic = list(args)
        if self.static_names and kwargs:
            # Keyword statics (static_argnames) are keyed by name; the rest stay dynamic.
            kwargs = dict(kwargs)
            for name in self.static_names:
                if name in kwargs:
                    statics.append((name, kwargs.pop(name)))
        for position in reversed(self.static_positions(len(args))):
            if position >= len(args):
                # As jax.jit: passed by keyword (a static name), left to its default, or
                # an *args entry this call does not give.
                continue
            statics.append((position, dynamic.pop(position)))
        return statics, tuple(dynamic), kwargs

    def static_positions(self, count: int) -> tuple[int, ...]:
        """The static positions of a call with ``count`` positional arguments.

        As ``jax.jit``: a negative ``static_argnums`` counts from the end of the
        call's positional arguments (``static_argnums=-1`` of ``f(*args)`` is the
        last one given), not of the function's parameters.
        """
        return from_end(self.static, count, f"program {self.name!r} ({self.source_info})")

    def check_static(self, where: int | str, value: Any) -> None:
        """Refuses a static argument that cannot key the program's cache.

        A key must hash and equal itself: a NaN does not (``nan != nan``), so a
        NaN static argument would miss the cache, tracing and compiling the
        program again, on every call.
        """
        fault = _key_fault(value)
        if fault is None:
            return
        head = f"static argument {where!r} of program {self.name!r}"
        called = f"called at {source.of_caller()} (program defined at {self.source_info})"
        todo = "Pass it as a traced argument (leave it out of static_argnums and static_argnames), or pass"
        if fault.unhashable:  # jax.jit raises ValueError here
            raise errors.also(errors.ProgramTraceError, ValueError)(
                f"{head} must be hashable, got {type(value).__name__}, {called}: static arguments "
                f"are the program's cache key. {todo} a hashable value (a tuple, not a list)."
            ) from fault.cause
        shown = f"its part {fault.path} is" if fault.path else "it is"
        raise errors.ProgramTraceError(
            f"{head}, {called}, cannot be a cache key: {shown} {_short_repr(fault.part)} "
            f"({type(fault.part).__name__}); {fault.reason}. Static arguments are the program's "
            f"cache key, so each must hash and equal itself. {todo} a value that equals itself."
        ) from fault.cause

    def in_user_words(self, text: str, treedef: Any, statics: tuple) -> str:
        """JAX's message about the trace, naming the user's function and arguments, not ours."""
        text = re.sub(r"flat_fun at \S+", f"{self.name} at {self.source_info}", text)
        if "dynamic_leaves[" not in text:
            return text
        names = [p.name for p in _parameters(self.fun)]
        static = {position for position, _ in statics if isinstance(position, int)}
        dynamic = [p for p in range(treedef.num_leaves + len(static) + len(names)) if p not in static]
        numbered = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
        leaf_names = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(numbered)[0]:
            if path[0].idx == 0:  # a positional argument
                position = dynamic[path[1].idx]
                head = names[position] if position < len(names) else f"args[{position}]"
            else:
                head = str(path[1].key)
            leaf_names[leaf] = head + jax.tree_util.keystr(path[2:])
        return re.sub(r"dynamic_leaves\[(\d+)\]", lambda m: leaf_names.get(int(m.group(1)), m.group(0)), text)

    def donated_leaves(self, args: tuple, kwargs: dict) -> frozenset[int]:
        """The argument leaves (flat positions) of the arguments donated, by position or by name.

        As ``jax.jit``: a donated parameter is donated whether the call passes it
        by position or by keyword; one the call leaves to its default has nothing to donate.
        """
        if not self.donate and not self.donate_names:
            return frozenset()
        donated: set[int] = set()
        start = 0
        static = self.static_positions(len(args))
        for position, arg in enumerate(args):
            if position in static:
                continue
            count = jax.tree_util.tree_structure(arg).num_leaves  # type: ignore[attr-defined]  # jaxlib has no PyTreeDef stubs
            if position in self.donate:
                donated.update(range(start, start + count))
            start += count
        # Keyword arguments follow, in the order a dict flattens (sorted keys), statics taken out.
        for name in sorted(k for k in kwargs if k not in self.static_names):
            count = jax.tree_util.tree_structure(kwargs[name]).num_leaves  # type: ignore[attr-defined]
            if name in self.donate_names:
                donated.update(range(start, start + count))
            start += count
        return frozenset(donated)


def static_key(statics: list[tuple[int | str, Any]]) -> tuple:
    """The part of a call's cache key its static arguments make (see ``ProgramInfo.take_statics``).

    Typed as ``jax.jit`` keys them: 1, 1.0 and True are equal but trace apart.
    """
    return tuple((where, type(value), value) for where, value in statics)


__all__ = ["ProgramInfo", "static_key"]


_LEAF = re.compile(r"argument leaf (\d+)")


def _name_the_path(exc: errors.ProgramTraceError, treedef: Any, positions: list[int] | None = None) -> None:
    """Adds to ``exc``'s "argument leaf N" where that leaf is in the call, as ``jax.jit`` names it
    (``args[0].config``, ``kwargs['batch']``): in a large train state a number alone is hard to find.

    ``treedef`` is that of the call's ``(args, kwargs)``, its static arguments taken out;
    ``positions``: the call's position of each positional argument left (None: all are).
    """
    text = str(exc)
    found = _LEAF.search(text)
    if found is None or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return
    try:
        position = int(found.group(1))
        placed = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
        path = jax.tree_util.tree_flatten_with_path(placed)[0][position][0]
    except Exception:  # not a path it can name: the number stays alone
        return
    if path[0].idx == 0:  # a positional argument, numbered as the call numbers it
        number = path[1].idx if positions is None else positions[path[1].idx]
        where = f"args[{number}]" + jax.tree_util.keystr(path[2:])
    else:
        where = "kwargs" + jax.tree_util.keystr(path[1:])
    exc.args = (f"{text.rstrip()} (Argument leaf {position} is {where} in the call.)",)
