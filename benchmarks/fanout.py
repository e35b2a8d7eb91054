"""A run's messages to many hosts: the controller's CPU, host by host against one broadcast.

The controller (a ``wire.Server``) sends every host its message of one run (a
``Run`` naming a registered plan, as ``channel_link.encode`` makes it), for 1
to 64 hosts, two ways side by side in one run:

  * **per host** (before): one ``send_many`` per host, one after another from
    the controller's thread (the loop ``RayBackend`` had);
  * **broadcast** (now): ONE ``Server.broadcast`` on the island's topic, every
    host's part in one signed frame that ZeroMQ's I/O thread copies to the
    island's subscribers; each host's message differs (a fed value per host);
  * **broadcast, SPMD**: the same, every host's message equal (an SPMD run's
    hosts read one sharded value): encoded once and carried once, as
    ``ChannelLink.send_group`` does.

Measured: the sending thread's CPU clock (``time.thread_time_ns``) around one
run's sends (its encoding included), the median of ``--runs`` runs per host
count and way, the two ways interleaved. The hosts are ``wire.Peer``\\ s in one
helper process (not Ray actors: too heavy for a 2-core machine), each
subscribed to the groups of the host counts it belongs to; each counts what it
gets and the counts are checked at the end (nothing lost). A straight line
through the medians gives each way's fixed cost per run and marginal cost per
host: the figures ``pw.sim`` takes (``hosts.message_s`` for per host,
``hosts.broadcast_s`` and ``hosts.broadcast_host_s`` for a broadcast).

Results to ``benchmarks/results/fanout.json`` and ``fanout.png``; the ratio
per host count printed.

  python benchmarks/fanout.py              # about a minute
  python benchmarks/fanout.py --runs 100 --hosts 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import secrets
import statistics
import subprocess
import sys
import time

import common
import numpy as np

from pathways_jax._src import wire
from pathways_jax._src.backends.channel_link import _encoded, encode

HOSTS = """
import sys, threading
from pathways_jax._src.wire import Address, Done, Fetch, Peer
up, down, key = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
counts = [int(c) for c in sys.argv[4].split(",")]
most = max(counts)
got = [0] * most
stopped = threading.Event()
lock = threading.Lock()
answered = []
peers = []
def handler(i):
    def on_message(received):
        match received.body:
            case Fetch(key=-1):
                peers[i].send(Done(seq=received.seq, value=float(got[i])))
                with lock:
                    answered.append(i)
                    if len(answered) == most:
                        stopped.set()
            case _:
                got[i] += 1
    return on_message
for i in range(most):
    groups = [b"n%d" % n for n in counts if i < n]
    peers.append(Peer(Address(up, down), key, identity=b"host-%d" % i, groups=groups,
                      on_message=handler(i), heartbeat=None, send_timeout=60))
for peer in peers:
    peer.send(Done(seq=0))
stopped.wait(600)
for peer in peers:
    peer.close()
"""


WAYS = ("per_host", "broadcast", "broadcast_spmd")


def _args(run_id: int, host: int | None) -> tuple:
    """A host's run message: the plan, a value fed from another run (the same on every host when
    ``host`` is None: an SPMD run's hosts read one sharded value), what to keep."""
    fed = 5 if host is None else 5 + host
    return (7, run_id, 1000 * run_id, [(0, "value", fed)], [(1, 100 + run_id)], [])


def measure(hosts: list[int], runs: int) -> dict:
    key = secrets.token_bytes(32)
    server = wire.Server(key, heartbeat=None, send_timeout=60)
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOSTS,
            server.address.up,
            server.address.down,
            key.hex(),
            ",".join(map(str, hosts)),
        ],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        names = [b"host-%d" % i for i in range(max(hosts))]
        for _ in names:  # every host said hello: it is connected
            if server.recv(timeout=120) is None:
                raise RuntimeError("the hosts did not start")
        sent = [0] * len(names)
        cpu: dict[str, dict[int, list[int]]] = {way: {h: [] for h in hosts} for way in WAYS}
        wall: dict[str, dict[int, list[int]]] = {way: {h: [] for h in hosts} for way in WAYS}
        run_id = 0
        for repeat in range(runs + 10):  # the first 10: warm-up
            for h in hosts:
                for way in WAYS if repeat % 2 else WAYS[::-1]:
                    run_id += 1
                    t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                    if way == "per_host":
                        for i in range(h):
                            server.send_many(names[i], [encode("run", _args(run_id, i))])
                    else:  # as ChannelLink.send_group: equal messages encoded (and sent) once
                        seen: list = []
                        spmd = way == "broadcast_spmd"
                        parts = {
                            names[i]: _encoded([(0, "run", _args(run_id, None if spmd else i))], seen)
                            for i in range(h)
                        }
                        server.broadcast(b"n%d" % h, parts)
                    t1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                    for i in range(h):
                        sent[i] += 1
                    if repeat >= 10:
                        cpu[way][h].append(t1 - t0)
                        wall[way][h].append(w1 - w0)
                    time.sleep(0.0005 * h)  # the hosts read: their pipes do not fill
        for name in names:
            server.send(name, wire.Fetch(key=-1))
        counted = {}
        for _ in names:
            answer = server.recv(timeout=60)
            assert answer is not None
            counted[answer.peer] = int(answer.body.value)
        lost = {n.decode(): sent[i] - counted[n] for i, n in enumerate(names) if counted[n] != sent[i]}
        if lost:
            raise RuntimeError(f"messages lost: {lost}")
        process.wait(timeout=60)
    finally:
        process.kill()
        process.wait()
        server.close()
    out: dict = {"hosts": hosts, "runs": runs}
    for way in WAYS:
        med = [statistics.median(cpu[way][h]) / 1e3 for h in hosts]
        q1 = [float(np.percentile(cpu[way][h], 25)) / 1e3 for h in hosts]
        q3 = [float(np.percentile(cpu[way][h], 75)) / 1e3 for h in hosts]
        slope, intercept = np.polyfit(hosts, med, 1)
        out[way] = {
            "cpu_us": med,
            "cpu_us_q1": q1,
            "cpu_us_q3": q3,
            "wall_us": [statistics.median(wall[way][h]) / 1e3 for h in hosts],
            "fixed_us": float(intercept),
            "per_host_us": float(slope),
        }
    for way, name in (("broadcast", "ratio"), ("broadcast_spmd", "ratio_spmd")):
        out[name] = {
            str(h): out["per_host"]["cpu_us"][i] / out[way]["cpu_us"][i] for i, h in enumerate(hosts)
        }
    return out


def _plot(report: dict, path: pathlib.Path) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    hosts = report["hosts"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for way, color, label in (
        ("per_host", "C3", "per host (before)"),
        ("broadcast", "C0", "one broadcast, parts differ"),
        ("broadcast_spmd", "C2", "one broadcast, equal parts (SPMD)"),
    ):
        r = report[way]
        ax.errorbar(
            hosts,
            r["cpu_us"],
            yerr=[np.subtract(r["cpu_us"], r["cpu_us_q1"]), np.subtract(r["cpu_us_q3"], r["cpu_us"])],
            fmt="o-",
            color=color,
            capsize=3,
            label=f"{label}: {r['fixed_us']:.0f} us + {r['per_host_us']:.1f} us/host",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hosts of the run")
    ax.set_ylabel("controller thread CPU per run (us)")
    ax.set_title("a run's messages to its hosts (median, quartiles)")
    ax.legend()
    return common.save_figure(plt, fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()
    started = time.time()
    report = {"benchmark": "fanout", "machine": common.machine(), **measure(args.hosts, args.runs)}
    report["seconds"] = round(time.time() - started, 1)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fanout.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "fanout.png")
    for i, h in enumerate(report["hosts"]):
        print(
            f"{h:3d} hosts: per host {report['per_host']['cpu_us'][i]:8.1f} us, "
            f"broadcast {report['broadcast']['cpu_us'][i]:7.1f} us ({report['ratio'][str(h)]:.1f}x), "
            f"SPMD {report['broadcast_spmd']['cpu_us'][i]:7.1f} us ({report['ratio_spmd'][str(h)]:.1f}x) CPU a run"
        )
    for way in WAYS:
        r = report[way]
        print(f"{way}: {r['fixed_us']:.1f} us + {r['per_host_us']:.2f} us a host")
    print(f"wrote {out / 'fanout.json'} and {out / 'fanout.png'} in {report['seconds']} s")


if __name__ == "__main__":
    main()
