"""Pictures of dataflow graphs: Graphviz DOT, SVG and notebook HTML.

Nodes are grouped by island and slice, transfers are drawn distinct (ICI solid
blue, DCN dashed red), and each node shows its user source line (also on hover).
SVG comes from Graphviz's ``dot`` program when it is installed; without it a
simple built-in layout (one column per slice, one row per step) is drawn, and
the HTML view says how to get the full picture.
"""

from __future__ import annotations

import collections
import functools
import math
import re
import shutil
import subprocess
from typing import TYPE_CHECKING, Any

from pathways_jax._src.core.formatting import aval_text, escape

if TYPE_CHECKING:
    from pathways_jax._src.api.graph_view import GraphView

__all__ = ["find_dot", "to_dot", "to_html", "to_svg"]

TRANSFER_STYLE = {
    "ici": {"color": "#1f5fbf", "dash": "", "dot": "solid"},
    "dcn": {"color": "#c0392b", "dash": "6,4", "dot": "dashed"},
}
_DOT_TIMEOUT_S = 30.0
NO_DOT_NOTE = (
    "Graphviz's dot program was not found on PATH, so this is a simple built-in layout. "
    "Install Graphviz (apt-get install graphviz, brew install graphviz or conda install graphviz) "
    "for the full picture; Graph.to_dot() gives the DOT source either way."
)


def find_dot() -> str | None:
    """The path of Graphviz's ``dot`` program, or ``None`` when it is not installed."""
    return shutil.which("dot")


def _nbytes(aval: Any) -> int:
    try:
        return int(math.prod(aval.shape)) * aval.dtype.itemsize
    except Exception:
        return 0


def _slice_devices(s: Any) -> str:
    return ",".join(str(d.id) for d in getattr(s, "_devices", ()))


def _slice_label(s: Any) -> str:
    mesh = ", ".join(f"{n}: {k}" for n, k in zip(s.axis_names, s.shape, strict=True))
    return f"slice #{s.id} {{{mesh}}} devices [{_slice_devices(s)}]"


class _Layout:
    """Who produces and who reads each value, and where every graph element sits."""

    def __init__(self, graph: GraphView):
        self.graph = graph
        self.producer: dict[int, str] = {}
        for j, inp in enumerate(graph.inputs):
            self.producer[inp.value] = f"in{j}"
        for k, const in enumerate(graph.consts):
            self.producer[const.value] = f"c{k}"
        for i, node in enumerate(graph.nodes):
            for vid in node.outputs:
                self.producer[vid] = f"n{i}"
        for i, t in enumerate(graph.transfers):
            self.producer[t.output] = f"t{i}"
        # (src element, dst element, value id), in a deterministic order.
        self.edges: list[tuple[str, str, int]] = []
        for kind, index in graph.steps:
            if kind == "node":
                for vid in graph.nodes[index].inputs:
                    if vid in self.producer:
                        self.edges.append((self.producer[vid], f"n{index}", vid))
            else:
                t = graph.transfers[index]
                if t.value in self.producer:
                    self.edges.append((self.producer[t.value], f"t{index}", t.value))
        for m, out in enumerate(graph.outputs):
            if out.value is not None and out.value in self.producer:
                self.edges.append((self.producer[out.value], f"out{m}", out.value))
        islands: dict[int, dict[int, Any]] = collections.defaultdict(dict)
        every = [*graph.slices, *(t.dst for t in graph.transfers)]
        every += [v.slice for v in graph.values if v.slice is not None]
        for s in every:
            islands[s.island].setdefault(s.id, s)
        self.islands = {k: islands[k] for k in sorted(islands)}

    def transfer_kind(self, element: str) -> str | None:
        if element.startswith("t"):
            return self.graph.transfers[int(element[1:])].kind
        return None


# --- DOT -------------------------------------------------------------------------------


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**attrs: Any) -> str:
    return "[" + ", ".join(f"{k}={_q(str(v))}" for k, v in attrs.items() if v is not None) + "]"


def to_dot(graph: GraphView) -> str:
    """The graph in Graphviz DOT: clusters per island and slice, transfers distinct.

    Example:
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> g = pw.program(lambda v: v + 1, devices=s).graph(jnp.zeros(2))
      >>> g.to_dot().splitlines()[0]
      'digraph "<lambda>" {'
      >>> s.release()
    """
    lay = _Layout(graph)
    out = [f"digraph {_q(graph.name)} {{"]
    out.append(
        "  "
        + " ".join(
            [
                "graph",
                _attrs(
                    label=f"program {graph.name} ({graph.source_info})\n"
                    "blue solid: ICI transfer, red dashed: DCN transfer",
                    labelloc="t",
                    fontname="Helvetica",
                    rankdir="TB",
                    compound="true",
                ),
            ]
        )
        + ";"
    )
    out.append("  " + "node " + _attrs(fontname="Helvetica", fontsize="10") + ";")
    out.append("  " + "edge " + _attrs(fontname="Helvetica", fontsize="9") + ";")
    nodes_on: dict[int, list[int]] = collections.defaultdict(list)
    for i, node in enumerate(graph.nodes):
        nodes_on[node.slice.id].append(i)
    for island, slices in lay.islands.items():
        out.append(f"  subgraph cluster_island_{island} {{")
        out.append(f"    graph {_attrs(label=f'island {island}', style='rounded', color='#888888')};")
        for sid, s in slices.items():
            out.append(f"    subgraph cluster_slice_{sid} {{")
            out.append(
                f"      graph {_attrs(label=_slice_label(s), style='filled', fillcolor='#f4f6fa', color='#b0b8c8')};"
            )
            for i in nodes_on.get(sid, []):
                node = graph.nodes[i]
                ins = ", ".join(f"v{v}" for v in node.inputs)
                outs = ", ".join(f"v{v}: {aval_text(graph.values[v].aval)}" for v in node.outputs)
                label = f"{node.name} [{node.kind}]\n({ins}) -> ({outs})\n{node.source_info}"
                fill = "#ffffff" if node.kind == "jit" else "#fff8e1"
                tooltip = f"{node.name} at {node.source_info}"
                out.append(
                    f"      n{i} {_attrs(label=label, shape='box', style='rounded,filled', fillcolor=fill, tooltip=tooltip)};"
                )
            out.append("    }")
        out.append("  }")
    for j, inp in enumerate(graph.inputs):
        v = graph.values[inp.value]
        label = f"input {inp.index}\nv{v.id}: {aval_text(v.aval)}" + (" (future)" if inp.is_future else "")
        out.append(f"  in{j} {_attrs(label=label, shape='ellipse', tooltip=v.origin)};")
    for k, const in enumerate(graph.consts):
        v = graph.values[const.value]
        out.append(f"  c{k} {_attrs(label=f'const v{v.id}: {aval_text(v.aval)}', shape='note')};")
    for i, t in enumerate(graph.transfers):
        style = TRANSFER_STYLE[t.kind]
        v = graph.values[t.value]
        label = (
            f"{t.kind.upper()} transfer\nv{t.value} -> v{t.output}\n{aval_text(v.aval)}, {_nbytes(v.aval)} B"
        )
        tooltip = f"#{t.src.id} (island {t.src.island}) -> #{t.dst.id} (island {t.dst.island})"
        attrs = _attrs(
            label=label,
            shape="box",
            color=style["color"],
            fontcolor=style["color"],
            style="rounded," + style["dot"],
            penwidth="2",
            tooltip=tooltip,
        )
        out.append(f"  t{i} {attrs};")
    for m, o in enumerate(graph.outputs):
        label = f"output {m}" + (f"\nv{o.value}" if o.value is not None else f"\nliteral {o.literal!r}")
        out.append(f"  out{m} {_attrs(label=label, shape='ellipse', style='dashed')};")
    for src, dst, vid in lay.edges:
        kind = lay.transfer_kind(dst) or lay.transfer_kind(src)
        label = f"v{vid}: {aval_text(graph.values[vid].aval)}"
        if kind is not None:
            style = TRANSFER_STYLE[kind]
            attrs = _attrs(label=label, color=style["color"], style=style["dot"], penwidth="2")
        else:
            attrs = _attrs(label=label)
        out.append(f"  {src} -> {dst} {attrs};")
    out.append("}")
    return "\n".join(out) + "\n"


# --- SVG -------------------------------------------------------------------------------

_PROLOG = re.compile(r"^\s*(<\?xml[^>]*\?>\s*)?(<!DOCTYPE[^>]*>\s*)?", re.S)


@functools.lru_cache(maxsize=32)
def _run_dot(source: str, program: str) -> str:
    proc = subprocess.run(
        [program, "-Tsvg"], input=source, capture_output=True, text=True, timeout=_DOT_TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"dot exited with {proc.returncode}: {proc.stderr.strip()[:500]}")
    return _PROLOG.sub("", proc.stdout, count=1)


def _svg_via_dot(graph: GraphView) -> tuple[str | None, str | None]:
    """(svg, None) from Graphviz, or (None, why not)."""
    program = find_dot()
    if program is None:
        return None, NO_DOT_NOTE
    try:
        return _run_dot(to_dot(graph), program), None
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return None, f"Graphviz's dot failed ({exc}); showing a simple built-in layout instead."


def to_svg(graph: GraphView) -> str:
    """An SVG picture of the graph: Graphviz's when ``dot`` is installed, else a built-in layout."""
    svg, _ = _svg_via_dot(graph)
    return svg if svg is not None else builtin_svg(graph)


_COL_W, _ROW_H, _BOX_W, _BOX_H, _TOP = 230, 64, 200, 44, 70
_FIT = 34  # characters that fit on a line of a box (the full text is on hover)


def _fit(line: str) -> str:
    return line if len(line) <= _FIT else line[: _FIT - 1] + "…"


def builtin_svg(graph: GraphView) -> str:
    """A simple SVG of the graph, drawn without Graphviz: a column per slice, a row per step."""
    lay = _Layout(graph)
    columns: dict[int | None, int] = {None: 0}  # slice id (None: host) -> column
    for slices in lay.islands.values():
        for sid in slices:
            columns[sid] = len(columns)
    pos: dict[str, tuple[int, int]] = {}
    # Inputs and constants stack at the top of their column, outputs at the bottom.
    stacked: collections.Counter[int] = collections.Counter()
    for j, inp in enumerate(graph.inputs):
        v = graph.values[inp.value]
        col = columns.get(v.slice.id if v.slice is not None else None, 0)
        pos[f"in{j}"] = (col, stacked[col])
        stacked[col] += 1
    for k in range(len(graph.consts)):
        pos[f"c{k}"] = (0, stacked[0])
        stacked[0] += 1
    first = max(stacked.values(), default=0)
    for row, (step_kind, index) in enumerate(graph.steps, start=first):
        if step_kind == "node":
            pos[f"n{index}"] = (columns[graph.nodes[index].slice.id], row)
        else:
            pos[f"t{index}"] = (columns[graph.transfers[index].dst.id], row)
    stacked.clear()
    for m, o in enumerate(graph.outputs):
        out_v = graph.values[o.value] if o.value is not None else None
        col = columns.get(out_v.slice.id if out_v is not None and out_v.slice is not None else None, 0)
        pos[f"out{m}"] = (col, first + len(graph.steps) + stacked[col])
        stacked[col] += 1
    last = max((row for _, row in pos.values()), default=0)
    width = _COL_W * len(columns) + 20
    height = _TOP + _ROW_H * (last + 1) + 30

    def centre(element: str) -> tuple[float, float]:
        col, row = pos[element]
        return 10 + col * _COL_W + _COL_W / 2, _TOP + row * _ROW_H + _BOX_H / 2

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
        "<defs>"
        + "".join(
            f'<marker id="pw-arrow-{name}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" '
            f'markerHeight="8" markerUnits="userSpaceOnUse" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
            for name, colour in (("plain", "#555555"), ("ici", "#1f5fbf"), ("dcn", "#c0392b"))
        )
        + "</defs>",
        f'<text x="10" y="18" font-size="13" font-weight="bold">program {escape(graph.name)} '
        f'<tspan font-weight="normal">({escape(graph.source_info)})</tspan></text>',
        '<text x="10" y="34" fill="#555555">blue solid: ICI transfer · red dashed: DCN transfer</text>',
    ]
    # Island and slice bands.
    for island, slices in lay.islands.items():
        cols = [columns[sid] for sid in slices]
        left = 10 + min(cols) * _COL_W + 4
        right = 10 + (max(cols) + 1) * _COL_W - 4
        parts.append(
            f'<g class="island"><title>island {island}</title><rect x="{left}" y="40" width="{right - left}" '
            f'height="{height - 50}" rx="8" fill="none" stroke="#888888"/>'
            f'<text x="{left + 6}" y="52" fill="#555555">island {island}</text></g>'
        )
        for sid, s in slices.items():
            cx = 10 + columns[sid] * _COL_W
            parts.append(
                f'<g class="slice"><title>{escape(_slice_label(s))}</title><rect x="{cx + 10}" y="56" '
                f'width="{_COL_W - 20}" height="{height - 72}" rx="6" fill="#f4f6fa" stroke="#b0b8c8"/>'
                f'<text x="{cx + 16}" y="68" font-size="10">{escape(_slice_label(s))}</text></g>'
            )
    parts.append('<text x="16" y="68" font-size="10" fill="#555555">host</text>')
    # Edges first, boxes on top.
    for src, dst, vid in lay.edges:
        (x0, y0), (x1, y1) = centre(src), centre(dst)
        kind = lay.transfer_kind(dst) or lay.transfer_kind(src)
        colour = TRANSFER_STYLE[kind]["color"] if kind else "#555555"
        dash = (
            f' stroke-dasharray="{TRANSFER_STYLE[kind]["dash"]}"'
            if kind and TRANSFER_STYLE[kind]["dash"]
            else ""
        )
        if abs(x1 - x0) < 1:
            y0 += _BOX_H / 2
        else:  # leave from the side facing the destination
            x0 += (_BOX_W / 2) * (1 if x1 > x0 else -1)
        y1 -= _BOX_H / 2
        bend = 40 if abs(x1 - x0) < 1 and y1 - y0 > _ROW_H else 0
        parts.append(
            f'<path d="M{x0:.0f},{y0:.0f} C{x0 + bend:.0f},{y0 + 20:.0f} {x1 + bend:.0f},{y1 - 20:.0f} '
            f'{x1:.0f},{y1:.0f}" fill="none" stroke="{colour}" stroke-width="{2 if kind else 1}"{dash} '
            f'marker-end="url(#pw-arrow-{kind or "plain"})"><title>v{vid}: {escape(aval_text(graph.values[vid].aval))}</title></path>'
        )

    def box(element: str, lines: list[str], tooltip: str, fill: str, stroke: str, dash: str = "") -> None:
        x, y = centre(element)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        text = "".join(
            f'<tspan x="{x:.0f}" dy="{0 if n == 0 else 13}">{escape(_fit(line))}</tspan>'
            for n, line in enumerate(lines)
        )
        parts.append(
            f'<g class="element" id="pw-{element}"><title>{escape(tooltip)}</title>'
            f'<rect x="{x - _BOX_W / 2:.0f}" y="{y - _BOX_H / 2:.0f}" width="{_BOX_W}" height="{_BOX_H}" rx="6" '
            f'fill="{fill}" stroke="{stroke}"{dash_attr}/>'
            f'<text x="{x:.0f}" y="{y - _BOX_H / 2 + 14:.0f}" text-anchor="middle">{text}</text></g>'
        )

    for j, inp in enumerate(graph.inputs):
        v = graph.values[inp.value]
        box(f"in{j}", [f"input {inp.index}", f"v{v.id}: {aval_text(v.aval)}"], v.origin, "#ffffff", "#555555")
    for k, const in enumerate(graph.consts):
        v = graph.values[const.value]
        box(f"c{k}", [f"const v{v.id}", aval_text(v.aval)], v.origin, "#ffffff", "#999999")
    for i, node in enumerate(graph.nodes):
        outs = ", ".join(f"v{v}" for v in node.outputs)
        fill = "#ffffff" if node.kind == "jit" else "#fff8e1"
        box(
            f"n{i}",
            [f"{node.name} [{node.kind}] -> {outs}", node.source_info],
            f"{node.name} at {node.source_info}",
            fill,
            "#333333",
        )
    for i, t in enumerate(graph.transfers):
        style = TRANSFER_STYLE[t.kind]
        v = graph.values[t.value]
        box(
            f"t{i}",
            [
                f"{t.kind.upper()} transfer v{t.value} -> v{t.output}",
                f"{aval_text(v.aval)}, {_nbytes(v.aval)} B",
            ],
            f"#{t.src.id} (island {t.src.island}) -> #{t.dst.id} (island {t.dst.island})",
            "#ffffff",
            style["color"],
            style["dash"],
        )
    for m, o in enumerate(graph.outputs):
        label = f"v{o.value}" if o.value is not None else f"literal {o.literal!r}"
        box(f"out{m}", [f"output {m}", label], f"output {m}", "#ffffff", "#555555", "3,3")
    parts.append("</svg>")
    return "\n".join(parts)


# --- HTML ------------------------------------------------------------------------------

_TABLE = 'style="border-collapse: collapse; font-size: 12px;"'
_CELL = 'style="border: 1px solid #ddd; padding: 2px 6px; text-align: left;"'


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A small HTML table; every cell is escaped."""
    head = "".join(f"<th {_CELL}>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td {_CELL}>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table {_TABLE}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def steps_table(graph: GraphView) -> str:
    """Every node and transfer of the graph, in run order, as an HTML table."""
    rows = []
    for kind, index in graph.steps:
        if kind == "node":
            n = graph.nodes[index]
            rows.append(
                [
                    f"node {n.name} [{n.kind}]",
                    f"island {n.slice.island}",
                    f"#{n.slice.id}",
                    ", ".join(f"v{v}" for v in n.inputs) + " -> " + ", ".join(f"v{v}" for v in n.outputs),
                    n.source_info,
                ]
            )
        else:
            t = graph.transfers[index]
            v = graph.values[t.value]
            rows.append(
                [
                    f"{t.kind.upper()} transfer",
                    f"island {t.src.island} -> {t.dst.island}",
                    f"#{t.src.id} -> #{t.dst.id}",
                    f"v{t.value} -> v{t.output}: {aval_text(v.aval)}, {_nbytes(v.aval)} B",
                    "",
                ]
            )
    return table(["step", "island", "slice", "values", "source"], rows)


def to_html(graph: GraphView) -> str:
    """The graph for a notebook: its picture, a note when Graphviz is missing, and a table."""
    svg, note = _svg_via_dot(graph)
    if svg is None:
        svg = builtin_svg(graph)
    parts = [
        '<div class="pw-graph">',
        f"<div><b>Graph {escape(graph.name)}</b>: {len(graph.nodes)} nodes, {len(graph.transfers)} transfers "
        f"({sum(t.kind == 'dcn' for t in graph.transfers)} DCN), defined at {escape(graph.source_info)}</div>",
        f'<div style="overflow: auto;">{svg}</div>',
    ]
    if note is not None:
        parts.append(f'<div style="color: #8a6d3b; font-size: 12px;">{escape(note)}</div>')
    parts.append(f"<details><summary>nodes and transfers</summary>{steps_table(graph)}</details>")
    parts.append(f"<details><summary>DOT source</summary><pre>{escape(to_dot(graph))}</pre></details>")
    parts.append("</div>")
    return "".join(parts)
