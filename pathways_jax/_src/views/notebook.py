"""HTML views for notebooks: ``Cluster``, ``VirtualSlice``, ``Program`` and ``Future``.

Each object's ``_repr_html_`` delegates here. Views only read state: they never
wait for a value, start the controller or trace a program.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pathways_jax._src.core.formatting import escape
from pathways_jax._src.runtime import futures
from pathways_jax._src.views import render

__all__ = ["cluster_html", "future_html", "program_html", "slice_html"]

_BOX = 'style="font-family: Helvetica, Arial, sans-serif; font-size: 13px;"'
_STATE_COLOURS = {"pending": "#b7791f", "ready": "#2f855a", "failed": "#c53030", "freed": "#718096"}


def _badge(state: str) -> str:
    colour = _STATE_COLOURS.get(state, "#4a5568")
    return (
        f'<span style="background: {colour}; color: white; border-radius: 4px; padding: 0 6px;">'
        f"{escape(state)}</span>"
    )


def _bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # pragma: no cover


def _mesh(slice_: Any) -> str:
    return "{" + ", ".join(f"{n}: {s}" for n, s in zip(slice_.axis_names, slice_.shape, strict=True)) + "}"


def _stats(cluster: Any) -> Mapping | None:
    """``pw.stats()`` of ``cluster`` when it is the running one and has run work; never raises.

    The view must not start a cluster or a controller: a closed or idle cluster has no stats.
    """
    try:
        import pathways_jax
        from pathways_jax._src.runtime import clusters

        fn = getattr(pathways_jax, "stats", None)
        running = getattr(clusters, "running", None)
        current = running() if callable(running) else clusters._current
        if (
            not callable(fn)
            or current is None
            or current is not cluster
            or current.closed
            or current._controller is None
        ):
            return None
        stats = fn()
        return stats if isinstance(stats, Mapping) else None
    except Exception:
        return None


def _section(stats: Mapping | None, key: str) -> dict[Any, Mapping]:
    part = stats.get(key) if stats is not None else None
    if not isinstance(part, Mapping):
        return {}
    return {k: v for k, v in part.items() if isinstance(v, Mapping)}


def _memory(device: Any, stat: Mapping) -> str:
    """Bytes in use (and the budget) from ``pw.stats()``, else from the device itself."""
    used, limit = stat.get("bytes_in_use"), stat.get("budget")
    if used is None:
        try:
            mem = device.memory_stats() or {}
        except Exception:
            mem = {}
        used, limit = mem.get("bytes_in_use"), mem.get("bytes_limit")
    if used is None:
        return ""
    return _bytes(used) + (f" / {_bytes(limit)}" if limit else "")


def _percent(value: Any) -> str:
    return f"{100 * value:.0f}%" if isinstance(value, int | float) else ("" if value is None else str(value))


def cluster_html(cluster: Any) -> str:
    """Islands, hosts and devices of a cluster, the live slices mapped on them, and ``pw.stats()``."""
    slices = cluster.live_slices() if hasattr(cluster, "live_slices") else []
    on_device: dict[int, list[str]] = {}
    for s in slices:
        for d in s._devices:
            on_device.setdefault(d.id, []).append(f"#{s.id}")
    load = cluster.resources.load()
    stats = _stats(cluster)
    per_device = _section(stats, "devices")
    per_island = _section(stats, "islands")
    has_util = any("utilisation" in v for v in per_device.values())
    state = "closed" if cluster.closed else "running"
    n_devices = sum(len(isl.devices) for isl in cluster.islands)
    parts = [
        f'<div class="pw-cluster" {_BOX}>',
        f"<div><b>Cluster</b> ({escape(cluster.backend.name)} backend, {state}): {len(cluster.islands)} islands, "
        f"{n_devices} devices, {len(slices)} live slices</div>",
    ]
    header = ["device", "kind", "host", "slices", "load", "memory"] + (["utilisation"] if has_util else [])
    for isl in cluster.islands:
        hosts = sorted({getattr(d, "process_index", 0) for d in isl.devices})
        rows = []
        for d in isl.devices:
            stat = per_device.get(d.id, {})
            row = [
                d.id,
                d.device_kind,
                getattr(d, "process_index", 0),
                " ".join(on_device.get(d.id, [])),
                load.get(d.id, 0),
                _memory(d, stat),
            ]
            if has_util:
                row.append(_percent(stat.get("utilisation")))
            rows.append(row)
        queue = per_island.get(isl.index)
        work = f"; {queue.get('queued', 0)} queued, {queue.get('in_flight', 0)} in flight" if queue else ""
        parts.append(
            f'<div style="margin-top: 6px;"><b>island {isl.index}</b> '
            f"(hosts {', '.join(map(str, hosts))}{escape(work)})</div>"
        )
        parts.append(render.table(header, rows))
    if slices:
        rows = [
            [
                f"#{s.id}",
                _mesh(s),
                s.island,
                ",".join(str(d.id) for d in s._devices),
                "exclusive" if s.exclusive else "shared",
            ]
            for s in slices
        ]
        parts.append('<div style="margin-top: 6px;"><b>live slices</b></div>')
        parts.append(render.table(["slice", "mesh", "island", "devices", "kind"], rows))
    clients = _section(stats, "clients")
    if clients:
        keys = sorted({k for v in clients.values() for k in v})
        rows = [[name, *(v.get(k, "") for k in keys)] for name, v in clients.items()]
        parts.append('<div style="margin-top: 6px;"><b>clients</b> (pw.stats())</div>')
        parts.append(render.table(["client", *keys], rows))
    if stats is not None:
        rows = [[k, v] for k, v in stats.items() if not isinstance(v, Mapping)]
        if rows:
            parts.append('<div style="margin-top: 6px;"><b>pw.stats()</b></div>')
            parts.append(render.table(["stat", "value"], rows))
    parts.append("</div>")
    return "".join(parts)


def slice_html(slice_: Any) -> str:
    """A virtual slice: its mesh, island, kind, and the devices laid out in mesh shape."""
    ids = np.array([d.id for d in slice_._devices], dtype=object)
    shape = slice_.shape
    grid = ids.reshape(math.prod(shape[:-1]), shape[-1])  # 1-D: one row
    cell = 'style="border: 1px solid #b0b8c8; padding: 2px 8px; text-align: center; background: #f4f6fa;"'
    body = "".join("<tr>" + "".join(f"<td {cell}>{escape(v)}</td>" for v in row) + "</tr>" for row in grid)
    kind = "exclusive" if slice_.exclusive else "shared"
    state = _badge("released") if slice_.released else ""
    return (
        f'<div class="pw-slice" {_BOX}><div><b>VirtualSlice #{slice_.id}</b> mesh {escape(_mesh(slice_))}, '
        f"island {slice_.island}, {kind} {state}</div>"
        f'<div style="font-size: 11px; color: #555;">devices in mesh order (rows: '
        f"{escape(' x '.join(slice_.axis_names[:-1]) or '-')}, columns: {escape(slice_.axis_names[-1])})</div>"
        f'<table style="border-collapse: collapse;">{body}</table></div>'
    )


def program_html(program: Any) -> str:
    """A program: where it is defined, its default slice, and the graphs traced so far."""
    graphs = list(getattr(program, "_graphs", {}).values())
    plans = getattr(program, "_plans", {})
    devices = program._info.devices
    default = f"slice #{devices.id} {_mesh(devices)}" if devices is not None else "none"
    parts = [
        f'<div class="pw-program" {_BOX}>',
        f"<div><b>pw.program {escape(program.name)}</b> defined at {escape(program.source_info)}; default devices: "
        f"{escape(default)}; {len(graphs)} traced signatures, {len(plans)} lowered plans</div>",
    ]
    failure = getattr(program, "_trace_failure", None)
    if failure is not None:
        parts.append(
            f'<div style="color: #b00020;">{"its last trace" if graphs else "its trace"} failed: '
            f"{escape(failure)}</div>"
        )
    elif not graphs:
        parts.append(
            '<div style="color: #555;">not traced yet: call it, or program.graph(*args) to see its graph</div>'
        )
    for i, graph in enumerate(graphs):
        open_attr = ' open="open"' if i == len(graphs) - 1 else ""
        parts.append(
            f"<details{open_attr}><summary>signature {i}: {len(graph.nodes)} nodes, "
            f"{len(graph.transfers)} transfers</summary>{render.to_html(graph)}</details>"
        )
    parts.append("</div>")
    return "".join(parts)


def _future_state(future: Any) -> tuple[str, str]:
    """(state, detail) of a future, without waiting: a small ready value shows itself."""
    state, detail = futures.state_of(future)
    array = future._entry.array
    if state == "ready" and array is not None and array.size <= 16:
        try:
            return "ready", np.array2string(np.asarray(array), threshold=16)
        except Exception:
            return "ready", ""
    return state, detail


def future_html(future: Any) -> str:
    """A future: its state (pending / ready / failed / freed), shape, dtype and slice."""
    entry = future._entry
    state, detail = _future_state(future)
    where = f"slice #{entry.slice.id} (island {entry.slice.island})" if entry.slice is not None else "host"
    shape = "x".join(map(str, entry.aval.shape)) or "scalar"
    detail_html = f'<pre style="margin: 2px 0;">{escape(detail)}</pre>' if detail else ""
    return (
        f'<div class="pw-future" {_BOX}><b>Future</b> {_badge(state)} {escape(shape)} {escape(entry.aval.dtype)} '
        f'on {escape(where)}<div style="font-size: 11px; color: #555;">{escape(entry.origin)}</div>{detail_html}</div>'
    )
