"""Turns a program's top-level jaxpr into a :class:`Graph`: placement, grouping, transfers."""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.extend.core as jex
from jax.sharding import PartitionSpec

from pathways_jax._src.core import errors, source
from pathways_jax._src.ir.graph import Const, Graph, Input, Node, Output, Step, Transfer, Value
from pathways_jax._src.runtime import context
from pathways_jax._src.runtime.slices import SCOPE_PREFIX, VirtualSlice

# Named scopes the tracer wraps placed code in: a slice's ``with`` block, the
# program's default slice, and each pw.jit call (numbered).
JIT_SCOPE = "pw_jit"
DEFAULT_SCOPE = "pw_default"
# A transformation traced around the scope (jax.grad, vmap) wraps its name: the forward of a
# pw.jit call under grad is ``jvp(pw_jit0)``, its backward ``transpose(jvp(pw_jit0))``.
_SCOPE_RE = re.compile(rf"^((?:\w+\()*)({SCOPE_PREFIX}|{DEFAULT_SCOPE}|{JIT_SCOPE})(\d+)\)*$")


@dataclasses.dataclass(frozen=True, slots=True)
class JitCall:
    """What a ``pw.jit`` call inside a program trace records about its node."""

    slice: VirtualSlice
    in_specs: tuple[PartitionSpec | None, ...]
    out_specs: tuple[PartitionSpec | None, ...] | None


class TraceState:
    """Side tables of one program trace, found again through named scopes."""

    def __init__(self, default: VirtualSlice | None):
        self.default = default
        # Where code no slice, scope or input places runs (a program with no
        # placement at all): the slice jax.jit would pick, made on first need.
        self.implied: Callable[[], VirtualSlice] | None = None
        self.slices: dict[int, VirtualSlice] = {}
        self.jit_calls: list[JitCall] = []
        if default is not None:
            self.note_slice(default)

    def note_slice(self, slice_: context.Slice) -> None:
        self.slices[slice_.id] = cast(VirtualSlice, slice_)  # slices of this runtime alone are entered

    def record_jit(self, call: JitCall) -> int:
        self.note_slice(call.slice)
        self.jit_calls.append(call)
        return len(self.jit_calls) - 1


def active_trace() -> TraceState | None:
    """The ``TraceState`` of the program being traced on this thread, if any."""
    return cast("TraceState | None", context.state.trace)


def _jit_specs(shardings: Any, slice_: Any, count: int) -> tuple:
    """The partition specs of a ``jax.jit`` call's shardings that hold on ``slice_``'s mesh.

    A ``NamedSharding`` whose axes the slice's mesh has, with the same sizes,
    keeps its spec (a program given ``out_shardings`` returns values sharded
    as ``jax.jit`` would); anything else is left to the compiler (None).
    """
    from jax.sharding import NamedSharding

    specs: list[Any] = [None] * count
    if shardings is None or slice_ is None or len(shardings) != count:
        return tuple(specs)
    mesh = getattr(slice_, "physical_mesh", None)
    if mesh is None:
        return tuple(specs)
    sizes = dict(mesh.shape)
    for i, sharding in enumerate(shardings):
        if not isinstance(sharding, NamedSharding):
            continue
        theirs = dict(sharding.mesh.shape)
        named = [
            n
            for part in sharding.spec
            if part is not None
            for n in (part if isinstance(part, tuple) else (part,))
        ]
        if all(sizes.get(n) == theirs.get(n) for n in named):
            specs[i] = sharding.spec
    return tuple(specs)


def _untyped(var: Any) -> bool:
    """Whether ``var``'s type names no mesh (traced with none set)."""
    mesh = getattr(getattr(getattr(var, "aval", None), "sharding", None), "mesh", None)
    return mesh is None or mesh.empty


def _typed_specs(atoms: Any, specs: tuple, slice_: Any) -> tuple:
    """``specs``, with the spec of each value whose type carries a sharding on Explicit axes of ``slice_``'s mesh.

    Under ``jax.set_mesh`` of Explicit axes a value's sharding is part of its
    type (``jax.typeof(x).sharding``), and an inner ``jax.jit``'s output is
    typed by it, not by its ``out_shardings``: the compiled node must give it
    that sharding, which a constraint to another spec would contradict.
    """
    from jax.sharding import AxisType, NamedSharding

    mesh = getattr(slice_, "physical_mesh", None)
    if mesh is None or AxisType.Explicit not in mesh.axis_types:
        return specs
    sizes = dict(mesh.shape)
    out = list(specs)
    for i, atom in enumerate(atoms):
        sharding = getattr(getattr(atom, "aval", None), "sharding", None)
        if not isinstance(sharding, NamedSharding) or AxisType.Explicit not in sharding.mesh.axis_types:
            continue
        if dict(sharding.mesh.shape) == sizes and not _same_spec(
            specs[i], sharding.spec, len(atom.aval.shape)
        ):
            out[i] = sharding.spec
    return tuple(out)


def _same_spec(spec: Any, typed: Any, ndim: int) -> bool:
    """True when the call's own ``spec`` places as the type's ``typed`` does: the call's is then kept
    (``jax.jit``'s ``out_shardings=P("x")`` gives ``P("x")``, where the type says ``P("x", None)``)."""
    if spec is None:
        return False
    return tuple(spec) + (None,) * (ndim - len(spec)) == tuple(typed) + (None,) * (ndim - len(typed))


def parse_scopes(name_stack: Any, *, transformed: bool = True) -> list[tuple[str, int]]:
    """The pathways scopes of an equation's name stack, innermost first.

    ``transformed``: also the scopes a transformation traced inside the program
    wraps (``jvp(pw_jit0)``: code under ``jax.grad`` keeps its placement, its
    backward runs where its forward does).
    """
    found = []
    for part in reversed(str(name_stack).split("/")):
        match = _SCOPE_RE.match(part)
        if match and (transformed or not match.group(1)):
            found.append((match.group(2), int(match.group(3))))
    return found


JIT_PRIMITIVES = frozenset({"jit", "pjit"})


def _is_var(atom: Any) -> bool:
    return not isinstance(atom, jex.Literal)


def _with_constants(eqn: Any, consts: dict[Any, Any]) -> tuple[Any, list[Any]]:
    """A node's computation for an inner ``jax.jit`` call ``eqn`` that passes literals or constants.

    A literal the caller passes to an inner ``jax.jit`` (the ``ddof=0`` of
    ``jnp.std``, the ``q`` of ``jnp.percentile``) and a constant made inside the
    function (``jnp.array([...])``) are constants of the computation under
    ``jax.jit``, which XLA folds; passed to the node as inputs they are runtime
    values, and results differed from ``jax.jit``'s in the last bit. The node
    computes the call itself, as ``jax.jit`` compiles it: the equation with its
    literals, the program's constants it reads bound as constants. Returns the
    computation and its input variables (each once).
    """
    used = list(dict.fromkeys(atom for atom in eqn.invars if _is_var(atom) and atom in consts))
    inputs = list(dict.fromkeys(atom for atom in eqn.invars if _is_var(atom) and atom not in consts))
    # Unused outputs of the call (DropVars) are still outputs of the node: named here.
    outs = [jex.Var(v.aval) if isinstance(v, jex.DropVar) else v for v in eqn.outvars]
    debug = jex.DebugInfo(
        f"pw.program call of {eqn.params.get('name', 'jit')}",
        source.of_equation(eqn),
        tuple(f"in{i}" for i in range(len(inputs))),
        tuple(f"out{i}" for i in range(len(outs))),
    )
    jaxpr = jex.Jaxpr(used, inputs, outs, [eqn.replace(outvars=outs)], eqn.effects, debug)
    return jex.ClosedJaxpr(jaxpr, [consts[v] for v in used]), inputs


def _without_dead_calls(closed: Any) -> Any:
    """``closed`` without the top-level equations that compute nothing: no used output, no effect.

    Differentiating a loop whose body calls a jitted function (``jax.nn.relu``
    in an ``nnx.scan`` or ``lax.scan`` over layers) leaves such a ``jit``
    behind, made by JAX outside every scope: with no input, user or scope to
    place it by, it made a program on a slice fail with ``PlacementError``,
    where ``jax.jit`` compiles it away.
    """
    eqns = closed.jaxpr.eqns
    kept = [
        eqn for eqn in eqns if eqn.effects or any(not isinstance(var, jex.DropVar) for var in eqn.outvars)
    ]
    # Under jax.grad of a jax.checkpoint function, the forward of each pw.jit call inside is
    # traced (and placed on its slice) though only the recomputing backward is used: XLA drops
    # it under jax.jit, so no node runs it here either.
    live = {v for v in closed.jaxpr.outvars if _is_var(v)}
    alive: list[Any] = []
    for eqn in reversed(kept):
        if eqn.effects or not _in_transformed_scope(eqn) or any(var in live for var in eqn.outvars):
            alive.append(eqn)
            live.update(v for v in eqn.invars if _is_var(v))
    kept = alive[::-1]
    if len(kept) == len(eqns):
        return closed
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=kept))


def _in_transformed_scope(eqn: Any) -> bool:
    """Whether a transformation traced inside the program wraps the equation's innermost pathways scope."""
    for part in reversed(str(eqn.source_info.name_stack).split("/")):
        match = _SCOPE_RE.match(part)
        if match:
            return bool(match.group(1))
    return False


def _host_literal(atom: Any) -> bool:
    """A float0 literal (the gradient of an integer input): host data under ``jax.jit`` too, made by no node."""
    return atom.aval.dtype == jax.dtypes.float0


def _constants_node(
    jaxpr: Any,
    const_data: dict[Any, Any],
    where: VirtualSlice | None,
    follows: tuple[bool, ...],
    source_info: str,
) -> tuple[Any, list[Any], list[Any]] | None:
    """The computation of the program outputs no node makes, if they go to ``where``; else None.

    Under ``jax.jit`` a literal or constant the function returns is an output
    of its computation: a new array each call, on the computation's devices
    (committed there when a committed argument placed it), and so is an
    uncommitted argument returned as it is. Made on the host once, such an
    output was one array every call returned (deleting or donating it broke
    the next call) on JAX's default device, uncommitted, wherever the program
    ran. Returns the node's computation, its input variables and its output
    atoms (each variable once; every literal).
    """
    if where is None:
        return None
    inputs = {var: index for index, var in enumerate(jaxpr.invars)}
    out_vars: list[Any] = []
    in_vars: list[Any] = []
    for atom in jaxpr.outvars:
        if not _is_var(atom):
            if not _host_literal(atom):
                out_vars.append(atom)
        elif atom not in out_vars and (
            atom in const_data or (atom in inputs and follows and follows[inputs[atom]])
        ):
            out_vars.append(atom)
            if atom in inputs:
                in_vars.append(atom)
    if not out_vars:
        return None
    used = [v for v in out_vars if _is_var(v) and v in const_data]
    debug = jex.DebugInfo(
        "pw.program constants",
        source_info,
        tuple(f"in{i}" for i in range(len(in_vars))),
        tuple(f"out{i}" for i in range(len(out_vars))),
    )
    closed = jex.ClosedJaxpr(
        jex.Jaxpr(used, in_vars, out_vars, [], frozenset(), debug), [const_data[v] for v in used]
    )
    return closed, in_vars, out_vars


def _place(closed: Any, state: TraceState, input_slices: dict[Any, VirtualSlice]) -> list[Any]:
    """One slice per top-level equation, or a PlacementError naming the user's line."""

    eqns = closed.jaxpr.eqns
    placed: list[VirtualSlice | None] = [None] * len(eqns)
    var_slice: dict[Any, VirtualSlice] = dict(input_slices)
    consumers: dict[Any, list[int]] = collections.defaultdict(list)
    for index, eqn in enumerate(eqns):
        for atom in eqn.invars:
            if _is_var(atom):
                consumers[atom].append(index)

    def from_scopes(eqn: Any) -> tuple[VirtualSlice | None, VirtualSlice | None]:
        explicit = default = None
        for kind, number in parse_scopes(eqn.source_info.name_stack):
            if kind == "pw_jit" and explicit is None:
                explicit = state.jit_calls[number].slice
            elif kind == "pw_slice" and explicit is None:
                explicit = state.slices.get(number)
            elif kind == "pw_default" and default is None:
                default = state.slices.get(number)
        return explicit, default

    scoped = [from_scopes(eqn) for eqn in eqns]

    def propagate() -> None:
        changed = True
        while changed:
            changed = False
            for index, eqn in enumerate(eqns):
                if placed[index] is not None:
                    continue
                explicit, default = scoped[index]
                from_inputs = next((var_slice[a] for a in eqn.invars if _is_var(a) and a in var_slice), None)
                if eqn.primitive.name in JIT_PRIMITIVES:
                    choice = explicit or default or from_inputs
                else:
                    choice = explicit or from_inputs or default
                if choice is None:
                    continue
                placed[index] = choice
                changed = True
                for var in eqn.outvars:
                    var_slice[var] = choice
            # Equations fed only by the host go where their first consumer runs.
            for index in reversed(range(len(eqns))):
                if placed[index] is not None:
                    continue
                for var in eqns[index].outvars:
                    users = [s for s in (placed[u] for u in consumers.get(var, ())) if s is not None]
                    if users:
                        placed[index] = users[0]
                        changed = True
                        for out in eqns[index].outvars:
                            var_slice[out] = users[0]
                        break

    propagate()
    # Code nothing places (a program with no slice at all) runs where jax.jit
    # would run it. What is left unplaced now has no placed input, user or scope,
    # so placement spreading from there could only bring it there too: it all
    # goes there at once (placing one equation and spreading again, equation by
    # equation, was quadratic: seconds for a program of a thousand arguments).
    if state.implied is not None and None in placed:
        fallback = state.implied()
        state.note_slice(fallback)
        for index, where in enumerate(placed):
            if where is None:
                placed[index] = fallback
                for var in eqns[index].outvars:
                    var_slice[var] = fallback
    for index, eqn in enumerate(eqns):
        if placed[index] is None:
            raise errors.PlacementError(
                f"cannot decide where `{eqn.primitive.name}` at {source.of_equation(eqn)} "
                "runs: it is not inside `with slice:`, the program has no devices=, and "
                "none of its inputs or users is placed. Wrap it in `with slice:`, use "
                "pw.jit(devices=...), or give the program a default with "
                "@pw.program(devices=...)."
            )
    return placed


# Primitives JAX traces their bodies into (lax.cond/switch, while_loop/fori_loop, scan/map):
# the program runs each as one operation, on one slice.
_CONTROL_FLOW = frozenset({"cond", "while", "scan"})


def _inner_equations(params: Any) -> Any:
    """Every equation of the jaxprs among an equation's ``params``, nested ones too."""
    for jaxpr in jex.jaxprs_in_params(params):
        for eqn in jaxpr.eqns:
            yield eqn
            yield from _inner_equations(eqn.params)


def _same_devices(a: VirtualSlice, b: VirtualSlice | None) -> bool:
    """True when both slices map the same devices in the same order (two slices of one placement)."""
    return b is not None and a.devices == b.devices and a.shape == b.shape


def _warn_placements_inside_control_flow(
    program: str, eqns: list[Any], placed: list[Any], state: TraceState
) -> None:
    """Warns of a ``pw.jit(devices=...)`` call or ``with slice:`` block inside lax control flow
    that asks for other devices than those the whole control-flow operation runs on."""
    for index, eqn in enumerate(eqns):
        if eqn.primitive.name not in _CONTROL_FLOW:
            continue
        where = placed[index]
        asked: dict[int, str] = {}
        for inner in _inner_equations(eqn.params):
            for kind, number in parse_scopes(inner.source_info.name_stack):
                wanted = (
                    state.jit_calls[number].slice
                    if kind == JIT_SCOPE
                    else state.slices.get(number)
                    if kind == SCOPE_PREFIX
                    else None
                )
                if wanted is not None:
                    if wanted is not where and wanted.id not in asked and not _same_devices(wanted, where):
                        what = "pw.jit" if kind == JIT_SCOPE else "`with slice:`"
                        line = source.of_equation(inner, "")
                        asked[wanted.id] = f"{what}{f' at {line}' if line else ''} asks for {wanted}"
                    break
        if asked:
            control = eqn.primitive.name
            warnings.warn(
                f"program {program!r}: {'; '.join(asked.values())}, inside `{control}` at "
                f"{source.of_equation(eqn)}. JAX traces `{control}` (lax.cond/switch, while_loop, "
                f"fori_loop, scan) as one operation, so all of it runs on {where}, and these "
                "placements are not honoured (the results are the same). To run a part on its own "
                f"devices, call it outside the `{control}`: compute the branches apart and select "
                "with jnp.where, or unroll the loop in Python.",
                UserWarning,
                stacklevel=2,
            )


def _group(eqns: list[Any], placed: list[Any]) -> list[tuple[str, Any, list[int]]]:
    """Each jit equation alone; runs of glue equations on one slice together."""
    groups: list[tuple[str, Any, list[int]]] = []
    for index, eqn in enumerate(eqns):
        if eqn.primitive.name in JIT_PRIMITIVES:
            groups.append(("jit", placed[index], [index]))
        elif groups and groups[-1][0] == "glue" and groups[-1][1] is placed[index]:
            groups[-1][2].append(index)
        else:
            groups.append(("glue", placed[index], [index]))
    return groups


def build(
    *,
    name: str,
    source_info: str,
    closed: Any,
    input_slices: tuple[VirtualSlice | None, ...],
    state: TraceState,
    out_tree: Any,
    constants: VirtualSlice | None = None,
    follows: tuple[bool, ...] = (),
    loose_constants: bool = False,
) -> tuple[Graph, dict[int, VirtualSlice]]:
    """The graph of a traced program, and the runtime's slice of each slice it names, by id.

    The graph names its slices by their frozen ``SliceRef`` alone.

    ``constants``: where the outputs no node computes (literals and constants
    the program returns) are made, as ``jax.jit`` makes them on its
    computation's devices; ``follows``: per argument leaf, whether one returned
    as it is goes there too, as ``jax.jit`` moves an uncommitted argument (host
    data, an uncommitted array) to where its committed ones are. They are
    replicated there, but for ``loose_constants``: nothing placed the call,
    and they are uncommitted on JAX's default device, as ``jax.jit``'s.
    """
    closed = _without_dead_calls(closed)
    jaxpr = closed.jaxpr
    values: list[Value] = []
    var_value: dict[Any, int] = {}
    held: dict[int, VirtualSlice] = {}

    def new_value(aval: Any, slice_: VirtualSlice | None, origin: str) -> int:
        ref = None
        if slice_ is not None:
            held.setdefault(slice_.id, slice_)
            ref = slice_.ref
        values.append(Value(len(values), aval, ref, origin))
        return len(values) - 1

    inputs = []
    argument_order = {var: index for index, var in enumerate(jaxpr.invars)}
    for index, (var, input_slice) in enumerate(zip(jaxpr.invars, input_slices, strict=True)):
        var_value[var] = new_value(var.aval, input_slice, f"program {name!r} input {index}")
        inputs.append(Input(index, var_value[var], input_slice is not None))
    consts = []
    # The program's constants (arrays the function closes over or makes from
    # Python data) stay constants of the nodes that read them, as under jax.jit;
    # only those the program returns as they are become values of the graph.
    const_data = dict(zip(jaxpr.constvars, closed.consts, strict=True))

    def const_value(var: Any) -> int:
        if var not in var_value:
            var_value[var] = new_value(var.aval, None, f"program {name!r} constant")
            consts.append(Const(var_value[var], const_data[var]))
        return var_value[var]

    placed = _place(
        closed, state, {v: s for v, s in zip(jaxpr.invars, input_slices, strict=True) if s is not None}
    )
    _warn_placements_inside_control_flow(name, jaxpr.eqns, placed, state)
    groups = _group(jaxpr.eqns, placed)

    # Which groups read each var, so a glue group exports only what others use.
    group_of = {}
    for number, (_, _, members) in enumerate(groups):
        for index in members:
            group_of[index] = number
    readers: dict[Any, set[int]] = collections.defaultdict(set)
    for index, eqn in enumerate(jaxpr.eqns):
        for atom in eqn.invars:
            if _is_var(atom):
                readers[atom].add(group_of[index])
    returned = {v for v in jaxpr.outvars if _is_var(v)}

    nodes: list[Node] = []
    transfers: list[Transfer] = []
    steps: list[Step] = []
    moved: dict[tuple[int, int], int] = {}
    names: collections.Counter[str] = collections.Counter()

    def on_slice(vid: int, slice_: VirtualSlice) -> int:
        now = values[vid].slice
        if now is None or now.id == slice_.id:
            return vid
        key = (vid, slice_.id)
        if key not in moved:
            out = new_value(values[vid].aval, slice_, values[vid].origin)
            transfers.append(Transfer(vid, out, now, slice_.ref))
            steps.append(("transfer", len(transfers) - 1))
            moved[key] = out
        return moved[key]

    def unique(base: str) -> str:
        names[base] += 1
        return base if names[base] == 1 else f"{base}_{names[base] - 1}"

    for number, (kind, slice_, members) in enumerate(groups):
        held.setdefault(slice_.id, slice_)
        if kind == "jit":
            eqn = jaxpr.eqns[members[0]]
            # Literals and constants passed in stay constants of the node's computation.
            kept = list(range(len(eqn.invars)))
            node_jaxpr = eqn.params["jaxpr"]
            if any(not _is_var(atom) or atom in const_data for atom in eqn.invars):
                node_jaxpr, call_inputs = _with_constants(eqn, const_data)
                kept = [eqn.invars.index(v) for v in call_inputs]  # each variable once, where it first is
            in_ids = [on_slice(var_value[eqn.invars[i]], slice_) for i in kept]
            # A plain jax.jit call's own in_shardings/out_shardings, where they name the slice's axes.
            all_in_specs: tuple = _jit_specs(eqn.params.get("in_shardings"), slice_, len(eqn.invars))
            out_specs: tuple = _jit_specs(eqn.params.get("out_shardings"), slice_, len(eqn.outvars))
            # On Explicit axes the sharding is the value's type: it wins over the call's shardings.
            all_in_specs = _typed_specs(eqn.invars, all_in_specs, slice_)
            out_specs = _typed_specs(eqn.outvars, out_specs, slice_)
            # A transformed call's inputs and outputs are not the call's: its specs do not apply
            # there (as a pw.jit called inside the caller's own grad or vmap).
            for scope_kind, call_number in parse_scopes(eqn.source_info.name_stack, transformed=False):
                if scope_kind == "pw_jit":
                    call = state.jit_calls[call_number]
                    if len(call.in_specs) == len(eqn.invars):
                        all_in_specs = call.in_specs
                    if call.out_specs is not None and len(call.out_specs) == len(out_specs):
                        out_specs = call.out_specs
                    break
            in_specs = tuple(all_in_specs[i] for i in kept)
            all_donated = eqn.params.get("donated_invars", (False,) * len(eqn.invars))
            node_name = unique(str(eqn.params.get("name", "jit")))
            where = source.of_equation(eqn, default=source_info)
            out_ids = []
            for var in eqn.outvars:
                vid = new_value(var.aval, slice_, f"program {name!r} node {node_name!r} ({where})")
                if _is_var(var) and not isinstance(var, jex.DropVar):
                    var_value[var] = vid
                out_ids.append(vid)
            nodes.append(
                Node(
                    name=node_name,
                    kind="jit",
                    slice=slice_.ref,
                    jaxpr=node_jaxpr,
                    inputs=tuple(in_ids),
                    outputs=tuple(out_ids),
                    in_specs=in_specs,
                    out_specs=tuple(out_specs),
                    donated=tuple(all_donated[i] for i in kept),
                    source_info=where,
                )
            )
        else:
            eqns = [jaxpr.eqns[i] for i in members]
            defined: set[Any] = set()
            in_vars: list[Any] = []
            glue_consts: list[Any] = []  # the program's constants it reads: constants of its own
            for eqn in eqns:
                for atom in eqn.invars:
                    if not _is_var(atom) or atom in defined:
                        continue
                    if atom in const_data:
                        if atom not in glue_consts:
                            glue_consts.append(atom)
                    elif atom not in in_vars:
                        in_vars.append(atom)
                defined.update(v for v in eqn.outvars if not isinstance(v, jex.DropVar))
            # The program's arguments first, in their order: XLA's output shardings are named
            # after the first input's, as jax.jit names them after its first argument's
            # (P("d", None) stays P("d", None), not P("d")).
            in_vars.sort(key=lambda v: argument_order.get(v, len(argument_order)))
            out_vars = [
                v
                for eqn in eqns
                for v in eqn.outvars
                if not isinstance(v, jex.DropVar) and (v in returned or readers.get(v, set()) - {number})
            ]
            effects = frozenset().union(*(eqn.effects for eqn in eqns))
            node_name = unique("glue")
            where = source.of_equation(eqns[0], default=source_info)
            debug = jex.DebugInfo(
                f"pw.program {name} glue",
                where,
                tuple(f"in{i}" for i in range(len(in_vars))),
                tuple(f"out{i}" for i in range(len(out_vars))),
            )
            glue = jex.ClosedJaxpr(
                jex.Jaxpr(glue_consts, in_vars, out_vars, eqns, effects, debug),
                [const_data[v] for v in glue_consts],
            )
            in_ids = [on_slice(var_value[v], slice_) for v in in_vars]
            out_ids = []
            for var in out_vars:
                var_value[var] = new_value(var.aval, slice_, f"program {name!r} node {node_name!r} ({where})")
                out_ids.append(var_value[var])
            nodes.append(
                Node(
                    name=node_name,
                    kind="glue",
                    slice=slice_.ref,
                    jaxpr=glue,
                    inputs=tuple(in_ids),
                    outputs=tuple(out_ids),
                    in_specs=(None,) * len(in_ids),
                    # With no input, and untyped (no mesh set, as jax.jit traces it), XLA would put
                    # them on its default device: replicated on the slice, as jax.jit's constants.
                    out_specs=tuple(
                        PartitionSpec() if not in_ids and not loose_constants and _untyped(v) else None
                        for v in out_vars
                    ),
                    donated=(False,) * len(in_ids),
                    source_info=where,
                )
            )
        steps.append(("node", len(nodes) - 1))

    if constants is not None and any(slice_.id != constants.id for _, slice_, _ in groups):
        follows = ()  # work on other slices too: no one computation's devices to move arguments to
    made = _constants_node(jaxpr, const_data, constants, follows, source_info)
    literal_ids: Any = iter(())
    if made is not None:
        node_slice = cast(VirtualSlice, constants)
        held.setdefault(node_slice.id, node_slice)
        glue, in_vars, out_vars = made
        in_ids = [on_slice(var_value[v], node_slice) for v in in_vars]
        out_ids = []
        for var in out_vars:
            out_ids.append(new_value(var.aval, node_slice, f"program {name!r} constant output"))
            if _is_var(var):
                var_value[var] = out_ids[-1]
        nodes.append(
            Node(
                name=unique("constants"),
                kind="glue",
                slice=node_slice.ref,
                jaxpr=glue,
                inputs=tuple(in_ids),
                outputs=tuple(out_ids),
                in_specs=(None,) * len(in_vars),
                # Replicated, as jax.jit's; with no input, no type and no spec, XLA
                # would put them on its default device.
                out_specs=(None if loose_constants else PartitionSpec(),) * len(out_vars),
                donated=(False,) * len(in_vars),
                source_info=source_info,
            )
        )
        steps.append(("node", len(nodes) - 1))
        literal_ids = iter(vid for var, vid in zip(out_vars, out_ids, strict=True) if not _is_var(var))
    outputs = tuple(
        Output(var_value[v] if v in var_value else const_value(v))
        if _is_var(v)
        else (Output(None, v.val) if made is None or _host_literal(v) else Output(next(literal_ids)))
        for v in jaxpr.outvars
    )
    graph = Graph(
        name=name,
        source_info=source_info,
        values=tuple(values),
        inputs=tuple(inputs),
        consts=tuple(consts),
        nodes=tuple(nodes),
        transfers=tuple(transfers),
        steps=tuple(steps),
        outputs=outputs,
        out_tree=out_tree,
    )
    return graph, held
