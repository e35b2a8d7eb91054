"""Lowering: a Graph plus the current virtual-to-physical map becomes a Plan.

A Plan is what the controller runs: slots for values, host feeds, moves
between slices, and compiled executables, all decided once per mapping.
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import hashlib
import itertools
import re
import warnings
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from pathways_jax._src.compile import lowering_log
from pathways_jax._src.compile.executable_cache import ExecutableCache
from pathways_jax._src.compile.placement import NOWHERE, Placement
from pathways_jax._src.core import charges as charges_lib
from pathways_jax._src.core import counts, errors, events
from pathways_jax._src.core.charges import Charge, charge_of
from pathways_jax._src.core.jax_context import trace_context as _trace_context
from pathways_jax._src.core.meshes import only_mesh, spec_parts
from pathways_jax._src.ir.graph import Graph, Node, SliceRef
from pathways_jax._src.ir.signatures import FutureKey

if TYPE_CHECKING:
    from pathways_jax._src.ir.signatures import Signature

_plans = itertools.count()


@dataclasses.dataclass(frozen=True, slots=True)
class MoveStep:
    """Copy ``src`` to ``dst`` with ``sharding``: a transfer between slices, or a reshard."""

    src: int
    dst: int
    sharding: jax.sharding.Sharding
    kind: Literal["ici", "dcn"] | None
    aval: Any  # the moved value's shape and dtype (backends moving it between hosts need them)


@dataclasses.dataclass(frozen=True, slots=True)
class ExecStep:
    """Dispatch one compiled node."""

    executable: Any
    in_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    node: Node
    island: int
    pinned: tuple[tuple[int, jax.Device], ...] = ()
    # Executables over several devices may hold collectives, and ones that call
    # back into Python hold a host thread each: they count against the island's
    # in-flight bound. Other single-device ones neither rendezvous nor block.
    windowed: bool = True
    # (serialized jax.export bytes, fingerprint) for remote hosts; None locally.
    exported: tuple[bytes, str] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class OutputSlot:
    """Where a program output comes from: a slot, a host argument, or a literal."""

    kind: Literal["slot", "argument", "literal"]
    where: Any
    aval: Any
    sharding: Any
    slice: SliceRef | None
    origin: str
    committed: bool = True  # False: an uncommitted one-device output, as jax.jit's (Graph.uncommitted_slice)

    @property
    def signature(self) -> FutureKey | None:
        """The argument cache key of futures made from this output (None: compute later)."""
        if self.sharding is None:
            return None
        return FutureKey.of(self.aval, self.sharding, self.slice, self.committed)


class AccountingGroup(NamedTuple):
    """The nodes of a plan on one set of devices: the accounting watcher times a run by them.

    A run's work on ``devices`` is done when the output in ``slot`` (of the
    last of those nodes) is ready; its ``node_count`` nodes there share that time.
    """

    devices: tuple[int, ...]  # device ids, sorted
    slot: int
    node_count: int


def _spec_fits(spec: PartitionSpec, mesh: jax.sharding.Mesh, shape: tuple[int, ...]) -> bool:
    parts = spec_parts(spec, mesh.shape)
    return (
        parts is not None
        and len(parts) <= len(shape)
        and all(dim % count == 0 for dim, count in zip(shape, parts, strict=False))
    )


def _target(spec: PartitionSpec | None, current: Any, mesh: jax.sharding.Mesh, aval: Any) -> NamedSharding:
    """The sharding a node input should have on ``mesh``.

    On a slice with Explicit axes the value's type says it (its trace saw the
    input so: see ``devices.explicit_view``); otherwise the node's spec, else
    the value's own spec where it fits ``mesh`` (whatever mesh it came on),
    else replicated.
    """
    typed = getattr(aval, "sharding", None)
    if isinstance(typed, NamedSharding) and AxisType.Explicit in typed.mesh.axis_types:
        return NamedSharding(mesh, typed.spec)
    if spec is not None:
        return NamedSharding(mesh, spec)
    if isinstance(current, NamedSharding) and _spec_fits(current.spec, mesh, aval.shape):
        return NamedSharding(mesh, current.spec)
    return NamedSharding(mesh, PartitionSpec())


def _calls_host(jaxpr: Any) -> bool:
    """True if a jaxpr (or one nested in it) calls back into Python on the host."""
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            return True
        for sub in jex.jaxprs_in_params(eqn.params):
            if _calls_host(sub):
                return True
    return False


def _pinned_device(sharding: Any) -> jax.Device | None:
    """The device of a "maximal" sharding (one device holds the value), else None."""
    hlo = getattr(sharding, "_hlo_sharding", None)
    if hlo is None or not hlo.is_maximal() or hlo.is_replicated():  # "tile maximal" covers replicated too
        return None
    devices = hlo.tile_assignment_devices()
    return sharding._device_assignment[devices[0]] if devices else None


def _same(a: Any, b: Any, ndim: int) -> bool:
    try:
        return a is not None and a.is_equivalent_to(b, ndim)
    except (AttributeError, ValueError, TypeError):
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """What a backend adds to a compiled plan: ``Backend.prepare``'s answer.

    Attributes:
      windowed: executables (or host messages) a run puts in each window: its
        key is an island, or a device's window (``backends.base.device_window_key``).
      islands: the islands a run's work goes to.
      reports: dispatch reports a run makes to a trace.
      part: the backend's own part of the plan (the local backend's lanes,
        the Ray hosts' parts), read by that backend alone.
    """

    windowed: collections.abc.Mapping[int, int]
    islands: frozenset[int] = frozenset()
    reports: int = 0
    part: Any = None


class Plan:
    """A graph bound to physical devices: what the controller executes per run.

    Frozen once compiled: nothing sets an attribute of a plan after its
    construction. Its backend's part comes as a copy (:meth:`with_prepared`).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"a Plan is frozen once compiled; cannot set {name!r} (a backend's part goes in "
                "Plan.with_prepared)"
            )
        object.__setattr__(self, name, value)

    def __init__(
        self,
        graph: Graph,
        signature: Signature,
        placement: Placement = NOWHERE,
        donated: frozenset[int] = frozenset(),
    ):
        self.graph = graph
        self.key = next(_plans)  # never reused, unlike id(): accounting keys its figures by it
        self.donated_args = donated  # argument leaves the caller donated (donate_argnums)
        # Future feed slots whose buffer an executable consumes: their futures are spent.
        self.consumed_feeds: frozenset[int] = frozenset()
        # Where the graph's slices are and what runs them: all lowering reads of the runtime.
        self.placement = placement
        self.template: list[Any] = []
        target = placement.target
        self.host_feeds: list[tuple[int, int, Any]] = []  # (arg index, slot, sharding)
        self.input_charges: list[Charge] = []  # bytes of each host feed on its devices
        self.array_feeds: list[tuple[int, int]] = []  # (arg index, slot): taken as is
        self.future_feeds: list[tuple[int, int]] = []  # (arg index, slot)
        self.feed_shardings: dict[int, Any] = {}  # slot -> sharding of the future fed there
        self.steps: list[MoveStep | ExecStep] = []
        self.outputs: list[OutputSlot] = []
        # Static bytes of what each step makes, by slot: reserved under a memory budget.
        self.slot_charge: dict[int, Charge] = {}
        self.step_charge: list[tuple[str, Charge]] = []  # (what, bytes per device) per step
        self._lower(signature)
        self._account()
        if self.consumed_feeds and target is not None and not target.donates:
            self.consumed_feeds = frozenset()  # compiled without donation there
        if placement.limits is not None:
            self.check_budget(placement.limits)
        # Under a budget, a queued run holds its host inputs on the host: the
        # controller puts them on devices when it admits the run.
        self.staged_feeds = (
            placement.limits is not None
            and target is not None
            and target.stages_inputs
            and bool(self.host_feeds)
        )
        # A backend that does not stage inputs ships them with the run's message.
        self.shipped_feeds = target is not None and not target.stages_inputs
        self.signatures = [out.signature for out in self.outputs]
        # The runtime's own slice of each output, as its placement holds it (``Placed.held``),
        # for the futures a run makes: looked up once here, not per call.
        self.output_slices = [
            placement.slices[out.slice.id].held if out.slice is not None else None for out in self.outputs
        ]
        # Outputs submission makes ready itself (literals, arguments returned as they are).
        self.special_outputs = [(i, out) for i, out in enumerate(self.outputs) if out.kind != "slot"]
        self.slot_outputs = {out.where: out for out in self.outputs if out.kind == "slot"}
        # How many windowed executables the plan puts on each island: a run
        # may be dispatched on the caller's thread only if they all fit now.
        # XLA's CPU client runs executables that call back into Python on the
        # dispatching thread; such runs always go through the controller's
        # thread so that the caller never waits for them.
        self.inline_ok = not any(
            isinstance(step, ExecStep) and _calls_host(step.node.jaxpr.jaxpr) for step in self.steps
        )
        self.windowed: dict[int, int] = collections.Counter(
            step.island for step in self.steps if isinstance(step, ExecStep) and step.windowed
        )
        # Until its backend prepares it (a plan that places nothing never is): no part of a backend's.
        self.prepared = Prepared(self.windowed, self.islands)
        self._frozen = True

    def with_prepared(self, prepared: Prepared) -> Plan:
        """This plan with its backend's part: a copy holding ``prepared`` (this one is unchanged)."""
        plan = copy.copy(self)
        object.__setattr__(plan, "prepared", prepared)
        return plan

    def _new_slot(self, value: Any = None) -> int:
        self.template.append(value)
        return len(self.template) - 1

    def _lower(self, signature: Signature) -> None:
        lowering = _Lowering(self, signature)
        for kind, index in self.graph.steps:
            if kind == "node":  # a transfer is materialised where a node first reads the moved value
                lowering.node(self.graph.nodes[index])
        self.consumed_feeds = frozenset(slot for _, slot in self.future_feeds if slot in lowering.consumed)
        for out in self.graph.outputs:
            self.outputs.append(lowering.output(out))

    def _note_bytes(self, what: str, slots: list[int], avals: list[Any], shardings: list[Any]) -> None:
        total: dict[int, int] = {}
        for slot, aval, sharding in zip(slots, avals, shardings, strict=True):
            charge = charge_of(aval, sharding)
            self.slot_charge[slot] = charge
            charges_lib.add(total, charge)
        self.step_charge.append((what, tuple(sorted(total.items()))))

    def _account(self) -> None:
        """Byte counts, accounting groups and islands of the plan (after ``_lower``)."""
        total: dict[int, int] = {}
        for charge in self.slot_charge.values():
            charges_lib.add(total, charge)
        self.charge: Charge = tuple(sorted((d, b) for d, b in total.items() if b))
        # Under a memory budget a run also holds its host inputs once on devices:
        # they are put there only when the run is admitted, and count until it completes.
        for charge in self.input_charges:
            charges_lib.add(total, charge)
        self.admit_charge: Charge = tuple(sorted((d, b) for d, b in total.items() if b))
        seen: set[int] = set()
        out_charges: list[Charge | None] = []
        for out in self.outputs:
            if out.kind == "slot" and out.where in self.slot_charge and out.where not in seen:
                seen.add(out.where)
                out_charges.append(self.slot_charge[out.where])
            else:
                out_charges.append(None)
        self.out_charges = out_charges
        # Accounting: per set of devices, the slot of the last node there and
        # how many nodes ran there; the watcher times the run by their readiness.
        groups: dict[tuple[int, ...], AccountingGroup] = {}
        islands: set[int] = set()
        for step in self.steps:
            if isinstance(step, ExecStep):
                islands.add(step.island)
                if not step.out_slots:
                    continue
                key = tuple(sorted(self.placement.device_ids(step.node.slice.id)))
                count = groups[key].node_count + 1 if key in groups else 1
                groups[key] = AccountingGroup(key, step.out_slots[0], count)
        self.acct_groups = tuple(groups.values())
        self.devices = frozenset(d for key in groups for d in key)
        self.islands = frozenset(islands)

    def check_budget(self, limits: collections.abc.Mapping[int, int]) -> None:
        """Raises ``ResourceError`` if this plan's outputs can never fit a budget of ``limits`` (bytes by device id)."""
        for what, charge in self.step_charge:
            for d, b in charge:
                if b > limits.get(d, b):
                    raise errors.ResourceError(
                        f"program {self.graph.name!r}: the outputs of {what} need {b} bytes on "
                        f"device {d}, but its memory budget is {limits[d]} bytes; it can never "
                        "run. Shard the value over more devices, make it smaller, or raise "
                        "pw.init(memory_budget=...)."
                    )
        for d, b in self.admit_charge:
            if b > limits.get(d, b):
                raise errors.ResourceError(
                    f"program {self.graph.name!r} ({self.graph.source_info}): its nodes' outputs "
                    f"and host inputs together need {b} bytes on device {d}, but its memory budget is "
                    f"{limits[d]} bytes; a run can never be admitted. Split the program, or raise "
                    "pw.init(memory_budget=...)."
                )

    def is_current(self) -> bool:
        """False when a slice was released or remapped, so the plan must be lowered again."""
        return self.placement.current()

    @property
    def cluster(self) -> Any:
        """The runtime's cluster the plan runs on (None: it places nothing); lowering never reads it."""
        return self.placement.owner

    @property
    def backend(self) -> Any:
        """The cluster's backend (None: the plan places nothing)."""
        owner = self.placement.owner
        return owner.backend if owner is not None else None


class _Lowering:
    """Lowering one graph into its plan's steps: which slot holds each value, with which sharding.

    Made per plan and dropped after. It reads the plan's placement and
    donated arguments and appends to the plan's template, feeds and steps.
    """

    def __init__(self, plan: Plan, signature: Signature):
        self.plan = plan
        graph = plan.graph
        self.graph = graph
        self.values = graph.values
        self.home: dict[int, tuple[int, Any]] = {}  # vid -> (slot, sharding) on devices
        self.host_arg: dict[int, int] = {}  # vid -> argument index (numpy/scalar)
        self.const_data: dict[int, Any] = {c.value: c.data for c in graph.consts}
        self.placed: dict[tuple[int, Any], int] = {}  # (vid, sharding) -> slot
        self.transfer_of = {t.output: t for t in graph.transfers}
        self.donated_values: set[int] = set()  # program inputs the caller gave up
        self.input_values: dict[int, int] = {}  # vid -> argument leaf index
        self.made_here: set[int] = set()  # values a step of this plan makes
        self.consumed: set[int] = set()  # future feed slots whose buffer an executable takes
        self._feed(signature)
        self.readers: collections.Counter[int] = collections.Counter()
        for node in graph.nodes:
            self.readers.update(node.inputs)
        for t in graph.transfers:
            self.readers[t.value] += 1
        self.computations = collections.Counter(self.readers)  # readers other than the program's outputs
        for out in graph.outputs:
            if out.value is not None:
                self.readers[out.value] += 2  # never donate what the program returns

    def _feed(self, signature: Signature) -> None:
        """A slot (or a host argument) for each program input, by its kind in ``signature``."""
        plan = self.plan
        for inp in self.graph.inputs:
            self.input_values[inp.value] = inp.index
            if inp.index in plan.donated_args:
                self.donated_values.add(inp.value)
            key = signature[inp.index]
            if key.kind == "future":
                slot = plan._new_slot()
                plan.future_feeds.append((inp.index, slot))
                plan.feed_shardings[slot] = key.sharding
                self.home[inp.value] = (slot, key.sharding)
            elif key.kind == "array":
                slot = plan._new_slot()
                plan.array_feeds.append((inp.index, slot))
                self.home[inp.value] = (slot, key.sharding)
            else:  # a numpy array or Python scalar: put on devices per run
                self.host_arg[inp.value] = inp.index

    def materialise(self, vid: int, target: NamedSharding, ndim: int) -> int:
        """A slot holding value ``vid`` with sharding ``target``, adding steps as needed."""
        plan, values, home, placed = self.plan, self.values, self.home, self.placed
        key = (vid, target)
        if key in placed:
            return placed[key]
        if vid in self.transfer_of and vid not in home:
            t = self.transfer_of[vid]
            src_slot, _ = home.get(t.value, (None, None))
            if src_slot is None:  # a host value moved between slices: feed it directly
                slot = self.materialise(t.value, target, ndim)
            else:
                slot = plan._new_slot()
                kind = plan.placement.kind(t.src.id, t.dst.id)  # where the slices are now
                plan.steps.append(MoveStep(src_slot, slot, target, kind, values[vid].aval))
                plan._note_bytes(
                    f"{kind} transfer of {values[vid].origin}", [slot], [values[vid].aval], [target]
                )
                self.made_here.add(vid)
            home[vid] = (slot, target)
            placed[key] = slot
            return slot
        if vid in home:
            slot, current = home[vid]
            if _same(current, target, ndim):
                placed[key] = slot
                return slot
            out = plan._new_slot()
            plan.steps.append(MoveStep(slot, out, target, None, values[vid].aval))
            plan._note_bytes(f"reshard of {values[vid].origin}", [out], [values[vid].aval], [target])
            placed[key] = out
            return out
        slot = plan._new_slot()
        if vid in self.host_arg:
            plan.host_feeds.append((self.host_arg[vid], slot, target))
            plan.input_charges.append(charge_of(values[vid].aval, target))
        else:
            plan.template[slot] = jax.device_put(self.const_data[vid], target)
        placed[key] = slot
        return slot

    def _inputs(self, node: Node, mesh: Any) -> tuple[list[int], list[NamedSharding], list[int]]:
        """The slots a node reads, their shardings, and the positions it may donate."""
        in_slots: list[int] = []
        shardings: list[NamedSharding] = []
        donate: list[int] = []
        home, transfer_of = self.home, self.transfer_of
        for position, (vid, spec) in enumerate(zip(node.inputs, node.in_specs, strict=True)):
            aval = self.values[vid].aval
            current = None
            if vid in home:
                current = home[vid][1]
            elif vid in transfer_of and transfer_of[vid].value in home:
                current = home[transfer_of[vid].value][1]
            target = _target(spec, current, mesh, aval)
            in_slots.append(self.materialise(vid, target, len(aval.shape)))
            shardings.append(target)
            wants = node.donated[position] or vid in self.donated_values
            if wants and self.readers[vid] == 1 and (vid in self.made_here or vid in self.input_values):
                donate.append(position)
                if vid in self.input_values and vid in home and home[vid][0] == in_slots[-1]:
                    self.consumed.add(in_slots[-1])  # the caller's own buffer goes
            elif wants and vid in self.input_values and self.computations[vid] > 1:
                # Read by several computations: the donation cannot be honoured. A value this
                # node alone reads and the program also returns (a TrainState's key) is kept
                # without a word: the caller gets that buffer back, as jax.jit's aliasing would.
                _warn_donation(self.graph, node, self.input_values[vid])
        return in_slots, shardings, donate

    def node(self, node: Node) -> None:
        """The step that runs ``node``: its inputs materialised, its executable compiled."""
        plan, graph = self.plan, self.graph
        placed_on = plan.placement.slices[node.slice.id]
        mesh = placed_on.mesh
        target = plan.placement.target
        if target is not None and not target.calls_back and _calls_host(node.jaxpr.jaxpr):
            raise errors.PlacementError(
                f"node {node.name!r} ({node.source_info}) calls back into Python on the host "
                f"(pure_callback, io_callback or debug printing); the {target.name!r} backend "
                "ships computations with jax.export, which cannot carry a Python callback to another "
                "process. Move the callback out of the program, or use backend='local'."
            )
        in_slots, shardings, donate = self._inputs(node, mesh)
        out_shardings = tuple(
            NamedSharding(mesh, spec) if spec is not None else None for spec in node.out_specs
        )
        export = target is not None and target.exports
        executable, exported = _compile(
            node,
            mesh,
            tuple(shardings),
            out_shardings,
            tuple(donate),
            plan.placement.executables,
            export=export,
            platforms=target.export_platforms if target is not None else None,
            options=graph.compiler_options,
            loose=_loose_device(graph, node, mesh) if not export else None,
        )
        produced = jax.tree_util.tree_leaves(executable.output_shardings)
        pinned = []
        for position, sharding in enumerate(produced):
            device = _pinned_device(sharding)
            if device is not None:
                # The compiler pinned this output to one device (host callbacks
                # do). Its other shards hold garbage, so the value is the one
                # shard: consumers move it from that device like any other.
                pinned.append((position, device))
                produced[position] = jax.sharding.SingleDeviceSharding(device)
        out_slots = []
        for vid, sharding in zip(node.outputs, produced, strict=True):
            slot = plan._new_slot()
            self.home[vid] = (slot, sharding)
            self.made_here.add(vid)
            out_slots.append(slot)
        plan.steps.append(
            ExecStep(
                executable,
                tuple(in_slots),
                tuple(out_slots),
                node,
                placed_on.island,
                tuple(pinned),
                windowed=mesh.devices.size > 1 or _calls_host(node.jaxpr.jaxpr),
                exported=exported,
            )
        )
        plan._note_bytes(
            f"node {node.name!r} ({node.source_info})",
            out_slots,
            [self.values[vid].aval for vid in node.outputs],
            produced,
        )

    def output(self, out: Any) -> OutputSlot:
        """Where a run finds program output ``out``: a slot, a literal or an argument."""
        graph, plan = self.graph, self.plan
        if out.value is None:
            literal = jnp.asarray(out.literal)
            if isinstance(literal, jax.Array):
                aval, sharding = literal.aval, literal.sharding
            else:  # float0 (the gradient of an integer input): host data, as jax.jit returns it
                aval, sharding = jax.core.ShapedArray(np.shape(literal), literal.dtype), None
            return OutputSlot("literal", literal, aval, sharding, None, f"{graph.name}: literal")
        value = self.values[out.value]
        if value.aval.dtype == jax.dtypes.float0:
            # Computed float0 (a gradient of an integer input): no data, so host zeros, as jax.jit gives.
            zeros = jnp.asarray(np.zeros(value.aval.shape, jax.dtypes.float0))
            return OutputSlot("literal", zeros, value.aval, None, None, value.origin)
        if out.value in self.home:
            slot, sharding = self.home[out.value]
            committed = not (
                value.slice is not None
                and value.slice.id == graph.uncommitted_slice
                and len(sharding.device_set) == 1
            )
            return OutputSlot("slot", slot, value.aval, sharding, value.slice, value.origin, committed)
        if out.value in self.host_arg:
            return OutputSlot("argument", self.host_arg[out.value], value.aval, None, None, value.origin)
        slot = plan._new_slot(jax.device_put(self.const_data[out.value]))
        return OutputSlot("slot", slot, value.aval, plan.template[slot].sharding, None, value.origin)


def _loose_device(graph: Graph, node: Node, mesh: Any) -> jax.Device | None:
    """The device of a node compiled as ``jax.jit`` compiles a call nothing placed, else None.

    A node on the slice a program implies when nothing placed its call
    (``Graph.uncommitted_slice``: one device) returns uncommitted outputs, as
    ``jax.jit``'s are. Compiled with no shardings and no mesh on that device,
    its executable returns them so itself: a call then remakes no array
    (``futures.dispatched_values``), and the next call, with those outputs or
    their futures, takes JAX's own fast path. Not for nodes with a placement
    of their own (specs, a typed mesh), host callbacks (whose outputs the
    compiler pins) or sub-byte inputs.
    """
    if graph.uncommitted_slice is None or node.slice.id != graph.uncommitted_slice or mesh.devices.size != 1:
        return None
    if any(spec is not None for spec in (*node.in_specs, *node.out_specs)):
        return None
    if _calls_host(node.jaxpr.jaxpr) or any(_sub_byte(aval.dtype) for aval in node.jaxpr.in_avals):
        return None
    for aval in (*node.jaxpr.in_avals, *node.jaxpr.out_avals):
        typed = getattr(aval, "sharding", None)
        if isinstance(typed, NamedSharding) and not typed.mesh.empty:
            return None
    return mesh.devices.flat[0]


def _compile(
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
) -> tuple[Any, tuple[bytes, str] | None]:
    """Compiles a node for ``mesh``; identical nodes (a function called many times) compile once.

    Returns the executable and, with ``export``, the node serialized with
    ``jax.export`` for remote hosts (bytes and their fingerprint), for
    ``platforms`` (``None``: this process's). With ``loose`` (see
    :func:`_loose_device`), compiled for that device as ``jax.jit`` compiles
    a call nothing placed: its outputs are uncommitted.
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
    )
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    body = jex.jaxpr_as_fun(node.jaxpr)

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
        with only_mesh(_NO_MESH, None), jax.default_device(loose):
            made: Any = (
                jax.jit(fun, donate_argnums=donate).lower(*plain).compile(dict(options) if options else None)
            )
        counts.bump("compiles")
        lowering_log.compiled(node, t0)
        if cache is not None:
            cache.put(key, (made, None), consts)
        return made, None
    # The slice's mesh alone, whatever mesh the caller set; works inside a trace too.
    with only_mesh(mesh.abstract_mesh, mesh):
        jitted = jax.jit(fun, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate)
        # XLA options (jax.jit's compiler_options) apply here; remote hosts compile with their own.
        compiled: Any = jitted.lower(*args).compile(dict(options) if options else None)
        if any(_sub_byte(aval.dtype) for aval in node.jaxpr.in_avals):
            compiled = _SubByteInputs(compiled, jitted, mesh)
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
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and jax.dtypes.itemsize_bits(dtype) < 8


class _SubByteInputs:
    """An executable whose inputs include a sub-byte dtype, called through its ``jax.jit``.

    ``jax.device_put`` onto several devices gives int4 and int2 arrays a layout
    whose element size reads 0 bits while the compiled executable asks for 4 or
    2, and a compiled call refuses the mismatch (jax.jit's own call does not):
    ``ValueError: Computation was compiled for input layouts that disagree``.
    """

    def __init__(self, compiled: Any, jitted: Any, mesh: Any) -> None:
        self._jitted, self._mesh = jitted, mesh
        self.input_shardings, self.output_shardings = compiled.input_shardings, compiled.output_shardings

    def __call__(self, *args: Any) -> Any:
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


def _warn_donation(graph: Graph, node: Node, leaf: int) -> None:
    """Says that a donation cannot be honoured; Python's warning filters show it once per text."""
    warnings.warn(
        f"program {graph.name!r}: argument leaf {leaf} is donated (donate_argnums) but node "
        f"{node.name!r} ({node.source_info}) is not its only reader, so its buffer is kept. "
        "Donate only arguments that one computation reads, or drop the donation.",
        UserWarning,
        stacklevel=2,
    )


def lower(
    graph: Graph, signature: Signature, placement: Placement, donated: frozenset[int] = frozenset()
) -> Plan:
    """Binds ``graph`` to the devices ``placement`` gives its slices and compiles its nodes.

    ``donated``: argument leaves whose buffers the program may consume.
    """
    t0 = events.now()
    plan = Plan(graph, signature, placement, donated)
    counts.bump("lowerings")
    lowering_log.lowered(graph, placement, t0)
    return plan


__all__ = ["AccountingGroup", "ExecStep", "MoveStep", "OutputSlot", "Plan", "lower"]
