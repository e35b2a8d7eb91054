"""Binding a graph to slots and steps: where each value lives in a run, and the moves between.

Walks a graph's steps in order under a placement: each program input gets a
slot (or stays a host argument), each node's inputs are materialised with the
sharding it reads (moving or resharding as needed), its executable compiled,
and each program output is found a slot, an argument or a literal.
"""

from __future__ import annotations

import collections
import warnings
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from pathways_jax._src.compile import node_compiler
from pathways_jax._src.compile.node_compiler import calls_host, loose_device
from pathways_jax._src.compile.placement import Placement
from pathways_jax._src.compile.steps import ExecStep, MoveStep, OutputSlot
from pathways_jax._src.core import charges as charges_lib
from pathways_jax._src.core import errors
from pathways_jax._src.core.charges import Charge, charge_of
from pathways_jax._src.core.meshes import spec_parts
from pathways_jax._src.ir.graph import Graph, Node

if TYPE_CHECKING:
    from pathways_jax._src.ir.signatures import Signature


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


class Binding:
    """One graph's values bound to slots and steps: which slot holds each value, with which sharding.

    Made per plan by :func:`bind`; the plan takes its template, feeds, steps,
    byte counts and outputs. It reads the graph, the placement and the donated
    arguments, nothing else.
    """

    def __init__(self, graph: Graph, signature: Signature, placement: Placement, donated: frozenset[int]):
        self.graph = graph
        self.placement = placement
        self.donated_args = donated  # argument leaves the caller donated (donate_argnums)
        self.template: list[Any] = []  # a run's slots: None, or a constant on devices
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
        self.fed_committed: dict[int, bool] = {}  # vid -> committed, of array and future inputs
        self.handed_out: set[int] = set()  # slots an output names so far (a second one gets a copy)
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

    def new_slot(self, value: Any = None) -> int:
        """A new slot of a run, holding ``value`` before the run fills it."""
        self.template.append(value)
        return len(self.template) - 1

    def note_bytes(self, what: str, slots: list[int], avals: list[Any], shardings: list[Any]) -> None:
        """Counts the bytes a step makes in ``slots``, per slot and per device."""
        total: dict[int, int] = {}
        for slot, aval, sharding in zip(slots, avals, shardings, strict=True):
            charge = charge_of(aval, sharding)
            self.slot_charge[slot] = charge
            charges_lib.add(total, charge)
        self.step_charge.append((what, tuple(sorted(total.items()))))

    def _feed(self, signature: Signature) -> None:
        """A slot (or a host argument) for each program input, by its kind in ``signature``."""
        for inp in self.graph.inputs:
            self.input_values[inp.value] = inp.index
            if inp.index in self.donated_args:
                self.donated_values.add(inp.value)
            key = signature[inp.index]
            if key.kind == "future":
                slot = self.new_slot()
                self.future_feeds.append((inp.index, slot))
                self.feed_shardings[slot] = key.sharding
                self.home[inp.value] = (slot, key.sharding)
                self.fed_committed[inp.value] = key.committed
            elif key.kind == "array":
                slot = self.new_slot()
                self.array_feeds.append((inp.index, slot))
                self.home[inp.value] = (slot, key.sharding)
                self.fed_committed[inp.value] = key.committed
            else:  # a numpy array or Python scalar: put on devices per run
                self.host_arg[inp.value] = inp.index

    def materialise(self, vid: int, target: NamedSharding, ndim: int) -> int:
        """A slot holding value ``vid`` with sharding ``target``, adding steps as needed."""
        values, home, placed = self.values, self.home, self.placed
        key = (vid, target)
        if key in placed:
            return placed[key]
        if vid in self.transfer_of and vid not in home:
            t = self.transfer_of[vid]
            src_slot, _ = home.get(t.value, (None, None))
            if src_slot is None:  # a host value moved between slices: feed it directly
                slot = self.materialise(t.value, target, ndim)
            else:
                slot = self.new_slot()
                kind = self.placement.kind(t.src.id, t.dst.id)  # where the slices are now
                self.steps.append(MoveStep(src_slot, slot, target, kind, values[vid].aval))
                self.note_bytes(
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
            out = self.new_slot()
            self.steps.append(MoveStep(slot, out, target, None, values[vid].aval))
            self.note_bytes(f"reshard of {values[vid].origin}", [out], [values[vid].aval], [target])
            placed[key] = out
            return out
        slot = self.new_slot()
        if vid in self.host_arg:
            self.host_feeds.append((self.host_arg[vid], slot, target))
            self.input_charges.append(charge_of(values[vid].aval, target))
        else:
            self.template[slot] = jax.device_put(self.const_data[vid], target)
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
            # A program input goes only where the program's caller donated it (donate_argnums);
            # a function's own donation reaches only values made inside, as under jax.jit.
            wants = vid in self.donated_values if vid in self.input_values else node.donated[position]
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
        graph = self.graph
        placed_on = self.placement.slices[node.slice.id]
        mesh = placed_on.mesh
        target = self.placement.target
        if target is not None and not target.calls_back and calls_host(node.jaxpr.jaxpr):
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
        executable, exported = node_compiler.compile_node(
            node,
            mesh,
            tuple(shardings),
            out_shardings,
            tuple(donate),
            self.placement.executables,
            export=export,
            platforms=target.export_platforms if target is not None else None,
            options=graph.compiler_options,
            loose=loose_device(graph, node, mesh) if not export else None,
            committed=node.slice.id == graph.device_slice,
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
            slot = self.new_slot()
            self.home[vid] = (slot, sharding)
            self.made_here.add(vid)
            out_slots.append(slot)
        self.steps.append(
            ExecStep(
                executable,
                tuple(in_slots),
                tuple(out_slots),
                node,
                placed_on.island,
                tuple(pinned),
                windowed=mesh.devices.size > 1 or calls_host(node.jaxpr.jaxpr),
                exported=exported,
            )
        )
        self.note_bytes(
            f"node {node.name!r} ({node.source_info})",
            out_slots,
            [self.values[vid].aval for vid in node.outputs],
            produced,
        )

    def output(self, out: Any) -> OutputSlot:
        """Where a run finds program output ``out``: a slot, a literal or an argument."""
        graph = self.graph
        if out.value is None:
            literal = jnp.asarray(out.literal)
            committed = False
            if isinstance(literal, jax.Array):
                aval, sharding = literal.aval, literal.sharding
                # Under the caller's jax.set_mesh, jnp.asarray replicates it over that mesh,
                # committed, as jax.jit's constant output there is.
                committed = literal.committed
            else:  # float0 (the gradient of an integer input): host data, as jax.jit returns it
                aval, sharding = jax.core.ShapedArray(np.shape(literal), literal.dtype), None
            # jnp.asarray's array: uncommitted on JAX's default device, as jax.jit's constant output.
            return OutputSlot(
                "literal", literal, aval, sharding, None, f"{graph.name}: literal", committed=committed
            )
        value = self.values[out.value]
        if value.aval.dtype == jax.dtypes.float0:
            # Computed float0 (a gradient of an integer input): no data, so host zeros, as jax.jit gives.
            zeros = jnp.asarray(np.zeros(value.aval.shape, jax.dtypes.float0))
            return OutputSlot("literal", zeros, value.aval, None, None, value.origin)
        if out.value in self.home:
            slot, sharding = self.home[out.value]
            if out.value in self.fed_committed:
                # An argument returned as it is stays where it came, so it stays as committed
                # as it came: committed there, an uncommitted array on JAX's default device
                # would refuse arrays committed elsewhere, where jax.jit's output takes them.
                committed = self.fed_committed[out.value]
            else:
                committed = not (
                    value.slice is not None
                    and value.slice.id == graph.uncommitted_slice
                    and len(sharding.device_set) == 1
                )
            # As jax.jit's, every output is a buffer of its own: an argument returned as it is
            # is not the caller's array, nor one value returned twice one buffer (donating or
            # deleting one would take the other).
            fresh = out.value not in self.made_here or slot in self.handed_out
            self.handed_out.add(slot)
            return OutputSlot(
                "slot", slot, value.aval, sharding, value.slice, value.origin, committed, fresh=fresh
            )
        if out.value in self.host_arg:
            return OutputSlot("argument", self.host_arg[out.value], value.aval, None, None, value.origin)
        slot = self.new_slot(jax.device_put(self.const_data[out.value]))
        return OutputSlot("slot", slot, value.aval, self.template[slot].sharding, None, value.origin)


def _warn_donation(graph: Graph, node: Node, leaf: int) -> None:
    """Says that a donation cannot be honoured; Python's warning filters show it once per text."""
    warnings.warn(
        f"program {graph.name!r}: argument leaf {leaf} is donated (donate_argnums) but node "
        f"{node.name!r} ({node.source_info}) is not its only reader, so its buffer is kept. "
        "Donate only arguments that one computation reads, or drop the donation.",
        UserWarning,
        stacklevel=2,
    )


def bind(graph: Graph, signature: Signature, placement: Placement, donated: frozenset[int]) -> Binding:
    """``graph``'s values bound to slots and steps under ``placement`` (its nodes compiled)."""
    binding = Binding(graph, signature, placement, donated)
    for kind, index in graph.steps:
        if kind == "node":  # a transfer is materialised where a node first reads the moved value
            binding.node(graph.nodes[index])
    for out in graph.outputs:
        binding.outputs.append(binding.output(out))
    return binding


__all__ = ["Binding", "bind"]
