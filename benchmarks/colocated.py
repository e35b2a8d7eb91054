"""Colocated Python on the Ray hosts: input iterators on the hosts against the same work done here.

Side by side in one run (one local Ray cluster, 4 host actors of one device
forming one island, ``ray.init(num_cpus=4)``):

  * ``iterator``: batches/s of the example's per-host iterator
    (``examples/host_input.py``: 4 shards of a global batch) as a
    ``pw.colocated_python.HostIterator`` on the 4 hosts (each batch a global
    array on the hosts' devices, the last one waited for) against the same
    iterator run here for all 4 shards, numpy only (the target's figure), and
    with each shard put on one of this process's devices as a local loop
    would; steady state (the iterators made and started first), rounds
    alternated, the median ratio; with the CPU each side spends per batch
    (the hosts' processes, this one) and the batches/s that CPU allows the
    hosts' side on this machine's cores (its bound where all share them);
  * ``call``: one colocated call with a small input (a 16-float array on one
    host), round trip (call, then wait for its output on the host), median of
    ``--n`` calls, against a plain Ray actor call of the same function
    (``ray.get(actor.f.remote(x))``); the call's own cost (until it returns
    its futures) is reported too;
  * ``bytes``: bytes of input data this process sent to the hosts per training
    step (the fed values' blobs, counted where the channel encodes them);
  * ``step``: a data-parallel training step (the example's linear model) fed by
    the host iterators against the same step fed from here, a batch of
    ``--batch`` rows (2 MB at the default).

Results to ``benchmarks/results/colocated.json`` and ``colocated.png``.

  python benchmarks/colocated.py            # about a minute, most of it Ray's start
  python benchmarks/colocated.py --quick    # fewer repetitions
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 4)

import common  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from host_input import FEATURES, Batches, make_rows  # noqa: E402

import pathways_jax as pw  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


class _FedBytes:
    """Bytes of fed values (data sent with a message) this process encodes for the hosts."""

    def __init__(self) -> None:
        from pathways_jax._src.backends import channel_link

        self.total = 0
        real = channel_link._feed

        def counted(slot, kind, payload):
            feed = real(slot, kind, payload)
            if feed.data is not None:
                self.total += len(feed.data)
            return feed

        channel_link._feed = counted


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def _iterator(batch: int, n: int, rounds: int, spec, host_pids: list[int]) -> dict:
    """Steady-state batches/s of the host iterators and of the same iterators here, rounds alternated.

    Also the CPU each side spends per batch (the hosts', this process's), and so the most batches/s
    the machine's cores allow the hosts' side: its bound on a machine its processes share.
    """
    batches = pw.colocated_python.HostIterator(lambda shard: Batches(shard, batch), spec)
    jax.block_until_ready(next(batches))  # the hosts' objects made, the iterators started
    shards = [Batches(pw.colocated_python.Shard(h, 4), batch) for h in range(4)]
    devices = jax.local_devices()[:4]  # this process's own 4 CPU devices, for a local loop's batches

    def on_devices(parts: list[dict]) -> dict:
        """The global batch on this process's devices, one shard each (what a local loop feeds)."""
        out = {}
        for name in ("x", "y"):
            shape = (batch, *parts[0][name].shape[1:])
            sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)), jax.P("d"))
            pieces = [jax.device_put(p[name], d) for p, d in zip(parts, devices, strict=True)]
            out[name] = jax.make_array_from_single_device_arrays(shape, sharding, pieces)
        return out

    hosts, here, here_put = [], [], []
    cpu = {"hosts": 0.0, "controller": 0.0, "here": 0.0}
    for _ in range(rounds):
        start, hosts_cpu, own_cpu = time.perf_counter(), _cpu_s(host_pids), time.process_time()
        for _ in range(n):
            last = next(batches)
        jax.tree.map(lambda f: f.block_until_ready(), last)
        hosts.append(n / (time.perf_counter() - start))
        cpu["hosts"] += _cpu_s(host_pids) - hosts_cpu
        cpu["controller"] += time.process_time() - own_cpu
        start, own_cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            [next(shard) for shard in shards]
        here.append(n / (time.perf_counter() - start))
        cpu["here"] += time.process_time() - own_cpu
        start = time.perf_counter()
        for _ in range(n):
            local = on_devices([next(shard) for shard in shards])
        jax.block_until_ready(local)
        here_put.append(n / (time.perf_counter() - start))
    ratios = [h / m for h, m in zip(hosts, here, strict=True)]
    ratios_put = [h / m for h, m in zip(hosts, here_put, strict=True)]
    per_batch = {side: seconds / (n * rounds) * 1e3 for side, seconds in cpu.items()}
    cores = os.cpu_count() or 1
    bound = cores / ((per_batch["hosts"] + per_batch["controller"]) / 1e3)  # all cores busy, nothing else
    return {
        "cpu_ms_per_batch": per_batch,
        "hosts_bound_batches_per_s": bound,
        "hosts_share_of_bound": statistics.median(hosts) / bound,
        "hosts_batches_per_s": statistics.median(hosts),
        "here_batches_per_s": statistics.median(here),
        "here_on_devices_batches_per_s": statistics.median(here_put),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "ratio_to_here_on_devices": statistics.median(ratios_put),
        "batches_per_round": n,
    }


def _call(n: int, s) -> dict:
    import ray

    x = jax.device_put(np.arange(16, dtype=np.float32), s.sharding(None))
    on_host = pw.jit(lambda v: v + 0, devices=s)(x)  # a value already on the host

    def add_one(v):
        return v + 1

    f = pw.colocated_python.colocated_python(add_one).specialize(
        out_specs_fn=lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
    )
    f(on_host).block_until_ready()
    issue, round_trip = [], []
    for _ in range(n):
        start = time.perf_counter()
        out = f(on_host)
        issue.append(time.perf_counter() - start)
        out.block_until_ready()
        round_trip.append(time.perf_counter() - start)

    @ray.remote(num_cpus=0)
    class Plain:
        def f(self, v):
            return v + 1

    actor = Plain.remote()
    data = np.arange(16, dtype=np.float32)
    ray.get(actor.f.remote(data))
    plain = []
    for _ in range(n):
        start = time.perf_counter()
        ray.get(actor.f.remote(data))
        plain.append(time.perf_counter() - start)
    ray.kill(actor)
    return {
        "pw_issue_ms": statistics.median(issue) * 1e3,
        "pw_round_trip_ms": statistics.median(round_trip) * 1e3,
        "ray_actor_call_ms": statistics.median(plain) * 1e3,
        "ratio_round_trip": statistics.median(round_trip) / statistics.median(plain),
    }


def _steps(batch: int, steps: int, s, spec, fed: _FedBytes) -> dict:
    import jax.numpy as jnp

    @pw.jit(devices=s, out_specs=pw.P())
    def train_step(params, b):
        def loss(p):
            return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value

    def controller_batch(step):
        parts = [make_rows(step, h * (batch // 4), batch // 4) for h in range(4)]
        return {"x": np.concatenate([x for x, _ in parts]), "y": np.concatenate([y for _, y in parts])}

    out = {}
    for mode in ("host-fed", "controller-fed") * 2:  # twice each, alternating: the second counts
        params = {"w": jnp.zeros(FEATURES), "b": jnp.zeros(())}
        batches = pw.colocated_python.HostIterator(lambda shard: Batches(shard, batch), spec)

        def next_batch(step, mode=mode, batches=batches):
            return next(batches) if mode == "host-fed" else controller_batch(step)

        params, loss = train_step(params, next_batch(0))
        loss.result()
        before = fed.total
        start = time.perf_counter()
        for step in range(1, steps):
            params, loss = train_step(params, next_batch(step))
        loss.result()
        out[mode] = {
            "ms_per_step": (time.perf_counter() - start) / (steps - 1) * 1e3,
            "input_bytes_per_step": (fed.total - before) / (steps - 1),
        }
    out["ratio_controller_over_host"] = out["controller-fed"]["ms_per_step"] / out["host-fed"]["ms_per_step"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=8192, help="global batch rows (65 floats a row)")
    args = parser.parse_args()
    n, steps = (50, 10) if args.quick else (300, 30)

    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    fed = _FedBytes()
    cluster = pw.init(backend="ray", hosts=4, devices_per_host=1, islands=1)
    host_pids = [cluster.backend.info[h]["pid"] for h in range(4)]
    s = pw.devices(mesh={"data": 4})
    spec = {
        "x": jax.ShapeDtypeStruct((args.batch, FEATURES), np.float32, sharding=s.sharding("data")),
        "y": jax.ShapeDtypeStruct((args.batch,), np.float32, sharding=s.sharding("data")),
    }
    results = {
        "machine": common.machine(),
        "batch_rows": args.batch,
        "batch_bytes": args.batch * (FEATURES + 1) * 4,
        "iterator": _iterator(args.batch, n // 2, 3 if args.quick else 5, spec, host_pids),
        "step": _steps(args.batch, steps, s, spec, fed),
    }
    s.release()
    single = pw.devices(mesh={"x": 1})
    results["call"] = _call(n, single)
    pw.shutdown()
    ray.shutdown()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "colocated.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=2))
    plt = common.pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        it = results["iterator"]
        axes[0].bar(["here", "4 hosts"], [it["here_batches_per_s"], it["hosts_batches_per_s"]])
        axes[0].set_title(f"iterator batches/s ({it['ratio']:.2f}x)")
        c = results["call"]
        axes[1].bar(
            ["ray actor call", "colocated call", "(its issue)"],
            [c["ray_actor_call_ms"], c["pw_round_trip_ms"], c["pw_issue_ms"]],
        )
        axes[1].set_title("one call, small input (ms)")
        st = results["step"]
        axes[2].bar(
            ["controller-fed", "host-fed"],
            [st["controller-fed"]["ms_per_step"], st["host-fed"]["ms_per_step"]],
        )
        axes[2].set_title(f"train step ms ({st['ratio_controller_over_host']:.2f}x)")
        common.save_figure(plt, fig, RESULTS / "colocated.png")


if __name__ == "__main__":
    main()
