"""A client process of a controller service, for tests/test_service.py (run as a subprocess).

    python tests/service_client.py ADDRESS SERVICE NAME DIR MODE [ARGS...]

It joins service SERVICE at ADDRESS (waiting for it to start, up to 120 s) as
client NAME and writes what it saw to
DIR/NAME.json (``{"state": ..., ...}``); it stops when DIR/stop appears.
Modes:

  collective ORDER N  N all-reduce programs over the island's 4 devices in
                      ORDER ("forward": sum; "reverse": max x 2, the devices
                      reversed), each result checked against numpy
  busy WEIGHT [PRIO [SIZE]]  a matmul loop on a SIZE-device slice (rows
                      split) under pw.client(NAME, weight=WEIGHT, priority=PRIO),
                      8 runs in flight, until stopped
  busy-series SVC:WEIGHT:PRIO:SIZE ...  "busy" in each service SVC in turn (SERVICE
                      is the first), each until DIR/stop-SVC appears, then leaves
                      it and joins the next; its states are "running SVC", "done SVC"
  hold K              K values kept, then runs queued without end (to be killed)
  pause K             K values kept; once DIR/resume appears (the test stops and
                      resumes this process meanwhile), one more program, whose
                      error is reported
  share READER        a value shared with READER (then donated) and one not shared: their
                      handles pickled to DIR/NAME.handles
  read OWNER          receives OWNER's handles: the unshared one must be
                      refused, the shared one read and checked, received again
                      (the first future dropped) and read, then donated to a
                      program and read again; once DIR/owner-gone
                      appears (the test kills OWNER), read again
  orders              one function on the island's 4 devices in order
                      [0, 1, 2, 3], then in order [3, 2, 1, 0], each
                      result checked against numpy
  mixed SIDE ROUNDS N two collective programs alternated N times a round
                      (SIDE "a": on devices [0, 1, 2, 3] and [2, 0]; "b": the
                      same two on [3, 2, 1, 0] and [0, 2]), every result checked; each
                      round starts when DIR/go-K appears
"""

from __future__ import annotations

import gc
import json
import pathlib
import pickle
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pathways_jax as pw


def main() -> None:
    address, service, name, folder, mode, *args = sys.argv[1:]
    out = pathlib.Path(folder)
    report = out / f"{name}.json"

    def say(**what) -> None:
        tmp = report.with_suffix(".tmp")
        tmp.write_text(json.dumps(what))
        tmp.replace(report)

    def stopped() -> bool:
        return (out / "stop").exists()

    try:
        if mode == "busy-series":
            busy_series(address, name, out, args, say)
            return
        _wait_for(address, service, stopped)
        pw.init(backend="ray", address=address, service=service, client_name=name)
        if mode == "collective":
            collective(args[0], int(args[1]), say)
        elif mode == "busy":
            priority = int(args[1]) if len(args) > 1 else 0
            busy(name, float(args[0]), priority, int(args[2]) if len(args) > 2 else 1, say, stopped)
        elif mode == "hold":
            hold(int(args[0]), say, stopped)
        elif mode == "pause":
            pause(int(args[0]), out / "resume", say)
        elif mode == "share":
            share(args[0], out / f"{name}.handles", say, stopped)
        elif mode == "read":
            read(out / f"{args[0]}.handles", say)
        elif mode == "orders":
            orders(say)
        elif mode == "mixed":
            mixed(args[0], int(args[1]), int(args[2]), out, say)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except BaseException as exc:
        say(state="error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        raise
    finally:
        pw.shutdown()


def _wait_for(address: str, service: str, stopped, timeout: float = 120.0) -> None:
    """Returns once service SERVICE runs: a test may start this process first, then the service."""
    deadline = time.monotonic() + timeout
    while not stopped():
        try:
            pw.service(service, address=address)
            return
        except pw.errors.ClusterError as exc:
            if "no controller service named" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.05)
    raise SystemExit(f"stopped before service {service!r} ran")


def collective(order: str, n: int, say) -> None:
    ids = [0, 1, 2, 3] if order == "forward" else [3, 2, 1, 0]
    s = pw.devices(mesh={"x": 4}, device_ids=ids)
    if order == "forward":
        fn = pw.jit(lambda x: jnp.sum(x, keepdims=True), devices=s, in_specs=(pw.P("x"),), out_specs=pw.P())
    else:
        fn = pw.jit(
            lambda x: jnp.max(x, keepdims=True) * 2, devices=s, in_specs=(pw.P("x"),), out_specs=pw.P()
        )
    rng = np.random.default_rng(0 if order == "forward" else 1)
    inputs = [rng.integers(0, 1000, size=8).astype(np.float32) for _ in range(n)]
    futures = [fn(x) for x in inputs]
    bad = []
    for i, (x, f) in enumerate(zip(inputs, futures, strict=True)):
        want = x.sum() if order == "forward" else x.max() * 2
        got = float(np.asarray(f.result(timeout=120))[0])
        if got != want:
            bad.append([i, got, float(want)])
    say(state="done", runs=n, bad=bad)


def orders(say) -> None:
    def fn(x):
        return jnp.cumsum(x) * 2

    x = np.arange(16, dtype=np.float32)
    want = np.asarray(jax.jit(fn)(x))
    bad = []
    for ids in ([0, 1, 2, 3], [3, 2, 1, 0], [0, 1, 2, 3]):
        s = pw.devices(mesh={"x": 4}, device_ids=ids)
        f = pw.jit(fn, devices=s, in_specs=pw.P("x"), out_specs=pw.P("x"))
        got = np.asarray(f(x).result(timeout=120))
        if not np.array_equal(got, want):
            bad.append([ids, got.tolist()])
    say(state="done", bad=bad)


def mixed(side: str, rounds: int, n: int, out: pathlib.Path, say) -> None:
    wide = pw.devices(mesh={"x": 4}, device_ids=[0, 1, 2, 3] if side == "a" else [3, 2, 1, 0])
    pair = pw.devices(mesh={"x": 2}, device_ids=[2, 0] if side == "a" else [0, 2])
    scale = 3.0  # the same computations in both processes, on their devices in other orders
    f = pw.jit(
        lambda x: jnp.sum(x, keepdims=True) * scale, devices=wide, in_specs=pw.P("x"), out_specs=pw.P()
    )
    g = pw.jit(
        lambda x: jnp.max(x, keepdims=True) + scale, devices=pair, in_specs=pw.P("x"), out_specs=pw.P()
    )
    rng = np.random.default_rng(0 if side == "a" else 1)
    bad: list = []
    for r in range(rounds):
        deadline = time.monotonic() + 120
        while not (out / f"go-{r}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {r} never started")
            time.sleep(0.005)
        xs = [rng.integers(0, 100, size=8 if i % 2 == 0 else 4).astype(np.float32) for i in range(n)]
        outs = [(f if i % 2 == 0 else g)(x) for i, x in enumerate(xs)]
        for i, (x, o) in enumerate(zip(xs, outs, strict=True)):
            want = x.sum() * scale if i % 2 == 0 else x.max() + scale
            got = float(np.asarray(o.result(timeout=60))[0])
            if got != want:
                bad.append([r, i, got, float(want)])
        say(state="round", round=r + 1, bad=bad)
    say(state="done", round=rounds, bad=bad)


def busy(name: str, weight: float, priority: int, size: int, say, stopped) -> None:
    s = pw.devices(mesh={"x": size})
    m = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32) / 16)
    # Tens of ms of device time each: two clients submit faster than the device
    # runs, so their runs queue at the service and its policy chooses.
    work = pw.jit(
        lambda v: jax.lax.fori_loop(0, 100 // size, lambda i, u: jnp.tanh(u @ m), v),
        devices=s,
        in_specs=(pw.P("x"),),
        out_specs=pw.P("x"),
    )
    v = jnp.ones((256, 256), jnp.float32)
    runs = 0
    in_flight: list = []
    with pw.client(name, weight=weight, priority=priority):
        while not stopped():
            in_flight.append(work(v))
            if len(in_flight) >= 8:
                in_flight.pop(0).block_until_ready()
                runs += 1
                if runs % 10 == 0:
                    say(state="running", runs=runs)
    want = np.asarray(
        jax.jit(lambda v: jax.lax.fori_loop(0, 100 // size, lambda i, u: jnp.tanh(u @ m), v))(v)
    )
    exact = bool(np.allclose(np.asarray(in_flight[-1].result(timeout=120)), want, atol=1e-5))
    say(state="done", runs=runs, exact=exact)


def busy_series(address: str, name: str, out: pathlib.Path, services: list[str], say) -> None:
    """``busy`` in each service in turn: one process for several (a process start costs seconds)."""
    for entry in services:
        service, weight, priority, size = entry.split(":")

        def stopped(service=service) -> bool:
            return (out / f"stop-{service}").exists() or (out / "stop").exists()

        def said(service=service, **what) -> None:
            say(**{**what, "state": f"{what['state']} {service}"})

        _wait_for(address, service, stopped)
        pw.init(backend="ray", address=address, service=service, client_name=name)
        try:
            busy(name, float(weight), int(priority), int(size), said, stopped)
        finally:
            pw.shutdown()


def _holding(k: int, say) -> tuple:
    """``k`` values made and kept on a 1-device slice (said once they are); the slice, its maker, the values."""
    s = pw.devices(mesh={"x": 1})
    make = pw.jit(lambda i: jnp.full((256,), i, jnp.float32), devices=s)
    kept = [make(jnp.float32(i)) for i in range(k)]
    for f in kept:
        f.block_until_ready()
    say(state="holding", values=k)
    return s, make, kept


def hold(k: int, say, stopped) -> None:
    s, _, kept = _holding(k, say)
    slow = pw.jit(lambda v: jax.lax.fori_loop(0, 200, lambda i, u: jnp.sin(u) + 1.0, v), devices=s)
    while not stopped():  # queued runs without end, until the process is killed
        kept.append(slow(kept[-1]))
        if len(kept) > k + 64:
            kept[k].block_until_ready()
            del kept[k]


def pause(k: int, resume: pathlib.Path, say) -> None:
    _, make, _ = _holding(k, say)
    while not resume.exists():
        time.sleep(0.05)
    started = time.monotonic()
    try:
        make(jnp.float32(k)).result()
    except Exception as exc:  # what a process the service dropped meets
        say(state="refused", error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - started)
    else:
        say(state="served")


def share(reader: str, path: pathlib.Path, say, stopped) -> None:
    deadline = time.monotonic() + 120
    while not any(c["name"] == reader and c["alive"] for c in pw.stats()["service"]["clients"].values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"client {reader!r} did not join the service")
        time.sleep(0.1)
    s = pw.devices(mesh={"x": 2})
    make = pw.jit(lambda v: v * 3 + 1, devices=s, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    shared = make(jnp.arange(8.0))
    private = make(jnp.arange(8.0) * 2)
    handles = {"shared": pw.share(shared, client=reader), "private": pw.share(private)}
    tmp = path.with_suffix(".part")
    tmp.write_bytes(pickle.dumps(handles))
    tmp.replace(path)
    # The owner donates the value it shared: the hosts consume a copy, the reader's value stays.
    consume = pw.jit(lambda v: v * 2, devices=s, in_specs=(pw.P("x"),), out_specs=pw.P("x"), donate_argnums=0)
    consumed = np.asarray(consume(shared).result(timeout=60)).tolist()
    say(state="shared", consumed=consumed)
    while not stopped():
        time.sleep(0.05)


def read(path: pathlib.Path, say) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():  # the owner shares once this process has joined
        if time.monotonic() > deadline:
            raise TimeoutError(f"no handles at {path}")
        time.sleep(0.05)
    time.sleep(0.2)  # written whole: it is renamed into place
    handles = pickle.loads(path.read_bytes())
    shared = pw.receive(handles["shared"])
    private = pw.receive(handles["private"])
    refused = []
    try:
        private.result(timeout=60)
    except pw.errors.AccessError as exc:
        refused.append(f"fetch: {exc}")
    s = pw.devices(mesh={"x": 2})
    double = pw.jit(lambda v: v * 2, devices=s, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    try:
        double(private).result(timeout=60)
    except pw.errors.AccessError as exc:
        refused.append(f"run: {exc}")
    got_shared = np.asarray(shared.result(timeout=60)).tolist()
    doubled = np.asarray(double(shared).result(timeout=60)).tolist()
    # Received again, the first future dropped (its free sent): the second still reads.
    again = pw.receive(handles["shared"])
    del shared
    gc.collect()
    pw.stats()  # collects dropped futures; their frees go out within 50 ms
    time.sleep(0.5)
    got_again = np.asarray(double(again).result(timeout=60)).tolist()
    # A received value donated: the hosts consume a copy, the owner's value stays (and so does
    # this process's other future of it).
    consume = pw.jit(lambda v: v * 2, devices=s, in_specs=(pw.P("x"),), out_specs=pw.P("x"), donate_argnums=0)
    consumed = np.asarray(consume(pw.receive(handles["shared"])).result(timeout=60)).tolist()
    still = np.asarray(again.result(timeout=60)).tolist()
    say(
        state="done",
        refused=refused,
        shared=got_shared,
        doubled=doubled,
        again=got_again,
        consumed=consumed,
        still=still,
    )
    deadline = time.monotonic() + 120
    while not (path.parent / "owner-gone").exists():  # the test kills the owner meanwhile
        if time.monotonic() > deadline:
            raise TimeoutError("the owner was not killed")
        time.sleep(0.05)
    after = np.asarray(again.result(timeout=60)).tolist()  # a receiver's future keeps the value
    say(state="after", after=after)


if __name__ == "__main__":
    main()
