"""Pipelined and two-island data-parallel Transformer training against plain SPMD ``jax.jit``.

The model is the decoder-only Transformer of ``examples/pipeline_transformer.py``
(--layers blocks). All modes train it with Adam on the same synthetic token
batches, on the same CPU devices (8 by default, --devices), carved into 2 islands of half each:

  spmd            plain ``jax.jit``: one train step over all 8 devices, the batch
                  split 8 ways, parameters replicated (the 1-stage baseline, and the
                  one-island baseline of the data-parallel comparison)
  pipe{S}-gpipe   ``pipeline.Pipeline`` with S = 2, 4, 8 stages of 8/S devices each
  pipe{S}-1f1b    (stages 0..S/2-1 on island 0, the rest on island 1), schedule
                  GPipe or 1F1B, --microbatches microbatches (default S)
  dp2             ``pipeline.DataParallel`` over the 2 islands of 4 devices
  jax-dp2         the same two-island step by hand in plain JAX (per-island jitted grads,
                  ``jax.device_put`` of the gradients across, per-island update): what the
                  split itself costs on this machine, without pathways_jax

Every train step of a pathways mode is ONE program call. Rounds are
interleaved (the mode order rotates each round) so machine drift hits all
modes alike; each mode's figure is the median over rounds of tokens/second,
and its ratio is the median over rounds of (mode / spmd of the same round).

Bubble accounting: a synchronous pipeline of S stages and M microbatches idles
a fraction b = (S - 1) / (M + S - 1) of its device time (GPipe and 1F1B alike).
We report the measured ratio r, b, and the bubble-corrected ratio r / (1 - b):
the throughput of the pipelined step relative to SPMD per unit of busy device
time. On an accelerator the bubble is idle hardware; on this CPU machine all
"devices" share the same few cores, so an idle stage leaves its cores to the
busy ones and the raw ratio r is the figure to trust (see benchmarks/README.md).

  python benchmarks/pipeline.py           # the full run (a few minutes)
  python benchmarks/pipeline.py --quick   # tiny sizes, seconds; used by the test suite
  python benchmarks/pipeline.py --devices 2 --stages 2   # 2 islands of 1 device: one per core here
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

import common
from absl import app, flags

_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds per mode.")
_STEPS = flags.DEFINE_integer("steps", 4, "Train steps per measurement.")
_STAGES = flags.DEFINE_list("stages", ["2", "4", "8"], "Pipeline stage counts.")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 0, "Microbatches per step; 0: as many as stages.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step (a multiple of 8 and of the microbatches).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Model width.")
_LAYERS = flags.DEFINE_integer("layers", 8, "Transformer blocks (a multiple of every stage count).")
_DEVICES = flags.DEFINE_integer(
    "devices", 8, "CPU devices, carved into 2 islands of half each (an even number >= every stage count)."
)
_QUICK = flags.DEFINE_bool("quick", False, "Tiny run that only checks the benchmark works.")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).resolve().parent / "results"), "Result folder.")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modes(config, batch: int, stages: list[int], microbatches: int, devices: int = 8):
    """Builds every mode; returns {mode: (step() -> None, finish() -> None, info)}."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from pipeline_transformer import loss_fn, make_stages

    import pathways_jax as pw
    from pathways_jax import pipeline

    tx = optax.adam(1e-3)
    modes = {}

    # spmd: plain jax.jit over all the devices, batch split as many ways.
    half = devices // 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))  # automatic sharding, as pw uses
    replicated, split = NamedSharding(mesh, pw.P()), NamedSharding(mesh, pw.P("data"))
    params, apply = pipeline.sequential(make_stages(config, 1))
    state = {"params": jax.device_put(params, replicated)}
    state["opt"] = jax.device_put(tx.init(state["params"]), replicated)

    @jax.jit
    def spmd_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(apply(p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    def spmd_run(x, y):
        state["loss"], state["params"], state["opt"] = spmd_step(
            state["params"], state["opt"], jax.device_put(x, split), jax.device_put(y, split)
        )

    modes["spmd"] = (spmd_run, lambda: jax.block_until_ready(state), {"kind": "baseline"})

    # jax-dp2: the two-island step written by hand in plain JAX (same split as dp2, host-driven
    # transfers), to tell what splitting over islands costs from what pathways_jax adds.
    from jax.flatten_util import ravel_pytree

    island_meshes = [
        jax.sharding.Mesh(np.array(jax.devices()[half * i : half * i + half]), ("data",)) for i in range(2)
    ]
    _, unravel = ravel_pytree(params)

    @jax.jit
    def island_grads(params, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(apply(p, x), y))(params)
        return loss, ravel_pytree(grads)[0]

    @jax.jit
    def island_update(params, opt_state, g0, g1):
        updates, opt_state = tx.update(unravel((g0 + g1) / 2), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    hand = []
    for m in island_meshes:
        p = jax.device_put(params, NamedSharding(m, pw.P()))
        hand.append([p, jax.device_put(tx.init(p), NamedSharding(m, pw.P()))])

    def hand_run(x, y):
        xs, ys = np.split(np.asarray(x), 2), np.split(np.asarray(y), 2)
        grads = []
        for i, m in enumerate(island_meshes):
            split_i = NamedSharding(m, pw.P("data"))
            grads.append(
                island_grads(hand[i][0], jax.device_put(xs[i], split_i), jax.device_put(ys[i], split_i))[1]
            )
        for j, m in enumerate(island_meshes):
            moved = [jax.device_put(g, NamedSharding(m, pw.P())) for g in grads]
            hand[j][0], hand[j][1] = island_update(hand[j][0], hand[j][1], *moved)

    modes["jax-dp2"] = (hand_run, lambda: jax.block_until_ready(hand), {"kind": "baseline", "islands": 2})

    def pathways_mode(trainer, info):
        last = {}

        def run(x, y):
            last["loss"] = trainer.train_step(x, y)

        def finish():
            last["loss"].result()
            params = trainer.params if isinstance(trainer, pipeline.Pipeline) else trainer.params_per_island
            jax.tree.map(pw.Future.result, params)

        return run, finish, info

    for count in stages:
        per = devices // count
        slices = [pw.devices(mesh={"data": per}, island=s * 2 // count) for s in range(count)]
        micro = microbatches or count
        for schedule in pipeline.SCHEDULES:
            pipe = pipeline.Pipeline(
                make_stages(config, count),
                slices,
                loss_fn=loss_fn,
                optimizer=tx,
                num_microbatches=micro,
                schedule=schedule,
            )
            info = {
                "kind": "pipeline",
                "stages": count,
                "devices_per_stage": per,
                "microbatches": micro,
                "schedule": schedule,
                "islands": [s.island for s in slices],
                "bubble_fraction": pipe.bubble_fraction,
            }
            modes[f"pipe{count}-{schedule}"] = pathways_mode(pipe, info)
    islands = [pw.devices(mesh={"data": half}, island=i) for i in range(2)]
    dp = pipeline.DataParallel(make_stages(config, 1), islands, loss_fn=loss_fn, optimizer=tx)
    modes["dp2"] = pathways_mode(dp, {"kind": "data_parallel", "islands": 2, "devices_per_island": half})
    return modes


def _plot(result: dict, path: pathlib.Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    modes = [m for m in result["modes"] if m != "spmd"]
    ratios = [result["modes"][m]["ratio_vs_spmd"] for m in modes]
    ideal = [1 - result["modes"][m].get("bubble_fraction", 0.0) for m in modes]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(modes))
    ax.bar(
        xs,
        ratios,
        color=[
            "grey"
            if m.startswith("jax")
            else "tab:blue"
            if "gpipe" in m
            else "tab:orange"
            if "1f1b" in m
            else "tab:green"
            for m in modes
        ],
    )
    ax.scatter(
        xs, ideal, marker="_", s=600, color="black", label="1 - bubble fraction (accelerator ideal)", zorder=3
    )
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.axhline(0.97, color="tab:green", linestyle="--", linewidth=1, label="two-island target 0.97")
    for x, r in zip(xs, ratios, strict=True):
        ax.text(x, r + 0.01, f"{r:.2f}", ha="center", fontsize=8)
    ax.set_xticks(list(xs), modes, rotation=30, ha="right")
    ax.set_ylabel("tokens/s relative to plain jax.jit SPMD")
    ax.set_title(
        f"Transformer training on {result['machine']['devices']} ({result['machine']['cpu_count']} cores)"
    )
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str]) -> None:
    del argv
    sys.path.insert(0, str(ROOT / "examples"))
    import pathways_jax as pw

    devices = _DEVICES.value
    stages = [int(s) for s in _STAGES.value]
    if devices < 2 or devices % 2 or any(devices % count for count in stages):
        raise app.UsageError(
            f"--devices={devices} must be even and a multiple of every stage count {stages}."
        )
    pw.init(num_cpu_devices=devices, islands=2)  # before any JAX work
    from pipeline_transformer import Config, make_batch

    if _QUICK.value:  # compile time dominates: as few layers as the largest pipeline needs
        config = Config(vocab=8, seq_len=4, d_model=8, heads=1, layers=max(stages), period=3)
        batch, rounds, steps = 16, 1, 1
    else:
        config = Config(
            vocab=64, seq_len=_SEQ_LEN.value, d_model=_D_MODEL.value, heads=4, layers=_LAYERS.value
        )
        batch, rounds, steps = _BATCH.value, _ROUNDS.value, _STEPS.value
    microbatches = 1 if _QUICK.value else _MICROBATCHES.value
    batches = [make_batch(config, 0, i, batch) for i in range(steps)]
    tokens = batch * config.seq_len * steps

    start = time.perf_counter()
    modes = _modes(config, batch, stages, microbatches, devices)
    for name, (run, finish, _) in modes.items():  # compile and warm every mode
        t0 = time.perf_counter()
        run(*batches[0])
        finish()
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"built and compiled {len(modes)} modes in {time.perf_counter() - start:.1f} s")

    names = list(modes)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            run, finish, _ = modes[name]
            t0 = time.perf_counter()
            for x, y in batches:
                run(x, y)
            finish()
            per_round[name].append(tokens / (time.perf_counter() - t0))
        print(f"round {r}: " + ", ".join(f"{n} {per_round[n][-1]:,.0f}" for n in names), flush=True)

    result = {
        "benchmark": "pipeline",
        "machine": common.machine(),
        "quick": _QUICK.value,
        "config": {
            **{k: getattr(config, k) for k in ("vocab", "seq_len", "d_model", "heads", "layers")},
            "batch": batch,
            "tokens_per_step": batch * config.seq_len,
            "steps_per_measurement": steps,
            "rounds": rounds,
            "devices": devices,
        },
        "bubble_accounting": (
            "bubble b = (S-1)/(M+S-1); bubble_corrected_ratio = ratio_vs_spmd / (1 - b). On this CPU "
            "machine the 8 devices share the cores, so idle stages do not idle the hardware: the raw ratio "
            "is the honest figure and the corrected one an upper bound."
        ),
        "modes": {},
    }
    for name in names:
        info = dict(modes[name][2])
        ratios = [m / b for m, b in zip(per_round[name], per_round["spmd"], strict=True)]
        entry = {
            **info,
            "tokens_per_s": statistics.median(per_round[name]),
            "tokens_per_s_min": min(per_round[name]),
            "tokens_per_s_max": max(per_round[name]),
            "ratio_vs_spmd": statistics.median(ratios),
        }
        if "bubble_fraction" in info:
            entry["bubble_corrected_ratio"] = entry["ratio_vs_spmd"] / (1 - info["bubble_fraction"])
        result["modes"][name] = entry
    result["two_island_vs_one_island"] = result["modes"]["dp2"]["ratio_vs_spmd"]
    dp2_vs_hand = [a / b for a, b in zip(per_round["dp2"], per_round["jax-dp2"], strict=True)]
    result["dp2_vs_plain_jax_two_island"] = statistics.median(dp2_vs_hand)

    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(result, indent=2) + "\n")
    plotted = _plot(result, out / "pipeline.png")
    print(f"\n{'mode':<14} {'tokens/s':>10} {'ratio':>7} {'bubble':>7} {'corrected':>9}")
    for name, entry in result["modes"].items():
        bubble = entry.get("bubble_fraction")
        corrected = entry.get("bubble_corrected_ratio")
        print(
            f"{name:<14} {entry['tokens_per_s']:>10,.0f} {entry['ratio_vs_spmd']:>7.3f} "
            f"{'' if bubble is None else f'{bubble:.3f}':>7} {'' if corrected is None else f'{corrected:.3f}':>9}"
        )
    print(
        f"two islands / one island (dp2 / spmd): {result['two_island_vs_one_island']:.3f}; "
        f"dp2 / jax-dp2: {result['dp2_vs_plain_jax_two_island']:.3f}"
    )
    print(f"wrote {out / 'pipeline.json'}" + (f" and {out / 'pipeline.png'}" if plotted else ""))
    pw.shutdown()


if __name__ == "__main__":
    app.run(main)
