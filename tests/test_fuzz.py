"""Fuzz: threads x short-lived clients x random program kinds x random closes; every result checked.

Each worker thread makes client after client (random priority and weight), and
inside each submits a random batch of program kinds: a single-device jit, 2- and
4-device sharded programs with an all-reduce, a multi-node ``@pw.program``,
a program spanning both islands (a DCN transfer), a host callback, a donating
``pw.jit``, and a program whose inner ``jax.jit`` donates a value the program
made. An input is a fresh array or, often, a future another call of
the same client returned (not yet read). Futures are read, dropped unread, or
left to a ``close()`` of their client, by the owner or, now and then, by
another thread while its runs are queued.

Every value that comes back must equal plain ``jax.jit`` on the same inputs; a
future whose client was closed may raise ``pw.errors.PathwaysError`` instead
(never another exception, never a hang). At the end the controller serves,
``pw.stats()`` answers, and once every future is dropped no bytes stay in use.

The choices are seeded: ``PW_FUZZ_SEED=<n>`` replays a run's choices (not its
thread interleaving); every failure message names the seed.
``PW_FUZZ_SECONDS`` sets how long the threads submit in each case.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

SEED = int(os.environ.get("PW_FUZZ_SEED", random.SystemRandom().randrange(2**31)))
SECONDS = float(os.environ.get("PW_FUZZ_SECONDS", "2.5"))  # submitting time per case
# Under load the threads go on past SECONDS, up to this much longer, until they did the work
# the checks below ask for: the amount of work is the test's, not the machine's.
SLACK_S = 40.0
THREADS = 5
SIZES = (16, 64)  # float32 elements of an input; divisible by every slice's device count
BUDGET = 1 << 20  # bytes per device; the values alive at once stay far below it
KINDS = ("single", "sharded2", "sharded4", "multinode", "islands", "callback", "donate", "inner_donate")


# --- the computations, shared by pathways_jax and the plain-jax.jit references ---------------


def _single(v):
    return jnp.sin(v) * 2.0 + 1.0


def _allreduce(v):  # over a sharded vector, the sum is an all-reduce
    return v * 0.5 + jnp.sum(v) / v.size


def _scale(v, k):
    return jnp.tanh(v * 0.9 + k)


def _host_cos(v):
    return np.cos(v).astype(v.dtype)


def _callback(v):
    return jax.pure_callback(_host_cos, jax.ShapeDtypeStruct(v.shape, v.dtype), v) + 1.0


def _update(v):
    return v * 0.5 - 1.0


_halve_in_place = jax.jit(lambda p: p * 0.5 - 0.25, donate_argnums=0)


def _inner_donate(v):  # an inner jit donates a value the program made
    return _halve_in_place(jnp.cos(v) + v)


def _multinode(v, k):  # the reference of the multi-node program
    return _allreduce(_scale(v, k))


def _islands(v):  # the reference of the two-island program
    return _allreduce(_allreduce(v) * 0.25)


@dataclasses.dataclass
class Kinds:
    """The pathways_jax program of each kind (built on the running cluster) and its reference."""

    programs: dict[str, Any]
    references: dict[str, Any]
    slices: list[pw.VirtualSlice]


def _kinds() -> Kinds:
    one0 = pw.devices(mesh={"x": 1}, island=0)
    two0 = pw.devices(mesh={"x": 2}, island=0)
    one1 = pw.devices(mesh={"x": 1}, island=1)
    four1 = pw.devices(mesh={"x": 4}, island=1)
    x = pw.P("x")
    single = pw.jit(_single, devices=one0)
    sharded2 = pw.jit(_allreduce, devices=two0, in_specs=x, out_specs=x)
    sharded4 = pw.jit(_allreduce, devices=four1, in_specs=x, out_specs=x)
    scale = pw.jit(_scale, devices=two0, in_specs=(x, None), out_specs=x)
    quarter = pw.jit(lambda v: v * 0.25, devices=two0, in_specs=x, out_specs=x)

    @pw.program(fuse=False)
    def multinode(v, k):  # two nodes on one slice
        return sharded2(scale(v, k))

    @pw.program
    def islands(v):  # island 0, then island 1 over DCN
        return sharded4(quarter(sharded2(v)))

    programs = {
        "single": single,
        "sharded2": sharded2,
        "sharded4": sharded4,
        "multinode": multinode,
        "islands": islands,
        "callback": pw.jit(_callback, devices=one1),
        "donate": pw.jit(_update, devices=one0, donate_argnums=0),
        "inner_donate": pw.program(_inner_donate, devices=two0),
    }
    references = {
        "single": jax.jit(_single),
        "sharded2": jax.jit(_allreduce),
        "sharded4": jax.jit(_allreduce),
        "multinode": jax.jit(_multinode),
        "islands": jax.jit(_islands),
        "callback": jax.jit(_callback),
        "donate": jax.jit(_update),
        "inner_donate": jax.jit(_inner_donate),
    }
    return Kinds(programs, references, [one0, two0, one1, four1])


# --- one worker thread -----------------------------------------------------------------------


@dataclasses.dataclass
class Tally:
    """What the workers did and saw (shared; updated under ``lock``)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    submitted: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    checked: int = 0  # values compared with the reference
    cancelled: int = 0  # futures of runs a close cancelled (ProgramFailedError)
    freed: int = 0  # futures of a closed client whose value was freed (PathwaysError)
    dropped: int = 0  # futures dropped unread
    clients: int = 0
    closes_by_owner: int = 0
    closes_by_others: int = 0
    refused_submissions: int = 0  # calls into a client another thread had closed
    errors: list[str] = dataclasses.field(default_factory=list)
    names: set[str] = dataclasses.field(default_factory=set)

    def add(self, field: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, field, getattr(self, field) + n)

    def error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text)


@dataclasses.dataclass
class Pending:
    future: Any
    want: np.ndarray
    kind: str
    chained: int  # how many program calls deep the value is


class Worker:
    """Makes short-lived clients and submits random program kinds into them until the deadline."""

    def __init__(
        self,
        index: int,
        case_seed: int,
        kinds: Kinds,
        tally: Tally,
        open_clients: dict,
        deadline: float,
        enough: Callable[[], bool] = lambda: True,
    ):
        self.index = index
        self.enough = enough
        self.rng = random.Random(case_seed * 1000 + index)
        self.kinds = kinds
        self.tally = tally
        self.open_clients = open_clients  # name -> Client, for closes by other threads
        self.deadline = deadline

    def __call__(self) -> None:
        try:
            generation = 0
            while time.monotonic() < self.deadline or (
                not self.enough() and time.monotonic() < self.deadline + SLACK_S
            ):
                self.one_client(f"t{self.index}-c{generation}")
                generation += 1
        except BaseException:
            self.tally.error(f"thread {self.index} raised outside a check:\n{traceback.format_exc()}")

    def fresh_input(self) -> np.ndarray:
        size = self.rng.choice(SIZES)
        return np.asarray(np.random.default_rng(self.rng.randrange(2**31)).standard_normal(size), np.float32)

    def one_client(self, name: str) -> None:
        rng, tally = self.rng, self.tally
        client = pw.client(name, priority=rng.randrange(4), weight=rng.choice([0.5, 1.0, 2.0, 4.0]))
        tally.add("clients")
        with tally.lock:
            tally.names.add(name)
            self.open_clients[name] = client
        pending: list[Pending] = []
        with client:
            for _ in range(rng.randint(1, 14)):
                if client.closed:
                    break
                try:
                    self.submit(pending)
                except pw.errors.PathwaysError as exc:
                    if not client.closed:  # refused for no reason
                        raise
                    if not isinstance(exc, pw.errors.ClusterError) or "closed" not in str(exc):
                        raise
                    tally.add("refused_submissions")
                    break
                roll = rng.random()
                if roll < 0.15 and pending:  # read one now; it may still feed later calls
                    self.check(pending[rng.randrange(len(pending))], client)
                elif roll < 0.25 and pending:  # drop one unread
                    pending.pop(rng.randrange(len(pending)))
                    tally.add("dropped")
                elif roll < 0.30:  # close while runs are queued
                    client.close()
                    tally.add("closes_by_owner")
                elif roll < 0.33:  # close another thread's client
                    with tally.lock:
                        others = [c for n, c in self.open_clients.items() if n != name]
                    if others:
                        rng.choice(others).close()
                        tally.add("closes_by_others")
        if rng.random() < 0.3 and not client.closed:  # close before anything is read
            client.close()
            tally.add("closes_by_owner")
        rng.shuffle(pending)
        for item in pending:
            self.check(item, client)
        if rng.random() < 0.8:
            client.close()  # short-lived; the rest are dropped open
        with tally.lock:
            self.open_clients.pop(name, None)

    def submit(self, pending: list[Pending]) -> None:
        """Calls one random program kind on a fresh input or on an earlier call's future."""
        rng, kinds = self.rng, self.kinds
        kind = rng.choice(KINDS)
        program, reference = kinds.programs[kind], kinds.references[kind]
        if pending and rng.random() < 0.5:  # chain: feed an earlier call's future (read or not)
            source = rng.randrange(len(pending))
            arg, want, depth = pending[source].future, pending[source].want, pending[source].chained
            if kind == "donate":  # the test never reuses a future it donated
                pending.pop(source)
        else:
            want = self.fresh_input()
            arg = jnp.asarray(want) if rng.random() < 0.5 else want
            depth = 0
            if kind == "donate":  # donate an intermediate future, never seen again
                arg = kinds.programs["single"](arg)
                want = np.asarray(kinds.references["single"](want))
        if kind == "multinode":
            k = np.float32(rng.choice([0.0, 0.5, -1.0]))
            out, ref = program(arg, k), reference(want, k)
        else:
            out, ref = program(arg), reference(want)
        del arg
        with self.tally.lock:
            self.tally.submitted[kind] += 1
        pending.append(Pending(out, np.asarray(ref), kind, depth + 1))

    def check(self, item: Pending, client: pw.Client) -> None:
        """The value equals the reference, or its client was closed and it raises PathwaysError."""
        where = f"seed={SEED} thread={self.index} client={client.name} kind={item.kind} depth={item.chained}"
        try:
            got = item.future.result(timeout=60)
        except pw.errors.FutureTimeoutError:
            self.tally.error(f"{where}: no result within 60 s (a hang)\n{traceback.format_exc()}")
            return
        except pw.errors.PathwaysError as exc:
            if client.closed:
                self.tally.add("cancelled" if isinstance(exc, pw.errors.ProgramFailedError) else "freed")
            else:
                self.tally.error(f"{where}: raised though its client is open\n{traceback.format_exc()}")
            return
        except BaseException:
            self.tally.error(f"{where}: raised a non-pathways error\n{traceback.format_exc()}")
            return
        try:
            assert got.shape == item.want.shape and got.dtype == item.want.dtype, (got.shape, got.dtype)
            np.testing.assert_allclose(np.asarray(got), item.want, rtol=1e-5, atol=1e-5)
        except AssertionError:
            self.tally.error(f"{where}: wrong value\n{traceback.format_exc()}")
            return
        self.tally.add("checked")


# --- the test --------------------------------------------------------------------------------


def _bytes_in_use() -> dict[int, int]:
    return {d: v["bytes_in_use"] for d, v in pw.stats()["devices"].items() if v["bytes_in_use"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [None, BUDGET], ids=["no-budget", "budget"])
@pytest.mark.parametrize("policy", ["fifo", "priority", "fair"])
def test_fuzz_clients_programs_and_closes(policy, budget):
    case_seed = SEED + 7 * ["fifo", "priority", "fair"].index(policy) + (budget is not None)
    print(f"fuzz seed {SEED} (PW_FUZZ_SEED={SEED} replays it), case seed {case_seed}")
    pw.init(num_cpu_devices=8, islands=2, scheduler=policy, memory_budget=budget)
    kinds = _kinds()
    # Compile every kind once, off the clock, so the threads spend their time fuzzing.
    warm = np.linspace(-1, 1, SIZES[0], dtype=np.float32)
    for kind in KINDS:
        args = (warm, np.float32(0.5)) if kind == "multinode" else (warm,)
        np.testing.assert_allclose(
            np.asarray(kinds.programs[kind](*args).result(timeout=60)),
            np.asarray(kinds.references[kind](*args)),
            rtol=1e-5,
            atol=1e-5,
        )
    gc.collect()
    baseline = pw.cluster().store.live_count()

    tally, open_clients = Tally(), {}
    deadline = time.monotonic() + SECONDS

    def enough() -> bool:  # what the checks below ask of the fuzz
        return tally.checked > 10 * THREADS and tally.clients > 2 * THREADS

    threads = [
        threading.Thread(
            target=Worker(i, case_seed, kinds, tally, open_clients, deadline, enough), name=f"fuzz-{i}"
        )
        for i in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline + SLACK_S + 30 - time.monotonic()))
    seed = f"seed {SEED} (case {case_seed}, {policy}, budget={budget})"
    assert not any(t.is_alive() for t in threads), f"{seed}: worker threads still running (a hang)"
    assert not tally.errors, f"{seed}: {len(tally.errors)} failures; the first:\n" + tally.errors[0]
    # The fuzz did real work: every kind ran, values were compared, clients came and went.
    summary = (
        f"{seed}: submitted {tally.submitted}, checked {tally.checked}, cancelled {tally.cancelled}, "
        f"freed {tally.freed}, "
        f"dropped {tally.dropped}, {tally.clients} clients, closes {tally.closes_by_owner} by owner / "
        f"{tally.closes_by_others} by other threads, {tally.refused_submissions} refused submissions"
    )
    print(summary)
    assert all(tally.submitted[k] > 0 for k in KINDS), summary
    assert tally.checked > 10 * THREADS and tally.clients > 2 * THREADS, summary

    # The controller still serves, on both islands, and reports.
    assert pw.cluster().controller.alive, seed
    probe = np.linspace(0, 1, SIZES[1], dtype=np.float32)
    for kind in KINDS:
        args = (probe, np.float32(-1.0)) if kind == "multinode" else (probe,)
        np.testing.assert_allclose(
            np.asarray(kinds.programs[kind](*args).result(timeout=60)),
            np.asarray(kinds.references[kind](*args)),
            rtol=1e-5,
            atol=1e-5,
            err_msg=f"{seed}: {kind} after the fuzz",
        )
    stats = pw.stats()
    assert stats["scheduler"] == policy
    # The fuzz's clients are accounted: each by name while open, summed in one row once closed
    # (under load few clients are made, and every one may have been closed); each value the
    # fuzz checked was a program run of one of them.
    fuzz_rows = {n: row for n, row in stats["clients"].items() if n != "default"}
    assert set(fuzz_rows) <= tally.names | {"(closed clients)"}, (seed, set(fuzz_rows))
    assert set(fuzz_rows) & tally.names or fuzz_rows["(closed clients)"]["clients"] > 0, (seed, fuzz_rows)
    assert sum(row["programs"] for row in fuzz_rows.values()) >= tally.checked, (seed, fuzz_rows)
    assert all(v["queued"] == 0 for v in stats["clients"].values()), (seed, stats["clients"])

    # Once every future is gone, nothing stays alive and no bytes stay in use.
    del threads
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        live, in_use = pw.cluster().store.live_count(), _bytes_in_use()
        if (live == baseline and not in_use) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert live == baseline, f"{seed}: {live - baseline} values still alive"
    assert not in_use, f"{seed}: bytes still in use per device: {in_use}"
    for s in kinds.slices:
        s.release()
