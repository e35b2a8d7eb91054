"""The paper's multi-tenancy experiment: many clients sharing one slice through one controller.

A *program* is one ``pw.jit`` on a --slice-device slice: each device multiplies
its (m, m) block of ``x`` by ``w``, then ``sum(tanh(.))`` over the sharded rows
is an all-reduce across the slice. The matmul size m is calibrated at startup
with plain JAX so that a program costs about --compute_ms of device time when
programs run back to back (the measured figure is reported). Modes:

  jax-1      one plain-JAX thread running the programs sequentially (at most
             the controller's in-flight bound of them dispatched and not
             finished): the baseline
  pw-N       N client threads (N in --clients), each with its own
             ``pw.client``, all calling the same program on the same slice for
             --measure_s seconds, each keeping at most --window of its own
             futures in flight before it waits for the oldest
  bare-N     a floor for any single-controller design: N client threads hand
             each program to one plain-Python dispatcher thread (a queue; the
             dispatcher keeps the same in-flight bound and hands each output
             back through a lock) and wait as pw-N clients do. It has no
             scheduling policy, accounting, memory budget, object store or
             failure isolation: what is left is the hand-off itself
  jax-N      plain JAX with N threads calling the same collective program
             (N in --jax_threads), each dispatching its programs without
             waiting, as plain JAX code does; jax-N-wW: each thread waits for
             its oldest output once W are in flight (--jax_windows). Threads
             running SPMD collectives on the same CPU devices can deadlock in
             XLA's rendezvous (DESIGN §5), so each runs in a subprocess under
             --jax_timeout_s and the benchmark records what happened
  fair       a fresh cluster with ``scheduler="fair"``; one client per weight
             (--fair_weights, 1:2:4:8) submitting as fast as it can; each
             client's share of device time against its weight's share

jax-1, pw-N and bare-N repeats are interleaved (the mode order rotates each repeat);
figures are medians over repeats, a ratio is the median of per-repeat ratios to
jax-1 of the same repeat. Utilisation is ``pw.stats()`` (reset before each
measurement): busy time of each slice device over the wall time, averaged over
the slice's devices. Results go to benchmarks/results/multitenancy.json and .png.

  python benchmarks/multitenancy.py           # the full run (a few minutes)
  python benchmarks/multitenancy.py --quick   # well under a minute; used by the test suite
  python benchmarks/multitenancy.py --fair_only --slice 1   # the fair runs alone, on a 1-device slice
  python benchmarks/multitenancy.py --only_processes        # client processes against one service

--fair_only skips the throughput and plain-JAX modes and writes its shares to
results/multitenancy_fair_slice{N}.json, beside (not over) the full run's results.

--only_processes runs the process mode alone (multitenancy_processes.py): proc-N
is N client *processes* (N in --processes) joined to one controller service
(``pw.serve``, one host owning the slice's devices), all submitting the same
program for --measure_s seconds from one start, each keeping --window futures
in flight; jax-1 and pw-1 (one client thread on the local backend) are
measured in this process between its rounds. It starts a local Ray cluster, or
joins the one --ray_address names (the test suite's). Results go to
results/multitenancy_processes.json and .png (``_quick`` with --quick).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import pathlib
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import common
import multitenancy_processes
from absl import app, flags

_CLIENTS = flags.DEFINE_list("clients", ["1", "2", "4", "8", "16"], "Client thread counts of the pw modes.")
_SLICE = flags.DEFINE_integer("slice", 4, "Devices in the slice every program runs on.")
_COMPUTE_MS = flags.DEFINE_float("compute_ms", 0.33, "Device time per program the calibration aims at.")
_SIZE = flags.DEFINE_integer("size", 0, "Matmul size m per device; 0: calibrate to --compute_ms.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved repeats of jax-1 and the pw modes.")
_MEASURE_S = flags.DEFINE_float("measure_s", 1.5, "Seconds each client submits in one measurement.")
_WINDOW = flags.DEFINE_integer("window", 4, "Futures each pw client thread keeps in flight.")
_JAX_THREADS = flags.DEFINE_list("jax_threads", ["2", "4"], "Thread counts of the plain-JAX jax-N modes.")
_JAX_WINDOWS = flags.DEFINE_list(
    "jax_windows",
    ["0", "8"],
    "In-flight bounds per thread of the jax-N modes: 0 (jax-N) dispatches without waiting, as plain "
    "JAX code does; W > 0 (jax-N-wW) waits for its oldest output once W are in flight.",
)
_JAX_TIMEOUT = flags.DEFINE_float("jax_timeout_s", 50.0, "Wall-clock limit of each jax-N subprocess.")
_FAIR_WEIGHTS = flags.DEFINE_list("fair_weights", ["1", "2", "4", "8"], "Client weights of the fair run.")
_FAIR_S = flags.DEFINE_float("fair_s", 4.0, "Seconds of steady state the fair shares are measured over.")
_FAIR_REPEATS = flags.DEFINE_integer("fair_repeats", 3, "Repeats of the fair run.")
_FAIR_WINDOW = flags.DEFINE_integer("fair_window", 16, "Futures each fair client thread keeps in flight.")
_QUICK = flags.DEFINE_bool("quick", False, "Short run that only checks the benchmark works.")
_FAIR_ONLY = flags.DEFINE_bool(
    "fair_only", False, "Calibrate, then run only the fair runs (on the --slice-device slice)."
)
_PROCESSES = flags.DEFINE_list(
    "processes",
    ["1", "2", "4", "8", "16"],
    "Client process counts of the process mode (--only_processes); --quick alone: 1,2.",
)
_ONLY_PROCESSES = flags.DEFINE_bool(
    "only_processes", False, "Calibrate, then run only the process mode (client processes, one service)."
)
_RAY_ADDRESS = flags.DEFINE_string(
    "ray_address", "", "The process mode joins this Ray cluster (a free CPU); empty: starts a local one."
)
_SERVICE_WINDOW = flags.DEFINE_integer("service_window", 4, "The service's runs in flight per island.")
_SERVICE_WAIT = flags.DEFINE_enum(
    "service_wait",
    "result",
    ["result", "ready"],
    "How a client process waits for its oldest future: result (.result(), the value comes to the "
    "client, as in the thread modes) or ready (.block_until_ready(), it stays on the host; results "
    "go to multitenancy_processes_ready.json).",
)
_OUT = flags.DEFINE_string(
    "out", str(pathlib.Path(__file__).resolve().parent / "results"), "Where results go."
)
# Internal: run one jax-N measurement (plain JAX, N threads) and exit; see _jax_threads_child.
_CHILD = flags.DEFINE_integer("jax_child_threads", 0, "Internal: run the plain-JAX N-thread child.")
_CHILD_PROGRAMS = flags.DEFINE_integer(
    "jax_child_programs", 300, "Programs per thread of the jax-N modes (300 unbounded: fine on one thread)."
)
_CHILD_WINDOW = flags.DEFINE_integer("jax_child_window", 0, "Internal: in-flight bound per child thread.")
# Internal: be one client process of the process mode; see multitenancy_processes.child.
_SERVICE_CHILD = flags.DEFINE_string(
    "service_child", "", "Internal: run as this client process of the service."
)
_SERVICE_ADDRESS = flags.DEFINE_string("service_address", "", "Internal: the service's Ray address.")
_SERVICE_NAME = flags.DEFINE_string("service_name", "", "Internal: the service's name.")

NUM_DEVICES = 8
SIZES = (8, 16, 32, 64, 96, 128, 144, 160, 176, 192, 208, 224, 256, 320, 384, 512)


def _program(x, w):
    """One program: a matmul per device, then a sum over the sharded rows (an all-reduce)."""
    import jax.numpy as jnp

    return jnp.sum(jnp.tanh(x @ w))


def _inputs(mesh, size: int):
    """``x`` split by rows over the mesh (one (size, size) block a device) and ``w`` replicated."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    rng = np.random.default_rng(0)
    n = mesh.devices.size
    x = rng.normal(size=(n * size, size)) / np.sqrt(size)
    w = rng.normal(size=(size, size)) / np.sqrt(size)
    x = jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, PartitionSpec("x")))
    w = jax.device_put(jnp.asarray(w, jnp.float32), NamedSharding(mesh, PartitionSpec()))
    return x, w


def _jax_program(mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.jit(_program, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _sequential(fn, x, w, seconds: float, window: int) -> tuple[int, float]:
    """Calls ``fn(x, w)`` back to back for ``seconds``, at most ``window`` unfinished; (count, elapsed)."""
    pending: collections.deque = collections.deque()
    count = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        pending.append(fn(x, w))
        count += 1
        if len(pending) >= window:
            pending.popleft().block_until_ready()
    for out in pending:
        out.block_until_ready()
    return count, time.perf_counter() - start


# --- calibration -------------------------------------------------------------------------


def calibrate(mesh, target_ms: float, seconds: float, window: int) -> dict:
    """The matmul size whose programs cost closest to ``target_ms`` each, run back to back."""
    tried = []
    for size in SIZES:
        x, w = _inputs(mesh, size)
        fn = _jax_program(mesh)
        fn(x, w).block_until_ready()
        _sequential(fn, x, w, seconds / 4, window)  # warm
        ms = statistics.median(
            elapsed / count * 1e3
            for count, elapsed in (_sequential(fn, x, w, seconds, window) for _ in range(3))
        )
        tried.append({"size": size, "compute_ms": ms})
        print(f"calibration: m={size}: {ms:.3f} ms/program", flush=True)
        if ms >= target_ms:
            break
    best = min(tried, key=lambda t: abs(t["compute_ms"] - target_ms))
    return {"target_ms": target_ms, "tried": tried, "size": best["size"]}


def measure_compute(mesh, size: int, seconds: float, window: int) -> dict:
    """The chosen program's device time per program (back to back) and latency (one at a time)."""
    x, w = _inputs(mesh, size)
    fn = _jax_program(mesh)
    fn(x, w).block_until_ready()
    count, elapsed = _sequential(fn, x, w, seconds, window)
    latencies = []
    deadline = time.perf_counter() + seconds / 2
    while time.perf_counter() < deadline or len(latencies) < 5:
        t0 = time.perf_counter()
        fn(x, w).block_until_ready()
        latencies.append(time.perf_counter() - t0)
    return {"compute_ms": elapsed / count * 1e3, "latency_ms": statistics.median(latencies) * 1e3}


# --- jax-1 and pw-N ----------------------------------------------------------------------


def _slice_utilisation(stats: dict, device_ids: list[int]) -> tuple[float, float]:
    values = [stats["devices"][d]["utilisation"] for d in device_ids]
    return statistics.fmean(values), min(values)


def run_jax_1(fn, x, w, seconds: float, window: int) -> dict:
    count, elapsed = _sequential(fn, x, w, seconds, window)
    return {"programs": count, "seconds": elapsed, "programs_per_s": count / elapsed}


def _drive(n: int, seconds: float, window: int, submit, wait, *, enter=None, tag: str, on_start=None):
    """``n`` threads call ``submit(i)`` until a shared deadline ``seconds`` away; (counts, elapsed).

    Each thread waits (``wait``) for its oldest submission once ``window`` are
    pending, and for all of them at the end; ``enter(i)``, if given, is the
    context thread ``i`` submits in. ``on_start`` runs once the threads exist,
    just before the clock starts. The first error of any thread is raised.
    """
    counts = [0] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1)
    clock = {}

    def worker(i: int) -> None:
        pending: collections.deque = collections.deque()
        try:
            barrier.wait()
            deadline = clock["deadline"]
            with enter(i) if enter is not None else contextlib.nullcontext():
                while time.perf_counter() < deadline:
                    pending.append(submit(i))
                    counts[i] += 1
                    if window and len(pending) >= window:
                        wait(pending.popleft())
                for item in pending:
                    wait(item)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), name=f"{tag}{i}") for i in range(n)]
    for t in threads:
        t.start()
    if on_start is not None:
        on_start()
    start = time.perf_counter()
    clock["deadline"] = start + seconds
    barrier.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return counts, elapsed


def run_clients(pw_fn, x, w, device_ids, n: int, seconds: float, window: int, tag: str) -> dict:
    """``n`` threads, each with its own client, call ``pw_fn`` for ``seconds``; throughput + stats."""
    import pathways_jax as pw

    clients = [pw.client(f"{tag}{i}") for i in range(n)]
    try:
        counts, elapsed = _drive(
            n,
            seconds,
            window,
            lambda i: pw_fn(x, w),
            lambda out: out.result(),
            enter=lambda i: clients[i],
            tag=tag,
            on_start=lambda: pw.stats(reset=True),
        )
        stats = pw.stats()
    finally:
        for c in clients:
            c.close()
    mean, low = _slice_utilisation(stats, device_ids)
    total = sum(counts)
    return {
        "programs": total,
        "seconds": elapsed,
        "programs_per_s": total / elapsed,
        "utilisation": mean,
        "utilisation_min_device": low,
        "accounted_programs": sum(stats["clients"].get(f"{tag}{i}", {}).get("programs", 0) for i in range(n)),
    }


def run_bare(fn, x, w, n: int, seconds: float, window: int, in_flight: int) -> dict:
    """``n`` threads submit ``fn(x, w)`` through one plain dispatcher thread for ``seconds``."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    stop = object()
    errors: list[BaseException] = []

    def dispatcher() -> None:
        flight: collections.deque = collections.deque()
        while (item := requests.get()) is not stop:
            slot, done = item
            try:
                if len(flight) >= in_flight:
                    flight.popleft().block_until_ready()
                out = fn(x, w)
                flight.append(out)
                slot.append(out)
            except BaseException as exc:
                errors.append(exc)
            done.release()

    def submit(i: int) -> tuple:
        done = threading.Lock()
        done.acquire()
        item = ([], done)
        requests.put(item)
        return item

    def wait(item: tuple) -> None:
        slot, done = item
        done.acquire()
        if slot:
            slot[0].block_until_ready()

    thread = threading.Thread(target=dispatcher, name="bare-dispatcher", daemon=True)
    thread.start()
    try:
        counts, elapsed = _drive(n, seconds, window, submit, wait, tag="bare")
    finally:
        requests.put(stop)
        thread.join()
    if errors:
        raise errors[0]
    total = sum(counts)
    return {"programs": total, "seconds": elapsed, "programs_per_s": total / elapsed}


def _prepared(slice_, size: int) -> tuple:
    """The inputs, the plain-JAX and the pathways_jax program (both run once), jax-1's window, the slice's ids."""
    import pathways_jax as pw

    mesh = slice_.physical_mesh
    x, w = _inputs(mesh, size)
    jax_fn = _jax_program(mesh)
    pw_fn = pw.jit(_program, devices=slice_, in_specs=(pw.P("x"), pw.P()), out_specs=pw.P())
    jax_window = pw.cluster().in_flight
    device_ids = [d.id for d in slice_.devices]
    jax_fn(x, w).block_until_ready()
    pw_fn(x, w).result()
    return x, w, jax_fn, pw_fn, jax_window, device_ids


def run_throughput(slice_, size: int, clients: list[int], repeats: int, seconds: float, window: int) -> dict:

    x, w, jax_fn, pw_fn, jax_window, device_ids = _prepared(slice_, size)

    def mode(name: str, measure: float) -> dict:
        if name == "jax-1":
            return run_jax_1(jax_fn, x, w, measure, jax_window)
        n = int(name.split("-")[1])
        if name.startswith("bare-"):
            return run_bare(jax_fn, x, w, n, measure, window, jax_window)
        return run_clients(pw_fn, x, w, device_ids, n, measure, window, tag=f"c{n}-")

    names = ["jax-1"] + [f"pw-{n}" for n in clients] + [f"bare-{n}" for n in clients]
    for name in names:  # warm every mode (threads, clients, the watcher)
        mode(name, min(0.1, seconds))
    samples: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            samples[name].append(mode(name, seconds))
        print(
            f"repeat {r}: "
            + ", ".join(
                f"{n} {samples[n][-1]['programs_per_s']:,.0f}/s"
                + (f" ({samples[n][-1]['utilisation']:.1%})" if "utilisation" in samples[n][-1] else "")
                for n in names
            ),
            flush=True,
        )
    out = {}
    for name in names:
        rates = [s["programs_per_s"] for s in samples[name]]
        ratios = [
            s["programs_per_s"] / b["programs_per_s"]
            for s, b in zip(samples[name], samples["jax-1"], strict=True)
        ]
        entry = {
            "clients": 1 if name == "jax-1" else int(name.split("-")[1]),
            "programs_per_s": statistics.median(rates),
            "programs_per_s_min": min(rates),
            "programs_per_s_max": max(rates),
            "ratio_to_jax_1": statistics.median(ratios),
            "programs": sum(s["programs"] for s in samples[name]),
            "utilisation": None,
        }
        if name.startswith("pw-"):
            entry["utilisation"] = statistics.median(s["utilisation"] for s in samples[name])
            entry["utilisation_min"] = min(s["utilisation_min_device"] for s in samples[name])
            entry["accounted_programs"] = sum(s["accounted_programs"] for s in samples[name])
        out[name] = entry
    return out


# --- jax-N: plain JAX, N threads, in a subprocess ------------------------------------------


def _jax_threads_child(threads: int, slice_devices: int, size: int, programs: int, window: int) -> None:
    """Plain JAX: ``threads`` threads call the collective program; prints progress, then the rate.

    ``window`` 0: each thread dispatches all its programs, then waits for them.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:slice_devices]), ("x",))
    x, w = _inputs(mesh, size)
    fn = _jax_program(mesh)
    fn(x, w).block_until_ready()  # compile on one thread first
    done = [0] * threads
    print("started", flush=True)

    def worker(i: int) -> None:
        pending: collections.deque = collections.deque()
        for _ in range(programs):
            pending.append(fn(x, w))
            if window and len(pending) >= window:
                pending.popleft().block_until_ready()
                done[i] += 1
        for out in pending:
            out.block_until_ready()
            done[i] += 1

    start = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    while any(t.is_alive() for t in pool):
        for t in pool:
            t.join(0.5)
        print(f"progress {sum(done)} {time.perf_counter() - start:.2f}", flush=True)
    elapsed = time.perf_counter() - start
    print(f"completed {sum(done)} {elapsed:.3f}", flush=True)


def run_jax_threads(
    counts: list[int], windows: list[int], slice_devices: int, size: int, programs: int, timeout: float
) -> dict:
    """Runs every jax-N child at once (they only compete if they do not deadlock); what happened."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for window in windows:
            for n in counts:
                name = f"jax-{n}" if not window else f"jax-{n}-w{window}"
                out = open(pathlib.Path(tmp) / f"{name}.out", "w+")  # noqa: SIM115 - closed below
                err = open(pathlib.Path(tmp) / f"{name}.err", "w+")  # noqa: SIM115
                cmd = [
                    sys.executable,
                    str(pathlib.Path(__file__).resolve()),
                    f"--jax_child_threads={n}",
                    f"--jax_child_window={window}",
                    f"--slice={slice_devices}",
                    f"--size={size}",
                    f"--jax_child_programs={programs}",
                ]
                proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
                procs[name] = (n, window, proc, out, err, time.monotonic())
        deadline = time.monotonic() + timeout
        ended: dict[str, float] = {}
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for name, (*_, proc, _, _, t0) in procs.items():
                if name not in ended and proc.poll() is not None:
                    ended[name] = time.monotonic() - t0
            time.sleep(0.1)
        for name, (n, window, proc, out, err, t0) in procs.items():
            timed_out = name not in ended and proc.poll() is None
            if timed_out:
                proc.kill()
                proc.wait()
            seconds = ended.get(name, time.monotonic() - t0)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            out.close()
            err.close()
            entry = _child_outcome(
                n, proc.returncode, timed_out, seconds, stdout, stderr, programs * n, timeout
            )
            entry["window_per_thread"] = window or None
            results[name] = entry
            print(f"{name}: {entry['summary']}", flush=True)
    return results


def _progress(done: int, expected: int, stalled_at: float | None) -> str:
    if not done:
        return f"none of {expected} programs finished (deadlocked)"
    return f"{done} of {expected} programs finished, none after {stalled_at or 0:.1f} s (deadlocked)"


def _child_outcome(
    n: int, rc: int, timed_out: bool, seconds: float, stdout: str, stderr: str, expected: int, timeout: float
) -> dict:
    progress = [(int(a), float(b)) for a, b in re.findall(r"^progress (\d+) ([\d.]+)$", stdout, re.M)]
    completed = re.search(r"^completed (\d+) ([\d.]+)$", stdout, re.M)
    done = progress[-1][0] if progress else 0
    stalled_at = None
    for count, t in progress:  # when the count last changed
        if count == done:
            stalled_at = t
            break
    entry = {
        "clients": n,
        "threads": n,
        "returncode": None if timed_out else rc,
        "seconds": seconds,
        "programs_expected": expected,
        "programs_done": done,
        "programs_per_s": None,
        "stderr_tail": [line[:300] for line in stderr.strip().splitlines() if line.strip()][-4:],
    }
    if completed and rc == 0:
        entry["programs_done"] = int(completed.group(1))
        entry["programs_per_s"] = int(completed.group(1)) / float(completed.group(2))
        entry["outcome"] = "completed"
        entry["summary"] = f"completed {entry['programs_done']} programs, {entry['programs_per_s']:,.0f}/s"
    elif timed_out:
        entry["outcome"] = "timeout"
        entry["summary"] = (
            f"no result after {timeout:.0f} s (killed), {_progress(done, expected, stalled_at)}"
        )
    elif rc is not None and rc < 0:
        name = signal.Signals(-rc).name
        entry["outcome"] = "aborted" if -rc == signal.SIGABRT else f"killed by {name}"
        entry["signal"] = name
        entry["summary"] = f"{name} after {seconds:.1f} s, {_progress(done, expected, stalled_at)}"
    else:
        entry["outcome"] = "failed"
        entry["summary"] = f"exit code {rc} after {seconds:.1f} s: {done} of {expected} programs finished"
    entry["stalled_after_s"] = stalled_at if entry["outcome"] != "completed" else None
    return entry


# --- fair ----------------------------------------------------------------------------------


def run_fair(size: int, weights: list[float], seconds: float, settle: float, window: int) -> dict:
    """One client per weight submits as fast as it can; device-time shares over a steady window."""
    import pathways_jax as pw

    pw.shutdown()
    pw.init(num_cpu_devices=NUM_DEVICES, scheduler="fair")
    slice_ = pw.devices(mesh={"x": _SLICE.value})
    x, w = _inputs(slice_.physical_mesh, size)
    pw_fn = pw.jit(_program, devices=slice_, in_specs=(pw.P("x"), pw.P()), out_specs=pw.P())
    pw_fn(x, w).result()
    names = [f"w{weight:g}" for weight in weights]
    clients = [pw.client(name, weight=weight) for name, weight in zip(names, weights, strict=True)]
    stop = threading.Event()
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(clients) + 1)

    def worker(i: int) -> None:
        pending: collections.deque = collections.deque()
        try:
            barrier.wait()
            with clients[i]:
                while not stop.is_set():
                    pending.append(pw_fn(x, w))
                    if window and len(pending) >= window:
                        pending.popleft().result()
                for out in pending:
                    out.result()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    barrier.wait()
    time.sleep(settle)  # every client is submitting: measure the steady state only
    pw.stats(reset=True)
    time.sleep(seconds)
    stats = pw.stats()  # taken while all clients still submit
    stop.set()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    slice_.release()
    if errors:
        raise errors[0]
    device_time = {name: stats["clients"].get(name, {}).get("device_time_s", 0.0) for name in names}
    programs = {name: stats["clients"].get(name, {}).get("programs", 0) for name in names}
    total_time, total_programs, total_weight = sum(device_time.values()), sum(programs.values()), sum(weights)
    per_client = {}
    for name, weight in zip(names, weights, strict=True):
        want = weight / total_weight
        share = device_time[name] / total_time if total_time else 0.0
        per_client[name] = {
            "weight": weight,
            "weight_share": want,
            "device_time_s": device_time[name],
            "share": share,
            "relative_error": abs(share - want) / want,
            "programs": programs[name],
            "program_share": programs[name] / total_programs if total_programs else 0.0,
        }
    return {"elapsed_s": stats["elapsed_s"], "clients": per_client}


def summarise_fair(runs: list[dict]) -> dict:
    names = list(runs[0]["clients"])
    clients = {}
    for name in names:
        first = runs[0]["clients"][name]
        shares = [r["clients"][name]["share"] for r in runs]
        share = statistics.median(shares)
        clients[name] = {
            "weight": first["weight"],
            "weight_share": first["weight_share"],
            "share": share,
            "share_min": min(shares),
            "share_max": max(shares),
            "relative_error": abs(share - first["weight_share"]) / first["weight_share"],
            # Every program is the same, so its count is a second measure of device time.
            "program_share_relative_error": abs(
                statistics.median(r["clients"][name]["program_share"] for r in runs) - first["weight_share"]
            )
            / first["weight_share"],
            "program_share": statistics.median(r["clients"][name]["program_share"] for r in runs),
            "device_time_s": statistics.median(r["clients"][name]["device_time_s"] for r in runs),
        }
    worst = max(c["relative_error"] for c in clients.values())
    return {
        "weights": [clients[n]["weight"] for n in names],
        "clients": clients,
        "max_relative_error": worst,
        "max_program_share_relative_error": max(c["program_share_relative_error"] for c in clients.values()),
        "max_relative_error_per_run": [max(c["relative_error"] for c in r["clients"].values()) for r in runs],
        "runs": runs,
    }


# --- report ----------------------------------------------------------------------------------


def _targets(modes: dict, fair: dict) -> dict:
    big = [m for m in modes.values() if m.get("utilisation") is not None and m["clients"] >= 4]
    ratio = min(m["ratio_to_jax_1"] for m in big) if big else None
    util = min(m["utilisation"] for m in big) if big else None
    return {
        "throughput_ratio_4plus_clients": {
            "target": ">= 1.0",
            "min": ratio,
            "met": ratio is not None and ratio >= 1.0,
        },
        "utilisation_4plus_clients": {
            "target": ">= 0.95",
            "min": util,
            "met": util is not None and util >= 0.95,
        },
        "fair_relative_error": {
            "target": "<= 0.10",
            "max": fair["max_relative_error"],
            "met": fair["max_relative_error"] <= 0.10,
        },
    }


def _table(modes: dict) -> str:
    rows = [
        "| mode | clients | programs/s | ratio to jax-1 | utilisation | outcome |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, m in modes.items():
        rate = f"{m['programs_per_s']:,.0f}" if m.get("programs_per_s") else "—"
        ratio = f"{m['ratio_to_jax_1']:.2f}" if m.get("ratio_to_jax_1") is not None else "—"
        util = f"{m['utilisation']:.1%}" if m.get("utilisation") is not None else "—"
        outcome = m.get("summary", "completed")
        rows.append(f"| `{name}` | {m['clients']} | {rate} | {ratio} | {util} | {outcome} |")
    return "\n".join(rows)


def _fair_table(fair: dict) -> str:
    rows = [
        "| client | weight | weight share | device-time share (min-max) | relative error "
        "| program share | relative error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in fair["clients"].items():
        rows.append(
            f"| `{name}` | {c['weight']:g} | {c['weight_share']:.3f} | {c['share']:.3f} "
            f"({c['share_min']:.3f}-{c['share_max']:.3f}) | {c['relative_error']:.1%} "
            f"| {c['program_share']:.3f} | {c['program_share_relative_error']:.1%} |"
        )
    return "\n".join(rows)


def _plot(report: dict, path: pathlib.Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    modes = report["modes"]
    pw_modes = [m for name, m in modes.items() if name.startswith("pw-")]
    xs = [m["clients"] for m in pw_modes]
    base = modes["jax-1"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax1.plot(xs, [m["programs_per_s"] for m in pw_modes], "-o", label="pathways_jax, N clients")
    ax1.fill_between(
        xs,
        [m["programs_per_s_min"] for m in pw_modes],
        [m["programs_per_s_max"] for m in pw_modes],
        alpha=0.2,
    )
    bare = [m for name, m in modes.items() if name.startswith("bare-")]
    if bare:
        ax1.plot(
            [m["clients"] for m in bare],
            [m["programs_per_s"] for m in bare],
            "-s",
            color="tab:gray",
            ms=4,
            label="bare dispatcher thread, N clients (floor)",
        )
    ax1.axhline(base["programs_per_s"], color="k", ls="--", label="plain JAX, 1 thread (jax-1)")
    lines = []
    for name, m in modes.items():
        if name.startswith("jax-") and name != "jax-1":
            lines.append(f"{name}: {m['summary']}")
            if m["outcome"] == "completed":
                ax1.plot([m["clients"]], [m["programs_per_s"]], "x", color="tab:red", ms=9)
    if lines:
        ax1.plot([], [], "x", color="tab:red", label="plain JAX, N threads (if it finished)")
        ax1.text(
            0.02,
            0.03,
            "plain JAX, N threads, collectives:\n" + "\n".join(lines),
            transform=ax1.transAxes,
            fontsize=7,
            va="bottom",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "tab:red"},
        )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, [str(v) for v in xs])
    ax1.set_ylim(bottom=0)
    ax1.set_xlabel("client threads")
    ax1.set_ylabel("programs / second (aggregate)")
    per_program = report["calibration"].get("jax_1_ms_per_program", report["calibration"]["compute_ms"])
    ax1.set_title(f"Throughput ({per_program:.2f} ms programs, jax-1)")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8, loc="center right")
    ax2.plot(xs, [100 * m["utilisation"] for m in pw_modes], "-o", label="mean over slice devices")
    ax2.plot(
        xs, [100 * m["utilisation_min"] for m in pw_modes], ":", marker=".", label="lowest device, any repeat"
    )
    ax2.axhline(95, color="tab:green", ls="--", label="target 95%")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(xs, [str(v) for v in xs])
    ax2.set_ylim(0, 105)
    ax2.set_xlabel("client threads")
    ax2.set_ylabel("device utilisation (%), pw.stats()")
    ax2.set_title("Utilisation")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8, loc="lower right")
    fair = report["fair"]["clients"]
    names = list(fair)
    pos = range(len(names))
    ax3.bar([p - 0.27 for p in pos], [fair[n]["weight_share"] for n in names], 0.27, label="weight share")
    ax3.bar(
        list(pos),
        [fair[n]["share"] for n in names],
        0.27,
        yerr=[
            [fair[n]["share"] - fair[n]["share_min"] for n in names],
            [fair[n]["share_max"] - fair[n]["share"] for n in names],
        ],
        label="device-time share (pw.stats)",
    )
    ax3.bar([p + 0.27 for p in pos], [fair[n]["program_share"] for n in names], 0.27, label="program share")
    ax3.set_xticks(list(pos), [f"weight {fair[n]['weight']:g}" for n in names])
    ax3.set_ylabel("share of device time")
    ax3.set_title('scheduler="fair", weights 1:2:4:8')
    ax3.grid(True, axis="y", alpha=0.3)
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_fair_repeats(size: int, weights: list[float], seconds: float, settle: float, repeats: int) -> dict:
    runs = []
    for r in range(repeats):
        runs.append(run_fair(size, weights, seconds, settle, _FAIR_WINDOW.value))
        print(
            f"fair run {r}: "
            + ", ".join(
                f"{n} {c['share']:.3f} (want {c['weight_share']:.3f})" for n, c in runs[-1]["clients"].items()
            ),
            flush=True,
        )
    return summarise_fair(runs)


def _fair_only(
    size: int,
    weights: list[float],
    seconds: float,
    settle: float,
    repeats: int,
    calibration: dict,
    out_dir: pathlib.Path,
    started: float,
) -> None:
    """--fair_only: the fair runs alone, written beside (not over) the full run's results."""
    import pathways_jax as pw

    fair = _run_fair_repeats(size, weights, seconds, settle, repeats)
    pw.shutdown()
    report = {
        "benchmark": "multitenancy-fair",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": common.machine(),
        "quick": _QUICK.value,
        "config": {
            "slice_devices": _SLICE.value,
            "matmul_size": size,
            "fair_weights": weights,
            "fair_s": seconds,
            "fair_repeats": repeats,
            "fair_window_per_client": _FAIR_WINDOW.value,
        },
        "calibration": calibration,
        "fair": fair,
        "fair_table": _fair_table(fair),
        "wall_s": time.perf_counter() - started,
    }
    name = f"multitenancy_fair_slice{_SLICE.value}" + ("_quick" if _QUICK.value else "")
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(report["fair_table"])
    print(f"max relative error {fair['max_relative_error']:.1%}")
    print(f"wrote {out_dir / (name + '.json')} in {report['wall_s']:.0f} s")


def _tree() -> dict:
    """The commit measured, and the runtime's files changed since it (another job may edit the tree)."""

    def git(*args: str) -> str:
        root = pathlib.Path(__file__).resolve().parent.parent
        got = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return got.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "changed": git("status", "--short", "pathways_jax").splitlines(),
    }


def _processes_only(
    slice_, size: int, calibration: dict, out_dir: pathlib.Path, started: float, repeats: int, measure: float
) -> None:
    """--only_processes: proc-N against jax-1 and pw-1 of the same run; see multitenancy_processes.py."""
    import ray

    import pathways_jax as pw

    quick = _QUICK.value
    processes = [int(v) for v in _PROCESSES.value]
    if quick and not _PROCESSES.present:
        processes = [1, 2]
    load_before = os.getloadavg()
    x, w, jax_fn, pw_fn, jax_window, device_ids = _prepared(slice_, size)
    baselines = {
        "jax-1": lambda seconds: run_jax_1(jax_fn, x, w, seconds, jax_window),
        "pw-1": lambda seconds: run_clients(pw_fn, x, w, device_ids, 1, seconds, _WINDOW.value, tag="local-"),
    }
    for run in baselines.values():  # warm
        run(min(0.1, measure))
    command = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        f"--slice={_SLICE.value}",
        f"--size={size}",
        f"--window={_WINDOW.value}",
        f"--service_wait={_SERVICE_WAIT.value}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        got = multitenancy_processes.run(
            processes=processes,
            repeats=repeats,
            seconds=measure,
            window=_WINDOW.value,
            slice_devices=_SLICE.value,
            size=size,
            command=command,
            service_window=_SERVICE_WINDOW.value,
            baselines=baselines,
            folder=pathlib.Path(tmp),
            ready_timeout=240.0,
            ray_address=_RAY_ADDRESS.value,
        )
    slice_.release()
    pw.shutdown()
    modes = got.pop("modes")
    calibration["jax_1_ms_per_program"] = 1e3 / modes["jax-1"]["programs_per_s"]
    report = {
        "benchmark": "multitenancy-processes",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": common.machine() | {"ray": ray.__version__},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "tree": _tree(),
        "quick": quick,
        "config": {
            "slice_devices": _SLICE.value,
            "matmul_size": size,
            "processes": processes,
            "repeats": repeats,
            "measure_s": measure,
            "window_per_client": _WINDOW.value,
            "client_waits_with": _SERVICE_WAIT.value,
            "jax_1_window": jax_window,
            "service": {
                "hosts": 1,
                "devices_per_host": _SLICE.value,
                "scheduler": "fifo",
                "window": _SERVICE_WINDOW.value,
            },
        },
        "calibration": calibration,
        "utilisation_measure": (
            "proc-N: the increase of the service's stats() device_time_s, summed over its client "
            "processes, over the round's wall time. The hosts measure each run's device time (from when a "
            "host enqueued the run's work, or its previous run ended, until the run's outputs were ready; "
            "the longest of the run's hosts) and the service adds it up per client process: busy time of "
            "the island, not per device. pw-1: pw.stats() as in the thread mode."
        ),
        "modes": modes,
        **got,
    }
    report["table"] = multitenancy_processes.table(modes)
    report["cpu_table"] = multitenancy_processes.cpu_table(modes)
    report["wall_s"] = time.perf_counter() - started
    name = (
        "multitenancy_processes"
        + ("_ready" if _SERVICE_WAIT.value == "ready" else "")
        + ("_quick" if quick else "")
    )
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    multitenancy_processes.plot(report, out_dir / f"{name}.png", common.pyplot)
    print(report["table"])
    print("CPU µs per program, by process role:")
    print(report["cpu_table"])
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')} in {report['wall_s']:.0f} s")


def main(argv: list[str]) -> None:
    del argv
    if _CHILD.value:
        _jax_threads_child(
            _CHILD.value, _SLICE.value, _SIZE.value, _CHILD_PROGRAMS.value, _CHILD_WINDOW.value
        )
        return
    if _SERVICE_CHILD.value:  # before any JAX computation in this process
        multitenancy_processes.child(
            address=_SERVICE_ADDRESS.value,
            service=_SERVICE_NAME.value,
            name=_SERVICE_CHILD.value,
            slice_devices=_SLICE.value,
            size=_SIZE.value,
            window=_WINDOW.value,
            wait=_SERVICE_WAIT.value,
            program=_program,
            inputs=_inputs,
        )
        return
    import pathways_jax as pw

    quick = _QUICK.value
    clients = [int(v) for v in _CLIENTS.value]
    jax_threads = [int(v) for v in _JAX_THREADS.value]
    weights = [float(v) for v in _FAIR_WEIGHTS.value]
    repeats, measure, fair_s, fair_repeats = (
        _REPEATS.value,
        _MEASURE_S.value,
        _FAIR_S.value,
        _FAIR_REPEATS.value,
    )
    jax_timeout, child_programs, calibrate_s, settle = _JAX_TIMEOUT.value, _CHILD_PROGRAMS.value, 0.2, 0.5
    if quick:
        repeats, measure, fair_s, fair_repeats = 1, 0.2, 0.6, 1
        jax_timeout, child_programs, calibrate_s, settle = 5.0, 100, 0.05, 0.2
    started = time.perf_counter()
    pw.init(num_cpu_devices=NUM_DEVICES)
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)

    slice_ = pw.devices(mesh={"x": _SLICE.value})
    mesh = slice_.physical_mesh
    jax_window = pw.cluster().in_flight
    if _SIZE.value:
        calibration = {"target_ms": _COMPUTE_MS.value, "tried": [], "size": _SIZE.value}
    else:
        calibration = calibrate(mesh, _COMPUTE_MS.value, calibrate_s, jax_window)
    size = calibration["size"]
    calibration.update(measure_compute(mesh, size, 2 * calibrate_s, jax_window))
    print(
        f"program: {_SLICE.value} devices, m={size}: {calibration['compute_ms']:.3f} ms each back to back "
        f"(plain JAX), {calibration['latency_ms']:.3f} ms one at a time",
        flush=True,
    )

    if _ONLY_PROCESSES.value:
        _processes_only(slice_, size, calibration, out_dir, started, repeats, measure)
        return
    if _FAIR_ONLY.value:
        slice_.release()
        _fair_only(size, weights, fair_s, settle, fair_repeats, calibration, out_dir, started)
        return
    modes = run_throughput(slice_, size, clients, repeats, measure, _WINDOW.value)
    # The most-sampled figure of a program's cost: jax-1's median rate, back to back.
    calibration["jax_1_ms_per_program"] = 1e3 / modes["jax-1"]["programs_per_s"]
    slice_.release()
    fair = _run_fair_repeats(size, weights, fair_s, settle, fair_repeats)
    pw.shutdown()
    # Last, with no cluster of ours running: each child deadlocks (or not) on its own.
    jax_windows = [int(v) for v in _JAX_WINDOWS.value]
    modes.update(run_jax_threads(jax_threads, jax_windows, _SLICE.value, size, child_programs, jax_timeout))

    report = {
        "benchmark": "multitenancy",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": common.machine(),
        "quick": quick,
        "config": {
            "slice_devices": _SLICE.value,
            "matmul_size": size,
            "clients": clients,
            "repeats": repeats,
            "measure_s": measure,
            "window_per_client": _WINDOW.value,
            "jax_1_window": jax_window,
            "pw_max_in_flight": jax_window,
            "jax_threads": jax_threads,
            "jax_timeout_s": jax_timeout,
            "jax_child_programs_per_thread": child_programs,
            "jax_windows_per_thread": [int(v) for v in _JAX_WINDOWS.value],
            "fair_weights": weights,
            "fair_s": fair_s,
            "fair_repeats": fair_repeats,
            "fair_window_per_client": _FAIR_WINDOW.value,
        },
        "calibration": calibration,
        "utilisation_measure": (
            "pw.stats(): per device, the union of [dispatch (or the end of the previous run on the device), "
            "outputs ready] over the measurement's wall time (reset before it), averaged over the slice's "
            "devices. The accounting watcher folds runs that finish close together and wakes once per 4 ms "
            "batch, so end times of runs shorter than that are known to ~4 ms."
        ),
        "modes": modes,
        "fair": fair,
    }
    report["targets"] = _targets(modes, fair)
    # pathways_jax against the bare hand-off, per client count: its own cost.
    report["pw_over_bare"] = {
        n: modes[f"pw-{n}"]["ratio_to_jax_1"] / modes[f"bare-{n}"]["ratio_to_jax_1"] for n in clients
    }
    report["table"] = _table(modes)
    report["fair_table"] = _fair_table(fair)
    report["wall_s"] = time.perf_counter() - started
    name = "multitenancy_quick" if quick else "multitenancy"
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / f"{name}.png")
    print(report["table"])
    print("pw-N / bare-N: " + ", ".join(f"{n}: {r:.3f}" for n, r in report["pw_over_bare"].items()))
    print(report["fair_table"])
    for key, target in report["targets"].items():
        print(f"target {key}: {target}")
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    app.run(main)
