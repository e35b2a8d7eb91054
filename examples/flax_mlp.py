"""Train a Flax NNX MLP where every training step is ONE pathways program.

Run with ``python examples/flax_mlp.py [--steps=300] [--batch=128]``; add
``--backend=ray`` to run the same code on two Ray host processes (needs
``pip install pathways-jax[ray]``): only the ``pw.init`` line differs.

The model learns a smooth function of 8 inputs from synthetic numpy data.
Each step runs on a slice of 4 devices with the batch split along the "data"
axis (data parallelism). The step returns futures; the next step takes those
futures as its inputs, so parameters and optimizer state stay on the devices
for the whole run. At the end the same loop runs in plain ``jax.jit`` from the
same start on the same data, and the two must agree.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

import pathways_jax as pw

_STEPS = flags.DEFINE_integer("steps", 300, "Training steps.")
_BATCH = flags.DEFINE_integer("batch", 128, "Global batch size (a multiple of 4).")
_HIDDEN = flags.DEFINE_integer("hidden", 64, "Width of the hidden layers.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 25, "Print the loss every this many steps.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the model and the data.")
_BACKEND = flags.DEFINE_enum(
    "backend", "local", ["local", "ray"], "local: this process's devices; ray: two Ray host actors."
)

NUM_FEATURES = 8


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.layer1 = nnx.Linear(din, hidden, rngs=rngs)
        self.layer2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.gelu(self.layer1(x))
        x = nnx.gelu(self.layer2(x))
        return self.head(x)


def make_batch(seed: int, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch `step` of a synthetic regression task: y = sin(x @ w) + x0 * x1 + noise."""
    w = np.random.default_rng(seed).normal(size=(NUM_FEATURES, 1)) / np.sqrt(NUM_FEATURES)
    rng = np.random.default_rng([seed, step])
    x = rng.normal(size=(batch, NUM_FEATURES))
    y = np.sin(3 * x @ w) + 0.5 * x[:, :1] * x[:, 1:2] + 0.05 * rng.normal(size=(batch, 1))
    return x.astype(np.float32), y.astype(np.float32)


def make_update(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """One training step in functional style: (state, opt_state, batch) -> (state, opt_state, loss)."""

    @jax.jit
    def loss_and_grad(state, x, y):
        def loss_fn(state):
            model = nnx.merge(graphdef, state)
            return jnp.mean((model(x) - y) ** 2)

        return jax.value_and_grad(loss_fn)(state)

    def update(state, opt_state, batch):
        loss, grads = loss_and_grad(state, *batch)
        # The optax update is plain glue code: the program compiles it together
        # with the loss-and-grad node into one executable (whole-slice compilation).
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    return update


def main(argv: list[str]) -> None:
    del argv
    # Before any JAX work: JAX fixes its CPU device count when its backend starts.
    if _BACKEND.value == "ray":
        pw.init(backend="ray", hosts=2, devices_per_host=4)  # the step runs in host process 0
    else:
        pw.init(num_cpu_devices=8)
    data = pw.devices(mesh={"data": 4})  # a virtual slice of 4 devices, axis "data"
    replicated, split = data.sharding(), data.sharding("data")
    batches = [make_batch(_SEED.value, i, _BATCH.value) for i in range(_STEPS.value)]

    model = MLP(NUM_FEATURES, _HIDDEN.value, 1, rngs=nnx.Rngs(_SEED.value))
    graphdef, init_state = nnx.split(model)  # static structure + a pytree of arrays
    tx = optax.adam(_LEARNING_RATE.value)
    init_opt_state = tx.init(init_state)
    update = make_update(graphdef, tx)

    @pw.program(devices=data)
    def train_step(state, opt_state, batch):
        # Traced into one graph on `data`: the jitted loss-and-grad and the optax
        # glue compile into one node (fuse=False would keep them apart).
        return update(state, opt_state, batch)

    # Training: each call returns futures at once; feeding them to the next
    # call keeps the values on the slice (no trip to the host).
    state = jax.device_put(init_state, replicated)
    opt_state = jax.device_put(init_opt_state, replicated)
    recent = []  # loss futures since the last print
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        state, opt_state, loss = train_step(state, opt_state, jax.device_put(batch, split))
        recent.append(loss)
        if step == 1:
            after_step_1 = pw.counters()
        if step % _LOG_EVERY.value == 0 or step == _STEPS.value - 1:
            # Only here does the host wait, and only for the steps issued so far.
            mean = np.mean([f.result() for f in recent])
            print(f"step {step:4d}  loss {mean:.6f}  (mean of the last {len(recent)} steps)")
            recent = []
    final_state = jax.tree.map(pw.Future.result, state)
    final_loss = float(loss.result())
    elapsed = time.perf_counter() - start
    print(f"pathways: {_STEPS.value} steps in {elapsed:.2f} s ({_STEPS.value / elapsed:.0f} steps/s)")

    # The counters: call 0 traces for host arrays, call 1 for futures (a new
    # input signature, as with jax.jit); from then on nothing is traced or compiled.
    final = pw.counters()
    print(train_step.graph(state, opt_state, jax.device_put(batches[-1], split)))
    print("counters after step 1:", after_step_1)
    print("counters at the end:  ", final)
    for key in ("traces", "lowerings", "compiles"):
        if final[key] != after_step_1[key]:
            raise RuntimeError(f"{key} grew after step 1: {after_step_1[key]} -> {final[key]}")
    print("no new traces, lowerings or compiles after step 1")

    # Reference: the same loop in plain jax.jit, same start, same data.
    reference_step = jax.jit(update)
    ref_state = jax.device_put(init_state, replicated)
    ref_opt_state = jax.device_put(init_opt_state, replicated)
    start = time.perf_counter()
    for batch in batches:
        ref_state, ref_opt_state, ref_loss = reference_step(
            ref_state, ref_opt_state, jax.device_put(batch, split)
        )
    jax.block_until_ready(ref_state)
    print(f"plain jax.jit: {_STEPS.value} steps in {time.perf_counter() - start:.2f} s")

    np.testing.assert_allclose(final_loss, float(ref_loss), rtol=1e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(final_state), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    print(f"final loss {final_loss:.6f}; params and loss match plain jax.jit ({float(ref_loss):.6f})")

    data.release()
    pw.shutdown()


if __name__ == "__main__":
    app.run(main)
