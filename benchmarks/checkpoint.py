"""Checkpoints the Ray hosts write, against Orbax's own async checkpoints of plain JAX, in one run.

A training state (parameters and a momentum, ``--mib`` MiB in all, sharded
over two devices) is trained with a step of about a second or more, and an
``ocp.CheckpointManager`` saves it with ``StandardSave`` between steps, as
Orbax users write it:

  pathways_jax  4 Ray hosts of one device, 2 islands; the state on island 0
                (a mesh of 2 over its 2 hosts). The hosts write their shards.
                Then a new cluster of 2 hosts, 1 island (one fewer), restores
                it (another topology) and trains on.
  plain JAX     the same state and step on 2 of this process's CPU devices,
                the same Orbax calls (Orbax's async save: it copies the
                arrays to host memory before returning).

Measured, per side: the steady step time; the time ``save`` blocks the
training loop, as a fraction of a step; the step time of the step run while
the checkpoint is written; the save's total time (to ``wait_until_finished``);
the growth of this process's RSS from before the save to its peak during it
(sampled every 5 ms), against the state's bytes (for pathways_jax: the
controller's, which holds no bytes of the state); and the time of the first
step after a restore (restore call to its result). Results go to
benchmarks/results/checkpoint.json and checkpoint.png.

  python benchmarks/checkpoint.py              # 256 MiB state, about 3 minutes
  python benchmarks/checkpoint.py --quick      # 32 MiB, a short step
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import threading
import time

import common
from absl import app, flags

_MIB = flags.DEFINE_integer("mib", 256, "Bytes of the training state, in MiB (parameters + momentum).")
_WIDTH = flags.DEFINE_integer(
    "width", 1024, "Columns of the parameters; the step multiplies by a square of it."
)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Matrix products per step (sets the step time).")
_STEPS = flags.DEFINE_integer("steps", 3, "Steady steps timed per side.")
_QUICK = flags.DEFINE_bool("quick", False, "A 32 MiB state and a short step.")
_DIR = flags.DEFINE_string("dir", "", "Checkpoint folder (default: a temporary one, removed after).")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).resolve().parent / "results"), "Result folder.")

DEVICES = 2


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The peak RSS of this process while it is open, sampled every 5 ms."""

    def __init__(self) -> None:
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def _functions(rows: int, width: int, repeats: int):
    import jax
    import jax.numpy as jnp

    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "w": jax.random.normal(k1, (rows, width)) / width,
            "m": jnp.zeros((rows, width)),
            "mix": jax.random.normal(k2, (width, width)) / width,
        }

    def step(state):
        h = state["w"]
        for _ in range(repeats):
            h = jnp.tanh(h @ state["mix"])
        m = 0.9 * state["m"] + h
        w = state["w"] - 1e-3 * m
        return {"w": w, "m": m, "mix": state["mix"]}, jnp.mean(w * w)

    return init, step


def _side(train, state, directory: pathlib.Path, steps: int, restore) -> tuple[dict, object]:
    """The measurements of one side; ``restore(manager, abstract)`` restores and returns (state, step)."""
    import jax
    import orbax.checkpoint as ocp

    state, loss = train(state)  # compile
    float(loss)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, loss = train(state)
        float(loss)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    manager = ocp.CheckpointManager(directory)
    peak = _Peak()
    start = time.perf_counter()
    manager.save(0, args=ocp.args.StandardSave(state))
    blocked = time.perf_counter() - start
    state, loss = train(state)  # runs while the checkpoint is written
    float(loss)
    during = time.perf_counter() - start - blocked
    manager.wait_until_finished()
    total = time.perf_counter() - start
    growth = peak.close()
    manager.close()
    return {
        "step_s": step_s,
        "save_blocks_s": blocked,
        "save_blocks_over_step": blocked / step_s,
        "step_during_save_s": during,
        "save_total_s": total,
        "rss_growth_bytes": growth,
    }, abstract


def _first_step(manager, abstract, train) -> float:
    import orbax.checkpoint as ocp

    start = time.perf_counter()
    restored = manager.restore(0, args=ocp.args.StandardRestore(abstract))
    _, loss = train(restored)
    float(loss)
    return time.perf_counter() - start


def _pathways(rows: int, directory: pathlib.Path, steps: int) -> dict:
    import jax
    import orbax.checkpoint as ocp

    import pathways_jax as pw

    init, step = _functions(rows, _WIDTH.value, _REPEATS.value)
    specs = {"w": pw.P("x"), "m": pw.P("x"), "mix": pw.P()}
    pw.init(backend="ray", hosts=4, devices_per_host=1, islands=2)
    try:
        s = pw.devices(mesh={"x": DEVICES}, island=0)
        state = pw.jit(init, devices=s, out_specs=specs)(jax.random.key(0))
        train = pw.jit(step, devices=s, out_specs=(specs, pw.P()), donate_argnums=0)
        result, abstract = _side(train, state, directory, steps, None)
        fetches = pw.counters()["fetches"]
        del state
    finally:
        pw.shutdown()
    # One island fewer: a cluster of 2 hosts as 1 island restores it onto its own mesh.
    pw.init(backend="ray", hosts=2, devices_per_host=1, islands=1)
    try:
        s = pw.devices(mesh={"y": DEVICES})
        train = pw.jit(step, devices=s, out_specs=({"w": pw.P("y"), "m": pw.P("y"), "mix": pw.P()}, pw.P()))
        target = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.sharding("y" if k != "mix" else None))
            for k, v in abstract.items()
        }
        with ocp.CheckpointManager(directory) as manager:
            result["first_step_after_restore_s"] = _first_step(manager, target, train)
        result["fetches_during_run"] = fetches
    finally:
        pw.shutdown()
    return result


def _plain(rows: int, directory: pathlib.Path, steps: int) -> dict:
    import jax
    import orbax.checkpoint as ocp

    init, step = _functions(rows, _WIDTH.value, _REPEATS.value)
    mesh = jax.sharding.Mesh(jax.devices()[:DEVICES], ("x",))
    named = {
        "w": jax.sharding.NamedSharding(mesh, jax.P("x")),
        "m": jax.sharding.NamedSharding(mesh, jax.P("x")),
        "mix": jax.sharding.NamedSharding(mesh, jax.P()),
    }
    state = jax.jit(init, out_shardings=named)(jax.random.key(0))
    train = jax.jit(step, out_shardings=(named, None), donate_argnums=0)
    result, abstract = _side(train, state, directory, steps, None)
    del state
    with ocp.CheckpointManager(directory) as manager:
        result["first_step_after_restore_s"] = _first_step(manager, abstract, train)
    return result


def _plot(record: dict, path: pathlib.Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    sides = ("plain_jax", "pathways_jax")
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(11, 3.2))
    left.bar(sides, [record[s]["save_blocks_over_step"] for s in sides])
    left.set_ylabel("save() blocks / step time")
    left.set_title("training loop blocked by a save")
    mid.bar(sides, [record[s]["rss_growth_bytes"] / record["state_bytes"] for s in sides])
    mid.set_ylabel("RSS growth / state bytes")
    mid.set_title("this process's memory during a save")
    right.bar(sides, [record[s]["first_step_after_restore_s"] / record[s]["step_s"] for s in sides])
    right.set_ylabel("first step after restore / step")
    right.set_title("restore (pw: onto 1 island of 2)")
    return common.save_figure(plt, fig, path)


def main(argv: list[str]) -> None:
    del argv
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    mib, repeats = (32, 1) if _QUICK.value else (_MIB.value, _REPEATS.value)
    flags.FLAGS.repeats = repeats
    width = _WIDTH.value
    rows = mib * 2**20 // (2 * 4 * width)  # two (rows, width) float32 arrays
    rows -= rows % DEVICES
    state_bytes = 2 * rows * width * 4 + width * width * 4
    root = pathlib.Path(_DIR.value) if _DIR.value else pathlib.Path(tempfile.mkdtemp(prefix="pw-ckpt-"))
    try:
        plain = _plain(rows, root / "plain", _STEPS.value)
        pathways = _pathways(rows, root / "pathways", _STEPS.value)
    finally:
        if not _DIR.value:
            shutil.rmtree(root, ignore_errors=True)
    record = {
        "machine": common.machine(),
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "state_bytes": state_bytes,
        "rows": rows,
        "width": width,
        "repeats": repeats,
        "plain_jax": plain,
        "pathways_jax": pathways,
        "blocks_ratio_pw_over_plain": pathways["save_blocks_over_step"] / plain["save_blocks_over_step"],
        "rss_growth_over_state": {
            "plain_jax": plain["rss_growth_bytes"] / state_bytes,
            "pathways_jax": pathways["rss_growth_bytes"] / state_bytes,
        },
    }
    for side in ("plain_jax", "pathways_jax"):
        r = record[side]
        print(
            f"{side}: step {r['step_s']:.2f} s; save blocks {r['save_blocks_s'] * 1e3:.1f} ms "
            f"({r['save_blocks_over_step']:.1%} of a step); step during the write {r['step_during_save_s']:.2f} s; "
            f"save total {r['save_total_s']:.2f} s; RSS +{r['rss_growth_bytes'] / 2**20:.1f} MiB "
            f"({r['rss_growth_bytes'] / state_bytes:.1%} of the {state_bytes / 2**20:.0f} MiB state); "
            f"first step after restore {r['first_step_after_restore_s']:.2f} s"
        )
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint.json").write_text(json.dumps(record, indent=2))
    plotted = _plot(record, out / "checkpoint.png")
    print(f"wrote {out / 'checkpoint.json'}" + (f" and {out / 'checkpoint.png'}" if plotted else ""))


if __name__ == "__main__":
    app.run(main)
