"""The README demo (``examples/flax_mlp.py``): its training loop in plain ``jax.jit`` and pathways_jax.

The same train step (an NNX MLP's jitted loss-and-grad plus Optax's Adam
update, on a slice of 4 CPU devices with the batch split along "data") runs in
three modes on the same data, in rounds whose order rotates so machine drift
hits all modes alike:

  jax          plain ``jax.jit`` of the whole step, called once per step
  pw           ``@pw.program`` of the step, with the default options (fused)
  pw-nofuse    the same program with ``fuse=False``: one node per jitted
               function and small nodes for Optax's glue

Each mode's figure is the median over rounds of steps/second, and its ratio is
the median over rounds of (mode / jax of the same round).

  python benchmarks/demo.py            # the full run (about a minute)
  python benchmarks/demo.py --quick    # tiny, seconds; used by the test suite
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import statistics
import time

import common
from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = ("jax", "pw", "pw-nofuse")


def _example():
    """The README demo's module: its model, data and train step are what is measured.

    Its flags (--steps, --batch, --hidden, --learning_rate, --seed) are this benchmark's too.
    """
    spec = importlib.util.spec_from_file_location("flax_mlp", ROOT / "examples" / "flax_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


demo = _example()
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Interleaved rounds per mode.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny run that only checks the benchmark works.")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).resolve().parent / "results"), "Result folder.")


def _plot(result: dict, path: pathlib.Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(result["modes"])
    ratios = [result["modes"][n]["ratio_vs_jax"] for n in names]
    ax.bar(names, ratios, color=["#888888", "#1f77b4", "#9ecae1"][: len(names)])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.95, color="red", linewidth=0.8, linestyle="--", label="0.95x target")
    for i, r in enumerate(ratios):
        ax.text(i, r + 0.01, f"{r:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("steps/s relative to jax.jit")
    ax.set_title("README demo (examples/flax_mlp.py) train step")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str]) -> None:
    del argv
    import pathways_jax as pw

    pw.init(num_cpu_devices=8)
    import jax
    import optax
    from flax import nnx

    rounds, steps = (2, 5) if _QUICK.value else (_ROUNDS.value, demo._STEPS.value)
    data = pw.devices(mesh={"data": 4})
    replicated, split = data.sharding(), data.sharding("data")
    model = demo.MLP(demo.NUM_FEATURES, demo._HIDDEN.value, 1, rngs=nnx.Rngs(demo._SEED.value))
    graphdef, init_state = nnx.split(model)
    tx = optax.adam(demo._LEARNING_RATE.value)
    update = demo.make_update(graphdef, tx)
    batches = [
        jax.device_put(demo.make_batch(demo._SEED.value, i, demo._BATCH.value), split) for i in range(steps)
    ]
    steppers = {
        "jax": jax.jit(update),
        "pw": pw.program(update, devices=data),
        "pw-nofuse": pw.program(update, devices=data, fuse=False),
    }

    def loop(step_fn) -> float:
        state = jax.device_put(init_state, replicated)
        opt_state = jax.device_put(tx.init(init_state), replicated)
        start = time.perf_counter()
        for batch in batches:
            state, opt_state, loss = step_fn(state, opt_state, batch)
        jax.block_until_ready(loss.result() if isinstance(loss, pw.Future) else loss)
        return steps / (time.perf_counter() - start)

    for step_fn in steppers.values():  # warm-up: trace, lower, compile
        loop(step_fn)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        measured = {mode: loop(steppers[mode]) for mode in order}
        for mode in MODES:
            rates[mode].append(measured[mode])
            ratios[mode].append(measured[mode] / measured["jax"])
    result = {
        "benchmark": "demo",
        "machine": common.machine(),
        "steps": steps,
        "rounds": rounds,
        "batch": demo._BATCH.value,
        "hidden": demo._HIDDEN.value,
        "graph_nodes": {
            mode: len(steppers[mode].graph(*_args(init_state, tx, batches[0], jax, replicated)).nodes)
            for mode in ("pw", "pw-nofuse")
        },
        "modes": {
            mode: {
                "steps_per_s": statistics.median(rates[mode]),
                "ratio_vs_jax": statistics.median(ratios[mode]),
                "ratios": ratios[mode],
            }
            for mode in MODES
        },
    }
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(result, indent=2) + "\n")
    plotted = _plot(result, out / "demo.png")
    for mode in MODES:
        entry = result["modes"][mode]
        print(f"{mode:10s} {entry['steps_per_s']:9.1f} steps/s  {entry['ratio_vs_jax']:.3f}x jax.jit")
    print(f"graph nodes: {result['graph_nodes']}")
    print(f"wrote {out / 'demo.json'}" + (f" and {out / 'demo.png'}" if plotted else ""))
    data.release()
    pw.shutdown()


def _args(init_state, tx, batch, jax, replicated):
    state = jax.device_put(init_state, replicated)
    return state, jax.device_put(tx.init(init_state), replicated), batch


if __name__ == "__main__":
    app.run(main)
