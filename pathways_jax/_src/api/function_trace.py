"""A program's function traced into a graph: JAX's jaxpr of it, its nodes placed on slices.

The function is traced with ``jax.make_jaxpr`` on its default slice (or the
slice its arguments, mesh or device imply, as ``jax.jit`` would place it);
``graph_builder`` turns the jaxpr into a :class:`~pathways_jax._src.ir.graph.Graph`.
Errors name the user's function and arguments, not the library's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.extend.core as jex
from jax.sharding import AxisType

from pathways_jax._src import compat
from pathways_jax._src.api import closed_refs, graph_builder, nnx_graph
from pathways_jax._src.api.arguments import TraceInputs, _abstract
from pathways_jax._src.api.graph_builder import DEFAULT_SCOPE, TraceState
from pathways_jax._src.api.graph_view import GraphView
from pathways_jax._src.api.placement import (
    _device_slice,
    _is_device_slice,
    _mesh_mismatch_hint,
    _mesh_slice,
    _named_mesh,
    _user_mesh,
)
from pathways_jax._src.api.program_info import ProgramInfo
from pathways_jax._src.core import counts, errors, events, source
from pathways_jax._src.core.jax_context import inside_jax_trace
from pathways_jax._src.core.meshes import only_mesh
from pathways_jax._src.ir.signatures import ArrayKey, FutureKey, Signature
from pathways_jax._src.runtime import context, slices
from pathways_jax._src.runtime.futures import Future
from pathways_jax._src.runtime.slices import NO_ABSTRACT_MESH, VirtualSlice

try:  # JAX's state discharge (private): the Refs a jaxpr makes, as the values they hold
    from jax._src.core import internal_mutable_array_effect as _INTERNAL_REFS
    from jax._src.state.discharge import discharge_state as _discharge_state
except ImportError:  # pragma: no cover - another JAX: a program's Refs stay as traced
    _INTERNAL_REFS = _discharge_state = None  # type: ignore[assignment]

try:  # JAX's lowering of "hijax" types (private): Flax's hijax Variables as the values they hold
    from jax._src.interpreters.partial_eval import lower_jaxpr2 as _lower_hijax
except ImportError:  # pragma: no cover - another JAX: a program's hijax values stay as traced
    _lower_hijax = None  # type: ignore[assignment]


def trace(
    info: ProgramInfo,
    inputs: TraceInputs,
    hint: jax.sharding.Mesh | None = None,
    placing: tuple[Any, ...] | None = None,
    jaxprs: JaxprCache | None = None,
    jaxpr_key: tuple = (),
) -> GraphView:
    """``info``'s function traced for a call's ``inputs`` into a graph, with the slices it names.

    Traced on the program's default slice, else the call's ambient one; with
    neither, where ``jax.jit`` would run it: the mesh of committed arguments or
    shardings (``hint``: a mesh the function names itself), else one device.
    ``placing``: the keys of the arguments that place it (None for an argument
    the function does not use, which ``jax.jit`` prunes); all of them if None.
    ``jaxprs``: the program's traces of calls nothing placed, by abstract values
    (see :class:`JaxprCache`), with ``jaxpr_key`` the rest of the call's key
    (its tree, static arguments and trace context).
    """
    compat.install_checkpoints()  # once: Flax's and orbax's checkpoints then take the futures it returns
    compat.install_flax()  # Flax then takes the futures of keys it returns, and writes into Variables holding futures
    treedef, statics, signature = inputs.treedef, inputs.statics, inputs.signature
    places = signature if placing is None else placing
    default = info.devices if info.devices is not None else inputs.ambient
    if default is not None:
        default.check_usable()
    state = TraceState(default)
    implied = None
    uncommitted = False
    if default is None and info.device is not None:  # jax.jit's device=
        implied = slices.implied((info.device.id,), {"x": 1})
        on_device: VirtualSlice = implied
        state.implied = lambda: on_device
    elif default is None:
        # Code nothing places runs where jax.jit would run it. Arguments on a
        # mesh of yours: the program is traced on that mesh, as jax.jit does.
        with contextlib.suppress(errors.ResourceError):  # reserved devices: placed later or an error
            implied = _mesh_slice(places, hint or info.mesh_hint or _user_mesh(), _owner(info))
        if implied is None:
            implied = _typed_future_slice(inputs, places)
        if implied is not None:
            on_mesh: VirtualSlice = implied
            state.implied = lambda: on_mesh
        else:
            state.implied = functools.cache(lambda: _committed_slice(inputs, places) or _device_slice(places))
            # Nothing committed placed it: as jax.jit's, its outputs there are uncommitted.
            uncommitted = not any(getattr(key, "committed", False) for key in places)
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
            out = info.fun(*full, **kwargs)
        if not info.nnx_inner and nnx_graph.has_graph_nodes(out):
            # New NNX objects (a model made inside): returned as nnx.jit returns them,
            # sharing between them kept, which flattening them as pytrees loses.
            raise nnx_graph.GraphOutput
        flat, tree = jax.tree_util.tree_flatten(out)
        out_trees.append(tree)
        return flat

    sink = events.SINK
    t0 = events.now() if sink is not None else 0
    # Nothing places the call (one-device arguments, committed or not, host values): it is traced
    # with no mesh, on abstract values alone, so a trace made for other devices is this one's too.
    reuse = jaxprs is not None and placing is None and hint is None and default is None and implied is None
    reuse = reuse and info.device is None and hasattr(state.implied, "cache_info")
    abstract_key = (jaxpr_key, tuple(_abstract(s, None) for s in signature)) if reuse else None
    known = jaxprs.get(abstract_key) if jaxprs is not None and abstract_key is not None else None
    if known is not None:
        closed, out_tree = known
        out_trees.append(out_tree)
        return _built(
            info, inputs, state, closed, out_trees, places, placing, implied, uncommitted, hint, False, t0
        )
    outer, context.state.trace = context.state.trace, state
    try:
        # The caller's own mesh (jax.set_mesh, of any size) is set aside: the
        # program sees its default slice's mesh, or none.
        target = default or implied
        # A program with no slice sees the caller's jax.set_mesh mesh as jax.jit does (bare
        # PartitionSpecs in an inner jax.jit's shardings name it); a slice's is abstract.
        concrete = implied.physical_mesh if default is None and implied is not None else None
        if default is None and (info.device is not None or _untyped(implied, signature)):
            # jax.jit's device= (or a wrapped jax.jit's device, backend or one-device shardings)
            # traces with no mesh, as jax.jit does: a mesh set there refuses its device= and backend=.
            target = concrete = None
        # With no mesh set, jax.jit traces with none: the mesh of its arguments (or shardings) types
        # them (Explicit axes) but is not the context mesh, so code reading the context mesh
        # (get_abstract_mesh, Flax Linen's nn.with_partitioning) sees none, as there. Only code
        # that fails so (a bare PartitionSpec, which jax.jit refuses) is traced again on that mesh.
        lenient = concrete is not None and default is None and _user_mesh() is None
        abstract = [_abstract(s, target) for s in signature]
        try:
            with only_mesh(
                NO_ABSTRACT_MESH if lenient or target is None else target.mesh, None if lenient else concrete
            ):
                closed = _without_refs(jax.make_jaxpr(flat_fun)(*abstract))
        except (errors.PathwaysError, nnx_graph.GraphOutput):
            raise
        except Exception as first:
            if not lenient or target is None:
                raise
            closed = _traced_on_context(target, concrete, flat_fun, abstract)
            if closed is None:
                raise first  # jax.jit's own error
    except (errors.PathwaysError, nnx_graph.GraphOutput):
        raise
    except Exception as exc:
        if implied is not None and default is None and hint is None and info.mesh_hint is None:
            # Traced on its arguments' mesh, the function failed: a mesh it names itself
            # (a shard_map's or pmap's over other axes) wins, as under jax.jit.
            named = _mesh_named_without_context(signature, state, flat_fun)
            if named is not None:
                return trace(info, inputs, named, placing)
        # No line of the function failed (it was called with arguments it does not take):
        # the user's call did.
        where = source.of_exception(exc, info.fun) or f"the call ({source.of_caller()})"
        # Also of the original's class: `except ValueError` written for jax.jit still catches it.
        raise errors.like(
            errors.ProgramTraceError,
            exc,
            f"tracing program {info.name!r} ({info.source_info}) failed at "
            f"{where}: {type(exc).__name__}: "
            f"{info.in_user_words(str(exc), treedef, statics)}{_mesh_mismatch_hint(exc, target)}",
        ) from exc
    finally:
        context.state.trace = outer
    _refuse_leaked_tracers(info, closed)
    refs = closed_refs.closed_over(closed.consts)
    if refs:  # Refs the function closes over: their values become inputs (closed_refs.call_closed)
        raise closed_refs.ClosedRefs(refs)
    if abstract_key is not None and jaxprs is not None and _placed_nothing(state):
        jaxprs.put(abstract_key, (closed, out_trees[-1]))
    return _built(
        info, inputs, state, closed, out_trees, places, placing, implied, uncommitted, hint, True, t0
    )


def _placed_nothing(state: TraceState) -> bool:
    """Whether the trace placed no code: no ``pw.jit`` call or slice, nor the device the call is on.

    Such a trace depends on the arguments' abstract values alone (as ``jax.jit``'s).
    """
    implied = state.implied
    asked = hasattr(implied, "cache_info") and implied.cache_info().currsize > 0  # type: ignore[union-attr]
    return not state.jit_calls and not state.slices and not asked


class JaxprCache:
    """A program's traces of calls nothing placed, by the call's key less its signature and its abstract values.

    ``jax.jit`` traces a function once for arguments of the same abstract values
    (shape, dtype, weak type), whichever device holds them and whether they are
    committed there; a program's graph depends on where they are, but its trace
    need not run the function again: a train loop's state restored committed to
    a device (orbax, ``jax.device_put``) runs the graph built from the trace
    made for the uncommitted arrays before.
    """

    def __init__(self) -> None:
        self._traces: dict[tuple, tuple[Any, Any]] = {}

    def get(self, key: tuple) -> tuple[Any, Any] | None:
        try:
            return self._traces.get(key)
        except TypeError:  # an unhashable part of the key: not kept
            return None

    def put(self, key: tuple, trace: tuple[Any, Any]) -> None:
        with contextlib.suppress(TypeError):
            self._traces[key] = trace

    def clear(self) -> None:
        self._traces.clear()


def _built(
    info: ProgramInfo,
    inputs: TraceInputs,
    state: TraceState,
    closed: Any,
    out_trees: list[Any],
    places: tuple[Any, ...],
    placing: tuple[Any, ...] | None,
    implied: VirtualSlice | None,
    uncommitted: bool,
    hint: jax.sharding.Mesh | None,
    traced: bool,
    t0: int,
) -> GraphView:
    """The graph of the trace ``closed`` (``traced``: just made) of ``info``'s function for ``inputs``."""
    default, signature, sink = state.default, inputs.signature, events.SINK
    if placing is None and default is None and info.device is None and not info.keep_unused:
        # As jax.jit prunes the arguments a function does not use (keep_unused=False), a
        # committed one of them places nothing: the call goes where the others place it.
        used = _used_inputs(closed.jaxpr)
        if any(getattr(key, "committed", False) for i, key in enumerate(signature) if i not in used):
            places = tuple(k if i in used else None for i, k in enumerate(signature))
            if implied is None:
                kept = places
                state.implied = functools.cache(lambda: _committed_slice(inputs, kept) or _device_slice(kept))
                uncommitted = not any(getattr(key, "committed", False) for key in kept)
            elif _kept_mesh(places, hint or info.mesh_hint or _user_mesh(), _owner(info)) is not implied:
                return trace(info, inputs, hint, places)  # traced on the mesh only an unused one is on
    if traced:
        counts.bump("traces")
    if default is None and implied is None and hint is None:
        # Nothing placed it, but the function names a mesh itself (a sharding constraint
        # or an inner jax.jit's shardings): as jax.jit, it runs on that mesh.
        named = _named_mesh(closed.jaxpr)
        if named is not None:
            return trace(info, inputs, named, placing)
    input_slices = _input_slices(inputs)
    constants = _constants_slice(
        default or implied,
        state,
        tuple(s for s, k in zip(input_slices, places, strict=True) if k is not None),
    )
    graph, held = graph_builder.build(
        name=info.name,
        source_info=info.source_info,
        closed=closed,
        input_slices=input_slices,
        state=state,
        out_tree=out_trees[-1],
        constants=constants,
        # As jax.jit's, with a committed argument: its uncommitted ones go where it is.
        follows=tuple(not getattr(key, "committed", False) for key in signature)
        if default is None and not uncommitted
        else (),
        loose_constants=uncommitted,
    )
    if uncommitted and state.implied is not None:
        implied_id = state.implied().id
        # Only a slice the graph names has outputs to leave uncommitted; naming another
        # (made for nothing, and a new one each trace) would make equal traces unequal graphs.
        if implied_id in held:
            graph = dataclasses.replace(graph, uncommitted_slice=implied_id)
    elif default is None and (implied is None or info.device is not None) and state.implied is not None:
        # Committed one-device arguments (no mesh), or jax.jit's device=, placed it on one
        # device: as jax.jit's, its outputs there are committed with a SingleDeviceSharding,
        # no mesh in their types.
        placed = state.implied()
        if placed.id in held and _is_device_slice(placed):
            graph = dataclasses.replace(graph, device_slice=placed.id)
    if sink is not None:
        sink(events.Traced(info.name, info.source_info, t0, events.now()))
    return GraphView(graph.check(), held)


def _constants_slice(
    placed: VirtualSlice | None, state: TraceState, input_slices: tuple[VirtualSlice | None, ...]
) -> VirtualSlice | None:
    """Where the program's constant outputs are made: where ``jax.jit`` would run it.

    Its default slice, else the device or mesh that placed it (``jax.jit``'s
    ``device=``, arguments on a mesh), else a committed future's slice, else
    the first committed array's device or JAX's default device.
    """
    if placed is not None:
        return placed
    committed = next((s for s in input_slices if s is not None), None)
    if committed is not None:
        return committed
    return state.implied() if state.implied is not None else None


def _typed_future_slice(inputs: TraceInputs, places: tuple[Any, ...]) -> VirtualSlice | None:
    """The slice of the first committed argument if it is a future on Explicit axes (else None).

    Its sharding is part of its type, as the array it stands for: ``jax.jit``
    traces that array typed (``float32[8@data]``: ``jax.typeof`` inside says
    so, a reshape that needs an ``out_sharding`` is refused, the outputs keep
    the type), so the call is traced on the future's slice, as on the mesh of
    an array argument. Untyped, a program first called with such futures (an
    evaluation step fed the train step's state) traced them otherwise.
    """
    leading = _committed_slice(inputs, places)
    if leading is not None and AxisType.Explicit in leading.axis_types:
        return leading
    return None


def _committed_slice(inputs: TraceInputs, places: tuple[Any, ...]) -> VirtualSlice | None:
    """The slice of the first committed argument in ``places``, if it is a future's (None: an array's, or none).

    As ``jax.jit`` runs a call where its committed arguments are, code of a
    program with no slice that reads only uncommitted values (``batch.mean()``
    beside ``params`` on a slice) runs on the slice of a committed future
    argument, as on the devices of the array it stands for.
    """
    for leaf, key in zip(inputs.leaves, places, strict=True):
        if isinstance(key, FutureKey) and key.committed and isinstance(leaf, Future):
            return leaf.slice
        if isinstance(key, ArrayKey) and key.committed:
            return None
    return None


def _kept_mesh(places: tuple[Any, ...], hint: jax.sharding.Mesh | None, owner: str) -> VirtualSlice | None:
    """The slice of the mesh the arguments in ``places`` put the call on, if any (see ``_mesh_slice``)."""
    with contextlib.suppress(errors.ResourceError):
        return _mesh_slice(places, hint, owner)
    return None


def _owner(info: ProgramInfo) -> str:
    """The program, in an error's words."""
    return f"program {info.name!r} ({info.source_info})"


def _used_inputs(jaxpr: Any) -> set[int]:
    """The positions of ``jaxpr``'s inputs its outputs or equations read.

    An inner ``jax.jit``'s are those its function reads: ``jax.jit`` prunes
    through them, whatever their own ``keep_unused``.
    """
    read = {v for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
    for eqn in jaxpr.eqns:
        kept = None
        if eqn.primitive.name in graph_builder.JIT_PRIMITIVES:
            kept = _used_inputs(eqn.params["jaxpr"].jaxpr)
        read.update(
            v
            for i, v in enumerate(eqn.invars)
            if not isinstance(v, jex.Literal) and (kept is None or i in kept)
        )
    return {i for i, v in enumerate(jaxpr.invars) if v in read}


def _input_slices(inputs: TraceInputs) -> tuple[VirtualSlice | None, ...]:
    """The slice each argument leaf is on, for placement: a future's, unless it is uncommitted.

    As ``jax.jit`` moves an uncommitted array to where the committed ones
    are, an uncommitted future (an output of a program nothing placed) places
    nothing: it follows the others, as an uncommitted array argument does.
    """
    return tuple(
        leaf.slice if isinstance(leaf, Future) and isinstance(key, FutureKey) and key.committed else None
        for leaf, key in zip(inputs.leaves, inputs.signature, strict=True)
    )


def _untyped(implied: VirtualSlice | None, signature: Signature) -> bool:
    """Whether ``jax.jit`` would trace the call with no mesh on a mesh of Explicit axes that only shardings name.

    With no mesh set, ``jax.jit`` traces arguments no Explicit mesh types
    (uncommitted arrays, host data) as they are, untyped: the mesh of its
    ``in_shardings`` / ``out_shardings`` (or an inner ``jax.jit``'s) places
    the computation, and the compiler the outputs, which come back typed by
    where it put them (``float32[8@x]`` for an argument ``in_shardings``
    split). Typed there, replicated, every output would stay replicated.
    """
    if implied is None or AxisType.Explicit not in implied.axis_types or _user_mesh() is not None:
        return False
    for key in signature:
        mesh = getattr(getattr(key, "sharding", None), "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh) and AxisType.Explicit in mesh.axis_types:
            return False  # an argument typed on a mesh: traced on it, as its type says
    return True


def _traced_on_context(target: VirtualSlice, concrete: Any, flat_fun: Any, abstract: list[Any]) -> Any:
    """The function traced with ``target``'s mesh as the context mesh (None if that fails too).

    For a program with no slice whose function failed traced as ``jax.jit``
    traces it, with no mesh set: code naming the mesh of its arguments with bare
    ``PartitionSpec`` s runs there, as under ``jax.set_mesh`` of that mesh.
    """
    try:
        with only_mesh(target.mesh, concrete):
            return _without_refs(jax.make_jaxpr(flat_fun)(*abstract))
    except (errors.PathwaysError, nnx_graph.GraphOutput):
        raise
    except Exception:
        return None


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


def _without_refs(closed: Any) -> Any:
    """``closed`` with the Refs (``jax.new_ref``) and hijax values it makes turned into the values they hold.

    A Ref lives in one computation: cut into nodes, the program would hand one
    node's Ref to the next as a plain array. JAX's own state discharge threads
    each Ref's value through instead (what ``jax.jit`` compiles); the other
    equations are bound again as they are, ``pw.jit`` calls and sources kept.
    """
    if closed_refs.closed_over(closed.consts):  # the call takes them as inputs: traced again then
        return closed
    if _lower_hijax is not None and getattr(closed.jaxpr, "is_high", False):
        # Flax's hijax Variables made inside (hijax_arguments): as jax.jit lowers them, their
        # values threaded through the equations, so no node hands another a Variable.
        closed = _lower_hijax(closed)
    if _discharge_state is None or _INTERNAL_REFS not in closed.jaxpr.effects:
        return closed
    return _discharge_state(closed)


def _refuse_leaked_tracers(info: ProgramInfo, closed: Any) -> None:
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
        f"tracing program {info.name!r} ({info.source_info}) read an intermediate value of another "
        f"trace ({leaked[0].aval.str_short()} in a {type(leaked[0]).__name__}) that escaped it: "
        "a function traced by JAX (a program, jax.jit, grad, ...) saved it to global state or a "
        "list instead of returning it. Return the value from that function and pass it to this "
        "program as an argument. To find where it leaked, run under jax.checking_leaks()."
    )


__all__ = ["trace"]
