"""``pw.jit``: a jitted function placed on a virtual slice."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from pathways_jax._src.api import decorator, hijax_arguments, nnx_graph, pickling
from pathways_jax._src.api.arguments import TracerArgument
from pathways_jax._src.api.graph_builder import JIT_SCOPE, JitCall, active_trace
from pathways_jax._src.api.jit_options import (
    _check_argnums_as_jax_jit,
    _resolve_statics,
    complete_argnums,
    from_end,
    name_of,
    refuse_traced_statics,
    with_jits_donations,
    with_jits_statics,
)
from pathways_jax._src.api.jit_shardings import (
    jits_device,
    jits_keep_unused,
    lowered_jit,
    with_jits_out_shardings,
)
from pathways_jax._src.api.tracing import Program, lowering_whole
from pathways_jax._src.core import errors, source
from pathways_jax._src.core.jax_context import inside_jax_trace
from pathways_jax._src.core.meshes import only_mesh, spec_parts
from pathways_jax._src.runtime import clusters, slices, submission
from pathways_jax._src.runtime.slices import VirtualSlice, check_spec

try:  # the tracer of a value vmap batches (private to JAX)
    from jax._src.interpreters.batching import BatchTracer as _BatchTracer
except ImportError:  # pragma: no cover - another JAX: every value may be batched
    _BatchTracer = None  # type: ignore[assignment, misc]

# One spec for every argument, or one pytree prefix of specs per non-static positional argument.
Specs = PartitionSpec | Sequence[Any] | None


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _spec_leaf(spec: Any, what: str) -> PartitionSpec | None:
    """``spec`` if it is a leaf of a specs prefix (a ``pw.P`` or None); else a PlacementError."""
    if not _is_spec_leaf(spec):
        raise errors.PlacementError(
            f"{what} must hold pw.P(...) or None at its leaves, got {spec!r} ({type(spec).__name__})."
        )
    return spec


def _check_fits(spec: PartitionSpec | None, aval: Any, slice_: VirtualSlice, what: str) -> None:
    if spec is None:
        return
    check_spec(spec, slice_, what=what)
    shape = getattr(aval, "shape", ())
    if len(spec) > len(shape):
        raise errors.PlacementError(
            f"{what} {spec} has {len(spec)} entries but the value has shape {tuple(shape)}; "
            "a spec has at most one entry per dimension."
        )
    parts_per_dim = spec_parts(spec, dict(zip(slice_.axis_names, slice_.shape, strict=True)))
    for dim, parts in zip(shape, parts_per_dim or (), strict=False):
        if dim % parts:
            raise errors.PlacementError(
                f"{what} {spec} splits a dimension of size {dim} into {parts} parts "
                f"for shape {tuple(shape)} on {slice_!r}; the size must divide evenly."
            )


def _retype(leaf: Any, spec: PartitionSpec | None) -> Any:
    """``leaf`` resharded to ``spec`` on the context's Explicit mesh, unless its type has it."""
    if spec is None:
        return leaf
    typed = getattr(jax.typeof(leaf), "sharding", None)
    ndim = len(getattr(leaf, "shape", ()))
    if typed is not None and _padded(typed.spec, ndim) == _padded(spec, ndim):
        return leaf
    return jax.sharding.reshard(leaf, spec)


def _batched(tree: Any) -> bool:
    """Whether ``tree`` holds a value ``vmap`` batches: specs do not see its batch dimension."""
    if _BatchTracer is None:
        return True
    return any(isinstance(leaf, _BatchTracer) for leaf in jax.tree_util.tree_leaves(tree))


def _padded(spec: PartitionSpec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


class _Group:
    """The specs of one part of an output, spread over its leaves."""

    __slots__ = ("specs",)

    def __init__(self, specs: list) -> None:
        self.specs = specs


class _CallOf:
    """``JitFunction.__call__`` of a function held weakly: what its programs on slices call.

    A function keeps its programs (``_programs``), and a program holding its
    function strongly made a reference cycle: a function dropped (``del f`` in a
    cell) kept its slice, the slice's devices and its executables until the
    garbage collector's next full pass, which a long-lived kernel seldom makes.
    Only the function calls its programs, so it lives while they are called.
    """

    __slots__ = ("__weakref__", "__wrapped__", "_owner")

    def __init__(self, owner: JitFunction) -> None:
        self._owner = weakref.ref(owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is None:  # pragma: no cover - only the function itself calls its programs
            raise errors.PathwaysError("this pw.jit function was garbage-collected; its programs cannot run.")
        return JitFunction.__call__(owner, *args, **kwargs)


class JitFunction:
    """A function compiled with ``jax.jit`` and placed on a slice; see :func:`jit`."""

    __name__: str  # the wrapped function's, set by functools.update_wrapper

    def __init__(
        self,
        fun: Callable[..., Any],
        devices: VirtualSlice | None,
        in_specs: Specs,
        out_specs: Any,
        static_argnums: tuple[int, ...],
        donate_argnums: tuple[int, ...],
        static_argnames: tuple[str, ...] = (),
        donate_argnames: tuple[str, ...] = (),
        compiler_options: tuple[tuple[str, Any], ...] = (),
        device: jax.Device | None = None,
        keep_unused: bool = False,
        share_key: tuple[Any, ...] | None = None,
        completed: bool = False,
    ):
        self._fun = fun
        # What it is made again from where it is unpickled (see __reduce__).
        self._made_with = {
            "devices": devices,
            "in_specs": in_specs,
            "out_specs": out_specs,
            "static_argnums": static_argnums,
            "donate_argnums": donate_argnums,
            "static_argnames": static_argnames,
            "donate_argnames": donate_argnames,
            "compiler_options": compiler_options,
            "device": device,
            "keep_unused": keep_unused,
            "completed": completed,
        }
        # Its function and options, where pw.jit made again with them takes the program of
        # its calls nothing places from the one made before (see _program_on).
        self._share_key = share_key
        self._share_pending = False  # its program is not kept yet (no cluster ran when it was made)
        # Where it runs when nothing places it (a wrapped jax.jit's device or one-device shardings).
        self._device = device
        self._compiler_options = compiler_options
        self._devices = devices
        self._in_specs = in_specs
        self._out_specs = out_specs
        # As jax.jit: positions and names complete each other (a static argument may come by keyword).
        # ``completed``: as pw.jit completed them (taken as they are; see jit_options.complete_argnums).
        self._static, self._static_names = _resolve_statics(
            fun, static_argnums, static_argnames, given_both=completed
        )
        self._donate, self._donate_names = _resolve_statics(
            fun, donate_argnums, donate_argnames, given_both=completed
        )
        self._jit_options: dict[str, Any] = {
            "static_argnums": self._static,
            "static_argnames": self._static_names,
            "donate_argnums": self._donate,
            "donate_argnames": self._donate_names,
        }
        self._keep_unused = keep_unused
        if keep_unused:  # as jax.jit's: an unused committed argument still places the call
            self._jit_options["keep_unused"] = True
        self._jitted = jax.jit(fun, **self._jit_options)
        self._aot_jitted: Callable[..., Any] | None = None  # with compiler_options: see _ahead_of_time
        self._nnx_jitted: Callable[..., Any] | None = None
        self._programs: dict[int | None, Program] = {}  # by slice id; None: placed as jax.jit
        # Threads tracing the function now, each with its depth (see _sole_tracer).
        self._tracers: dict[int, int] = {}
        self._tracers_lock = threading.Lock()
        self.source_info = source.of_function(fun)
        # Not fun.__dict__ (updated=()): a jax.jit object keeps its own _fun there.
        functools.update_wrapper(self, fun, updated=())
        if not isinstance(getattr(self, "__name__", None), str):  # a functools.partial has none
            self.__name__ = name_of(fun)

    @property
    def devices(self) -> VirtualSlice | None:
        return self._devices

    def _slice(self) -> VirtualSlice | None:
        """The slice it runs on now; ``None``: nothing places it, so it runs where ``jax.jit`` would."""
        trace = active_trace()
        chosen = self._devices or slices.current_slice() or (trace.default if trace else None)
        if chosen is None:
            if self._in_specs is None and self._out_specs is None:
                return None
            raise errors.PlacementError(
                f"pw.jit function {self.__name__!r} ({self.source_info}) was called at "
                f"{source.of_caller()} with in_specs/out_specs but no devices: specs name a "
                "slice's axes, so pass pw.jit(..., devices=slice), call it inside `with slice:`, "
                "or inside a @pw.program(devices=slice) (or leave the specs out to run it "
                "where jax.jit would)."
            )
        chosen.check_usable()
        return chosen

    def _static_of(self, args: tuple) -> tuple[int, ...]:
        """The static positions of a call (a negative one counts from the end of ``args``, as under ``jax.jit``)."""
        return from_end(self._static, len(args), f"pw.jit function {self.__name__!r} ({self.source_info})")

    def _per_arg_specs(self, count: int) -> list[Any]:
        """One spec prefix per non-static positional argument (``count`` of them)."""
        if self._in_specs is None or isinstance(self._in_specs, PartitionSpec):
            return [self._in_specs] * count
        per_arg = list(self._in_specs)
        if len(per_arg) != count:
            raise errors.PlacementError(
                f"pw.jit function {self.__name__!r} ({self.source_info}) has "
                f"{len(per_arg)} in_specs but was called with {count} "
                "non-static positional arguments; give one spec (or None) per argument."
            )
        return per_arg

    def _leaf_in_specs(self, args: tuple, kwargs: dict, slice_: VirtualSlice) -> tuple:
        static = self._static_of(args)
        dynamic = [a for i, a in enumerate(args) if i not in static]
        specs: list[PartitionSpec | None] = []
        for position, (arg, prefix) in enumerate(
            zip(dynamic, self._per_arg_specs(len(dynamic)), strict=True)
        ):
            what = f"in_specs[{position}] of {self.__name__!r}"
            for spec, leaf in zip(
                self._spread(prefix, arg, what), jax.tree_util.tree_leaves(arg), strict=True
            ):
                _check_fits(spec, leaf, slice_, what)
                specs.append(spec)
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
        specs.extend([None] * len(jax.tree_util.tree_leaves(dynamic_kwargs)))
        return tuple(specs)

    def _spread(self, prefix: Any, tree: Any, what: str) -> list[PartitionSpec | None]:
        """The spec of each leaf of ``tree``, from ``prefix``: a pytree prefix of it with spec leaves.

        As ``jax.jit``'s shardings and ``shard_map``'s specs: one ``pw.P``
        (or ``None``) stands for every leaf below it.
        """
        if _is_spec_leaf(prefix):
            return [prefix] * len(jax.tree_util.tree_leaves(tree))
        try:
            spread = jax.tree_util.tree_map(
                lambda spec, sub: _Group([_spec_leaf(spec, what)] * len(jax.tree_util.tree_leaves(sub))),
                prefix,
                tree,
                is_leaf=_is_spec_leaf,
            )
        except errors.PlacementError:
            raise  # a leaf that is not a spec (_spec_leaf)
        except (ValueError, TypeError) as exc:
            raise errors.PlacementError(
                f"{what} ({self.source_info}) is {prefix!r}, which does not match the structure "
                f"{jax.tree_util.tree_structure(tree)}; give one pw.P(...) (or None) for all of it, or a "
                "pytree prefix of it with a pw.P(...) or None at each leaf."
            ) from exc
        # _Group is not a pytree, so the user's own lists are not mistaken for it.
        return [spec for group in jax.tree_util.tree_leaves(spread) for spec in group.specs]

    def _leaf_out_specs(self, out: Any, slice_: VirtualSlice) -> tuple:
        what = f"out_specs of {self.__name__!r}"
        specs = self._spread(self._out_specs, out, what)
        for spec, leaf in zip(specs, jax.tree_util.tree_leaves(out), strict=True):
            _check_fits(spec, leaf, slice_, what)
        return tuple(specs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """As ``jax.jit(fun).lower(...)``: JAX's ``Lowered`` (``.as_text()``, ``.compile()``, its analyses).

        Called outside a program, it also prepares the plan a call with these
        arguments runs (as ``Program.lower`` does; ``jax.ShapeDtypeStruct`` s
        stand for arrays), so that call compiles nothing: the AOT guide's
        warm-up, ``f.lower(...).compile()``, warms ``f``'s calls as under ``jax.jit``.
        On a slice it lowers what a call compiles: as ``jax.jit`` under the
        slice's mesh, with its ``in_specs``/``out_specs`` as shardings and its
        ``compiler_options`` (see ``_ahead_of_time``).
        """
        outside = active_trace() is None and not inside_jax_trace()
        if outside and not jax.config.jax_disable_jit:  # type: ignore[attr-defined]
            try:
                slice_ = self._slice()
            except errors.PlacementError:  # specs but no slice: the call says so; this shows the function
                pass
            else:
                self._program_on(slice_)._prepare(args, kwargs)
        with self._slice_mesh():
            jitted, args, kwargs = self._ahead_of_time(args, kwargs)
            return jitted.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """As ``jax.jit(fun).trace(...)``: JAX's ``Traced`` of the function."""
        with self._slice_mesh():
            jitted, args, kwargs = self._ahead_of_time(args, kwargs)
            return jitted.trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """As ``jax.jit(fun).eval_shape(...)``: the outputs' shapes and dtypes, computing nothing."""
        with self._slice_mesh():
            jitted, args, kwargs = self._ahead_of_time(args, kwargs)
            return jitted.eval_shape(*args, **kwargs)

    def _ahead_of_time(self, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        """What ``lower``, ``trace`` and ``eval_shape`` take: the function as ``jax.jit``, with its specs.

        With ``in_specs``/``out_specs`` on a slice a call puts the arguments as
        their specs say on the slice's devices and compiles the function with its
        ``out_specs``; so is it lowered: the arguments a spec names stand as
        ``jax.ShapeDtypeStruct`` s of that sharding (as ``jax.jit``'s
        ``in_shardings=slice.sharding(spec)``, which would refuse keyword
        arguments: here they come as they are), and ``out_specs`` are
        ``jax.jit``'s ``out_shardings`` (``None``: left to XLA). What ``lower`` shows (``as_text()``, the compiled
        ``input_shardings``/``output_shardings``) is then what a call runs.
        """
        jitted: Any = self._jitted
        options = dict(self._compiler_options) or None  # as jax.jit(fun, compiler_options=...) lowers
        given = lowered_jit(self._fun)  # a jax.jit function given
        jit_info = getattr(given, "_jit_info", None)  # jax.jit's own record of its options (private)
        if (
            jit_info is not None
            and options is None
            and set(self._donate) <= set(getattr(jit_info, "donate_argnums", ()) or ())
            and self._keep_unused == bool(getattr(jit_info, "keep_unused", False))
        ):
            jitted = given  # lowered as it is, not as one jax.jit inside another
        elif options:
            jitted = self._aot_jitted
            if jitted is None:
                jitted = self._aot_jitted = jax.jit(self._fun, compiler_options=options, **self._jit_options)
        plain = (jitted, args, kwargs)
        if active_trace() is not None or inside_jax_trace():
            return plain
        try:
            slice_ = self._slice()
        except errors.PathwaysError:  # specs but no slice, or a slice released: the call says so
            return plain
        if slice_ is not None and self._in_specs is None and self._out_specs is None:
            return (jitted, *self._moved_onto(slice_, args, kwargs))
        if slice_ is None:
            return plain
        args, kwargs = self._moved_onto(slice_, args, kwargs)
        specs = iter(self._leaf_in_specs(args, kwargs, slice_))  # refuses what a call refuses
        mesh = slice_.physical_mesh
        static = self._static_of(args)

        def placed(leaf: Any) -> Any:
            spec = next(specs)
            if spec is None:
                return leaf
            aval = jax.typeof(leaf)
            return jax.ShapeDtypeStruct(
                aval.shape, aval.dtype, sharding=NamedSharding(mesh, spec), weak_type=aval.weak_type
            )

        args = tuple(
            arg if i in static else jax.tree_util.tree_map(placed, arg) for i, arg in enumerate(args)
        )
        out_shardings = jax.tree_util.tree_map(
            lambda spec: None if spec is None else NamedSharding(mesh, spec),
            self._out_specs,
            is_leaf=_is_spec_leaf,
        )
        specified = jax.jit(
            self._fun, out_shardings=out_shardings, compiler_options=options, **self._jit_options
        )
        return specified, args, kwargs

    def _moved_onto(self, slice_: VirtualSlice, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments as a call puts them on ``slice_`` (see ``slices.moved_onto``), statics as they are."""
        if nnx_graph.has_graph_nodes((args, kwargs)):
            return args, kwargs
        static = self._static_of(args)
        moved = tuple(arg if i in static else slices.moved_onto(slice_, arg) for i, arg in enumerate(args))
        names = self._static_names
        return moved, {k: v if k in names else slices.moved_onto(slice_, v) for k, v in kwargs.items()}

    def _slice_mesh(self) -> contextlib.AbstractContextManager[None]:
        """Where ``lower``, ``trace`` and ``eval_shape`` run the function as ``jax.jit``: on its slice's
        mesh (as under ``jax.set_mesh(slice.physical_mesh)``) if it has one here, else as it is."""
        if active_trace() is not None or inside_jax_trace():
            return contextlib.nullcontext()
        try:
            slice_ = self._slice()
        except errors.PathwaysError:  # specs but no slice, or a slice released: the call says so
            return contextlib.nullcontext()
        return contextlib.nullcontext() if slice_ is None else slices.on_slice_mesh(slice_)

    def clear_cache(self) -> None:
        """As ``jax.jit(fun).clear_cache()``: the next call traces and lowers again.

        Executables identical computations share stay in the cluster's cache
        (``jax.clear_caches()`` clears them, every program's caches and JAX's own).
        """
        for prog in list(self._programs.values()):
            prog.clear_cache()
        self._jitted.clear_cache()  # type: ignore[attr-defined]  # jax.jit's, not in its stubs
        if self._aot_jitted is not None:
            self._aot_jitted.clear_cache()  # type: ignore[attr-defined]

    def _cache_size(self) -> int:
        """As ``jax.jit(fun)._cache_size()``: the call signatures traced for its calls made outside a program."""
        return sum(prog._cache_size() for prog in list(self._programs.values()))

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """As ``jax.jit``: a function defined in a class body is a method, ``self`` its first argument."""
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __deepcopy__(self, memo: dict) -> JitFunction:
        """The function itself, as ``copy.deepcopy`` keeps a function (see ``Program.__deepcopy__``)."""
        return self

    def __reduce__(self) -> str | tuple[Any, ...]:
        """As a ``jax.jit`` function pickles (cloudpickle: Ray, joblib): its function and options (see ``pickling``)."""
        what = f"pw.jit function {self.__name__!r} ({self.source_info})"
        made_with = (type(self), self._fun, self._made_with)
        return pickling.reduced(self, what, self._devices, pickling.remade, made_with)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace = active_trace()
        if trace is None and jax.config.jax_disable_jit:  # type: ignore[attr-defined]
            # As jax.jit under jax.disable_jit(): op by op, in the caller; futures of its results.
            out = self._fun(*args, **kwargs)
            return submission.computed(out, f"pw.jit {self.__name__!r} run op by op", nnx_graph.is_graph_leaf)
        if trace is None and inside_jax_trace():  # checkify, make_jaxpr: as jax.jit, traced in
            return self._transformed(self._slice(), args, kwargs)
        if trace is None and hijax_arguments.given_hijax(args, kwargs):
            return self._on_values(args, kwargs)  # Flax's hijax Variables: updated as jax.jit updates them
        if trace is None and self._devices is not None and not self._devices.released:
            prog = self._programs.get(self._devices.id)
            if prog is not None:
                try:
                    return prog(*args, **kwargs)
                except errors.ProgramTraceError as exc:
                    if not isinstance(exc.__context__, TracerArgument):
                        raise
                return self._transformed(self._devices, args, kwargs)
        slice_ = self._slice()
        if trace is None:
            prog = self._program_on(slice_)
            try:
                out = prog(*args, **kwargs)
            except errors.ProgramTraceError as exc:
                if not isinstance(exc.__context__, TracerArgument):
                    raise
            else:
                if self._share_pending:  # made before any cluster ran: the call started one
                    self._share(prog)
                return out
            return self._transformed(slice_, args, kwargs)
        if trace is not None and hijax_arguments.given_hijax(args, kwargs):
            return self._on_values(args, kwargs)  # a node of their arrays, written back after it
        if slice_ is None:
            # Nothing places it: a plain jax.jit call of the program, placed as one.
            with self._sole_tracer() as alone:
                jitted = self._jitted_for(args, kwargs) if alone else self._unshared(args, kwargs)
                return jitted(*args, **kwargs)
        number = trace.record_jit(JitCall(slice_, self._leaf_in_specs(args, kwargs, slice_), None))
        explicit = AxisType.Explicit in slice_.axis_types
        with jax.named_scope(f"{JIT_SCOPE}{number}"), only_mesh(slice_.mesh), self._sole_tracer() as alone:
            if explicit:
                args = self._retype_args(args)
            jitted = self._jitted_for(args, kwargs) if alone else self._unshared(args, kwargs)
            out = jitted(*args, **kwargs)
            out_specs = self._leaf_out_specs(out, slice_)
            if explicit:
                # Shardings are types here: the node makes what its types say, and
                # out_specs reshard its outputs (as jax.sharding.reshard would).
                leaves, tree = jax.tree_util.tree_flatten(out)
                out = jax.tree_util.tree_unflatten(
                    tree, [_retype(leaf, spec) for leaf, spec in zip(leaves, out_specs, strict=True)]
                )
                out_specs = (None,) * len(out_specs)
        trace.jit_calls[number] = dataclasses.replace(trace.jit_calls[number], out_specs=out_specs)
        return out

    def _on_values(self, args: tuple, kwargs: dict) -> Any:
        """A call with Flax hijax Variables: a call of their arrays, written back into them after it.

        As ``jax.jit`` updates them: the function's node makes hijax Variables
        of the arrays, runs the function on them, and returns the arrays they
        end with, which the caller's Variables take once the run is dispatched.
        """
        slots, trees, variables, plain_args, plain_kwargs = hijax_arguments.as_values(
            args, kwargs, self.__name__
        )
        on_values = self.__dict__.setdefault("_hijax_nodes", {})
        node = on_values.get((slots, trees))
        if node is None:
            node = on_values.setdefault(
                (slots, trees),
                jit(
                    hijax_arguments.with_variables(self._fun, slots, trees),
                    devices=self._devices,
                    in_specs=self._in_specs,
                    out_specs=None if self._out_specs is None else (self._out_specs, None),
                    static_argnums=self._static,
                    static_argnames=self._static_names,
                    donate_argnums=self._donate,
                    donate_argnames=self._donate_names,
                    keep_unused=self._keep_unused,
                ),
            )
        out, ends = node(*plain_args, **plain_kwargs)
        hijax_arguments.write_back(variables, ends)
        return out

    def _program_on(self, slice_: VirtualSlice | None) -> Program:
        """The one-node program a call outside any program runs on ``slice_`` (made once per slice).

        As ``jax.jit(f)`` made again reuses what ``jax.jit(f)`` traced, the
        program of calls nothing places (``slice_`` None) is shared with
        ``pw.jit`` made before of the same module-level function and options
        (``pw.jit(f)(x)`` written inline in a loop), through ``pw.program``'s
        registry of such programs. A slice's program is not: it would keep the
        slice, and its devices, after the user dropped it.
        """
        key = slice_.id if slice_ is not None else None
        prog = self._programs.get(key)
        if prog is None and key is None and self._share_key is not None:
            shared = decorator._shared(self._share_key)
            if shared is not None:
                prog = self._programs.setdefault(None, shared)
        if prog is None:
            # Kept for pw.jit made again (share), a program may outlive this function: held strongly.
            outlives = key is None and self._share_key is not None
            call: Any = functools.partial(JitFunction.__call__, self) if outlives else _CallOf(self)
            # Its signature is the function's: a static argument may come by keyword.
            call.__wrapped__ = self._fun
            prog = Program(
                call,
                devices=slice_,
                device=self._device if slice_ is None else None,
                static_argnums=self._static,
                static_argnames=self._static_names,
                name=self.__name__,
                compiler_options=self._compiler_options,
                source_info=self.source_info,
                under_transforms=False,  # a tracer argument comes back here (_transformed)
                keep_unused=self._keep_unused,
                # A program's own donation consumes its arguments (a donation of a function it
                # calls reaches only values made inside it, as under jax.jit).
                donate_argnums=self._donate,
                donate_argnames=self._donate_names,
                argnums_completed=True,
            )
            # Threads making their first calls at once share one program (and its caches).
            prog = self._programs.setdefault(key, prog)
            if key is None and self._share_key is not None:
                self._share_pending = True
                self._share(prog)
        return prog

    def _share(self, prog: Program) -> None:
        """Keeps ``prog`` for ``pw.jit`` made again, once a cluster runs (kept per cluster)."""
        if clusters.running() is not None:
            self._share_pending = False
            decorator._share(self._share_key, prog)

    def _transformed(self, slice_: VirtualSlice | None, args: tuple, kwargs: dict) -> Any:
        """Called inside someone else's ``jax.jit``, ``grad`` or ``vmap``: behave as ``jax.jit``,
        on the slice's devices (with no slice, where ``jax.jit`` would).

        The arguments are put on the slice's devices, so the computation (and
        its outputs) stay there inside the outer transformation as in a
        program. ``in_specs``/``out_specs`` do not apply there: under ``vmap``
        they would not see the batch dimension; the slice's devices do. An outer
        ``jax.jit`` whose other arguments live on other devices then fails with
        JAX's own "incompatible devices" error, naming both.
        """
        self._refuse_traced_statics(args, kwargs)
        if slice_ is None:
            return self._jitted_for(args, kwargs)(*args, **kwargs)
        if (
            lowering_whole()
            and (self._in_specs is not None or self._out_specs is not None)
            and not _batched((args, kwargs))
            and not nnx_graph.has_graph_nodes((args, kwargs))
        ):
            return self._with_specs(slice_, args, kwargs)
        replicated = NamedSharding(slice_.physical_mesh, PartitionSpec())
        # NNX objects are moved in place: nnx.jit then updates the caller's, not copies.
        put = nnx_graph.put_in_place if nnx_graph.has_graph_nodes((args, kwargs)) else slices.put_for_jit
        static = self._static_of(args)
        moved = [arg if position in static else put(arg, replicated) for position, arg in enumerate(args)]
        moved_kwargs = {k: v if k in self._static_names else put(v, replicated) for k, v in kwargs.items()}
        with slices.on_slice_mesh(slice_):  # code naming the slice's mesh finds its devices
            out = self._jitted_for(tuple(moved), moved_kwargs)(*moved, **moved_kwargs)
        # NNX objects returned are the caller's own (nnx.jit updates them in place): left as they are.
        return out if nnx_graph.has_graph_nodes(out) else slices.typed_for_caller(slice_, out)

    def _with_specs(self, slice_: VirtualSlice, args: tuple, kwargs: dict) -> Any:
        """Called in a program's ``lower``/``trace``/``eval_shape``: as ``_transformed``, with its specs.

        Its arguments are put on the slice's devices as its ``in_specs`` say
        (the others replicated) and its outputs constrained to its
        ``out_specs``, as the program's node compiles it.
        """
        mesh = slice_.physical_mesh
        explicit = AxisType.Explicit in slice_.axis_types
        specs = iter(self._leaf_in_specs(args, kwargs, slice_))
        static = self._static_of(args)

        def put(leaf: Any) -> Any:
            spec = next(specs)
            return jax.device_put(leaf, NamedSharding(mesh, spec if spec is not None else PartitionSpec()))

        moved = tuple(arg if i in static else jax.tree_util.tree_map(put, arg) for i, arg in enumerate(args))
        moved_kwargs = {
            name: jax.tree_util.tree_map(put, kwargs[name])
            for name in sorted(kwargs)  # in the order the specs hold them
            if name not in self._static_names
        }
        moved_kwargs = {name: moved_kwargs.get(name, value) for name, value in kwargs.items()}
        with slices.on_slice_mesh(slice_):
            out = self._jitted_for(moved, moved_kwargs)(*moved, **moved_kwargs)
            leaves, tree = jax.tree_util.tree_flatten(out)
            constrained = [
                leaf
                if spec is None
                else jax.sharding.reshard(leaf, spec)
                if explicit
                else jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
                for leaf, spec in zip(leaves, self._leaf_out_specs(out, slice_), strict=True)
            ]
        return slices.typed_for_caller(slice_, jax.tree_util.tree_unflatten(tree, constrained))

    def _refuse_traced_statics(self, args: tuple, kwargs: dict) -> None:
        """Refuses a static argument a transformation made abstract, as a program does."""
        static = self._static_of(args)
        statics: list[tuple[int | str, Any]] = [(i, args[i]) for i in static if i < len(args)]
        statics += [(name, kwargs[name]) for name in self._static_names if name in kwargs]
        refuse_traced_statics(statics, f"pw.jit function {self.__name__!r}", self.__name__, self.source_info)

    def _retype_args(self, args: tuple) -> tuple:
        """On Explicit axes in_specs are types: arguments typed otherwise are resharded first."""
        if self._in_specs is None:
            return args
        static = self._static_of(args)
        dynamic = [i for i in range(len(args)) if i not in static]
        out = list(args)
        for number, (position, prefix) in enumerate(
            zip(dynamic, self._per_arg_specs(len(dynamic)), strict=True)
        ):
            if prefix is not None:
                leaves, tree = jax.tree_util.tree_flatten(args[position])
                specs = self._spread(prefix, args[position], f"in_specs[{number}] of {self.__name__!r}")
                retyped = [_retype(leaf, spec) for leaf, spec in zip(leaves, specs, strict=True)]
                out[position] = jax.tree_util.tree_unflatten(tree, retyped)
        return tuple(out)

    @contextlib.contextmanager
    def _sole_tracer(self) -> Iterator[bool]:
        """Marks this thread as tracing the function; yields whether no other thread is.

        JAX's trace cache makes a thread wait for another thread's trace of the
        same function and arguments. That trace may be waiting for this thread
        (the function started it and joins it), so a thread that is not alone
        traces through :meth:`_unshared` instead.
        """
        me = threading.get_ident()
        with self._tracers_lock:
            alone = self._tracers.keys() <= {me}
            self._tracers[me] = self._tracers.get(me, 0) + 1
        try:
            yield alone
        finally:
            with self._tracers_lock:
                self._tracers[me] -= 1
                if not self._tracers[me]:
                    del self._tracers[me]

    def _unshared(self, args: tuple, kwargs: dict) -> Callable[..., Any]:
        """The function jitted afresh: no trace cache entry shared with another thread's trace."""
        fun = functools.partial(self._fun)  # hashed by identity: a cache key of its own
        if nnx_graph.has_graph_nodes((args, kwargs)):
            from flax import nnx

            return nnx.jit(fun, **self._jit_options)
        return jax.jit(fun, **self._jit_options)

    def _jitted_for(self, args: tuple, kwargs: dict) -> Callable[..., Any]:
        # NNX objects are updated in place as nnx.jit does (a trace-time check only); Flax's
        # hijax Variables as jax.jit updates them.
        if not nnx_graph.has_graph_nodes((args, kwargs)) or hijax_arguments.given_hijax(args, kwargs):
            return self._jitted
        if self._nnx_jitted is None:
            from flax import nnx

            self._nnx_jitted = nnx.jit(self._fun, **self._jit_options)
        return self._nnx_jitted

    def __repr__(self) -> str:
        return f"pw.jit({self.__name__}, devices={self._devices!r})"


@overload
def jit(
    fun: Callable[..., Any],
    *,
    devices: VirtualSlice | None = None,
    in_specs: Specs = None,
    out_specs: Any = None,
    static_argnums: int | Sequence[int] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    device: jax.Device | None = None,
    backend: str | None = None,
) -> JitFunction: ...


@overload
def jit(
    fun: None = None,
    *,
    devices: VirtualSlice | None = None,
    in_specs: Specs = None,
    out_specs: Any = None,
    static_argnums: int | Sequence[int] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    device: jax.Device | None = None,
    backend: str | None = None,
) -> Callable[[Callable[..., Any]], JitFunction]: ...


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    devices: VirtualSlice | None = None,
    in_specs: Specs = None,
    out_specs: Any = None,
    static_argnums: int | Sequence[int] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    device: jax.Device | None = None,
    backend: str | None = None,
) -> JitFunction | Callable[[Callable[..., Any]], JitFunction]:
    """Compiles ``fun`` with ``jax.jit`` and places it on a slice.

    Usable bare (``pw.jit(f, devices=s)``) or as a decorator
    (``@pw.jit(devices=s)``). Called inside a ``@pw.program`` it becomes one
    node of the program; called anywhere else it runs as a one-node program
    and returns :class:`Future` s.

    Args:
      fun: the function.
      devices: the slice to run on; ``None`` uses the enclosing ``with slice:``
        or the program's default slice at call time, and with neither (and no
        specs) runs where ``jax.jit`` would: on its arguments' devices or mesh.
      in_specs: ``pw.P(...)`` for every positional argument, or one entry per
        non-static positional argument: a ``pw.P``/``None``, or a pytree prefix
        of that argument with a ``pw.P``/``None`` at each leaf (as
        ``shard_map``'s ``in_specs``), over the slice's axis names. As with
        ``jax.jit``'s ``in_shardings``, arguments given by keyword take none.
      out_specs: ``pw.P(...)`` for every output, or a pytree prefix of the
        output with one ``pw.P``/``None`` per part.
      static_argnums: positional arguments that are Python values (negative
        positions count from the end, as in ``jax.jit``).
      donate_argnums: arguments whose buffers the function may reuse.
      static_argnames: the same as ``static_argnums``, by parameter name; as in
        ``jax.jit``, one given alone completes the other, so a static argument
        may come by position or keyword (given both, each is taken as given).
      donate_argnames: the same as ``donate_argnums``, by parameter name.
      keep_unused: as in ``jax.jit``: with no slice, a committed argument the
        function does not use places the call only when True.
      inline: accepted as ``jax.jit`` accepts it (no effect on results).
      compiler_options: XLA options the function is compiled with when called
        on its own (inside a program, the program's own apply).
      in_shardings, out_shardings, device, backend: as in ``jax.jit``, for a
        function nothing places (no ``devices``, specs or enclosing slice):
        ``pw.jit(f, out_shardings=s)`` is ``pw.jit(jax.jit(f, out_shardings=s))``.

    Returns:
      A :class:`JitFunction`.

    Example:
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 2})
      >>> @pw.jit(devices=s, in_specs=pw.P("x"), out_specs=pw.P())
      ... def total(v):
      ...     return v.sum()
      >>> float(total(jnp.arange(4.0)).result())
      6.0
      >>> s.release()
    """
    if fun is None:

        def decorate(f: Callable[..., Any]) -> JitFunction:
            return jit(
                f,
                devices=devices,
                in_specs=in_specs,
                out_specs=out_specs,
                static_argnums=static_argnums,
                donate_argnums=donate_argnums,
                static_argnames=static_argnames,
                donate_argnames=donate_argnames,
                keep_unused=keep_unused,
                inline=inline,
                compiler_options=compiler_options,
                in_shardings=in_shardings,
                out_shardings=out_shardings,
                device=device,
                backend=backend,
            )

        return decorate
    if not callable(fun):
        raise errors.ProgramTraceError(f"pw.jit expects a function, got {type(fun).__name__}: {fun!r}.")
    if devices is not None and not isinstance(devices, VirtualSlice):
        raise errors.PlacementError(
            f"pw.jit(devices=...) expects a slice from pw.devices(...), got {devices!r}."
        )
    if devices is not None:
        if isinstance(in_specs, PartitionSpec):
            check_spec(in_specs, devices, what="in_specs")
        elif in_specs is not None:
            for spec in jax.tree_util.tree_leaves(in_specs, is_leaf=_is_spec_leaf):
                if _spec_leaf(spec, "in_specs") is not None:
                    check_spec(spec, devices, what="in_specs")
    # As jax.jit's: None is "not given", and given both (even one empty) each is taken as it is.
    statics, static_names = with_jits_statics(fun, *complete_argnums(fun, static_argnums, static_argnames))
    given_donations = complete_argnums(fun, donate_argnums, donate_argnames, "donate")
    _check_argnums_as_jax_jit(
        fun, static_argnums, static_argnames, donate_argnums, donate_argnames, "pw.jit", empty_is_unset=False
    )
    share_key = None
    if devices is None and in_specs is None and out_specs is None:
        options = (static_argnums, static_argnames, donate_argnums, donate_argnames, keep_unused)
        placement = (
            tuple(sorted((compiler_options or {}).items())),
            in_shardings,
            out_shardings,
            device,
            backend,
        )
        share_key = decorator._shared_key(fun, ("pw.jit", *options, *placement))
    keeps = bool(keep_unused) or jits_keep_unused(fun)  # a wrapped jax.jit's own too
    fun = _with_jax_jit_placement(
        fun,
        devices,
        in_specs,
        out_specs,
        statics,
        static_names,
        in_shardings,
        out_shardings,
        device,
        backend,
        (donate_argnums, donate_argnames),
    )
    donated, donated_names = with_jits_donations(fun, *given_donations)
    return JitFunction(
        # A jax.jit function given out_shardings returns values sharded so, on Explicit axes too.
        with_jits_out_shardings(fun),
        devices,
        in_specs,
        out_specs,
        statics,
        donated,
        static_names,
        donated_names,
        compiler_options=tuple(sorted((compiler_options or {}).items())),
        keep_unused=keeps,
        # As jax.jit: a wrapped jax.jit's device (device=, backend=, one-device shardings) runs it there.
        device=jits_device(fun),
        share_key=share_key,
        completed=True,
    )


def _with_jax_jit_placement(
    fun: Callable[..., Any],
    devices: VirtualSlice | None,
    in_specs: Specs,
    out_specs: Any,
    statics: tuple[int, ...],
    static_names: tuple[str, ...],
    in_shardings: Any,
    out_shardings: Any,
    device: jax.Device | None,
    backend: str | None,
    donations: tuple[Any, Any] = (None, None),
) -> Callable[..., Any]:
    """``fun`` under ``jax.jit`` with the placement options of ``jax.jit`` given (those not None), else ``fun``.

    ``pw.jit(f, out_shardings=s)`` is then ``pw.jit(jax.jit(f, out_shardings=s))``:
    placed as ``jax.jit`` places it, and donating what ``donations``
    (``donate_argnums``, ``donate_argnames`` as given) say, so that it lowers
    as that one ``jax.jit`` (with its input shardings as given, not the
    compiler's choice of a ``jax.jit`` around it). A slice's placement (``devices``,
    ``in_specs``, ``out_specs``) and ``jax.jit``'s are two answers to one
    question, so giving both raises ``PlacementError``.
    """
    given: dict[str, Any] = {
        name: value
        for name, value in (
            ("in_shardings", in_shardings),
            ("out_shardings", out_shardings),
            ("device", device),
            ("backend", backend),
        )
        if value is not None
    }
    if not given:
        return fun
    slice_options = [
        name
        for name, value in (("devices", devices), ("in_specs", in_specs), ("out_specs", out_specs))
        if value is not None
    ]
    if slice_options:
        raise errors.PlacementError(
            f"pw.jit({name_of(fun)!r}) was given {', '.join(slice_options)} and "
            f"{', '.join(given)}: a slice's placement and jax.jit's cannot both place it. Give "
            "devices= (with in_specs/out_specs over the slice's axes), or jax.jit's "
            f"{', '.join(given)} alone."
        )
    donate_argnums, donate_argnames = donations
    return jax.jit(
        fun,
        static_argnums=statics,
        static_argnames=static_names,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        **given,
    )
