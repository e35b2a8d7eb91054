"""Elastic data parallelism: training through host kills, against the same training undisturbed.

Four Ray hosts, one device each, are four islands; a ``pipeline.DataParallel``
MLP keeps one replica on each. Modes, each in one run on the same cluster:

  plain     ``dp.train_step`` in a loop, no manager, no kills: the baseline steps/s
  elastic   the same loop through ``pw.elastic.Manager``, no kills: its cost
  kills     the managed loop while ``pw.faults`` kills a replica's host --kills
            times at random steps (seeded), each once the manager has its
            replicas back (the island rebuilt and rejoined): a kill now
            (``kill_host(h)``, which returns once the host is dead) at a random
            step, or in the middle of the next run (``at_run=1``), alternately

What is measured: for each kill now, the seconds from the host's death to the
next completed step (detection, the survivors' programs traced and compiled
for fewer replicas, the spoiled steps run again); the largest relative
difference of any step's loss, and of the final parameters, from plain JAX
applying every step taken exactly once with the same replica count at each
step (a step lost or applied twice shows there as a difference of order 1e-3
or more, from that step on); whether the replicas are bit-identical at the
end; hangs (any wait past --timeout_s fails the run). Results go to
benchmarks/results/elastic.json and elastic.png.

  python benchmarks/elastic.py                # 6 kills, about 2 minutes
  python benchmarks/elastic.py --kills 100    # the soak
  python benchmarks/elastic.py --quick        # 1 kill, used by nothing in CI
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
import random
import statistics
import time

import common
from absl import app, flags

_KILLS = flags.DEFINE_integer("kills", 6, "Host kills in the kills mode.")
_STEPS = flags.DEFINE_integer("steps", 60, "Steps of the plain and elastic modes.")
_GAP = flags.DEFINE_integer("gap", 6, "Steps between a rejoin and the next kill, at least.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Hidden width of the MLP.")
_TIMEOUT_S = flags.DEFINE_float(
    "timeout_s", 180.0, "Longest any wait may take before the run fails (a hang)."
)
_WINDOW = flags.DEFINE_integer("window", 8, "The manager's window (pw.elastic.Manager(window=...)).")
_QUICK = flags.DEFINE_bool("quick", False, "One kill, few steps.")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).resolve().parent / "results"), "Result folder.")

HOSTS = 4
BATCH = 48  # splits evenly over 2, 3 and 4 replicas
FEATURES = 32


def _model():
    import jax
    import jax.numpy as jnp

    hidden = _HIDDEN.value
    params = {
        "w1": jax.random.normal(jax.random.key(0), (FEATURES, hidden)) / FEATURES**0.5,
        "w2": jax.random.normal(jax.random.key(1), (hidden, 4)) / hidden**0.5,
    }

    def apply(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    def loss_fn(out, y):
        return jnp.mean((out - y) ** 2)

    return params, apply, loss_fn


def _batch(step: int):
    import numpy as np

    rng = np.random.default_rng(step)
    return rng.normal(size=(BATCH, FEATURES)).astype(np.float32), rng.normal(size=(BATCH, 4)).astype(
        np.float32
    )


def _dp():
    import optax

    import pathways_jax as pw
    from pathways_jax import pipeline

    params, apply, loss_fn = _model()
    slices = [pw.devices(mesh={"data": 1}, island=i) for i in range(HOSTS)]
    return pipeline.DataParallel((params, apply), slices, loss_fn=loss_fn, optimizer=optax.adam(1e-3))


def _steps_per_s(step, steps: int) -> float:
    for s in range(3):  # warm up: trace and compile
        float(step(*_batch(s)))
    start = time.perf_counter()
    loss = None
    for s in range(steps):
        loss = step(*_batch(s))
    float(loss)
    return steps / (time.perf_counter() - start)


def _reference(steps: int, counts: list[int]):
    """Plain jax.jit: step s averages counts[s] equal shards' gradients, as DataParallel does."""
    import jax
    import jax.numpy as jnp
    import optax

    params, apply, loss_fn = _model()
    tx = optax.adam(1e-3)

    @functools.partial(jax.jit, static_argnums=4)
    def step(p, o, x, y, k):
        results = [
            jax.value_and_grad(lambda p, xi=xi, yi=yi: loss_fn(apply(p, xi), yi))(p)
            for xi, yi in zip(jnp.split(x, k), jnp.split(y, k), strict=True)
        ]
        total = results[0][1]
        for _, g in results[1:]:
            total = jax.tree.map(jnp.add, total, g)
        updates, o = tx.update(jax.tree.map(lambda g: g / k, total), o, p)
        losses = [loss for loss, _ in results]
        return optax.apply_updates(p, updates), o, sum(losses[1:], losses[0]) / k

    o = tx.init(params)
    losses = []
    for s in range(steps):
        params, o, loss = step(params, o, *_batch(s), counts[s])
        losses.append(float(loss))
    return params, losses


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"hang: {what} within {timeout}s")
        time.sleep(0.05)


def _kills(kills: int) -> dict:
    import jax
    import numpy as np

    import pathways_jax as pw

    cluster = pw.cluster()
    dp = _dp()
    manager = pw.elastic.Manager(dp, minimum_islands=2, window=_WINDOW.value)
    rng = random.Random(0)
    timeout = _TIMEOUT_S.value
    losses, recoveries, kinds = [], [], []
    step = 0

    def train(count: int) -> None:
        nonlocal step
        for _ in range(count):
            losses.append(manager.train_step(*_batch(step)))
            step += 1

    train(3)
    manager.wait(timeout)
    for kill in range(kills):
        train(rng.randint(1, _GAP.value))
        victim = rng.randrange(1, HOSTS)  # host h is island h
        now = kill % 2 == 0
        kinds.append("now" if now else "mid-run")
        if now:
            pw.faults.kill_host(victim, timeout=timeout)
            dead = time.monotonic()
            loss = manager.train_step(*_batch(step))
            losses.append(loss)
            step += 1
            loss.result(timeout)
            recoveries.append(time.monotonic() - dead)
        else:
            pw.faults.kill_host(victim, at_run=1, timeout=timeout)
            train(2)
        manager.wait(timeout)
        _wait(lambda: not cluster.resources.lost, timeout, f"island rebuilt after kill {kill}")
        train(1)  # the step boundary at which the island rejoins
        manager.wait(timeout)
        if len(manager.islands) != HOSTS:
            raise RuntimeError(f"after kill {kill} the replicas are on {manager.islands}")
        print(
            f"kill {kill + 1}/{kills} ({kinds[-1]}, host {victim}) at step {step}: events {len(manager.events)}"
        )
    train(3)
    manager.wait(timeout)
    counts = [HOSTS] * step
    for event in manager.events:
        for s in range(event.step, step):
            counts[s] = len(event.islands)
    got = [float(loss.result(timeout)) for loss in losses]
    want_params, want = _reference(step, counts)
    replicas = [jax.tree.map(lambda f: np.asarray(f.result(timeout)), p) for p in dp.params_per_island]
    identical = all(
        all(np.array_equal(replicas[0][k], other[k]) for k in replicas[0]) for other in replicas[1:]
    )
    params_diff = max(
        float(
            np.max(
                np.abs(replicas[0][k] - np.asarray(want_params[k]))
                / (np.abs(np.asarray(want_params[k])) + 1e-6)
            )
        )
        for k in replicas[0]
    )
    return {
        "kills": kills,
        "kinds": kinds,
        "steps_taken": manager.step,
        "events": [e._asdict() for e in manager.events],
        "recovery_s": recoveries,
        "recovery_s_median": statistics.median(recoveries) if recoveries else None,
        "recovery_s_max": max(recoveries) if recoveries else None,
        "loss_max_rel_diff": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want, strict=True)),
        "params_max_rel_diff": params_diff,
        "replicas_bit_identical": identical,
        "losses": got,
        "replica_counts": counts,
    }


def run(kills: int, steps: int) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", HOSTS)
    import pathways_jax as pw

    pw.init(backend="ray", hosts=HOSTS, devices_per_host=1)
    try:
        plain_dp = _dp()
        managed = pw.elastic.Manager(_dp(), window=_WINDOW.value)
        plain = elastic = None
        plains, elastics = [], []
        for r in range(2):  # interleaved: plain, elastic, elastic, plain
            order = (("plain", plain_dp.train_step), ("elastic", managed.train_step))
            for name, step in order if r % 2 == 0 else order[::-1]:
                (plains if name == "plain" else elastics).append(_steps_per_s(step, steps))
        plain, elastic = statistics.median(plains), statistics.median(elastics)
        for slice_ in plain_dp.slices + managed.model.slices:
            slice_.release()
        return {
            "plain_steps_per_s": plain,
            "elastic_steps_per_s": elastic,
            "elastic_over_plain": elastic / plain,
            "kills": _kills(kills),
        }
    finally:
        pw.shutdown()


def _plot(results: dict, path: pathlib.Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    kills = results["kills"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.plot(kills["losses"], label="pw.elastic, with kills")
    for event in kills["events"]:
        left.axvline(event["step"], color="red" if event["kind"] == "lost" else "green", linewidth=0.6)
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.set_title(f"{kills['kills']} kills; red: lost, green: rejoined")
    right.bar(range(len(kills["recovery_s"])), kills["recovery_s"])
    right.set_xlabel("kill (host killed now)")
    right.set_ylabel("s from death to next completed step")
    right.set_title(f"elastic / plain steps/s: {results['elastic_over_plain']:.2f}x")
    return common.save_figure(plt, fig, path)


def main(argv: list[str]) -> None:
    del argv
    kills = 1 if _QUICK.value else _KILLS.value
    steps = 10 if _QUICK.value else _STEPS.value
    results = run(kills, steps)
    record = {
        "machine": common.machine(),
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hosts": HOSTS,
        "batch": BATCH,
        "hidden": _HIDDEN.value,
        "window": _WINDOW.value,
        **results,
    }
    k = results["kills"]
    print(
        f"plain {results['plain_steps_per_s']:.1f} steps/s, elastic {results['elastic_steps_per_s']:.1f} "
        f"({results['elastic_over_plain']:.2f}x); {k['kills']} kills: recovery median "
        f"{k['recovery_s_median']} s, max {k['recovery_s_max']} s; {k['steps_taken']} steps; "
        f"loss max rel diff {k['loss_max_rel_diff']:.2e}; params {k['params_max_rel_diff']:.2e}; "
        f"replicas identical {k['replicas_bit_identical']}"
    )
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "elastic.json").write_text(json.dumps(record, indent=2))
    plotted = _plot(results, out / "elastic.png")
    print(f"wrote {out / 'elastic.json'}" + (f" and {out / 'elastic.png'}" if plotted else ""))


if __name__ == "__main__":
    app.run(main)
