"""Calls other than the steady repeat call, against ``jax.jit`` side by side in one process.

Each case runs the same function on the same inputs under ``jax.jit`` and
under pathways_jax, and reports the time per call of each and their ratio
(pathways_jax over ``jax.jit``: above 1 is slower). A cliff is a ratio of 10
or more, or a cost that grows without bound; the cases:

- ``first call``: trace, compile and run of a function never called before;
- ``second call, donating``: a train step's second call, with the futures of the first
  (``jax.jit``: the arrays it returned), the state donated;
- ``made again inline``: ``pw.jit(f)(x)`` / ``jax.jit(f)(x)`` written inline in a loop;
- ``new shape each call``: a loop whose calls each bring a new shape (retrace and compile);
- ``numpy input each call``, ``Python scalar each call``: host data put on devices per call;
- ``after jax.clear_caches()``: the call after clearing, which traces and compiles again.

Run: ``python benchmarks/cliffs.py [--out benchmarks/results/cliffs.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, pyplot, save_figure

import pathways_jax as pw


def _mlp(params, x):
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return (x**2).mean()


def _train_step(params, x):
    loss, grads = jax.value_and_grad(_mlp)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def _params(layers: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), layers)
    return [{"w": jax.random.normal(k, (32, 32)) * 0.1, "b": jnp.zeros(32)} for k in keys]


def _sine(v):
    return jnp.sin(v) * 2


def _scale(v, k):
    return v * k


def _ready(out) -> None:
    jax.block_until_ready(pw.results(out))


def _per_call(fn, calls: int) -> float:
    """Seconds a call of ``fn(i)`` for ``i`` in ``range(calls)``, waiting for the last."""
    out = None
    start = time.perf_counter()
    for i in range(calls):
        out = fn(i)
    _ready(out)
    return (time.perf_counter() - start) / calls


def _first_call(make, layers: int) -> float:
    params, x = _params(layers, seed=layers), jnp.ones((8, 32))
    step = make(_train_step)
    start = time.perf_counter()
    _ready(step(params, x))
    return time.perf_counter() - start


def _second_call(make, layers: int) -> float:
    params, x = _params(layers, seed=100 + layers), jnp.ones((8, 32))
    step = make(_train_step, donate_argnums=0)
    params, loss = step(params, x)
    _ready(loss)
    start = time.perf_counter()
    _, loss = step(params, x)
    _ready(loss)
    return time.perf_counter() - start


def _after_clear(make) -> float:
    x = jnp.ones((64, 64))
    f = make(_sine)
    _ready(f(x))
    jax.clear_caches()
    start = time.perf_counter()
    _ready(f(x))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per loop case")
    parser.add_argument("--layers", type=int, default=24, help="layers of the train step")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cliffs.json"))
    args = parser.parse_args()
    pw.init(num_cpu_devices=8)
    x = jnp.ones((64, 64))
    host = np.ones((64, 64), np.float32)
    n = args.calls
    jit_scale, pw_scale = jax.jit(_scale), pw.program(_scale)
    cases = {
        "first call": (
            lambda: _first_call(jax.jit, args.layers),
            lambda: _first_call(pw.program, args.layers + 1),
        ),
        "second call, donating": (
            lambda: _second_call(jax.jit, args.layers),
            lambda: _second_call(pw.program, args.layers + 1),
        ),
        "made again inline": (
            lambda: _per_call(lambda i: jax.jit(_sine)(x), n),
            lambda: _per_call(lambda i: pw.jit(_sine)(x), n),
        ),
        "new shape each call": (
            lambda: _per_call(lambda i: jax.jit(_sine)(jnp.ones(i + 1)), n // 4),
            lambda: _per_call(lambda i: pw.program(_sine)(jnp.ones(i + 1 + n)), n // 4),
        ),
        "numpy input each call": (
            lambda: _per_call(lambda i: jit_scale(host, 2.0), n),
            lambda: _per_call(lambda i: pw_scale(host, 2.0), n),
        ),
        "Python scalar each call": (
            lambda: _per_call(lambda i: jit_scale(x, float(i)), n),
            lambda: _per_call(lambda i: pw_scale(x, float(i)), n),
        ),
        "after jax.clear_caches()": (lambda: _after_clear(jax.jit), lambda: _after_clear(pw.program)),
    }
    # Both sides' machinery started, and the loops' functions traced (first calls are a case).
    _ready(jit_scale(x, 1.0))
    _ready(pw_scale(x, 1.0))
    _ready(jit_scale(host, 1.0))
    _ready(pw_scale(host, 1.0))
    rows = []
    for name, (theirs, ours) in cases.items():
        jax_s, pw_s = theirs(), ours()
        rows.append({"case": name, "jax_s": jax_s, "pw_s": pw_s, "ratio": pw_s / jax_s})
        print(
            f"{name:28s} jax.jit {jax_s * 1e3:9.3f} ms   pathways_jax {pw_s * 1e3:9.3f} ms   {pw_s / jax_s:6.2f}x"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "calls": n, "layers": args.layers, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    plt = pyplot()
    if plt is not None:
        png = os.path.splitext(args.out)[0] + ".png"
        _plot(plt, rows, png)
        print(f"wrote {png}")


def _plot(plt, rows: list[dict], path: str) -> None:
    """Each case's ratio (pathways_jax over jax.jit, log scale), with the cliff line at 10x."""
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    names = [row["case"] for row in rows][::-1]
    ratios = [row["ratio"] for row in rows][::-1]
    ax.barh(names, ratios, color=["tab:red" if r >= 10 else "tab:blue" for r in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(10.0, color="tab:red", linestyle="--", linewidth=0.8, label="a cliff: 10x")
    ax.set_xscale("log")
    ax.set_xlabel("time a call, pathways_jax / jax.jit (above 1 is slower)")
    ax.legend(loc="lower right")
    save_figure(plt, fig, path)


if __name__ == "__main__":
    main()
