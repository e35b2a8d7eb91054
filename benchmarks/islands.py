"""One collective program on islands of 1, 2 and 4 Ray hosts: pathways_jax against multi-controller JAX.

For each island size H (``--hosts``, one CPU device per host), the same jitted
program runs ``N`` times in a row, each run fed the previous run's output:

  mc-jax   plain multi-controller JAX: H plain Ray actors (``num_cpus=0``),
           joined into one ``jax.distributed`` system when H > 1, each running
           the program N times over the global mesh (launched on all of them
           at once, asynchronous dispatch with at most ``--window`` runs in
           flight, blocked on at the end). Throughput: N / the longest of the
           H elapsed times, each measured inside its actor from its first
           dispatch to its last result.
  ray-mc   the same H actors and program, but the driver starts every run
           with one Ray actor call per member (not waited for; a member runs
           its calls in order), then asks every member for its last value:
           what one controller message per host per run costs without
           pathways_jax. Throughput: N / the driver's elapsed time.
  pw       ``pw.init(backend="ray", hosts=H, devices_per_host=1, islands=1)``
           (H = 1: ``islands=None``), a slice ``pw.devices(mesh={"x": H})``
           spanning the island, the program as ``pw.jit(..., devices=slice)``
           called N times from this process (each call fed the previous
           call's future), ``.result()`` at the end. Throughput: N / the
           driver's elapsed time.
  pw-C     the same pw.jit chained ``--chain`` times in one
           ``@pw.program(fuse=False)`` (``--chain`` executables per host per
           program run, one message per host for all of them), called
           N / ``--chain`` times: the per-run message amortised.

Programs (``--sizes``):

  tiny     a scalar all-reduce over the H devices, then a scalar add
           (``_all_reduce_add`` in dispatch.py): dispatch-bound.
  matmul   x (S, S) @ w (S, S) with the contraction sharded over "x" (each
           device multiplies an (S, S/H) block of x by an (S/H, S) block of
           w), the partial products summed with a psum, then tanh;
           S = ``--matmul_size``.

N is calibrated per (H, program, side) so a measurement lasts about
``--target_s``. Repeats interleave the sides (the order rotates every repeat); both
sets of actors stay alive across the repeats of one H, and ``pw.shutdown()``
comes between H values. Before measuring, every side runs each program 32 times
from the same input and their final values must agree (tiny: every
measurement's value is also checked, x -> x + 1 from 0). Results: median throughput (runs/s) with min and max, and the
ratios pw / mc-jax, pw / ray-mc and pw-C / mc-jax per (H, program), to ``benchmarks/results/islands.json`` and
``islands.png``; a markdown table is printed.

  python benchmarks/islands.py                     # about 4-6 minutes on 2 cores
  python benchmarks/islands.py --hosts 1,2 --repeats 3
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import statistics
import time
import warnings

import common
from absl import app, flags

_HOSTS = flags.DEFINE_list("hosts", ["1", "2", "4"], "Island sizes (Ray hosts of one CPU device) to measure.")
_SIZES = flags.DEFINE_list("sizes", ["tiny", "matmul"], "Programs: tiny and/or matmul.")
_MATMUL = flags.DEFINE_integer("matmul_size", 256, "S of the matmul program (S x S @ S x S).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved repeats of each side.")
_TARGET = flags.DEFINE_float("target_s", 1.0, "Seconds a measurement aims to last (sets N).")
_MAX_RUNS = flags.DEFINE_integer("max_runs", 4000, "Upper bound on N.")
_CHAIN = flags.DEFINE_integer("chain", 16, "pw-C: runs chained in one @pw.program (N is a multiple).")
_WINDOW = flags.DEFINE_integer("window", 16, "mc-jax: runs in flight before it waits for the oldest.")
_OUT = flags.DEFINE_string(
    "out", str(pathlib.Path(__file__).resolve().parent / "results"), "Where results go."
)

SIDES = ("mc-jax", "ray-mc", "pw", "pw-C")
_START_TIMEOUT_S = 180.0
_RUN_TIMEOUT_S = 120.0  # a hung collective fails the run instead of hanging it
_CHECK_RUNS = 32  # every side runs this many first; their final values must agree (a multiple of --chain)


def _programs(hosts: int, matmul_size: int, mesh=None) -> dict:
    """{name: (function of x, x0 as numpy)}; ``mesh=None``: the context mesh (pw.jit's slice)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    def tiny(x):
        total = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P(), out_specs=P())(x)
        return total * (1.0 / hosts) + 1.0

    s = matmul_size
    w = (np.random.default_rng(0).normal(size=(s, s)) / np.sqrt(s)).astype(np.float32)

    def matmul(x):
        partial = jax.shard_map(
            lambda a, b: jax.lax.psum(a @ b, "x"),
            mesh=mesh,
            in_specs=(P(None, "x"), P("x", None)),
            out_specs=P(),
        )(x, jnp.asarray(w))
        return jnp.tanh(partial)

    x_matmul = np.random.default_rng(1).normal(size=(s, s)).astype(np.float32)
    return {"tiny": (tiny, np.zeros((), np.float32)), "matmul": (matmul, x_matmul)}


class _Member:
    """One process of the multi-controller program (wrapped with ``ray.remote``)."""

    def address(self) -> str:
        """A free port on this node: the coordinator of the ``jax.distributed`` system listens there."""
        import socket

        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def setup(self, coordinator: str | None, processes: int, rank: int, matmul_size: int, window: int) -> int:
        """Starts JAX (joining the system when ``processes`` > 1; every member must be in here at once)."""
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 1)
        if processes > 1:
            jax.distributed.initialize(coordinator, processes, rank)
        every = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = jax.sharding.Mesh(np.array(every), ("x",))
        replicated = NamedSharding(mesh, P())
        self._jax = jax
        self._window = window
        self._steps = {}
        self._x0 = {}
        for name, (fn, x0) in _programs(processes, matmul_size, mesh).items():
            self._steps[name] = jax.jit(fn, out_shardings=replicated)
            self._x0[name] = jax.make_array_from_callback(x0.shape, replicated, lambda index, v=x0: v[index])
            self._steps[name](self._x0[name]).block_until_ready()  # compile; every member runs it
        return len(every)

    def run(self, name: str, runs: int) -> tuple[float, object]:
        """``runs`` runs of program ``name``, each fed the previous output; (elapsed s, final value)."""
        import numpy as np

        step, x = self._steps[name], self._x0[name]
        in_flight: collections.deque = collections.deque()
        start = time.perf_counter()
        for _ in range(runs):
            x = step(x)
            in_flight.append(x)
            if len(in_flight) > self._window:
                in_flight.popleft().block_until_ready()
        x.block_until_ready()
        elapsed = time.perf_counter() - start
        return elapsed, np.asarray(x.addressable_shards[0].data)

    # ray-mc: the driver starts every run with one actor call per member.

    def reset(self, name: str) -> None:
        self._x = self._x0[name]
        self._in_flight = collections.deque()

    def step(self, name: str) -> None:
        """One run of program ``name``, fed the previous one's output (calls run in order)."""
        self._x = self._steps[name](self._x)
        self._in_flight.append(self._x)
        if len(self._in_flight) > self._window:
            self._in_flight.popleft().block_until_ready()

    def value(self) -> object:
        import numpy as np

        return np.asarray(self._x.addressable_shards[0].data)


def _mc_side(ray, hosts: int, matmul_size: int, window: int):
    """H actors joined into one system; returns (run(name, runs) -> (s, value), close)."""
    cls = ray.remote(num_cpus=0, max_restarts=0)(_Member)
    actors = [cls.remote() for _ in range(hosts)]
    coordinator = ray.get(actors[0].address.remote(), timeout=_START_TIMEOUT_S) if hosts > 1 else None
    ray.get(
        [a.setup.remote(coordinator, hosts, r, matmul_size, window) for r, a in enumerate(actors)],
        timeout=_START_TIMEOUT_S,
    )

    def run(name: str, runs: int) -> tuple[float, object]:
        out = ray.get([a.run.remote(name, runs) for a in actors], timeout=_RUN_TIMEOUT_S)
        return max(s for s, _ in out), out[0][1]

    def driven(name: str, runs: int) -> tuple[float, object]:
        ray.get([a.reset.remote(name) for a in actors], timeout=_RUN_TIMEOUT_S)
        start = time.perf_counter()
        for _ in range(runs):
            for a in actors:
                a.step.remote(name)  # not waited for: a member runs its calls in order
        value = ray.get([a.value.remote() for a in actors], timeout=_RUN_TIMEOUT_S)[0]
        return time.perf_counter() - start, value

    def close() -> None:
        for a in actors:
            ray.kill(a, no_restart=True)

    return run, driven, close


def _pw_side(hosts: int, matmul_size: int, stand_ins: int, chain: int):
    """pathways_jax on one island of H hosts; returns pw's and pw-C's run(name, runs) -> (s, value)."""
    import jax.numpy as jnp
    import numpy as np

    import pathways_jax as pw

    # The controller's stand-in devices: as many for every H (JAX starts once in this process).
    pw.init(
        backend="ray",
        hosts=hosts,
        devices_per_host=1,
        islands=1 if hosts > 1 else None,
        num_cpu_devices=stand_ins,
    )
    s = pw.devices(mesh={"x": hosts})
    programs = {
        name: (pw.jit(fn, devices=s), jnp.asarray(x0))
        for name, (fn, x0) in _programs(hosts, matmul_size).items()
    }
    for f, x0 in programs.values():
        f(f(x0)).result()  # compile; warm both argument kinds (arrays, then futures)

    def chained(f):
        def body(x):
            for _ in range(chain):
                x = f(x)
            return x

        return body

    chains = {
        name: pw.program(chained(f), name=f"islands_{name}_chain", fuse=False)
        for name, (f, _) in programs.items()
    }
    for name, (_, x0) in programs.items():
        chains[name](chains[name](x0)).result()

    def run(name: str, runs: int) -> tuple[float, object]:
        f, x = programs[name]
        start = time.perf_counter()
        for _ in range(runs):
            x = f(x)
        value = x.result()
        return time.perf_counter() - start, np.asarray(value)

    def run_chained(name: str, runs: int) -> tuple[float, object]:
        f, x = chains[name], programs[name][1]
        start = time.perf_counter()
        for _ in range(runs // chain):
            x = f(x)
        value = x.result()
        return time.perf_counter() - start, np.asarray(value)

    return run, run_chained


def _check(name: str, runs: int, mc_value, pw_value) -> None:
    import numpy as np

    if name == "tiny":  # x -> x + 1 from 0
        np.testing.assert_allclose(mc_value, runs, rtol=1e-6)
    np.testing.assert_allclose(pw_value, mc_value, rtol=1e-4, atol=1e-5)


def _calibrate(run, name: str, target_s: float) -> int:
    """Runs per measurement so that one lasts about ``target_s`` (a multiple of --chain)."""
    probe = _CHAIN.value
    elapsed, _ = run(name, probe)
    while elapsed < target_s / 8 and probe < _MAX_RUNS.value:
        probe *= 4
        elapsed, _ = run(name, probe)
    runs = max(1, min(_MAX_RUNS.value, int(probe * target_s / elapsed)) // _CHAIN.value)
    return runs * _CHAIN.value


def _measure_hosts(ray, hosts: int, sizes: list[str], repeats: int, target_s: float, stand_ins: int) -> dict:
    import pathways_jax as pw

    mc_run, ray_mc_run, mc_close = _mc_side(ray, hosts, _MATMUL.value, _WINDOW.value)
    try:
        pw_run, pw_chain_run = _pw_side(hosts, _MATMUL.value, stand_ins, _CHAIN.value)
        try:
            sides = {"mc-jax": mc_run, "ray-mc": ray_mc_run, "pw": pw_run, "pw-C": pw_chain_run}
            runs: dict = {name: {} for name in sizes}
            for name in sizes:
                check = {side: run(name, _CHECK_RUNS)[1] for side, run in sides.items()}
                _check(name, _CHECK_RUNS, check["mc-jax"], check["pw"])
                _check(name, _CHECK_RUNS, check["mc-jax"], check["ray-mc"])
                _check(name, _CHECK_RUNS, check["mc-jax"], check["pw-C"])
                for side, run in sides.items():
                    runs[name][side] = _calibrate(run, name, target_s)
            samples = {name: {side: [] for side in sides} for name in sizes}
            for r in range(repeats):
                for name in sizes:
                    order = list(sides)[r % len(sides) :] + list(sides)[: r % len(sides)]
                    for side in order:  # rotates every repeat
                        n = runs[name][side]
                        elapsed, value = sides[side](name, n)
                        if name == "tiny":
                            _check(name, n, value, value)
                        samples[name][side].append(n / elapsed)
        finally:
            pw.shutdown()
    finally:
        mc_close()
    out = {}
    for name in sizes:
        by_side = {
            side: {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}
            for side, v in samples[name].items()
        }
        out[name] = {
            "runs_per_measurement": runs[name],  # per side: N, calibrated on its own
            "runs_per_second": by_side,
            "ratio_pw_to_mc_jax": by_side["pw"]["median"] / by_side["mc-jax"]["median"],
            "ratio_pw_to_ray_mc": by_side["pw"]["median"] / by_side["ray-mc"]["median"],
            "ratio_pw_C_to_mc_jax": by_side["pw-C"]["median"] / by_side["mc-jax"]["median"],
            "us_per_run": {side: 1e6 / by_side[side]["median"] for side in by_side},
        }
        print(_row(hosts, name, out[name]), flush=True)
    return out


def _ratio(r: float) -> str:
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.3f}x"


def _cell(c: dict) -> str:
    return f"{c['median']:,.0f} ({c['min']:,.0f}-{c['max']:,.0f})"


def _row(hosts: int, name: str, r: dict) -> str:
    by_side, us = r["runs_per_second"], r["us_per_run"]
    cells = " | ".join(_cell(by_side[side]) for side in SIDES)
    return (
        f"| {hosts} | {name} | {cells} | **{_ratio(r['ratio_pw_to_mc_jax'])}** "
        f"| {_ratio(r['ratio_pw_to_ray_mc'])} | {_ratio(r['ratio_pw_C_to_mc_jax'])} "
        f"| {' / '.join(f'{us[side]:,.0f}' for side in SIDES)} |"
    )


_HEAD = (
    "| hosts | program | "
    + " | ".join(f"{side} runs/s (min-max)" for side in SIDES)
    + " | pw / mc-jax | pw / ray-mc | pw-C / mc-jax | µs/run "
    + " / ".join(SIDES)
    + " |\n|---:|---|"
    + "---:|" * (len(SIDES) + 4)
)


def _plot(results: dict, sizes: list[str], path: pathlib.Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    hosts = [int(h) for h in results]
    for ax, name in zip(axes[0], sizes, strict=True):
        for side, style in (("mc-jax", "--"), ("ray-mc", ":"), ("pw", "-"), ("pw-C", "-.")):
            cells = [results[str(h)][name]["runs_per_second"][side] for h in hosts]
            ax.plot(hosts, [c["median"] for c in cells], style, marker="o", label=side)
            ax.fill_between(hosts, [c["min"] for c in cells], [c["max"] for c in cells], alpha=0.15)
        for h in hosts:
            r = results[str(h)][name]
            ax.annotate(
                _ratio(r["ratio_pw_to_mc_jax"]),
                (h, r["runs_per_second"]["pw"]["median"]),
                textcoords="offset points",
                xytext=(0, 8),
                ha="center",
                fontsize=9,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(hosts, [str(h) for h in hosts])
        ax.set_xlabel("hosts in the island (1 CPU device each)")
        ax.set_ylabel("runs / second")
        ax.set_title(f"{name}: pw against multi-controller JAX (higher is better)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    import ray

    hosts_list = [int(h) for h in _HOSTS.value]
    sizes = list(_SIZES.value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(
            address="local",
            num_cpus=max(4, max(hosts_list)),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    results = {}
    print(_HEAD, flush=True)
    try:
        for hosts in hosts_list:
            results[str(hosts)] = _measure_hosts(
                ray, hosts, sizes, _REPEATS.value, _TARGET.value, max(hosts_list)
            )
    finally:
        ray.shutdown()
    table = (
        _HEAD + "\n" + "\n".join(_row(int(h), name, r[name]) for h, r in results.items() for name in sizes)
    )
    report = {
        "benchmark": "islands",
        "started": started,
        "config": {
            "hosts": hosts_list,
            "sizes": sizes,
            "matmul_size": _MATMUL.value,
            "repeats": _REPEATS.value,
            "target_s": _TARGET.value,
            "mc_jax_window": _WINDOW.value,
            "ray": ray.__version__,
            "mc_jax_timing": "inside the actors: the longest member's first dispatch to last result",
            "ray_mc_timing": "the driver: first actor call to every member's last value",
            "pw_timing": "the driver: first call to .result() of the last",
        },
        "results": results,
        "table": table,
        "machine": common.machine(),
        "load_average_1_5_15_min": {"start": load_before, "end": os.getloadavg()},
    }
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "islands.json").write_text(json.dumps(report, indent=2, default=float))
    _plot(results, sizes, out_dir / "islands.png")
    print(table)
    print(f"wrote {out_dir / 'islands.json'} and {out_dir / 'islands.png'}")


if __name__ == "__main__":
    app.run(main)
