"""The paper's dispatch micro-benchmark: plain JAX and pathways_jax side by side.

One *computation* is a scalar all-reduce over the slice's devices followed by a
scalar add; each output feeds the next. Modes (DESIGN §6):

  jax-O       plain JAX, one jitted call per computation (at most --jax_window
              computations in flight: XLA's CPU runtime deadlocks on unbounded
              asynchronous dispatch of collectives, DESIGN §5; 16 was measured
              safe on 8 devices and costs no throughput against smaller bounds)
  jax-F       plain JAX, one jitted function holding --chain computations
  pw-O        one pw.jit call per computation, through the controller
  pw-C        one @pw.program chaining --chain nodes, called repeatedly
  pw-C+fuse   the same program with fuse=True (the chain compiles into one node)
  pw-F        one @pw.program whose single node holds --chain computations

Every mode runs for 1, 2, 4 and 8 CPU devices; repeats are interleaved (the
mode order rotates each repeat) so that machine drift hits all modes alike.
Results: computations/second (median over repeats, with min and max) and each
mode's ratio to jax-O, written to benchmarks/results/dispatch.json and plotted
in benchmarks/results/dispatch.png.

  python benchmarks/dispatch.py            # the full run (a few minutes)
  python benchmarks/dispatch.py --sweep    # + the work-size sweep
  python benchmarks/dispatch.py --quick    # seconds; used by the test suite
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time
from collections.abc import Callable

import common
from absl import app, flags

_DEVICES = flags.DEFINE_list("devices", ["1", "2", "4", "8"], "Slice sizes to measure.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Interleaved repeats per mode.")
_CHAIN = flags.DEFINE_integer("chain", 128, "Computations per chained / fused call.")
_TARGET = flags.DEFINE_float("target_s", 0.25, "Seconds each measurement aims to last.")
_JAX_WINDOW = flags.DEFINE_integer("jax_window", 16, "In-flight bound of the jax-O loop.")
_SWEEP = flags.DEFINE_bool("sweep", False, "Also run the work-size sweep.")
_SWEEP_SIZES = flags.DEFINE_list(
    "sweep_sizes", ["1", "16", "32", "64", "96", "128", "192", "256"], "Matmul sizes of the sweep."
)
_SWEEP_DEVICES = flags.DEFINE_list("sweep_devices", ["1", "8"], "Slice sizes of the sweep.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny run that only checks the benchmark works.")
_OUT = flags.DEFINE_string(
    "out", str(pathlib.Path(__file__).resolve().parent / "results"), "Where results go."
)

MODES = ("jax-O", "jax-F", "pw-O", "pw-C", "pw-C+fuse", "pw-F")


def _measure(run: Callable[[int], float], unit: int, target_s: float) -> Callable[[], float]:
    """Calibrates how many calls last about ``target_s``; returns a timer of computations/s."""
    run(2)  # compile and warm both argument kinds (arrays, then futures)
    calls = 1
    while True:
        elapsed = run(calls)
        if elapsed >= target_s / 4 or calls >= 1 << 16:
            break
        calls *= 4
    calls = max(1, int(calls * target_s / max(elapsed, 1e-9)))

    def timed() -> float:
        return calls * unit / run(calls)

    return timed


def _modes(n: int, chain: int, jax_window: int, work: int | None = None):
    """Builds every mode for an ``n``-device slice; returns {mode: (run(calls) -> s, unit)}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    import pathways_jax as pw

    P = pw.P
    s = pw.devices(mesh={"x": n})
    mesh = s.physical_mesh
    replicated = NamedSharding(mesh, P())
    weights = (
        None
        if work is None
        else jnp.asarray(np.random.default_rng(0).normal(size=(work, work)) / work, jnp.float32)
    )

    def computation(x, mesh=None):
        if weights is not None:
            # Work that grows with --sweep_sizes: a matmul per device before the all-reduce.
            h = jnp.tanh(weights * (x * 1e-3)) @ weights
            x = x + jnp.mean(h) * 1e-6
        total = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P(), out_specs=P())(x)
        return total * (1.0 / n) + 1.0

    def many(x, mesh=None):
        for _ in range(chain):
            x = computation(x, mesh)
        return x

    x0 = jax.device_put(jnp.zeros((), jnp.float32), replicated)

    jax_one = jax.jit(lambda x: computation(x, mesh))
    jax_many = jax.jit(lambda x: many(x, mesh))
    pw_one = pw.jit(computation, devices=s)
    pw_many = pw.jit(many, devices=s)

    def chained(x):
        for _ in range(chain):
            x = pw_one(x)
        return x

    pw_chain = pw.program(chained, name="chain")
    pw_chain_fused = pw.program(chained, name="chain_fused", fuse=True)
    pw_fused = pw.program(lambda x: pw_many(x), name="fused")

    def jax_o(calls: int) -> float:
        start = time.perf_counter()
        x = x0
        window = []
        for _ in range(calls * chain):
            x = jax_one(x)
            window.append(x)
            if len(window) > jax_window:
                window.pop(0).block_until_ready()
        x.block_until_ready()
        return time.perf_counter() - start

    def jax_f(calls: int) -> float:
        start = time.perf_counter()
        x = x0
        for _ in range(calls):
            x = jax_many(x)
        x.block_until_ready()
        return time.perf_counter() - start

    def pw_loop(fn, per_call):
        def run(calls: int) -> float:
            start = time.perf_counter()
            x = x0
            for _ in range(calls * per_call):
                x = fn(x)
            x.result()
            return time.perf_counter() - start

        return run

    return s, {
        "jax-O": (jax_o, chain),
        "jax-F": (jax_f, chain),
        "pw-O": (pw_loop(pw_one, chain), chain),
        "pw-C": (pw_loop(pw_chain, 1), chain),
        "pw-C+fuse": (pw_loop(pw_chain_fused, 1), chain),
        "pw-F": (pw_loop(pw_fused, 1), chain),
    }


def _submit_latency(n: int, chain: int, samples: int) -> dict:
    """Median time for a cached pw-C call and a cached pw.jit call to return (submission only)."""
    import jax.numpy as jnp

    import pathways_jax as pw

    s = pw.devices(mesh={"x": n})
    one = pw.jit(lambda x: x + 1.0, devices=s)

    def chained(x):
        for _ in range(chain):
            x = one(x)
        return x

    prog = pw.program(chained, name="latency_chain")
    out = {}
    for name, fn in (("pw-O", one), ("pw-C", prog)):
        x = fn(jnp.zeros(())).result()
        x = fn(x)
        x.result()
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            x = fn(x)
            times.append(time.perf_counter() - start)
        x.result()
        out[name] = statistics.median(times) * 1e6
    s.release()
    return out


def run_dispatch(devices: list[int], repeats: int, chain: int, target_s: float, jax_window: int) -> dict:
    import pathways_jax as pw

    results = {}
    for n in devices:
        s, modes = _modes(n, chain, jax_window)
        timers = {name: _measure(run, unit, target_s) for name, (run, unit) in modes.items()}
        samples: dict[str, list[float]] = {name: [] for name in MODES}
        for r in range(repeats):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for name in order:
                samples[name].append(timers[name]())
        base = statistics.median(samples["jax-O"])
        results[str(n)] = {
            name: {
                "median": statistics.median(v),
                "min": min(v),
                "max": max(v),
                "ratio_to_jax_O": statistics.median(v) / base,
            }
            for name, v in samples.items()
        }
        s.release()
        pw.reset_counters()
        print(_row(n, results[str(n)]), flush=True)
    return results


def run_sweep(
    devices: list[int], sizes: list[int], repeats: int, chain: int, target_s: float, jax_window: int
) -> dict:
    out = {}
    for n in devices:
        rows = []
        for size in sizes:
            s, modes = _modes(n, chain, jax_window, work=size)
            picked = {k: modes[k] for k in ("jax-O", "pw-O", "pw-C")}
            timers = {name: _measure(run, unit, target_s) for name, (run, unit) in picked.items()}
            samples: dict[str, list[float]] = {name: [] for name in picked}
            for r in range(repeats):
                for name in list(picked)[r % 3 :] + list(picked)[: r % 3]:
                    samples[name].append(timers[name]())
            med = {k: statistics.median(v) for k, v in samples.items()}
            row = {
                "size": size,
                "jax_O_us_per_computation": 1e6 / med["jax-O"],
                "pw_O_ratio": med["pw-O"] / med["jax-O"],
                "pw_C_ratio": med["pw-C"] / med["jax-O"],
            }
            rows.append(row)
            s.release()
            print(
                f"sweep n={n} size={size}: jax-O {row['jax_O_us_per_computation']:.1f} us/computation, "
                f"pw-O {row['pw_O_ratio']:.2f}x, pw-C {row['pw_C_ratio']:.2f}x",
                flush=True,
            )
        threshold = {}
        for mode, key in (("pw-O", "pw_O_ratio"), ("pw-C", "pw_C_ratio")):
            reached = [r for r in rows if r[key] >= 0.95]
            threshold[mode] = reached[0]["jax_O_us_per_computation"] if reached else None
        out[str(n)] = {"rows": rows, "threshold_us_at_95pct": threshold}
    return out


def _row(n: int, by_mode: dict) -> str:
    cells = " | ".join(f"{by_mode[m]['median']:,.0f} ({by_mode[m]['ratio_to_jax_O']:.2f}x)" for m in MODES)
    return f"| {n} | {cells} |"


def _table(results: dict) -> str:
    head = "| devices | " + " | ".join(MODES) + " |\n|---|" + "---|" * len(MODES)
    return head + "\n" + "\n".join(_row(int(n), r) for n, r in results.items())


def _plot(results: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'pathways-jax[bench]'): no plot.")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    devices = [int(n) for n in results]
    for mode in MODES:
        ys = [results[str(n)][mode]["median"] for n in devices]
        lo = [results[str(n)][mode]["min"] for n in devices]
        hi = [results[str(n)][mode]["max"] for n in devices]
        style = "--" if mode.startswith("jax") else "-"
        ax.plot(devices, ys, style, marker="o", label=mode)
        ax.fill_between(devices, lo, hi, alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(devices, [str(d) for d in devices])
    ax.set_xlabel("CPU devices in the slice")
    ax.set_ylabel("computations / second")
    ax.set_title("Dispatch: scalar all-reduce + add, chained (higher is better)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    import pathways_jax as pw

    devices = [int(d) for d in _DEVICES.value]
    repeats, chain, target = _REPEATS.value, _CHAIN.value, _TARGET.value
    if _QUICK.value:
        repeats, chain, target = 1, 8, 0.005
        devices = devices[:2]
    pw.init(num_cpu_devices=max(8, *devices))
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)

    print("| devices | " + " | ".join(MODES) + " |  (computations/s, ratio to jax-O)")
    results = run_dispatch(devices, repeats, chain, target, _JAX_WINDOW.value)
    latency = _submit_latency(devices[-1], chain, 50 if _QUICK.value else 2000)
    print(
        f"cached call, submission only (median): pw-O {latency['pw-O']:.1f} us, pw-C {latency['pw-C']:.1f} us"
    )
    report = {
        "benchmark": "dispatch",
        "machine": common.machine(),
        "config": {
            "repeats": repeats,
            "chain": chain,
            "target_s": target,
            "jax_window": _JAX_WINDOW.value,
            "pw_max_in_flight": pw.cluster().in_flight,
            "quick": _QUICK.value,
        },
        "computations_per_second": results,
        "submit_latency_us": latency,
        "table": _table(results),
    }
    if _SWEEP.value:
        sizes = [int(v) for v in _SWEEP_SIZES.value]
        sweep_devices = [int(v) for v in _SWEEP_DEVICES.value]
        if _QUICK.value:
            sizes, sweep_devices = sizes[:2], sweep_devices[:1]
        report["sweep"] = run_sweep(sweep_devices, sizes, repeats, chain, target, _JAX_WINDOW.value)
    name = "dispatch_quick" if _QUICK.value else "dispatch"
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    _plot(results, out_dir / f"{name}.png")
    print(report["table"])
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')}")
    pw.shutdown()


if __name__ == "__main__":
    app.run(main)
