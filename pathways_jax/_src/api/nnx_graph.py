"""Flax NNX graph objects as program arguments, with the semantics of ``nnx.jit``.

A program called with NNX objects (modules, ``nnx.Optimizer``, ``nnx.Rngs``,
Variables, nested in tuples, lists and dicts) runs the way ``nnx.jit`` runs
its function: the objects are split into a pytree of states before the
program's own argument handling, an inner program (which sees only arrays
and futures) merges them back into objects inside its trace, calls the
user's function and returns the output with the updated states, and the
caller's objects are updated in place with those states: their Variables
then hold :class:`Future` s. Sharing between arguments is kept (a Variable
reached from two arguments is one input), as are new attributes and
returned objects.

This module owns that split/merge; it imports Flax only when a call has
NNX objects (``flax.nnx`` already imported), never at package import.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from pathways_jax._src.core import errors, reentry


class GraphArgument(Exception):
    """Raised by the argument signature for a leaf that is an NNX graph node or Variable."""


class GraphOutput(Exception):
    """Raised while a program is traced when its output holds NNX objects: it runs as ``nnx.jit`` runs it."""


def _nnx() -> Any:
    """``flax.nnx`` if it is imported, else None: no NNX object can exist without it."""
    return sys.modules.get("flax.nnx")


def is_graph_leaf(leaf: Any) -> bool:
    """True for an NNX Variable or graph node (a leaf of ``jax.tree`` when not a pytree)."""
    if _nnx() is None:
        return False
    from flax.nnx import graphlib

    return graphlib.is_graph_node(leaf)


def _is_object(leaf: Any, nnx: Any) -> bool:
    """An NNX graph node that is not a Variable: a module, ``nnx.Optimizer``, ``nnx.Rngs``."""
    from flax.nnx import graphlib

    return graphlib.is_graph_node(leaf) and not isinstance(leaf, nnx.Variable)


def has_graph_nodes(tree: Any) -> bool:
    """True when the pytree holds an NNX object (module, optimizer, Rngs) anywhere.

    Variables alone (an ``nnx.State`` from ``nnx.split``, functional style) are
    plain pytrees, as under ``jax.jit``: only objects, whose in-place updates
    the caller expects to see, are run as ``nnx.jit`` runs them.
    """
    nnx = _nnx()
    if nnx is None:
        return False
    import jax
    from flax.nnx import graphlib

    return any(
        _is_object(leaf, nnx) for leaf in jax.tree_util.tree_leaves(tree, is_leaf=graphlib.is_graph_node)
    )


def _is_inner(program: Any) -> bool:
    """True for an inner program made here (``Program.inner_program``): it takes NNX pytrees as plain pytrees.

    Routing its call here again would recurse: in Flax's tree mode its
    arguments are the caller's modules themselves.
    """
    return program._info.nnx_inner


def put_in_place(value: Any, sharding: Any) -> Any:
    """``jax.device_put(value, sharding)``, except that the NNX objects and Variables in it stay themselves.

    Their values are moved in place, so that ``nnx.jit`` still writes what a
    call changes back into the caller's objects: a copy of a module, as
    ``jax.device_put`` makes of a pytree, would take the updates and be dropped.
    """
    import jax
    from flax import nnx
    from flax.nnx import graphlib

    def move(leaf: Any) -> Any:
        if isinstance(leaf, nnx.Variable):
            leaf.set_value(jax.device_put(leaf.get_value(), sharding))
        elif graphlib.is_graph_node(leaf):
            nnx.update(leaf, jax.device_put(nnx.state(leaf), sharding))
        else:
            return jax.device_put(leaf, sharding)
        return leaf

    return jax.tree_util.tree_map(move, value, is_leaf=graphlib.is_graph_node)


def routes(program: Any, tree: Any) -> bool:
    """True when a program's arguments hold NNX objects it should run as ``nnx.jit`` does.

    The inner programs made here take NNX pytrees as plain pytrees (Flax's tree mode).
    """
    return not _is_inner(program) and has_graph_nodes(tree)


def takes_objects(program: Any, args: tuple, kwargs: dict) -> bool:
    """True when an argument itself (not nested) is an NNX object (a module, ``nnx.Optimizer``).

    A cheap look before the program flattens its arguments: a model and its
    optimizer flatten into every Variable, only to be routed here anyway.
    """
    nnx = _nnx()
    if nnx is None or _is_inner(program):
        return False
    return any(_is_object(arg, nnx) for arg in (*args, *kwargs.values()))


class _GraphCall:
    """The inner program of one program, and the tag of its Flax update context.

    The inner function is Flax's own ``JitFn`` (what ``nnx.jit`` traces): it
    merges the states into objects inside the trace, calls the user's
    function, and splits the arguments and the output again.
    """

    def __init__(self, program: Any):
        from flax.nnx.transforms import compilation

        self.program = weakref.proxy(program)
        inner = compilation.JitFn(program._info.fun, None, None, None, self)
        self.inner = program.inner_program(inner)
        # The last plan a repeat call ran, which of its outputs are states written back, its output tree.
        self._written: tuple[Any, tuple[bool, ...], Any] | None = None

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        from flax.nnx import extract, graphlib
        from flax.nnx.transforms import compilation

        with graphlib.update_context(self):
            pure_args, pure_kwargs = _to_tree(
                self.program,
                lambda: extract.to_tree((args, kwargs), split_fn=compilation._jit_split_fn, ctxtag=self),
            )
            stores: set[Any] = set()
            pure_out = self._repeat(pure_args, pure_kwargs)
            if pure_out is None:
                args_out, kwargs_out, user_out = _run(self.inner, pure_args, pure_kwargs, (args, kwargs))
                pure_out = (
                    _arrays(args_out, stores),
                    _arrays(kwargs_out, stores),
                    _returned_arrays(user_out),
                )
                del args_out, kwargs_out, user_out
            # The call's input states (the step before's arrays) stay held until the new ones
            # are written back, as under nnx.jit: then they go together, not one by one as each
            # Variable lets go (measured: 0.5 ms a call less at 446 states).
            _args_out, _kwargs_out, out = extract.from_tree(
                pure_out, merge_fn=compilation._jit_merge_fn, is_inner=False, ctxtag=self
            )
        del pure_out, _args_out, _kwargs_out, pure_args, pure_kwargs
        for store in stores:
            # The step's futures of the states written back are gone: their entries go now,
            # not at the next call, so that they die young (a train step makes hundreds).
            store.collect_dropped()
        return out

    def _repeat(self, pure_args: tuple, pure_kwargs: dict) -> Any:
        """The inner program's output of a repeat call, the states written back as arrays; None: not one.

        A train step called again with states of the types of the call before
        runs that call's plan (``Program.repeat_plan``) and reads the states it
        writes back as ``jax.Array`` s straight from the run, as :func:`_arrays`
        would from their futures, without making the futures
        (``submission.submit_values``): what ``nnx.jit`` leaves in the
        Variables, at a cost that is one pass over the outputs.
        """
        import jax

        from pathways_jax._src.runtime import submission

        repeat = self.inner.repeat_plan(pure_args, pure_kwargs)
        if repeat is None:
            return None
        runnable, leaves = repeat
        written = self._written
        if written is None or written[0] is not runnable:
            if not submission.takes_values(runnable):
                return None
            out_tree = runnable.plan.graph.out_tree
            written = self._written = (runnable, _written_back(out_tree), out_tree)
        values = submission.submit_values(runnable, leaves, written[1])
        return jax.tree_util.tree_unflatten(written[2], values)

    def graph(self, args: tuple, kwargs: dict) -> Any:
        from flax.nnx import extract, graphlib
        from flax.nnx.transforms import compilation

        with graphlib.update_context(self):
            pure_args, pure_kwargs = _to_tree(
                self.program,
                lambda: extract.to_tree((args, kwargs), split_fn=compilation._jit_split_fn, ctxtag=self),
            )
            return self.inner.graph(*pure_args, **pure_kwargs)


class _TreeCall:
    """The inner program in Flax's tree mode (``nnx.jit(graph=False)`` or no graph updates).

    The inner function is Flax's ``SimpleJitFn``: it returns the output and
    the Variables that changed, which are then written into the caller's.
    """

    def __init__(self, program: Any, graph: bool):
        from flax.nnx.transforms import compilation

        self.program = weakref.proxy(program)
        self.graph_mode = graph
        inner = compilation.SimpleJitFn(
            program._info.fun, None, None, frozenset(program._info.donate), frozenset(), graph, (None,)
        )
        self.inner = program.inner_program(inner)

    def _pure(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from flax.nnx import extract

        if self.graph_mode:
            return _to_tree(self.program, lambda: extract.to_tree2((args, kwargs)))
        return args, kwargs

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        from flax.nnx import extract

        original = (args, kwargs)
        args, kwargs = self._pure(args, kwargs)
        variables = extract.check_no_aliases("jit", args=args, kwargs=kwargs)
        out, updates = _run(self.inner, args, kwargs, original)
        extract.apply_updates(variables, _arrays(updates))
        return extract.from_tree2(out) if self.graph_mode else out

    def graph(self, args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._pure(args, kwargs)
        return self.inner.graph(*args, **kwargs)


_ARRAY_LIKE = (bool, int, float, complex)


def _arrays(states: Any, stores: set[Any] | None = None) -> Any:
    """The updated states written back into the caller's objects: ``jax.Array`` s once dispatched.

    As after an ``nnx.jit`` call, the caller's Variables then hold arrays that
    may still be computing, so eager code (``variable[...] = v``, a Dropout's
    key, ``nnx.clone``) works on the model between steps. The call waits for
    the run's dispatch, not its result. Values that cannot be had that way
    (Ray hosts, a controller service, a memory budget) stay :class:`Future` s;
    see ``futures.dispatched``. A run that failed at dispatch (a host callback
    that raised, ``jax_debug_nans``) raises its error, as an ``nnx.jit`` call
    does, and nothing is written back: the objects keep their states.
    """
    import jax

    from pathways_jax._src.runtime.futures import Future, dispatched_all, failure_of
    from pathways_jax._src.runtime.object_store import Failed

    leaves, treedef = jax.tree_util.tree_flatten(states)  # a future is a leaf of its own
    futures = [leaf for leaf in leaves if type(leaf) is Future]
    if not futures:
        return states
    if stores is not None:
        stores.add(futures[0]._store)
    values = dispatched_all(futures)
    for value in values:  # a run that failed at dispatch: the call raises, writing nothing back
        if type(value) is Future and isinstance(value._entry.state, Failed):
            raise failure_of(value._entry.state)
    if len(futures) < len(leaves):
        made = iter(values)
        return jax.tree_util.tree_unflatten(
            treedef, [next(made) if type(leaf) is Future else leaf for leaf in leaves]
        )
    return jax.tree_util.tree_unflatten(treedef, values)


def _written_back(out_tree: Any) -> tuple[bool, ...]:
    """Per output leaf of an inner program (``JitFn``'s (args, kwargs, output)): True for a state written back.

    The leaves :func:`_arrays` and :func:`_returned_arrays` turn into arrays:
    every leaf of the arguments' states, and those of the NNX objects the
    output returns.
    """
    import jax
    from flax.nnx import extract

    def is_states(leaf: Any) -> bool:
        return isinstance(leaf, extract.NodeStates)

    wanted = [False] * out_tree.num_leaves
    args_out, kwargs_out, user_out = jax.tree_util.tree_unflatten(out_tree, range(out_tree.num_leaves))
    for index in jax.tree_util.tree_leaves((args_out, kwargs_out)):
        wanted[index] = True
    for node in jax.tree_util.tree_leaves(user_out, is_leaf=is_states):
        if is_states(node):
            for index in jax.tree_util.tree_leaves(node):
                wanted[index] = True
    return tuple(wanted)


def _returned_arrays(out: Any) -> Any:
    """The output, with the states of the NNX objects it returns as ``jax.Array`` s once dispatched.

    As after ``nnx.jit``, a model a step returns (or creates) works eagerly at
    once (``variable[...] = v``, BatchNorm or Dropout in train mode, metrics);
    the output's other values stay :class:`Future` s.
    """
    import jax
    from flax.nnx import extract

    def is_states(leaf: Any) -> bool:
        return isinstance(leaf, extract.NodeStates)

    return jax.tree_util.tree_map(lambda x: _arrays(x) if is_states(x) else x, out, is_leaf=is_states)


def _run(inner: Any, args: tuple, kwargs: dict, original: Any) -> Any:
    try:
        return inner(*args, **kwargs)
    except errors.ProgramTraceError as exc:
        _explain(inner, original, exc)
        raise


def _explain(inner: Any, original: Any, exc: Exception) -> None:
    """Names the NNX Variable holding a value a program cannot take (once a call failed)."""
    import jax
    import numpy as np
    from flax import nnx
    from flax.nnx import graphlib

    from pathways_jax._src.runtime.futures import Future

    taken = (jax.Array, np.ndarray, np.generic, Future, *_ARRAY_LIKE)
    for top, node in jax.tree_util.tree_leaves_with_path(original, is_leaf=graphlib.is_graph_node):
        if not graphlib.is_graph_node(node):
            continue
        for path, value in nnx.iter_graph(node, graph=True):  # also under nnx.set_graph_mode(False)
            if not isinstance(value, nnx.Variable):
                continue
            held = value.get_value()
            if all(isinstance(leaf, taken) for leaf in jax.tree_util.tree_leaves(held)):
                continue
            where = jax.tree_util.keystr(top[1:]) + "".join(f".{part}" for part in path)
            raise errors.ProgramTraceError(
                f"program {inner.name!r} ({inner.source_info}) got Flax NNX objects whose "
                f"{type(value).__name__} at argument {where} holds a {type(held).__name__}; expected every "
                "Variable to hold a jax.Array, numpy array, Python scalar or pw.Future, as "
                "nnx.jit does. Keep other values in plain attributes (static), or out of the "
                "arguments."
            ) from exc


def _to_tree(program: Any, split: Any) -> Any:
    try:
        return split()
    except errors.PathwaysError:
        raise
    except Exception as exc:
        if reentry.from_signal_handler(exc):
            raise  # the caller's own (a time budget's alarm), not a fault of the objects
        raise errors.ProgramTraceError(
            f"program {program.name!r} ({program.source_info}) got Flax NNX objects it cannot "
            f"split into states the way nnx.jit does: {type(exc).__name__}: {exc}. Pass NNX "
            "modules, nnx.Optimizer, nnx.Rngs and Variables (in tuples, lists or dicts) whose "
            "states hold arrays, or split them yourself with nnx.split and pass the state."
        ) from exc


def _inner(program: Any) -> _GraphCall | _TreeCall:
    if _is_inner(program):  # a graph node that is not a pytree, in tree mode
        raise errors.ProgramTraceError(
            f"program {program.name!r} ({program.source_info}) got a Flax NNX object that is not "
            "a pytree while nnx.set_graph_mode(False) is in effect; as with nnx.jit, tree mode "
            "takes only pytree modules. Use graph mode, or make the module a pytree."
        )
    graph, updates = _modes()
    chosen_graph, chosen_updates = program._info.nnx_modes  # nnx.jit's graph= and graph_updates=
    if chosen_graph is not None:
        graph = chosen_graph
    if chosen_updates is not None:
        updates = chosen_updates
    key = (graph, updates)
    calls = program.__dict__.setdefault("_nnx_calls", {})
    call = calls.get(key)
    if call is None:
        with program._lock:
            call = calls.get(key)
            if call is None:
                call = _GraphCall(program) if graph and updates else _TreeCall(program, graph)
                calls[key] = call
    return call


def _modes() -> tuple[bool, bool]:
    from flax.nnx import graphlib

    return bool(graphlib.set_graph_mode.current_value()), bool(graphlib.set_graph_updates.current_value())


def call(program: Any, args: tuple, kwargs: dict) -> Any:
    """Runs ``program`` on arguments holding NNX objects, as ``nnx.jit`` would run it."""
    return _inner(program)(args, kwargs)


def graph(program: Any, args: tuple, kwargs: dict) -> Any:
    """The graph ``program`` traces into for arguments holding NNX objects."""
    return _inner(program).graph(args, kwargs)
