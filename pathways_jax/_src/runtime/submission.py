"""Submission: one call of a lowered plan becomes a run on the controller's queue, and its futures."""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pathways_jax._src.core import counts as counters
from pathways_jax._src.core import errors, timeline
from pathways_jax._src.core.charges import Charge
from pathways_jax._src.runtime import clients, context
from pathways_jax._src.runtime.futures import Future
from pathways_jax._src.runtime.object_store import ObjectStore, Owner

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan

_runs = itertools.count()


@dataclasses.dataclass(slots=True)
class Run:
    """One call of a program, queued for the controller."""

    id: int
    plan: Plan
    env: list[Any]
    future_inputs: list[tuple[int, Future]]
    outputs: list[Any]
    failed: bool = False
    # The client that submitted the run, its place in the submission order,
    # and what the scheduler and the memory budget know of it.
    client: Any = None
    seq: int = 0
    estimate: float = 0.0  # device-seconds charged to the client at dispatch
    transient: Charge = ()  # reserved bytes released when the run completes
    blocked_since: float | None = None  # when it first waited for memory
    blocked_ns: int = 0
    head: Any = (
        None  # how the scheduling policy sees it once queued (a scheduler.Head; cost refreshed when picked)
    )


def submit(plan: Plan, leaves: list[Any]) -> Any:
    """Queues one run with these argument leaves; returns the output pytree of futures."""
    rec = timeline.ACTIVE
    t0 = rec.now() if rec is not None else 0
    cl = plan.cluster
    if cl is None:  # a program that places nothing (it only returns literals)
        from pathways_jax._src.runtime import session as cluster_lib

        cl = cluster_lib.cluster()
    store = cl.store
    env = list(plan.template)
    shipped = plan.shipped_feeds
    staged = shipped or plan.staged_feeds
    if plan.host_feeds:
        _guard_host_feeds(plan, leaves)
    for index, slot, sharding in plan.host_feeds:
        leaf = leaves[index]
        if staged:  # shipped with the run's message, or put on devices at admission
            env[slot] = np.array(leaf, copy=True) if shipped or isinstance(leaf, np.ndarray) else leaf
            continue
        if isinstance(leaf, np.ndarray):
            # The transfer is asynchronous and the caller may change its numpy
            # array once the call returns: hand JAX a private copy.
            leaf = np.array(leaf, copy=True)
        env[slot] = jax.device_put(leaf, sharding)
    # The run holds its input futures until it is dispatched: their values
    # stay alive even if the caller drops them at once.
    future_inputs = [(slot, leaves[index]) for index, slot in plan.future_feeds]
    for index, slot in plan.array_feeds:
        leaf = leaves[index]
        if (
            type(leaf) is Future
        ):  # of the array's type, on its devices (Program._array_plan): read at dispatch
            future_inputs.append((slot, leaf))
        else:
            env[slot] = leaf
    client = clients.current()
    if client.closed:
        raise errors.ClusterError(f"{client!r} is closed; programs cannot be submitted for it.")
    run_id = next(_runs)
    owner = Owner(client.name, run_id, client.key)
    entries = store.new_run(owner, plan.outputs, plan.signatures)
    futures: list[Any] = [Future(entry, store) for entry in entries]
    for position, out in plan.special_outputs:
        entry = entries[position]
        if out.kind == "literal":
            store.set_ready(entry, out.where)
            if not isinstance(out.where, jax.Array):
                # float0 (no device holds it): host data, as jax.jit returns it; the entry goes.
                futures[position] = out.where
        elif out.kind == "argument":
            array = jnp.asarray(leaves[out.where])
            entry.sharding = array.sharding
            store.set_ready(entry, array)
    counters.bump("runs")
    cl.controller.submit(Run(run_id, plan, env, future_inputs, entries, client=client))
    if rec is not None:
        rec.submitted(plan, run_id, t0, owner.client)
    return jax.tree_util.tree_unflatten(plan.graph.out_tree, futures)


def _guard_host_feeds(plan: Plan, leaves: list[Any]) -> None:
    """``jax.transfer_guard`` for the host values a call passes, as ``jax.jit`` applies it.

    ``jax.jit`` moves a NumPy array or Python scalar argument to its devices
    implicitly, which a ``"disallow"`` guard refuses and a ``"log"`` guard
    logs; the run's own ``jax.device_put`` is explicit, which those allow.
    """
    guard = jax.config.jax_transfer_guard_host_to_device or jax.config.jax_transfer_guard  # type: ignore[attr-defined]
    if guard not in ("disallow", "log"):
        return
    index = plan.host_feeds[0][0]
    leaf = leaves[index]
    what = f"{type(leaf).__name__} of shape {np.shape(leaf)}"
    if guard == "disallow":
        raise errors.TransferError(
            f"program {plan.graph.name!r} was called with a host value ({what}, argument leaf {index}) "
            "under jax.transfer_guard('disallow'): as jax.jit, the implicit host-to-device transfer "
            "is refused. Put it on devices first (jax.device_put), or allow the transfer."
        )
    logging.warning("pathways_jax: host-to-device transfer of %s for program %r", what, plan.graph.name)


_AFTER_EXIT: dict[str, ObjectStore] = {}


def computed(tree: Any, origin: str, is_leaf: Any = None) -> Any:
    """Futures of values already computed in the caller (a program run op by op): ready at once.

    Under ``jax.disable_jit()`` a program runs its function eagerly, as ``jax.jit``
    does; its outputs are still returned as futures, so code that reads them with
    ``result()`` works unchanged.
    """
    from pathways_jax._src.runtime import session as cluster_lib

    running = cluster_lib.running()
    if running is not None or not context.exiting:
        store = cluster_lib.cluster().store
    else:  # after the exit hook: no cluster to start; the futures keep their own store
        store = _AFTER_EXIT.setdefault("store", ObjectStore())
    client = clients.current()
    owner = Owner(client.name, next(_runs), client.key)

    def future(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
            return leaf  # an NNX object (updated in place; see is_leaf) or another Python value: as it is
        array = leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)
        entry = store.new(owner, array.aval, array.sharding, None, origin)
        store.set_ready(entry, array)
        return Future(entry, store)

    return jax.tree_util.tree_map(future, tree, is_leaf=is_leaf)


__all__ = ["Run", "computed", "submit"]
