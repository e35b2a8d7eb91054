"""``@pw.program`` and ``pw.jit``: tracing user functions into dataflow graphs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, overload

import jax

from pathways_jax._src import compat
from pathways_jax._src.api import graph_builder, nnx_graph
from pathways_jax._src.api.arguments import (
    TraceInputs,
    TracerArgument,
    _abstract,
    _as_array_key,
    _key_fault,
    _marks,
    _same_types,
    _short_repr,
    _signed,
)
from pathways_jax._src.api.graph_builder import DEFAULT_SCOPE, TraceState
from pathways_jax._src.api.graph_view import GraphView
from pathways_jax._src.api.jit_options import (
    _check_argnums_as_jax_jit,
    _parameters,
    _positions_of,
    _resolve_statics,
    argnames,
    argnums,
    name_of,
    with_jits_statics,
)
from pathways_jax._src.api.jit_shardings import jit_with_shardings
from pathways_jax._src.api.placement import (
    _device_slice,
    _mesh_mismatch_hint,
    _mesh_of,
    _mesh_slice,
    _named_mesh,
    _single_device_of,
    _user_mesh,
)
from pathways_jax._src.compile import lowering
from pathways_jax._src.core import counts, errors, events, reentry, source
from pathways_jax._src.core.jax_context import inside_jax_trace
from pathways_jax._src.core.jax_context import trace_context as _trace_context
from pathways_jax._src.core.meshes import only_mesh
from pathways_jax._src.ir import fusion
from pathways_jax._src.ir.signatures import FutureKey, Signature
from pathways_jax._src.runtime import context, slices, submission
from pathways_jax._src.runtime.futures import Future
from pathways_jax._src.runtime.slices import NO_ABSTRACT_MESH, VirtualSlice


class _LastCall(NamedTuple):
    """The last call whose arguments were all futures: the next such call may skip its lookups."""

    signatures: tuple[FutureKey, ...]  # the futures' keys (shared objects: compared by identity)
    ambient: VirtualSlice | None
    plan: Any  # lowering.Plan
    config: tuple  # JAX's trace context of that call


class _LastLeaves(NamedTuple):
    """The last call with no static arguments whose leaves were all ``jax.Array`` s or futures.

    The next call whose leaves have the same types, compared by identity (an
    array's ``aval`` and ``sharding`` objects, a future's shared signature),
    skips its signature and cache lookups: a train loop feeds each step the
    outputs of the one before, whose types are the same objects every step.
    """

    treedef: Any
    marks: tuple[Any, ...]  # per leaf: a future's signature, or an array's (aval, sharding, committed)
    ambient: VirtualSlice | None
    plan: Any  # lowering.Plan
    config: tuple  # JAX's trace context of that call


class Program:
    """A function traced into ONE dataflow program over virtual slices.

    Made by :func:`program`. Calling it returns at once with a pytree of
    :class:`Future` (one per output leaf); the controller runs the program in
    the background.
    """

    # True on the inner programs nnx_graph makes (they take NNX objects as pytrees).
    _nnx_inner: bool = False
    # Called with tracers (inside the caller's jax.jit, grad or vmap): run as jax.jit would
    # (see _transformed). False on pw.jit's own programs, which handle that themselves.
    _under_transforms: bool = True
    _jitted: Any = None

    def __init__(
        self,
        fun: Callable[..., Any],
        *,
        devices: VirtualSlice | None,
        static_argnums: tuple[int, ...],
        name: str | None = None,
        fuse: bool = True,
        donate_argnums: tuple[int, ...] = (),
        static_argnames: tuple[str, ...] = (),
        mesh_hint: jax.sharding.Mesh | None = None,
        donate_argnames: tuple[str, ...] = (),
        device: jax.Device | None = None,
        compiler_options: tuple[tuple[str, Any], ...] = (),
    ):
        self._fun = fun
        self._mesh_hint = mesh_hint  # the mesh of in_shardings/out_shardings, if any
        self._device = device  # jax.jit's device=: where a program with no slice runs
        self._compiler_options = compiler_options  # XLA options every node is compiled with
        self._devices = devices
        self._static, self._static_names = _resolve_statics(fun, static_argnums, static_argnames)
        # Static positions that may also arrive by keyword (or be left to their defaults).
        self._named_positions = frozenset(_positions_of(fun, self._static_names))
        self._fuse = fuse
        # Donated positions and names, each completed from the other as jax.jit does: an
        # argument is donated whether it arrives by position or by keyword.
        self._donate, self._donate_names = _resolve_statics(fun, donate_argnums, donate_argnames)
        self.name: str = name if name else name_of(fun)
        self.source_info = source.of_function(fun)
        # Guards the caches of graphs and plans; never held while user code runs.
        self._lock = threading.RLock()
        self._graphs: dict[Any, GraphView] = {}
        self._plans: dict[Any, Any] = {}
        # Call keys whose arguments or outputs hold NNX objects (pytrees): run as nnx.jit runs them.
        self._routed: set[Any] = set()
        self._last: _LastCall | None = None
        self._last_leaves: _LastLeaves | None = None
        # Not fun.__dict__ (updated=()): a jax.jit object keeps its own _fun there.
        functools.update_wrapper(self, fun, updated=())

    def _split(self, args: tuple, kwargs: dict, flat: tuple | None = None) -> tuple[tuple, TraceInputs]:
        """The cache key of a call and what tracing it needs (``flat``: its leaves and treedef, if known)."""
        if not self._static and not (kwargs and self._static_names):
            leaves, treedef = flat if flat is not None else jax.tree_util.tree_flatten((args, kwargs))
            ambient = slices.current_slice() if self._devices is None else None
            signature = _signed(leaves, self.name)
            # As jax.jit's, the key holds the configuration the trace depends on.
            key: tuple = (
                treedef,
                signature,
                (),
                ambient.id if ambient is not None else None,
                _trace_context(),
            )
            return key, TraceInputs(treedef, (), signature, ambient, leaves)
        statics: list[tuple[int | str, Any]] = []  # (position or keyword name, value)
        dynamic = list(args)
        if self._static_names and kwargs:
            # Keyword statics (static_argnames) are keyed by name; the rest stay dynamic.
            kwargs = dict(kwargs)
            for name in self._static_names:
                if name in kwargs:
                    statics.append((name, kwargs.pop(name)))
        for position in reversed(self._static):
            if position >= len(args) and position in self._named_positions:
                continue  # passed by keyword (a static name) or left to its default
            if position >= len(args):
                raise errors.ProgramTraceError(
                    f"program {self.name!r} ({self.source_info}) has static_argnums "
                    f"{self._static}, but was called with {len(args)} positional arguments."
                )
            statics.append((position, dynamic.pop(position)))
        for where, value in statics:
            self._check_static(where, value)
        leaves, treedef = jax.tree_util.tree_flatten((tuple(dynamic), kwargs))
        ambient = slices.current_slice() if self._devices is None else None
        signature = _signed(leaves, self.name)
        key = (
            treedef,
            signature,
            # Typed as jax.jit keys them: 1, 1.0 and True are equal but trace apart.
            tuple((where, type(value), value) for where, value in statics),
            ambient.id if ambient is not None else None,
            _trace_context(),
        )
        ordered = tuple(reversed([s for s in statics if isinstance(s[0], int)]))
        named = tuple(s for s in statics if isinstance(s[0], str))
        return key, TraceInputs(treedef, ordered + named, signature, ambient, leaves)

    def _check_static(self, where: int | str, value: Any) -> None:
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

    def _in_user_words(self, text: str, treedef: Any, statics: tuple) -> str:
        """JAX's message about the trace, naming the user's function and arguments, not ours."""
        text = re.sub(r"flat_fun at \S+", f"{self.name} at {self.source_info}", text)
        if "dynamic_leaves[" not in text:
            return text
        names = [p.name for p in _parameters(self._fun)]
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

    def _donated_leaves(self, args: tuple, kwargs: dict) -> frozenset[int]:
        """The argument leaves (flat positions) of the arguments donated, by position or by name.

        As ``jax.jit``: a donated parameter is donated whether the call passes it
        by position or by keyword; one the call leaves to its default has nothing to donate.
        """
        if not self._donate and not self._donate_names:
            return frozenset()
        donated: set[int] = set()
        start = 0
        for position, arg in enumerate(args):
            if position in self._static:
                continue
            count = jax.tree_util.tree_structure(arg).num_leaves  # type: ignore[attr-defined]  # jaxlib has no PyTreeDef stubs
            if position in self._donate:
                donated.update(range(start, start + count))
            start += count
        # Keyword arguments follow, in the order a dict flattens (sorted keys), statics taken out.
        for name in sorted(k for k in kwargs if k not in self._static_names):
            count = jax.tree_util.tree_structure(kwargs[name]).num_leaves  # type: ignore[attr-defined]
            if name in self._donate_names:
                donated.update(range(start, start + count))
            start += count
        return frozenset(donated)

    def _lowered(
        self, lower: Callable[..., Any], graph: GraphView, signature: Signature, donated: frozenset
    ) -> Any:
        """``lower(graph, ...)``, prepared by its backend; what JAX refuses only when compiling raises as a ``pw.errors`` type.

        JAX finds some errors only at lowering (a ``jvp`` of a ``custom_vjp``,
        devices that do not fit together), XLA some when compiling (an unknown
        ``compiler_options`` entry). Their class stays (see ``errors.also``): a
        ``ValueError`` is also a ``PlacementError``, anything else a ``ProgramTraceError``.
        """
        try:
            # The graph is plain data; where its slices are now is the placement's.
            plan = lower(graph.ir, signature, slices.placement_of(tuple(graph.held.values())), donated)
            if plan.backend is None:  # it places nothing: no backend's part
                return plan
            # The compiler calls no backend: the backend's part is made here, a copy holds it.
            prepared = plan.backend.prepare(plan)
            if not isinstance(prepared, lowering.Prepared):
                raise errors.ClusterError(
                    f"backend {plan.backend.name!r}: its prepare returned {type(prepared).__name__}, not a "
                    "Prepared record (pathways_jax._src.backends.base.Prepared: the windows, islands, "
                    "reports and the backend's own part of the plan); fix the backend"
                )
            return plan.with_prepared(prepared)
        except (errors.PathwaysError, Warning):  # a warning raised as an error stays itself
            raise
        except Exception as exc:  # also of the original's class (XLA's JaxRuntimeError: a bad option)
            kind = errors.PlacementError if isinstance(exc, ValueError) else errors.ProgramTraceError
            raise errors.also(kind, type(exc))(
                f"compiling program {self.name!r} ({self.source_info}) for {source.of_caller()} failed: "
                f"{type(exc).__name__}: {exc}{_mesh_mismatch_hint(exc, None)}"
            ) from exc

    def _transformed(self, args: tuple, kwargs: dict) -> Any:
        """Called inside the caller's ``jax.jit``, ``grad`` or ``vmap``: the function runs as ``jax.jit``.

        A transformation traces through the function, so no controller run can
        take part: as where ``@jax.jit`` stood, the function is traced into the
        caller's computation (its ``pw.jit`` functions keep their slices' devices).
        """
        statics: list[tuple[int | str, Any]] = [(i, args[i]) for i in self._static if i < len(args)]
        statics += [(name, kwargs[name]) for name in self._static_names if name in kwargs]
        for where, value in statics:
            if isinstance(value, jax.core.Tracer):
                raise errors.also(errors.ProgramTraceError, ValueError)(
                    f"static argument {where!r} of program {self.name!r} ({self.source_info}) is a JAX "
                    f"tracer (called at {source.of_caller()}): the transformation around the call (jax.eval_shape "
                    "traces every argument) made it abstract, and a static argument must be a value. "
                    f"Ask the program itself: {self.name}.eval_shape(...), or close over the value "
                    "(functools.partial) before transforming."
                )
        jitted = self._as_jax_jit()
        if self._devices is None:
            return jitted(*args, **kwargs)
        with self._devices:
            return jitted(*args, **kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """As ``jax.jit``: a program defined in a class body is a method, ``self`` its first argument."""
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def graph(self, *args: Any, **kwargs: Any) -> GraphView:
        """The dataflow graph this program traces into for these arguments.

        The graph (``.ir``) is plain data naming virtual slices; the view
        returned shows it with its slices where they are now (a node's
        ``slice`` is the ``VirtualSlice``, a transfer's ``kind`` is ICI or DCN
        as the slices are placed when it is read).

        Example:
          >>> import jax.numpy as jnp, pathways_jax as pw
          >>> s = pw.devices(mesh={"x": 1})
          >>> prog = pw.program(lambda v: v + 1, devices=s)
          >>> len(prog.graph(jnp.zeros(3)).nodes)
          1
          >>> s.release()
        """
        try:
            key, inputs = self._split(args, kwargs)
        except nnx_graph.GraphArgument:
            return nnx_graph.graph(self, args, kwargs)
        except errors.ProgramTraceError:
            if not nnx_graph.routes(self, (args, kwargs)):
                raise
            return nnx_graph.graph(self, args, kwargs)  # names the NNX state at fault
        if nnx_graph.routes(self, (args, kwargs)) or key in self._routed:
            return nnx_graph.graph(self, args, kwargs)
        try:
            return self._graph_for(key, inputs)
        except nnx_graph.GraphOutput:
            return nnx_graph.graph(self, args, kwargs)

    @staticmethod
    def _mesh_named_without_context(signature: Signature, state: TraceState, flat_fun: Any) -> Any:
        """The mesh the function names itself, traced with no mesh set (None if that fails too)."""
        outer, context.state.trace = context.state.trace, state
        try:
            with only_mesh(NO_ABSTRACT_MESH):
                closed = jax.make_jaxpr(flat_fun)(*(_abstract(s) for s in signature))
        except Exception:
            return None
        finally:
            context.state.trace = outer
        return _named_mesh(closed.jaxpr)

    def _graph_for(self, key: Any, inputs: TraceInputs) -> GraphView:
        graph = self._graphs.get(key)
        # A graph on a slice that is gone is traced again: the slices a program
        # with no placement implied belonged to a cluster that was shut down, and
        # those the user named raise their own clear error when traced.
        if graph is not None and not any(s.released for s in graph.held.values()):
            return graph
        # Traced with no lock held: the trace runs the user's code, which may
        # call this program from a thread it then joins. Threads tracing one
        # signature at once each finish; the first graph stored is kept.
        traced = self._trace(inputs)
        ir = traced.ir
        if self._fuse:
            ir = fusion.fuse(ir)
        if self._compiler_options:
            ir = dataclasses.replace(ir, compiler_options=self._compiler_options)
        graph = GraphView(ir, traced.held) if ir is not traced.ir else traced
        with self._lock:
            kept = self._graphs.get(key)
            if kept is None or any(s.released for s in kept.held.values()):
                kept = self._graphs[key] = graph
            return kept

    def _trace(self, inputs: TraceInputs, hint: jax.sharding.Mesh | None = None) -> GraphView:
        compat.install_checkpoints()  # once: Flax's and orbax's checkpoints then take the futures it returns
        treedef, statics, signature = inputs.treedef, inputs.statics, inputs.signature
        default = self._devices if self._devices is not None else inputs.ambient
        if default is not None:
            default.check_usable()
        state = TraceState(default)
        implied = None
        uncommitted = False
        if default is None and self._device is not None:  # jax.jit's device=
            implied = slices.implied((self._device.id,), {"x": 1})
            on_device: VirtualSlice = implied
            state.implied = lambda: on_device
        elif default is None:
            # Code nothing places runs where jax.jit would run it. Arguments on a
            # mesh of yours: the program is traced on that mesh, as jax.jit does.
            with contextlib.suppress(errors.ResourceError):  # reserved devices: placed later or an error
                implied = _mesh_slice(signature, hint or self._mesh_hint or _user_mesh())
            if implied is not None:
                on_mesh: VirtualSlice = implied
                state.implied = lambda: on_mesh
            else:
                state.implied = functools.cache(lambda: _device_slice(signature))
                # Nothing committed placed it: as jax.jit's, its outputs there are uncommitted.
                uncommitted = not any(getattr(key, "committed", False) for key in signature)
        out_trees: list[Any] = []

        def flat_fun(*dynamic_leaves: Any) -> list[Any]:
            dynamic, kwargs = jax.tree_util.tree_unflatten(treedef, dynamic_leaves)
            full = list(dynamic)
            for position, value in statics:
                if isinstance(position, str):
                    kwargs = {**kwargs, position: value}
                else:
                    full.insert(position, value)
            with contextlib.ExitStack() as stack:
                # Scopes entered here, inside the trace, are recorded on every equation.
                if default is not None:
                    stack.enter_context(jax.named_scope(f"{DEFAULT_SCOPE}{default.id}"))
                out = self._fun(*full, **kwargs)
            if not self._nnx_inner and nnx_graph.has_graph_nodes(out):
                # New NNX objects (a model made inside): returned as nnx.jit returns them,
                # sharing between them kept, which flattening them as pytrees loses.
                raise nnx_graph.GraphOutput
            flat, tree = jax.tree_util.tree_flatten(out)
            out_trees.append(tree)
            return flat

        sink = events.SINK
        t0 = events.now() if sink is not None else 0
        outer, context.state.trace = context.state.trace, state
        try:
            # The caller's own mesh (jax.set_mesh, of any size) is set aside: the
            # program sees its default slice's mesh, or none.
            target = default or implied
            # A program with no slice sees its mesh as jax.jit sees the caller's (bare
            # PartitionSpecs in an inner jax.jit's shardings name it); a slice's is abstract.
            concrete = implied.physical_mesh if default is None and implied is not None else None
            with only_mesh(target.mesh if target is not None else NO_ABSTRACT_MESH, concrete):
                closed = jax.make_jaxpr(flat_fun)(*(_abstract(s, target) for s in signature))
        except (errors.PathwaysError, nnx_graph.GraphOutput):
            raise
        except Exception as exc:
            if implied is not None and default is None and hint is None and self._mesh_hint is None:
                # Traced on its arguments' mesh, the function failed: a mesh it names itself
                # (a shard_map's or pmap's over other axes) wins, as under jax.jit.
                named = self._mesh_named_without_context(signature, state, flat_fun)
                if named is not None:
                    return self._trace(inputs, named)
            # No line of the function failed (it was called with arguments it does not take):
            # the user's call did.
            where = source.of_exception(exc, self._fun) or f"the call ({source.of_caller()})"
            # Also of the original's class: `except ValueError` written for jax.jit still catches it.
            raise errors.also(errors.ProgramTraceError, type(exc))(
                f"tracing program {self.name!r} ({self.source_info}) failed at "
                f"{where}: {type(exc).__name__}: "
                f"{self._in_user_words(str(exc), treedef, statics)}{_mesh_mismatch_hint(exc, target)}"
            ) from exc
        finally:
            context.state.trace = outer
        self._refuse_leaked_tracers(closed)
        counts.bump("traces")
        if default is None and implied is None and hint is None:
            # Nothing placed it, but the function names a mesh itself (a sharding constraint
            # or an inner jax.jit's shardings): as jax.jit, it runs on that mesh.
            named = _named_mesh(closed.jaxpr)
            if named is not None:
                return self._trace(inputs, named)
        graph, held = graph_builder.build(
            name=self.name,
            source_info=self.source_info,
            closed=closed,
            input_slices=tuple(leaf.slice if isinstance(leaf, Future) else None for leaf in inputs.leaves),
            state=state,
            out_tree=out_trees[-1],
        )
        if uncommitted and state.implied is not None:
            implied_id = state.implied().id
            # Only a slice the graph names has outputs to leave uncommitted; naming another
            # (made for nothing, and a new one each trace) would make equal traces unequal graphs.
            if implied_id in held:
                graph = dataclasses.replace(graph, uncommitted_slice=implied_id)
        if sink is not None:
            sink(events.Traced(self.name, self.source_info, t0, events.now()))
        return GraphView(graph.check(), held)

    def _refuse_leaked_tracers(self, closed: Any) -> None:
        """Raises jax.jit's ``UnexpectedTracerError`` for a tracer the function read from an ended trace.

        ``jax.make_jaxpr`` keeps such a tracer (an earlier trace's value saved
        to a global or a list) as a constant, where ``jax.jit`` refuses it;
        programs are traced only outside JAX's transformations, so no constant
        can be a tracer of a live one.
        """
        leaked = [c for c in closed.consts if isinstance(c, jax.core.Tracer)]
        if not leaked or inside_jax_trace():
            return
        raise errors.also(errors.ProgramTraceError, jax.errors.UnexpectedTracerError)(
            f"tracing program {self.name!r} ({self.source_info}) read an intermediate value of another "
            f"trace ({leaked[0].aval.str_short()} in a {type(leaked[0]).__name__}) that escaped it: "
            "a function traced by JAX (a program, jax.jit, grad, ...) saved it to global state or a "
            "list instead of returning it. Return the value from that function and pass it to this "
            "program as an argument. To find where it leaked, run under jax.checking_leaks()."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if context.state.trace is not None or reentry.inside.depth or context.exiting:
            return self._call_within(args, kwargs)
        if self._under_transforms and inside_jax_trace():
            # Traced by JAX (checkify, make_jaxpr) with concrete arguments: as jax.jit, traced in.
            return self._transformed(args, kwargs)
        plan = self._repeated_futures(args) if not kwargs else None
        if plan is not None:
            return submission.submit(plan, list(args))
        if jax.config.jax_disable_jit:  # type: ignore[attr-defined]
            # As jax.jit under jax.disable_jit(): op by op, in the caller.
            out = self._fun(*args, **kwargs)
            return submission.computed(out, f"program {self.name!r} run op by op", nnx_graph.is_graph_leaf)
        return self._call_planned(args, kwargs)

    def _call_within(self, args: tuple, kwargs: dict) -> Any:
        """A call made inside another program's trace, the runtime's own work, or an exit hook."""
        if context.state.trace is not None:
            # Called while another program is traced: its nodes join that program.
            if self._devices is None:
                return self._fun(*args, **kwargs)
            with self._devices:
                return self._fun(*args, **kwargs)
        # Called by Python code run inside the controller's own work (a garbage-collector
        # finalizer, a signal handler, a host callback), or by an exit hook that runs
        # after pathways_jax's: as jax.jit, in place (a daemon thread is held first).
        if context.exiting and not reentry.inside.depth:
            context.park_at_exit()
        out = self._as_jax_jit()(*args, **kwargs)
        how = "at exit" if context.exiting else "in place"
        return submission.computed(out, f"program {self.name!r} run {how}", nnx_graph.is_graph_leaf)

    def _repeated_futures(self, args: tuple) -> Any:
        """The plan of the call before if this one passes futures of its signatures in its context; else None.

        Signatures are shared objects, so the check is by identity: no signing
        and no lookup.
        """
        last = self._last
        if last is None or len(args) != len(last.signatures):
            return None
        plan = last.plan
        if (
            all(
                type(a) is Future and a._entry.signature is sig
                for a, sig in zip(args, last.signatures, strict=True)
            )
            and (self._devices is not None or slices.current_slice() is last.ambient)
            and plan.is_current()
            and _trace_context() == last.config
        ):
            return plan
        return None

    def _call_planned(self, args: tuple, kwargs: dict) -> Any:
        """The call submitted with its plan (traced and lowered if new), or run as ``nnx.jit`` would."""
        if nnx_graph.takes_objects(self, args, kwargs):  # a model, an optimizer: as nnx.jit runs it
            return nnx_graph.call(self, args, kwargs)
        try:
            planned = self._planned(args, kwargs)
        except TracerArgument as exc:
            if self._under_transforms:
                return self._transformed(args, kwargs)
            raise errors.ProgramTraceError(
                f"program {self.name!r} ({self.source_info}) was called with a JAX tracer as "
                f"argument leaf {exc.args[0]}: a program cannot run inside jax.jit, vmap or "
                "grad. Call it from Python, or call the jitted functions it uses directly."
            ) from None
        if planned is None:  # NNX objects in the arguments or outputs: as nnx.jit runs it
            return nnx_graph.call(self, args, kwargs)
        return submission.submit(*planned)

    def _planned(self, args: tuple, kwargs: dict) -> tuple[Any, list[Any]] | None:
        """The call's plan and argument leaves, or None where NNX objects route it to ``nnx_graph``."""
        flat = None
        fast = self._last_leaves
        if fast is not None and not self._static and not (kwargs and self._static_names):
            # Leaves of the same types as the call before (a train loop's): skip the signature.
            flat = jax.tree_util.tree_flatten((args, kwargs))
            plan = self._repeated(fast, flat)
            if plan is not None:
                return plan, flat[0]
        try:
            key, inputs = self._split(args, kwargs, flat)
        except nnx_graph.GraphArgument:
            return None
        except errors.ProgramTraceError:
            if not nnx_graph.routes(self, (args, kwargs)):
                raise
            return None  # nnx_graph names the NNX state at fault
        if key in self._routed:  # NNX objects that are pytrees: run as nnx.jit does
            return None
        plan = self._plans.get(key)
        if plan is None:
            plan = self._array_plan(key, inputs)
        if plan is None or not plan.is_current():
            if nnx_graph.routes(self, (args, kwargs)):
                self._routed.add(key)
                return None
            try:
                plan = self._plan_for(key, inputs, args, kwargs)
            except nnx_graph.GraphOutput:  # it returns NNX objects: as nnx.jit runs it
                self._routed.add(key)
                return None
        self._remember(key, inputs, args, kwargs, plan)
        return plan, inputs.leaves

    def _remember(self, key: tuple, inputs: TraceInputs, args: tuple, kwargs: dict, plan: Any) -> None:
        """Keeps what lets the next call with the same types skip signing: its futures' signatures, or its leaf types."""
        futures_only = not kwargs and not self._static and all(type(a) is Future for a in args)
        if futures_only and all(a._entry.signature is not None for a in args):
            self._last = _LastCall(tuple(a._entry.signature for a in args), inputs.ambient, plan, key[-1])
        elif not self._static and not (kwargs and self._static_names):
            marks = _marks(inputs.leaves)
            if marks is not None:
                self._last_leaves = _LastLeaves(inputs.treedef, marks, inputs.ambient, plan, key[-1])

    def _repeated(self, fast: _LastLeaves, flat: tuple[list[Any], Any]) -> Any:
        """``fast``'s plan if the flattened call ``flat`` has its leaf types, treedef and context; else None."""
        leaves, treedef = flat
        plan = fast.plan
        if (
            _same_types(leaves, fast.marks)
            and treedef == fast.treedef
            and (self._devices is not None or slices.current_slice() is fast.ambient)
            and plan.is_current()
            and _trace_context() == fast.config
        ):
            return plan
        return None

    def repeat_plan(self, args: tuple, kwargs: dict) -> tuple[Any, list[Any]] | None:
        """The plan and leaves of a call that repeats the one before (see :class:`_LastLeaves`), else None.

        For ``nnx_graph``, which submits the plan itself and reads its outputs
        as arrays without making futures. None wherever ``__call__`` would not
        take its repeat-call path: inside a trace, a transformation, the
        runtime's own work or ``jax.disable_jit``, with static arguments, or
        leaves of other types (the caller then calls the program as usual).
        """
        fast = self._last_leaves
        if (
            fast is None
            or self._static
            or (kwargs and self._static_names)
            or context.state.trace is not None
            or reentry.inside.depth
            or context.exiting
            or (self._under_transforms and inside_jax_trace())
            or jax.config.jax_disable_jit  # type: ignore[attr-defined]
        ):
            return None
        flat = jax.tree_util.tree_flatten((args, kwargs))
        plan = self._repeated(fast, flat)
        return None if plan is None else (plan, flat[0])

    def _array_plan(self, key: tuple, inputs: TraceInputs) -> Any:
        """The plan of the call with each future's array in its place, if there is one that takes futures.

        A train loop calls a program first with arrays, then with the futures
        the call returned: of the same types as those arrays, on the same
        devices. As ``jax.jit`` runs the second call with the plan of the
        first, so does a program: the futures are read where the plan reads
        the arrays, when the run is dispatched (see ``submission.submit``),
        and the plan is kept for the futures' signature too. None (trace the
        futures' signature) when no such plan exists, or when the plan cannot
        take a future where it takes an array: it donates arguments, returns
        one as it is, runs on remote hosts, or runs under a memory budget
        (whose accounts know futures from arrays).
        """
        signature = key[1]
        if not any(type(k) is FutureKey for k in signature):
            return None
        arrays = tuple(_as_array_key(k) if type(k) is FutureKey else k for k in signature)
        if None in arrays:
            return None
        plan = self._plans.get((key[0], arrays, *key[2:]))
        if plan is None or plan.donated_args or plan.shipped_feeds:
            return None
        if plan.special_outputs or (plan.cluster is not None and plan.cluster.store.budget is not None):
            return None
        with self._lock:
            self._plans.setdefault(key, plan)
        return plan

    def _plan_for(self, key: Any, inputs: TraceInputs, args: tuple, kwargs: dict) -> Any:
        """The plan of this signature: traced (once) and lowered (once per mapping)."""

        graph = self._graph_for(key, inputs)
        donated = self._donated_leaves(args, kwargs)
        with self._lock:  # one lowering per signature; lowering runs no user code
            plan = self._plans.get(key)
            if plan is None or not plan.is_current():
                plan = self._lowered(lowering.lower, graph, inputs.signature, donated)
                self._plans[key] = plan
        return plan

    def _as_jax_jit(self) -> Any:
        """The function under ``jax.jit`` with this program's options (built once)."""
        jitted = self._jitted
        if jitted is None:
            jitted = self._jitted = jax.jit(
                self._fun,
                static_argnums=self._static,
                static_argnames=self._static_names,
                donate_argnums=self._donate,
            )
        return jitted

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """As ``jax.jit(fun).lower(...)``, and compiles this program's plan for these arguments.

        Returns JAX's ``Lowered`` of the whole function as ``jax.jit`` would
        compile it (one executable): ``.as_text()``, ``.compile()`` and its
        ``cost_analysis()`` / ``memory_analysis()`` work as for ``jax.jit``.
        The program's own plan for these arguments (its graph and executables)
        is prepared too, so a later call with them compiles nothing (warm-up);
        ``graph(*args)`` shows that plan's nodes.
        """
        self._prepare(args, kwargs)
        return self._as_jax_jit().lower(*args, **kwargs)

    def clear_cache(self) -> None:
        """As ``jax.jit(fun).clear_cache()``: the next call traces and lowers again.

        Executables identical computations share stay in the cluster's cache
        (``jax.clear_caches()`` clears JAX's own).
        """
        with self._lock:
            self._graphs.clear()
            self._plans.clear()
            self._routed.clear()
            self._last = None
            self._last_leaves = None
            jitted = self._jitted
        if jitted is not None:
            jitted.clear_cache()

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """As ``jax.jit(fun).trace(...)``: JAX's ``Traced`` of the function (``.jaxpr``, ``.lower()``)."""
        return self._as_jax_jit().trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """As ``jax.jit(fun).eval_shape(...)``: the outputs' shapes and dtypes, computing nothing."""
        return self._as_jax_jit().eval_shape(*args, **kwargs)

    def _prepare(self, args: tuple, kwargs: dict) -> None:
        """Traces and lowers the plan a call with these arguments would run (nothing runs).

        Abstract arguments (``jax.ShapeDtypeStruct``, as the AOT guide lowers
        with) make no plan: a call takes arrays.
        """
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
            return
        try:
            key, inputs = self._split(args, kwargs)
        except (TracerArgument, nnx_graph.GraphArgument):
            return  # under a transformation, or NNX objects: prepared by their first call
        if nnx_graph.routes(self, (args, kwargs)) or key in self._routed:
            return
        plan = self._plans.get(key)
        if plan is None or not plan.is_current():
            try:
                self._plan_for(key, inputs, args, kwargs)
            except nnx_graph.GraphOutput:  # NNX objects returned: prepared by the first call
                self._routed.add(key)

    def inner_program(self, inner_fun: Callable[..., Any]) -> Program:
        """A program with this one's options over ``inner_fun``, taking NNX pytrees as plain pytrees.

        ``nnx_graph`` runs NNX objects through it as ``nnx.jit`` does.
        """
        inner = Program(
            inner_fun,
            devices=self._devices,
            static_argnums=self._static,
            static_argnames=self._static_names,
            name=self.name,
            fuse=self._fuse,
            donate_argnums=self._donate,
            donate_argnames=self._donate_names,
        )
        inner.source_info = self.source_info
        inner._nnx_inner = True
        return inner

    def _repr_html_(self) -> str:
        from pathways_jax._src.views import notebook

        return notebook.program_html(self)

    def __repr__(self) -> str:
        return f"pw.program({self.name}, {self.source_info})"


@overload
def program(
    fun: Callable[..., Any],
    *,
    devices: VirtualSlice | None = None,
    static_argnums: int | Sequence[int] | None = (),
    static_argnames: str | Sequence[str] | None = (),
    name: str | None = None,
    fuse: bool = True,
    donate_argnums: int | Sequence[int] | None = (),
    donate_argnames: str | Sequence[str] | None = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    device: jax.Device | None = None,
    backend: str | None = None,
) -> Program: ...


@overload
def program(
    fun: None = None,
    *,
    devices: VirtualSlice | None = None,
    static_argnums: int | Sequence[int] | None = (),
    static_argnames: str | Sequence[str] | None = (),
    name: str | None = None,
    fuse: bool = True,
    donate_argnums: int | Sequence[int] | None = (),
    donate_argnames: str | Sequence[str] | None = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    device: jax.Device | None = None,
    backend: str | None = None,
) -> Callable[[Callable[..., Any]], Program]: ...


def program(
    fun: Callable[..., Any] | None = None,
    *,
    devices: VirtualSlice | None = None,
    static_argnums: int | Sequence[int] | None = (),
    static_argnames: str | Sequence[str] | None = (),
    name: str | None = None,
    fuse: bool = True,
    donate_argnums: int | Sequence[int] | None = (),
    donate_argnames: str | Sequence[str] | None = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    device: jax.Device | None = None,
    backend: str | None = None,
) -> Program | Callable[[Callable[..., Any]], Program]:
    """Turns a function into ONE dataflow program over virtual slices.

    Usable bare (``@pw.program``) or with options (``@pw.program(devices=s)``).
    Every ``pw.jit`` function called inside becomes one node; plain
    ``jax.jit`` functions become nodes on the enclosing ``with slice:`` (or the
    program's ``devices``); operations between them are grouped into small
    nodes placed with their inputs; values crossing slices get transfers
    (``"ici"`` within an island, ``"dcn"`` across islands).

    Args:
      fun: the function to trace.
      devices: the default slice for code not placed otherwise.
      static_argnums: positional arguments that are Python values, not arrays.
      static_argnames: arguments, by name, that are Python values, as in
        ``jax.jit``: static whether passed by keyword or by position (each of
        ``static_argnums`` and ``static_argnames`` completes the other).
      name: the program's name in graphs and errors (default: ``fun.__name__``).
      fuse: compile each chain of consecutive nodes on one slice into a single
        executable (fewer dispatches; identical results), split where another
        slice reads a value. On by default; ``fuse=False`` keeps one node per
        jitted function (``graph()`` then shows each of them).
      donate_argnums: positional arguments whose buffers the program may reuse
        for its outputs, as in ``jax.jit``: a donated ``jax.Array`` is deleted
        and a donated :class:`Future` cannot be read again once the run is
        dispatched. An argument read by more than one computation of the
        program is kept (with a warning, once).
      donate_argnames: the same, by parameter name.
      in_shardings: as in ``jax.jit``: the function is compiled with these
        argument shardings (a pytree prefix of the positional arguments), and
        a program with no slice runs on their mesh.
      out_shardings: as in ``jax.jit``, for the outputs.
      keep_unused: accepted as ``jax.jit`` accepts it; unused arguments are
        never transferred or read, kept or not.
      inline: accepted as ``jax.jit`` accepts it (an inlining hint for an
        enclosing trace); no effect on a program's results.
      compiler_options: XLA options every node of the program is compiled
        with, as in ``jax.jit`` (local backend; Ray hosts compile with theirs).
      device: as ``jax.jit``'s (deprecated there): a program with no slice runs
        on this device.
      backend: as ``jax.jit``'s (deprecated there): a program with no slice
        runs on the first device of this platform (``"cpu"``).

    Returns:
      A :class:`Program`; calling it returns a pytree of :class:`Future`.

    Example:
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> @pw.program(devices=s)
      ... def step(v):
      ...     return v * 2 + 1
      >>> step(jnp.arange(3.0)).result().tolist()
      [1.0, 3.0, 5.0]
      >>> s.release()
    """
    if fun is None:
        return functools.partial(
            program,
            devices=devices,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            name=name,
            fuse=fuse,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            keep_unused=keep_unused,
            inline=inline,
            compiler_options=compiler_options,
            device=device,
            backend=backend,
        )
    if not callable(fun):
        raise errors.ProgramTraceError(f"pw.program expects a function, got {type(fun).__name__}: {fun!r}.")
    if devices is not None and not isinstance(devices, VirtualSlice):
        raise errors.PlacementError(
            f"pw.program(devices=...) expects a slice from pw.devices(...), got {devices!r}."
        )
    statics, static_names = with_jits_statics(fun, argnums(fun, static_argnums), argnames(static_argnames))
    donate = argnums(fun, donate_argnums, "donate_argnums")
    donate_names = argnames(donate_argnames, "donate_argnames")
    _check_argnums_as_jax_jit(fun, static_argnums, static_argnames, donate_argnums, donate_argnames)
    donate = tuple(sorted({*donate, *_positions_of(fun, donate_names)}))
    del keep_unused, inline  # hints with no effect on a program's results (see Args)
    if device is None and backend is not None:
        try:
            device = jax.devices(backend)[0]
        except RuntimeError as exc:
            raise errors.PlacementError(
                f"pw.program(backend={backend!r}): this process has no such platform ({exc}); "
                f"its devices are {jax.devices()[0].platform}."
            ) from exc
    if device is None and (in_shardings is not None or out_shardings is not None):
        # As jax.jit: shardings on one device (SingleDeviceSharding) run the function there.
        device = _single_device_of(in_shardings, out_shardings)
    if device is not None and not isinstance(device, jax.Device):
        raise errors.PlacementError(f"pw.program(device=...) expects a jax.Device, got {device!r}.")
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise errors.ProgramTraceError(
            f"pw.program(compiler_options=...) expects a dict of XLA options, got {compiler_options!r}."
        )
    mesh_hint = None
    if in_shardings is not None or out_shardings is not None:
        # As jax.jit: the function is compiled with these shardings (one node),
        # and a program with no slice runs on their mesh.
        mesh_hint = _mesh_of(in_shardings, out_shardings)
        fun = jit_with_shardings(
            fun,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            static_argnums=statics,
            static_argnames=static_names,
        )
    if set(donate) & set(statics):
        raise errors.ProgramTraceError(
            f"pw.program({getattr(fun, '__name__', fun)!r}): arguments {sorted(set(donate) & set(statics))} "
            "are both static and donated; a static argument is a Python value with no buffer to donate."
        )
    return Program(
        fun,
        devices=devices,
        static_argnums=statics,
        static_argnames=static_names,
        name=name,
        fuse=fuse,
        donate_argnums=donate,
        donate_argnames=donate_names,
        mesh_hint=mesh_hint,
        device=device,
        compiler_options=tuple(sorted((compiler_options or {}).items())),
    )
