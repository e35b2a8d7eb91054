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

**The parts.** What a controller service's client does alike (splitting
plans, sending runs, fetching values, what a host's answer means) is a
``ray_dispatch.Dispatcher`` this backend holds, given a
``ray_route.DirectRoute`` to its own host actors; the client holds one too,
with a route to the service instead.

Ray is imported lazily (``ray_boot.import_ray``): ``pip install pathways-jax[ray]``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import TYPE_CHECKING, Any

import jax
from absl import logging

from pathways_jax._src.backends import ray_fleet, ray_host
from pathways_jax._src.backends.base import Dispatched, FaultKind, Prepared, Windows
from pathways_jax._src.backends.host_link import HostGone, Link
from pathways_jax._src.backends.ray_boot import Layout as Layout
from pathways_jax._src.backends.ray_boot import import_ray as import_ray
from pathways_jax._src.backends.ray_boot import join_ray
from pathways_jax._src.backends.ray_boot import make_link as make_link
from pathways_jax._src.backends.ray_checkpoints import HostCheckpoints
from pathways_jax._src.backends.ray_dispatch import CALL_TIMEOUT_S as CALL_TIMEOUT_S
from pathways_jax._src.backends.ray_dispatch import Dispatcher
from pathways_jax._src.backends.ray_failures import is_lost_error as is_lost_error
from pathways_jax._src.backends.ray_failures import refusal as refusal
from pathways_jax._src.backends.ray_failures import with_remote_traceback as with_remote_traceback
from pathways_jax._src.backends.ray_fleet import HUNG_S as HUNG_S
from pathways_jax._src.backends.ray_fleet import HostActors, results
from pathways_jax._src.backends.ray_losses import Losses
from pathways_jax._src.backends.ray_places import Places
from pathways_jax._src.backends.ray_plan import Placed
from pathways_jax._src.backends.ray_route import DirectRoute
from pathways_jax._src.backends.ray_send import Sender
from pathways_jax._src.backends.ray_values import RemoteArray
from pathways_jax._src.core import errors, reentry

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan

CLOSE_TIMEOUT_S = 10.0  # how long close() waits for this side's threads unless told
# How long new hosts for a lost island may take to start on a first try; each try after a failed
# one gives them twice as long, up to _REBUILD_TIMEOUT_MAX_S. A try that runs out kills the hosts it
# started: with a fixed time, a machine where hosts take longer to start (a loaded one: 60-90 s were
# seen on 2 cores at load 15) never got the island back.
_REBUILD_TIMEOUT_S = 60.0
_REBUILD_TIMEOUT_MAX_S = 480.0
_REBUILD_RETRY_S = 5.0  # a rebuild that failed is tried again this much later, then twice as late ...
_REBUILD_RETRY_MAX_S = 120.0  # ... up to this

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


class RayBackend:
    """The controller's side of the Ray backend: its host actors, and what a lost host means.

    Implements :class:`~pathways_jax._src.backends.base.Backend`: a run is one
    message per host, and each host dispatches its part of the plan itself.
    It holds its host actors (``fleet``, a :class:`~.ray_fleet.HostActors`),
    the link to them (``link``) and a :class:`~.ray_dispatch.Dispatcher`
    (``dispatcher``) that prepares, sends, settles and fetches over a
    :class:`~.ray_route.DirectRoute` to those actors. ``lost`` is keyed by
    island (an island is lost as a unit): the ``losses``' own.
    """

    name = "ray"
    window_size: int | None = RUNS_IN_FLIGHT
    donates = True  # hosts compile the exported nodes with the donation this process's have
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
        ray = self.ray = import_ray()
        layout = self.layout = Layout(hosts, devices_per_host, hosts // (islands or hosts))
        self.hosts = hosts
        self.places = Places(layout, standins, platform)
        self.export_platforms = self.places.export_platforms
        losses = self.losses = Losses(layout)
        # The losses' own: Backend.lost, what the host monitor and the service's actor read.
        self.lost, self.lost_hosts, self.generations = losses.lost, losses.lost_hosts, losses.generations
        self.on_lost = on_lost  # set by the cluster: called with a lost island
        self.on_restored: Any = None  # set by the cluster: called with a rebuilt island
        # Set by the cluster: forgets the store's values whose futures went (their
        # handles went with them), and the hosts hear of it even when no program runs.
        self.collect: Any = None
        self.slices_of: Any = None  # set by the cluster: its live slices' device ids, by slice id
        self.sender = Sender(layout)  # message numbers, what each host has and is to free
        # A lost island is rebuilt on new hosts (in the same bundles) when Ray has room.
        self.replace_lost = replace_lost
        join_ray(ray, address, hosts)
        # Each host of an island of several bounds its executables in flight lower.
        host_window_size = window_size if layout.per_island == 1 else min(window_size, CROSS_HOST_WINDOW)
        self.fleet = HostActors(ray, layout, platform, host_window_size)
        self.link: Link = make_link(transport)
        self.route = DirectRoute(self.sender, self.link, losses, self.fleet, self)
        self.dispatcher = Dispatcher(ray, self.places, losses, self.sender, self.route)
        self.checkpoints = HostCheckpoints(
            self.dispatcher
        )  # saves and restores the hosts write (base.HostWrites)
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
            reentry.runtime_thread(self.dispatcher.flush_loop, args=(self,), name="pathways-ray-flush"),
        ]
        for thread in self._threads:
            thread.start()

    def _connect(self) -> None:
        """Tells every host where the others' transfer servers are."""
        addresses = {h: host_info["transfer"] for h, host_info in enumerate(self.info)}
        with self.dispatcher.lock:
            answers = [self.route.message(h, "peers", (addresses,)) for h in range(self.hosts)]
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
        return self.dispatcher.closed

    # --- the Backend protocol: the dispatcher's ------------------------------------------------

    @property
    def islands(self) -> tuple[tuple[jax.Device, ...], ...]:
        return self.places.islands

    def place_of(self, device: Any) -> tuple[int, int, int]:
        """A stand-in device's island, position among the island's devices, and host."""
        return self.places.place_of(device)

    def prepare(self, plan: Plan) -> Prepared:
        return self.dispatcher.prepare(plan)

    def execute(self, run: Any, windows: Windows) -> Dispatched:
        return self.dispatcher.execute(run, windows)

    def settle(self, in_flight: collections.deque) -> None:
        self.dispatcher.settle(in_flight)

    # --- checkpoints the hosts write (base.HostWrites) ------------------------------------------

    def holds(self, value: Any) -> bool:
        """Whether ``value`` (a future's array) is a value these hosts keep."""
        return isinstance(value, RemoteArray) and value.backend is self.dispatcher and value.key is not None

    def where(self, sharding: Any) -> Placed | None:
        """The island, hosts and descriptor of a sharding over these hosts' stand-ins; None if it is not."""
        try:
            devices = sharding.device_set
        except (AttributeError, ValueError):  # no sharding, or one over an abstract mesh
            return None
        if not devices or not all(self.places.owns(device) for device in devices):
            return None
        return self.places.where(sharding, "a restored value")

    # --- messages a controller service composes itself -------------------------------------------

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
        with self.dispatcher.lock:
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

    def take_uuids(self, count: int) -> int:
        """The first of ``count`` fresh transfer uuids (for a run the caller sends itself)."""
        with self.dispatcher.lock:
            return self.sender.take_uuids(count)

    def host_stats(self, timeout: float = CALL_TIMEOUT_S) -> dict[int, dict]:
        """Each live host's counts: values kept, runs done, executables and plans cached, transfers."""
        live = [h for h in range(self.hosts) if h not in self.lost_hosts]
        stats = self.ray.get([self.actors[h].stats.remote() for h in live], timeout=timeout)
        return dict(zip(live, stats, strict=True))

    def strike(
        self, host: int, kind: FaultKind, at_run: int, timeout: float = CALL_TIMEOUT_S, at_save: int = 0
    ) -> None:
        """Has host ``host`` strike a fault on itself (``base.Strikes``); ClusterError if it is lost."""
        why = self.lost_hosts.get(host)
        if why is not None:
            raise errors.ClusterError(f"host {host} is lost already ({why}): no fault was injected.")
        self.fleet.strike(host, ray_host.Fault(kind, at_run, at_save), timeout)

    # --- health ------------------------------------------------------------------------

    def mark_lost(self, host: int, why: str, generation: int | None = None) -> None:
        """Host ``host`` died: its island is lost, its other hosts are killed, the rest stop waiting on them.

        ``generation``: of the island the death was seen in; a death of hosts
        already replaced changes nothing.
        """
        island = self.layout.island_of(host)
        members = self.layout.members(island)
        with self.dispatcher.lock:
            if self.closed or (generation is not None and generation != self.generations[island]):
                return
            if not self.losses.record(
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

    def _rebuild(self, island: int) -> None:
        """Starts new hosts for a lost island in its bundles; once they serve, the island is placed on again.

        A try that fails (Ray had no room for them within ``_REBUILD_TIMEOUT_S``:
        a node went with the hosts; or they took longer to start) is tried
        again, ``_REBUILD_RETRY_S`` later and then less often, each try giving
        the new hosts twice as long to start as the one before (up to
        ``_REBUILD_TIMEOUT_MAX_S``), until it succeeds or the cluster closes:
        a week-long job gets its island back without anyone restarting it,
        and so does a loaded machine whose hosts start slowly.
        """
        wait, timeout = _REBUILD_RETRY_S, _REBUILD_TIMEOUT_S
        while not self._rebuild_once(island, timeout):
            if self.closed:
                return
            logging.warning(
                "pathways_jax: island %d will be rebuilt again in %.0f s, its new hosts given %.0f s to start",
                island,
                wait,
                min(2 * timeout, _REBUILD_TIMEOUT_MAX_S),
            )
            time.sleep(wait)
            wait = min(2 * wait, _REBUILD_RETRY_MAX_S)
            timeout = min(2 * timeout, _REBUILD_TIMEOUT_MAX_S)
            if self.closed:
                return
        logging.warning("pathways_jax: island %d was rebuilt on new hosts", island)
        if self.on_restored is not None:
            self.on_restored(island)

    def _rebuild_once(self, island: int, timeout: float = _REBUILD_TIMEOUT_S) -> bool:
        """One try at :meth:`_rebuild`, its new hosts given ``timeout`` seconds to start: True once the
        island serves again."""
        fleet = self.fleet
        members = self.layout.members(island)
        new: list[Any] = []
        lock = self.dispatcher.lock
        try:
            new, info = fleet.replace(island, timeout)
            with lock:
                if self.closed:
                    raise errors.ClusterError("the cluster closed")
                fleet.install(members, new, info)
                for member in members:
                    self.sender.renew(member)
                serving = [h for h in range(self.hosts) if h not in self.lost_hosts or h in members]
                addresses = {h: self.info[h]["transfer"] for h in serving}
                answers = [self.route.message(h, "peers", (addresses,)) for h in serving]
            deadline = time.monotonic() + timeout
            for host, answer in zip(serving, answers, strict=True):
                try:
                    told = answer.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    if host not in members and host in self.lost_hosts:
                        continue  # lost meanwhile (its own rebuild tells its new hosts): not this island's
                    raise
                if told is not None:
                    raise errors.ClusterError(f"the new hosts could not reach the others: {told}")
            with lock:
                self.losses.restore(island, self.generations[island] + 1)
        except Exception as exc:
            fleet.kill(new)
            if not self.closed:
                logging.warning(
                    "pathways_jax: island %d could not be rebuilt on new hosts (%s); it stays out of placement "
                    "meanwhile.",
                    island,
                    exc,
                )
            return False
        return True

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Kills the host actors (their values go with them) and stops this side's threads.

        Never waits for a host: the actors are killed without waiting, and this
        side's threads are waited for up to ``timeout`` seconds in all
        (``None``: as long as they take); one still running then is left as a
        daemon thread, and logged.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self.dispatcher.closed = True
        self.fleet.close()
        for thread in getattr(self, "_threads", []):  # none if the hosts did not start
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
