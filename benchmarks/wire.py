"""The wire package's channels against a Ray actor call: round trip, throughput, sender CPU.

Side by side in one run, the driver (a ``wire.Server``, as the controller) and
an echo peer in another process (a ``wire.Peer``, as a host, answering each
message from its receive thread):

  * **round trip**: send a tiny message (``Fetch``), wait for the answer
    (``Done``); over ipc and tcp. Ray: ``ray.get(actor.echo.remote(i))`` on a
    trivial actor (``ray.init(num_cpus=2)``).
  * **pipelined**: N messages with at most ``--window`` outstanding (answers
    read as they come); messages/s. ``send`` one at a time, and ``send_many``
    in batches of ``--batch``. Ray: N ``.remote()`` calls, then one ``ray.get``.
  * **sender CPU per message**: ``time.thread_time()`` of the sending thread
    over a burst of sends divided by their count (Ray: of the ``.remote()``
    calls); and the driver process's whole CPU (``time.process_time()``, its
    receive thread included) per round trip.
  * **hand-off**: what a send would add if it went through an inproc queue to
    an I/O thread instead of the caller taking a lock (both threads' CPU).

Results to ``benchmarks/results/wire.json`` and ``wire.png``; ratios printed.

  python benchmarks/wire.py                 # about a minute (Ray's start is most of it)
  python benchmarks/wire.py --noray --n 5000
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
import threading
import time

import common
import numpy as np
import zmq

from pathways_jax._src import wire

ECHO = """
import sys, threading
from pathways_jax._src.wire import Address, Done, Fetch, Peer
up, down, key = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
stop = threading.Event()
peer = None
def answer(received):
    match received.body:
        case Fetch(key=-1):
            stop.set()
        case Fetch():
            peer.send(Done(seq=received.seq))
        case _:
            pass
peer = Peer(Address(up, down), key, identity=b"echo", on_message=answer, heartbeat=None)
peer.send(Done(seq=0))
stop.wait(600)
peer.close()
"""


def _echo_peer(transport: str, key: bytes) -> tuple[wire.Server, subprocess.Popen]:
    server = wire.Server(key, transport=transport, heartbeat=None)
    process = subprocess.Popen(
        [sys.executable, "-c", ECHO, server.address.up, server.address.down, key.hex()],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    hello = server.recv(timeout=60)
    if hello is None:
        raise RuntimeError("the echo peer did not start")
    return server, process


def _round_trips(call, n: int) -> dict:
    """Wall seconds of each of ``n`` calls of ``call(i)``, the caller thread's and process's CPU."""
    for i in range(min(200, n)):  # warm-up
        call(i)
    walls = []
    thread0, process0 = time.thread_time(), time.process_time()
    for i in range(n):
        start = time.perf_counter()
        call(i)
        walls.append(time.perf_counter() - start)
    thread_cpu, process_cpu = time.thread_time() - thread0, time.process_time() - process0
    walls.sort()
    return {
        "median_us": statistics.median(walls) * 1e6,
        "p90_us": walls[int(0.9 * n)] * 1e6,
        "mean_us": statistics.fmean(walls) * 1e6,
        "caller_cpu_us": thread_cpu / n * 1e6,
        "process_cpu_us": process_cpu / n * 1e6,
    }


def bench_wire(transport: str, n: int, window: int, batch: int) -> dict:
    key = secrets.token_bytes(32)
    server, process = _echo_peer(transport, key)
    try:

        def round_trip(i: int) -> None:
            server.send(b"echo", wire.Fetch(key=i))
            server.recv(timeout=10)

        def posted_round_trip(i: int) -> None:
            server.post(b"echo", wire.Fetch(key=i))  # nothing in progress: sent at once
            server.recv(timeout=10)

        result = {"round_trip": _round_trips(round_trip, n)}
        result["round_trip_post"] = _round_trips(posted_round_trip, n)

        # Pipelined, one message a send; at most `window` outstanding.
        start, sent, answered = time.perf_counter(), 0, 0
        send_cpu = 0.0
        while answered < n:
            burst = min(window - (sent - answered), n - sent)
            if burst > 0:
                t0 = time.thread_time()
                for i in range(sent, sent + burst):
                    server.send(b"echo", wire.Fetch(key=i))
                send_cpu += time.thread_time() - t0
                sent += burst
            server.recv(timeout=10)
            answered += 1
        seconds = time.perf_counter() - start
        result["pipelined"] = {"messages_per_s": n / seconds, "sender_cpu_us": send_cpu / n * 1e6}

        # Pipelined in batches of `batch` (one frame each), answers one message each.
        start, sent, answered, send_cpu = time.perf_counter(), 0, 0, 0.0
        while answered < n:
            if sent - answered + batch <= window and sent < n:
                count = min(batch, n - sent)
                t0 = time.thread_time()
                server.send_many(b"echo", [wire.Fetch(key=i) for i in range(sent, sent + count)])
                send_cpu += time.thread_time() - t0
                sent += count
                continue
            server.recv(timeout=10)
            answered += 1
        seconds = time.perf_counter() - start
        result["batched"] = {
            "batch": batch,
            "messages_per_s": n / seconds,
            "sender_cpu_us": send_cpu / n * 1e6,
        }
        # A 1 MiB numpy payload each way, out of band (no copy on the sender).
        payload = np.ones(1 << 17, np.float64)
        t0 = time.perf_counter()
        for i in range(50):
            server.send(b"echo", wire.Run(plan=0, run_id=i, base=0, feeds=wire.Blob(payload)))
        result["one_mib_send_us"] = (time.perf_counter() - t0) / 50 * 1e6
        result["refused"] = server.refused
        server.send(b"echo", wire.Fetch(key=-1))
        return result
    finally:
        process.wait(timeout=30)
        server.close()


def bench_handoff(n: int) -> dict:
    """CPU per message of a lock around the send, against a hand-off to an I/O thread (inproc)."""
    lock = threading.Lock()
    t0 = time.process_time()
    for _ in range(n):
        with lock:
            pass
    lock_us = (time.process_time() - t0) / n * 1e6
    context = zmq.Context()
    pull, push = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    pull.bind("inproc://handoff")
    push.connect("inproc://handoff")
    done = threading.Event()

    def io_thread() -> None:
        for _ in range(n):
            pull.recv()
        done.set()

    thread = threading.Thread(target=io_thread)
    t0 = time.process_time()
    thread.start()
    for _ in range(n):
        push.send(b"x" * 40)
    done.wait(60)
    handoff_us = (time.process_time() - t0) / n * 1e6
    thread.join()
    pull.close()
    push.close()
    context.term()
    return {"lock_cpu_us": lock_us, "inproc_handoff_cpu_us": handoff_us}


def bench_ray(n: int, window: int) -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Echo:
            def echo(self, x: int) -> int:
                return x

        actor = Echo.remote()  # type: ignore[attr-defined]
        ray.get(actor.echo.remote(0))
        count = max(200, n // 5)  # a Ray call costs ~1 ms: fewer of them
        result = {"round_trip": _round_trips(lambda i: ray.get(actor.echo.remote(i)), count)}
        start, submit_cpu, refs = time.perf_counter(), 0.0, []
        for begin in range(0, count, window):
            t0 = time.thread_time()
            refs = [actor.echo.remote(i) for i in range(begin, min(count, begin + window))]
            submit_cpu += time.thread_time() - t0
            ray.get(refs)
        seconds = time.perf_counter() - start
        result["pipelined"] = {"messages_per_s": count / seconds, "sender_cpu_us": submit_cpu / count * 1e6}
        result["calls"] = count
        return result
    finally:
        ray.shutdown()


def _plot(results: dict, path: pathlib.Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    names = list(results)
    batched = [k for k in names if "batched" in results[k]]
    piped = names + [f"{k}\nsend_many" for k in batched]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("round trip (median, µs)", names, [results[k]["round_trip"]["median_us"] for k in names], 200),
        (
            "pipelined (messages/s)",
            piped,
            [results[k]["pipelined"]["messages_per_s"] for k in names]
            + [results[k]["batched"]["messages_per_s"] for k in batched],
            None,
        ),
        (
            "sender CPU per message (µs)",
            piped,
            [results[k]["pipelined"]["sender_cpu_us"] for k in names]
            + [results[k]["batched"]["sender_cpu_us"] for k in batched],
            30,
        ),
    ]
    colours = {"wire-ipc": "tab:blue", "wire-tcp": "tab:cyan", "ray-actor": "tab:red"}
    for ax, (title, labels, values, target) in zip(axes, panels, strict=True):
        bars = ax.bar(labels, values, color=[colours.get(label.split("\n")[0], "gray") for label in labels])
        ax.bar_label(bars, fmt="%.3g")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", label="target")
            ax.legend()
    fig.suptitle("pathways_jax wire (ZeroMQ + msgspec, HMAC-signed) vs a Ray actor call, 2 processes")
    common.save_figure(plt, fig, path)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=10_000, help="Messages per measurement.")
    parser.add_argument("--window", type=int, default=500, help="Most messages outstanding when pipelined.")
    parser.add_argument("--batch", type=int, default=100, help="Messages per send_many.")
    parser.add_argument("--rounds", type=int, default=3, help="Alternated rounds of the wire runs.")
    parser.add_argument("--noray", action="store_true", help="Skip the Ray actor baseline.")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    rounds: dict[str, list[dict]] = {"wire-ipc": [], "wire-tcp": []}
    for _ in range(args.rounds):  # alternated: a busy machine slows both alike
        for name in rounds:
            rounds[name].append(bench_wire(name.removeprefix("wire-"), args.n, args.window, args.batch))
    results: dict[str, dict] = {}
    for name, runs in rounds.items():  # the round of the median round trip, with all rounds' figures
        runs_by_rt = sorted(runs, key=lambda r: r["round_trip"]["median_us"])
        results[name] = {**runs_by_rt[len(runs) // 2], "rounds": runs}
    handoff = bench_handoff(args.n * 10)
    if not args.noray:
        results["ray-actor"] = bench_ray(args.n, args.window)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "wire",
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": common.machine(),
        "args": vars(args),
        "targets": {"round_trip_us": 200, "sender_cpu_us": 30},
        "results": results,
        "send_path": handoff,
    }
    (out / "wire.json").write_text(json.dumps(report, indent=2))
    _plot(results, out / "wire.png")
    for name, r in results.items():
        rt, pipe = r["round_trip"], r["pipelined"]
        line = (
            f"{name:10s} round trip {rt['median_us']:7.1f} µs median (p90 {rt['p90_us']:.0f}),"
            f" caller CPU {rt['caller_cpu_us']:.1f} µs, process CPU {rt['process_cpu_us']:.1f} µs;"
            f" pipelined {pipe['messages_per_s']:9,.0f}/s, sender CPU {pipe['sender_cpu_us']:.1f} µs/msg"
        )
        if "round_trip_post" in r:
            line += f"; round trip by post {r['round_trip_post']['median_us']:.1f} µs"
        if "batched" in r:
            line += f"; batches of {r['batched']['batch']}: {r['batched']['messages_per_s']:,.0f}/s,"
            line += f" {r['batched']['sender_cpu_us']:.2f} µs/msg; 1 MiB send {r['one_mib_send_us']:.0f} µs"
        print(line)
    if "ray-actor" in results:
        ray = results["ray-actor"]
        for name in ("wire-ipc", "wire-tcp"):
            r = results[name]
            print(
                f"{name} vs ray-actor: round trip {ray['round_trip']['median_us'] / r['round_trip']['median_us']:.1f}x"
                f" faster, pipelined {r['pipelined']['messages_per_s'] / ray['pipelined']['messages_per_s']:.1f}x"
                f" more/s, sender CPU {ray['pipelined']['sender_cpu_us'] / r['pipelined']['sender_cpu_us']:.1f}x less"
            )
    print(
        f"send path: a lock {handoff['lock_cpu_us']:.2f} µs of CPU per send, an inproc hand-off to an I/O"
        f" thread {handoff['inproc_handoff_cpu_us']:.2f} µs (both threads)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
