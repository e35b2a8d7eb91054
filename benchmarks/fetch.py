"""A tiny fetch's round trip: a Ray actor call against pathways_jax's hosts and its service.

Side by side in one run (one local Ray cluster, ``ray.init(num_cpus=4)``), a
256-byte value already computed and read again and again (median of
``--n`` reads, in ``--rounds`` rounds that rotate the order):

  * ``ray-get``: the baseline: ``ray.get(actor.value.remote())`` on a plain
    Ray actor holding the numpy array;
  * ``pw-hosts``: this process's own Ray host (``pw.init(backend="ray",
    hosts=1)``): the backend's fetch of the value, controller -> host ->
    controller over the channel;
  * ``pw-service``: a client process of a controller service
    (``pw.serve(..., hosts=1)``, a subprocess joined with ``pw.init(service=...)``):
    the service checks the handle and the host sends the value straight to the
    client's channel (client -> service -> host -> client).

Each read is the ``fetch`` of the value's handle by what holds it (the
backend's dispatcher), as ``.result()`` does the first time (``.result()`` keeps the value it read). Results to
``benchmarks/results/fetch.json`` and ``fetch.png``; ratios to ``ray-get`` printed.

  python benchmarks/fetch.py            # about a minute, most of it Ray's start
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import common
import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SERVICE = "fetch-bench"


def _reads(n: int) -> list[float]:
    """``n`` fetches of one computed 256-byte value through this process's Ray backend (seconds each)."""
    import jax.numpy as jnp

    import pathways_jax as pw

    value = pw.jit(lambda: jnp.arange(64, dtype=jnp.float32) * 2.0, devices=pw.devices(mesh={"x": 1}))()
    value.block_until_ready()
    remote = value._entry.array  # the RemoteArray: the handle of the value on its host
    holder = remote.backend  # what holds the value on the hosts and fetches it
    times = []
    for _ in range(n):
        start = time.perf_counter()
        got = holder.fetch(remote.hosts, remote.key, remote.generation)
        times.append(time.perf_counter() - start)
    assert np.array_equal(np.asarray(got), np.arange(64, dtype=np.float32) * 2.0)
    return times


def child(address: str, n: int, rounds: int) -> None:
    """A client process of the service: its reads, one JSON line per round."""
    import pathways_jax as pw

    pw.init(backend="ray", address=address, service=SERVICE, client_name=f"fetch-{os.getpid()}")
    try:
        for _ in range(rounds):
            print(json.dumps(_reads(n)), flush=True)
            if sys.stdin.readline().strip() != "go":
                break
    finally:
        pw.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="reads per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.n, args.rounds)
        return
    import ray

    import pathways_jax as pw

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Holder:
        def __init__(self):
            self.array = np.arange(64, dtype=np.float32) * 2.0

        def value(self):
            return self.array

    holder = Holder.remote()
    ray.get(holder.value.remote())

    def ray_reads(n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            ray.get(holder.value.remote())
            times.append(time.perf_counter() - start)
        return times

    svc = pw.serve(SERVICE, hosts=1)
    pw.init(backend="ray", hosts=1)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", svc.address, "--n", str(args.n), "--rounds", str(args.rounds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    samples: dict[str, list[float]] = {"ray-get": [], "pw-hosts": [], "pw-service": []}
    try:
        order = ["ray-get", "pw-hosts", "pw-service"]
        for r in range(args.rounds):
            for mode in order[r % 3 :] + order[: r % 3]:
                if mode == "ray-get":
                    times = ray_reads(args.n)
                elif mode == "pw-hosts":
                    times = _reads(args.n)
                else:
                    if r:
                        proc.stdin.write("go\n")
                        proc.stdin.flush()
                    times = json.loads(proc.stdout.readline())
                samples[mode].append(statistics.median(times))
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        pw.shutdown()
        svc.stop()
        ray.shutdown()
    result = {
        "machine": common.machine(),
        "n": args.n,
        "rounds": args.rounds,
        "modes": {
            mode: {"median_us": statistics.median(v) * 1e6, "rounds_us": [x * 1e6 for x in v]}
            for mode, v in samples.items()
        },
        "ratio_to_ray_get": {
            mode: statistics.median(a / b for a, b in zip(v, samples["ray-get"], strict=True))
            for mode, v in samples.items()
        },
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fetch.json").write_text(json.dumps(result, indent=1))
    for mode, row in result["modes"].items():
        print(
            f"{mode:>11}: {row['median_us']:7.0f} µs a read  ({result['ratio_to_ray_get'][mode]:.2f}x ray-get's time)"
        )
    plt = common.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3))
        modes = list(result["modes"])
        ax.bar(modes, [result["modes"][m]["median_us"] for m in modes], color=["#888", "#3a7", "#37a"])
        ax.axhline(200, color="k", linestyle=":", linewidth=1, label="target: 200 µs")
        ax.set_ylabel("µs a read (median)")
        ax.set_title("A 256-byte fetch's round trip")
        ax.legend()
        common.save_figure(plt, fig, RESULTS / "fetch.png")


if __name__ == "__main__":
    main()
