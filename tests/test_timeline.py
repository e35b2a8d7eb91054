"""Timeline traces: valid trace-event JSON whose events match what ran; nothing when off."""

import collections
import importlib.util
import itertools
import json
import logging
import sys

import jax.numpy as jnp
import pytest
from absl import logging as absl_logging
from helpers import run_script

import pathways_jax as pw
from pathways_jax._src.api import recording
from pathways_jax._src.backends import local as local_backend
from pathways_jax._src.core import events, trace_format


@pytest.fixture(autouse=True)
def _no_trace_left_running():
    yield
    if recording.ACTIVE is not None:  # a failed test must not leak its recorder
        pw.stop_trace(timeout=5)


def _two_island_program():
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)

    @pw.jit(devices=a, out_specs=pw.P("x"))
    def scale(x):
        return jnp.sin(x) * 2

    @pw.jit(devices=b)
    def total(x):
        return x.sum()

    @pw.program
    def step(x):
        return total(scale(x))  # one DCN transfer, island 0 -> 1

    return a, b, step


def _check_trace_event_json(data: dict) -> list[dict]:
    """Checks the Chrome/Perfetto trace-event format; returns the events."""
    json.loads(json.dumps(data))  # plain JSON types only
    assert isinstance(data["traceEvents"], list)
    names = collections.defaultdict(dict)
    for e in data["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], int | float) and e["ts"] >= 0, e
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0, e
            assert isinstance(e.get("cat"), str) and isinstance(e.get("args"), dict), e
        elif e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name"), e
            names[e["name"]][(e["pid"], e["tid"])] = e["args"]
        else:
            assert e["ph"] == "i" and e["s"] in ("t", "p", "g"), e
    # Every track that holds spans is named, and spans on one track never overlap.
    spans = collections.defaultdict(list)
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            assert (e["pid"], e["tid"]) in names["thread_name"], e
            spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["cat"]))
    for track, items in spans.items():
        if track[0] == trace_format.CONTROLLER_PID:
            continue  # controller spans nest (lower holds compiles)
        items.sort()
        for (_, end, _), (start, _, _) in itertools.pairwise(items):
            assert start >= end - 1e-3, (track, items)
    return data["traceEvents"]


@pytest.mark.timeout(60)
def test_trace_file_matches_what_ran(tmp_path):
    pw.init(num_cpu_devices=8, islands=2)
    a, b, step = _two_island_program()
    path = tmp_path / "run.json"
    pw.reset_counters()
    with pw.trace(path) as rec:
        outs = [step(jnp.arange(16.0)) for _ in range(3)]
    assert recording.ACTIVE is None
    counts = pw.counters()
    assert all(o.done() for o in outs)  # the trace waited for the work it recorded
    with open(path) as f:
        data = json.load(f)
    assert data == json.loads(json.dumps(rec.to_json()))
    events = _check_trace_event_json(data)
    spans = [e for e in events if e["ph"] == "X"]
    by_cat = collections.Counter(e["cat"] for e in spans)
    assert by_cat["trace"] == counts["traces"] == 1
    assert by_cat["lower"] == counts["lowerings"] == 1
    assert by_cat["compile"] == counts["compiles"] == 2
    assert by_cat["submit"] == counts["runs"] == 3

    # One execution event per node per run, on each device of the node's slice.
    graph = step.graph(jnp.arange(16.0))
    runs = sorted({e["args"]["run"] for e in spans if e["cat"] == "submit"})
    assert len(runs) == 3
    executions = collections.defaultdict(list)
    for e in spans:
        if e["cat"] == "execution":
            executions[(e["args"]["run"], e["args"]["node"])].append(e["args"]["device"])
    want_devices = {node.name: sorted(d.id for d in node.slice.devices) for node in graph.nodes}
    assert set(executions) == {(r, n.name) for r in runs for n in graph.nodes}
    for (_, node), devices in executions.items():
        assert sorted(devices) == want_devices[node]
    assert len(executions) == counts["dispatches"] == 6
    node_sources = {e["args"]["source"] for e in spans if e["cat"] == "execution"}
    assert node_sources == {n.source_info for n in graph.nodes}

    # Transfers where the graph has them: one DCN transfer per run, with its bytes.
    dcn = [e for e in spans if e["cat"] == "transfer" and e["args"]["kind"] == "dcn"]
    assert len(graph.transfers) == 1 and graph.transfers[0].kind == "dcn"
    assert sorted(e["args"]["run"] for e in dcn) == runs
    assert counts["transfers_dcn"] == 3 and counts["transfers_ici"] == 0
    for e in dcn:
        assert e["args"]["bytes"] == 16 * 4
        assert e["args"]["src_devices"] == [d.id for d in a.devices]
        assert e["args"]["dst_devices"] == [d.id for d in b.devices]
        assert e["pid"] == 1 + b.island  # drawn on the receiving island

    # The client of every run, and named tracks for controller, islands and devices.
    assert {e["args"]["client"] for e in spans if e["cat"] in ("execution", "transfer", "submit")} == {
        "default"
    }
    assert data["otherData"]["clients"] == ["default"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"controller", "island 0", "island 1"} <= names
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "MainThread" in threads  # the caller's thread: trace, lower, compile, submit
    assert {f"device {d.id} (cpu, host 0)" for d in [*a.devices, *b.devices]} <= threads


@pytest.mark.timeout(60)
def test_tracing_off_records_nothing(monkeypatch):
    pw.init(num_cpu_devices=8, islands=2)
    _, _, step = _two_island_program()
    calls = collections.Counter()
    original = recording.Recorder.record

    def counting(self, event):
        calls[type(event).__name__] += 1
        return original(self, event)

    monkeypatch.setattr(recording.Recorder, "record", counting)
    assert recording.ACTIVE is None and events.SINK is None
    step(jnp.arange(16.0)).result(timeout=30)  # traces, lowers, compiles, runs: all untraced
    assert calls == {}

    with pw.trace() as rec:
        step(jnp.arange(16.0)).result(timeout=30)
    assert calls["Submitted"] == 1 and calls["Dispatched"] == 2 and calls["Moved"] >= 1
    recorded = len(rec.events)
    calls.clear()
    step(jnp.arange(16.0)).result(timeout=30)  # after the trace: nothing more
    assert calls == {} and len(rec.events) == recorded


def test_traces_do_not_nest_and_stop_needs_a_start(tmp_path):
    with pytest.raises(pw.errors.TimelineError, match="no trace is being recorded"):
        pw.stop_trace()
    pw.start_trace()
    with pytest.raises(pw.errors.TimelineError, match=r"already being recorded.*pw\.stop_trace"):
        pw.start_trace(tmp_path / "other.json")
    assert "traceEvents" in pw.stop_trace()
    with pytest.raises(pw.errors.TimelineError, match="does not exist") as info:
        pw.start_trace(tmp_path / "missing" / "run.json")
    assert isinstance(info.value, RuntimeError)
    assert recording.ACTIVE is None


def test_recorder_takes_clients_and_back_pressure_waits():
    rec = pw.start_trace()
    start = rec.now()
    rec.record(events.Waited("back-pressure", "alice", 1, start, start + 2_000_000, bytes=1024))
    rec.record(events.Waited("back-pressure", "bob", None, start, start + 1_000))  # too short for a slice
    trace = pw.stop_trace()
    waits = [e for e in trace["traceEvents"] if e.get("cat") == "wait"]
    assert len(waits) == 1
    assert waits[0]["name"] == "wait: back-pressure (island 1)"
    assert waits[0]["args"] == {"client": "alice", "island": 1, "bytes": 1024}
    assert waits[0]["dur"] == pytest.approx(2000.0)
    assert trace["otherData"]["clients"] == ["alice"]


@pytest.mark.timeout(60)
def test_failures_are_logged_and_marked(monkeypatch, caplog):
    pw.init(num_cpu_devices=8, islands=2)
    _, _, step = _two_island_program()
    step(jnp.arange(16.0)).result(timeout=30)

    class BrokenJax:
        @staticmethod
        def device_put(*args, **kwargs):
            raise OSError("link down")

    monkeypatch.setattr(local_backend, "jax", BrokenJax)
    with pw.trace() as rec:
        out = step(jnp.arange(16.0))
    with pytest.raises(pw.errors.ProgramFailedError, match="link down"):
        out.result(timeout=30)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "link down" in r.getMessage()]
    assert len(warnings) == 1 and "program 'step'" in warnings[0].getMessage()
    failures = [e for e in rec.events if e["cat"] == "failure"]
    assert len(failures) == 1 and "link down" in failures[0]["args"]["message"]


@pytest.mark.timeout(60)
def test_compiles_and_remaps_log_at_debug_only(caplog):
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 2}, island=0)
    double = pw.jit(lambda v: v * 2, devices=s)
    double(jnp.ones(4)).result(timeout=30)
    assert not [r for r in caplog.records if r.name == "absl"]  # hidden by default
    old = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.DEBUG)
    try:
        double(jnp.ones(6)).result(timeout=30)  # a new signature: lowered and compiled
        # Move the slice as the resource manager would: the plan is lowered again.
        other = tuple(d for d in pw.cluster().islands[0].devices if d not in s.devices)[:2]
        s._devices, s._physical_mesh = other, None
        pw.cluster().mapping_epoch += 1
        double(jnp.ones(6)).result(timeout=30)
    finally:
        absl_logging.set_verbosity(old)
    messages = [r.getMessage() for r in caplog.records if r.name == "absl"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "absl")
    assert any(m.startswith("compiled node '<lambda>'") for m in messages), messages
    assert any("lowered 1 nodes onto devices" in m for m in messages), messages
    remaps = [m for m in messages if "re-lowered after a remap" in m]
    assert len(remaps) == 1 and f"slice #{s.id}" in remaps[0], messages


@pytest.mark.timeout(60)
def test_plot_timeline_draws_devices_and_transfers(tmp_path):
    pytest.importorskip("matplotlib")
    pw.init(num_cpu_devices=8, islands=2)
    a, b, step = _two_island_program()
    step(jnp.arange(16.0)).result(timeout=30)
    path = tmp_path / "run.json"
    with pw.trace(path):
        step(jnp.arange(16.0))
    fig = pw.plot_timeline(path, tmp_path / "run.png", title="two islands")
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["controller"] + [
        f"island {d.id // 4} · device {d.id}" for d in [*a.devices, *b.devices]
    ]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "step (client default)" in legend and "DCN transfer" in legend
    assert ax.get_title() == "two islands"


def test_plot_timeline_errors(tmp_path, monkeypatch):
    with pytest.raises(pw.errors.TimelineError, match="no trace file at"):
        pw.plot_timeline(tmp_path / "nothing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(pw.errors.TimelineError, match="not trace-event JSON"):
        pw.plot_timeline(tmp_path / "bad.json")
    with pytest.raises(pw.errors.TimelineError, match="'traceEvents' list"):
        pw.plot_timeline({"events": []})
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'pathways-jax\[viz\]'"):
        pw.plot_timeline({"traceEvents": []})


@pytest.mark.timeout(120)
def test_trace_timeline_example_runs_and_draws(tmp_path):
    trace, png = tmp_path / "run.json", tmp_path / "timeline.png"
    out = run_script(
        "examples/trace_timeline.py", f"--trace={trace}", f"--png={png}", "--steps=4", timeout=100
    )
    assert "both threads match plain jax.jit" in out
    assert "DCN transfers: 8" in out  # 2 threads x 4 runs x 1 DCN transfer
    with open(trace) as f:
        events = _check_trace_event_json(json.load(f))
    programs = {e["args"]["program"] for e in events if e.get("cat") == "execution"}
    assert programs == {"client_a_step", "client_b_step"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "pathways-jax[viz]" in out


def test_the_simulator_lays_out_its_trace_as_pw_trace_does():
    """One trace format (core.trace_format): the same metadata events and track names in both traces."""
    from pathways_jax import sim

    pw.init(num_cpu_devices=8, islands=2)
    a, b, step = _two_island_program()
    with pw.trace() as rec:
        step(jnp.arange(16.0)).result()
    real = rec.to_json()
    cluster = sim.SimCluster(hosts=2, devices_per_host=4, islands=2)
    simulated = sim.simulate(cluster, sim.chain(cluster, 2, compute_s=1e-5)).trace

    def layout(data):
        _check_trace_event_json(data)
        meta = [e for e in data["traceEvents"] if e["ph"] == "M"]
        processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
        sorted_ = {e["pid"] for e in meta if e["name"] == "process_sort_index"}
        threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
        return processes, sorted_, threads, data["displayTimeUnit"]

    for processes, sorted_, threads, unit in (layout(real), layout(simulated)):
        assert processes[1] == "island 0" and processes[2] == "island 1"
        assert processes[trace_format.CONTROLLER_PID].startswith("controller")
        assert sorted_ == set(processes)  # every process ordered by its pid
        assert threads[(1, trace_format.TRANSFER_TID)] == "transfers into island 0"
        assert threads[(1, 0)].startswith("device 0 (")
        assert unit == "ms"
    s_real = next(e for e in real["traceEvents"] if e["ph"] == "X")
    s_sim = next(e for e in simulated["traceEvents"] if e["ph"] == "X")
    assert set(s_real) == set(s_sim)  # spans carry the same fields
    a.release()
    b.release()
