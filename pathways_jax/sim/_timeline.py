"""A simulation's timeline: trace events on the layout ``pw.trace`` writes (``core.trace_format``).

The controller has a process of its own; each island is a process whose tracks
are its first devices (``max_tracks`` in all), its incoming transfers and its
hosts' threads.
"""

from __future__ import annotations

from collections.abc import Sequence

from pathways_jax._src.core import trace_format
from pathways_jax._src.core.trace_format import CONTROLLER_PID, TRANSFER_TID
from pathways_jax.sim._cluster import SimCluster
from pathways_jax.sim._state import Item, Run
from pathways_jax.sim._workload import Workload

CONTROLLER_TID = 1
HOST_TID = 2_000_000  # host threads' tracks, in their island's process


class Timeline:
    """The trace events of one simulation; with ``record=False`` it keeps none."""

    def __init__(self, cluster: SimCluster, workloads: Sequence[Workload], *, record: bool, max_tracks: int):
        self.cluster = cluster
        self.workloads = workloads
        self.record = record
        # The devices the timeline draws: the first ones of every island, max_tracks in all.
        per_island = max(1, min(max_tracks // cluster.islands, cluster.devices_per_island))
        self.tracked = [
            d for i in range(cluster.islands) for d in range(*cluster.island_devices(i))[:per_island]
        ]
        self.tracked_hosts = sorted({cluster.host_of(d) for d in self.tracked})
        self.events: list[dict] = []

    def span(self, name: str, cat: str, start: float, end: float, pid: int, tid: int, args: dict) -> None:
        if self.record:
            self.events.append(trace_format.span(name, cat, start * 1e6, (end - start) * 1e6, pid, tid, args))

    def controller(self, name: str, cat: str, start: float, end: float, run: Run, args: dict) -> None:
        """The controller's span of work for ``run``."""
        if self.record:
            w = self.workloads[run.client]
            args.update(client=w.client, program=w.program.name, run=run.seq)
            self.span(name, cat, start, end, CONTROLLER_PID, CONTROLLER_TID, args)

    def host(self, host: int, run: Run, start: float, end: float) -> None:
        """Host ``host`` enqueueing its part of ``run`` (drawn for the hosts of drawn devices)."""
        if self.record and host in self.tracked_hosts:
            island = host // self.cluster.hosts_per_island
            w = self.workloads[run.client]
            self.span(
                f"host {host}: enqueue {w.program.name}", "enqueue", start, end, 1 + island,
                HOST_TID + host, {"client": w.client, "program": w.program.name, "run": run.seq, "host": host},
            )  # fmt: skip

    def _tracked_in(self, devices: tuple[int, int]) -> list[int]:
        lo, hi = devices
        return [d for d in self.tracked if lo <= d < hi]

    def item(self, item: Item) -> None:
        """A node's execution on each drawn device, or a transfer into a drawn device's island."""
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
                self.span(
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
            self.span(
                f"{step.link} {step.nbytes} B",
                "transfer",
                item.start,
                item.end,
                1 + island,
                TRANSFER_TID,
                args,
            )

    def document(self) -> dict:
        """The trace-event JSON document of the events so far, with its processes and tracks named."""
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
