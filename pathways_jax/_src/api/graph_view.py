"""What ``program.graph(...)`` returns: the traced graph with its slices where they are now.

The graph itself (``.ir``, an ``ir.graph.Graph``) is plain frozen data: it
names its slices by ``SliceRef`` and does not change when a slice moves. The
view pairs it with the runtime's ``VirtualSlice`` of each slice it names, so
what users read reads the slices now: a node's ``.slice`` is the slice they
asked for (``.island``, ``.devices``), a transfer's ``.kind`` is ICI or DCN as
its slices are placed when it is read, and the printed and drawn graph say
so. A program keeps one view per traced signature (the view holds the slices
its graph names, and lowering is given ``.ir`` and the placement of ``.held``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pathways_jax._src.ir.graph import Graph, Node, Transfer, TransferKind, Value, transfer_kind
from pathways_jax._src.runtime.slices import VirtualSlice

__all__ = ["GraphView", "NodeView", "TransferView", "ValueView"]


class ValueView:
    """A value of the graph (``.ir``), on its slice now (None: fed from the host)."""

    __slots__ = ("ir", "slice")

    def __init__(self, ir: Value, slice_: VirtualSlice | None):
        self.ir = ir
        self.slice = slice_

    @property
    def id(self) -> int:
        return self.ir.id

    @property
    def aval(self) -> Any:
        return self.ir.aval

    @property
    def origin(self) -> str:
        return self.ir.origin

    def __repr__(self) -> str:
        return repr(self.ir)


class NodeView:
    """A node of the graph (``.ir``: one compiled function), its ``slice`` the runtime's."""

    __slots__ = ("ir", "slice")

    def __init__(self, ir: Node, slice_: VirtualSlice):
        self.ir = ir
        self.slice = slice_

    @property
    def name(self) -> str:
        return self.ir.name

    @property
    def kind(self) -> str:
        """``"jit"``, ``"glue"`` or ``"fused"``."""
        return self.ir.kind

    @property
    def jaxpr(self) -> Any:
        return self.ir.jaxpr

    @property
    def inputs(self) -> tuple[int, ...]:
        return self.ir.inputs

    @property
    def outputs(self) -> tuple[int, ...]:
        return self.ir.outputs

    @property
    def in_specs(self) -> tuple[Any, ...]:
        return self.ir.in_specs

    @property
    def out_specs(self) -> tuple[Any, ...]:
        return self.ir.out_specs

    @property
    def donated(self) -> tuple[bool, ...]:
        return self.ir.donated

    @property
    def source_info(self) -> str:
        """Where the user's code of the node is (file:line)."""
        return self.ir.source_info

    def __repr__(self) -> str:
        return repr(self.ir)


class TransferView:
    """A transfer of the graph (``.ir``) between the runtime's slices ``src`` and ``dst``."""

    __slots__ = ("dst", "ir", "src")

    def __init__(self, ir: Transfer, src: VirtualSlice, dst: VirtualSlice):
        self.ir = ir
        self.src = src
        self.dst = dst

    @property
    def value(self) -> int:
        return self.ir.value

    @property
    def output(self) -> int:
        return self.ir.output

    @property
    def kind(self) -> TransferKind:
        """``"ici"`` within an island, ``"dcn"`` across islands: where the slices are *now*
        (a slice moved off a lost island makes the same transfer another kind)."""
        return transfer_kind(self.src.island, self.dst.island)

    def __repr__(self) -> str:
        return self.ir.describe({self.src.id: self.src.island, self.dst.id: self.dst.island})


class GraphView:
    """A program's traced graph (``.ir``, plain data) with its slices where they are now.

    Reads as the graph does: ``name``, ``source_info``, ``inputs``, ``consts``,
    ``steps``, ``outputs``, ``out_tree``, ``compiler_options``,
    ``uncommitted_slice`` and ``device_slice`` are the graph's; ``nodes``,
    ``transfers`` and ``values`` are views whose slices are the runtime's (``VirtualSlice``).

    Attributes:
      ir: the graph: frozen data naming slices by ``SliceRef``, the same
        whatever islands its slices are on.
      held: every slice the graph names, by id (the runtime's, live).

    Example:
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> g = pw.program(lambda v: v + 1, devices=s).graph(jnp.zeros(2))
      >>> g.nodes[0].slice is s, g.ir.nodes[0].slice == s.ref
      (True, True)
      >>> s.release()
    """

    __slots__ = ("_nodes", "_transfers", "_values", "held", "ir")

    def __init__(self, ir: Graph, held: Mapping[int, VirtualSlice]):
        self.ir = ir
        self.held = held
        self._nodes: tuple[NodeView, ...] | None = None
        self._transfers: tuple[TransferView, ...] | None = None
        self._values: tuple[ValueView, ...] | None = None

    @property
    def name(self) -> str:
        return self.ir.name

    @property
    def source_info(self) -> str:
        return self.ir.source_info

    @property
    def inputs(self) -> tuple[Any, ...]:
        return self.ir.inputs

    @property
    def consts(self) -> tuple[Any, ...]:
        return self.ir.consts

    @property
    def steps(self) -> tuple[Any, ...]:
        return self.ir.steps

    @property
    def outputs(self) -> tuple[Any, ...]:
        return self.ir.outputs

    @property
    def out_tree(self) -> Any:
        return self.ir.out_tree

    @property
    def compiler_options(self) -> tuple[tuple[str, Any], ...]:
        return self.ir.compiler_options

    @property
    def uncommitted_slice(self) -> int | None:
        return self.ir.uncommitted_slice

    @property
    def device_slice(self) -> int | None:
        return self.ir.device_slice

    @property
    def nodes(self) -> tuple[NodeView, ...]:
        """Sharded computation nodes, in dispatch order; each ``slice`` the runtime's."""
        if self._nodes is None:
            self._nodes = tuple(NodeView(n, self.held[n.slice.id]) for n in self.ir.nodes)
        return self._nodes

    @property
    def transfers(self) -> tuple[TransferView, ...]:
        """Values crossing slices; ``kind``: ``"ici"`` within an island, ``"dcn"`` across, as placed now."""
        if self._transfers is None:
            held = self.held
            self._transfers = tuple(
                TransferView(t, held[t.src.id], held[t.dst.id]) for t in self.ir.transfers
            )
        return self._transfers

    @property
    def values(self) -> tuple[ValueView, ...]:
        """Every value, indexed by id; each ``slice`` the runtime's (None: fed from the host)."""
        if self._values is None:
            held = self.held
            self._values = tuple(
                ValueView(v, held[v.slice.id] if v.slice is not None else None) for v in self.ir.values
            )
        return self._values

    @property
    def slices(self) -> tuple[VirtualSlice, ...]:
        """The distinct slices the graph places work on, in order of first use."""
        return tuple(self.held[ref.id] for ref in self.ir.slices)

    def islands(self) -> dict[int, int]:
        """The island each slice the graph names is on now, by slice id."""
        return {sid: s.island for sid, s in self.held.items()}

    def check(self) -> GraphView:
        """Validates the graph (``ir.graph.Graph.check``); returns this view, so calls chain.

        Raises:
          ProgramTraceError: naming the node and what is inconsistent.
        """
        self.ir.check()
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GraphView):
            return NotImplemented
        return (
            self.ir == other.ir
            and self.held.keys() == other.held.keys()
            and all(s is other.held[sid] for sid, s in self.held.items())
        )

    def __hash__(self) -> int:
        return hash(self.ir)

    def __repr__(self) -> str:
        return self.ir.describe(self.islands())

    def to_dot(self) -> str:
        """The graph in Graphviz DOT: nodes grouped by island and slice, ICI and DCN transfers distinct.

        Example:
          >>> import jax.numpy as jnp, pathways_jax as pw
          >>> s = pw.devices(mesh={"x": 1})
          >>> dot = pw.program(lambda v: v + 1, devices=s).graph(jnp.zeros(2)).to_dot()
          >>> dot.startswith("digraph") and "cluster_island_0" in dot
          True
          >>> s.release()
        """
        from pathways_jax._src.views import render

        return render.to_dot(self)

    def _repr_svg_(self) -> str:
        """An SVG picture (Graphviz's ``dot`` when installed, else a built-in layout)."""
        from pathways_jax._src.views import render

        return render.to_svg(self)

    def _repr_html_(self) -> str:
        """The notebook view: picture, a note when Graphviz is missing, the steps as a table."""
        from pathways_jax._src.views import render

        return render.to_html(self)
