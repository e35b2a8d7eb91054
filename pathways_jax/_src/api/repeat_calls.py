"""A program's repeated calls: the plan of the call before, taken again without signing the arguments.

A train loop calls a program with the outputs of its call before: futures
whose signatures are shared objects, or arrays whose types are. The next
call compares those by identity and runs the same plan, skipping the
signature and the cache lookups.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from pathways_jax._src.api.arguments import TraceInputs, _marks, _same_types
from pathways_jax._src.api.program_info import ProgramInfo, static_key
from pathways_jax._src.core.jax_context import trace_context as _trace_context
from pathways_jax._src.ir.signatures import FutureKey
from pathways_jax._src.runtime import slices
from pathways_jax._src.runtime.futures import Future
from pathways_jax._src.runtime.runnable import Runnable
from pathways_jax._src.runtime.slices import VirtualSlice


class LastCall(NamedTuple):
    """The last call whose arguments were all futures: the next such call may skip its lookups."""

    signatures: tuple[FutureKey, ...]  # the futures' keys (shared objects: compared by identity)
    ambient: VirtualSlice | None
    plan: Runnable
    config: tuple  # JAX's trace context of that call


class LastLeaves(NamedTuple):
    """The last call whose dynamic leaves were all ``jax.Array`` s, futures or host values.

    The next call whose leaves have the same types, compared by identity (an
    array's ``aval`` and ``sharding`` objects, a future's shared signature, a
    Python scalar's type; a numpy value's type, shape and dtype by equality),
    and whose static arguments are equal (as ``jax.jit`` compares them), skips
    its signature and cache lookups: a train loop feeds each step the outputs
    of the one before, whose types are the same objects every step.
    """

    treedef: Any  # of the dynamic arguments
    marks: tuple[Any, ...]  # per leaf: see arguments._marks
    ambient: VirtualSlice | None
    plan: Runnable
    config: tuple  # JAX's trace context of that call
    statics: tuple  # its static arguments' part of the cache key (program_info.static_key); () if none


class RepeatCalls:
    """What one program keeps of its last calls: a :class:`LastCall` and a :class:`LastLeaves`."""

    __slots__ = ("info", "last", "last_leaves")

    def __init__(self, info: ProgramInfo) -> None:
        self.info = info
        self.last: LastCall | None = None
        self.last_leaves: LastLeaves | None = None

    def clear(self) -> None:
        self.last = None
        self.last_leaves = None

    def _keyed_by_leaves(self, kwargs: dict) -> bool:
        """True when a call with these keyword arguments has no static argument: its leaves key it."""
        return not self.info.static and not (kwargs and self.info.static_names)

    def _in_context(self, ambient: VirtualSlice | None, plan: Runnable, config: tuple) -> bool:
        """True when a plan made in that context still runs a call made now."""
        return (
            (self.info.devices is not None or slices.current_slice() is ambient)
            and plan.is_current()
            and _trace_context() == config
        )

    def by_futures(self, args: tuple) -> Runnable | None:
        """The plan of the call before if this one passes futures of its signatures in its context; else None.

        Signatures are shared objects, so the check is by identity: no signing
        and no lookup.
        """
        last = self.last
        if last is None:
            return None
        signatures = last.signatures
        if len(args) != len(signatures):
            return None
        # A plain loop: a generator under all() costs more than the check on one or two arguments.
        for a, sig in zip(args, signatures, strict=True):  # lengths checked above
            if type(a) is not Future or a._entry.signature is not sig:
                return None
        plan = last.plan
        if self._in_context(last.ambient, plan, last.config):
            return plan
        return None

    def by_leaves(self, args: tuple, kwargs: dict) -> tuple[Runnable | None, tuple[list[Any], Any] | None]:
        """The plan of the call before if this one's static arguments are equal and its dynamic leaves
        have its types, treedef and context (else None), and the dynamic leaves and their treedef if
        they were flattened (else None: no call was kept, or a static argument differs)."""
        fast = self.last_leaves
        if fast is None:
            return None, None
        if self._keyed_by_leaves(kwargs):
            if fast.statics:  # that call gave a static argument by keyword; this one leaves it out
                return None, None
            flat = jax.tree_util.tree_flatten((args, kwargs))
        else:
            statics, dynamic, kwargs = self.info.take_statics(args, kwargs)
            try:
                same = static_key(statics) == fast.statics  # as jax.jit compares them
            except Exception:  # an __eq__ that raises: signed, and refused there if it must be
                same = False
            if not same:
                return None, None
            flat = jax.tree_util.tree_flatten((dynamic, kwargs))
        leaves, treedef = flat
        plan = fast.plan
        if (
            _same_types(leaves, fast.marks)
            and treedef == fast.treedef
            and self._in_context(fast.ambient, plan, fast.config)
        ):
            return plan, flat
        return None, flat

    def remember(self, key: tuple, inputs: TraceInputs, args: tuple, kwargs: dict, plan: Runnable) -> None:
        """Keeps what lets the next call with the same types skip signing: its futures' signatures, or its leaf types."""
        futures_only = not kwargs and not self.info.static and all(type(a) is Future for a in args)
        if futures_only and all(a._entry.signature is not None for a in args):
            self.last = LastCall(tuple(a._entry.signature for a in args), inputs.ambient, plan, key[-1])
        else:
            marks = _marks(inputs.leaves)
            if marks is not None:
                self.last_leaves = LastLeaves(inputs.treedef, marks, inputs.ambient, plan, key[-1], key[2])


__all__ = ["LastCall", "LastLeaves", "RepeatCalls"]
