"""What a simulation predicts: each run's record, each client's figures, and the summary of them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from pathways_jax.sim._state import Item, Run
from pathways_jax.sim._workload import Workload


@dataclasses.dataclass(frozen=True, slots=True)
class RunRecord:
    """When one simulated run was submitted, dispatched and done (seconds)."""

    client: str
    program: str
    index: int
    submitted: float
    dispatch_start: float
    dispatch_end: float
    done: float


@dataclasses.dataclass(frozen=True, slots=True)
class ClientStats:
    """One client's steady state: time per run and computations per second."""

    client: str
    runs: int
    step_time_s: float
    throughput: float


@dataclasses.dataclass(frozen=True, slots=True)
class SimResult:
    """What a simulation predicts.

    Attributes:
      makespan_s: from the first submission until the last step is done.
      step_time_s: time per run in the steady state (the mean gap between
        runs done after the first quarter; the whole time for a single run),
        of the first client.
      throughput: computations per second of all clients together in the steady state.
      utilisation: the fraction of device time busy, over all the cluster's
        devices, in the steady state.
      controller_busy: the fraction of the time the controller's thread is busy.
      clients: per-client figures.
      runs: every run's record.
      trace: the timeline as trace-event JSON (what ``pw.trace`` writes), or
        ``None`` if not recorded.
    """

    makespan_s: float
    step_time_s: float
    throughput: float
    utilisation: float
    controller_busy: float
    clients: tuple[ClientStats, ...]
    runs: tuple[RunRecord, ...]
    trace: dict | None


def summarise(
    workloads: Sequence[Workload],
    runs: Sequence[Run],
    items: Sequence[Item],
    spans: Sequence[tuple[float, float, int, int]],
    *,
    devices: int,
    controller_busy: float,
    trace: dict | None,
) -> SimResult:
    """The :class:`SimResult` of a finished simulation.

    Args:
      workloads: the clients' workloads, by client index.
      runs: every run, in submission order.
      items: every dispatched step of every run.
      spans: every node's ``(start, end, lo, hi)``: when it ran, on devices ``[lo, hi)``.
      devices: the cluster's device count.
      controller_busy: seconds the controller's thread was busy.
      trace: the timeline, if recorded.
    """
    records = tuple(
        RunRecord(
            workloads[r.client].client,
            workloads[r.client].program.name,
            r.index,
            r.submitted,
            r.dispatch_start,
            r.dispatch_end,
            float(r.items[workloads[r.client].program.output].end),
        )
        for r in runs
    )
    makespan = max(max(r.done for r in records), max(r.end for r in items))
    stats = []
    windows = []
    total_computations = 0.0
    for i, w in enumerate(workloads):
        done = sorted(rec.done for rec, r in zip(records, runs, strict=True) if r.client == i)
        first = len(done) // 4
        if len(done) >= 2 and done[-1] > done[first]:
            step = (done[-1] - done[first]) / (len(done) - 1 - first)
            windows.append((done[first], done[-1]))
        else:
            step = done[-1] if done else 0.0
            windows.append((0.0, done[-1] if done else 0.0))
        rate = w.program.computations / step if step > 0 else math.inf
        total_computations += rate
        stats.append(ClientStats(w.client, w.runs, step, rate))
    a = min(lo for lo, _ in windows)
    b = max(hi for _, hi in windows)
    if b <= a:
        a, b = 0.0, makespan
    busy = 0.0
    for start, end, lo, hi in spans:
        busy += max(0.0, min(end, b) - max(start, a)) * (hi - lo)
    utilisation = busy / (devices * (b - a)) if b > a else 0.0
    return SimResult(
        makespan_s=makespan,
        step_time_s=stats[0].step_time_s,
        throughput=total_computations,
        utilisation=utilisation,
        controller_busy=controller_busy / makespan if makespan > 0 else 0.0,
        clients=tuple(stats),
        runs=records,
        trace=trace,
    )
