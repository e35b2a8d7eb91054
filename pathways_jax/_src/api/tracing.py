"""``pw.Program``: a function's graphs and plans, cached by call signature, and its calls.

A :class:`Program` keeps, per call signature, the traced graph
(``function_trace``) and its lowered plan (a ``runtime.runnable.Runnable``:
the plan with the cluster and slices it runs on), and submits each call's run;
``program_info`` makes a call's key and ``repeat_calls`` lets a repeated
call skip it. ``decorator`` (``pw.program``) makes programs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
from collections.abc import Callable
from typing import Any

import jax
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from pathways_jax._src.api import (
    arguments,
    closed_refs,
    function_trace,
    hijax_arguments,
    jit_shardings,
    nnx_graph,
    pickling,
    ref_arguments,
)
from pathways_jax._src.api.arguments import (
    AbstractArray,
    TraceInputs,
    TracerArgument,
    _abstract,
    _as_array_keys,
    note_array_keys,
)
from pathways_jax._src.api.graph_view import GraphView
from pathways_jax._src.api.jit_options import name_of, refuse_traced_statics
from pathways_jax._src.api.placement import _mesh_mismatch_hint
from pathways_jax._src.api.program_info import ProgramInfo
from pathways_jax._src.api.repeat_calls import RepeatCalls
from pathways_jax._src.compat import jax_caches
from pathways_jax._src.compile import lowering
from pathways_jax._src.core import arrays, errors, reentry, source
from pathways_jax._src.core.gone import Gone
from pathways_jax._src.core.jax_context import inside_jax_trace
from pathways_jax._src.ir import fusion
from pathways_jax._src.ir.signatures import ArgKey, ArrayKey, FutureKey, NumpyKey, ScalarKey, Signature
from pathways_jax._src.runtime import context, runnable, submission
from pathways_jax._src.runtime.runnable import Runnable
from pathways_jax._src.runtime.slices import (
    VirtualSlice,
    moved_onto,
    on_slice_mesh,
    put_for_jit,
    typed_for_caller,
)


def _uncommitted(key: ArgKey) -> bool:
    """Whether ``key`` is that of a value nothing placed: an uncommitted array or future, or a host value."""
    if type(key) in (ScalarKey, NumpyKey):
        return True
    return type(key) in (ArrayKey, FutureKey) and not key.committed  # type: ignore[union-attr]


def _traced_as(key: ArgKey) -> tuple | None:
    """What ``jax.jit``'s trace of a value nothing placed depends on: shape, dtype, weak type, device.

    A host value (a Python scalar, a numpy array) is put on JAX's default
    device at each call, uncommitted; None for a value something placed.
    """
    if not _uncommitted(key):
        return None
    host = type(key) in (ScalarKey, NumpyKey)
    devices = {arrays.default_device()} if host else key.sharding.device_set  # type: ignore[union-attr]
    aval = _abstract(key)
    return (tuple(aval.shape), aval.dtype, aval.weak_type, frozenset(devices))


def _traced_alike(old: ArgKey, new: ArgKey) -> bool:
    """Whether a trace made for an argument leaf of key ``old`` is the one ``jax.jit`` makes for ``new``.

    Equal keys are; so are those of values nothing placed (host values, put
    on JAX's default device at each call, uncommitted arrays and futures) of
    the same shape, dtype and weak type on the same device: ``jax.jit`` traces
    them alike (a train loop's first call with ``step=0``, its next ones with
    the arrays it returned), and they place nothing.
    """
    if old == new:
        return True
    alike = _traced_as(old)
    return alike is not None and alike == _traced_as(new)


_whole = threading.local()  # depth of the program lower/trace/eval_shape calls on this thread


def lowering_whole() -> bool:
    """True while a program's ``lower``, ``trace`` or ``eval_shape`` traces its whole function as one ``jax.jit``.

    Its ``pw.jit`` functions then keep their ``in_specs``/``out_specs`` (as
    sharding constraints) as its plan's nodes do, so the one executable shows
    what a call runs.
    """
    return getattr(_whole, "depth", 0) > 0


@contextlib.contextmanager
def _as_one_executable() -> Any:
    _whole.depth = getattr(_whole, "depth", 0) + 1
    try:
        yield
    finally:
        _whole.depth -= 1


# What note_array_keys noted of each plan's outputs, forgotten once the plan goes (its program
# dropped), or each redefinition of a cell's function left its outputs' keys in that table
# (about 1.2 MB a hundred redefinitions of a dozen outputs, until 65536 entries). Noted gone
# with no Python code run (core.gone); the next plan noted forgets what went.
_NOTED: Gone[tuple[Any, ...]] = Gone()
_FORGET_LOCK = threading.Lock()


def _note_array_keys(plan: Any, signature: tuple[ArgKey, ...]) -> None:
    """``note_array_keys`` of ``plan``'s outputs, forgotten once ``plan`` is garbage."""
    with _FORGET_LOCK:
        while _NOTED:
            arguments.forget_array_keys(_NOTED.popleft())
    note_array_keys(plan.signatures, signature)
    _NOTED.watch(plan, tuple(plan.signatures))


def _summary(exc: BaseException, most: int = 300) -> str:
    """``exc``'s first line, ``most`` characters at most, after its type's name unless it names it."""
    line = next((part for part in str(exc).splitlines() if part.strip()), "").strip()
    if not isinstance(exc, errors.PathwaysError):
        line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line if len(line) <= most else line[: most - 3] + "..."


class Program:
    """A function traced into ONE dataflow program over virtual slices.

    Made by ``pw.program`` (``decorator.program``). Calling it returns at once with a pytree of
    :class:`Future` (one per output leaf); the controller runs the program in
    the background.
    """

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
        source_info: str | None = None,
        nnx_inner: bool = False,
        nnx_modes: tuple[bool | None, bool | None] = (None, None),
        under_transforms: bool = True,
        keep_unused: bool = False,
        argnums_completed: bool = False,
    ):
        # See ProgramInfo for each option; nnx_inner and under_transforms are set by
        # nnx_graph's inner programs and pw.jit's own.
        self._made_with = {
            "devices": devices,
            "static_argnums": static_argnums,
            "name": name,
            "fuse": fuse,
            "donate_argnums": donate_argnums,
            "static_argnames": static_argnames,
            "mesh_hint": mesh_hint,
            "donate_argnames": donate_argnames,
            "device": device,
            "compiler_options": compiler_options,
            "source_info": source_info,
            "nnx_inner": nnx_inner,
            "nnx_modes": nnx_modes,
            "under_transforms": under_transforms,
            "keep_unused": keep_unused,
            "argnums_completed": argnums_completed,
        }
        self._info = info = ProgramInfo.of(
            fun,
            name=name if name else name_of(fun),
            source_info=source_info if source_info is not None else source.of_function(fun),
            devices=devices,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            argnums_completed=argnums_completed,
            fuse=fuse,
            mesh_hint=mesh_hint,
            device=device,
            compiler_options=compiler_options,
            nnx_inner=nnx_inner,
            nnx_modes=nnx_modes,
            under_transforms=under_transforms,
            keep_unused=keep_unused,
        )
        # Guards the caches of graphs and plans; never held while user code runs.
        self._lock = threading.RLock()
        self._graphs: dict[Any, GraphView] = {}
        # Traces of calls nothing placed, by abstract values: run on other devices, not traced again.
        self._jaxprs = function_trace.JaxprCache()
        self._plans: dict[Any, Runnable] = {}  # call key -> its plan, as the runtime runs it
        # Call keys whose arguments or outputs hold NNX objects (pytrees): run as nnx.jit runs them.
        self._routed: set[Any] = set()
        # Call keys whose function closes over jax.Refs, and those Refs (closed_refs.call_closed).
        self._closed_refs: dict[Any, tuple[Any, ...]] = {}
        self._repeats = RepeatCalls(info)
        # The one-line summary of the error the last trace raised (None: it did not fail).
        self._trace_failure: str | None = None
        self._jitted: Any = None
        self._aot_jitted: Any = None
        self._nnx_jitted: Any = None
        # Not fun.__dict__ (updated=()): a jax.jit object keeps its own _fun there.
        functools.update_wrapper(self, fun, updated=())
        jax_caches.PROGRAMS.add(self)  # jax.clear_caches() clears this program's caches too

    @property
    def name(self) -> str:
        """The program's name in graphs and errors."""
        return self._info.name

    @property
    def source_info(self) -> str:
        """Where the program's function is defined (``file.py:12 (fn)``)."""
        return self._info.source_info

    def _lowered(
        self, lower: Callable[..., Any], graph: GraphView, signature: Signature, donated: frozenset
    ) -> Runnable:
        """``lower(graph, ...)``, prepared by its backend (``runnable.lowered``); what JAX refuses only when compiling raises as a ``pw.errors`` type.

        JAX finds some errors only at lowering (a ``jvp`` of a ``custom_vjp``,
        devices that do not fit together), XLA some when compiling (an unknown
        ``compiler_options`` entry). Their class stays (see ``errors.also``): a
        ``ValueError`` is also a ``PlacementError``, anything else a ``ProgramTraceError``.
        """
        try:
            # The graph is plain data; where its slices are now is the placement's.
            return runnable.lowered(lower, graph.ir, signature, tuple(graph.held.values()), donated)
        except (errors.PathwaysError, Warning):  # a warning raised as an error stays itself
            raise
        except Exception as exc:  # also of the original's class (XLA's JaxRuntimeError: a bad option)
            kind = errors.PlacementError if isinstance(exc, ValueError) else errors.ProgramTraceError
            raise errors.like(
                kind,
                exc,
                f"compiling program {self.name!r} ({self.source_info}) for {source.of_caller()} failed: "
                f"{type(exc).__name__}: {exc}{_mesh_mismatch_hint(exc, None)}",
            ) from exc

    def _transformed(self, args: tuple, kwargs: dict) -> Any:
        """Called inside the caller's ``jax.jit``, ``grad`` or ``vmap``: the function runs as ``jax.jit``.

        A transformation traces through the function, so no controller run can
        take part: as where ``@jax.jit`` stood, the function is traced into the
        caller's computation (its ``pw.jit`` functions keep their slices' devices).
        A program with a default slice keeps it as a ``pw.jit`` function does:
        its arguments are put on the slice's devices and its code sees the
        slice's mesh (``shard_map(mesh=slice.mesh)``, bare specs in constraints).
        """
        positions = self._info.static_positions(len(args))
        statics: list[tuple[int | str, Any]] = [(i, args[i]) for i in positions if i < len(args)]
        statics += [(name, kwargs[name]) for name in self._info.static_names if name in kwargs]
        refuse_traced_statics(statics, f"program {self.name!r}", self.name, self.source_info)
        jitted = self._as_jit_for(args, kwargs)
        slice_ = self._info.devices
        if slice_ is None:
            return jitted(*args, **kwargs)
        replicated = NamedSharding(slice_.physical_mesh, PartitionSpec())
        # NNX objects are moved in place: nnx.jit then updates the caller's, not copies.
        put = nnx_graph.put_in_place if nnx_graph.has_graph_nodes((args, kwargs)) else put_for_jit
        args = tuple(arg if i in positions else put(arg, replicated) for i, arg in enumerate(args))
        kwargs = {k: v if k in self._info.static_names else put(v, replicated) for k, v in kwargs.items()}
        with slice_:  # outside a program's trace: the slice's mesh too (on_slice_mesh)
            out = jitted(*args, **kwargs)
        # NNX objects returned are the caller's own (nnx.jit updates them in place): left as they are.
        return out if nnx_graph.has_graph_nodes(out) else typed_for_caller(slice_, out)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """As ``jax.jit``: a program defined in a class body is a method, ``self`` its first argument."""
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __deepcopy__(self, memo: dict) -> Program:
        """The program itself, as ``copy.deepcopy`` keeps a function: an object holding it copies.

        A ``jax.jit`` function deep-copies into one that runs the function it
        was made with; a program is that already (its caches and lock are its
        own, not the caller's state).
        """
        return self

    def __reduce__(self) -> str | tuple[Any, ...]:
        """As a ``jax.jit`` function pickles (cloudpickle: Ray, joblib): its function and options.

        Made again where it is unpickled; a program defined at a module's top
        level pickles as a reference to its name. One placed on a slice raises
        ``PlacementError`` (also a ``TypeError``): see ``pickling``.
        """
        what = f"program {self.name!r} ({self.source_info})"
        made_with = (type(self), self._info.fun, self._made_with)
        return pickling.reduced(self, what, self._made_with["devices"], pickling.remade, made_with)

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
            key, inputs = self._info.split(args, kwargs)
        except (nnx_graph.GraphArgument, errors.ProgramTraceError) as exc:
            if ref_arguments.takes_refs(self, args, kwargs):
                return ref_arguments.graph(self, args, kwargs)
            if not self._info.nnx_inner and hijax_arguments.takes_hijax(args, kwargs):
                return hijax_arguments.graph(self, args, kwargs)
            if isinstance(exc, nnx_graph.GraphArgument):
                return nnx_graph.graph(self, args, kwargs)
            if not nnx_graph.routes(self, (args, kwargs)):
                raise
            return nnx_graph.graph(self, args, kwargs)  # names the NNX state at fault
        if nnx_graph.routes(self, (args, kwargs)) or key in self._routed:
            return nnx_graph.graph(self, args, kwargs)
        try:
            return self._graph_for(key, inputs)
        except nnx_graph.GraphOutput:
            return nnx_graph.graph(self, args, kwargs)
        except closed_refs.ClosedRefs as exc:  # jax.Refs it closes over: inputs of its graph
            return closed_refs.graph_closed(self, exc.refs, args, kwargs)

    def _graph_for(self, key: Any, inputs: TraceInputs) -> GraphView:
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._host_graph(key)
        # A graph on a slice that is gone is traced again: the slices a program
        # with no placement implied belonged to a cluster that was shut down, and
        # those the user named raise their own clear error when traced.
        if graph is not None and not any(s.released for s in graph.held.values()):
            return graph
        # Traced with no lock held: the trace runs the user's code, which may
        # call this program from a thread it then joins. Threads tracing one
        # signature at once each finish; the first graph stored is kept.
        try:
            traced = function_trace.trace(
                self._info, inputs, jaxprs=self._jaxprs, jaxpr_key=(key[0], *key[2:])
            )
        except closed_refs.ClosedRefs:
            raise  # traced: it runs with the Refs it closes over as inputs
        except Exception as exc:
            self._trace_failure = _summary(exc)  # what the program's view says of it
            raise
        self._trace_failure = None
        graph = self._compiled_as(traced, self._info.fuse)
        with self._lock:
            kept = self._graphs.get(key)
            if kept is None or any(s.released for s in kept.held.values()):
                kept = self._graphs[key] = graph
            return kept

    def _host_graph(self, key: tuple) -> GraphView | None:
        """The graph traced for host values (Python scalars, numpy arrays) where ``key`` has uncommitted values of their types.

        A train loop's first call often takes host values (``TrainState.create``'s
        ``step=0``, parameters read from a file) and the next the futures it
        returned, which stand for uncommitted arrays of the same types. ``jax.jit``
        traces the two calls once (its trace is keyed by abstract values): so does
        a program, which lowers the graph of the first for the second's signature
        instead of running the function again (whose Python state may have changed
        since, as ``jax.jit`` would not see either).
        """
        signature = key[1]
        if not any(_uncommitted(k) for k in signature):
            return None
        with self._lock:
            kept = list(self._graphs.items())
        for other, graph in kept:
            if other[0] != key[0] or other[2:] != key[2:] or len(other[1]) != len(signature):
                continue
            if any(s.released for s in graph.held.values()):
                continue
            if all(_traced_alike(old, new) for old, new in zip(other[1], signature, strict=True)):
                return graph
        return None

    def _compiled_as(self, traced: GraphView, fuse: bool) -> GraphView:
        """``traced`` as it compiles: its chains fused if ``fuse``, with the program's compiler options."""
        ir = fusion.fuse(traced.ir) if fuse else traced.ir
        if self._info.compiler_options:
            ir = dataclasses.replace(ir, compiler_options=self._info.compiler_options)
        return GraphView(ir, traced.held) if ir is not traced.ir else traced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if context.state.trace is not None or reentry.inside.depth or context.exiting:
            return self._call_within(args, kwargs)
        if self._info.under_transforms and inside_jax_trace():
            # Traced by JAX (checkify, make_jaxpr) with concrete arguments: as jax.jit, traced in.
            return self._transformed(args, kwargs)
        repeat = self._repeats.by_futures(args) if not kwargs else None
        if repeat is not None:
            return submission.submit(repeat, list(args))
        if jax.config.jax_disable_jit:  # type: ignore[attr-defined]
            # As jax.jit under jax.disable_jit(): op by op, in the caller.
            out = self._info.fun(*args, **kwargs)
            return submission.computed(out, f"program {self.name!r} run op by op", nnx_graph.is_graph_leaf)
        return self._call_planned(args, kwargs)

    def _call_within(self, args: tuple, kwargs: dict) -> Any:
        """A call made inside another program's trace, the runtime's own work, or an exit hook."""
        if context.state.trace is not None:
            # Called while another program is traced: its nodes join that program.
            if self._info.devices is None:
                return self._info.fun(*args, **kwargs)
            with self._info.devices:
                return self._info.fun(*args, **kwargs)
        # Called by Python code run inside the controller's own work (a garbage-collector
        # finalizer, a signal handler, a host callback), or by an exit hook that runs
        # after pathways_jax's: as jax.jit, in place (a daemon thread is held first).
        if context.exiting and not reentry.inside.depth:
            context.park_at_exit()
        out = self._as_jit_for(args, kwargs)(*args, **kwargs)
        how = "at exit" if context.exiting else "in place"
        return submission.computed(out, f"program {self.name!r} run {how}", nnx_graph.is_graph_leaf)

    def _call_planned(self, args: tuple, kwargs: dict) -> Any:
        """The call submitted with its plan (traced and lowered if new), or run as ``nnx.jit`` would."""
        # Leaves of the same types as the call before (a train loop's): skip the signature. First:
        # a call whose treedef and leaf types repeat one that took no NNX object takes none either.
        plan, flat = self._repeats.by_leaves(args, kwargs)
        if plan is not None and flat is not None:
            return submission.submit(plan, flat[0])
        if nnx_graph.takes_objects(self, args, kwargs):  # a model, an optimizer: as nnx.jit runs it
            if hijax_arguments.given_hijax(args, kwargs):  # Flax's hijax mode: as jax.jit runs it
                return hijax_arguments.call(self, args, kwargs)
            if ref_arguments.given_refs(args, kwargs) and ref_arguments.takes_refs(self, args, kwargs):
                return ref_arguments.call(self, args, kwargs)  # Flax took a jax.Ref for an NNX object
            return nnx_graph.call(self, args, kwargs)
        try:
            planned = self._planned(args, kwargs, flat)
        except ref_arguments.RefArguments:  # jax.Ref leaves: written in place, as jax.jit writes them
            return ref_arguments.call(self, args, kwargs)
        except closed_refs.ClosedRefs as exc:  # jax.Refs it closes over: read and written as jax.jit does
            return closed_refs.call_closed(self, exc.refs, args, kwargs)
        except hijax_arguments.HijaxArguments:  # Flax's hijax Variables: updated as jax.jit updates them
            return hijax_arguments.call(self, args, kwargs)
        except TracerArgument as exc:
            if self._info.under_transforms:
                return self._transformed(args, kwargs)
            raise errors.ProgramTraceError(
                f"program {self.name!r} ({self.source_info}) was called with a JAX tracer as "
                f"argument leaf {exc.args[0]}: a program cannot run inside jax.jit, vmap or "
                "grad. Call it from Python, or call the jitted functions it uses directly."
            ) from None
        if planned is None:  # NNX objects in the arguments or outputs: as nnx.jit runs it
            return nnx_graph.call(self, args, kwargs)
        return submission.submit(*planned)

    def _planned(
        self, args: tuple, kwargs: dict, flat: tuple[list[Any], Any] | None
    ) -> tuple[Runnable, list[Any]] | None:
        """The call's plan and argument leaves, or None where NNX objects route it to ``nnx_graph``.

        ``flat``: the call flattened by ``RepeatCalls.by_leaves`` (which found no repeat), or None.
        """
        try:
            key, inputs = self._info.split(args, kwargs, flat)
        except (nnx_graph.GraphArgument, errors.ProgramTraceError) as exc:
            # Signing refuses a jax.Ref (Flax imported, it takes one for an NNX graph node).
            if ref_arguments.takes_refs(self, args, kwargs):
                raise ref_arguments.RefArguments from None
            if not self._info.nnx_inner and hijax_arguments.takes_hijax(args, kwargs):
                raise hijax_arguments.HijaxArguments from None
            if isinstance(exc, nnx_graph.GraphArgument):
                return None
            if not nnx_graph.routes(self, (args, kwargs)):
                raise
            return None  # nnx_graph names the NNX state at fault
        if key in self._routed:  # NNX objects that are pytrees: run as nnx.jit does
            return None
        closed = self._closed_refs.get(key)
        if closed is not None:  # traced before: it closes over jax.Refs (not traced again)
            raise closed_refs.ClosedRefs(closed)
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
            except closed_refs.ClosedRefs as exc:
                with self._lock:
                    self._closed_refs[key] = exc.refs
                raise
        self._repeats.remember(key, inputs, args, kwargs, plan)
        return plan, inputs.leaves

    def repeat_plan(self, args: tuple, kwargs: dict) -> tuple[Runnable, list[Any]] | None:
        """The plan and leaves of a call that repeats the one before (see ``repeat_calls.LastLeaves``), else None.

        For ``nnx_graph``, which submits the plan itself and reads its outputs
        as arrays without making futures. None wherever ``__call__`` would not
        take its repeat-call path: inside a trace, a transformation, the
        runtime's own work or ``jax.disable_jit``, with static arguments, or
        leaves of other types (the caller then calls the program as usual).
        """
        if (
            context.state.trace is not None
            or reentry.inside.depth
            or context.exiting
            or (self._info.under_transforms and inside_jax_trace())
            or jax.config.jax_disable_jit  # type: ignore[attr-defined]
        ):
            return None
        plan, flat = self._repeats.by_leaves(args, kwargs)
        return None if plan is None or flat is None else (plan, flat[0])

    def _array_plan(self, key: tuple, inputs: TraceInputs) -> Runnable | None:
        """The plan of the call with each future's array in its place, if there is one that takes futures.

        A train loop calls a program first with arrays, then with the futures
        the call returned: of the same types as those arrays, on the same
        devices. As ``jax.jit`` runs the second call with the plan of the
        first, so does a program: the futures are read where the plan reads
        the arrays, when the run is dispatched (see ``submission.submit``),
        and the plan is kept for the futures' signature too. None (trace the
        futures' signature) when no such plan exists, or when the plan cannot
        take a future where it takes an array: it runs on remote hosts, or
        under a memory budget (whose accounts know futures from arrays). A
        donated future is spent as a donated array is deleted (the plan's
        ``consumed_feeds`` name the array feeds consumed); the outputs a
        submission makes itself (literals, host arguments returned as they
        are) read no array argument.
        """
        signature = key[1]
        if not any(type(k) is FutureKey for k in signature):
            return None
        arrays = _as_array_keys(signature)
        if arrays is None:
            return None
        kept = self._plans.get((key[0], arrays, *key[2:]))
        if kept is None:
            return None
        plan = kept.plan
        if plan.shipped_feeds:
            return None
        if plan.placement.limits is not None:  # under a memory budget
            return None
        with self._lock:
            self._plans.setdefault(key, kept)
        return kept

    def _plan_for(self, key: Any, inputs: TraceInputs, args: tuple, kwargs: dict) -> Runnable:
        """The plan of this signature: traced (once) and lowered (once per mapping)."""

        graph = self._graph_for(key, inputs)
        donated = self._info.donated_leaves(args, kwargs)
        try:
            with self._lock:  # one lowering per signature; lowering runs no user code
                plan = self._plans.get(key)
                if plan is None or not plan.is_current():
                    plan = self._lowered(lowering.lower, graph, inputs.signature, donated)
                    self._plans[key] = plan
                    _note_array_keys(plan.plan, key[1])
            return plan
        except errors.ProgramTraceError as exc:
            if not self._info.fuse or not isinstance(exc.__cause__, jax.errors.JaxRuntimeError):
                raise
            # XLA failed to compile the fused executable (its SPMD partitioner refuses some
            # resharding chains jax.jit refuses too): the nodes compiled apart, as traced, may
            # compile. Traced again with no lock held (the trace runs the user's code).
            traced = function_trace.trace(self._info, inputs)
            if fusion.fuse(traced.ir) is traced.ir:
                raise  # nothing was fused: the node itself does not compile
            traced = self._compiled_as(traced, fuse=False)
            with self._lock:
                plan = self._lowered(lowering.lower, traced, inputs.signature, donated)
                self._plans[key] = plan
                self._graphs[key] = traced  # what program.graph() shows for it, and lowers again
            logging.warning(
                "pathways_jax: program %r (%s): XLA could not compile its nodes fused into one "
                "executable (%s); they run as the separate executables traced, as with fuse=False.",
                self.name,
                self.source_info,
                str(exc.__cause__).splitlines()[0],
            )
            return plan

    def _as_jax_jit(self) -> Any:
        """The function under ``jax.jit`` with this program's options (built once)."""
        jitted = self._jitted
        if jitted is None:
            jitted = self._jitted = jax.jit(
                self._info.fun,
                static_argnums=self._info.static,
                static_argnames=self._info.static_names,
                donate_argnums=self._info.donate,
            )
        return jitted

    def _ahead_of_time(self) -> Any:
        """The function as ``lower``, ``trace`` and ``eval_shape`` give it: under ``jax.jit`` with every
        option a call compiles with (``keep_unused``, ``compiler_options``), as ``jax.jit`` given them."""
        jitted = self._aot_jitted
        if jitted is None and self._given_jit() is not None:
            jitted = self._aot_jitted = self._given_jit()
        if jitted is None:
            info = self._info
            jitted = self._aot_jitted = jit_shardings.ahead_of_time(
                info.fun,
                static_argnums=info.static,
                static_argnames=info.static_names,
                donate_argnums=info.donate,
                keep_unused=info.keep_unused,
                compiler_options=dict(info.compiler_options) or None,
            )
        return jitted

    def _given_jit(self) -> Any:
        """The ``jax.jit`` function the program was made of, where the program adds no option to its own; else None.

        ``pw.program(jax.jit(step, static_argnames="train"))`` (or ``in_shardings=``)
        then lowers as that ``jax.jit`` function does, not as one ``jax.jit`` inside
        another (whose inputs' shardings would be the outer one's, not the given ones).
        """
        info = self._info
        given = jit_shardings.lowered_jit(info.fun)
        jit_info = getattr(given, "_jit_info", None)  # jax.jit's own record of its options (private)
        if jit_info is None:
            return None
        own = (
            set(info.donate) <= set(getattr(jit_info, "donate_argnums", ()) or ())
            and info.keep_unused == bool(getattr(jit_info, "keep_unused", False))
            and dict(info.compiler_options) == dict(getattr(jit_info, "compiler_options_kvs", ()) or ())
        )
        return given if own else None

    def _as_jit_for(self, args: tuple, kwargs: dict) -> Any:
        """The function as ``jax.jit`` runs it, or as ``nnx.jit`` does where the arguments hold NNX objects.

        As where ``@nnx.jit`` stood: a model or optimizer passed in (inside the
        caller's ``nnx.jit`` or ``nnx.grad``) is updated in place. Under
        ``jax.jit`` it would be flattened as a pytree, and its updates lost.
        """
        if self._info.nnx_inner or not nnx_graph.has_graph_nodes((args, kwargs)):
            return self._as_jax_jit()
        if hijax_arguments.given_hijax(args, kwargs):  # Flax's hijax mode: jax.jit takes its Variables
            return self._as_jax_jit()
        jitted = self._nnx_jitted
        if jitted is None:
            from flax import nnx

            graph, updates = self._info.nnx_modes  # nnx.jit's own (None: Flax's setting at the call)
            jitted = self._nnx_jitted = nnx.jit(
                self._info.fun,
                static_argnums=self._info.static,
                static_argnames=self._info.static_names,
                donate_argnums=self._info.donate,
                graph=graph,
                graph_updates=updates,
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

        Raises:
          PlacementError: the program runs on slices of different devices, or
            of the same devices in different orders: no one executable spans
            them (its plan is prepared all the same).
        """
        self._prepare(args, kwargs)
        with self._slice_mesh(), _as_one_executable():
            try:
                return self._ahead_of_time().lower(*self._moved(args), **self._moved_kwargs(kwargs))
            except ValueError as exc:
                if "incompatible devices" not in str(exc) or not self._on_several_orders(args, kwargs):
                    raise
                raise errors.PlacementError(
                    f"program {self.name!r} ({self.source_info}): lower() gives the whole function as one "
                    "jax.jit executable, but its computations run on slices of different devices (or of "
                    f"the same devices in different orders), which no one executable spans: "
                    f"{str(exc).splitlines()[0]} Its own plan for these arguments is prepared (a call "
                    "with them compiles nothing more); graph(*args) shows its nodes, and each pw.jit "
                    "function's lower(...) gives its own executable."
                ) from exc

    def _moved(self, args: tuple) -> tuple:
        """The positional arguments as a call puts them on the default slice (see ``slices.moved_onto``)."""
        slice_ = self._info.devices
        if slice_ is None or nnx_graph.has_graph_nodes(args):
            return args
        static = self._info.static_positions(len(args))
        return tuple(arg if i in static else moved_onto(slice_, arg) for i, arg in enumerate(args))

    def _moved_kwargs(self, kwargs: dict) -> dict:
        """The keyword arguments as a call puts them on the default slice."""
        slice_ = self._info.devices
        if slice_ is None or not kwargs or nnx_graph.has_graph_nodes(kwargs):
            return kwargs
        names = self._info.static_names
        return {k: v if k in names else moved_onto(slice_, v) for k, v in kwargs.items()}

    def _on_several_orders(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call's graph runs on slices of different devices or device orders."""
        try:
            nodes = self.graph(*args, **kwargs).nodes
        except Exception:  # not known: the caller's error stands as it is
            return False
        return len({tuple(d.id for d in node.slice.devices) for node in nodes}) > 1

    def _slice_mesh(self) -> contextlib.AbstractContextManager[Any]:
        """The program's default slice's mesh, where ``lower``, ``trace`` and ``eval_shape`` run its
        function as ``jax.jit`` (as under ``jax.set_mesh(slice.physical_mesh)``); without one, its
        ``device=`` as the default device (where a call puts its arguments), else nothing."""
        slice_ = self._info.devices
        if slice_ is not None:
            return on_slice_mesh(slice_)
        if self._info.device is not None:
            return jax.default_device(self._info.device)
        return contextlib.nullcontext()

    def clear_cache(self) -> None:
        """As ``jax.jit(fun).clear_cache()``: the next call traces and lowers again.

        Executables identical computations share stay in the cluster's cache
        (``jax.clear_caches()`` clears them, every program's caches and JAX's own).
        """
        with self._lock:
            self._graphs.clear()
            self._jaxprs.clear()
            self._plans.clear()
            self._routed.clear()
            self._closed_refs.clear()
            self._repeats.clear()
            self._nnx_jitted = None
            jitted = self._jitted
            aot = self._aot_jitted
            # Calls given NNX objects run through inner programs (nnx_graph), made anew at the next.
            nnx_calls = self.__dict__.pop("_nnx_calls", {})
        for cached in (jitted, aot):
            if cached is not None:
                cached.clear_cache()
        for call in nnx_calls.values():
            call.inner.clear_cache()

    def _cache_size(self) -> int:
        """As ``jax.jit(fun)._cache_size()``: how many call signatures the program traced and keeps.

        Test suites check with it that a loop does not trace again. A call
        whose values nothing placed takes the graph of one alike (a loop fed
        its own futures after arrays), as it takes ``jax.jit``'s executable;
        calls given NNX objects count their trace too. ``clear_cache()``
        empties it.
        """
        with self._lock:
            graphs = len({id(graph) for graph in self._graphs.values()})
            inner = [call.inner for call in self.__dict__.get("_nnx_calls", {}).values()]
        return graphs + sum(program._cache_size() for program in inner)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """As ``jax.jit(fun).trace(...)``: JAX's ``Traced`` of the function (``.jaxpr``, ``.lower()``)."""
        with self._slice_mesh(), _as_one_executable():
            return self._ahead_of_time().trace(*self._moved(args), **self._moved_kwargs(kwargs))

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """As ``jax.jit(fun).eval_shape(...)``: the outputs' shapes and dtypes, computing nothing."""
        with self._slice_mesh(), _as_one_executable():
            return self._ahead_of_time().eval_shape(*self._moved(args), **self._moved_kwargs(kwargs))

    def _prepare(self, args: tuple, kwargs: dict) -> None:
        """Traces and lowers the plan a call with these arguments would run (nothing runs).

        Abstract arguments (``jax.ShapeDtypeStruct``, as the AOT guide lowers
        with) prepare the plan of a call with ``jax.Array`` s of their shapes,
        dtypes and shardings, as ``jax.jit``'s ``lower(...).compile()`` warms its
        calls; one that no array stands for (a sharding with no devices) prepares none.
        """
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
            if nnx_graph.has_graph_nodes((args, kwargs)):
                return  # NNX objects: prepared by their first call
            stand_ins = [AbstractArray.of(v) if isinstance(v, jax.ShapeDtypeStruct) else v for v in leaves]
            if any(v is None for v in stand_ins):
                return
            args, kwargs = jax.tree_util.tree_unflatten(treedef, stand_ins)
        try:
            key, inputs = self._info.split(args, kwargs)
        except (TracerArgument, nnx_graph.GraphArgument, errors.ProgramTraceError) as exc:
            if ref_arguments.takes_refs(self, args, kwargs):
                return ref_arguments.prepare(self, args, kwargs)
            if not self._info.nnx_inner and hijax_arguments.takes_hijax(args, kwargs):
                return hijax_arguments.prepare(self, args, kwargs)
            if isinstance(exc, errors.ProgramTraceError):
                raise
            return  # under a transformation, or NNX objects: prepared by their first call
        if nnx_graph.routes(self, (args, kwargs)) or key in self._routed:
            return
        closed = self._closed_refs.get(key)
        if closed is not None:  # it closes over jax.Refs: the plan taking their values
            return closed_refs.prepare_closed(self, closed, args, kwargs)
        plan = self._plans.get(key)
        if plan is None or not plan.is_current():
            try:
                self._plan_for(key, inputs, args, kwargs)
            except nnx_graph.GraphOutput:  # NNX objects returned: prepared by the first call
                self._routed.add(key)
            except closed_refs.ClosedRefs as exc:
                with self._lock:
                    self._closed_refs[key] = exc.refs
                closed_refs.prepare_closed(self, exc.refs, args, kwargs)

    def inner_program(self, inner_fun: Callable[..., Any]) -> Program:
        """A program with this one's options over ``inner_fun``, taking NNX pytrees as plain pytrees.

        ``nnx_graph`` runs NNX objects through it as ``nnx.jit`` does.
        """
        info = self._info
        return Program(
            inner_fun,
            devices=info.devices,
            static_argnums=info.static,
            static_argnames=info.static_names,
            name=info.name,
            fuse=info.fuse,
            donate_argnums=info.donate,
            donate_argnames=info.donate_names,
            source_info=info.source_info,
            nnx_inner=True,
            argnums_completed=True,
        )

    def _repr_html_(self) -> str:
        from pathways_jax._src.views import notebook

        return notebook.program_html(self)

    def __repr__(self) -> str:
        return f"pw.program({self.name}, {self.source_info})"


__all__ = ["Program", "lowering_whole"]
