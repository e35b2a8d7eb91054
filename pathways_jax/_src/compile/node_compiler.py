"""One node compiled for a mesh: its executable (shared through the cache), and its export for hosts."""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

from pathways_jax._src.compile import lowering_log
from pathways_jax._src.compile.executable_cache import ExecutableCache
from pathways_jax._src.core import counts, errors, events
from pathways_jax._src.core.jax_context import trace_context as _trace_context
from pathways_jax._src.core.meshes import only_mesh
from pathways_jax._src.ir.graph import Graph, Node


def calls_host(jaxpr: Any) -> bool:
    """True if a jaxpr (or one nested in it) calls back into Python on the host."""
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            return True
        for sub in jex.jaxprs_in_params(eqn.params):
            if calls_host(sub):
                return True
    return False


def loose_device(graph: Graph, node: Node, mesh: Any) -> jax.Device | None:
    """The device of a node compiled as ``jax.jit`` compiles a call nothing placed, else None.

    A node on the slice a program implies when nothing placed its call
    (``Graph.uncommitted_slice``: one device) returns uncommitted outputs, as
    ``jax.jit``'s are. Compiled with no shardings and no mesh on that device,
    its executable returns them so itself: a call then remakes no array
    (``futures.batch_values``), and the next call, with those outputs or
    their futures, takes JAX's own fast path. Not for nodes with a placement
    of their own (specs, a typed mesh), host callbacks (whose outputs the
    compiler pins) or sub-byte inputs. A node on the slice committed one-device
    arguments placed the call on (``Graph.device_slice``) is compiled so too,
    but committed to that device (``compile_node``'s ``committed``), as
    ``jax.jit`` runs such a call: ``SingleDeviceSharding`` outputs, no mesh
    in their types. There, on one device, specs, the slice's own mesh of Auto
    axes, host callbacks and sub-byte inputs (its executable called through
    its ``jax.jit``, see ``_SubByteInputs``) place nothing more, so they do
    not stop it.
    """
    if node.slice.id not in (graph.uncommitted_slice, graph.device_slice) or mesh.devices.size != 1:
        return None
    placed = node.slice.id == graph.device_slice
    if not placed and any(spec is not None for spec in (*node.in_specs, *node.out_specs)):
        return None
    if not placed and (
        calls_host(node.jaxpr.jaxpr) or any(_sub_byte(aval.dtype) for aval in node.jaxpr.in_avals)
    ):
        return None
    for aval in (*node.jaxpr.in_avals, *node.jaxpr.out_avals):
        typed = getattr(aval, "sharding", None)
        if isinstance(typed, NamedSharding) and not typed.mesh.empty:
            if placed and AxisType.Explicit not in typed.mesh.axis_types:
                continue  # the slice's own one-device mesh of Auto axes: types nothing
            return None
    return mesh.devices.flat[0]


def compile_node(
    node: Node,
    mesh: Any,
    in_shardings: tuple,
    out_shardings: tuple,
    donate: tuple,
    cache: ExecutableCache | None,
    *,
    export: bool = False,
    platforms: tuple[str, ...] | None = None,
    options: tuple[tuple[str, Any], ...] = (),
    loose: jax.Device | None = None,
    committed: bool = False,
) -> tuple[Any, tuple[bytes, str] | None]:
    """Compiles a node for ``mesh``; identical nodes (a function called many times) compile once.

    Returns the executable and, with ``export``, the node serialized with
    ``jax.export`` for remote hosts (bytes and their fingerprint), for
    ``platforms`` (``None``: this process's). With ``loose`` (see
    :func:`loose_device`), compiled for that device as ``jax.jit`` compiles
    a call nothing placed: its outputs are uncommitted; with ``committed`` too,
    as ``jax.jit`` compiles a call committed one-device arguments placed there:
    its outputs are committed to it (``SingleDeviceSharding``).
    """
    # Keyed by the function's text (and its constants' identities): JAX may
    # trace one Python function into distinct but identical jaxprs.
    consts = tuple(node.jaxpr.consts)
    key = (
        _function_text(node.jaxpr.jaxpr),
        # The text does not show weak types, which the executable's outputs carry.
        tuple(getattr(aval, "weak_type", False) for aval in (*node.jaxpr.in_avals, *node.jaxpr.out_avals)),
        # Nor the configuration lowering depends on (jax_threefry_partitionable, precision).
        _trace_context(),
        tuple(map(id, consts)),
        # Nor which Python functions its host callbacks call: two lambdas of one
        # factory print alike, and sharing an executable would run the wrong one.
        _host_functions(node.jaxpr.jaxpr),
        mesh,
        in_shardings,
        out_shardings,
        donate,
        export,
        platforms,
        options,
        loose,
        committed,
    )
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    body = jex.jaxpr_as_fun(_unconstrained(node.jaxpr) if loose is not None and committed else node.jaxpr)

    def fun(*args: Any) -> tuple:
        return tuple(body(*args))

    fun.__name__ = node.name
    args = [
        jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=s, weak_type=getattr(aval, "weak_type", False))
        for aval, s in zip(node.jaxpr.in_avals, in_shardings, strict=True)
    ]
    t0 = events.now()
    exported = None
    if loose is not None:
        # No mesh at all (whatever the caller set) and no shardings, on that device.
        plain = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in args]
        on_device = _device_sharding(loose) if committed else None
        with only_mesh(_NO_MESH, None), jax.default_device(loose):
            jitted = (
                jax.jit(fun, in_shardings=on_device, out_shardings=on_device, donate_argnums=donate)
                if committed
                else jax.jit(fun, donate_argnums=donate)
            )
            made: Any = jitted.lower(*plain).compile(dict(options) if options else None)
        if any(_sub_byte(aval.dtype) for aval in node.jaxpr.in_avals):
            made = _SubByteInputs(made, jitted, None, loose)
        counts.bump("compiles")
        lowering_log.compiled(node, t0)
        if cache is not None:
            cache.put(key, (made, None), consts)
        return made, None
    if _untyped_on_explicit(node, mesh):
        # Traced with no mesh, as jax.jit traces a call no mesh types (function_trace._untyped):
        # compiled so too, its shardings placing it, untyped (typed, its body would not trace).
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in args]
        context = only_mesh(_NO_MESH, None)
    else:
        # The slice's mesh alone, whatever mesh the caller set; works inside a trace too.
        context = only_mesh(mesh.abstract_mesh, mesh)
    with context:
        jitted = jax.jit(fun, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate)
        # XLA options (jax.jit's compiler_options) apply here; remote hosts compile with their own.
        compiled: Any = jitted.lower(*args).compile(dict(options) if options else None)
        if any(_sub_byte(aval.dtype) for aval in node.jaxpr.in_avals):
            compiled = _SubByteInputs(compiled, jitted, mesh, None)
        if export:
            # Hosts compile for themselves; donation is a local optimisation left out.
            blob = _exported(
                node, jax.jit(fun, in_shardings=in_shardings, out_shardings=out_shardings), args, platforms
            )
            exported = (blob, hashlib.sha256(blob).hexdigest())
    counts.bump("compiles")
    lowering_log.compiled(node, t0)
    if cache is not None:
        cache.put(key, (compiled, exported), consts)
    return compiled, exported


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _untyped_on_explicit(node: Node, mesh: Any) -> bool:
    """A node on Explicit axes traced with no mesh: its inputs' types (with none, its outputs') name none.

    Its computation may type values itself (a ``jax.sharding.reshard`` in it).
    """
    if AxisType.Explicit not in mesh.axis_types:
        return False
    avals = node.jaxpr.in_avals or node.jaxpr.out_avals
    return not any(_typed(aval) for aval in avals)


def _typed(aval: Any) -> bool:
    """Whether ``aval``'s type names a mesh."""
    sharding = getattr(aval, "sharding", None)
    return isinstance(sharding, NamedSharding) and not sharding.mesh.empty


def _exported(node: Node, jitted: Any, args: list, platforms: tuple[str, ...] | None) -> bytes:
    """The node serialized with ``jax.export`` for remote hosts; what cannot be raises ``PlacementError``."""
    try:
        return bytes(jax.export.export(jitted, platforms=platforms)(*args).serialize())
    except Exception as exc:
        if "host_callback" in str(exc):
            what = (
                "calls back into Python (jax.debug.print, jax.debug.callback, pure_callback or "
                "io_callback), and remote hosts cannot call into this process"
            )
            fix = "Take the callback out of the program (print its result after .result()), or use the local backend."
        else:
            what = f"cannot be serialized for remote hosts with jax.export ({type(exc).__name__}: {exc})"
            fix = "Write the computation with operations jax.export supports, or use the local backend."
        raise errors.PlacementError(
            f"node {node.name!r} ({node.source_info}) {what}; programs on the Ray backend run in host "
            f"processes from exported computations. {fix}"
        ) from exc


# A float literal in a jaxpr's text: its value and dtype ("0.99:f32[]").
_FLOAT_LITERAL = re.compile(r"(?<![\w.])(-?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf)):(bf16|f16|f32|f64)\[\]")
_FLOAT_TYPES = {"bf16": jnp.bfloat16, "f16": np.float16, "f32": np.float32, "f64": np.float64}


def _function_text(jaxpr: Any) -> str:
    """A jaxpr's text with each float literal written as the value its dtype holds.

    Two traces of one function may write one literal two ways (a Python float
    ``0.99`` in one, the float32 it becomes, ``0.9900000095367432``, in the
    other: a program's first call with arrays and its next with futures), which
    made the executable cache miss and compile the same computation again.
    """
    return _FLOAT_LITERAL.sub(
        lambda m: f"{float(_FLOAT_TYPES[m.group(2)](float(m.group(1))))!r}:{m.group(2)}[]", str(jaxpr)
    )


def _sub_byte(dtype: Any) -> bool:
    """int4, uint4, int2, float4: dtypes packed several to a byte."""
    if dtype == jax.dtypes.float0 or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False  # float0 holds no data (a gradient of an integer input); keys are whole words
    return jax.dtypes.itemsize_bits(dtype) < 8


class _SubByteInputs:
    """An executable whose inputs include a sub-byte dtype, called through its ``jax.jit``.

    ``jax.device_put`` onto several devices gives int4 and int2 arrays a layout
    whose element size reads 0 bits while the compiled executable asks for 4 or
    2, and a compiled call refuses the mismatch (jax.jit's own call does not):
    ``ValueError: Computation was compiled for input layouts that disagree``.
    """

    def __init__(self, compiled: Any, jitted: Any, mesh: Any, device: jax.Device | None) -> None:
        # ``mesh``: the mesh it was compiled under; None: none, on ``device`` (``loose_device``'s).
        self._jitted, self._mesh, self._device = jitted, mesh, device
        self.input_shardings, self.output_shardings = compiled.input_shardings, compiled.output_shardings

    def __call__(self, *args: Any) -> Any:
        if self._mesh is None:
            # Arguments the plan put on the slice's one-device mesh: on that device with no mesh
            # in their types, as the executable itself takes them, so no output is typed with it.
            on_device = _device_sharding(self._device)
            args = tuple(jax.device_put(a, on_device) if _typed(jax.typeof(a)) else a for a in args)
            with only_mesh(_NO_MESH, None), jax.default_device(self._device):
                return self._jitted(*args)
        with only_mesh(self._mesh.abstract_mesh, self._mesh):
            return self._jitted(*args)


class _Same:
    """An object as a cache-key part that equals only itself (and keeps it alive while keyed)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


def _host_functions(jaxpr: Any) -> tuple[_Same, ...]:
    """The Python callables that ``jaxpr``'s host callbacks (``pure_callback``,
    ``io_callback``, ``jax.debug``) call, in order, nested jaxprs included."""
    found: list[_Same] = []

    def walk(value: Any) -> None:
        if isinstance(value, jex.ClosedJaxpr):
            value = value.jaxpr
        if isinstance(value, jex.Jaxpr):
            for eqn in value.eqns:
                host = "callback" in eqn.primitive.name
                for param in eqn.params.values():
                    if host and callable(param) and not isinstance(param, jex.Jaxpr | jex.ClosedJaxpr):
                        # pure_callback and io_callback wrap the user's function anew at each trace.
                        found.append(_Same(getattr(param, "callback_func", param)))
                    else:
                        walk(param)
        elif isinstance(value, tuple | list):
            for item in value:
                walk(item)

    walk(jaxpr)
    return tuple(found)


def _unconstrained(closed: Any) -> Any:
    """``closed`` without its top-level sharding constraints to a one-device mesh of Auto axes.

    On one device they place nothing; they are where the graph puts a value on
    its slice (an argument returned as it is), and would type the output with
    the slice's mesh, where ``jax.jit``'s output on that device has none.
    """
    jaxpr = closed.jaxpr
    kept: list[Any] = []
    alias: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        sharding = eqn.params.get("sharding") if eqn.primitive.name == "sharding_constraint" else None
        mesh = getattr(sharding, "mesh", None)
        source = eqn.invars[0] if eqn.invars else None
        if mesh is not None and mesh.size == 1 and AxisType.Explicit not in mesh.axis_types:
            # A constant's (the graph puts it on its slice so) becomes the constant itself,
            # which the executable makes with its weak type, as jax.jit's constant output.
            alias[eqn.outvars[0]] = source if isinstance(source, jex.Literal) else alias.get(source, source)
            continue
        if alias and any(v in alias for v in eqn.invars if not isinstance(v, jex.Literal)):
            eqn = eqn.replace(
                invars=[alias.get(v, v) if not isinstance(v, jex.Literal) else v for v in eqn.invars]
            )
        kept.append(eqn)
    if not alias:
        return closed
    outvars = [alias.get(v, v) if not isinstance(v, jex.Literal) else v for v in jaxpr.outvars]
    return closed.replace(jaxpr=jaxpr.replace(eqns=kept, outvars=outvars))


@functools.lru_cache(maxsize=64)
def _device_sharding(device: jax.Device) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device)


__all__ = ["calls_host", "compile_node", "loose_device"]
