"""Validates pw.sim against measurement: the dispatch benchmark's modes, measured and simulated.

For 1/2/4/8 local CPU devices, and then 2 and 4 Ray hosts of 1 device each,
every repeat measures, in one rotating order (so that the machine's drift and
the load of other processes hit all alike):

- the calibration's loops (``pathways_jax.sim``'s ``calibrate``: plain
  ``jax.jit`` calls of one computation and of a fused chain of 256, the same
  chain through ``pw.jit``, a 1-node and a 16-node ``pw`` run on 1 device; on
  Ray, one node on one host, one on each of two, 16 on one);
- the dispatch benchmark's modes (``benchmarks/dispatch.py``'s own runners):

    O   one run per computation (local: ``pw-O``, a pw.jit call; Ray: a program
        of one node on every host)
    C   a run of --chain nodes (``pw-C``, unfused; Ray: --chain steps of one node per host)
    F   one node of --chain computations per run (``pw-F``; Ray: one such node per host)

The calibration loops' medians make a profile (as ``calibrate`` does); the
simulator predicts each mode with it on a simulated cluster of the same shape;
the error of a point is ``simulated / measured - 1`` against the measured
median (target: within 15%). Paired errors (each repeat's calibration against
the same repeat's measurement) show how much the machine moved meanwhile.
Results go to ``benchmarks/results/sim_validate.json`` and ``.png``.

  python benchmarks/sim_validate.py            # the full run (a few minutes)
  python benchmarks/sim_validate.py --noray    # local devices only
  python benchmarks/sim_validate.py --quick    # seconds: only checks the script works
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import time

import common
import dispatch
from absl import app, flags

# dispatch.py's flags (--devices, --repeats, --chain, --target_s, --ray, --quick, --out) are this
# script's too: importing it defines them.
_DEVICES, _REPEATS, _CHAIN, _TARGET = dispatch._DEVICES, dispatch._REPEATS, dispatch._CHAIN, dispatch._TARGET
_RAY, _QUICK, _OUT = dispatch._RAY, dispatch._QUICK, dispatch._OUT
_HOSTS = flags.DEFINE_list("hosts", ["2", "4"], "Ray host counts.")

LOCAL_MODES = {"O": "pw-O", "C": "pw-C", "F": "pw-F"}
TARGET = 0.15


def _simulate(cluster, mode: str, chain: int, spread: str, compute_s: float | None = None) -> float:
    """Simulated computations/s of a dispatch mode on ``cluster`` (steady state)."""
    from pathways_jax import sim

    program = sim.dispatch_mode(cluster, mode, chain_length=chain, spread=spread, compute_s=compute_s)
    runs = max(8, min(200, 2048 // len(program.steps)))
    return sim.simulate(cluster, program, runs=runs, record=False).throughput


def _validate(samples: dict, names: list[str], profile_of, simulate) -> tuple[dict, dict]:
    """Points for the timers ``names`` (seconds per computation) of ``samples`` (every timer's repeats).

    The prediction uses the profile of the run's calibration (every loop's
    median, as ``calibrate`` makes it); the error is ``simulated / measured - 1``
    with the measured median. ``best``: the same with every loop's fastest
    repeat on both sides (timeit's rule: on a shared machine the slower repeats
    carry other processes' interference). ``paired_errors``: medians, one repeat
    at a time (that repeat's calibration against that repeat's measurement).
    """
    median = {k: statistics.median(v) for k, v in samples.items()}
    profile = profile_of(median)
    predicted = simulate(profile)
    best_profile = profile_of({k: min(v) for k, v in samples.items()})
    best = simulate(best_profile)
    paired: dict[str, list[float]] = {name: [] for name in names}
    for r in range(len(samples[names[0]])):
        again = simulate(profile_of({k: v[r] for k, v in samples.items()}))
        for name in names:
            paired[name].append(again[name] * samples[name][r] - 1.0)
    row = {}
    for name in names:
        rates = [1.0 / t for t in samples[name]]
        measured = statistics.median(rates)
        row[name] = {
            "measured": measured,
            "min": min(rates),
            "max": max(rates),
            "simulated": predicted[name],
            "error": predicted[name] / measured - 1.0,
            "best": {"measured": max(rates), "simulated": best[name], "error": best[name] / max(rates) - 1.0},
            "paired_errors": paired[name],
        }
    return row, {**_figures(profile), "best": _figures(best_profile)}


def _figures(p) -> dict:
    """A profile's figures (for the report)."""
    d = {
        "controller.run_s": p.controller.run_s,
        "controller.node_s": p.controller.node_s,
    }
    for section, costs in (("hosts", p.hosts), ("hosts_busy", p.hosts_busy)):
        if costs is not None:
            for field in ("message_s", "run_s", "enqueue_s", "dispatch_s", "node_s"):
                d[f"{section}.{field}"] = getattr(costs, field)
    for field in ("launch_s", "computation_s", "inline", "launch_cpu_s"):
        for k, v in getattr(p.device, field).items():
            d[f"device.{field}[{k}]"] = v
    for field in ("run_at_s", "node_at_s"):
        for k, v in getattr(p.controller, field).items():
            d[f"controller.{field}[{k}]"] = v
    return d


def _mode_timers(modes: dict, target_s: float) -> dict:
    """dispatch.py's modes as timers of seconds per computation."""
    out = {}
    for name, (run, unit) in modes.items():
        rate = dispatch._measure(run, unit, target_s)
        out[name] = lambda rate=rate: 1.0 / rate()
    return out


def local_profile(per_call: dict, n: int):
    from pathways_jax import sim
    from pathways_jax.sim._calibrate import LOCAL_SOURCES, local_costs

    controller, device, jax_call = local_costs(per_call, [n])
    return sim.Profile(
        name="this_run", controller=controller, device=device, jax_call_s=jax_call,
        devices_per_host=n, sources=LOCAL_SOURCES,
    )  # fmt: skip


def run_local(devices: list[int], repeats: int, chain: int, target_s: float) -> tuple[dict, dict]:
    import pathways_jax as pw
    from pathways_jax import sim
    from pathways_jax.sim._calibrate import interleaved, local_timers

    out, calibration = {}, {}
    single = pw.devices(mesh={"x": 1})
    for n in devices:
        s, modes = dispatch._modes(n, chain, 16)
        timers = {
            **local_timers(s, single, target_s),
            **_mode_timers({m: modes[m] for m in LOCAL_MODES.values()}, target_s),
        }
        samples = interleaved(timers, repeats)
        s.release()
        pw.reset_counters()
        in_flight = pw.cluster().in_flight

        def simulate(profile, n=n, in_flight=in_flight) -> dict:
            cluster = sim.SimCluster(hosts=1, devices_per_host=n, profile=profile, in_flight=in_flight)
            return {name: _simulate(cluster, mode, chain, "island") for mode, name in LOCAL_MODES.items()}

        names = list(LOCAL_MODES.values())
        row, figures = _validate(samples, names, lambda per_call, n=n: local_profile(per_call, n), simulate)
        row["jax-O (reference)"] = {"measured": 1.0 / statistics.median(samples[f"jax-one/{n}"])}
        out[str(n)] = row
        calibration[str(n)] = {k: statistics.median(v) for k, v in samples.items() if k not in names}
        calibration[str(n)]["profile"] = figures
        print(_line(f"{n} device(s)", row), flush=True)
    single.release()
    return out, calibration


def _ray_modes(hosts: int, chain: int):
    """{mode: (run(calls) -> s, computations per call)} on ``hosts`` Ray hosts of 1 device."""
    import jax.numpy as jnp

    import pathways_jax as pw

    slices = [pw.devices(mesh={"x": 1}, island=h) for h in range(hosts)]
    one = [pw.jit(lambda x: x * 0.5 + 1.0, devices=s) for s in slices]

    def many_fn(x):
        for _ in range(chain):
            x = x * 0.5 + 1.0
        return x

    many = [pw.jit(many_fn, devices=s) for s in slices]

    def o_step(xs):
        return tuple(f(x) for f, x in zip(one, xs, strict=True))

    def c_step(xs):
        for _ in range(chain):
            xs = tuple(f(x) for f, x in zip(one, xs, strict=True))
        return xs

    def f_step(xs):
        return tuple(f(x) for f, x in zip(many, xs, strict=True))

    progs = {
        "O": (pw.program(o_step, name="ray_O", fuse=False), 1),
        "C": (pw.program(c_step, name="ray_C", fuse=False), chain),
        "F": (pw.program(f_step, name="ray_F", fuse=False), chain),
    }
    x0 = tuple(jnp.zeros((), jnp.float32) for _ in range(hosts))

    def loop(prog):
        def run(calls: int) -> float:
            start = time.perf_counter()
            xs = x0
            for _ in range(calls):
                xs = prog(xs)
            for x in xs:
                x.result()
            return time.perf_counter() - start

        return run

    return {mode: (loop(prog), unit) for mode, (prog, unit) in progs.items()}


def run_ray(base, host_counts: list[int], repeats: int, chain: int, target_s: float) -> dict | None:
    """Ray points: the host calibration loops beside the modes, every repeat; the controller's
    and the device's costs are the local section's (medians)."""
    import pathways_jax as pw
    from pathways_jax import sim
    from pathways_jax.sim._calibrate import (
        BUSY,
        HOST_SOURCES,
        RAY_TARGET_S,
        busy_cpu_timer,
        cpu_timer,
        host_costs,
        interleaved,
        ray_loops,
        start_ray,
    )

    ray = start_ray(max(host_counts))
    if ray is None:
        print("Ray is not installed (pip install 'pathways-jax[ray]'): no Ray points.")
        return None
    out: dict = {}
    cores = os.cpu_count() or 1
    try:
        for h in host_counts:
            try:
                pw.init(backend="ray", hosts=h, devices_per_host=1)
                # A run on Ray hosts takes milliseconds: loops of at least RAY_TARGET_S, so that
                # the fixed cost of a loop (its first run's latency, fetching the results at the
                # end, tens of ms on 4 hosts) stays a small part of a steady-state figure.
                ray_target = max(target_s, RAY_TARGET_S)
                loops = ray_loops()
                timers = {
                    **{k: cpu_timer(v, ray_target) for k, v in loops.items()},
                    # The same loops with no idle core: the profile's hosts_busy, which the
                    # simulated cluster charges as its hosts and controller crowd the cores.
                    **{k + BUSY: busy_cpu_timer(v, ray_target) for k, v in loops.items()},
                    **{f"pw-ray-{m}": t for m, t in _mode_timers(_ray_modes(h, chain), ray_target).items()},
                }
                samples = interleaved(timers, repeats)
            except Exception as exc:  # the Ray backend is shared work in progress: say what failed
                out[str(h)] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                print(f"{h} Ray hosts: not measured ({out[str(h)]['error']})", flush=True)
                continue
            finally:
                pw.shutdown()

            def profile_of(per_call: dict) -> object:
                return dataclasses.replace(
                    base,
                    hosts=host_costs(per_call, base.controller, base.device),
                    hosts_busy=host_costs(per_call, base.controller, base.device, BUSY),
                    devices_per_host=1,
                    sources={**base.sources, **HOST_SOURCES},
                )

            def simulate(profile, h=h) -> dict:
                # The hosts, the controller and Ray share this machine's cores.
                cluster = sim.SimCluster(
                    hosts=h, devices_per_host=1, islands=h, profile=profile, dispatch="hosts", cores=cores
                )
                # An elementwise op on 1 device a host: no collective, launch and a tiny computation.
                return {
                    f"pw-ray-{m}": _simulate(
                        cluster, m, chain, "hosts", compute_s=profile.device.computation(1)
                    )
                    for m in "OCF"
                }

            row, figures = _validate(samples, [f"pw-ray-{m}" for m in "OCF"], profile_of, simulate)
            row["calibration"] = {k: statistics.median(v) for k, v in samples.items() if k.startswith("ray-")}
            row["calibration"]["profile"] = figures
            out[str(h)] = row
            print(_line(f"{h} Ray hosts", row), flush=True)
    finally:
        ray.shutdown()
    return out


def _points(row: dict) -> dict:
    """A row's validation points (not its references or calibration)."""
    return {k: p for k, p in row.items() if isinstance(p, dict) and "simulated" in p}


def _line(label: str, row: dict) -> str:
    cells = ", ".join(
        f"{m} {p['measured']:,.0f} vs {p['simulated']:,.0f} ({p['error']:+.1%})"
        for m, p in _points(row).items()
    )
    return f"{label}: {cells}"


def _table(local: dict, ray: dict | None) -> str:
    lines = [
        "| point | mode | measured (computations/s, median) | simulated | error | fastest repeats: "
        "measured | simulated | error | paired errors (one repeat at a time) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, results in (("devices", local), ("Ray hosts", ray or {})):
        for n, row in results.items():
            if "error" in row:
                lines.append(f"| {n} {label} | - | not measured: {row['error'][:80]} | | | |")
                continue
            for mode, p in _points(row).items():
                mark = "" if abs(p["error"]) <= TARGET else " **"
                spread = " ".join(f"{e:+.0%}" for e in p["paired_errors"])
                b = p["best"]
                best_mark = "" if abs(b["error"]) <= TARGET else " **"
                lines.append(
                    f"| {n} {label} | {mode} | {p['measured']:,.0f} | {p['simulated']:,.0f} | "
                    f"{p['error']:+.1%}{mark} | {b['measured']:,.0f} | {b['simulated']:,.0f} | "
                    f"{b['error']:+.1%}{best_mark} | {spread} |"
                )
    return "\n".join(lines)


def _plot(local: dict, ray: dict | None, path: pathlib.Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    panels = [("local CPU devices", local)] + ([("Ray hosts (1 CPU device each)", ray)] if ray else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (title, results) in zip(axes[0], panels, strict=True):
        xs = [int(n) for n, row in results.items() if "error" not in row]
        if not xs:
            ax.set_title(f"{title}: not measured")
            continue
        for i, mode in enumerate(_points(results[str(xs[0])])):
            colour = f"C{i}"
            measured = [results[str(n)][mode]["measured"] for n in xs]
            simulated = [results[str(n)][mode]["simulated"] for n in xs]
            ax.plot(xs, measured, "-o", color=colour, label=f"{mode} measured")
            ax.plot(xs, simulated, "--x", color=colour, label=f"{mode} simulated")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_ylabel("computations / second")
        ax.set_title(f"pw.sim against measurement: {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    import pathways_jax as pw

    devices = [int(d) for d in _DEVICES.value]
    hosts = [int(h) for h in _HOSTS.value]
    repeats, chain, target = _REPEATS.value, _CHAIN.value, _TARGET.value
    quick = _QUICK.value
    if quick:
        repeats, chain, target, devices = 1, 8, 0.005, devices[:2]
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    # One device more than the largest slice: the controller's calibration loops run beside it.
    # (and the Ray backend's hosts stand in with CPU devices of this process: as many as hosts)
    pw.init(num_cpu_devices=max(max(devices) + 1, *hosts))
    local, calibration = run_local(devices, repeats, chain, target)
    pw.shutdown()
    ray_results = None
    if _RAY.value and not quick:
        n = min(devices)
        base = local_profile({k: v for k, v in calibration[str(n)].items() if k != "profile"}, n)
        ray_results = run_ray(base, hosts, repeats, chain, target)
    points = [p for r in (local, ray_results or {}) for row in r.values() for p in _points(row).values()]
    errors = [abs(p["error"]) for p in points]
    report = {
        "benchmark": "sim_validate",
        "target_abs_error": TARGET,
        "within_target": sum(e <= TARGET for e in errors),
        "within_target_fastest_repeats": sum(abs(p["best"]["error"]) <= TARGET for p in points),
        "points": len(errors),
        "max_abs_error": max(errors, default=None),
        "local": local,
        "ray": ray_results,
        "calibration_s_per_call": calibration,
        "table": _table(local, ray_results),
        "config": {"repeats": repeats, "chain": chain, "target_s": target, "quick": quick},
        "seconds": round(time.time() - started, 1),
        "machine": common.machine(),
    }
    name = "sim_validate_quick" if quick else "sim_validate"
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    _plot(local, ray_results, out_dir / f"{name}.png")
    print(report["table"])
    print(
        f"{report['within_target']}/{report['points']} points within {TARGET:.0%} "
        f"({report['within_target_fastest_repeats']} with the fastest repeats)"
    )
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')}")


if __name__ == "__main__":
    app.run(main)
