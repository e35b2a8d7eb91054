"""Graph pictures: DOT always; SVG/HTML with Graphviz, and a clear fallback without it."""

import html
import html.parser
import re
import subprocess
import xml.etree.ElementTree as ET

import jax.numpy as jnp
import pytest

import pathways_jax as pw
from pathways_jax._src.views import render


def _two_island_graph():
    """A program with an ICI transfer (two slices of island 0) and DCN transfers both ways."""
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    c = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)
    assert set(a.devices).isdisjoint(c.devices)

    @pw.jit(devices=a)
    def scale(x):
        return jnp.sin(x) * 2

    @pw.jit(devices=c)
    def shift(x):
        return x + 1

    @pw.jit(devices=b)
    def total(x):
        return x.sum()

    @pw.program
    def step(x):
        y = shift(scale(x))  # ICI: a -> c
        return scale(total(y) * jnp.ones(4)), y  # DCN: c -> b, then b -> a

    graph = step.graph(jnp.arange(8.0))
    kinds = sorted(t.kind for t in graph.transfers)
    assert kinds == ["dcn", "dcn", "ici"], graph
    return graph


def _check_html(text: str) -> ET.Element:
    """Well-formed (parses as XML) and balanced for an HTML parser."""
    root = ET.fromstring(text)

    class Balanced(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack = []

        def handle_starttag(self, tag, attrs):
            self.stack.append(tag)

        def handle_startendtag(self, tag, attrs):
            pass

        def handle_endtag(self, tag):
            assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
            self.stack.pop()

    parser = Balanced()
    parser.feed(text)
    parser.close()
    assert parser.stack == []
    return root


def _text(root: ET.Element) -> str:
    return " ".join("".join(root.itertext()).split())


def test_to_dot_has_every_node_transfer_cluster_and_source_line():
    graph = _two_island_graph()
    dot = graph.to_dot()
    assert dot.startswith('digraph "step" {') and dot.rstrip().endswith("}")
    for i, node in enumerate(graph.nodes):
        line = next(ln for ln in dot.splitlines() if ln.strip().startswith(f"n{i} ["))
        assert node.name in line and node.source_info in line  # the user's line in the label
        assert f'tooltip="{node.name} at {node.source_info}"' in line  # and on hover
    for i, t in enumerate(graph.transfers):
        line = next(ln for ln in dot.splitlines() if ln.strip().startswith(f"t{i} ["))
        assert f"{t.kind.upper()} transfer" in line
        style = "dashed" if t.kind == "dcn" else "solid"
        assert f'style="rounded,{style}"' in line and render.TRANSFER_STYLE[t.kind]["color"] in line
        assert re.search(rf"^\s+\w+ -> t{i} \[", dot, re.M) and re.search(rf"^\s+t{i} -> \w+ \[", dot, re.M)
    # Nodes sit in their slice's cluster, inside their island's cluster.
    for island in (0, 1):
        assert f"subgraph cluster_island_{island} {{" in dot
    for s in graph.slices:
        block = dot.split(f"subgraph cluster_slice_{s.id} {{", 1)[1].split("\n    }\n", 1)[0]
        names = {f"n{i}" for i, n in enumerate(graph.nodes) if n.slice is s}
        assert names and all(re.search(rf"^\s+{n} \[", block, re.M) for n in names)
    if render.find_dot() is not None:  # and Graphviz accepts it
        subprocess.run([render.find_dot(), "-Tsvg"], input=dot, text=True, check=True, capture_output=True)


def test_to_dot_escapes_quotes_and_backslashes():
    assert render._q('a "b" \\ c\nd') == '"a \\"b\\" \\\\ c\\nd"'


@pytest.mark.parametrize("with_dot", [True, False])
def test_svg_and_html_reprs_contain_every_node_and_transfer(monkeypatch, with_dot):
    if with_dot and render.find_dot() is None:
        pytest.skip("Graphviz's dot is not installed")
    if not with_dot:
        monkeypatch.setattr(render, "find_dot", lambda: None)
    graph = _two_island_graph()
    svg = graph._repr_svg_()
    svg_root = ET.fromstring(svg)
    assert svg_root.tag == "{http://www.w3.org/2000/svg}svg"
    svg_text = _text(svg_root)
    page = graph._repr_html_()
    root = _check_html(page)
    page_text = _text(root)
    for node in graph.nodes:
        assert node.name in svg_text and node.source_info in svg_text
        assert node.name in page_text
    for t in graph.transfers:
        label = f"v{t.value} -> v{t.output}"
        assert f"{t.kind.upper()} transfer" in svg_text and label in svg_text
        assert label in page_text
    note = "Graphviz's dot program was not found"
    assert (note in page_text) is (not with_dot)
    assert "island 0" in svg_text and "island 1" in svg_text
    if not with_dot:  # the built-in layout: ICI and DCN drawn distinct
        assert 'stroke="#1f5fbf"' in svg and 'stroke="#c0392b" stroke-width="2" stroke-dasharray="6,4"' in svg
        node = graph.nodes[0]
        assert f"<title>{html.escape(f'{node.name} at {node.source_info}')}</title>" in svg


def test_dot_failure_falls_back_with_the_reason(monkeypatch):
    monkeypatch.setattr(render, "find_dot", lambda: "/bin/false")
    render._run_dot.cache_clear()
    graph = _two_island_graph()
    page = graph._repr_html_()
    assert "dot failed" in _text(_check_html(page))
    assert ET.fromstring(graph._repr_svg_()).tag.endswith("svg")
