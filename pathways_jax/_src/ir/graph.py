"""The dataflow graph a ``@pw.program`` traces into: immutable data, virtual placement.

A graph names only virtual slices, as plain frozen :class:`SliceRef` records:
what each slice is (its id, shape and axes), never where it is. Where a slice
is now (its devices, its island, so what kind each transfer is) is a
placement's (``compile.placement``); lowering binds the graph to it. The same
program traced twice names the same slices, and a slice that moves islands
leaves every graph naming it unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, NoReturn

from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from pathways_jax._src.core import errors
from pathways_jax._src.core.formatting import aval_text

TransferKind = Literal["ici", "dcn"]


def transfer_kind(src_island: int, dst_island: int) -> TransferKind:
    """A move between two islands' devices: ``"ici"`` within one island, ``"dcn"`` across."""
    return "ici" if src_island == dst_island else "dcn"


@dataclasses.dataclass(frozen=True, slots=True)
class SliceRef:
    """A virtual slice as plain, frozen data: what it is, not where it is.

    The runtime's ``VirtualSlice`` wraps one (``.ref``), as JAX's ``Mesh``
    has an ``AbstractMesh``; which devices and island it has now is the
    placement lowering is given (``compile.placement``). Graphs name their
    slices by these alone.
    """

    id: int
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_types: tuple[AxisType, ...]
    mesh: AbstractMesh


@dataclasses.dataclass(frozen=True, slots=True)
class Value:
    """A value flowing through the graph. ``slice`` is None for values fed from the host."""

    id: int
    aval: Any
    slice: SliceRef | None
    origin: str


@dataclasses.dataclass(frozen=True, slots=True)
class Input:
    """A dynamic argument leaf of the program: ``index`` into the flat argument leaves."""

    index: int
    value: int
    is_future: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Const:
    """A constant the program closes over, fed to the devices once per plan."""

    value: int
    data: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """One sharded computation: one compiled function on one slice."""

    name: str
    kind: Literal["jit", "glue", "fused"]
    slice: SliceRef
    jaxpr: Any
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    in_specs: tuple[PartitionSpec | None, ...]
    out_specs: tuple[PartitionSpec | None, ...]
    donated: tuple[bool, ...]
    source_info: str

    def __repr__(self) -> str:
        ins = ", ".join(f"v{i}" for i in self.inputs)
        outs = ", ".join(f"v{i}" for i in self.outputs)
        return (
            f"Node({self.name!r}, {self.kind}, slice=#{self.slice.id}, "
            f"({ins}) -> ({outs}), at {self.source_info})"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """A value moving from the slice that made it to the slice that uses it.

    Its kind (ICI within an island, DCN across) is not the graph's: it is where
    the slices are when the graph is lowered (``Placement.kind``, or
    :meth:`kind_in` given the slices' islands).
    """

    value: int
    output: int
    src: SliceRef
    dst: SliceRef

    def kind_in(self, islands: Mapping[int, int]) -> TransferKind:
        """``"ici"`` or ``"dcn"`` with the slices on ``islands`` (island by slice id)."""
        return transfer_kind(islands[self.src.id], islands[self.dst.id])

    def describe(self, islands: Mapping[int, int] | None = None) -> str:
        """The transfer in one line; with ``islands`` (island by slice id), its kind and islands too."""
        if islands is None:
            return f"Transfer(v{self.value} -> v{self.output}, #{self.src.id} -> #{self.dst.id})"
        src, dst = islands[self.src.id], islands[self.dst.id]
        return (
            f"Transfer(v{self.value} -> v{self.output}, {transfer_kind(src, dst)}, "
            f"#{self.src.id} (island {src}) -> #{self.dst.id} (island {dst}))"
        )

    def __repr__(self) -> str:
        return self.describe()


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    """A program output leaf: a graph value, or a literal the program returned."""

    value: int | None
    literal: Any = None


Step = tuple[Literal["node", "transfer"], int]


@dataclasses.dataclass(frozen=True, slots=True)
class Graph:
    """A traced program: nodes on virtual slices, transfers between them, in run order.

    Attributes:
      name: the program's name.
      source_info: where the program function is defined (file:line).
      values: every value, indexed by id.
      inputs: the program's dynamic argument leaves.
      consts: constants closed over by the program.
      nodes: sharded computation nodes, in dispatch order.
      transfers: values crossing slices (their kind is where the slices are
        when the graph is lowered: ``Placement.kind``).
      steps: the run order, as ``("node", i)`` / ``("transfer", i)`` pairs.
      outputs: one per output leaf of the program.
      out_tree: the output pytree structure.
      compiler_options: XLA options every node is compiled with (``jax.jit``'s
        ``compiler_options``), as sorted ``(name, value)`` pairs.
      uncommitted_slice: the id of the slice whose one-device outputs are
        uncommitted, as ``jax.jit``'s are when nothing placed the call (no
        slice, no committed argument: JAX's default device); None: none.
      device_slice: the id of the one-device slice committed one-device
        arguments placed the call on (no slice, no mesh): its nodes' outputs
        are committed to that device with a ``SingleDeviceSharding`` and no
        mesh in their types, as ``jax.jit``'s; None: none.
    """

    name: str
    source_info: str
    values: tuple[Value, ...]
    inputs: tuple[Input, ...]
    consts: tuple[Const, ...]
    nodes: tuple[Node, ...]
    transfers: tuple[Transfer, ...]
    steps: tuple[Step, ...]
    outputs: tuple[Output, ...]
    out_tree: Any
    compiler_options: tuple[tuple[str, Any], ...] = ()
    uncommitted_slice: int | None = None
    device_slice: int | None = None

    @property
    def slices(self) -> tuple[SliceRef, ...]:
        """The distinct slices the graph places work on, in order of first use."""
        seen: dict[int, SliceRef] = {}
        for node in self.nodes:
            seen.setdefault(node.slice.id, node.slice)
        for transfer in self.transfers:
            seen.setdefault(transfer.src.id, transfer.src)
        return tuple(seen.values())

    def check(self) -> Graph:
        """Validates the graph: every edge's shape and dtype, placement and order.

        Returns the graph, so ``program.graph(x).check()`` chains.

        Raises:
          ProgramTraceError: naming the node and what is inconsistent.
        """
        defined = {i.value for i in self.inputs} | {c.value for c in self.consts}
        for kind, index in self.steps:
            if kind == "transfer":
                t = self.transfers[index]
                if t.value not in defined:
                    self._fail(f"{t!r} reads v{t.value} before it exists")
                src = self.values[t.value]
                dst = self.values[t.output]
                if src.slice != t.src:
                    self._fail(f"{t!r} does not start where v{t.value} lives")
                if dst.slice != t.dst:
                    self._fail(f"{t!r} does not end where v{t.output} lives")
                if not (src.aval.shape == dst.aval.shape and src.aval.dtype == dst.aval.dtype):
                    self._fail(f"{t!r} changes shape or dtype")
                defined.add(t.output)
                continue
            node = self.nodes[index]
            in_avals = node.jaxpr.in_avals
            out_avals = node.jaxpr.out_avals
            if len(in_avals) != len(node.inputs):
                self._fail(f"{node!r} has {len(node.inputs)} inputs, its function {len(in_avals)}")
            if len(out_avals) != len(node.outputs):
                self._fail(f"{node!r} has {len(node.outputs)} outputs, its function {len(out_avals)}")
            for position, (vid, aval) in enumerate(zip(node.inputs, in_avals, strict=True)):
                if vid not in defined:
                    self._fail(f"{node!r} reads v{vid} before it exists")
                value = self.values[vid]
                if not (value.aval.shape == aval.shape and value.aval.dtype == aval.dtype):
                    self._fail(
                        f"{node!r} input {position} expects {aval_text(aval)} but v{vid} is {aval_text(value.aval)}"
                    )
                if not (value.slice is None or value.slice == node.slice):
                    self._fail(
                        f"{node!r} reads v{vid} on slice #{value.slice.id if value.slice else None} without a transfer"
                    )
            for spec, aval in zip(
                node.in_specs + node.out_specs, list(in_avals) + list(out_avals), strict=True
            ):
                if spec is not None and not (len(spec) <= len(aval.shape)):
                    self._fail(f"{node!r} spec {spec} has more entries than {aval_text(aval)} has dims")
            for vid, aval in zip(node.outputs, out_avals, strict=True):
                value = self.values[vid]
                if value.slice != node.slice:
                    self._fail(f"{node!r} output v{vid} is not placed on its slice")
                if not (value.aval.shape == aval.shape and value.aval.dtype == aval.dtype):
                    self._fail(f"{node!r} output v{vid} does not match its function's output")
                defined.add(vid)
        for out in self.outputs:
            if not (out.value is None or out.value in defined):
                self._fail(f"output v{out.value} is never computed")
        return self

    def _fail(self, what: str) -> NoReturn:
        # Messages are made only on failure: a node's repr lists every input, and a program
        # of thousands of arguments made every other's repr for each of them.
        raise errors.ProgramTraceError(
            f"graph of program {self.name!r} ({self.source_info}) is inconsistent: {what}."
        )

    def describe(self, islands: Mapping[int, int] | None = None) -> str:
        """The graph as text: inputs, steps in run order, outputs.

        Args:
          islands: the island of each slice by id, where a placement puts
            them; with it, each node says its island and each transfer its
            kind (``program.graph(x)`` prints it so, its slices where they are now).
        """
        lines = [f"Graph({self.name!r}, {len(self.nodes)} nodes, {len(self.transfers)} transfers)"]
        for inp in self.inputs:
            v = self.values[inp.value]
            where = f" on #{v.slice.id}" if v.slice is not None else ""
            lines.append(f"  input  v{v.id}: {aval_text(v.aval)}{where}")
        for kind, index in self.steps:
            if kind == "transfer":
                lines.append(f"  {self.transfers[index].describe(islands)}")
                continue
            node = self.nodes[index]
            ins = ", ".join(f"v{i}" for i in node.inputs)
            outs = ", ".join(f"v{i}: {aval_text(self.values[i].aval)}" for i in node.outputs)
            s = node.slice
            mesh = dict(zip(s.axis_names, s.shape, strict=True))
            island = f" island {islands[s.id]}" if islands is not None else ""
            lines.append(
                f"  node   {node.name} [{node.kind}] on #{s.id} {mesh}{island}: "
                f"({ins}) -> ({outs})  @ {node.source_info}"
            )
        outs = ", ".join(f"v{o.value}" if o.value is not None else repr(o.literal) for o in self.outputs)
        lines.append(f"  output ({outs})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()
