"""Train the Transformer of ``pipeline_transformer.py`` data-parallel over 2 islands.

Run with ``python examples/two_island_data_parallel.py [--steps=200]``.

This is the paper's two-island experiment in miniature: the 8 CPU devices
form 2 islands of 4 (``pw.init(islands=2)``). Each island holds a full copy
of the model and trains on its half of the batch (split again over the
island's 4 devices, so gradients are reduced inside the island by XLA).
Each island's gradients then cross to the other island over DCN, both
average them in the same order and apply the same Adam update, so the two
copies stay bit-identical. A train step is ONE program call. At the end the
same training runs in plain ``jax.jit`` on the full batch, and must agree.
"""

import time

import jax
import numpy as np
import optax
from absl import app, flags
from pipeline_transformer import (
    Config,
    check_against_plain_jax,
    loss_fn,
    make_batch,
    make_stages,
    report_steady_state,
)

import pathways_jax as pw
from pathways_jax import pipeline

_STEPS = flags.DEFINE_integer("steps", 200, "Training steps.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step (a multiple of 8).")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Print the loss every this many steps.")
_CHECK_STEPS = flags.DEFINE_integer("check_steps", 5, "Steps compared with plain jax.jit at the end.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the model and the data.")


def main(argv: list[str]) -> None:
    del argv
    pw.init(num_cpu_devices=8, islands=2)  # 2 islands of 4 CPU devices
    config = Config()
    islands = [pw.devices(mesh={"data": 4}, island=i) for i in range(2)]
    tx = optax.adam(_LEARNING_RATE.value)
    # The same model as the pipeline example, its 4 stages composed into one.
    dp = pipeline.DataParallel(make_stages(config, 4, _SEED.value), islands, loss_fn=loss_fn, optimizer=tx)
    batches = [make_batch(config, _SEED.value, i, _BATCH.value) for i in range(_STEPS.value)]
    graph = dp.graph(*batches[0])
    kinds = [t.kind for t in graph.transfers]
    print(dp, f"one train step = one program: {len(graph.nodes)} nodes, {kinds.count('dcn')} DCN transfers")

    losses, recent, start = [], [], time.perf_counter()
    for step, (x, y) in enumerate(batches):
        loss = dp.train_step(x, y)
        losses.append(loss)
        recent.append(loss)
        if step == 0:
            loss.result()
            after_first, first_done = pw.counters(), time.perf_counter()
        if step % _LOG_EVERY.value == 0 or step == len(batches) - 1:
            mean = np.mean([f.result() for f in recent])
            tokens = _BATCH.value * config.seq_len * (step + 1) / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {mean:.4f}  ({tokens:,.0f} tokens/s since start)", flush=True)
            recent = []
    first, second = dp.params_per_island
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("the two islands hold bit-identical parameters")
    final = report_steady_state(_BATCH.value * config.seq_len, len(batches), after_first, first_done)
    print(
        f"{final['runs'] - after_first['runs']} program runs and "
        f"{final['transfers_dcn'] - after_first['transfers_dcn']} DCN transfers for "
        f"{len(batches) - 1} steps after the first; no new traces, lowerings or compiles"
    )

    # Reference: one replica in plain jax.jit on the full batch, same start, same data.
    check_against_plain_jax(make_stages(config, 4, _SEED.value), tx, batches, losses, _CHECK_STEPS.value)
    pw.shutdown()


if __name__ == "__main__":
    app.run(main)
