"""Soak: short-lived clients and throw-away programs for minutes; is anything growing?

One *request* is what a serving process does for one user: (pathways_jax) make
a ``pw.client`` of random priority and weight, and inside it build a brand-new
program, call it one to three times (each output fed into the next call), check
the value against NumPy, drop everything and close the client. Programs are new
objects every time, so every request traces and compiles; of the kinds

  small     ``jit(lambda x: x * k + 1)`` on a 256-element vector, k a fresh float
  const     ``jit(lambda x: x + c)``, c a fresh 1-4 MiB constant array closed over
  two-step  two fresh jitted functions chained in one ``@pw.program`` (plain
            JAX: ``jax.jit`` of the composition)

one is picked at random per request. The plain-``jax.jit`` side runs the same
requests (same seed, same kinds, same checks) without clients: the baseline.
Each side runs in its own process for --seconds (the process's RSS is its own),
the baseline first. A sampler thread records, every --sample_s: program calls
and requests done, RSS (``/proc/self/statm``), open file descriptors, threads,
and on the pathways_jax side the client rows of ``pw.stats()``, the values alive
in the object store, the accounting's per-client records and the executables in
the cluster's compile cache.

The summary gives each side's programs/s and RSS growth, their ratios, and a
flatness check: the least-squares slope, per minute, of RSS, descriptors,
threads and client rows over the second half of the run (the first half holds
JAX's own warm-up). Slopes are reported, not asserted. Results go to
benchmarks/results/soak.json and soak.png.

  python benchmarks/soak.py                 # 180 s a side, about 6.5 minutes in all
  python benchmarks/soak.py --quick         # 2 s a side, both at once; used by the test suite
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import common
from absl import app, flags

_SECONDS = flags.DEFINE_float("seconds", 180.0, "Seconds each side (plain JAX, pathways_jax) runs requests.")
_SAMPLE_S = flags.DEFINE_float("sample_s", 1.0, "Seconds between two samples.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the requests' random choices (the same on both sides).")
_QUICK = flags.DEFINE_bool(
    "quick", False, "Short run (2 s a side, both at once) that only checks the benchmark works."
)
_OUT = flags.DEFINE_string(
    "out", str(pathlib.Path(__file__).resolve().parent / "results"), "Where results go."
)
# Internal: run one side in this process and write its samples to --child_out.
_SIDE = flags.DEFINE_enum("side", "", ["", "jax", "pw"], "Internal: run one side and exit.")
_CHILD_OUT = flags.DEFINE_string("child_out", "", "Internal: where a side writes its samples.")

NUM_DEVICES = 2
SIDES = ("jax", "pw")
KINDS = ("small", "const", "two-step")
SMALL = 256
CONST_MIB = (1, 4)
PW_METRICS = ("clients", "live_values", "accounting_rows", "executables")
METRICS = ("rss_mib", "fds", "threads", "os_threads", *PW_METRICS)


# --- what a process looks like from inside -----------------------------------------------------


def _rss_mib() -> float:
    """Resident set size now (``/proc/self/statm``; the peak from ``resource`` elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1])
        return resident * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _os_threads() -> int:
    """Threads of the process, XLA's included (``threading`` sees only Python's)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return -1


# --- one request ---------------------------------------------------------------------------------


class Requests:
    """Builds and runs one request's throw-away program on either side; checks every value."""

    def __init__(self, side: str, seed: int):
        import jax
        import numpy as np

        self.side = side
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.calls = 0
        self.requests = 0
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.wrong = 0
        self.first_error = ""
        if side == "pw":
            import pathways_jax as pw

            self.pw = pw
            self.slice = pw.devices(mesh={"x": 1})
        self.jax = jax

    def _jit(self, fun):
        if self.side == "pw":
            return self.pw.jit(fun, devices=self.slice)
        return self.jax.jit(fun)

    def _build(self, kind: str):
        """(a new program, its input, the NumPy function it computes)."""
        import jax.numpy as jnp
        import numpy as np

        if kind == "small":
            k = float(self.rng.uniform(0.5, 1.5))
            x = self.np_rng.standard_normal(SMALL).astype(np.float32)
            return self._jit(lambda v: v * k + 1.0), x, lambda v: v * np.float32(k) + np.float32(1.0)
        if kind == "const":
            n = self.rng.randint(CONST_MIB[0] * 2**18, CONST_MIB[1] * 2**18)  # float32: 4 B each
            c = self.np_rng.standard_normal(n).astype(np.float32)
            x = np.zeros(n, np.float32)
            return self._jit(lambda v: v + c), x, lambda v: v + c
        a, b = float(self.rng.uniform(0.5, 1.5)), float(self.rng.uniform(-1, 1))
        first = self.jax.jit(lambda v: jnp.tanh(v) * a)
        second = self.jax.jit(lambda v: v + b)
        x = self.np_rng.standard_normal(SMALL).astype(np.float32)
        program: Any = (
            self.pw.program(lambda v: second(first(v)), devices=self.slice)
            if self.side == "pw"
            else self.jax.jit(lambda v: second(first(v)))
        )
        return program, x, lambda v: np.tanh(v) * np.float32(a) + np.float32(b)

    def one(self) -> None:
        import numpy as np

        kind = self.rng.choice(KINDS)
        calls = self.rng.randint(1, 3)
        priority, weight = self.rng.randrange(3), self.rng.choice([0.5, 1.0, 2.0])
        client = None
        if self.side == "pw":
            client = self.pw.client(f"req-{self.requests}", priority=priority, weight=weight)
            client.__enter__()
        try:
            program, x, reference = self._build(kind)
            want, out = x, x
            for _ in range(calls):
                out = program(out)  # the output feeds the next call without waiting
                want = reference(want)
            got = np.asarray(out.result(timeout=120) if self.side == "pw" else out)
            if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
                self.wrong += 1
                self.first_error = self.first_error or f"request {self.requests} ({kind}): wrong value"
            del program, out, got
        finally:
            if client is not None:
                client.__exit__(None, None, None)
                client.close()
        self.calls += calls
        self.requests += 1
        self.by_kind[kind] += 1


# --- one side, in its own process --------------------------------------------------------------


def _extras(side: str) -> dict:
    """The pathways_jax side's own counts: client rows, live values, and two internal tables.

    ``accounting_rows`` (per-client records) and ``executables`` (the cluster's
    compile cache) are read from internals: None where they are not found.
    """
    if side != "pw":
        return dict.fromkeys(PW_METRICS)
    import pathways_jax as pw

    cl = pw.cluster()
    usage = getattr(getattr(cl.controller, "accounting", None), "usage", None)
    executables = getattr(cl, "executables", None)
    return {
        "clients": len(pw.stats()["clients"]),
        "live_values": cl.store.live_count(),
        "accounting_rows": None if usage is None else len(usage),
        "executables": None if executables is None else len(executables),
    }


def run_side(side: str, seconds: float, sample_s: float, seed: int) -> dict:
    """Runs requests for ``seconds`` on one side while a sampler thread records the process."""
    if side == "pw":
        import pathways_jax as pw

        pw.init(num_cpu_devices=NUM_DEVICES)
    else:
        import jax

        jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
    requests = Requests(side, seed)
    samples: list[dict] = []
    stop = threading.Event()
    start = time.perf_counter()
    sampler_error: list[str] = []

    def sample() -> None:
        samples.append(
            {
                "t": time.perf_counter() - start,
                "calls": requests.calls,
                "requests": requests.requests,
                "rss_mib": _rss_mib(),
                "fds": _fds(),
                "threads": threading.active_count(),
                "os_threads": _os_threads(),
                **_extras(side),
            }
        )

    def sampler() -> None:  # samples at once, then every sample_s, then once more at the end
        try:
            while True:
                stopped = stop.is_set()  # read first: a stop set during the sample gets one more
                sample()
                if stopped:
                    return
                stop.wait(sample_s)
        except BaseException as exc:  # reported in the results, not lost in a thread
            sampler_error.append(repr(exc))

    thread = threading.Thread(target=sampler, name="soak-sampler", daemon=True)
    thread.start()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        requests.one()
    stop.set()
    thread.join()
    elapsed = time.perf_counter() - start
    return {
        "side": side,
        "seconds": elapsed,
        "calls": requests.calls,
        "requests": requests.requests,
        "by_kind": requests.by_kind,
        "wrong": requests.wrong,
        "first_error": requests.first_error,
        "sampler_error": sampler_error[0] if sampler_error else "",
        "samples": samples,
    }


def _run_child(side: str, seconds: float, sample_s: float, seed: int) -> dict:
    """Runs one side in a fresh process (its own device count, its own RSS); its results."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / f"{side}.json"
        cmd = [
            sys.executable,
            str(pathlib.Path(__file__).resolve()),
            f"--side={side}",
            f"--seconds={seconds}",
            f"--sample_s={sample_s}",
            f"--seed={seed}",
            f"--child_out={out}",
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=seconds + 180, env=env, check=False
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"the {side} side exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                f"\n--- stderr\n{proc.stderr[-4000:]}"
            )
        return json.loads(out.read_text())


# --- summary -----------------------------------------------------------------------------------


def _slope_per_min(ts: list[float], ys: list) -> float | None:
    """Least-squares slope of ``ys`` against ``ts``, per minute; None without two numbers."""
    import numpy as np

    pairs = [(t, y) for t, y in zip(ts, ys, strict=True) if y is not None]
    if len(pairs) < 2 or pairs[-1][0] == pairs[0][0]:
        return None
    t, y = np.asarray(pairs, dtype=float).T
    return float(np.polyfit(t, y, 1)[0] * 60)


def summarise(result: dict) -> dict:
    """Throughput, RSS growth and second-half slopes of one side."""
    samples = result["samples"]
    half = samples[len(samples) // 2 :]
    ts = [s["t"] for s in half]
    first, mid, last = samples[0], half[0], samples[-1]
    span = last["t"] - mid["t"]
    summary = {
        "programs_per_s": result["calls"] / result["seconds"],
        "requests_per_s": result["requests"] / result["seconds"],
        "programs_per_s_second_half": (last["calls"] - mid["calls"]) / span if span > 0 else None,
        "rss_start_mib": first["rss_mib"],
        "rss_mid_mib": mid["rss_mib"],
        "rss_end_mib": last["rss_mib"],
        "rss_peak_mib": max(s["rss_mib"] for s in samples),
        "rss_growth_mib": last["rss_mib"] - first["rss_mib"],
        "rss_growth_second_half_mib": last["rss_mib"] - mid["rss_mib"],
        "slopes_per_min_second_half": {m: _slope_per_min(ts, [s[m] for s in half]) for m in METRICS},
        "end": {m: last[m] for m in METRICS},
    }
    return summary


def _table(report: dict) -> str:
    sides = report["sides"]
    rows = [
        "| side | requests | program calls | programs/s | RSS start → end (MiB) | RSS growth, 2nd half (MiB) |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for side in SIDES:
        r, s = sides[side], sides[side]["summary"]
        rows.append(
            f"| `{side}` | {r['requests']:,} | {r['calls']:,} | {s['programs_per_s']:.1f} | "
            f"{s['rss_start_mib']:.0f} → {s['rss_end_mib']:.0f} | {s['rss_growth_second_half_mib']:+.1f} |"
        )
    rows += ["", "Slopes over the second half, per minute:", ""]
    rows += ["| side | " + " | ".join(METRICS) + " |", "|---|" + "---:|" * len(METRICS)]
    for side in SIDES:
        slopes = sides[side]["summary"]["slopes_per_min_second_half"]
        cells = ["—" if slopes[m] is None else f"{slopes[m]:+.2f}" for m in METRICS]
        rows.append(f"| `{side}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _plot(report: dict, path: pathlib.Path) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    colors = {"jax": "tab:gray", "pw": "tab:blue"}
    labels = {"jax": "plain jax.jit", "pw": "pathways_jax"}
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for side in SIDES:
        samples = report["sides"][side]["samples"]
        ts = [s["t"] for s in samples]
        rates = [
            (b["calls"] - a["calls"]) / (b["t"] - a["t"]) if b["t"] > a["t"] else 0.0
            for a, b in itertools.pairwise(samples)
        ]
        axes[0].plot(ts[1:], rates, color=colors[side], label=labels[side])
        axes[1].plot(ts, [s["rss_mib"] for s in samples], color=colors[side], label=labels[side])
        axes[2].plot(ts, [s["fds"] for s in samples], color=colors[side], label=f"{labels[side]}: fds")
        axes[2].plot(
            ts, [s["threads"] for s in samples], "--", color=colors[side], label=f"{labels[side]}: threads"
        )
        axes[2].plot(
            ts,
            [s["os_threads"] for s in samples],
            ":",
            color=colors[side],
            label=f"{labels[side]}: OS threads",
        )
    pw_samples = report["sides"]["pw"]["samples"]
    ts = [s["t"] for s in pw_samples]
    for metric, style in (
        ("clients", "-"),
        ("accounting_rows", "--"),
        ("executables", "-."),
        ("live_values", ":"),
    ):
        ys = [s[metric] for s in pw_samples]
        if any(y is not None for y in ys):
            axes[3].plot(ts, ys, style, color=colors["pw"], label=metric.replace("_", " "))
    titles = (
        "program calls / s (per sample)",
        "process RSS (MiB)",
        "open file descriptors, threads (Python, OS)",
        "pathways_jax: client rows, records, executables, live values",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ratio = report["ratios"]["programs_per_s_pw_over_jax"]
    fig.suptitle(
        f"Soak: a client and a new program per request, {report['config']['seconds']:.0f} s a side "
        f"(pathways_jax / plain jax.jit: {ratio:.2f}x programs/s)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    seconds, sample_s = _SECONDS.value, _SAMPLE_S.value
    if _QUICK.value:
        seconds, sample_s = 2.0, 0.25
    if _SIDE.value:
        result = run_side(_SIDE.value, seconds, sample_s, _SEED.value)
        pathlib.Path(_CHILD_OUT.value).write_text(json.dumps(result) + "\n")
        return
    started = time.perf_counter()
    out_dir = pathlib.Path(_OUT.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    sides = {}
    # One after the other: two sides at once would share the 2 cores' time. A quick run only
    # checks that the benchmark works (its figures mean nothing): both sides at once.
    with concurrent.futures.ThreadPoolExecutor(len(SIDES) if _QUICK.value else 1) as pool:
        runs = {side: pool.submit(_run_child, side, seconds, sample_s, _SEED.value) for side in SIDES}
    for side in SIDES:
        sides[side] = runs[side].result()
        sides[side]["summary"] = summarise(sides[side])
        s = sides[side]["summary"]
        print(
            f"{side}: {sides[side]['requests']} requests, {s['programs_per_s']:.1f} programs/s, "
            f"RSS {s['rss_start_mib']:.0f} -> {s['rss_end_mib']:.0f} MiB, {sides[side]['wrong']} wrong values",
            flush=True,
        )
    jax_s, pw_s = sides["jax"]["summary"], sides["pw"]["summary"]
    report: dict[str, Any] = {
        "benchmark": "soak",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "quick": _QUICK.value,
        "config": {
            "seconds": seconds,
            "sample_s": sample_s,
            "seed": _SEED.value,
            "num_cpu_devices": NUM_DEVICES,
            "kinds": list(KINDS),
            "small_elements": SMALL,
            "const_mib": list(CONST_MIB),
            "calls_per_request": [1, 3],
        },
        "sides": sides,
        "ratios": {
            "programs_per_s_pw_over_jax": pw_s["programs_per_s"] / jax_s["programs_per_s"],
            "rss_growth_pw_minus_jax_mib": pw_s["rss_growth_mib"] - jax_s["rss_growth_mib"],
        },
    }
    report["table"] = _table(report)
    report["wall_s"] = time.perf_counter() - started
    name = "soak_quick" if _QUICK.value else "soak"
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / f"{name}.png")
    print(report["table"])
    print(
        f"pathways_jax / plain jax.jit: {pw_s['programs_per_s'] / jax_s['programs_per_s']:.2f}x programs/s; "
        f"RSS growth {pw_s['rss_growth_mib']:+.1f} MiB against {jax_s['rss_growth_mib']:+.1f} MiB"
    )
    flat = {
        side: {m: v for m, v in sides[side]["summary"]["slopes_per_min_second_half"].items() if v is not None}
        for side in SIDES
    }
    print("flatness (second-half slope per minute): " + json.dumps(flat))
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')} in {report['wall_s']:.0f} s")


def _machine() -> dict:
    """common.machine() of a JAX with the sides' device count (the parent process starts no JAX work)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
    return common.machine()


if __name__ == "__main__":
    app.run(main)
