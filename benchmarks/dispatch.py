"""The paper's dispatch micro-benchmark: plain JAX and pathways_jax side by side.

One *computation* is a scalar all-reduce over the slice's devices followed by a
scalar add; each output feeds the next. Modes (DESIGN §6):

  jax-O       plain JAX, one jitted call per computation (at most --jax_window
              computations in flight: XLA's CPU runtime deadlocks on unbounded
              asynchronous dispatch of collectives, DESIGN §5; 16 was measured
              safe on 8 devices and costs no throughput against smaller bounds)
  jax-F       plain JAX, one jitted function holding --chain computations
  pw-O        one pw.jit call per computation, through the controller
  pw-C        one @pw.program(fuse=False) chaining --chain nodes, called repeatedly
  pw-C+fuse   the same program fused (the default; the chain compiles into one node)
  pw-F        one @pw.program whose single node holds --chain computations

Every mode runs for 1, 2, 4 and 8 CPU devices; repeats are interleaved (the
mode order rotates each repeat) so that machine drift hits all modes alike.
Results: computations/second (median over repeats, with min and max) and each
mode's ratio to jax-O, written to benchmarks/results/dispatch.json and plotted
in benchmarks/results/dispatch.png.

Then (--ray, on by default) the same computation on a 1-device mesh, on Ray
(a local Ray cluster started here, or the one --ray_address names; needs pathways-jax[ray]):

  ray-O       one plain Ray actor holding the jitted computation: one actor call
              per computation, each output ObjectRef passed into the next call
              (the paper's Ray baseline)
  pw-ray-O    pw.init(backend="ray", hosts=2, devices_per_host=1): one pw.jit
              call per computation on host 0
  pw-ray-C    one @pw.program of --chain nodes alternating between host 0 and
              host 1 (every node's input crosses hosts, host to host through
              the transfer servers), called repeatedly
  pw-ray-C16  the same chain moving to the other host every 16 nodes (a
              cross-island hop every 16 nodes)
  pw-ray-C1   the same chain with every node on host 0 (no cross-host moves)
  xfer-C      the floor of pw-ray-C's data plane, without pathways_jax: two
              plain Ray actors run the same alternating chain by hand, each
              node's input pulled from the other actor's transfer server
              (jax.experimental.transfer), one actor call per actor per chain

with each mode's ratio to ray-O (the target: pw-ray-C >= 5x ray-O), under the
"ray" key of the same JSON and as a second panel of the same plot.

  python benchmarks/dispatch.py            # the full run (a few minutes)
  python benchmarks/dispatch.py --sweep    # + the work-size sweep
  python benchmarks/dispatch.py --noray    # the local section only
  python benchmarks/dispatch.py --only_ray # the Ray section only: dispatch_ray.json / .png
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
_RAY = flags.DEFINE_bool("ray", True, "Also measure dispatch on 2 Ray hosts (after the local section).")
_RAY_ADDRESS = flags.DEFINE_string(
    "ray_address", "", "The Ray section joins this Ray cluster (2 free CPUs); empty: starts a local one."
)
_ONLY_RAY = flags.DEFINE_bool(
    "only_ray", False, "Run only the Ray section; results go to dispatch_ray.json / .png."
)
_OUT = flags.DEFINE_string(
    "out", str(pathlib.Path(__file__).resolve().parent / "results"), "Where results go."
)

MODES = ("jax-O", "jax-F", "pw-O", "pw-C", "pw-C+fuse", "pw-F")
RAY_MODES = ("ray-O", "pw-ray-O", "pw-ray-C", "pw-ray-C16", "pw-ray-C1", "xfer-C")
RAY_TARGET = 5.0  # pw-ray-C throughput against ray-O: the target
RAY_HOSTS = 2


def _all_reduce_add(x, mesh, n: int):
    """One computation: a scalar all-reduce over the mesh's ``n`` devices, then a scalar add."""
    import jax
    from jax.sharding import PartitionSpec as P

    total = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P(), out_specs=P())(x)
    return total * (1.0 / n) + 1.0


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


def _pw_loop(fn: Callable, per_call: int, x0) -> Callable[[int], float]:
    """A timed loop of ``fn`` calls, each fed the previous call's future; waits for the last."""

    def run(calls: int) -> float:
        start = time.perf_counter()
        x = x0
        for _ in range(calls * per_call):
            x = fn(x)
        x.result()
        return time.perf_counter() - start

    return run


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
        return _all_reduce_add(x, mesh, n)

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

    pw_chain = pw.program(chained, name="chain", fuse=False)
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

    return s, {
        "jax-O": (jax_o, chain),
        "jax-F": (jax_f, chain),
        "pw-O": (_pw_loop(pw_one, chain, x0), chain),
        "pw-C": (_pw_loop(pw_chain, 1, x0), chain),
        "pw-C+fuse": (_pw_loop(pw_chain_fused, 1, x0), chain),
        "pw-F": (_pw_loop(pw_fused, 1, x0), chain),
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

    prog = pw.program(chained, name="latency_chain", fuse=False)
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


def _interleaved(
    modes: dict, names: tuple[str, ...], repeats: int, target_s: float
) -> dict[str, list[float]]:
    """Computations/s of every mode, ``repeats`` times, the mode order rotating each repeat."""
    timers = {name: _measure(run, unit, target_s) for name, (run, unit) in modes.items()}
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(timers[name]())
    return samples


def _summary(samples: dict[str, list[float]], base_mode: str) -> dict:
    """Median, min, max and the ratio of medians to ``base_mode`` (key ``ratio_to_<base>``)."""
    base = statistics.median(samples[base_mode])
    key = "ratio_to_" + base_mode.replace("-", "_")
    return {
        name: {"median": statistics.median(v), "min": min(v), "max": max(v), key: statistics.median(v) / base}
        for name, v in samples.items()
    }


def run_dispatch(devices: list[int], repeats: int, chain: int, target_s: float, jax_window: int) -> dict:
    import pathways_jax as pw

    results = {}
    for n in devices:
        s, modes = _modes(n, chain, jax_window)
        samples = _interleaved(modes, MODES, repeats, target_s)
        results[str(n)] = _summary(samples, "jax-O")
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


class _RayStep:
    """ray-O's actor (wrapped with ``ray.remote`` in the Ray section): one computation per call."""

    def __init__(self):
        import jax
        import numpy as np

        # A fresh worker process: JAX's backend has not started, its platform can still be set.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 1)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
        self._np = np
        self._step = jax.jit(lambda x: _all_reduce_add(x, mesh, 1))

    def step(self, x):
        # The output goes back as a Ray object (numpy): the next call's argument.
        return self._np.asarray(self._step(x))


class _XferHost:
    """xfer-C's actors: the alternating chain by hand, each input pulled from the other host.

    Node ``k`` of the endless chain runs on host ``k % 2``; its value is
    posted under uuid ``k`` on its host's transfer server and pulled by the
    other host for node ``k + 1``. One call runs a chain's nodes of this host.
    """

    def __init__(self, parity: int):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.experimental import transfer

        from pathways_jax._src.backends.ray_host import transfer_options

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 1)
        device = jax.devices()[0]
        mesh = jax.sharding.Mesh(np.array([device]), ("x",))
        self._parity = parity
        self._step = jax.jit(lambda x: _all_reduce_add(x, mesh, 1))
        # Started as a host's is (ray_host.transfer_options): the floor of the same data plane.
        self._server = transfer.start_transfer_server(
            device.client, "127.0.0.1:0", ["127.0.0.1:0"], **transfer_options(device.platform)
        )
        self._spec = [
            jax.ShapeDtypeStruct((), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
        ]
        self._first = jnp.zeros((), jnp.float32)
        self._peer = None

    def address(self) -> str:
        return self._server.address()

    def connect(self, address: str) -> None:
        self._peer = self._server.connect(address)

    def chain(self, base: int, length: int) -> None:
        last = None
        for k in range(base, base + length):
            if k % 2 != self._parity:
                continue
            x = self._first if k == 0 else self._peer.pull(k - 1, self._spec)[0]
            last = self._step(x)
            self._server.await_pull(k, [last])
        if last is not None:
            last.block_until_ready()


def _ray_modes(ray, chain: int):
    """Builds the Ray modes on 2 hosts of 1 device; returns {mode: (run(calls) -> s, unit)}."""
    import jax.numpy as jnp
    import numpy as np

    import pathways_jax as pw

    actor = ray.remote(num_cpus=0)(_RayStep).remote()
    pw.init(backend="ray", hosts=RAY_HOSTS, devices_per_host=1)
    a = pw.devices(mesh={"x": 1}, island=0)
    b = pw.devices(mesh={"x": 1}, island=1)

    def computation(x, mesh=None):
        return _all_reduce_add(x, mesh, 1)

    on_a = pw.jit(computation, devices=a)
    on_b = pw.jit(computation, devices=b)

    def alternating(x):
        for i in range(chain):
            x = (on_a if i % 2 == 0 else on_b)(x)  # every node's input comes from the other host
        return x

    def hop_every_16(x):
        for i in range(chain):
            x = (on_a if (i // 16) % 2 == 0 else on_b)(x)
        return x

    def host0_only(x):
        for _ in range(chain):
            x = on_a(x)
        return x

    pw_chain = pw.program(alternating, name="ray_chain", fuse=False)
    pw_chain_one_host = pw.program(host0_only, name="ray_chain_one_host", fuse=False)
    pw_chain_16 = pw.program(hop_every_16, name="ray_chain_hop_every_16", fuse=False)
    x0 = jnp.zeros((), jnp.float32)

    def ray_o(calls: int) -> float:
        start = time.perf_counter()
        x = np.float32(0)
        for _ in range(calls * chain):
            x = actor.step.remote(x)  # the ObjectRef goes straight into the next call
        ray.get(x)
        return time.perf_counter() - start

    xfer = [ray.remote(num_cpus=0)(_XferHost).remote(parity) for parity in (0, 1)]
    addresses = ray.get([h.address.remote() for h in xfer])
    ray.get([xfer[0].connect.remote(addresses[1]), xfer[1].connect.remote(addresses[0])])
    next_node = [0]

    def xfer_c(calls: int) -> float:
        start = time.perf_counter()
        refs = []
        for _ in range(calls):
            base, next_node[0] = next_node[0], next_node[0] + chain
            refs = [h.chain.remote(base, chain) for h in xfer]
        ray.get(refs)
        return time.perf_counter() - start

    modes = {
        "ray-O": (ray_o, chain),
        "pw-ray-O": (_pw_loop(on_a, chain, x0), chain),
        "pw-ray-C": (_pw_loop(pw_chain, 1, x0), chain),
        "pw-ray-C16": (_pw_loop(pw_chain_16, 1, x0), chain),
        "pw-ray-C1": (_pw_loop(pw_chain_one_host, 1, x0), chain),
        "xfer-C": (xfer_c, chain),
    }

    def close() -> None:
        pw.shutdown()
        ray.kill(actor)
        for h in xfer:
            ray.kill(h)

    return modes, close


def run_ray(repeats: int, chain: int, target_s: float) -> dict | None:
    """The Ray section: ray-O against pathways_jax on 2 Ray hosts, interleaved like the local modes."""

    try:
        import ray
    except ImportError:
        print("Ray is not installed (pip install 'pathways-jax[ray]'): no Ray section.")
        return None
    started = not ray.is_initialized()
    if started:
        common.start_ray(_RAY_ADDRESS.value, num_cpus=4)
    try:
        modes, close = _ray_modes(ray, chain)
        try:
            samples = _interleaved(modes, RAY_MODES, repeats, target_s)
        finally:
            close()
    finally:
        if started:
            ray.shutdown()
    by_mode = _summary(samples, "ray-O")
    us = {name: 1e6 / by_mode[name]["median"] for name in RAY_MODES}
    ratio = by_mode["pw-ray-C"]["ratio_to_ray_O"]
    return {
        "config": {"hosts": RAY_HOSTS, "devices_per_host": 1, "chain": chain, "ray_version": ray.__version__},
        "computations_per_second": by_mode,
        "us_per_computation": us,
        # pw-ray-C moves every node's input across hosts; pw-ray-C1 moves nothing.
        "cross_host_hop_us": us["pw-ray-C"] - us["pw-ray-C1"],
        # The same chain by hand through the transfer servers: the data plane's floor.
        "pw_ray_C_ratio_to_floor": by_mode["pw-ray-C"]["median"] / by_mode["xfer-C"]["median"],
        "target": {"pw_ray_C_ratio_to_ray_O": RAY_TARGET, "measured": ratio, "met": ratio >= RAY_TARGET},
        "table": _ray_table(by_mode),
    }


def _ray_table(by_mode: dict) -> str:
    head = "| mode | computations/s (median) | min | max | ratio to ray-O | µs per computation |\n"
    head += "|---|---:|---:|---:|---:|---:|"
    rows = [
        f"| {m} | {by_mode[m]['median']:,.0f} | {by_mode[m]['min']:,.0f} | {by_mode[m]['max']:,.0f} "
        f"| {by_mode[m]['ratio_to_ray_O']:.2f}x | {1e6 / by_mode[m]['median']:.1f} |"
        for m in RAY_MODES
    ]
    return head + "\n" + "\n".join(rows)


def _row(n: int, by_mode: dict) -> str:
    cells = " | ".join(f"{by_mode[m]['median']:,.0f} ({by_mode[m]['ratio_to_jax_O']:.2f}x)" for m in MODES)
    return f"| {n} | {cells} |"


def _table(results: dict) -> str:
    head = "| devices | " + " | ".join(MODES) + " |\n|---|" + "---|" * len(MODES)
    return head + "\n" + "\n".join(_row(int(n), r) for n, r in results.items())


def _plot(results: dict | None, ray_results: dict | None, path: pathlib.Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    panels = [p for p in (results, ray_results) if p is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    axes = list(axes[0])
    if results is not None:
        _plot_local(axes.pop(0), results)
    if ray_results is not None:
        _plot_ray(axes.pop(0), ray_results)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_local(ax, results: dict) -> None:
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


def _plot_ray(ax, ray_results: dict) -> None:
    by_mode = ray_results["computations_per_second"]
    ys = [by_mode[m]["median"] for m in RAY_MODES]
    err = [
        [y - by_mode[m]["min"] for m, y in zip(RAY_MODES, ys, strict=True)],
        [by_mode[m]["max"] - y for m, y in zip(RAY_MODES, ys, strict=True)],
    ]
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:purple"]
    ax.bar(RAY_MODES, ys, yerr=err, capsize=4, color=colors)
    for i, m in enumerate(RAY_MODES):
        ax.annotate(
            f"{by_mode[m]['ratio_to_ray_O']:.2f}x",
            (i, by_mode[m]["max"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=9,
        )
    base = by_mode["ray-O"]["median"]
    ax.axhline(base * RAY_TARGET, ls="--", color="tab:red", lw=1)
    ax.annotate(
        f"target: pw-ray-C at {RAY_TARGET:.0f}x ray-O",
        (-0.4, base * RAY_TARGET),
        textcoords="offset points",
        xytext=(0, 4),
        ha="left",
        fontsize=8,
        color="tab:red",
    )
    ax.set_yscale("log")
    ax.set_ylim(top=max(*ys, base * RAY_TARGET) * 3)
    ax.set_ylabel("computations / second")
    chain = ray_results["config"]["chain"]
    ax.set_title(f"Dispatch on {RAY_HOSTS} Ray hosts, 1 CPU device each ({chain}-node chains)")
    ax.grid(True, axis="y", which="both", alpha=0.3)


def main(argv: list[str]) -> None:
    del argv
    import pathways_jax as pw

    devices = [int(d) for d in _DEVICES.value]
    repeats, chain, target = _REPEATS.value, _CHAIN.value, _TARGET.value
    if _QUICK.value:
        repeats, chain, target = 1, 8, 0.005
        devices = devices[:2]
    only_ray = _ONLY_RAY.value
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"repeats": repeats, "chain": chain, "target_s": target, "quick": _QUICK.value}
    report: dict = {"benchmark": "dispatch"}
    results = None
    if not only_ray:
        pw.init(num_cpu_devices=max(8, *devices))
        print("| devices | " + " | ".join(MODES) + " |  (computations/s, ratio to jax-O)")
        results = run_dispatch(devices, repeats, chain, target, _JAX_WINDOW.value)
        latency = _submit_latency(devices[-1], chain, 50 if _QUICK.value else 2000)
        print(
            f"cached call, submission only (median): pw-O {latency['pw-O']:.1f} us, "
            f"pw-C {latency['pw-C']:.1f} us"
        )
        config.update(jax_window=_JAX_WINDOW.value, pw_max_in_flight=pw.cluster().in_flight)
        report.update(
            computations_per_second=results,
            submit_latency_us=latency,
            table=_table(results),
        )
        if _SWEEP.value:
            sizes = [int(v) for v in _SWEEP_SIZES.value]
            sweep_devices = [int(v) for v in _SWEEP_DEVICES.value]
            if _QUICK.value:
                sizes, sweep_devices = sizes[:2], sweep_devices[:1]
            report["sweep"] = run_sweep(sweep_devices, sizes, repeats, chain, target, _JAX_WINDOW.value)
        pw.shutdown()
    ray_results = None
    if _RAY.value or only_ray:
        print(f"Ray section: {RAY_HOSTS} hosts of 1 CPU device, {chain}-node chains")
        ray_results = run_ray(repeats, chain, target)
        if ray_results is None and only_ray:
            raise app.UsageError("--only_ray needs Ray: pip install 'pathways-jax[ray]'")
        if ray_results is not None:
            report["ray"] = ray_results
            print(ray_results["table"])
            print(
                f"pw-ray-C: {ray_results['us_per_computation']['pw-ray-C']:.1f} us per node, "
                f"pw-ray-C1: {ray_results['us_per_computation']['pw-ray-C1']:.1f} us per node; "
                f"target {RAY_TARGET:.0f}x ray-O "
                f"{'met' if ray_results['target']['met'] else 'not met'} "
                f"({ray_results['target']['measured']:.2f}x); pw-ray-C at "
                f"{ray_results['pw_ray_C_ratio_to_floor']:.2f}x of its floor xfer-C "
                f"({ray_results['us_per_computation']['xfer-C']:.1f} us per node)"
            )
    report["machine"] = common.machine()
    report["config"] = config
    name = "dispatch_ray" if only_ray else "dispatch"
    if _QUICK.value:
        name += "_quick"
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    _plot(results, ray_results, out_dir / f"{name}.png")
    if results is not None:
        print(report["table"])
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')}")


if __name__ == "__main__":
    app.run(main)
