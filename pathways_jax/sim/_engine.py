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
  :func:`_host_load.host_costs`).
- **Transfers** (ICI or DCN) start when their source is ready and they are
  enqueued; a DCN link between two islands carries one transfer at a time in
  each direction. Transfers do not occupy the devices' compute streams.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from pathways_jax import errors
from pathways_jax._src.backends.ray import CROSS_HOST_WINDOW
from pathways_jax._src.backends.ray_host import PACE
from pathways_jax._src.runtime import admission
from pathways_jax._src.runtime import scheduler as scheduler_lib
from pathways_jax.sim._cluster import SimCluster
from pathways_jax.sim._errors import import_simpy
from pathways_jax.sim._fanout import CONTROLLER, fanout_tree
from pathways_jax.sim._host_load import host_costs
from pathways_jax.sim._results import SimResult, summarise
from pathways_jax.sim._state import Item, Run, Window
from pathways_jax.sim._timeline import Timeline
from pathways_jax.sim._workload import PREVIOUS_RUN, SimProgram, Step, Workload


class _Simulation:
    def __init__(self, cluster: SimCluster, workloads: Sequence[Workload], record: bool, max_tracks: int):
        simpy = import_simpy()
        self.simpy = simpy
        self.env = simpy.Environment()
        self.cluster = cluster
        self.profile = cluster.profile
        self.workloads = list(workloads)
        self.timeline = Timeline(cluster, self.workloads, record=record, max_tracks=max_tracks)
        # The runtime's admission core: a queue per client and the cluster's policy.
        self.admission: admission.Queues[int, Run] = admission.Queues(scheduler_lib.make(cluster.scheduler))
        self.wakeup = self.env.event()
        self.seq = 0
        self.runs: list[Run] = []
        self.tail = np.full(cluster.devices, -1, dtype=np.int64)  # last item on each device
        self.items: list[Item] = []
        per = "island" if cluster.dispatch == "local" else "host"
        count = cluster.islands if per == "island" else cluster.hosts
        self.windows = [Window(self.env, cluster.in_flight) for _ in range(count)]
        # A host's bound for windowed executables (the runtime's hosts: ray.py, ray_host.py).
        self._host_bound = min(
            cluster.in_flight, PACE, CROSS_HOST_WINDOW if cluster.hosts_per_island > 1 else PACE
        )
        self.device_windows = (
            [Window(self.env, cluster.device_in_flight) for _ in range(cluster.devices)]
            if per == "island"
            else []
        )
        self.host_threads = (
            [simpy.Resource(self.env, 1) for _ in range(cluster.hosts)] if per == "host" else []
        )
        self.links: dict[tuple[int, int], Any] = {}
        self.cores = simpy.Container(self.env, cluster.cores, init=cluster.cores) if cluster.cores else None
        self.host_costs = host_costs(self.profile, cluster)
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

    # --- the controller's time ------------------------------------------------------------

    def _controller(
        self, name: str, cat: str, start: float, run: Run, *, exempt: float = 0.0, **args: Any
    ) -> None:
        """The controller's span from ``start`` to now; ``exempt``: of it, seconds the devices'
        own figures already hold (``device.launch_cpu``), which they do not lose again."""
        now = self.env.now
        if cat != "wait":
            self.controller_busy += now - start
            if self.shared_cpu:
                self.device_debt += max(self._busy(now) - self._busy(start) - exempt, 0.0)
        self.timeline.controller(name, cat, start, now, run, args)

    # --- clients and the scheduler -------------------------------------------------------

    def _client(self, index: int) -> Any:
        w = self.workloads[index]
        prev = None
        for i in range(w.runs):
            run = Run(index, i, self.seq, self.env.now, prev if w.chained else None)
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

    def _dispatch(self, run: Run) -> Any:
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
        per_host: dict[int, list[Item]] = collections.defaultdict(list)
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

    def _local_window(self, step: Step) -> Window | None:
        """The window a node counts against on the local backend: its island's, or its device's."""
        if step.kind != "node":
            return None
        if step.windowed:
            return self.windows[self.cluster.island_of(step.devices[0])]
        if step.devices[1] - step.devices[0] == 1:
            return self.device_windows[step.devices[0]]
        return None

    def _new_item(self, run: Run, index: int, step: Step, hosts: int) -> Item:
        item = Item(self.env, run, index, step, hosts)
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
        self, host: int, run: Run, per_host: dict[int, list[Item]], tree: dict[int, tuple[int, ...]]
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
            self.timeline.host(host, run, start, env.now)

    # --- devices and links ---------------------------------------------------------------

    def _link(self, step: Step) -> Any:
        assert step.src is not None
        key = (self.cluster.island_of(step.src[0]), self.cluster.island_of(step.devices[0]))
        if key not in self.links:
            self.links[key] = self.simpy.Resource(self.env, 1)
        return self.links[key]

    def _execute(self, item: Item, waits: list) -> Any:
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
        self.timeline.item(item)
        item.done.succeed()

    # --- running and results -------------------------------------------------------------

    def run(self) -> SimResult:
        env = self.env
        for i in range(len(self.workloads)):
            env.process(self._client(i))
        env.process(self._controller_loop())
        env.run()  # until nothing is left to happen
        return self._result()

    def _result(self) -> SimResult:
        return summarise(
            self.workloads,
            self.runs,
            self.items,
            self.spans,
            devices=self.cluster.devices,
            controller_busy=self.controller_busy,
            trace=self.timeline.document() if self.timeline.record else None,
        )


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
