"""How many cross-process collective programs XLA:CPU holds in flight before it deadlocks.

The Ray backend bounds each host of a multi-host island at ``CROSS_HOST_WINDOW``
executables in flight (``pathways_jax/_src/backends/ray.py``), because
asynchronously dispatched collective programs that span processes deadlock
XLA's CPU runtime beyond some count. This measures that count without
pathways_jax: plain ``jax.distributed`` processes (Ray actors), each running
the same program, as multi-controller JAX does.

One *program* is a jitted ``shard_map`` scalar all-reduce over the global mesh
(every device of every process) followed by a scalar add (``_all_reduce_add``
in ``dispatch.py``); ``--collectives C`` puts C of them, one after the other,
in one program. For a layout of P processes x D devices and each K of
``--ks``, in increasing order:

  1. P fresh Ray actors (a deadlocked process is poisoned: it is killed, not
     reused) join one ``jax.distributed`` system, compile the program and run
     it once (warm-up, blocked on);
  2. every actor, at once, dispatches K programs without waiting (``--feed``:
     ``chained``, each fed the previous output; ``independent``, each fed the
     same input), then blocks on all of them;
  3. the driver waits ``--timeout_s`` for every actor: a timeout is a
     deadlock, and the actors are killed (SIGKILL).

After the first K that hangs, ``--bisect`` more probes halve the gap between
the largest K that completed and the smallest that hung. Higher Ks are not
tried. Results: per layout and feed, the largest K completed and the smallest
hung, to ``benchmarks/results/inflight_bound.json`` and ``inflight_bound.png``.

  python benchmarks/inflight_bound.py                       # 2x1, 2x2, 4x1 (a few minutes)
  python benchmarks/inflight_bound.py --layouts 2x2 --ks 16,32,48
  python benchmarks/inflight_bound.py --layouts 4x2 --merge   # add a layout to the existing JSON
  python benchmarks/inflight_bound.py --layouts 2x2 --collectives 4 --ks 4,8,12,16,24,32 --merge
"""

from __future__ import annotations

import json
import pathlib
import time
import warnings

import common
from absl import app, flags

_LAYOUTS = flags.DEFINE_list("layouts", ["2x1", "2x2", "4x1"], "Layouts PROCESSESxDEVICES to measure.")
_KS = flags.DEFINE_list(
    "ks", ["8", "16", "24", "32", "40", "48", "64", "96", "128", "192", "256"], "Programs in flight to try."
)
_FEEDS = flags.DEFINE_list("feeds", ["chained"], "chained (each fed the previous output) and/or independent.")
_TIMEOUT = flags.DEFINE_float(
    "timeout_s", 20.0, "Seconds after which a dispatched batch counts as deadlocked."
)
_BISECT = flags.DEFINE_integer("bisect", 2, "Probes between the largest K completed and the smallest hung.")
_COLLECTIVES = flags.DEFINE_integer(
    "collectives",
    1,
    "All-reduces in one program, each reading the previous (results labelled by it when > 1).",
)
_MERGE = flags.DEFINE_bool(
    "merge", False, "Keep the layouts of an existing inflight_bound.json that this run does not measure."
)
_WINDOW = flags.DEFINE_integer(
    "runtime_window", 16, "The runtime's bound (CROSS_HOST_WINDOW), for the report."
)
_OUT = flags.DEFINE_string(
    "out", str(pathlib.Path(__file__).resolve().parent / "results"), "Where results go."
)

_START_TIMEOUT_S = 120.0


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

    def setup(self, coordinator: str, processes: int, rank: int, devices: int, collectives: int) -> int:
        """Joins the system (every member must be in here at once); compiles and warms the program."""
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
        jax.distributed.initialize(coordinator, processes, rank)
        every = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = jax.sharding.Mesh(np.array(every), ("x",))
        n = len(every)

        def program(x):
            for _ in range(collectives):  # each all-reduce reads the previous one's result
                total = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P(), out_specs=P())(
                    x
                )
                x = total * (1.0 / n) + 1.0
            return x

        self._jax = jax
        self._step = jax.jit(program)
        value = np.zeros((), np.float32)
        self._x0 = jax.make_array_from_callback((), NamedSharding(mesh, P()), lambda index: value[index])
        self._step(self._x0).block_until_ready()
        return n

    def run(self, k: int, feed: str) -> dict:
        """Dispatches ``k`` programs without waiting, then blocks on them all."""
        start = time.perf_counter()
        outs = []
        x = self._x0
        for _ in range(k):
            x = self._step(x if feed == "chained" else self._x0)
            outs.append(x)
        dispatched = time.perf_counter() - start
        self._jax.block_until_ready(outs)
        return {"dispatch_s": dispatched, "total_s": time.perf_counter() - start}


def _probe(ray, processes: int, devices: int, k: int, feed: str, timeout_s: float, collectives: int) -> dict:
    """One K on fresh actors: {"ok": bool, ...}. The actors are killed either way."""
    cls = ray.remote(num_cpus=0, max_restarts=0)(_Member)
    actors = [cls.remote() for _ in range(processes)]
    try:
        coordinator = ray.get(actors[0].address.remote(), timeout=_START_TIMEOUT_S)
        ray.get(
            [a.setup.remote(coordinator, processes, r, devices, collectives) for r, a in enumerate(actors)],
            timeout=_START_TIMEOUT_S,
        )
        start = time.perf_counter()
        pending = [a.run.remote(k, feed) for a in actors]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        waited = time.perf_counter() - start
        if len(ready) < len(pending):
            return {"k": k, "ok": False, "waited_s": waited, "finished_members": len(ready)}
        timings = ray.get(pending)
        return {
            "k": k,
            "ok": True,
            "dispatch_s": max(t["dispatch_s"] for t in timings),
            "total_s": max(t["total_s"] for t in timings),
        }
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)  # SIGKILL: a deadlocked process does not come back


def _search(
    ray,
    processes: int,
    devices: int,
    feed: str,
    ks: list[int],
    timeout_s: float,
    bisect: int,
    collectives: int,
) -> dict:
    """Ks in increasing order until one hangs, then ``bisect`` probes between the last good and it."""
    probes = []

    def probe(k: int) -> bool:
        result = _probe(ray, processes, devices, k, feed, timeout_s, collectives)
        probes.append(result)
        state = (
            f"ok ({result['total_s'] * 1e3:.0f} ms, dispatch {result['dispatch_s'] * 1e3:.0f} ms)"
            if result["ok"]
            else "HUNG"
        )
        print(f"  {processes}x{devices} {feed} K={k}: {state}", flush=True)
        return result["ok"]

    good, bad = 0, None
    for k in ks:
        if probe(k):
            good = k
        else:
            bad = k
            break
    for _ in range(bisect if bad is not None else 0):
        if bad - good <= 1:
            break
        mid = (good + bad) // 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return {"largest_completed": good, "smallest_hung": bad, "probes": sorted(probes, key=lambda p: p["k"])}


def _plot(results: dict, window: int, path: pathlib.Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = [(layout, feed, r) for layout, by_feed in results.items() for feed, r in by_feed.items()]
    for i, (_, _, r) in enumerate(rows):
        for p in r["probes"]:
            ax.scatter(
                p["k"], i, marker="o" if p["ok"] else "x", s=50, color="tab:green" if p["ok"] else "tab:red"
            )
        if r["smallest_hung"] is not None:
            ax.annotate(
                f"completed {r['largest_completed']}, hung {r['smallest_hung']}",
                (r["smallest_hung"], i),
                textcoords="offset points",
                xytext=(8, 6),
                fontsize=8,
            )
    ax.axvline(window, ls="--", color="tab:blue", lw=1)
    ax.annotate(
        f"runtime bound {window}",
        (window, len(rows) - 0.5),
        xytext=(4, 0),
        textcoords="offset points",
        fontsize=8,
        color="tab:blue",
    )
    ax.set_yticks(range(len(rows)), [f"{layout} ({feed})" for layout, feed, _ in rows])
    ax.set_ylim(-0.5, len(rows) - 0.3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("collective programs dispatched before blocking (o completed, x deadlocked)")
    ax.set_title("XLA:CPU cross-process programs in flight (processes x devices)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    import ray

    layouts = [tuple(int(v) for v in layout.split("x")) for layout in _LAYOUTS.value]
    ks = sorted(int(k) for k in _KS.value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(
            address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    results: dict = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        for processes, devices in layouts:
            for feed in _FEEDS.value:
                r = _search(
                    ray, processes, devices, feed, ks, _TIMEOUT.value, _BISECT.value, _COLLECTIVES.value
                )
                label = feed if _COLLECTIVES.value == 1 else f"{feed}, {_COLLECTIVES.value} all-reduces"
                results.setdefault(f"{processes}x{devices}", {})[label] = r
    finally:
        ray.shutdown()
    out_dir = pathlib.Path(_OUT.value)
    path = out_dir / "inflight_bound.json"
    if _MERGE.value and path.exists():
        before = json.loads(path.read_text())["results"]
        for layout, by_feed in results.items():
            before.setdefault(layout, {}).update(by_feed)
        results = before
    hung = [
        r["smallest_hung"] for by_feed in results.values() for r in by_feed.values() if r["smallest_hung"]
    ]
    window = _WINDOW.value
    verdict = {
        "runtime_window": window,
        "smallest_hung_any_layout": min(hung) if hung else None,
        "window_at_most_half_of_smallest_hung": (2 * window <= min(hung)) if hung else None,
    }
    report = {
        "benchmark": "inflight_bound",
        "started": started,
        "config": {"ks": ks, "timeout_s": _TIMEOUT.value, "bisect": _BISECT.value, "ray": ray.__version__},
        "results": results,
        "verdict": verdict,
        "machine": common.machine(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    _plot(results, window, out_dir / "inflight_bound.png")
    print("| layout (processes x devices) | feed | largest K completed | smallest K hung |")
    print("|---|---|---:|---:|")
    for layout, by_feed in results.items():
        for feed, r in by_feed.items():
            hung_at = r["smallest_hung"] or f"none up to {r['largest_completed']}"
            print(f"| {layout} | {feed} | {r['largest_completed']} | {hung_at} |")
    print(f"verdict: {verdict}")
    print(f"wrote {out_dir / 'inflight_bound.json'} and {out_dir / 'inflight_bound.png'}")


if __name__ == "__main__":
    app.run(main)
