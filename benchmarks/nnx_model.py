"""A GPT-2-shaped Flax NNX train step and a short ``lax.scan`` step: ``@pw.program`` as a drop-in.

Two parts, each run side by side with the function it replaces, in interleaved
rounds whose order alternates:

  nnx    a 12-layer transformer-ish NNX model (148 parameter leaves) with
         ``nnx.Optimizer(optax.adamw)`` (about 300 optimizer-state leaves),
         tiny compute, so what is measured is each side's per-call cost:
         ``nnx.jit(step)`` against ``pw.program(step)``
  scan   a functional step that accumulates gradients with ``lax.scan`` over
         microbatches, then applies SGD: ``jax.jit`` against ``pw.program``

Each round runs --calls calls of each side back to back (each fed the state
of the one before, as a train loop is) and waits for the last loss. Figures
are medians over rounds: seconds per call, ``ratio`` (steps/s of pw over the
reference: above 1 is faster) and ``overhead_ms`` (pw's extra time per call).
Results: benchmarks/results/nnx_model.json and .png.

  python benchmarks/nnx_model.py             # about a minute
  python benchmarks/nnx_model.py --quick     # seconds
  python benchmarks/nnx_model.py --profile=nnx   # cProfile of pw's steady calls, top 25 by own time
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

import common
from absl import app, flags

_ROUNDS = flags.DEFINE_integer("rounds", 7, "Interleaved rounds per part.")
_CALLS = flags.DEFINE_integer("calls", 30, "Calls per side in each round.")
_PARTS = flags.DEFINE_list("parts", ["nnx", "scan"], "Parts to run: nnx, scan.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny run that only checks the benchmark works.")
_PROFILE = flags.DEFINE_string("profile", "", "Profile pw's steady calls of this part instead of timing.")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).resolve().parent / "results"), "Result folder.")

LAYERS = 12
WIDTH = 16
SEQ = 4
BATCH = 2
VOCAB = 32


def _model_and_optimizer():
    """A GPT-2-shaped NNX model (12 blocks of LN, attention, LN, MLP) and its AdamW optimizer."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs)
            self.proj = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.fc = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
            self.out = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
            weights = nnx.softmax(q @ k.swapaxes(-1, -2) / WIDTH**0.5, axis=-1)
            x = x + self.proj(weights @ v)
            return x + self.out(nnx.gelu(self.fc(self.ln2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.wte = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            self.wpe = nnx.Embed(SEQ, WIDTH, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.ln_f = nnx.LayerNorm(WIDTH, rngs=rngs)

        def __call__(self, tokens):
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[-1]))
            for block in self.blocks:
                x = block(x)
            return self.wte.attend(self.ln_f(x))

    model = GPT(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return model, optimizer


def nnx_step(model, optimizer, tokens, targets):
    """One AdamW step of next-token cross-entropy; returns the loss."""
    import optax
    from flax import nnx

    def loss_fn(model):
        logits = model(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def leaf_counts(model, optimizer) -> tuple[int, int]:
    """Parameter leaves of the model and state leaves of the optimizer (its step and count included)."""
    import jax
    from flax import nnx

    params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    return params, len(jax.tree.leaves(nnx.state(optimizer)))


def _nnx_sides():
    """``{"ref": call, "pw": call}``: each runs one step on its own model and optimizer, returns the loss."""
    import jax.numpy as jnp
    from flax import nnx

    import pathways_jax as pw

    tokens = jnp.arange(BATCH * SEQ).reshape(BATCH, SEQ) % VOCAB
    targets = (tokens + 1) % VOCAB
    sides = {}
    for mode, wrap in (("ref", nnx.jit), ("pw", pw.program)):
        model, optimizer = _model_and_optimizer()
        step = wrap(nnx_step)
        sides[mode] = lambda step=step, model=model, optimizer=optimizer: step(
            model, optimizer, tokens, targets
        )
    return sides


def scan_step(params, batches):
    """Gradients accumulated over microbatches with ``lax.scan``, then one SGD step."""
    import jax
    import jax.numpy as jnp

    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    def micro(acc, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(jnp.add, acc, grads), value

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, losses = jax.lax.scan(micro, zeros, batches)
    new = jax.tree.map(lambda p, g: p - 0.01 * g / batches[0].shape[0], params, grads)
    return new, losses.mean()


def _scan_sides():
    import jax
    import jax.numpy as jnp

    import pathways_jax as pw

    key = jax.random.key(0)
    params = {
        "w1": jax.random.normal(key, (8, 16)),
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(key, (16, 1)),
        "b2": jnp.zeros(1),
    }
    batches = (jnp.ones((4, 2, 8)), jnp.zeros((4, 2, 1)))
    sides = {}
    for mode, wrap in (("ref", jax.jit), ("pw", pw.program)):
        step = wrap(scan_step)
        state = {"params": params}

        def call(step=step, state=state):
            state["params"], loss = step(state["params"], batches)
            return loss

        sides[mode] = call
    return sides


def _wait(loss) -> None:
    loss.block_until_ready() if hasattr(loss, "block_until_ready") else loss.result()


def _per_call(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        loss = call()
    _wait(loss)
    return (time.perf_counter() - start) / calls


def _measure(sides: dict, rounds: int, calls: int) -> dict:
    for call in sides.values():  # warm up: trace, compile and a few steady calls
        for _ in range(3):
            _wait(call())
    samples: dict[str, list[float]] = {"ref": [], "pw": []}
    for r in range(rounds):
        for mode in ("ref", "pw") if r % 2 == 0 else ("pw", "ref"):
            samples[mode].append(_per_call(sides[mode], calls))
    ref = statistics.median(samples["ref"])
    ours = statistics.median(samples["pw"])
    return {
        "ref_s": ref,
        "pw_s": ours,
        "ratio": statistics.median(a / b for a, b in zip(samples["ref"], samples["pw"], strict=True)),
        "overhead_ms": (ours - ref) * 1e3,
    }


PARTS = {"nnx": (_nnx_sides, "nnx.jit"), "scan": (_scan_sides, "jax.jit")}


def _profile(part: str, calls: int) -> None:
    import cProfile
    import pstats

    sides = PARTS[part][0]()
    for _ in range(3):
        _wait(sides["pw"]())
    profiler = cProfile.Profile()
    profiler.enable()
    _per_call(sides["pw"], calls)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    pstats.Stats(profiler).sort_stats("cumtime").print_stats(40)


def run(parts: list[str], rounds: int, calls: int) -> dict:
    import pathways_jax as pw

    pw.init()
    results: dict = {}
    for part in parts:
        make, reference = PARTS[part]
        entry = {"reference": reference, **_measure(make(), rounds, calls)}
        if part == "nnx":
            entry["param_leaves"], entry["optimizer_leaves"] = leaf_counts(*_model_and_optimizer())
        results[part] = entry
        print(
            f"{part}: {reference} {entry['ref_s'] * 1e3:.3f} ms, pw {entry['pw_s'] * 1e3:.3f} ms a call; "
            f"steps/s ratio {entry['ratio']:.2f}x, overhead {entry['overhead_ms']:+.3f} ms a call"
        )
    pw.shutdown()
    return results


def _plot(results: dict, path: pathlib.Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2))
    parts = list(results)
    ax.bar(range(len(parts)), [results[p]["ratio"] for p in parts], 0.5)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(parts)), [f"{p}\n(vs {results[p]['reference']})" for p in parts])
    ax.set_ylabel("steps/s, pw.program / reference")
    ax.set_title("Drop-in train steps, tiny compute")
    return common.save_figure(plt, fig, path)


def main(argv: list[str]) -> None:
    del argv
    if _PROFILE.value:
        import pathways_jax as pw

        pw.init()
        _profile(_PROFILE.value, _CALLS.value)
        pw.shutdown()
        return
    rounds = 2 if _QUICK.value else _ROUNDS.value
    calls = 3 if _QUICK.value else _CALLS.value
    results = run(list(_PARTS.value), rounds, calls)
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": common.machine(), "rounds": rounds, "calls": calls, "parts": results}
    (out / "nnx_model.json").write_text(json.dumps(record, indent=2))
    plotted = _plot(results, out / "nnx_model.png")
    print(f"wrote {out / 'nnx_model.json'}" + (f" and {out / 'nnx_model.png'}" if plotted else ""))


if __name__ == "__main__":
    app.run(main)
