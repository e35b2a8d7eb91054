"""``pw.plot_timeline``: the paper's device-trace figure from a recorded trace.

One row per device (grouped by island) plus a controller row; programs are
coloured by client (shades of the client's colour tell programs apart) and
transfers are marked on the devices that receive them (ICI blue, DCN red).
matplotlib is an optional extra (``pip install 'pathways-jax[viz]'``) and is
imported only when a picture is drawn.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pathways_jax._src.core import errors

__all__ = ["load_trace", "plot_timeline"]

_CLIENT_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
_TRANSFER_COLOURS = {"ici": "#1f5fbf", "dcn": "#c0392b", "reshard": "#7f8c8d"}


def load_trace(trace: str | os.PathLike | dict | list) -> dict:
    """A trace-event JSON object from a path, a ``{"traceEvents": ...}`` dict or a list of events.

    Raises:
      TimelineError: the file does not exist or is not trace-event JSON.
    """
    if isinstance(trace, str | os.PathLike):
        path = os.fspath(trace)
        if not os.path.isfile(path):
            raise errors.TimelineError(
                f"no trace file at {path!r}; record one with `with pw.trace({path!r}): ...` first."
            )
        try:
            with open(path) as f:
                trace = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise errors.TimelineError(f"{path!r} is not trace-event JSON: {exc}") from exc
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise errors.TimelineError(
            "expected trace-event JSON: an object with a 'traceEvents' list (what pw.trace writes), "
            f"got {type(trace).__name__}."
        )
    return trace


def _import_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "pw.plot_timeline needs matplotlib, which is not installed. Install the optional "
            "extra: pip install 'pathways-jax[viz]' (or pip install matplotlib)."
        ) from exc
    return Figure


def _shade(colour: str, amount: float) -> tuple[float, float, float]:
    """``colour`` mixed with white by ``amount`` (0: the colour, 1: white)."""
    r, g, b = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def plot_timeline(
    trace: str | os.PathLike | dict | list,
    out: str | os.PathLike | None = None,
    *,
    title: str | None = None,
    warmup: bool = False,
    width: float = 12.0,
    dpi: int = 120,
) -> Any:
    """Draws a recorded trace: one row per device, programs coloured by client, transfers marked.

    Args:
      trace: a trace file written by :func:`pw.trace` / :func:`pw.stop_trace`,
        or the trace object they return.
      out: where to save the picture (PNG, SVG, PDF: by extension); ``None``
        only returns the figure.
      title: the figure's title.
      warmup: also draw tracing, lowering and compiling on the controller row;
        by default the picture starts at the first dispatch.
      width: the figure's width in inches.
      dpi: resolution of a saved bitmap.

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ImportError: matplotlib is not installed (``pip install 'pathways-jax[viz]'``).
      TimelineError: ``trace`` is not a trace file or object.

    Example:
      >>> import os, tempfile
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 2})
      >>> with pw.trace() as rec:
      ...     out = pw.jit(lambda v: v + 1, devices=s)(jnp.ones(4))
      >>> png = os.path.join(tempfile.mkdtemp(), "run.png")
      >>> try:
      ...     fig = pw.plot_timeline(rec.to_json(), png)  # or the path pw.trace wrote
      ... except ImportError:  # matplotlib is the optional `viz` extra
      ...     fig = None
      >>> fig is None or os.path.getsize(png) > 0
      True
      >>> s.release()
    """
    data = load_trace(trace)
    figure_cls = _import_matplotlib()
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    events = [e for e in data["traceEvents"] if isinstance(e, dict)]
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device_info = {d["id"]: d for d in data.get("otherData", {}).get("devices", []) if "id" in d}
    executions = [e for e in spans if e.get("cat") == "execution"]
    transfers = [e for e in spans if e.get("cat") == "transfer"]
    warm_cats = ("trace", "lower", "compile") if warmup else ()
    controller = [e for e in spans if e.get("cat") in ("dispatch", "submit", "wait", *warm_cats)]
    spans = executions + transfers + controller
    for e in executions:
        device = e.get("args", {}).get("device", e.get("tid"))
        device_info.setdefault(device, {"id": device, "island": e.get("pid", 1) - 1})
    for e in transfers:
        for device in e.get("args", {}).get("dst_devices", []):
            device_info.setdefault(device, {"id": device, "island": e.get("pid", 1) - 1})
    devices = sorted(device_info, key=lambda d: (device_info[d].get("island", 0), d))
    row_of = {d: i + 1 for i, d in enumerate(devices)}  # row 0: the controller
    t0 = min((e["ts"] for e in spans), default=0.0)

    clients = sorted({e.get("args", {}).get("client", "default") for e in executions + transfers})
    programs: dict[str, list[str | None]] = {c: [] for c in clients}  # None: an event naming none
    for e in executions:
        args = e.get("args", {})
        names = programs[args.get("client", "default")]
        if args.get("program") not in names:
            names.append(args.get("program"))

    def colour(args: dict) -> tuple[float, float, float]:
        client = args.get("client", "default")
        base = _CLIENT_COLOURS[clients.index(client) % len(_CLIENT_COLOURS)]
        names = programs.get(client, [])
        index = names.index(args.get("program")) if args.get("program") in names else 0
        return _shade(base, 0.6 * index / max(len(names) - 1, 1))

    height = 1.2 + 0.42 * (len(devices) + 1)
    fig = figure_cls(figsize=(width, height))
    ax = fig.add_subplot(1, 1, 1)
    span_ms = max((e["ts"] + e.get("dur", 0) - t0 for e in spans), default=1.0) / 1e3 or 1.0
    for e in executions:
        args = e.get("args", {})
        row = row_of[args.get("device", e.get("tid"))]
        start, dur = (e["ts"] - t0) / 1e3, max(e.get("dur", 0) / 1e3, span_ms * 1e-3)
        ax.broken_barh(
            [(start, dur)], (row - 0.4, 0.8), facecolors=colour(args), edgecolors="white", linewidth=0.4
        )
        if dur > span_ms * 0.06:
            ax.text(
                start + dur / 2,
                row,
                str(args.get("node", e.get("name", ""))),
                ha="center",
                va="center",
                fontsize=6,
                clip_on=True,
            )
    for e in transfers:
        args = e.get("args", {})
        kind = args.get("kind", "dcn")
        c = _TRANSFER_COLOURS.get(kind, "#7f8c8d")
        start, dur = (e["ts"] - t0) / 1e3, max(e.get("dur", 0) / 1e3, span_ms * 1e-3)
        for device in args.get("dst_devices", []):
            ax.broken_barh(
                [(start, dur)],
                (row_of[device] + 0.12, 0.28),
                facecolors="none",
                edgecolors=c,
                hatch="////",
                linewidth=0.8,
            )
        src = [d for d in args.get("src_devices", []) if d in row_of]
        dst = [d for d in args.get("dst_devices", []) if d in row_of]
        if src and dst and kind != "reshard":
            ax.annotate(
                "",
                xy=(start + dur, row_of[dst[0]]),
                xytext=(start, row_of[src[0]]),
                arrowprops={"arrowstyle": "->", "color": c, "lw": 0.8, "alpha": 0.7},
            )
    for e in controller:
        start, dur = (e["ts"] - t0) / 1e3, max(e.get("dur", 0) / 1e3, span_ms * 5e-4)
        faces: dict[str | None, str] = {
            "wait": "#bbbbbb",
            "trace": "#d8b365",
            "lower": "#d8b365",
            "compile": "#d8b365",
        }
        face = faces.get(e.get("cat"), "#555555")
        ax.broken_barh([(start, dur)], (-0.3, 0.6), facecolors=face, edgecolors="none")
    labels = ["controller"] + [f"island {device_info[d].get('island', '?')} · device {d}" for d in devices]
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms)")
    islands = [device_info[d].get("island") for d in devices]
    for i in range(1, len(islands)):
        if islands[i] != islands[i - 1]:
            ax.axhline(i + 0.5, color="#888888", linewidth=0.8)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    handles: list[Artist] = [
        Patch(facecolor=colour({"client": c, "program": prog}), label=f"{prog} (client {c})")
        for c in clients
        for prog in programs[c]
    ]
    handles += [
        Line2D([0], [0], color=_TRANSFER_COLOURS[k], lw=1.5, label=f"{k.upper()} transfer")
        for k in ("ici", "dcn")
        if any(t.get("args", {}).get("kind") == k for t in transfers)
    ]
    handles.append(Patch(facecolor="#555555", label="controller dispatch"))
    if any(e.get("cat") == "wait" for e in controller):
        handles.append(Patch(facecolor="#bbbbbb", label="controller wait"))
    if warm_cats:
        handles.append(Patch(facecolor="#d8b365", label="trace / lower / compile"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "pathways_jax timeline", fontsize=10)
    fig.tight_layout()
    if out is not None:
        fig.savefig(os.fspath(out), dpi=dpi)
    return fig
