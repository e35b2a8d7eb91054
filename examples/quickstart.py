"""Quickstart: one program stitched from two jitted functions on two islands.

Run with ``python examples/quickstart.py``. The words used below:

- island: a group of devices joined by a fast interconnect (ICI). Values moving
  between islands go over the slower data-centre network (DCN).
- slice: a virtual set of devices with a mesh shape and axis names, asked for
  with ``pw.devices``. The cluster maps it onto physical devices.
- program: a function traced by ``@pw.program`` into ONE dataflow graph whose
  nodes are the jitted functions it calls, each placed on its slice.
- controller: one background thread that schedules and dispatches every
  program's nodes, island by island, in one consistent order.
- future: what a program call returns at once; ``.result()`` waits for the
  value and brings it to the client.
"""

import jax
import jax.numpy as jnp
import numpy as np

import pathways_jax as pw

# Eight CPU devices split into two islands of four. This must come before any
# JAX computation: JAX fixes its CPU device count when its backend starts.
pw.init(num_cpu_devices=8, islands=2)

a = pw.devices(mesh={"x": 4})  # a slice of 4 devices on island 0
b = pw.devices(mesh={"x": 4}, island=1)  # and one on island 1
print("slices:", a, b, sep="\n  ")


@pw.jit(devices=a, out_specs=pw.P("x"))  # runs on `a`, output sharded along "x"
def f(x):
    return jnp.sin(x) * 2


@pw.jit(devices=b)  # runs on `b`
def g(x):
    return x.sum()


@pw.program  # f and g become ONE dataflow program of two nodes
def step(x):
    return g(f(x))  # f's output moves from island 0 to island 1 by itself


x = jnp.arange(16.0)
out = step(x)  # returns at once with a pw.Future; the controller runs it
print("future:", out)
result = out.result()  # waits, then gives a jax.Array on the client
print("result:", result)

# The same math in plain jax.jit, as a reference.
expected = jax.jit(lambda v: (jnp.sin(v) * 2).sum())(x)
np.testing.assert_allclose(np.asarray(result), np.asarray(expected), rtol=1e-6)
print("matches plain jax.jit:", expected)

# The graph: nodes, where each runs, and the transfer between islands.
print(step.graph(x))

# A second call reuses the traced graph and the compiled executables.
step(x).result()
print("counters:", pw.counters())

pw.shutdown()
