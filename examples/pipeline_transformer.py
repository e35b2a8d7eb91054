"""Train a small decoder-only Transformer pipelined over 4 stages on 4 islands.

Run with ``python examples/pipeline_transformer.py [--steps=200] [--schedule=1f1b]``.

The language model (Flax NNX) is cut into 4 stages: the first holds the
token and position embeddings and a Transformer block, the middle ones a
block each, the last a block and the output head. Each stage lives on its
own island of 2 CPU devices (``pw.init(islands=4)``), its microbatches split
over the island's "data" axis. A train step is ONE program call: the batch
is cut into microbatches that flow forward island to island over DCN, the
cross-entropy is taken on the last island, gradients flow back and every
stage applies its own Adam update on its own island.

The data is made here, no download: a stream of tokens repeating a fixed
random phrase; the model learns to continue it, so the loss falls from
ln(vocab) towards zero. At the end the same training runs in plain
``jax.jit`` on the unpipelined model, and the two must agree.
"""

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

import pathways_jax as pw
from pathways_jax import pipeline


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    seq_len: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 4
    period: int = 24  # length of the repeating phrase in the token stream


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.heads = config.heads
        self.qkv = nnx.Linear(config.d_model, 3 * config.d_model, rngs=rngs)
        self.out = nnx.Linear(config.d_model, config.d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads) for z in jnp.split(self.qkv(x), 3, -1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.out(y.reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        d = config.d_model
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attention = CausalSelfAttention(config, rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class TransformerStage(nnx.Module):
    """Blocks ``[first_layer, first_layer + count)`` of the model, with the embeddings
    if the stage comes first and the output head if it comes last."""

    def __init__(self, config: Config, count: int, *, first: bool, last: bool, rngs: nnx.Rngs):
        d = config.d_model
        self.embed = nnx.Embed(config.vocab, d, rngs=rngs) if first else None
        self.position = (
            nnx.Param(0.02 * jax.random.normal(rngs.params(), (config.seq_len, d))) if first else None
        )
        self.blocks = nnx.List([Block(config, rngs) for _ in range(count)])
        self.norm = nnx.LayerNorm(d, rngs=rngs) if last else None
        self.head = nnx.Linear(d, config.vocab, rngs=rngs) if last else None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.embed is not None:  # token ids -> activations
            x = self.embed(x) + self.position[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.head is not None:  # activations -> logits
            x = self.head(self.norm(x))
        return x


def make_stages(config: Config, num_stages: int, seed: int = 0) -> list[TransformerStage]:
    """The model cut into ``num_stages`` stages of ``layers / num_stages`` blocks each."""
    if config.layers % num_stages:
        raise ValueError(f"{config.layers} layers do not split into {num_stages} equal stages.")
    rngs = nnx.Rngs(seed)
    per = config.layers // num_stages
    return [
        TransformerStage(config, per, first=s == 0, last=s == num_stages - 1, rngs=rngs)
        for s in range(num_stages)
    ]


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_batch(config: Config, seed: int, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows of a token stream that repeats one random phrase: (inputs, next tokens)."""
    phrase = np.random.default_rng(seed).integers(0, config.vocab, size=config.period)
    starts = np.random.default_rng([seed, step]).integers(0, config.period, size=batch)
    index = (starts[:, None] + np.arange(config.seq_len + 1)[None, :]) % config.period
    tokens = phrase[index].astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def report_steady_state(tokens_per_step: int, steps: int, after_first: dict, first_done: float) -> dict:
    """Prints the throughput after the first step; fails if anything was traced or compiled again."""
    if steps > 1:
        rate = tokens_per_step * (steps - 1) / (time.perf_counter() - first_done)
        print(f"after the first step (compiles): {rate:,.0f} tokens/s")
    final = pw.counters()
    for key in ("traces", "lowerings", "compiles"):
        if final[key] != after_first[key]:
            raise RuntimeError(f"{key} grew after step 0: {after_first[key]} -> {final[key]}")
    return final


def check_against_plain_jax(stages, tx, batches, losses, steps: int) -> None:
    """Trains the unpipelined model in plain jax.jit from the same start; compares the losses."""
    params, apply = pipeline.sequential(stages)
    opt_state = tx.init(params)

    @jax.jit
    def reference_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(apply(p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    steps = min(steps, len(batches))
    for step in range(steps):
        want, params, opt_state = reference_step(params, opt_state, *batches[step])
        np.testing.assert_allclose(float(losses[step].result()), float(want), rtol=2e-4)
    print(f"losses of the first {steps} steps match plain jax.jit")
    print(f"loss: first {float(losses[0].result()):.4f}, last {float(losses[-1].result()):.4f}")


def main(argv: list[str]) -> None:
    del argv
    pw.init(num_cpu_devices=8, islands=4)  # 4 islands of 2 CPU devices, before any JAX work
    config = Config()
    num_stages = 4
    slices = [pw.devices(mesh={"data": 2}, island=i) for i in range(num_stages)]
    tx = optax.adam(_LEARNING_RATE.value)
    pipe = pipeline.Pipeline(
        make_stages(config, num_stages, _SEED.value),
        slices,
        loss_fn=loss_fn,
        optimizer=tx,
        num_microbatches=_MICROBATCHES.value,
        schedule=_SCHEDULE.value,
    )
    print(pipe, f"bubble fraction {pipe.bubble_fraction:.2f}")
    batches = [make_batch(config, _SEED.value, i, _BATCH.value) for i in range(_STEPS.value)]
    graph = pipe.graph(*batches[0])
    kinds = [t.kind for t in graph.transfers]
    print(f"one train step = one program: {len(graph.nodes)} nodes, {kinds.count('dcn')} DCN transfers")

    losses, recent, start = [], [], time.perf_counter()
    for step, (x, y) in enumerate(batches):
        loss = pipe.train_step(x, y)  # returns at once; parameters stay on their islands
        losses.append(loss)
        recent.append(loss)
        if step == 0:
            loss.result()
            after_first, first_done = pw.counters(), time.perf_counter()
        if step % _LOG_EVERY.value == 0 or step == len(batches) - 1:
            mean = np.mean([f.result() for f in recent])  # the host waits only here
            tokens = _BATCH.value * config.seq_len * (step + 1) / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {mean:.4f}  ({tokens:,.0f} tokens/s since start)", flush=True)
            recent = []
    jax.tree.map(pw.Future.result, pipe.params)
    final = report_steady_state(_BATCH.value * config.seq_len, len(batches), after_first, first_done)
    print(
        f"{final['runs'] - after_first['runs']} program runs for {len(batches) - 1} steps after the first; "
        "no new traces, lowerings or compiles"
    )

    # Reference: the unpipelined model in plain jax.jit, same start, same data.
    check_against_plain_jax(
        make_stages(config, num_stages, _SEED.value), tx, batches, losses, _CHECK_STEPS.value
    )
    pw.shutdown()


if __name__ == "__main__":
    # Flags are defined only when run as a script: two_island_data_parallel.py imports
    # the model and data from here and defines its own.
    _STEPS = flags.DEFINE_integer("steps", 200, "Training steps.")
    _BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step (a multiple of 2 x microbatches).")
    _MICROBATCHES = flags.DEFINE_integer("microbatches", 4, "Microbatches per step.")
    _SCHEDULE = flags.DEFINE_enum("schedule", "1f1b", list(pipeline.SCHEDULES), "Pipeline schedule.")
    _LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
    _LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Print the loss every this many steps.")
    _CHECK_STEPS = flags.DEFINE_integer("check_steps", 5, "Steps compared with plain jax.jit at the end.")
    _SEED = flags.DEFINE_integer("seed", 0, "Seed of the model and the data.")
    app.run(main)
