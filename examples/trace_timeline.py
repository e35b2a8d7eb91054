"""Seeing what happens: a timeline trace of two threads sharing two islands.

Run with ``python examples/trace_timeline.py`` (add ``--png docs/timeline.png``
to draw the picture; that needs ``pip install 'pathways-jax[viz]'``).

Two Python threads each call their own program twenty times, feeding each
result into the next call; each thread is its own client (a thread's default
client is named after it), so the picture colours their runs apart. Both programs run an all-reduce on island 0 and
move a value over DCN to island 1, so the controller interleaves them on the
same devices in one consistent order. ``pw.trace`` records what it did: open
the JSON in ui.perfetto.dev or chrome://tracing, or draw it with
``pw.plot_timeline``.
"""

import argparse
import collections
import json
import os
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

import pathways_jax as pw

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--trace", default=None, help="where to write the trace JSON (default: a temp dir)")
parser.add_argument("--png", default=None, help="where to draw the timeline picture (needs matplotlib)")
parser.add_argument("--steps", type=int, default=20, help="calls per thread")
args = parser.parse_args()

pw.init(num_cpu_devices=8, islands=2)  # two islands of four CPU devices
near = pw.devices(mesh={"x": 4}, island=0)
far = pw.devices(mesh={"x": 4}, island=1)
P = pw.P


def make_program(name: str, scale: float):
    @pw.jit(devices=near, in_specs=P("x"), out_specs=P("x"))
    def update(w):
        mean = jax.shard_map(lambda v: jax.lax.pmean(v.mean(), "x"), in_specs=P("x"), out_specs=P())(w)
        return jnp.tanh(w) * scale + 0.25 * mean + 0.1

    @pw.jit(devices=far)
    def report(w):
        return (w**2).sum()

    def step(w):
        w = update(w)
        return w, report(w)  # `w` moves from island 0 to island 1 over DCN

    step.__name__ = name
    return pw.program(step)


programs = {"A": make_program("client_a_step", 0.5), "B": make_program("client_b_step", 0.6)}
start = jnp.linspace(-1.0, 1.0, 64)
for program in programs.values():  # warm up: trace, lower and compile before tracing
    w, _ = program(start)  # an array argument...
    program(w)[1].result()  # ...and a future one: each signature is traced once

results: dict[str, list] = {}


ready = threading.Barrier(len(programs), timeout=60)


def client(label: str) -> None:
    w, losses = start, []
    ready.wait()  # start together, so the controller interleaves the two
    for _ in range(args.steps):
        w, loss = programs[label](w)
        losses.append(loss)
        if len(losses) > 2:  # like a training loop logging with a lag of two steps
            losses[-3].result(timeout=120)
    results[label] = [float(x.result(timeout=120)) for x in losses]


trace_path = args.trace or os.path.join(tempfile.mkdtemp(), "run.json")
with pw.trace(trace_path):
    threads = [threading.Thread(target=client, args=(label,), name=f"client-{label}") for label in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
assert not any(t.is_alive() for t in threads), "client threads did not finish"

# Check the numbers against plain jax.jit, one step at a time.
for label, scale in (("A", 0.5), ("B", 0.6)):
    w = start
    for want_loss in results[label]:
        w = jnp.tanh(w) * scale + 0.25 * w.mean() + 0.1
        np.testing.assert_allclose(want_loss, float((w**2).sum()), rtol=1e-5, atol=1e-6)
print("both threads match plain jax.jit")

with open(trace_path) as f:
    events = json.load(f)["traceEvents"]
kinds = collections.Counter(e["cat"] for e in events if e["ph"] == "X")
dcn = sum(1 for e in events if e.get("cat") == "transfer" and e["args"]["kind"] == "dcn")
print(f"trace: {trace_path}")
print(f"events: {dict(sorted(kinds.items()))}; DCN transfers: {dcn}")
print("open it in https://ui.perfetto.dev or chrome://tracing")

if args.png:
    try:
        pw.plot_timeline(trace_path, args.png, title="two threads, two islands: 2 x 20 program runs")
        print(f"picture: {args.png}")
    except ImportError as exc:
        print(f"no picture: {exc}")
