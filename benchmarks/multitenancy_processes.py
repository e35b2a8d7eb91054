"""multitenancy.py's process mode: client processes sharing one controller service (``pw.serve``).

The parent (``multitenancy.py --only_processes``) starts a local Ray cluster
(or joins the one ``--ray_address`` names) and a service of one host owning the slice's devices, then, for each N in
--processes, N client processes (``multitenancy.py --service_child=NAME``,
see :func:`child`; added to those already joined, so all N measure). Each
child joins the service, places the program's inputs on the service's host
once, compiles and warms the program, and says it is ready. The parent
then measures rounds: every child is told the same start and deadline
(``time.monotonic`` is one clock for every process of the machine), submits
until the deadline keeping --window futures in flight, waits for the rest
and reports how many programs it completed.

Between the rounds the parent measures, in its own process, ``jax-1`` (plain
JAX, the same program and size on the same number of CPU devices) and
``pw-1`` (one client thread on the local backend), so that every ratio is
against a baseline of the same minute. The children stay joined between
rounds and idle on a blocking read of their stdin.

Protocol: the parent writes ``go START DEADLINE`` or ``quit`` to a child's
stdin; a child answers with one line ``@ready {json}`` once, then ``@done
{json}`` per round, on stdout (its stderr goes to a log file).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import threading
import time

import common

_MARK = "@"
_LEAD_S = 0.05  # the start is this far after the parent's "go": every child has read it


# --- a client process -------------------------------------------------------------------------


def child(
    *,
    address: str,
    service: str,
    name: str,
    slice_devices: int,
    size: int,
    window: int,
    wait: str,
    program,
    inputs,
) -> None:
    """One client process of the service: joins, warms, then measures rounds on the parent's word.

    ``wait``: how it waits for its oldest future: ``"result"`` brings the value
    here (``.result()``, as the thread modes do); ``"ready"`` only waits for it
    (``.block_until_ready()``, the value stays on the host).
    """
    waits = {"result": lambda f: f.result(), "ready": lambda f: f.block_until_ready()}[wait]
    import pathways_jax as pw

    pw.init(backend="ray", address=address, service=service, client_name=name)
    try:
        slice_ = pw.devices(mesh={"x": slice_devices})
        spec_in = (pw.P("x"), pw.P())
        # The inputs go to the service's host once; every run then names them by handle.
        place = pw.jit(lambda a, b: (a * 1, b * 1), devices=slice_, in_specs=spec_in, out_specs=spec_in)
        x, w = place(*inputs(slice_.physical_mesh, size))
        fn = pw.jit(program, devices=slice_, in_specs=spec_in, out_specs=pw.P())
        fn(x, w).result()
        _submit(fn, x, w, time.monotonic() + 0.2, window, waits)  # warm
        latencies = []
        for _ in range(20):
            t0 = time.monotonic()
            waits(fn(x, w))
            latencies.append(time.monotonic() - t0)
        _say("ready", pid=os.getpid(), latency_ms=statistics.median(latencies) * 1e3)
        for line in sys.stdin:
            match line.split():
                case ["go", start, deadline]:
                    time.sleep(max(0.0, float(start) - time.monotonic()))
                    cpu = time.process_time()
                    count = _submit(fn, x, w, float(deadline), window, waits)
                    _say("done", programs=count, end=time.monotonic(), cpu_s=time.process_time() - cpu)
                case ["quit"]:
                    break
                case other:
                    raise SystemExit(f"{name}: unknown command {other!r}")
    finally:
        pw.shutdown()


def _submit(fn, x, w, deadline: float, window: int, wait) -> int:
    """Calls ``fn(x, w)`` until ``deadline``, ``window`` futures in flight; the programs completed."""
    pending: collections.deque = collections.deque()
    count = 0
    while time.monotonic() < deadline:
        pending.append(fn(x, w))
        count += 1
        if len(pending) >= window:
            wait(pending.popleft())
    for out in pending:
        wait(out)
    return count


def _say(kind: str, **what) -> None:
    print(f"{_MARK}{kind} {json.dumps(what)}", flush=True)


# --- the parent's side ------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Child:
    """A client process: its ``Popen``, its messages (a reader thread's queue) and its log."""

    name: str
    proc: subprocess.Popen
    log: pathlib.Path
    messages: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)

    def read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                kind, _, body = line[1:].partition(" ")
                self.messages.put((kind, json.loads(body)))
        self.messages.put(("exit", {}))

    def expect(self, kind: str, timeout: float) -> dict:
        try:
            got, body = self.messages.get(timeout=timeout)
        except queue.Empty:
            got, body = "timeout", {}
        if got != kind:
            tail = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(
                f"client process {self.name} sent {got!r} where {kind!r} was expected "
                f"(exit code {self.proc.poll()}); its log ends:\n{tail}"
            )
        return body

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()


def start_children(names: list[str], command: list[str], folder: pathlib.Path) -> list[Child]:
    """Starts one client process per name: ``command + [--service_child=NAME]``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    children = []
    for name in names:
        log = folder / f"{name}.log"
        with log.open("w") as err:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [*command, f"--service_child={name}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        c = Child(name, proc, log)
        threading.Thread(target=c.read, name=f"read-{name}", daemon=True).start()
        children.append(c)
    return children


def stop_children(children: list[Child]) -> None:
    for c in children:
        if c.proc.poll() is None:
            with contextlib.suppress(OSError):
                c.send("quit")
    for c in children:
        try:
            c.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait(timeout=10)


def _island_busy_s(svc) -> tuple[float, dict]:
    stats = svc.stats()
    return sum(c["device_time_s"] for c in stats["clients"].values()), stats


def measure_round(children: list[Child], svc, seconds: float, timeout: float) -> dict:
    """Every child submits from one start to one deadline; throughput, service busy time, CPU by role."""
    busy0, stats0 = _island_busy_s(svc)
    pids = {c.proc.pid for c in children}
    cpu0 = cpu_by_process(os.getpid(), pids)
    start = time.monotonic() + _LEAD_S
    for c in children:
        c.send(f"go {start!r} {start + seconds!r}")
    done = [c.expect("done", timeout) for c in children]
    cpu1 = cpu_by_process(os.getpid(), pids)
    busy1, stats1 = _island_busy_s(svc)
    elapsed = max(d["end"] for d in done) - start
    programs = sum(d["programs"] for d in done)
    runs = {
        c["name"]: c["runs"] - stats0["clients"].get(i, {}).get("runs", 0)
        for i, c in stats1["clients"].items()
        if c["alive"]
    }
    return {
        "programs": programs,
        "seconds": elapsed,
        "programs_per_s": programs / elapsed,
        "per_process": [d["programs"] for d in done],
        "utilisation": (busy1 - busy0) / elapsed,
        "service_runs": sum(runs.get(c.name, 0) for c in children),
        "client_cpu_s": sum(d["cpu_s"] for d in done),
        "cpu_s": cpu_delta(cpu0, cpu1),
    }


# --- CPU time by role, from /proc -----------------------------------------------------------------


def _processes() -> dict[int, tuple[int, list[str], float]]:
    """Every readable process: pid -> (parent pid, command line, CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = (int(fields[1]), argv, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _role(argv: list[str]) -> str:
    """A Ray process's role: the actor class in its title (``ray::Host.call``), else its program."""
    title = argv[0]
    if title.startswith("ray::"):
        return {"ServiceActor": "service actor", "Host": "host actor", "Token": "client token actors"}.get(
            title[5:].split(".")[0].split()[0], "ray (other)"
        )
    name = pathlib.Path(title).name
    return name if name in ("raylet", "gcs_server") else "ray (other)"


def cpu_by_process(root: int, clients: set[int]) -> dict[int, tuple[str, float]]:
    """``root``'s descendants: pid -> (role, CPU seconds so far); clients: these pids and theirs."""
    procs = _processes()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, _, _) in procs.items():
        children[ppid].append(pid)
    out = {root: ("parent", procs[root][2])} if root in procs else {}
    stack = [(pid, None) for pid in children[root]]
    while stack:
        pid, role = stack.pop()
        _, argv, cpu = procs[pid]
        mine = role or ("client processes" if pid in clients else _role(argv))
        out[pid] = (mine, cpu)
        stack.extend((kid, mine if pid in clients or role else None) for kid in children[pid])
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds by role between two :func:`cpu_by_process` snapshots, process by process.

    Ray reuses idle workers as actors and ends idle ones, so totals by role
    would move CPU between roles; each process's own delta counts under its
    role at the end (a process that ended in between is not counted).
    """
    totals: dict[str, float] = collections.defaultdict(float)
    for pid, (role, cpu) in after.items():
        totals[role] += cpu - before.get(pid, (role, 0.0))[1]
    return dict(totals)


# --- the whole mode ---------------------------------------------------------------------------


def run(
    *,
    processes: list[int],
    repeats: int,
    seconds: float,
    window: int,
    slice_devices: int,
    size: int,
    command: list[str],
    service_window: int,
    baselines: dict,
    folder: pathlib.Path,
    ready_timeout: float,
    ray_address: str = "",
) -> dict:
    """The process mode: jax-1, pw-1 and proc-N interleaved; per-mode medians and per-round samples.

    ``baselines`` maps a mode name to a function of the seconds to measure
    (the parent's ``jax-1`` and ``pw-1``). ``command`` starts a client process
    (``--service_child=NAME`` is added). ``ray_address``: the Ray cluster to join (a CPU
    free for the service's host); ``""``: a local one of 4 CPUs, started here.
    """
    import ray

    import pathways_jax as pw

    common.start_ray(ray_address, num_cpus=4)
    started = time.monotonic()
    svc = pw.serve(
        "multitenancy", hosts=1, devices_per_host=slice_devices, scheduler="fifo", window=service_window
    )
    service_start_s = time.monotonic() - started
    command = [*command, f"--service_address={svc.address}", "--service_name=multitenancy"]
    children: list[Child] = []
    samples: dict[str, list[dict]] = {name: [] for name in baselines}
    rounds = []
    latency: dict[int, list[float]] = {}
    joins = {}
    try:
        for n in sorted(processes):
            t0 = time.monotonic()
            new = start_children([f"p{i}" for i in range(len(children), n)], command, folder)
            children.extend(new)
            latency[n] = [c.expect("ready", ready_timeout)["latency_ms"] for c in new]
            joins[n] = time.monotonic() - t0
            print(f"proc-{n}: {len(new)} more client processes ready in {joins[n]:.1f} s", flush=True)
            measure_round(children, svc, min(0.2, seconds), ready_timeout)  # warm every child together
            name = f"proc-{n}"
            samples[name] = []
            names = [*baselines, name]
            for r in range(repeats):
                for mode in names[r % len(names) :] + names[: r % len(names)]:
                    got = (
                        measure_round(children, svc, seconds, ready_timeout + seconds)
                        if mode == name
                        else baselines[mode](seconds)
                    )
                    got["round"] = len(rounds)
                    samples[mode].append(got)
                rounds.append({m: samples[m][-1]["programs_per_s"] for m in names} | {"processes": n})
                print(
                    f"proc-{n} repeat {r}: "
                    + ", ".join(f"{m} {samples[m][-1]['programs_per_s']:,.0f}/s" for m in names)
                    + f" (proc-{n} utilisation {samples[name][-1]['utilisation']:.1%})",
                    flush=True,
                )
        service_stats = svc.stats()
    finally:
        stop_children(children)
        svc.stop()
        ray.shutdown()
    modes = _summarise(samples, rounds, latency)
    return {
        "modes": modes,
        "rounds": rounds,
        "service_start_s": service_start_s,
        "join_s": joins,
        "service_clients": {
            c["name"]: {"runs": c["runs"], "device_time_s": c["device_time_s"], "failures": c["failures"]}
            for c in service_stats["clients"].values()
        },
    }


def _summarise(samples: dict[str, list[dict]], rounds: list[dict], latency: dict) -> dict:
    """Medians per mode; a ratio is the median of per-round ratios to that round's jax-1."""
    base = {s["round"]: s["programs_per_s"] for s in samples["jax-1"]}
    out = {}
    for name, got in samples.items():
        rates = [s["programs_per_s"] for s in got]
        entry = {
            "processes": int(name.split("-")[1]) if name.startswith("proc-") else 1,
            "programs_per_s": statistics.median(rates),
            "programs_per_s_min": min(rates),
            "programs_per_s_max": max(rates),
            "ratio_to_jax_1": statistics.median(s["programs_per_s"] / base[s["round"]] for s in got),
            "ratios": [s["programs_per_s"] / base[s["round"]] for s in got],
            "programs": sum(s["programs"] for s in got),
            "utilisation": None,
        }
        if "utilisation" in got[0]:
            entry["utilisation"] = statistics.median(s["utilisation"] for s in got)
        if name.startswith("proc-"):
            n = entry["processes"]
            entry["service_runs"] = sum(s["service_runs"] for s in got)
            entry["per_process_programs"] = [s["per_process"] for s in got]
            entry["latency_ms_one_at_a_time"] = statistics.median(latency[n])
            total = entry["programs"]
            cpu: dict[str, float] = collections.defaultdict(float)
            for s in got:
                for role, v in s["cpu_s"].items():
                    cpu[role] += v
            entry["cpu_us_per_program"] = {role: 1e6 * v / total for role, v in sorted(cpu.items())}
            entry["client_cpu_us_per_program"] = 1e6 * sum(s["client_cpu_s"] for s in got) / total
        out[name] = entry
    return out


# --- report -------------------------------------------------------------------------------------


def table(modes: dict) -> str:
    rows = ["| mode | programs/s | ratio to jax-1 | utilisation |", "|---|---:|---:|---:|"]
    for name, m in modes.items():
        util = f"{m['utilisation']:.1%}" if m["utilisation"] is not None else "—"
        rows.append(f"| `{name}` | {m['programs_per_s']:,.0f} | {m['ratio_to_jax_1']:.2f} | {util} |")
    return "\n".join(rows)


def cpu_table(modes: dict) -> str:
    procs = [(name, m) for name, m in modes.items() if name.startswith("proc-")]
    roles = sorted({r for _, m in procs for r in m["cpu_us_per_program"]})
    rows = ["| mode | " + " | ".join(roles) + " |", "|---|" + "---:|" * len(roles)]
    for name, m in procs:
        rows.append(
            f"| `{name}` | " + " | ".join(f"{m['cpu_us_per_program'].get(r, 0.0):,.0f}" for r in roles) + " |"
        )
    return "\n".join(rows)


def plot(report: dict, path: pathlib.Path, pyplot) -> None:
    plt = pyplot()
    if plt is None:
        return
    modes = report["modes"]
    procs = [m for name, m in modes.items() if name.startswith("proc-")]
    xs = [m["processes"] for m in procs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax1.plot(xs, [m["programs_per_s"] for m in procs], "-o", label="client processes, one controller service")
    ax1.fill_between(
        xs, [m["programs_per_s_min"] for m in procs], [m["programs_per_s_max"] for m in procs], alpha=0.2
    )
    ax1.axhline(modes["jax-1"]["programs_per_s"], color="k", ls="--", label="plain JAX, 1 process (jax-1)")
    if "pw-1" in modes:
        ax1.axhline(
            modes["pw-1"]["programs_per_s"],
            color="tab:gray",
            ls=":",
            label="local backend, 1 client thread (pw-1)",
        )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, [str(v) for v in xs])
    ax1.set_yscale("log")
    ax1.set_xlabel("client processes")
    ax1.set_ylabel("programs / second (aggregate)")
    ax1.set_title(
        f"Throughput ({report['config']['slice_devices']}-device slice, m={report['config']['matmul_size']})"
    )
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.plot(xs, [100 * m["utilisation"] for m in procs], "-o")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(xs, [str(v) for v in xs])
    ax2.set_ylim(0, 105)
    ax2.set_xlabel("client processes")
    ax2.set_ylabel("island busy time / wall time (%), service stats")
    ax2.set_title("Utilisation, as the service measures it")
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
