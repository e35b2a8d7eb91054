"""``pw.program``: the decorator, bare or with options, checked as ``jax.jit`` checks them."""

from __future__ import annotations

import collections
import functools
import gc
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax

from pathways_jax._src.api.jit_options import (
    _check_argnums_as_jax_jit,
    complete_argnums,
    with_jits_donations,
    with_jits_statics,
)
from pathways_jax._src.api.jit_shardings import (
    jit_with_shardings,
    jits_device,
    jits_keep_unused,
    with_jits_out_shardings,
)
from pathways_jax._src.api.placement import _mesh_of, _single_device_of
from pathways_jax._src.api.tracing import Program
from pathways_jax._src.core import errors
from pathways_jax._src.runtime import clusters, slices
from pathways_jax._src.runtime.slices import VirtualSlice


@overload
def program(
    fun: Callable[..., Any],
    *,
    devices: VirtualSlice | None = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    name: str | None = None,
    fuse: bool = True,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    device: jax.Device | None = None,
    backend: str | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Program: ...


@overload
def program(
    fun: None = None,
    *,
    devices: VirtualSlice | None = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    name: str | None = None,
    fuse: bool = True,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    device: jax.Device | None = None,
    backend: str | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Callable[[Callable[..., Any]], Program]: ...


def program(
    fun: Callable[..., Any] | None = None,
    *,
    devices: VirtualSlice | None = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    name: str | None = None,
    fuse: bool = True,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    device: jax.Device | None = None,
    backend: str | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
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
      keep_unused: as in ``jax.jit``: with no slice, a committed argument the
        function does not use places the call only when True (its outputs are
        otherwise uncommitted, as ``jax.jit``'s). Unused arguments are never
        transferred or read, kept or not.
      inline: accepted as ``jax.jit`` accepts it (an inlining hint for an
        enclosing trace); no effect on a program's results.
      compiler_options: XLA options every node of the program is compiled
        with, as in ``jax.jit`` (local backend; Ray hosts compile with theirs).
      device: as ``jax.jit``'s (deprecated there): a program with no slice runs
        on this device.
      backend: as ``jax.jit``'s (deprecated there): a program with no slice
        runs on the first device of this platform (``"cpu"``).
      graph: as ``nnx.jit``'s, for Flax NNX objects among the arguments: False
        takes modules as pytrees (Flax's tree mode). None (the default) takes
        ``nnx.set_graph_mode``'s setting at the call.
      graph_updates: as ``nnx.jit``'s: False propagates only Variable updates
        (no structural changes). None takes ``nnx.set_graph_updates``'s setting at the call.

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
            graph=graph,
            graph_updates=graph_updates,
        )
    if not callable(fun):
        raise errors.ProgramTraceError(f"pw.program expects a function, got {type(fun).__name__}: {fun!r}.")
    if devices is not None and not isinstance(devices, VirtualSlice):
        raise errors.PlacementError(
            f"pw.program(devices=...) expects a slice from pw.devices(...), got {devices!r}."
        )
    # As jax.jit's: None is "not given", and given both (even one empty) each is taken as it is.
    statics, static_names = with_jits_statics(fun, *complete_argnums(fun, static_argnums, static_argnames))
    _check_argnums_as_jax_jit(
        fun, static_argnums, static_argnames, donate_argnums, donate_argnames, empty_is_unset=False
    )
    # A wrapped jax.jit's donations are the program's own (they consume the caller's arrays).
    donate, donate_names = with_jits_donations(
        fun, *complete_argnums(fun, donate_argnums, donate_argnames, "donate")
    )
    del inline  # a hint with no effect on a program's results (see Args)
    keeps = bool(keep_unused) or jits_keep_unused(fun)  # a wrapped jax.jit's own too
    if device is None and backend is not None:
        try:
            device = jax.devices(backend)[0]
        except RuntimeError as exc:
            raise errors.PlacementError(
                f"pw.program(backend={backend!r}): this process has no such platform ({exc}); "
                f"its devices are {jax.devices()[0].platform}."
            ) from exc
    if device is None:
        # As jax.jit: shardings on one device (SingleDeviceSharding) run the function there,
        # the program's own or those of the jax.jit function it wraps.
        device = _single_device_of(in_shardings, out_shardings) or jits_device(fun)
    if device is not None and not isinstance(device, jax.Device):
        raise errors.PlacementError(f"pw.program(device=...) expects a jax.Device, got {device!r}.")
    for option, value in (("graph", graph), ("graph_updates", graph_updates)):
        if value is not None and not isinstance(value, bool):
            raise errors.ProgramTraceError(
                f"pw.program({option}=...) expects True, False or None (Flax's setting at the call), "
                f"as nnx.jit does; got {value!r}."
            )
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise errors.ProgramTraceError(
            f"pw.program(compiler_options=...) expects a dict of XLA options, got {compiler_options!r}."
        )
    # A jax.jit function given out_shardings returns values sharded so, on Explicit axes too.
    fun = with_jits_out_shardings(fun)
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
    options = tuple(sorted((compiler_options or {}).items()))
    # Not kept for a slice (given, or entered): the program's graphs hold it, and a slice the user
    # drops must give its devices back, as a lambda's program lets it.
    placed = devices is not None or slices.current_slice() is not None
    key = (
        None
        if placed
        else _shared_key(fun, (statics, static_names, name, fuse, donate, donate_names, device))
    )
    key = key if key is None or mesh_hint is not None else (*key, options, graph, graph_updates, keeps)
    made = _shared(key) if mesh_hint is None else None
    if made is None:
        made = Program(
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
            compiler_options=options,
            nnx_modes=(graph, graph_updates),
            keep_unused=keeps,
            argnums_completed=True,
        )
        if mesh_hint is None:
            _share(key, made)
    return made


# As jax.jit(f) made again reuses what jax.jit(f) traced and compiled before, pw.program(f) made
# again with the same options (inline, `pw.program(train_step)(state, batch)` in a loop) is the
# program made before in this cluster: it traced anew at every call. Only for functions defined
# at a module's top level, which live as long as their module (a closure or lambda made anew is a
# new function, as for jax.jit), and made with no slice given or entered (its graphs would hold the
# slice); at most _SHARED_MAX, the least recently made again dropped first.
_SHARED: collections.OrderedDict[Any, tuple[Any, Program]] = collections.OrderedDict()
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 64


def _shared_key(fun: Any, options: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if type(fun) is not types.FunctionType or fun.__closure__ is not None:
        return None
    if "<" in fun.__qualname__:  # a lambda, or a function defined inside another
        return None
    return (fun, *options)


def _shared(key: tuple[Any, ...] | None) -> Program | None:
    if key is None:
        return None
    try:
        with _SHARED_LOCK:
            kept = _SHARED.get(key)
            if kept is not None:
                _SHARED.move_to_end(key)
    except TypeError:  # an option that cannot key a cache
        return None
    cluster = clusters.running()
    if kept is None or cluster is None or kept[0]() is not cluster:
        return None  # none yet, or made for a cluster since shut down
    return kept[1]


def _share(key: tuple[Any, ...] | None, made: Program) -> None:
    cluster = clusters.running()
    if key is None or cluster is None:
        return
    fun = key[0]
    try:
        with _SHARED_LOCK:
            # What no later call can take goes first: programs of clusters shut down, and those
            # of a function defined again under its name (a notebook cell run again), whose
            # compiled executables would otherwise live on until pushed out.
            for old in [
                k
                for k, (held, _) in _SHARED.items()
                if held() is not cluster
                or (
                    k[0] is not fun
                    and k[0].__module__ == fun.__module__
                    and k[0].__qualname__ == fun.__qualname__
                )
            ]:
                del _SHARED[old]
            _SHARED[key] = (weakref.ref(cluster), made)
            _SHARED.move_to_end(key)
            while len(_SHARED) > _SHARED_MAX:
                _SHARED.popitem(last=False)
    except TypeError:
        return


def _release_unheld() -> None:
    """Lets go of the programs only the registry holds (``Cluster._reclaim``, devices wanted).

    A notebook's ``del step`` leaves ``step``'s program here, and with it the
    one-device slice it runs on: a request for that device exclusively would
    wait for ever. A program the user still holds stays; one made again later
    from the same function is traced again.
    """
    with _SHARED_LOCK:
        kept = {key: (held, weakref.ref(made)) for key, (held, made) in _SHARED.items()}
        _SHARED.clear()
    gc.collect()  # a program in a reference cycle of its own goes here too
    with _SHARED_LOCK:
        for key, (held, made) in kept.items():
            program = made()
            if program is not None and key not in _SHARED:
                _SHARED[key] = (held, program)


clusters.RECLAIM_HOOKS.append(_release_unheld)

__all__ = ["program"]
