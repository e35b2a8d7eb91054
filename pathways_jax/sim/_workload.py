"""What the simulator runs: programs of steps (nodes and transfers) on device ranges, and workloads.

A :class:`SimProgram` is the simulator's form of a lowered plan: its steps in
dispatch order, each on a ``[start, stop)`` range of the cluster's devices with
its device time already worked out from the profile. :func:`from_graph` builds
one from a traced ``pw.Graph``; the other builders make the synthetic workloads
of the scale study (the dispatch benchmark, SPMD, pipelines, two islands). A
:class:`Workload` is one client's stream of runs of a program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from pathways_jax import errors
from pathways_jax.sim._cluster import SimCluster

PREVIOUS_RUN = -1  # an input that is the previous run's output (futures chained run to run)


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One node or transfer of a :class:`SimProgram`.

    Attributes:
      kind: ``"node"`` (a compiled executable on ``devices``) or ``"transfer"``
        (a value moving from ``src`` to ``devices``).
      name: what the timeline calls it.
      devices: ``[start, stop)``: the devices it runs on (a transfer: its destination).
      duration_s: device (or link) time.
      inputs: earlier steps whose outputs it reads (``PREVIOUS_RUN``: the
        previous run's last step).
      src: a transfer's source devices.
      link: a transfer's link, ``"ici"`` or ``"dcn"``.
      nbytes: a transfer's bytes.
      windowed: counts against the in-flight window (multi-device executables).
    """

    kind: Literal["node", "transfer"]
    name: str
    devices: tuple[int, int]
    duration_s: float
    inputs: tuple[int, ...] = ()
    src: tuple[int, int] | None = None
    link: Literal["ici", "dcn"] | None = None
    nbytes: int = 0
    windowed: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class SimProgram:
    """A program as the simulator runs it: its steps in dispatch order.

    Attributes:
      name: the program's name.
      steps: nodes and transfers, in the order the controller dispatches them.
      computations: the units of work one run does (a dispatch benchmark's
        computations; 1 otherwise): throughput is reported per computation.
      output: the step whose result is the run's output (default: the last).
    """

    name: str
    steps: tuple[Step, ...]
    computations: int = 1
    output: int = -1

    def check(self, cluster: SimCluster) -> SimProgram:
        """Validates the steps against ``cluster``.

        Raises:
          ResourceError: a step is on devices the cluster lacks, or reads a later step.
        """
        if not self.steps:
            raise errors.ResourceError(f"sim program {self.name!r} has no steps.")
        for i, step in enumerate(self.steps):
            for lo, hi in (step.devices, step.src or step.devices):
                if not 0 <= lo < hi <= cluster.devices:
                    raise errors.ResourceError(
                        f"sim program {self.name!r} step {i} ({step.name}) is on devices [{lo}, {hi}); "
                        f"the cluster has {cluster.devices} (hosts={cluster.hosts} x "
                        f"devices_per_host={cluster.devices_per_host})."
                    )
            if step.duration_s < 0:
                raise errors.ResourceError(f"step {step.name} has a negative duration {step.duration_s}.")
            for j in step.inputs:
                if j != PREVIOUS_RUN and not 0 <= j < i:
                    raise errors.ResourceError(
                        f"sim program {self.name!r} step {i} ({step.name}) reads step {j}, not an earlier one."
                    )
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """One client's stream of runs of one program.

    Attributes:
      program: what each run runs.
      runs: how many runs the client submits.
      client: the client's name (the timeline colours by it).
      interval_s: seconds between the client's submissions (0: all at once,
        interleaved with other clients' submissions at the same instant).
      chained: each run's first steps read the previous run's output.
      weight: the client's share under the ``"fair"`` scheduler.
      priority: the client's priority under the ``"priority"`` scheduler.
    """

    program: SimProgram
    runs: int = 1
    client: str = "default"
    interval_s: float = 0.0
    chained: bool = True
    weight: float = 1.0
    priority: int = 0


def node_time(
    cluster: SimCluster, devices: int, *, computations: int = 1, compute_s: float | None = None
) -> float:
    """Device time of one node on ``devices`` devices: launch, then its computations.

    ``compute_s`` (seconds of work per computation) defaults to the profile's
    time for one dispatch-benchmark computation (a scalar all-reduce and an add).
    """
    device = cluster.profile.device
    per = device.computation(devices) if compute_s is None else compute_s
    return device.launch(devices) + computations * per


def _range(cluster: SimCluster, devices: tuple[int, int] | None) -> tuple[int, int]:
    return (0, cluster.devices_per_island) if devices is None else devices


def chain(
    cluster: SimCluster,
    nodes: int,
    *,
    compute_s: float | None = None,
    devices: tuple[int, int] | None = None,
    name: str = "chain",
) -> SimProgram:
    """``nodes`` nodes, each reading the one before (the first reads the previous run's output).

    Args:
      cluster: the simulated cluster.
      nodes: how many nodes.
      compute_s: device time of each node on top of its launch (default: one
        dispatch-benchmark computation).
      devices: the ``[start, stop)`` devices of every node (default: island 0).
      name: the program's name.
    """
    lo, hi = _range(cluster, devices)
    dur = node_time(cluster, hi - lo, compute_s=compute_s)
    steps = tuple(
        Step("node", f"n{i}", (lo, hi), dur, inputs=(i - 1 if i else PREVIOUS_RUN,), windowed=hi - lo > 1)
        for i in range(nodes)
    )
    return SimProgram(name, steps, computations=nodes)


def dispatch_mode(
    cluster: SimCluster,
    mode: Literal["O", "C", "F"],
    *,
    chain_length: int = 128,
    compute_s: float | None = None,
    spread: Literal["island", "hosts"] = "island",
) -> SimProgram:
    """One run of the dispatch benchmark's mode: ``O`` one computation, ``C`` a chain, ``F`` fused.

    Args:
      cluster: the simulated cluster.
      mode: ``"O"``: one node of one computation per run (op by op);
        ``"C"``: ``chain_length`` nodes of one computation each; ``"F"``: one
        node holding ``chain_length`` computations.
      chain_length: computations per run of ``C`` and ``F``.
      compute_s: device time of one computation (default: the profile's).
      spread: ``"island"``: every node spans all devices of island 0 (SPMD with
        a collective: the local and TPU benchmarks); ``"hosts"``: every
        computation is one node on each host, side by side (the Ray benchmark:
        each host is an island).
    """
    if mode not in ("O", "C", "F"):
        raise errors.ResourceError(f"dispatch mode must be 'O', 'C' or 'F', got {mode!r}.")
    length = 1 if mode == "O" else chain_length
    per_node = length if mode == "F" else 1
    nodes = 1 if mode in ("O", "F") else chain_length
    if spread == "island":
        groups = [_range(cluster, None)]
    else:
        d = cluster.devices_per_host
        groups = [(h * d, (h + 1) * d) for h in range(cluster.hosts)]
    steps: list[Step] = []
    last: list[int] = [PREVIOUS_RUN] * len(groups)
    for i in range(nodes):
        for g, (lo, hi) in enumerate(groups):
            dur = node_time(cluster, hi - lo, computations=per_node, compute_s=compute_s)
            steps.append(Step("node", f"c{i}@{lo}", (lo, hi), dur, inputs=(last[g],), windowed=hi - lo > 1))
            last[g] = len(steps) - 1
    return SimProgram(f"dispatch-{mode}", tuple(steps), computations=length)


def spmd(
    cluster: SimCluster,
    compute_s: float,
    *,
    all_reduce_bytes: int = 0,
    devices: tuple[int, int] | None = None,
    name: str = "spmd",
) -> SimProgram:
    """One SPMD node over ``devices`` (default: island 0): compute, then an ICI all-reduce."""
    lo, hi = _range(cluster, devices)
    dur = (
        cluster.profile.device.launch(hi - lo)
        + compute_s
        + cluster.profile.ici.all_reduce(all_reduce_bytes, hi - lo)
    )
    return SimProgram(name, (Step("node", "step", (lo, hi), dur, inputs=(PREVIOUS_RUN,)),))


def pipeline(
    cluster: SimCluster,
    stages: int,
    microbatches: int,
    stage_s: float,
    *,
    activation_bytes: int = 0,
    backward: bool = True,
    name: str = "pipeline",
) -> SimProgram:
    """A GPipe step: island 0 split into ``stages`` slices; every microbatch through every stage.

    Node ``(stage, microbatch)`` lasts ``stage_s`` forward (twice that backward)
    and its activations move to the next stage over ICI. The controller
    dispatches forward in microbatch order, then backward in reverse stage order.

    Raises:
      ResourceError: the island's devices do not split into ``stages``.
    """
    lo, hi = _range(cluster, None)
    if (hi - lo) % stages:
        raise errors.ResourceError(f"{hi - lo} devices do not split into {stages} pipeline stages.")
    per = (hi - lo) // stages
    launch = cluster.profile.device.launch(per)
    ici = cluster.profile.ici
    steps: list[Step] = []
    fwd: dict[tuple[int, int], int] = {}

    def add(step: Step) -> int:
        steps.append(step)
        return len(steps) - 1

    for m in range(microbatches):
        for s in range(stages):
            devs = (lo + s * per, lo + (s + 1) * per)
            inputs: tuple[int, ...] = (PREVIOUS_RUN,) if s == 0 else ()
            if s:
                prev = (lo + (s - 1) * per, lo + s * per)
                t = add(
                    Step(
                        "transfer", f"act s{s - 1}->s{s} mb{m}", devs, ici.transfer(activation_bytes),
                        inputs=(fwd[s - 1, m],), src=prev, link="ici", nbytes=activation_bytes,
                    )
                )  # fmt: skip
                inputs = (t,)
            fwd[s, m] = add(Step("node", f"fwd s{s} mb{m}", devs, launch + stage_s, inputs=inputs))
    if backward:
        bwd: dict[tuple[int, int], int] = {}
        for m in range(microbatches):
            for s in reversed(range(stages)):
                devs = (lo + s * per, lo + (s + 1) * per)
                inputs = (fwd[s, m],)
                if s < stages - 1:
                    nxt = (lo + (s + 1) * per, lo + (s + 2) * per)
                    t = add(
                        Step(
                            "transfer", f"grad s{s + 1}->s{s} mb{m}", devs, ici.transfer(activation_bytes),
                            inputs=(bwd[s + 1, m],), src=nxt, link="ici", nbytes=activation_bytes,
                        )
                    )  # fmt: skip
                    inputs = (fwd[s, m], t)
                bwd[s, m] = add(Step("node", f"bwd s{s} mb{m}", devs, launch + 2 * stage_s, inputs=inputs))
    return SimProgram(name, tuple(steps), computations=microbatches)


def two_islands(
    cluster: SimCluster,
    compute_s: float,
    gradient_bytes: int,
    *,
    apply_s: float = 0.0,
    all_reduce_bytes: int = 0,
    name: str = "two_islands",
) -> SimProgram:
    """Data parallel over two islands: each computes gradients, sends them over DCN, applies both.

    Each island's gradient node (``compute_s`` plus an ICI all-reduce of
    ``all_reduce_bytes``) is followed by a DCN transfer of ``gradient_bytes`` to
    the other island (sharded over the island's hosts) and an apply node that
    reads the local and the received gradients.

    Raises:
      ResourceError: the cluster does not have exactly two islands.
    """
    if cluster.islands != 2:
        raise errors.ResourceError(f"two_islands needs a cluster of 2 islands, got {cluster.islands}.")
    prof = cluster.profile
    ranges = [cluster.island_devices(i) for i in (0, 1)]
    steps: list[Step] = []
    grads = []
    for i, (lo, hi) in enumerate(ranges):
        dur = prof.device.launch(hi - lo) + compute_s + prof.ici.all_reduce(all_reduce_bytes, hi - lo)
        steps.append(Step("node", f"grads island {i}", (lo, hi), dur, inputs=(PREVIOUS_RUN,)))
        grads.append(len(steps) - 1)
    moved = []
    for i, (lo, hi) in enumerate(ranges):
        other = ranges[1 - i]
        dur = prof.dcn.transfer(gradient_bytes, parallel=cluster.hosts_per_island)
        steps.append(
            Step(
                "transfer", f"grads {1 - i}->{i}", (lo, hi), dur, inputs=(grads[1 - i],), src=other,
                link="dcn", nbytes=gradient_bytes,
            )
        )  # fmt: skip
        moved.append(len(steps) - 1)
    for i, (lo, hi) in enumerate(ranges):
        dur = prof.device.launch(hi - lo) + apply_s
        steps.append(Step("node", f"apply island {i}", (lo, hi), dur, inputs=(grads[i], moved[i])))
    return SimProgram(name, tuple(steps))


def concat(name: str, programs: Sequence[SimProgram]) -> SimProgram:
    """Programs one after another in one run (each reads what the one before wrote last)."""
    steps: list[Step] = []
    for prog in programs:
        base = len(steps)
        prev = len(steps) - 1 if steps else PREVIOUS_RUN
        for step in prog.steps:
            inputs = tuple(prev if j == PREVIOUS_RUN else base + j for j in step.inputs)
            steps.append(dataclasses.replace(step, inputs=inputs))
    return SimProgram(name, tuple(steps), computations=sum(p.computations for p in programs))
