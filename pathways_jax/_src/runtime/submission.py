"""Submission: one call of a lowered plan becomes a run on the controller's queue, and its futures."""

from __future__ import annotations

import itertools
import operator
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pathways_jax._src.core import arrays, counts, errors, events, reentry
from pathways_jax._src.ir.signatures import FutureKey
from pathways_jax._src.runtime import clients, clusters, context
from pathways_jax._src.runtime.futures import Future, batch_values
from pathways_jax._src.runtime.object_store import ObjectStore, Owner
from pathways_jax._src.runtime.runs import Run

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan
    from pathways_jax._src.runtime.runnable import Runnable

_runs = itertools.count()


def submit(runnable: Runnable, leaves: list[Any]) -> Any:
    """Queues one run of ``runnable`` with these argument leaves; returns the output pytree of futures."""
    sink = events.SINK
    t0 = events.now() if sink is not None else 0
    run, cl = _run_of(runnable, leaves)
    plan = run.plan
    store = cl.store
    entries = run.outputs
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
            # Host data returned as it is lands where jnp.asarray puts it, uncommitted (as jax.jit's
            # output of it is): a future saying otherwise would refuse arrays committed elsewhere.
            entry.signature = FutureKey.of(array.aval, array.sharding, None, committed=False)
            store.set_ready(entry, array)
    counts.bump("runs")
    (cl._controller or cl.controller).submit(run)  # the property only to start it
    if sink is not None:
        sink(_submitted(plan, run, t0))
    return jax.tree_util.tree_unflatten(plan.graph.out_tree, futures)


def takes_values(runnable: Runnable) -> bool:
    """True when :func:`submit_values` may run ``runnable``: every output is a node's, no memory budget."""
    cl = runnable.cluster
    return cl is not None and not runnable.plan.special_outputs and cl.store.budget is None


def submit_values(runnable: Runnable, leaves: list[Any], wanted: Sequence[bool]) -> list[Any]:
    """Queues one run as :func:`submit`; returns its flat outputs, those ``wanted`` as arrays once dispatched.

    For a caller that writes outputs back at once (``nnx_graph``: the
    states of a step's NNX objects, as ``nnx.jit`` leaves ``jax.Array`` s in
    them): the run has one store entry for all its outputs, not one each
    (``ObjectStore.new_batch``); the call waits for its dispatch and reads
    them from it (see ``futures.batch_values``). A wanted output that comes
    back as a ``jax.Array`` is that array; the other outputs are futures.
    Only for a plan :func:`takes_values` accepts.
    """
    # A host callback on the controller's thread cannot wait for the run: it gets futures.
    batched = not reentry.inside.depth
    sink = events.SINK
    t0 = events.now() if sink is not None else 0
    run, cl = _run_of(runnable, leaves, batched)
    store = cl.store
    held = [run.batch] if batched else run.outputs  # (the run lets go of them once dispatched)
    counts.bump("runs")
    try:
        cl.controller.submit(run)
    except BaseException:
        store.free(list(held))  # nothing else holds them: the run's outputs go with it
        raise
    if sink is not None:
        sink(_submitted(run.plan, run, t0))
    if not batched:
        return [Future(entry, store) for entry in held]
    return batch_values(held[0], run.plan, runnable.output_slices, store, wanted)


def _submitted(plan: Plan, run: Run, start: int) -> events.Submitted:
    """The trace event of ``run`` (of ``plan``), submitted from ``start`` until now."""
    return events.Submitted(
        run.id, plan.graph.name, run.client.name, plan.prepared.reports, start, events.now()
    )


def _run_of(runnable: Runnable, leaves: list[Any], batched: bool = False) -> tuple[Run, Any]:
    """The run of ``runnable`` with these argument leaves, its outputs' entries made (``batched``:
    one entry for them all, ``Run.batch``); and its cluster."""
    plan = runnable.plan
    cl = runnable.cluster
    if cl is None:  # a program that places nothing (it only returns literals)
        cl = clusters.cluster()
    store = cl.store
    env = list(plan.template)
    shipped = plan.shipped_feeds
    staged = shipped or plan.staged_feeds
    # Host values go to the executables as they are, as jax.jit's call takes them: its C++ call
    # puts them on devices, about 10 µs a leaf less than a transfer of their own. Not where a
    # transfer guard is set (_guard_host_feeds), nor staged or shipped (below).
    as_is = not staged and not _guard_host_feeds(plan, leaves) if plan.host_feeds else False
    ticket = None
    for index in plan.unfed_ints:  # (usually none) as jax.jit refuses them, used or not
        _check_int(leaves[index], plan, index)
    if plan.staged_feeds:  # under a memory budget: queued runs hold these copies on the host
        ticket = _stage(cl, plan, leaves, env)
    for index, slot, sharding in plan.host_feeds:
        leaf = leaves[index]
        kind = type(leaf)
        if kind is int:
            _check_int(leaf, plan, index)
        if as_is:
            if kind in _AS_IS:  # immutable: a queued run may hold it as it is
                env[slot] = leaf
                continue
            if kind is np.ndarray and leaf.dtype in arrays.PLAIN:
                # The caller may change its array once the call returns, before a queued run is
                # dispatched: the run holds a private copy.
                env[slot] = np.array(leaf, copy=True)
                continue
        if staged:  # shipped with the run's message, or put on devices at admission
            if shipped:
                env[slot] = np.array(leaf, copy=True)
            elif not plan.staged_feeds or not isinstance(leaf, np.ndarray):
                env[slot] = leaf
            continue
        if isinstance(leaf, np.ndarray):
            # The transfer is asynchronous and the caller may change its numpy
            # array once the call returns: hand JAX a private copy.
            leaf = np.array(leaf, copy=True)
        env[slot] = arrays.put(leaf, sharding)
    # The run holds its input futures until it is dispatched: their values
    # stay alive even if the caller drops them at once.
    feeds = [leaves[index] for index in plan.future_indices]
    more: list[int] | None = None  # the feeds' slots, where futures came for arrays too
    for index, slot in plan.array_feeds:
        leaf = leaves[index]
        if (
            type(leaf) is Future
        ):  # of the array's type, on its devices (Program._array_plan): read at dispatch
            if more is None:
                more = list(plan.future_slots)
            more.append(slot)
            feeds.append(leaf)
        else:
            env[slot] = leaf
    client = clients.current()
    if client.closed:
        raise client.closed_error()
    run_id = next(_runs)
    owner = Owner(client.name, run_id, client.key)
    if batched:
        entries = []
        batch = store.new_batch(owner, f"program {plan.graph.name!r} run {run_id}")
    else:
        entries = store.new_run(owner, plan.outputs, plan.signatures, runnable.output_slices)
        batch = None
    return Run(
        run_id,
        plan,
        env,
        plan.future_slots if more is None else more,
        feeds,
        entries,
        client=client,
        staged=ticket,
        batch=batch,
    ), cl


def _stage(cl: Any, plan: Plan, leaves: list[Any], env: list[Any]) -> StagedBytes | None:
    """Private copies of the call's NumPy inputs, within the cluster's bound on staged bytes.

    Waits for room first (:class:`HostStaging`): the copies are made only once they fit.
    Returns what the run holds, released when it is admitted (or its copies are freed).
    """
    staging = _staging(cl)
    feeds = [(index, slot) for index, slot, _ in plan.host_feeds if isinstance(leaves[index], np.ndarray)]
    ticket = StagedBytes(staging, sum(leaves[index].nbytes for index, _ in feeds))
    if not ticket.nbytes:
        return None
    # Counted while the run holds it (Run.staged: a run failed or cancelled before admission goes,
    # and its copies with it) and until admission releases it.
    staging.reserve(ticket, plan.graph.name)
    for index, slot in feeds:
        env[slot] = np.array(leaves[index], copy=True)
    return ticket


def _check_int(leaf: int, plan: Plan, index: int) -> None:
    """Refuses, as ``jax.jit`` does, a Python int argument that does not fit JAX's integer type."""
    wide = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]
    bounds = np.iinfo(np.int64) if wide else np.iinfo(np.int32)
    if bounds.min <= leaf <= bounds.max:
        return
    raise errors.also(errors.ProgramTraceError, OverflowError)(
        f"program {plan.graph.name!r} got argument leaf {index}, the Python int {leaf}, which is too "
        f"large for {bounds.dtype.name}, the type JAX gives a Python int (jax_enable_x64 is {wide}): "
        "as jax.jit, a program refuses it. Pass it as a float, enable jax_enable_x64 for int64, or "
        "pass it through static_argnums."
    )


def _guard_host_feeds(plan: Plan, leaves: list[Any]) -> bool:
    """``jax.transfer_guard`` for the host values a call passes, as ``jax.jit`` applies it; whether one is set.

    ``jax.jit`` moves a NumPy array or Python scalar argument to its devices
    implicitly, which a ``"disallow"`` guard refuses and a ``"log"`` guard
    logs; the run's own ``jax.device_put`` is explicit, which those allow.
    True where a guard is set: the run then puts its host values on devices
    itself, at the call, so that the guard refuses or logs each once, where
    ``jax.jit`` does (the scalars an executable takes as they are would be
    refused inside the run's dispatch, or logged a second time).
    """
    guard = jax.config.jax_transfer_guard_host_to_device or jax.config.jax_transfer_guard  # type: ignore[attr-defined]
    if guard not in ("disallow", "log"):
        return guard is not None and guard != "allow"
    index = plan.host_feeds[0][0]
    leaf = leaves[index]
    what = f"{type(leaf).__name__} of shape {np.shape(leaf)}"
    if guard == "disallow":
        # Also jax.jit's class (jax.errors.JaxRuntimeError): `except` written for jax.jit catches it.
        raise errors.also(errors.TransferError, jax.errors.JaxRuntimeError)(
            f"program {plan.graph.name!r} was called with a host value ({what}, argument leaf {index}) "
            "under jax.transfer_guard('disallow'): as jax.jit, the implicit host-to-device transfer "
            "is refused. Put it on devices first (jax.device_put), or allow the transfer."
        )
    logging.warning("pathways_jax: host-to-device transfer of %s for program %r", what, plan.graph.name)
    return True


# Host values a run's executables take as they are (immutable, so a queued run may hold them):
# Python scalars and NumPy's scalars, of these exact types.
_AS_IS = arrays.PYTHON_SCALARS | arrays.NUMPY_SCALARS


class HostStaging:
    """The bytes of host inputs that queued runs hold under a memory budget, and their bound.

    Under a budget a queued run keeps private copies of its NumPy inputs on the
    host until it is admitted (``plan.staged_feeds``). ``max_queued`` alone
    bounded them by runs, not bytes: 1,500 calls with a 1 MiB input under an
    8 MiB budget held about a gigabyte. Now a call waits (on the caller's
    thread, as for ``max_queued``) until the copies held by all queued runs
    and its own fit in :attr:`bound`: the budget summed over the cluster's
    devices. A call whose inputs alone exceed it goes once nothing else is
    held. A run's bytes count until the backend puts its inputs on devices
    (admission) or the run goes before that (it failed or was cancelled: its
    ticket, held by the run alone, is garbage).

    What is held is read from the live tickets, weakly held here, whenever it is
    asked: no finalizer gives bytes back (a Python callback where a Ctrl-C landing
    is only reported, never raised, and the bytes lost), and a Ctrl-C anywhere in
    a call leaves nothing counted that no run holds.

    Attributes:
      bound: bytes the copies may take together.
      held: bytes held now.
      peak: the most held at once.
      waits: calls that waited for room.
    """

    def __init__(self, bound: int, timeout: float | None):
        self.bound = bound
        self.timeout = timeout
        self.peak = 0
        self.waits = 0
        self._tickets: list[weakref.ref[StagedBytes]] = []  # reserved, weakly: see _held
        # Taken as the bare lock (``with self._lock``): a Condition's __enter__ is a Python frame,
        # where a Ctrl-C landing as the lock is taken would leave it held (see core.locks).
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)

    @property
    def held(self) -> int:
        """Bytes held now by queued runs' copies."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        """Bytes of the tickets still staged whose runs live; forgets the others (lock held)."""
        live = [ref for ref in self._tickets if (ticket := ref()) is not None and ticket.staging is self]
        self._tickets = live
        return sum(ticket.nbytes for ticket in map(operator.call, live) if ticket is not None)

    def reserve(self, ticket: StagedBytes, program: str) -> None:
        """Counts ``ticket``'s bytes, first waiting until they fit; raises ``BackPressureTimeout`` on timeout."""
        nbytes = ticket.nbytes
        with self._lock:
            held = self._held()
            if held and held + nbytes > self.bound and not reentry.inside.depth:
                # The runtime's own threads (a host callback calling a program) never wait here.
                self.waits += 1
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
                while held and held + nbytes > self.bound:
                    left = _LOOK_S if deadline is None else min(_LOOK_S, deadline - time.monotonic())
                    if left <= 0:
                        raise errors.BackPressureTimeout(
                            f"program {program!r}: a call with {nbytes} bytes of NumPy inputs waited "
                            f"{self.timeout}s (backpressure_timeout) while queued runs held {held} bytes "
                            f"of host inputs, at most {self.bound} under the memory budget (its bytes over "
                            "all devices). Wait for results before submitting more, drop futures you no "
                            "longer need so that queued runs are admitted, or raise memory_budget."
                        )
                    # Admission says so at once; a run that went unadmitted says nothing: look again.
                    self._room.wait(left)
                    held = self._held()
            self._tickets.append(weakref.ref(ticket))  # one C call: counted from here, or not at all
            self.peak = max(self.peak, held + nbytes)

    def release(self, ticket: StagedBytes) -> None:
        """Stops counting what ``ticket`` holds (its run was admitted)."""
        with self._lock:
            ticket.staging = None
            self._room.notify_all()


_LOOK_S = 0.05  # how often a call waiting for room for its host inputs looks again


class StagedBytes:
    """The host-input bytes one queued run holds against :class:`HostStaging`.

    Counted while the run holds it, until the backend puts the run's inputs on
    devices (admission: :meth:`release`).
    """

    __slots__ = ("__weakref__", "nbytes", "staging")

    def __init__(self, staging: HostStaging, nbytes: int):
        self.staging: HostStaging | None = staging
        self.nbytes = nbytes

    def release(self) -> None:
        staging = self.staging
        if staging is not None:
            staging.release(self)


_STAGING: weakref.WeakKeyDictionary[Any, HostStaging] = weakref.WeakKeyDictionary()
_STAGING_LOCK = threading.Lock()


def _staging(cl: Any) -> HostStaging:
    """The cluster's :class:`HostStaging` (made at its first staged call)."""
    staging = _STAGING.get(cl)
    if staging is None:
        with _STAGING_LOCK:
            staging = _STAGING.get(cl)
            if staging is None:
                budget = cl.store.budget
                staging = _STAGING[cl] = HostStaging(sum(budget.limits.values()), cl.backpressure_timeout)
    return staging


def host_staging(cl: Any) -> HostStaging | None:
    """The cluster's :class:`HostStaging`, if a call has staged host inputs yet (for tests and stats)."""
    return _STAGING.get(cl)


_AFTER_EXIT: dict[str, ObjectStore] = {}


def computed(tree: Any, origin: str, is_leaf: Any = None) -> Any:
    """Futures of values already computed in the caller (a program run op by op): ready at once.

    Under ``jax.disable_jit()`` a program runs its function eagerly, as ``jax.jit``
    does; its outputs are still returned as futures, so code that reads them with
    ``result()`` works unchanged.
    """
    running = clusters.running()
    if running is not None or not context.exiting:
        store = clusters.cluster().store
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


__all__ = ["HostStaging", "Run", "computed", "host_staging", "submit", "submit_values", "takes_values"]
