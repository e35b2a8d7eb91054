"""A training loop fed by input iterators on the hosts, beside the same loop fed from here.

Four Ray hosts form one island (one device each); a linear model trains
data-parallel over the four devices. Each step's global batch is made two ways:

* **host-fed**: a ``pw.colocated_python.HostIterator``: every host runs its own
  iterator, makes its rows of the batch and puts them on its own device. The
  batch's futures go straight into the training step: no input data passes
  through this process.
* **controller-fed**: the same batches made here, in this process, and passed
  to the step as numpy arrays: each goes to the hosts with the step's messages.

Both loops see the same data, so their parameters must match; the script
prints the time per step, the bytes of input each loop sent from here, and
the iterator's state (what a checkpoint would keep).

  python examples/host_input.py                 # about 20 s, most of it Ray's start
  python examples/host_input.py --steps=50 --batch=4096

On a machine whose 2 cores the 4 hosts share, each host's call costs about
0.5 ms of CPU besides its rows, and the 4 hosts take turns: at a batch of
0.5 MB (``--batch=2048``) the controller-fed loop is the faster here, at 1 MB
they are even, at 2 MB and more the host-fed loop is (see
``benchmarks/README.md``). Hosts with cores of their own make their parts in
parallel.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pathways_jax as pw  # noqa: E402

FEATURES = 64


def make_rows(step: int, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``first .. first + count`` of step ``step``'s global batch: features and targets."""
    rng = np.random.default_rng([step, first])
    x = rng.standard_normal((count, FEATURES), dtype=np.float32)
    true_w = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)
    return x, x @ true_w + 0.5


class Batches:
    """A per-host iterator: this host's rows of every step's batch (``shard`` says which)."""

    def __init__(self, shard: pw.colocated_python.Shard, batch: int) -> None:
        self.rows = batch // shard.count
        self.first = shard.index * self.rows
        self.step = 0

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict:
        x, y = make_rows(self.step, self.first, self.rows)
        self.step += 1
        return {"x": x, "y": y}

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--batch", type=int, default=8192, help="global batch rows (4 hosts' shards; 8192 rows: 2.1 MB)"
    )
    args = parser.parse_args()

    pw.init(backend="ray", hosts=4, devices_per_host=1, islands=1)
    s = pw.devices(mesh={"data": 4})
    spec = {
        "x": jax.ShapeDtypeStruct((args.batch, FEATURES), np.float32, sharding=s.sharding("data")),
        "y": jax.ShapeDtypeStruct((args.batch,), np.float32, sharding=s.sharding("data")),
    }

    @pw.jit(devices=s, out_specs=pw.P())
    def train_step(params, batch):
        def loss(p):
            pred = batch["x"] @ p["w"] + p["b"]
            return jnp.mean((pred - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value

    def fresh():
        return {"w": jnp.zeros(FEATURES), "b": jnp.zeros(())}

    def controller_batch(step: int) -> dict:
        parts = [make_rows(step, h * (args.batch // 4), args.batch // 4) for h in range(4)]
        return {"x": np.concatenate([x for x, _ in parts]), "y": np.concatenate([y for _, y in parts])}

    batch_bytes = args.batch * (FEATURES + 1) * 4
    timings = {}
    for mode in ("host-fed", "controller-fed"):
        params = fresh()
        batches = pw.colocated_python.HostIterator(lambda shard: Batches(shard, args.batch), spec)
        params, loss = train_step(params, next(batches) if mode == "host-fed" else controller_batch(0))
        loss.result()  # compiled, iterators started
        start = time.perf_counter()
        for step in range(1, args.steps):
            batch = next(batches) if mode == "host-fed" else controller_batch(step)
            params, loss = train_step(params, batch)
        final = float(loss.result())
        timings[mode] = (time.perf_counter() - start) / (args.steps - 1)
        sent = 0 if mode == "host-fed" else batch_bytes * args.steps
        print(
            f"{mode:15s} {timings[mode] * 1e3:7.2f} ms/step  loss {final:.5f}  "
            f"input bytes sent from this process: {sent}"
        )
        if mode == "host-fed":
            print(f"iterator state (each host's, for a checkpoint): {batches.get_state()}")
            host_params = pw.results(params)
        else:
            np.testing.assert_allclose(host_params["w"], params["w"].result(), rtol=1e-5, atol=1e-6)
            print("host-fed and controller-fed parameters match")
    print(f"host-fed step time / controller-fed: {timings['host-fed'] / timings['controller-fed']:.2f}x")
    pw.shutdown()


if __name__ == "__main__":
    main()
