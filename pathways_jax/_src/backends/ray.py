"""The Ray backend: host actors owning their own devices, driven by the one controller.

``pw.init(backend="ray", hosts=H, devices_per_host=D, islands=K)`` starts (or
connects to) a Ray cluster and H host actors (``ray_host.Host``), placed with
a placement group of one bundle per host, grouped into K islands of H/K
hosts each (``islands=None``: each host is its own island).

**Islands of several hosts.** The hosts of an island form one
``jax.distributed`` system (one coordinator per island, on its first host):
together they see the island's H/K x D devices as one global mesh, and a
slice may span them. Every host of a slice runs the slice's SPMD
executables itself, in the controller's order (each host handles its
numbered messages strictly in order), so their collectives always meet.

**Stand-in devices.** The controller process traces and lowers programs
exactly as on the local backend, against H x D of its own CPU devices that
stand in for the hosts' devices (host ``h`` owns stand-ins ``h*D .. h*D+D-1``):
graphs, plans, shardings, byte counts and the scheduler do not change. What
changes is dispatch: a lowered plan is split into one part per host (its
computations serialized with ``jax.export``, its moves either local puts or
host-to-host transfers), registered once per host, and each run sends each
participating host ONE message. Values stay on the hosts; a future holds a
:class:`RemoteArray` handle, and ``Future.result()`` fetches the value.

**Fan-out.** A run's messages (and any batch of :meth:`RayBackend.send_batch`)
are numbered per host, then each island's go in one call of the link
(``Link.send_group``): over the channel, ONE broadcast that every host of
the island reads its own part of, so the controller's cost of a run hardly
grows with its hosts. Nothing waits to be batched: a lone run goes at once.

**The data plane.** A value that moves between hosts (between islands, or
between slices on different hosts of one island) goes from the source
host's transfer server (``jax.experimental.transfer``) to the destination
host, never through the controller or a Ray call: the controller only
numbers the transfers of each run (a uuid base in the run's message). There
is no Ray-call fallback.

**Failure as a unit.** If any host of an island dies, the island is lost:
its other hosts are killed, its pending runs fail with ``HostLostError``
naming the host, the other hosts stop waiting for values from it, and the
cluster moves its slices to surviving islands.

Ray is imported lazily (``ray_boot.import_ray``): ``pip install pathways-jax[ray]``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from absl import logging

from pathways_jax._src.backends import ray_fleet, ray_host
from pathways_jax._src.backends.base import Dispatched, FaultKind, Prepared, StepFailed, Windows
from pathways_jax._src.backends.host_link import HostGone, Link
from pathways_jax._src.backends.ray_boot import Layout as Layout
from pathways_jax._src.backends.ray_boot import import_ray as import_ray
from pathways_jax._src.backends.ray_boot import join_ray
from pathways_jax._src.backends.ray_boot import make_link as make_link
from pathways_jax._src.backends.ray_failures import is_lost_error as is_lost_error
from pathways_jax._src.backends.ray_failures import refusal as refusal
from pathways_jax._src.backends.ray_failures import with_remote_traceback as with_remote_traceback
from pathways_jax._src.backends.ray_fleet import HUNG_S as HUNG_S
from pathways_jax._src.backends.ray_fleet import HostActors, results
from pathways_jax._src.backends.ray_host import (
    KeyData,
    NamedDesc,
    Refused,
    RunDone,
    RunFailure,
    Shards,
    SingleDesc,
)
from pathways_jax._src.backends.ray_plan import Placed, RemotePlan
from pathways_jax._src.backends.ray_send import Sender
from pathways_jax._src.backends.ray_values import RemoteArray
from pathways_jax._src.core import counts, errors, events, reentry

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan

_FLUSH_S = 0.05  # how often freed values are sent back to their hosts
CALL_TIMEOUT_S = 120.0
CLOSE_TIMEOUT_S = 10.0  # how long close() waits for this side's threads unless told
_WAIT_STEP_S = 0.1  # a wait for a host's answer looks whether the cluster closed this often
_REBUILD_TIMEOUT_S = 60.0  # how long new hosts for a lost island may take to start
_CLOSED = (
    "the cluster was shut down and its Ray hosts with it; values that lived on them are gone. "
    "Call .result() before pw.shutdown() to keep a value."
)

# Executables each host of an island of several hosts keeps in flight at most
# (pw.init(max_in_flight=...) may lower it). Cross-process collective programs
# in flight deadlock XLA:CPU beyond a bound: with several devices per process,
# 34-38 hung (2x2 hosts x devices: 32 ran, 34 hung; 2x4 and 4x2 hung at 36 and
# 38), counted in programs, not collectives; processes of one device dispatch
# synchronously and never hung up to 256 (benchmarks/inflight_bound.py).
# Half the smallest failing count, rounded down.
CROSS_HOST_WINDOW = 16

# Messages sent to one island's hosts and not complete yet before dispatch
# there waits (each host bounds its own executables in flight as well).
RUNS_IN_FLIGHT = 64


def _assemble(results: list) -> Any:
    """One numpy array from the hosts' answers: one host's whole array, or every host's shards."""
    for result in results:
        if isinstance(result, np.ndarray):  # a host holding all of it
            return result
    parts = [part for result in results for part in result.parts]
    # The raw data of typed keys has trailing dimensions the keys' shape does not: read them off.
    shape = tuple(
        max(stop for (_, stop) in dims) for dims in zip(*(bounds for bounds, _ in parts), strict=True)
    )
    whole = np.empty(shape, dtype=parts[0][1].dtype)
    for bounds, data in parts:
        whole[tuple(slice(start, stop) for start, stop in bounds)] = data
    return whole


class RayBackend:
    """The controller's side of the Ray backend: dispatch, fetches, and what a lost host means.

    Implements :class:`~pathways_jax._src.backends.base.Backend`: a run is one
    message per host, and each host dispatches its part of the plan itself.
    It holds its host actors (``fleet``, a :class:`~.ray_fleet.HostActors`) and
    what it sent each host (``sender``, a :class:`~.ray_send.Sender`).
    ``lost`` is keyed by island (an island is lost as a unit).
    """

    name = "ray"
    window_size: int | None = RUNS_IN_FLIGHT
    donates = False  # hosts compile the exported nodes without donation
    exports = True
    calls_back = False
    stages_inputs = False  # host inputs travel with the run's message

    def __init__(
        self,
        *,
        address: str | None,
        hosts: int,
        devices_per_host: int,
        standins: list[jax.Device],
        window_size: int,
        on_lost: Any,
        islands: int | None = None,
        platform: str = "cpu",
        replace_lost: bool = True,
        transport: str = "channel",
    ):
        ray = import_ray()
        self._common(
            ray, Layout(hosts, devices_per_host, hosts // (islands or hosts)), platform, standins, on_lost
        )
        # A lost island is rebuilt on new hosts (in the same bundles) when Ray has room.
        self.replace_lost = replace_lost
        join_ray(ray, address, hosts)
        # Each host of an island of several bounds its executables in flight lower.
        host_window_size = window_size if self.layout.per_island == 1 else min(window_size, CROSS_HOST_WINDOW)
        self.fleet = HostActors(ray, self.layout, platform, host_window_size)
        self.link: Link = make_link(transport)
        self.fleet.launch(self.link)
        try:
            self.info = self.fleet.start()
            self._connect()
        except Exception as exc:
            self.close()
            if isinstance(exc, errors.ClusterError):
                raise
            raise errors.ClusterError(f"the Ray host actors did not start: {exc}") from exc
        self._threads = [
            reentry.runtime_thread(self.fleet.monitor, args=(self,), name="pathways-ray-monitor"),
            reentry.runtime_thread(self._flush_loop, name="pathways-ray-flush"),
        ]
        for thread in self._threads:
            thread.start()

    def _common(self, ray: Any, layout: Layout, platform: str, standins: list, on_lost: Any) -> None:
        """The state every controller side keeps, whether it starts the hosts or a service owns them."""
        self.ray = ray
        self.layout = layout
        self.hosts = layout.hosts
        devices_per_host = self.devices_per_host = layout.devices_per_host
        self.platform = platform
        # Computations are exported for the hosts' platform (the controller lowers on CPU).
        self.export_platforms = ("cpu",) if platform == "cpu" else ("cpu", "cuda")
        self.standins = standins
        per = layout.per_island
        # stand-in id -> (island, position among the island's devices, host)
        self._where = {
            d.id: (i // (per * devices_per_host), i % (per * devices_per_host), i // devices_per_host)
            for i, d in enumerate(standins)
        }
        self.on_lost = on_lost  # set by the cluster: called with a lost island
        # Set by the cluster: frees the store's values whose futures went, so that
        # their handles go and the hosts hear of it even when no program runs.
        self.collect: Any = None
        self.slices_of: Any = None  # set by the cluster: its live slices' device ids, by slice id
        self._lock = threading.Lock()  # message numbering and sending, losses
        self.sender = Sender(layout)  # message numbers, what each host has and is to free
        self._keys = itertools.count()
        self.lost: dict[int, str] = {}  # island -> why
        self.lost_hosts: dict[int, str] = {}  # host -> why (every host of a lost island)
        self._lost_before: dict[int, str] = {}  # island -> why it was lost last (rebuilt since or not)
        self.generations = [0] * layout.islands  # bumped when an island is rebuilt
        self.on_restored: Any = None  # set by the cluster: called with a rebuilt island
        self._closed = False

    def _connect(self) -> None:
        """Tells every host where the others' transfer servers are."""
        addresses = {h: host_info["transfer"] for h, host_info in enumerate(self.info)}
        with self._lock:
            answers = [self._message(h, "peers", addresses) for h in range(self.hosts)]
        for h, answer in enumerate(results(answers, ray_fleet.START_TIMEOUT_S)):
            if answer is not None:
                raise errors.ClusterError(
                    f"host {h} could not reach the other hosts' transfer servers: {answer}"
                )

    @property
    def actors(self) -> list[Any]:
        """The host actors, by host (replaced in place when an island is rebuilt)."""
        return self.fleet.actors

    @property
    def closed(self) -> bool:
        return self._closed

    # --- devices --------------------------------------------------------------------------

    @property
    def islands(self) -> tuple[tuple[jax.Device, ...], ...]:
        n = self.layout.per_island * self.devices_per_host
        return tuple(tuple(self.standins[i * n : (i + 1) * n]) for i in range(self.layout.islands))

    def place_of(self, device: Any) -> tuple[int, int, int]:
        """A stand-in device's island, position among the island's devices, and host."""
        return self._where[device.id]

    def where(self, sharding: Any, what: str) -> Placed:
        """The island, hosts and island-local descriptor of a stand-in sharding."""
        if isinstance(sharding, jax.sharding.SingleDeviceSharding):
            device: Any  # a jax.Device; its stub type does not resolve here
            (device,) = sharding.device_set
            island, position, host = self._where[device.id]
            return Placed(island, (host,), SingleDesc(position))
        if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
            places = [self._where[d.id] for d in sharding.mesh.devices.flat]
            islands = sorted({island for island, _, _ in places})
            if len(islands) != 1:
                raise errors.PlacementError(
                    f"{what} is sharded over devices of islands {islands}; a value lives on one island. "
                    "Give each island's part its own slice and move values between them."
                )
            return Placed(
                islands[0],
                tuple(sorted({host for _, _, host in places})),
                NamedDesc(
                    tuple(position for _, position, _ in places),
                    sharding.mesh.devices.shape,
                    sharding.mesh.axis_names,
                    sharding.spec,
                ),
            )
        raise errors.PlacementError(
            f"{what} has sharding {sharding!r}; the Ray backend ships NamedSharding and "
            "SingleDeviceSharding values only. Give the value a pw.P(...) spec on its slice."
        )

    # --- messages ------------------------------------------------------------------------

    def _message(self, host: int, kind: str, *args: Any) -> Any:
        """Sends host ``host`` its next numbered message; call with ``_lock`` held."""
        return self.sender.send(self.link, host, kind, args)

    def prepare(self, plan: Plan) -> Prepared:
        """Splits ``plan`` into one part per host; a run then makes one message (and report) per host."""
        remote = RemotePlan(self, plan)
        for island in remote.islands:
            if island in self.lost:
                raise errors.HostLostError(self._lost_message(island, f"program {plan.graph.name!r}"))
        # The hosts keep their parts as long as the prepared plan holds this one.
        weakref.finalize(remote, self.sender.forget, remote.key, remote.hosts)
        return Prepared(dict(remote.windowed), remote.islands, len(remote.hosts), remote)

    def execute(self, run: Any, windows: Windows) -> Dispatched:
        """Sends each host of ``run`` its one message; the hosts do the rest."""
        plan = run.plan
        remote: RemotePlan | None = plan.prepared.part
        if remote is None:
            # A plan that places nothing (it returns literals or its arguments)
            # was prepared by no backend: no host takes part, its values are here.
            return Dispatched(run.env)
        for island in plan.prepared.windowed:
            windows.make_room(island)
        sink = events.SINK
        t0 = events.now() if sink is not None else 0
        try:
            outputs, markers = self.dispatch(run)
        except Exception as exc:
            raise StepFailed(
                f"program {plan.graph.name!r} run {run.id} could not be sent to its hosts", exc
            ) from exc
        counts.bump("dispatches", len(markers))
        for kind, count in remote.transfers.items():
            counts.bump(f"transfers_{kind}", count)
        if remote.pulls:
            counts.bump("host_pulls", remote.pulls)
        island_of = self.layout.island_of
        for host, marker in markers.items():
            windows.in_flight(island_of(host), marker, run)
            if sink is not None:
                ids = tuple(
                    d.id
                    for d in self.standins[host * self.devices_per_host : (host + 1) * self.devices_per_host]
                )
                name, island = plan.graph.name, island_of(host)
                sink(
                    events.Sent(run.id, run.client.name, name, host, island, ids, t0, events.now(), (marker,))
                )
        slot_hosts = remote.slot_hosts
        return Dispatched(outputs, tuple([markers[slot_hosts[group.slot][0]] for group in plan.acct_groups]))

    def settle(self, in_flight: collections.deque) -> None:
        self.retire_ready(in_flight)

    def _send_forgets(self) -> None:
        """Tells hosts to forget the plans that went; call with ``_lock`` held."""
        for host, key in self.sender.take_forgotten(self.lost_hosts):
            self._message(host, "forget", key)

    def dispatch(self, run: Any) -> tuple[dict[int, RemoteArray], dict[int, RemoteArray]]:
        """Sends each host of ``run`` its one message; returns output handles and one marker per host."""
        plan = run.plan
        remote: RemotePlan = plan.prepared.part
        env = run.env
        markers: dict[int, RemoteArray] = {}
        keys = {slot: next(self._keys) for part in remote.parts.values() for slot in part.keep}
        name = plan.graph.name
        with self._lock:
            for island in remote.islands:
                if island in self.lost:
                    raise errors.HostLostError(self._lost_message(island, f"program {name!r}"))
            generations = {island: self.generations[island] for island in remote.islands}
            # Every host's inputs first: a run that fails here sends nothing, so no
            # host waits for a value from a host that never got its part.
            messages: dict[int, tuple[list, list]] = {}
            for host in remote.hosts:
                hp = remote.parts[host]
                feeds: list[tuple] = []
                for slot in hp.futures:
                    value = env[slot]
                    if isinstance(value, jax.Array):  # here, not on the hosts: it goes with the message
                        feeds.append((slot, "data", (ray_host.to_wire(value), remote.future_descs[slot])))
                        continue
                    if not isinstance(value, RemoteArray) or value.backend is not self:
                        raise errors.PlacementError(
                            f"program {name!r}: an input future belongs to another cluster "
                            "(one shut down since); pass its .result() instead"
                        )
                    if value.hosts != remote.slot_hosts[slot]:
                        raise errors.PlacementError(
                            f"program {name!r}: an input future is on hosts {list(value.hosts)}, "
                            f"not on hosts {list(remote.slot_hosts[slot])}, where the program reads it"
                        )
                    island = self.layout.island_of(host)
                    if value.generation != generations[island]:
                        raise errors.HostLostError(
                            self._lost_message(island, f"an input of program {name!r}")
                        )
                    feeds.append((slot, "value", value.key))
                for source, slot, desc in hp.data:
                    feeds.append((slot, "data", (ray_host.to_wire(env[source]), desc)))
                messages[host] = (feeds, [(slot, keys[slot]) for slot in hp.keep])
            base = self._take_uuids(remote.uuids)
            # The run's messages, every host's at once: the hosts of an island must
            # all see them at the same place in their order.
            batch: list[tuple[int, str, tuple]] = []
            runs: dict[int, int] = {}  # host -> index of its run message in the batch
            sender = self.sender
            for host, (feeds, keep) in messages.items():
                hp = remote.parts[host]
                if remote.key not in sender.known[host]:
                    have = sender.fingerprints[host]
                    blobs = {f: b for f, b in hp.blobs.items() if f not in have}
                    batch.append((host, "register", (remote.key, hp.ops, hp.constants, blobs, remote.x64)))
                    have.update(blobs)
                    sender.known[host].add(remote.key)
                frees = sender.take_dropped(host)
                runs[host] = len(batch)
                batch.append((host, "run", (remote.key, run.id, base, feeds, keep, frees)))
            answers = self._send_run(batch, run, remote)
            for host, index in runs.items():
                generation = generations[self.layout.island_of(host)]
                markers[host] = RemoteArray(self, (host,), None, None, None, (answers[index],), generation)
        outputs: dict[int, RemoteArray] = {}
        for slot, key in keys.items():
            out = plan.slot_outputs[slot]
            hosts = remote.slot_hosts[slot]
            dones = tuple(markers[h].dones[0] for h in hosts)
            generation = markers[hosts[0]].generation
            outputs[slot] = RemoteArray(self, hosts, key, out.aval, out.sharding, dones, generation)
        return outputs, markers

    def send_items(self, items: list[tuple[int, Any]]) -> list[concurrent.futures.Future]:
        """:meth:`send_batch` for typed wire messages ``(host, item)`` (a controller service's)."""
        from pathways_jax._src.backends.channel_link import decode

        if self.link.name == "channel":  # they go as they are
            return self.send_batch([(host, "wire", (item,)) for host, item in items])
        return self.send_batch([(host, *decode(item)) for host, item in items])

    def send_batch(self, messages: list[tuple[int, str, tuple]]) -> list[concurrent.futures.Future]:
        """Sends messages ``(host, kind, args)`` numbered in this order, each host's in one batch.

        For a caller that composes host messages itself (the controller
        service). One future per message, in order, set to the host's answer;
        a lost host's message is not sent and its future fails with ``HostGone``.
        """
        with self._lock:
            live = [i for i, (host, _kind, _args) in enumerate(messages) if host not in self.lost_hosts]
            sent = self.sender.send_all(self.link, [messages[i] for i in live]) if live else []
        futures: list[concurrent.futures.Future] = []
        answers = dict(zip(live, sent, strict=True))
        for index, (host, _kind, _args) in enumerate(messages):
            future = answers.get(index)
            if future is None:
                future = concurrent.futures.Future()
                future.set_exception(HostGone(host, "it was lost"))
            futures.append(future)
        return futures

    def _send_run(self, batch: list[tuple[int, str, tuple]], run: Any, remote: RemotePlan) -> list:
        """Sends a run's messages (host, kind, args); their answers' futures. Call with ``_lock`` held."""
        return self.sender.send_all(self.link, batch)

    def take_uuids(self, count: int) -> int:
        """The first of ``count`` fresh transfer uuids (for a run the caller sends itself)."""
        with self._lock:
            return self._take_uuids(count)

    def _take_uuids(self, count: int) -> int:
        """The first of ``count`` fresh transfer uuids; call with ``_lock`` held."""
        return self.sender.take_uuids(count)

    def retire_ready(self, in_flight: collections.deque) -> None:
        """Drops the completed head of an island's in-flight deque.

        Each host answers its runs in order, so the deque completes from the
        front: the head is looked at, then each next entry while they are
        done (not every entry each time).
        """
        while in_flight:
            marker = in_flight[0][0]
            if not marker._ready:
                if not marker.dones[0].done():
                    return
                marker._ready = True
            in_flight.popleft()

    def drop(self, host: int, key: int | tuple[int, int]) -> None:
        """A handle went: its value is freed on its host with the next message there."""
        self.sender.dropped[host].append(key)

    def _flush_loop(self) -> None:
        while not self._closed:
            time.sleep(_FLUSH_S)
            try:
                if self.collect is not None:
                    self.collect()
                sender = self.sender
                if not any(sender.dropped) and not sender.forgotten:
                    continue
                with self._lock:
                    if not self._closed:
                        self._send_forgets()
                    for host in range(self.hosts):
                        if sender.dropped[host] and host not in self.lost_hosts and not self._closed:
                            self._message(host, "free", sender.take_dropped(host))
            except Exception as exc:  # Ray itself went away (process exit): stop
                if self._closed or not self.ray.is_initialized():
                    return
                logging.warning("pathways_jax: freeing values on the Ray hosts failed once: %s", exc)

    def fetch(self, hosts: tuple[int, ...], key: int | tuple[int, int], generation: int) -> Any:
        """A kept value as a numpy array: from its host, or pieced together from its hosts' shards."""
        if self._closed:
            raise errors.ClusterError(_CLOSED)
        island = self.layout.island_of(hosts[0])
        with self._lock:
            if island in self.lost or generation != self.generations[island]:
                raise errors.HostLostError(self._lost_message(island, "a value"))
            answers = [self._message(host, "fetch", key) for host in hosts]
        results: list[Any] = []
        for host, answer in zip(hosts, answers, strict=True):
            try:
                result = self._fetched(host, answer.result(timeout=CALL_TIMEOUT_S))
            except Exception as exc:
                lost = self._loss(host, exc, generation, "a value")
                if lost is not None:
                    raise lost from exc
                raise
            if isinstance(result, Refused):
                raise refusal(result)
            if not isinstance(result, np.ndarray | Shards | KeyData):
                raise with_remote_traceback(
                    errors.ProgramFailedError(f"fetching a value from host {host} failed: {result.message}"),
                    host,
                    getattr(result, "trace", ""),
                )
            results.append(result)
        keys = [result for result in results if isinstance(result, KeyData)]
        if not keys:
            return _assemble(results)
        # Typed keys: their raw data came, pieced together, then wrapped again.
        return jax.random.wrap_key_data(_assemble([k.data for k in keys]), impl=keys[0].impl)

    def outcome(self, host: int, done: Any, generation: int) -> BaseException | None:
        """None if a host's part of a run completed, else the error its values raise.

        ``generation``: of the host's island when the run was sent (a host that
        died then may have been replaced since).
        """
        if self._closed:
            return errors.ClusterError(_CLOSED)
        island = self.layout.island_of(host)
        try:
            # In steps, so that a wait on a hung host ends when the cluster closes.
            while concurrent.futures.wait([done], timeout=_WAIT_STEP_S).not_done:
                if self._closed:
                    return errors.ClusterError(_CLOSED)
            status = done.result()
        except Exception as exc:
            lost = self._loss(host, exc, generation, "a run")
            if lost is not None:
                return lost
            return errors.ProgramFailedError(f"host {host} failed: {exc}")
        if status is None or isinstance(status, float | RunDone):  # done (in how much device time)
            return None
        if isinstance(status, Refused):  # the controller service refused the run: it touched nothing
            return refusal(status)
        if not isinstance(status, RunFailure):  # a message that failed before its run began
            return with_remote_traceback(
                errors.ProgramFailedError(f"host {host} failed: {getattr(status, 'message', status)}"),
                host,
                getattr(status, "trace", ""),
            )
        if status.kind == "lost" and status.peer is not None:
            return errors.HostLostError(
                self._lost_message(self.layout.island_of(status.peer), f"a run on host {host}")
            )
        # A collective whose peer died, or a pull from a dead host, fails like a
        # program of the user's: ask the hosts it depended on whether they live.
        suspects = {h for h in self.layout.members(island) if h != host} | set(status.peers)
        gone = self._health_check(suspects)
        if gone is not None:
            return errors.HostLostError(self._lost_message(gone, f"a run on host {host}"))
        return with_remote_traceback(errors.ProgramFailedError(status.message), host, status.trace)

    def _fetched(self, host: int, answer: Any) -> Any:
        """A host's answer to a fetch as it came (a controller service's client reads it from the host)."""
        return answer

    def _loss(self, host: int, exc: BaseException, generation: int, what: str) -> BaseException | None:
        """The error for a wait on ``host`` that raised ``exc``: HostLostError if the host died, else None."""
        if not is_lost_error(exc):
            return None
        self.mark_lost(host, str(exc), generation)
        return errors.HostLostError(self._lost_message(self.layout.island_of(host), what))

    def _health_check(self, hosts: set[int]) -> int | None:
        """The island of the first of ``hosts`` found dead (marked lost), or None if all answer or are busy."""
        island_of = self.layout.island_of
        for host in sorted(hosts):
            if island_of(host) in self.lost:
                return island_of(host)
        live = sorted(h for h in hosts if h not in self.lost_hosts)
        if not live:
            return None
        dead = self.fleet.first_dead(live)
        if dead is None:
            return None
        host, exc = dead
        self.mark_lost(host, str(exc))
        return island_of(host)

    def host_stats(self, timeout: float = CALL_TIMEOUT_S) -> dict[int, dict]:
        """Each live host's counts: values kept, runs done, executables and plans cached, transfers."""
        live = [h for h in range(self.hosts) if h not in self.lost_hosts]
        stats = self.ray.get([self.actors[h].stats.remote() for h in live], timeout=timeout)
        return dict(zip(live, stats, strict=True))

    def strike(self, host: int, kind: FaultKind, at_run: int, timeout: float = CALL_TIMEOUT_S) -> None:
        """Has host ``host`` strike a fault on itself (``base.Strikes``); ClusterError if it is lost."""
        why = self.lost_hosts.get(host)
        if why is not None:
            raise errors.ClusterError(f"host {host} is lost already ({why}): no fault was injected.")
        self.fleet.strike(host, ray_host.Fault(kind, at_run), timeout)

    # --- health ------------------------------------------------------------------------

    def _lost_message(self, island: int, what: str) -> str:
        members = self.layout.members(island)
        hosts = f"host {members[0]}" if len(members) == 1 else f"hosts {members[0]}-{members[-1]}"
        why = self.lost.get(island) or self._lost_before.get(island, "it died")
        lost = f"{what} needed island {island} ({hosts}), which was lost: {why}. "
        if len(self.lost) == self.layout.islands:
            return lost + (
                f"Its values are gone, and no island survives (all {self.layout.islands} were lost), so "
                "nothing can run on this cluster: call pw.shutdown() and then pw.init(...) to start new hosts."
            )
        return lost + (
            "Its values are gone; slices on it were moved to surviving islands where they fit, so "
            "calling the program again runs there."
        )

    def mark_lost(self, host: int, why: str, generation: int | None = None) -> None:
        """Host ``host`` died: its island is lost, its other hosts are killed, the rest stop waiting on them.

        ``generation``: of the island the death was seen in; a death of hosts
        already replaced changes nothing.
        """
        island = self.layout.island_of(host)
        members = self.layout.members(island)
        with self._lock:
            if self._closed or (generation is not None and generation != self.generations[island]):
                return
            if not self._record_lost(
                island, f"host {host} died ({why.splitlines()[0] if why else 'no reason given'})"
            ):
                return
            survivors = [h for h in range(self.hosts) if h not in self.lost_hosts]
        logging.warning("pathways_jax: island %d was lost: %s", island, self.lost[island])
        self.fleet.isolate(host, survivors)
        if self.on_lost is not None:
            self.on_lost(island)
        # Last: what waits on these hosts' answers wakes to a cluster that has moved on.
        for member in members:
            self.link.host_lost(member, self.lost.get(island) or why)
        if self.replace_lost:
            reentry.runtime_thread(
                self._rebuild, args=(island,), name=f"pathways-ray-rebuild-{island}"
            ).start()

    def _record_lost(self, island: int, why: str) -> bool:
        """Marks ``island`` and its hosts lost, saying ``why``; False if it was already. Call with ``_lock`` held."""
        if island in self.lost:
            return False
        self.lost[island] = self._lost_before[island] = why
        for member in self.layout.members(island):
            self.lost_hosts[member] = why
        return True

    def _rebuild(self, island: int) -> None:
        """Starts new hosts for a lost island in its bundles; once they serve, the island is placed on again.

        If Ray has no room for them within ``_REBUILD_TIMEOUT_S`` (a node went
        with the hosts), the island stays out of placement.
        """
        fleet = self.fleet
        members = self.layout.members(island)
        new: list[Any] = []
        try:
            new, info = fleet.replace(island, _REBUILD_TIMEOUT_S)
            with self._lock:
                if self._closed:
                    raise errors.ClusterError("the cluster closed")
                fleet.install(members, new, info)
                for member in members:
                    self.sender.renew(member)
                serving = [h for h in range(self.hosts) if h not in self.lost_hosts or h in members]
                addresses = {h: self.info[h]["transfer"] for h in serving}
                answers = [self._message(h, "peers", addresses) for h in serving]
            for answer in results(answers, _REBUILD_TIMEOUT_S):
                if answer is not None:
                    raise errors.ClusterError(f"the new hosts could not reach the others: {answer}")
            with self._lock:
                self.generations[island] += 1
                del self.lost[island]
                for member in members:
                    del self.lost_hosts[member]
        except Exception as exc:
            fleet.kill(new)
            if not self._closed:
                logging.warning(
                    "pathways_jax: island %d could not be rebuilt on new hosts (%s); it stays out of placement.",
                    island,
                    exc,
                )
            return
        logging.warning("pathways_jax: island %d was rebuilt on new hosts", island)
        if self.on_restored is not None:
            self.on_restored(island)

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Kills the host actors (their values go with them) and stops this side's threads.

        Never waits for a host: the actors are killed without waiting, and this
        side's threads are waited for up to ``timeout`` seconds in all
        (``None``: as long as they take); one still running then is left as a
        daemon thread, and logged.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._closed = True
        fleet = getattr(self, "fleet", None)
        if fleet is not None:
            fleet.close()
        for thread in getattr(self, "_threads", []):
            if thread is threading.current_thread():
                continue
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logging.warning(
                    "pathways_jax: Ray backend thread %s did not stop within %ss; it is left running "
                    "as a daemon thread.",
                    thread.name,
                    timeout,
                )
