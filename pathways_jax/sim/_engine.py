"""The discrete-event model of the controller, hosts and devices, on SimPy.

What is modelled (each charged from the cluster's :class:`Profile`):

- **Clients** submit runs (each client's runs in order, every ``interval_s``;
  a run's first step reads the previous run's output, as chained futures do).
- **The controller** is one thread: per run ``controller.run_s``, per node
  ``controller.node_s`` (on the local backend ``controller.run(k)`` for a run
  whose widest node is on ``k`` devices and ``controller.node(k)`` for a node
  on ``k``, where the profile has them by device count), per transfer
  ``controller.transfer_s`` (sending runs
  to hosts: ``hosts.dispatch_s`` more per run, ``hosts.node_s`` per node or
  transfer instead). Among the
  clients' queue heads the cluster's policy (the runtime's own ``fifo`` /
  ``fair`` / ``priority`` objects) picks the next run.
- **Dispatch.** ``local``: the controller enqueues each executable itself. ``hosts``:
  after its per-node work the controller sends each host the run touches ONE
  message (``hosts.message_s`` each, one after another); it reaches the host
  ``hosts.latency_s`` later, and the host's own thread pays ``hosts.run_s``
  and ``hosts.enqueue_s`` per step. All hosts enqueue in parallel. With
  ``SimCluster(fanout="tree")`` the controller sends to ``fanout_degree`` hosts
  a round and each host reached forwards the message (``hosts.message_s``
  each, on its own thread, before its own part) to as many more a round;
  with ``SimCluster(fanout="broadcast")`` it sends ONE message for all
  (``hosts.broadcast_s`` plus ``hosts.broadcast_host_s`` a host)
  (:mod:`pathways_jax.sim._fanout`).
- **The in-flight window.** ``local``: at most ``in_flight`` windowed
  executables in flight per island, and ``device_in_flight`` single-device
  executables per device; the controller waits when a window is full until it
  has drained to half (as the runtime does). ``hosts``: each host bounds its
  own executables as the runtime's hosts do: every one counts, at most
  ``ray_host.PACE`` in flight (windowed ones also at most ``in_flight``, and
  ``CROSS_HOST_WINDOW`` on islands of several hosts); a full host waits
  until half have finished.
- **Devices** run what was enqueued on them in dispatch order, one thing at a
  time. A node on several devices (and hosts) starts once every one of its
  devices is free, every host has enqueued it and its inputs are ready, and
  lasts its step's ``duration_s`` (launch, compute and ICI collectives; see
  :mod:`pathways_jax.sim._workload`).
- **Inline execution** (local backend): the controller's call that enqueues
  a node on ``k`` devices keeps it ``device.inline[k]`` of the node's device
  time beyond a one-computation node's (XLA:CPU runs a 1-device executable on
  the calling thread). Zero for accelerators.
- **Shared cores** (local backend): each second of the controller's work
  while a node runs delays the devices: the next node to start on ``k``
  devices lasts ``device.shared_cpu[k]`` seconds longer for each (CPU
  devices' threads run on the controller's cores). Of the work that enqueues
  a node on ``k`` devices, ``device.launch_cpu(k)`` is exempt: ``jax.jit``'s
  own call spends it too, and ``device.launch_s`` was measured with it.
  Zero for accelerators.
- **Shared cores** (``SimCluster(cores=n)``: hosts on one machine): the
  controller's work, every host's and every node's device time each hold
  one of ``n`` cores while they run (first come, first served), so that
  together they never use more than the machine has. Where the profile has
  ``hosts_busy`` (the hosts' costs measured with no idle core), the hosts'
  costs go from ``hosts`` to it as the processes (the hosts and the
  controller) go from as many as the cores to twice as many (linearly; see
  :func:`_host_costs`).
- **Transfers** (ICI or DCN) start when their source is ready and they are
  enqueued; a DCN link between two islands carries one transfer at a time in
  each direction. Transfers do not occupy the devices' compute streams.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pathways_jax import errors
from pathways_jax._src.backends.ray import CROSS_HOST_WINDOW
from pathways_jax._src.backends.ray_host import PACE
from pathways_jax._src.core import trace_format
from pathways_jax._src.core.trace_format import CONTROLLER_PID, TRANSFER_TID
from pathways_jax._src.runtime import admission
from pathways_jax._src.runtime import scheduler as scheduler_lib
from pathways_jax.sim._cluster import SimCluster
from pathways_jax.sim._errors import import_simpy
from pathways_jax.sim._fanout import CONTROLLER, fanout_tree
from pathways_jax.sim._profile import HostCosts, Profile
from pathways_jax.sim._workload import PREVIOUS_RUN, SimProgram, Step

CONTROLLER_TID = 1
HOST_TID = 2_000_000  # host threads' tracks, in their island's process


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


class _Window:
    """A bound on executables in flight; waiters ask for the count to fall to a level."""

    def __init__(self, env: Any, size: int):
        self.env = env
        self.size = size
        self.count = 0
        self._waiters: list[tuple[int, Any]] = []

    def until(self, level: int) -> Any:
        event = self.env.event()
        if self.count <= level:
            event.succeed()
        else:
            self._waiters.append((level, event))
        return event

    def release(self) -> None:
        self.count -= 1
        still = []
        for level, event in self._waiters:
            if self.count <= level:
                event.succeed()
            else:
                still.append((level, event))
        self._waiters = still


class _Item:
    """One step of one run, once dispatched."""

    __slots__ = ("done", "end", "enqueued", "hosts_left", "index", "run", "start", "step")

    def __init__(self, env: Any, run: _Run, index: int, step: Step, hosts: int):
        self.run = run
        self.index = index
        self.step = step
        self.done = env.event()
        self.enqueued = env.event()
        self.hosts_left = hosts
        self.start = math.nan
        self.end = math.nan


class _Run:
    __slots__ = (
        "client",
        "dispatch_end",
        "dispatch_start",
        "done",
        "index",
        "items",
        "prev",
        "seq",
        "submitted",
    )

    def __init__(self, client: int, index: int, seq: int, submitted: float, prev: _Run | None):
        self.client = client
        self.index = index
        self.seq = seq
        self.submitted = submitted
        self.prev = prev
        self.items: list[_Item] = []
        self.dispatch_start = math.nan
        self.dispatch_end = math.nan
        self.done: Any = None


def _host_costs(profile: Profile, cluster: SimCluster) -> HostCosts:
    """The hosts' costs on ``cluster``: ``hosts``, or towards ``hosts_busy`` on a crowded machine.

    A process's CPU seconds per unit of work move with the load: calibration
    measures them with cores to spare (``hosts``) and with none idle
    (``hosts_busy``). Hosts sharing ``cores`` with the controller pay
    ``hosts`` while the processes fit the cores and ``hosts_busy`` from twice
    as many processes as cores, in proportion in between. The linear form and
    its ends are a choice, not a measurement: on the 2-core machine of
    ``cpu_2core`` it puts 2 hosts (3 processes) halfway, and 2-host chains fall
    between the two measured states there (``benchmarks/README.md``, Simulator).
    """
    busy = profile.hosts_busy
    if cluster.cores is None or busy is None:
        return profile.hosts
    share = min(max((cluster.hosts + 1 - cluster.cores) / cluster.cores, 0.0), 1.0)
    idle = profile.hosts
    return HostCosts(
        **{
            f.name: (1 - share) * getattr(idle, f.name) + share * getattr(busy, f.name)
            for f in dataclasses.fields(HostCosts)
        }
    )


class _Simulation:
    def __init__(self, cluster: SimCluster, workloads: Sequence[Workload], record: bool, max_tracks: int):
        simpy = import_simpy()
        self.simpy = simpy
        self.env = simpy.Environment()
        self.cluster = cluster
        self.profile = cluster.profile
        self.workloads = list(workloads)
        self.record = record
        # The devices the timeline draws: the first ones of every island, max_tracks in all.
        per_island = max(1, min(max_tracks // cluster.islands, cluster.devices_per_island))
        self.tracked = [
            d for i in range(cluster.islands) for d in range(*cluster.island_devices(i))[:per_island]
        ]
        self.tracked_hosts = sorted({cluster.host_of(d) for d in self.tracked})
        self.events: list[dict] = []
        # The runtime's admission core: a queue per client and the cluster's policy.
        self.admission: admission.Queues[int, _Run] = admission.Queues(scheduler_lib.make(cluster.scheduler))
        self.wakeup = self.env.event()
        self.seq = 0
        self.runs: list[_Run] = []
        self.tail = np.full(cluster.devices, -1, dtype=np.int64)  # last item on each device
        self.items: list[_Item] = []
        per = "island" if cluster.dispatch == "local" else "host"
        count = cluster.islands if per == "island" else cluster.hosts
        self.windows = [_Window(self.env, cluster.in_flight) for _ in range(count)]
        # A host's bound for windowed executables (the runtime's hosts: ray.py, ray_host.py).
        self._host_bound = min(
            cluster.in_flight, PACE, CROSS_HOST_WINDOW if cluster.hosts_per_island > 1 else PACE
        )
        self.device_windows = (
            [_Window(self.env, cluster.device_in_flight) for _ in range(cluster.devices)]
            if per == "island"
            else []
        )
        self.host_threads = (
            [simpy.Resource(self.env, 1) for _ in range(cluster.hosts)] if per == "host" else []
        )
        self.links: dict[tuple[int, int], Any] = {}
        self.cores = simpy.Container(self.env, cluster.cores, init=cluster.cores) if cluster.cores else None
        self.host_costs = _host_costs(self.profile, cluster)
        self.controller_busy = 0.0
        self.spans: list[tuple[float, float, int, int]] = []  # node (start, end, lo, hi)
        self.remaining = sum(w.runs for w in self.workloads)
        # The controller's seconds of work while a node ran, charged to the next node to start.
        table = self.profile.device.shared_cpu
        self.shared_cpu = cluster.dispatch == "local" and any(v > 0 for v in table.values())
        self.device_debt = 0.0
        self.running = 0  # nodes running now
        self.busy_marks = [0.0]  # times at which ``running`` changed ...
        self.busy_before = [0.0]  # ... and the time some node ran before each of them

    # --- trace events ------------------------------------------------------------------

    def _span(self, name: str, cat: str, start: float, end: float, pid: int, tid: int, args: dict) -> None:
        if self.record:
            self.events.append(trace_format.span(name, cat, start * 1e6, (end - start) * 1e6, pid, tid, args))

    def _controller(
        self, name: str, cat: str, start: float, run: _Run, *, exempt: float = 0.0, **args: Any
    ) -> None:
        """The controller's span from ``start`` to now; ``exempt``: of it, seconds the devices'
        own figures already hold (``device.launch_cpu``), which they do not lose again."""
        now = self.env.now
        if cat != "wait":
            self.controller_busy += now - start
            if self.shared_cpu:
                self.device_debt += max(self._busy(now) - self._busy(start) - exempt, 0.0)
        if self.record:
            w = self.workloads[run.client]
            args.update(client=w.client, program=w.program.name, run=run.seq)
            self._span(name, cat, start, now, CONTROLLER_PID, CONTROLLER_TID, args)

    # --- clients and the scheduler -------------------------------------------------------

    def _client(self, index: int) -> Any:
        w = self.workloads[index]
        prev = None
        for i in range(w.runs):
            run = _Run(index, i, self.seq, self.env.now, prev if w.chained else None)
            self.seq += 1
            self.runs.append(run)
            self.admission.push(index, run)
            if not self.wakeup.triggered:
                self.wakeup.succeed()
            prev = run
            yield self.env.timeout(w.interval_s)

    def _controller_loop(self) -> Any:
        while self.remaining:
            if not self.admission:
                self.wakeup = self.env.event()
                yield self.wakeup
                continue
            live = self.admission.heads()
            heads = [
                scheduler_lib.Head(
                    client=i,
                    seq=run.seq,
                    priority=self.workloads[i].priority,
                    weight=self.workloads[i].weight,
                    cost=self._cost(self.workloads[i].program),
                )
                for i, run in live
            ]
            client = live[self.admission.pick(heads)][0]
            run = self.admission.pop(client)
            self.remaining -= 1
            yield from self._dispatch(run)

    @staticmethod
    def _cost(program: SimProgram) -> float:
        return sum(s.duration_s * (s.devices[1] - s.devices[0]) for s in program.steps if s.kind == "node")

    # --- dispatch ------------------------------------------------------------------------

    def _hosts_of(self, step: Step) -> list[int]:
        d = self.cluster.devices_per_host
        hosts = set(range(step.devices[0] // d, (step.devices[1] - 1) // d + 1))
        if step.src is not None:
            hosts |= set(range(step.src[0] // d, (step.src[1] - 1) // d + 1))
        return sorted(hosts)

    def _dispatch(self, run: _Run) -> Any:
        env, cost = self.env, self.profile.controller
        program = self.workloads[run.client].program
        run.dispatch_start = env.now
        start = env.now
        local = self.cluster.dispatch == "local"
        if local:  # on CPU devices the controller's costs move with the width of what it enqueues
            widest = max((s.devices[1] - s.devices[0] for s in program.steps if s.kind == "node"), default=1)
            yield from self._work(cost.run(widest))
        else:
            yield from self._work(cost.run_s + self.host_costs.dispatch_s)
        self._controller(f"dispatch {program.name}", "dispatch", start, run, what="run")
        per_host: dict[int, list[_Item]] = collections.defaultdict(list)
        for index, step in enumerate(program.steps):
            island = self.cluster.island_of(step.devices[0])
            hosts = self._hosts_of(step)
            window = self._local_window(step) if local else None
            if window is not None:
                if not admission.has_room(window.count, 1, window.size):
                    start = env.now
                    yield window.until(window.size // 2)
                    where = f"island {island}" if step.windowed else f"device {step.devices[0]}"
                    self._controller(f"wait: in-flight window ({where})", "wait", start, run, island=island)
                window.count += 1
            start = env.now
            exempt = 0.0
            if not local:
                yield from self._work(self.host_costs.node_s)
            elif step.kind == "node":
                width = step.devices[1] - step.devices[0]
                exempt = self.profile.device.launch_cpu(width)
                yield from self._work(cost.node(width))
            else:
                yield from self._work(cost.transfer_s)
            item = self._new_item(run, index, step, 0 if local else len(hosts))
            if local:
                item.enqueued.succeed()
                inline = self._inline(step)
                if inline:  # the call that enqueued it runs it: the controller waits in it
                    yield env.timeout(inline)
            else:
                for h in hosts:
                    per_host[h].append(item)
            self._controller(
                f"dispatch {program.name}/{step.name}", "dispatch", start, run, exempt=exempt, node=step.name
            )
        if not local:
            tree = fanout_tree(sorted(per_host), self.cluster.fanout, self.cluster.fanout_degree)
            if self.cluster.fanout == "broadcast" and len(per_host) > 1:
                start = env.now
                cost_s = self.host_costs.broadcast_s + len(per_host) * self.host_costs.broadcast_host_s
                yield from self._work(cost_s)
                self._controller(f"send {program.name} to {len(per_host)} hosts", "dispatch", start, run)
                for h in tree.get(CONTROLLER, ()):
                    env.process(self._host(h, run, per_host, {}))
                tree = {}
            for h in tree.get(CONTROLLER, ()):
                start = env.now
                yield from self._work(self.host_costs.message_s)
                self._controller(f"send {program.name} to host {h}", "dispatch", start, run, host=h)
                env.process(self._host(h, run, per_host, tree))
        run.dispatch_end = env.now
        run.done = run.items[program.output].done

    def _work(self, seconds: float) -> Any:
        """``seconds`` of one thread's CPU work: on one of the machine's cores when they are shared."""
        if self.cores is None or seconds <= 0:
            yield self.env.timeout(seconds)
            return
        yield self.cores.get(1)
        yield self.env.timeout(seconds)
        yield self.cores.put(1)

    def _inline(self, step: Step) -> float:
        """The controller's time inside the call that enqueues node ``step``, beyond ``node_s``."""
        if step.kind != "node":
            return 0.0
        k = step.devices[1] - step.devices[0]
        device = self.profile.device
        fraction = device.inline_fraction(k)
        if not fraction:
            return 0.0
        return fraction * max(step.duration_s - device.launch(k) - device.computation(k), 0.0)

    def _running(self, change: int) -> None:
        """A node starts (+1) or ends (-1): the device-busy record moves on."""
        now = self.env.now
        ran = now - self.busy_marks[-1] if self.running else 0.0
        self.busy_marks.append(now)
        self.busy_before.append(self.busy_before[-1] + ran)
        self.running += change

    def _busy(self, t: float) -> float:
        """Seconds before ``t`` during which some node ran."""
        i = bisect.bisect_right(self.busy_marks, t) - 1
        running = self.running if i == len(self.busy_marks) - 1 else None
        if running is None:
            # Between two marks: running iff the later mark's total grew past this one's.
            nxt = self.busy_before[i + 1] - self.busy_before[i]
            return self.busy_before[i] + (t - self.busy_marks[i] if nxt > 0 else 0.0)
        return self.busy_before[i] + (t - self.busy_marks[i] if running else 0.0)

    def _local_window(self, step: Step) -> _Window | None:
        """The window a node counts against on the local backend: its island's, or its device's."""
        if step.kind != "node":
            return None
        if step.windowed:
            return self.windows[self.cluster.island_of(step.devices[0])]
        if step.devices[1] - step.devices[0] == 1:
            return self.device_windows[step.devices[0]]
        return None

    def _new_item(self, run: _Run, index: int, step: Step, hosts: int) -> _Item:
        item = _Item(self.env, run, index, step, hosts)
        run.items.append(item)
        waits = [item.enqueued]
        for j in step.inputs:
            if j == PREVIOUS_RUN:
                if run.prev is not None:
                    prev = run.prev.items[self.workloads[run.prev.client].program.output]
                    waits.append(prev.done)
            else:
                waits.append(run.items[j].done)
        if step.kind == "node":
            lo, hi = step.devices
            for before in np.unique(self.tail[lo:hi]):
                if before >= 0:
                    waits.append(self.items[before].done)
            self.tail[lo:hi] = len(self.items)
        self.items.append(item)
        self.env.process(self._execute(item, waits))
        return item

    def _host(
        self, host: int, run: _Run, per_host: dict[int, list[_Item]], tree: dict[int, tuple[int, ...]]
    ) -> Any:
        """Host ``host`` receives ``run``'s message, forwards it down ``tree``, then enqueues its items."""
        env, cost = self.env, self.host_costs
        yield env.timeout(cost.latency_s)
        with self.host_threads[host].request() as turn:
            yield turn
            start = env.now
            for child in tree.get(host, ()):  # a fan-out tree's hop: on this host's thread, first
                yield from self._work(cost.message_s)
                env.process(self._host(child, run, per_host, tree))
            items = per_host[host]
            yield from self._work(cost.run_s)
            window, windowed = self.windows[host], self._host_bound
            for item in items:
                if item.step.kind == "node":
                    bound = windowed if item.step.windowed else PACE
                    if not admission.has_room(window.count, 1, bound):
                        yield window.until(bound // 2)
                    window.count += 1
                yield from self._work(cost.enqueue_s)
                item.hosts_left -= 1
                if item.hosts_left == 0:
                    item.enqueued.succeed()
            if self.record and host in self.tracked_hosts:
                island = host // self.cluster.hosts_per_island
                w = self.workloads[run.client]
                self._span(
                    f"host {host}: enqueue {w.program.name}", "enqueue", start, env.now, 1 + island,
                    HOST_TID + host, {"client": w.client, "program": w.program.name, "run": run.seq, "host": host},
                )  # fmt: skip

    # --- devices and links ---------------------------------------------------------------

    def _link(self, step: Step) -> Any:
        assert step.src is not None
        key = (self.cluster.island_of(step.src[0]), self.cluster.island_of(step.devices[0]))
        if key not in self.links:
            self.links[key] = self.simpy.Resource(self.env, 1)
        return self.links[key]

    def _execute(self, item: _Item, waits: list) -> Any:
        env, step = self.env, item.step
        pending = [e for e in waits if not e.processed]
        if pending:
            yield self.simpy.AllOf(env, pending)
        if step.kind == "transfer" and step.link == "dcn":
            with self._link(step).request() as turn:
                yield turn
                item.start = env.now
                yield env.timeout(step.duration_s)
        elif step.kind == "node" and self.cores is not None:
            # Every device of it is a CPU thread: it takes a core for each (at once, first come
            # first served: a request waits behind an earlier one that does not fit yet).
            k = min(step.devices[1] - step.devices[0], self.cores.capacity)
            yield self.cores.get(k)
            item.start = env.now
            yield env.timeout(step.duration_s)
            yield self.cores.put(k)
        else:
            item.start = env.now
            duration = step.duration_s
            if step.kind == "node" and self.shared_cpu:
                lost = self.device_debt * self.profile.device.shared(step.devices[1] - step.devices[0])
                duration, self.device_debt = duration + lost, 0.0
                self._running(+1)
            yield env.timeout(duration)
        item.end = env.now
        if step.kind == "node":
            if self.shared_cpu:
                self._running(-1)
            self.spans.append((item.start, item.end, *step.devices))
            if self.cluster.dispatch == "local":
                window = self._local_window(step)
                if window is not None:
                    window.release()
            else:
                for h in self._hosts_of(step):
                    self.windows[h].release()
        self._record_item(item)
        item.done.succeed()

    def _tracked_in(self, devices: tuple[int, int]) -> list[int]:
        lo, hi = devices
        return [d for d in self.tracked if lo <= d < hi]

    def _record_item(self, item: _Item) -> None:
        if not self.record:
            return
        step, run = item.step, item.run
        w = self.workloads[run.client]
        island = self.cluster.island_of(step.devices[0])
        tracked = self._tracked_in(step.devices)
        base = {"program": w.program.name, "client": w.client, "run": run.seq, "island": island}
        if step.kind == "node":
            for d in tracked:
                args = dict(
                    base, node=step.name, kind="jit", device=d, dispatched_us=run.dispatch_start * 1e6
                )
                self._span(
                    f"{w.program.name}/{step.name}", "execution", item.start, item.end, 1 + island, d, args
                )
        elif tracked:
            assert step.src is not None
            args = dict(
                base,
                kind=step.link,
                bytes=step.nbytes,
                src_devices=self._tracked_in(step.src),
                dst_devices=list(tracked),
            )
            self._span(
                f"{step.link} {step.nbytes} B",
                "transfer",
                item.start,
                item.end,
                1 + island,
                TRANSFER_TID,
                args,
            )

    # --- running and results -------------------------------------------------------------

    def run(self) -> SimResult:
        env = self.env
        for i in range(len(self.workloads)):
            env.process(self._client(i))
        env.process(self._controller_loop())
        env.run()  # until nothing is left to happen
        return self._result()

    def _result(self) -> SimResult:
        runs = tuple(
            RunRecord(
                self.workloads[r.client].client,
                self.workloads[r.client].program.name,
                r.index,
                r.submitted,
                r.dispatch_start,
                r.dispatch_end,
                float(r.items[self.workloads[r.client].program.output].end),
            )
            for r in self.runs
        )
        makespan = max(max(r.done for r in runs), max(r.end for r in self.items))
        stats = []
        windows = []
        total_computations = 0.0
        for i, w in enumerate(self.workloads):
            done = sorted(rec.done for rec, r in zip(runs, self.runs, strict=True) if r.client == i)
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
        for start, end, lo, hi in self.spans:
            busy += max(0.0, min(end, b) - max(start, a)) * (hi - lo)
        utilisation = busy / (self.cluster.devices * (b - a)) if b > a else 0.0
        trace = self._trace() if self.record else None
        return SimResult(
            makespan_s=makespan,
            step_time_s=stats[0].step_time_s,
            throughput=total_computations,
            utilisation=utilisation,
            controller_busy=self.controller_busy / makespan if makespan > 0 else 0.0,
            clients=tuple(stats),
            runs=runs,
            trace=trace,
        )

    def _trace(self) -> dict:
        c = self.cluster
        processes = {CONTROLLER_PID: "controller (simulated)"}
        threads = {(CONTROLLER_PID, CONTROLLER_TID): "controller"}
        devices = []
        for island in range(c.islands):
            processes[1 + island] = f"island {island}"
            threads[(1 + island, TRANSFER_TID)] = f"transfers into island {island}"
        for d in self.tracked:
            island, host = c.island_of(d), c.host_of(d)
            devices.append({"id": d, "island": island, "kind": "sim", "host": host})
            threads[(1 + island, d)] = f"device {d} (sim, host {host})"
        for event in self.events:  # the hosts' own tracks (enqueueing their parts of runs)
            pid, tid = event["pid"], event["tid"]
            if tid >= HOST_TID and (pid, tid) not in threads:
                threads[(pid, tid)] = f"host {tid - HOST_TID} (sim)"
        other = {
            "producer": "pathways_jax.sim",
            "cluster": repr(c),
            "profile": c.profile.name,
            "clients": sorted({w.client for w in self.workloads}),
            "devices": devices,
            "devices_not_drawn": c.devices - len(self.tracked),
        }
        return trace_format.document(self.events, processes, threads, other)


def simulate(
    cluster: SimCluster,
    workloads: Workload | SimProgram | Sequence[Workload],
    *,
    runs: int = 1,
    record: bool = True,
    max_tracks: int = 16,
) -> SimResult:
    """Simulates clients running programs on ``cluster``.

    Args:
      cluster: the simulated cluster.
      workloads: one :class:`Workload` per client, or one program (one client running it ``runs`` times).
      runs: runs of a bare program.
      record: keep the timeline (trace-event JSON in ``SimResult.trace``).
      max_tracks: draw at most this many devices in the timeline (the first ones of each island).

    Returns:
      The :class:`SimResult`.

    Raises:
      ResourceError: a program does not fit the cluster, or there is nothing to run.
      SimulatorUnavailable: SimPy is not installed (``pip install 'pathways-jax[sim]'``).

    Example:
      >>> from pathways_jax import sim
      >>> profile = sim.Profile(controller=sim.ControllerCosts(run_s=1e-6, node_s=1e-6))
      >>> cluster = sim.SimCluster(hosts=1, devices_per_host=1, profile=profile)
      >>> program = sim.chain(cluster, 3, compute_s=10e-6)
      >>> round(sim.simulate(cluster, program).makespan_s * 1e6, 6)  # 1 + 1 + 3 x 10
      32.0
    """
    if isinstance(workloads, SimProgram):
        workloads = [Workload(workloads, runs=runs)]
    elif isinstance(workloads, Workload):
        workloads = [workloads]
    workloads = list(workloads)
    if not workloads or any(w.runs < 1 for w in workloads):
        raise errors.ResourceError("pw.sim.simulate needs at least one workload with runs >= 1.")
    names = [w.client for w in workloads]
    if len(set(names)) != len(names):
        raise errors.ResourceError(f"pw.sim.simulate: every workload needs its own client name, got {names}.")
    for w in workloads:
        w.program.check(cluster)
    return _Simulation(cluster, workloads, record, max_tracks).run()
