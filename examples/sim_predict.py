"""Sizing a cluster: what would this program do on 8 to 512 TPU v4 hosts? (``pw.sim.predict``)

Run with ``python examples/sim_predict.py`` (``--png sim.png`` draws the
predicted timeline; needs ``pip install 'pathways-jax[sim,viz]'``).

A two-island program (a layer on island 0, its loss on island 1, the
activations crossing over DCN) is traced here on 8 CPU devices, then simulated
on clusters this machine does not have. Nothing is compiled or run for the
prediction: the simulator takes the traced graph and charges every cost from a
profile (``tpu_v4``: public TPU v4 figures plus this project's measured
controller costs). Each node's device time is estimated from its jaxpr, or
given (``node_times``) when you know it from a profile of the real thing.
"""

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp

import pathways_jax as pw

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--png", default=None, help="where to draw the predicted timeline (needs matplotlib)")
parser.add_argument("--layer_ms", type=float, default=20.0, help="device time of the layer on TPU, if known")
args = parser.parse_args()

pw.init(num_cpu_devices=8, islands=2)
near = pw.devices(mesh={"x": 4}, island=0)
far = pw.devices(mesh={"x": 4}, island=1)

layer = pw.jit(lambda w, x: jnp.tanh(x @ w), devices=near)
loss = pw.jit(lambda h: jnp.mean(h**2), devices=far)


@pw.program(fuse=False)
def step(w, x):
    return loss(layer(w, x))


w = jnp.ones((512, 512), jnp.float32) / 512
x = jnp.ones((256, 512), jnp.float32)
print(step.graph(w, x))
print("runs here:", float(step(w, x).result()))

print("\nestimated from the jaxpr (tiny matmuls: the controller's costs show):")
for hosts in (8, 64, 512):
    cluster = pw.sim.SimCluster(hosts=hosts, islands=2, profile="tpu_v4")
    pred = pw.sim.predict(step, w, x, cluster=cluster, runs=16)
    print(f"  {hosts:4d} hosts ({cluster.devices:5d} TPU v4 chips): predicted step {pred.step_time_s * 1e3:8.3f} ms, "
          f"device utilisation {pred.utilisation:6.1%}")  # fmt: skip

print(f"\nwith the layer taking {args.layer_ms} ms per step (node_times):")
names = [n.name for n in step.graph(w, x).nodes]
times = {names[0]: args.layer_ms * 1e-3}
for hosts in (8, 64, 512):
    cluster = pw.sim.SimCluster(hosts=hosts, islands=2, profile="tpu_v4")
    pred = pw.sim.predict(step, w, x, cluster=cluster, runs=16, node_times=times)
    print(f"  {hosts:4d} hosts: predicted step {pred.step_time_s * 1e3:8.3f} ms, "
          f"device utilisation {pred.utilisation:6.1%}")  # fmt: skip

trace = os.path.join(tempfile.mkdtemp(), "sim_timeline.json")
pred.save_timeline(trace)  # the same trace-event JSON pw.trace writes: open it in ui.perfetto.dev
print(f"\nwrote the predicted timeline to {trace}")
if args.png:
    pred.plot(args.png)  # = pw.plot_timeline(pred.timeline, args.png)
    print(f"drew {args.png}")
del jax
pw.shutdown()
