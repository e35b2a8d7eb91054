"""The paper's scale figures, simulated with pw.sim and the TPU v4 profile.

Nothing here runs on devices: every figure is a simulation of the controller,
its hosts and TPU v4 chips (``pathways_jax/sim/profiles/tpu_v4.json``: public
TPU v4 figures, this project's measured controller and host-message costs).

  dispatch    the dispatch benchmark (a scalar all-reduce + add per computation)
              at 1-512 hosts of 4 chips: pw-O (one run per computation), pw-C
              (a run of --chain nodes), pw-F (one node of --chain computations),
              and the multi-controller JAX baselines jax-O / jax-F (every host
              runs its own Python: ``max(jax.call_s, device time)`` a call).
  threshold   the amortisation threshold: the smallest device time of one
              computation at which pw-O reaches 95% (and 99%) of jax-O's
              throughput, against host count (paper: 2.3 ms @16 hosts, 35 ms @512);
              again with a host message of --ray_message_ms (what this project's
              Ray backend paid: a Python Ray actor call per host per run), and
              with the host message --channel_profile measured (its ZeroMQ
              channel's hosts.message_s), sent one after another ("serial", as
              the runtime did), down a tree (each sender forwards to
              --fanout_degree hosts a round: pw.sim.SimCluster(fanout="tree")) and
              as one broadcast (the runtime now: hosts.broadcast_s once and
              hosts.broadcast_host_s a host, benchmarks/fanout.py;
              pw.sim.SimCluster(fanout="broadcast")).
  pipeline    a GPipe step of a 3B-parameter model on 128 chips (32 hosts),
              4/8/16 stages and 16-512 microbatches, against SPMD on the same
              chips doing the same device work (paper: 16 stages 131.4k tokens/s
              against 133.7k at 4 stages, 98%).
  two islands a 64B-parameter model's step on two islands of 512 chips (128
              hosts each), each island sending its bf16 gradients to the other
              over DCN, against one island of 1024 chips (paper: 97.2%).

Writes benchmarks/results/sim_scale.json and sim_scale.png.

  python benchmarks/sim_scale.py           # a few minutes
  python benchmarks/sim_scale.py --quick   # seconds; used by the test suite
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time

import common
from absl import app, flags

_PROFILE = flags.DEFINE_string("profile", "tpu_v4", "The profile (a built-in name or a JSON path).")
_CHAIN = flags.DEFINE_integer("chain", 128, "Computations per run of pw-C / pw-F.")
_MFU = flags.DEFINE_float("mfu", 0.5, "Fraction of peak FLOP/s the models' device work reaches.")
_RAY_MESSAGE_MS = flags.DEFINE_float(
    "ray_message_ms", 1.0, "The host message cost of the threshold's Ray variant (a Ray actor call here)."
)
_CHANNEL_PROFILE = flags.DEFINE_string(
    "channel_profile",
    "cpu_2core",
    "The profile whose measured hosts.message_s (the runtime's ZeroMQ channel) the threshold's channel "
    "variants charge.",
)
_FANOUT_DEGREE = flags.DEFINE_integer("fanout_degree", 4, "Hosts each sender sends to a round (fanout tree).")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny sizes: only checks the script works.")
_OUT = flags.DEFINE_string(
    "out", str(pathlib.Path(__file__).resolve().parent / "results"), "Where results go."
)

PAPER = {
    "threshold_ms": {16: 2.3, 512: 35.0},
    "pipeline_16_vs_4_stages": 131.4 / 133.7,
    "two_islands_vs_one": 0.972,
}


def _throughput(cluster, program, runs: int) -> float:
    from pathways_jax import sim

    return sim.simulate(cluster, program, runs=runs, record=False).throughput


def dispatch_scale(profile, hosts: list[int], chain: int) -> dict:
    """Computations/s of every mode at every host count (one island of all the hosts' chips)."""
    from pathways_jax import sim

    out = {}
    for h in hosts:
        cluster = sim.SimCluster(hosts=h, profile=profile)
        n = cluster.devices
        device_one = profile.device.launch(n) + profile.device.computation(n)
        device_fused = profile.device.launch(n) + chain * profile.device.computation(n)
        row = {
            "chips": n,
            "jax-O": 1.0 / max(profile.jax_call_s, device_one),
            "jax-F": chain / max(profile.jax_call_s, device_fused),
        }
        for mode, runs in (("O", 32), ("C", 6), ("F", 16)):
            program = sim.dispatch_mode(cluster, mode, chain_length=chain)
            row[f"pw-{mode}"] = _throughput(cluster, program, runs)
        out[str(h)] = row
        print(
            f"dispatch {h:4d} hosts ({n:5d} chips): "
            + ", ".join(f"{k} {v:,.0f}" for k, v in row.items() if k != "chips"),
            flush=True,
        )
    return out


def amortisation_threshold(
    profile, hosts: list[int], levels=(0.95, 0.99), fanout: str = "serial", degree: int = 4
) -> dict:
    """Per host count: the device time of one computation at which pw-O reaches ``level`` x jax-O.

    ``fanout``/``degree``: how the controller's messages of a run reach its hosts (from 2 hosts).
    """
    from pathways_jax import sim

    out = {}
    for h in hosts:
        tree = {"fanout": fanout, "fanout_degree": degree} if h > 1 else {}
        cluster = sim.SimCluster(hosts=h, profile=profile, **tree)
        n = cluster.devices
        launch = profile.device.launch(n)

        def ratio(work_s: float, cluster=cluster, launch=launch) -> float:
            program = sim.dispatch_mode(cluster, "O", compute_s=work_s)
            pw_o = _throughput(cluster, program, 24)
            jax_o = 1.0 / max(profile.jax_call_s, launch + work_s)
            return pw_o / jax_o

        row = {"chips": n}
        for level in levels:
            lo, hi = 1e-7, 10.0  # seconds of work per computation: ratio(lo) < level <= ratio(hi)
            if ratio(lo) >= level:
                row[f"{level:.0%}"] = (launch + lo) * 1e3
                continue
            for _ in range(40):  # bisection in log space, to 1e-3 relative
                mid = math.sqrt(lo * hi)
                if ratio(mid) >= level:
                    hi = mid
                else:
                    lo = mid
                if hi / lo < 1.001:
                    break
            row[f"{level:.0%}"] = (launch + hi) * 1e3  # ms of device time per computation
        c, hc = profile.controller, profile.hosts
        if cluster.dispatch == "hosts" and cluster.fanout == "broadcast":
            messages = 1
            per_run = c.run_s + hc.dispatch_s + hc.node_s + hc.broadcast_s + h * hc.broadcast_host_s
        elif cluster.dispatch == "hosts":
            messages = len(sim.fanout_tree(range(h), cluster.fanout, cluster.fanout_degree)[-1])
            per_run = c.run_s + hc.dispatch_s + hc.node_s + messages * hc.message_s
        else:
            messages, per_run = 0, c.run_s + c.node_s
        row["controller_messages"] = messages
        row["controller_per_run_ms"] = per_run * 1e3
        out[str(h)] = row
        print(
            f"threshold {h:4d} hosts ({fanout}, {hc.message_s * 1e6:.0f} us messages): "
            + ", ".join(f"{level:.0%} at {row[f'{level:.0%}']:.3f} ms" for level in levels)
            + f" (controller per run {row['controller_per_run_ms']:.3f} ms, {messages} messages)",
            flush=True,
        )
    return out


def _step_time(profile, params: float, tokens: int, chips: int, mfu: float) -> float:
    """Seconds of device work of one training step: 6 x params x tokens FLOPs over the chips."""
    return 6.0 * params * tokens / (chips * profile.device.flops_per_s * mfu)


def pipeline_vs_spmd(profile, stage_counts: list[int], microbatches: list[int], mfu: float) -> dict:
    """A 3B model on 32 hosts (128 chips): GPipe over S stages against SPMD, same device work."""
    from pathways_jax import sim

    hosts, params, tokens, d_model = 32, 3e9, 1 << 20, 2560
    cluster = sim.SimCluster(hosts=hosts, profile=profile)
    chips = cluster.devices
    work = _step_time(profile, params, tokens, chips, mfu)
    spmd = sim.simulate(cluster, sim.spmd(cluster, work), runs=8, record=False)
    out = {
        "config": {
            "hosts": hosts,
            "chips": chips,
            "params": params,
            "tokens_per_step": tokens,
            "d_model": d_model,
            "mfu": mfu,
            "spmd_device_s": work,
            "note": "same device work in both: SPMD is one node over all chips; stage s of S does 1/S of "
            "the layers on chips/S chips, forward t and backward 2t per microbatch (3t = work/M); "
            "activations (tokens/M x d_model bf16) move between stages over ICI; gradient "
            "synchronisation is charged to neither",
        },
        "spmd_step_s": spmd.step_time_s,
        "rows": [],
    }
    for s in stage_counts:
        for m in microbatches:
            stage_s = work / (3 * m)
            act = tokens // m * d_model * 2
            program = sim.pipeline(cluster, s, m, stage_s, activation_bytes=act)
            result = sim.simulate(cluster, program, runs=4, record=False)
            ideal = work * (m + s - 1) / m  # GPipe's bubble, nothing else
            row = {
                "stages": s,
                "microbatches": m,
                "step_s": result.step_time_s,
                "vs_spmd": spmd.step_time_s / result.step_time_s,
                "vs_ideal_gpipe": ideal / result.step_time_s,
                "bubble_bound": m / (m + s - 1),
                "controller_busy": result.controller_busy,
            }
            out["rows"].append(row)
            print(
                f"pipeline {s:2d} stages x {m:3d} microbatches: {row['vs_spmd']:.1%} of SPMD "
                f"(GPipe bound {row['bubble_bound']:.1%}; {row['vs_ideal_gpipe']:.2%} of it)",
                flush=True,
            )
    return out


def two_islands(profile, hosts_per_island: int, mfu: float, step_scales: list[float]) -> dict:
    """A 64B model on 2 x (hosts_per_island x 4 chips), bf16 gradients over DCN, against one island."""
    from pathways_jax import sim

    params, tokens = 64e9, 1 << 20
    grad_bytes = int(params * 2)  # bf16
    one = sim.SimCluster(hosts=2 * hosts_per_island, profile=profile)
    two = sim.SimCluster(hosts=2 * hosts_per_island, profile=profile, islands=2)
    chips = one.devices
    work = _step_time(profile, params, tokens, chips, mfu)  # per chip: the same in both layouts
    shard = grad_bytes // (chips // 2)  # each chip's share of one replica's gradients
    apply_s = 3 * shard / profile.device.bytes_per_s  # read the gradient twice, write once
    out = {
        "config": {
            "hosts_per_island": hosts_per_island,
            "chips": chips,
            "params": params,
            "tokens_per_step": tokens,
            "gradient_bytes": grad_bytes,
            "mfu": mfu,
            "device_s_at_1x": work,
            "apply_s": apply_s,
            "dcn_s": profile.dcn.transfer(grad_bytes, parallel=hosts_per_island),
            "note": "each island computes its half batch's gradients (ICI all-reduce of a chip's "
            "gradient shard inside the island), sends all its bf16 gradients to the other island "
            "over DCN (sharded over its hosts, both directions at once), then applies both; one "
            "island of all the chips does the same work with the all-reduce over ICI and no DCN. "
            "The transfer starts when the gradient node ends (not overlapped with the backward pass)",
        },
        "rows": [],
    }
    for scale in step_scales:
        c = work * scale
        base = sim.simulate(one, sim.spmd(one, c + apply_s, all_reduce_bytes=shard), runs=6, record=False)
        program = sim.two_islands(two, c, grad_bytes, apply_s=apply_s, all_reduce_bytes=shard)
        result = sim.simulate(two, program, runs=6, record=False)
        row = {
            "tokens_per_step": int(tokens * scale),
            "device_s": c,
            "one_island_step_s": base.step_time_s,
            "two_islands_step_s": result.step_time_s,
            "ratio": base.step_time_s / result.step_time_s,
        }
        out["rows"].append(row)
        print(
            f"two islands, {row['tokens_per_step']:,} tokens a step ({c:.3f} s of device work): "
            f"{row['ratio']:.1%} of one island",
            flush=True,
        )
    return out


def _plot(report: dict, path: pathlib.Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    ax = axes[0][0]
    d = report["dispatch"]
    hosts = [int(h) for h in d]
    for i, mode in enumerate(("jax-O", "jax-F", "pw-O", "pw-C", "pw-F")):
        style = "--" if mode.startswith("jax") else "-"
        ax.plot(hosts, [d[str(h)][mode] for h in hosts], style + "o", color=f"C{i}", label=mode, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hosts (4 TPU v4 chips each)")
    ax.set_ylabel("computations / second")
    ax.set_title("dispatch benchmark, simulated (paper Fig. 5)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    ax = axes[0][1]
    t = report["threshold"]
    hosts = [int(h) for h in t]
    for i, level in enumerate(("95%", "99%")):
        ax.plot(
            hosts,
            [t[str(h)][level] for h in hosts],
            "-o",
            color=f"C{i}",
            ms=4,
            label=f"pw-O at {level} of jax-O",
        )
    ax.plot(
        hosts,
        [t[str(h)]["controller_per_run_ms"] for h in hosts],
        ":",
        color="gray",
        label="controller per run",
    )
    r = report["threshold_ray_message"]
    ray_label = f"95%, with {report['config_ray_message_ms']:g} ms host messages (Ray calls)"
    ax.plot(hosts, [r[str(h)]["95%"] for h in hosts], "--", color="C2", label=ray_label)
    us = report["config_channel_message_us"]
    for key, style, color, what in (
        ("threshold_channel", "-.", "C3", "serial"),
        ("threshold_channel_tree", "-.", "C4", f"tree of {report['config_fanout_degree']}"),
        ("threshold_channel_broadcast", "-.", "C5", "one broadcast"),
    ):
        ax.plot(
            hosts, [report[key][str(h)]["95%"] for h in hosts], style, color=color,
            label=f"95%, measured channel ({us:.0f} µs messages), {what}",
        )  # fmt: skip
    ph = sorted(PAPER["threshold_ms"])
    ax.plot(ph, [PAPER["threshold_ms"][h] for h in ph], "r*", ms=12, label="paper (Pathways)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hosts (4 TPU v4 chips each)")
    ax.set_ylabel("device time of one computation (ms)")
    ax.set_title("amortisation threshold (paper: 2.3 ms @16, 35 ms @512)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    ax = axes[1][0]
    p = report["pipeline"]
    for i, s in enumerate(sorted({r["stages"] for r in p["rows"]})):
        rows = [r for r in p["rows"] if r["stages"] == s]
        ms = [r["microbatches"] for r in rows]
        ax.plot(ms, [r["vs_spmd"] for r in rows], "-o", color=f"C{i}", ms=4, label=f"{s} stages (simulated)")
        ax.plot(ms, [r["bubble_bound"] for r in rows], ":", color=f"C{i}", label=f"{s} stages: GPipe bound")
    ax.axhline(0.98, color="r", ls="--", lw=1, label="paper: 16 stages at 98% (of 4 stages)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches per step")
    ax.set_ylabel("throughput / SPMD")
    ax.set_title("pipeline vs SPMD, 3B model on 128 chips (simulated)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)

    ax = axes[1][1]
    rows = report["two_islands"]["rows"]
    ax.plot([r["device_s"] for r in rows], [r["ratio"] for r in rows], "-o", ms=4, label="simulated")
    ax.axhline(PAPER["two_islands_vs_one"], color="r", ls="--", lw=1, label="paper: 97.2%")
    ax.set_xscale("log")
    ax.set_xlabel("device time of a step (s)")
    ax.set_ylabel("throughput / one island")
    ax.set_title("two islands of 512 chips over DCN, 64B model (simulated)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tables(report: dict) -> str:
    lines = ["| hosts | chips | jax-O | jax-F | pw-O | pw-C | pw-F | pw-C / jax-O |", "|---:" * 8 + "|"]
    for h, r in report["dispatch"].items():
        lines.append(
            f"| {h} | {r['chips']} | {r['jax-O']:,.0f} | {r['jax-F']:,.0f} | {r['pw-O']:,.0f} | "
            f"{r['pw-C']:,.0f} | {r['pw-F']:,.0f} | {r['pw-C'] / r['jax-O']:.2f}x |"
        )
    us, k = report["config_channel_message_us"], report["config_fanout_degree"]
    lines += [
        "",
        "| hosts | pw-O at 95% of jax-O (ms) | at 99% (ms) | controller per run (ms) | "
        f"95% with {report['config_ray_message_ms']:g} ms messages (ms) | "
        f"95%, channel {us:.0f} µs, serial (ms) | 95%, channel, tree of {k} (ms) | "
        "95%, channel, broadcast (ms) | paper (ms) |",
    ]
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for h, r in report["threshold"].items():
        paper = PAPER["threshold_ms"].get(int(h))
        ray = report["threshold_ray_message"][h]["95%"]
        serial = report["threshold_channel"][h]["95%"]
        tree = report["threshold_channel_tree"][h]["95%"]
        broadcast = report["threshold_channel_broadcast"][h]["95%"]
        lines.append(
            f"| {h} | {r['95%']:.3f} | {r['99%']:.3f} | {r['controller_per_run_ms']:.3f} | {ray:.3g} | "
            f"{serial:.3g} | {tree:.3g} | {broadcast:.3g} | {paper if paper is not None else ''} |"
        )
    lines += [
        "",
        "| stages | microbatches | vs SPMD | GPipe bound | of the bound |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in report["pipeline"]["rows"]:
        lines.append(
            f"| {r['stages']} | {r['microbatches']} | {r['vs_spmd']:.1%} | {r['bubble_bound']:.1%} | "
            f"{r['vs_ideal_gpipe']:.2%} |"
        )
    lines += [
        "",
        "| tokens a step | device s | one island (s) | two islands (s) | ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in report["two_islands"]["rows"]:
        lines.append(
            f"| {r['tokens_per_step']:,} | {r['device_s']:.3f} | {r['one_island_step_s']:.4f} | "
            f"{r['two_islands_step_s']:.4f} | {r['ratio']:.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    from pathways_jax import sim

    profile = sim.load_profile(_PROFILE.value)
    quick = _QUICK.value
    hosts = [1, 16] if quick else [2**i for i in range(10)]
    chain = 8 if quick else _CHAIN.value
    started = time.time()
    report: dict = {"benchmark": "sim_scale", "profile": profile.to_json(), "paper": PAPER}
    report["dispatch"] = dispatch_scale(profile, hosts, chain)
    report["threshold"] = amortisation_threshold(profile, hosts)
    ray_like = dataclasses.replace(
        profile, hosts=dataclasses.replace(profile.hosts, message_s=_RAY_MESSAGE_MS.value * 1e-3)
    )
    report["threshold_ray_message"] = amortisation_threshold(ray_like, hosts)
    report["config_ray_message_ms"] = _RAY_MESSAGE_MS.value
    channel = sim.load_profile(_CHANNEL_PROFILE.value)
    channel_like = dataclasses.replace(
        profile,
        hosts=dataclasses.replace(
            profile.hosts,
            message_s=channel.hosts.message_s,
            broadcast_s=channel.hosts.broadcast_s,
            broadcast_host_s=channel.hosts.broadcast_host_s,
        ),
    )
    degree = _FANOUT_DEGREE.value
    report["threshold_channel"] = amortisation_threshold(channel_like, hosts, levels=(0.95,))
    report["threshold_channel_tree"] = amortisation_threshold(
        channel_like, hosts, levels=(0.95,), fanout="tree", degree=degree
    )
    report["threshold_channel_broadcast"] = amortisation_threshold(
        channel_like, hosts, levels=(0.95,), fanout="broadcast"
    )
    report["config_channel_message_us"] = channel.hosts.message_s * 1e6
    report["config_channel_profile"] = {
        "name": channel.name,
        "measured": channel.meta.get("hosts_measured", channel.meta.get("measured")),
        "source": channel.sources.get("hosts.message_s", ""),
    }
    report["config_fanout_degree"] = degree
    report["pipeline"] = pipeline_vs_spmd(
        profile, [4, 16] if quick else [4, 8, 16], [16] if quick else [16, 64, 256, 512], _MFU.value
    )
    report["two_islands"] = two_islands(
        profile, 8 if quick else 128, _MFU.value, [1.0] if quick else [0.125, 0.25, 0.5, 1.0, 2.0, 4.0]
    )
    report["table"] = _tables(report)
    report["config"] = {"chain": chain, "mfu": _MFU.value, "quick": quick}
    report["seconds"] = round(time.time() - started, 1)
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "sim_scale_quick" if quick else "sim_scale"
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    _plot(report, out_dir / f"{name}.png")
    print(report["table"])
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')} in {report['seconds']} s")


if __name__ == "__main__":
    app.run(main)
