"""Programs of many arguments: a step over a pytree of N leaves, plain ``jax.jit`` and ``@pw.program``.

Real models hand a step hundreds to thousands of parameter leaves. The step here
updates every leaf of ``{layer_i: {"w": f32[4], "b": f32[]}}`` elementwise, so
the devices do next to nothing and what is measured is each side's cost per
leaf:

  first     the first call with arrays, until its outputs are ready (trace,
            lowering, compile, run); a new function each round, so no cache
            of either side helps
  second    the call that follows, fed the first call's outputs (pathways_jax:
            futures, a second signature, traced once more)
  steady    per call, a loop of --calls calls each fed the one before
  steady_nogc
            the same loop with Python's cyclic garbage collector paused, on both
            sides: the difference to ``steady`` is what the collector costs each
            side (every object a call makes and its user keeps to the next call
            counts towards the collector's full collections, which scan every
            live object of the process)

Modes: ``jax`` and ``pw``, in rounds whose order rotates; each figure is the
median over rounds, and ``ratio`` is pw / jax (time: above 1 is slower).
Results: benchmarks/results/many_leaves.json and .png.

  python benchmarks/many_leaves.py            # 100, 500 and 2000 leaves (about two minutes)
  python benchmarks/many_leaves.py --quick    # seconds; used by the test suite
"""

from __future__ import annotations

import gc
import json
import pathlib
import statistics
import time

import common
from absl import app, flags

_LEAVES = flags.DEFINE_list("leaves", ["100", "500", "2000"], "Pytree sizes (leaves) to measure.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds per size.")
_CALLS = flags.DEFINE_integer("calls", 20, "Calls in the steady-state loop.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny run that only checks the benchmark works.")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).resolve().parent / "results"), "Result folder.")

PHASES = ("first", "second", "steady", "steady_nogc")


def _params(leaves: int):
    import jax.numpy as jnp

    return {f"layer{i}": {"w": jnp.full((4,), float(i)), "b": jnp.zeros(())} for i in range(leaves // 2)}


def _ready(tree) -> None:
    import jax

    for leaf in jax.tree.leaves(tree):
        leaf.block_until_ready()


def _measure(make, params, calls: int) -> dict[str, float]:
    """Seconds of the first and second calls of a new step, and per call of a steady loop."""
    start = time.perf_counter()
    out = make(params)
    _ready(out)
    first = time.perf_counter() - start
    start = time.perf_counter()
    out = make(out)
    _ready(out)
    second = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        out = make(out)
    _ready(out)
    steady = (time.perf_counter() - start) / calls
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            out = make(out)
        _ready(out)
        paused = (time.perf_counter() - start) / calls
    finally:
        if collecting:
            gc.enable()
    return {"first": first, "second": second, "steady": steady, "steady_nogc": paused}


def run(leaf_counts: list[int], rounds: int, calls: int) -> dict:
    import jax

    import pathways_jax as pw

    pw.init(num_cpu_devices=2)
    results: dict = {}
    for leaves in leaf_counts:
        params = _params(leaves)
        samples: dict[str, list[dict[str, float]]] = {"jax": [], "pw": []}
        for r in range(rounds):
            bias = 0.01 * (r + 1)  # a new computation each round: no compile cache of either side helps

            def step(p, bias=bias):
                return jax.tree.map(lambda v: v * 0.99 + bias, p)

            makers = {"jax": jax.jit(step), "pw": pw.program(step, name=f"leaves{leaves}_{r}")}
            order = ("jax", "pw") if r % 2 == 0 else ("pw", "jax")
            for mode in order:
                samples[mode].append(_measure(makers[mode], params, calls))
        entry: dict = {"leaves": leaves}
        for mode in ("jax", "pw"):
            entry[mode] = {p: statistics.median(s[p] for s in samples[mode]) for p in PHASES}
        entry["ratio"] = {
            p: statistics.median(b[p] / a[p] for a, b in zip(samples["jax"], samples["pw"], strict=True))
            for p in PHASES
        }
        results[str(leaves)] = entry
        print(
            f"{leaves} leaves: "
            + ", ".join(
                f"{p} jax {entry['jax'][p] * 1e3:.1f} ms / pw {entry['pw'][p] * 1e3:.1f} ms ({entry['ratio'][p]:.2f}x)"
                for p in PHASES
            )
        )
    pw.shutdown()
    return results


def _plot(results: dict, path: pathlib.Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.4))
    sizes = sorted(results, key=int)
    width = 0.2
    for k, phase in enumerate(PHASES):
        xs = [i + (k - 1.5) * width for i in range(len(sizes))]
        ax.bar(xs, [results[s]["ratio"][phase] for s in sizes], width, label=phase)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(sizes)), [f"{s} leaves" for s in sizes])
    ax.set_ylabel("pw.program time / jax.jit time")
    ax.set_title("A step over a pytree of N leaves")
    ax.legend()
    return common.save_figure(plt, fig, path)


def main(argv: list[str]) -> None:
    del argv
    leaf_counts = [20] if _QUICK.value else [int(n) for n in _LEAVES.value]
    rounds = 2 if _QUICK.value else _ROUNDS.value
    calls = 3 if _QUICK.value else _CALLS.value
    results = run(leaf_counts, rounds, calls)
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": common.machine(), "rounds": rounds, "calls": calls, "sizes": results}
    (out / "many_leaves.json").write_text(json.dumps(record, indent=2))
    plotted = _plot(results, out / "many_leaves.png")
    print(f"wrote {out / 'many_leaves.json'}" + (f" and {out / 'many_leaves.png'}" if plotted else ""))


if __name__ == "__main__":
    app.run(main)
