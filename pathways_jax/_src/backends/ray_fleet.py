"""The Ray backend's host actors: placed one a bundle, started, watched, replaced and killed.

:class:`HostActors` owns the actors and their placement group; the backend
that holds it decides what a dead or hung host means (``RayBackend.mark_lost``)
and numbers the messages they are sent.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from typing import Any, Protocol

import jax
from absl import logging

from pathways_jax._src.backends import ray_host, version_check
from pathways_jax._src.backends.host_link import Link
from pathways_jax._src.backends.ray_boot import Layout, check_cpus, check_gpus
from pathways_jax._src.backends.ray_failures import is_lost_error
from pathways_jax._src.backends.ray_host import Role
from pathways_jax._src.core import errors

_PING_S = 0.25  # how often the monitor looks at every host
# A host whose channel said nothing, not even a heartbeat (one a second), for this long is hung
# (a stopped or wedged process: Ray still sees its actor alive): it is killed and counts as lost.
# PATHWAYS_JAX_HUNG_S (seconds) in the environment of the process that watches the hosts
# (pw.init's, or pw.serve's: the service takes its starter's) sets another.
HUNG_S = 10.0
HUNG_ENV = "PATHWAYS_JAX_HUNG_S"
# A monitor that did not look for this long was not running itself (its process stopped, Ctrl-Z, or
# starved): the hosts' silence meanwhile is its own, and each is given HUNG_S again from its return.
PAUSED_S = 2.0
START_TIMEOUT_S = 120.0
# A placement the Ray cluster had no free room for (its CPUs, or GPUs, held by others: another
# service's hosts, another job's actors) all this long is refused, not waited on for START_TIMEOUT_S.
# Long enough for the bundles of actors just killed (a service just stopped) to come back.
# PATHWAYS_JAX_ROOM_GRACE_S (seconds) in the environment of the process that places the hosts
# (pw.init's, or pw.serve's: the service takes its starter's) sets another grace.
ROOM_GRACE_S = 10.0
ROOM_GRACE_ENV = "PATHWAYS_JAX_ROOM_GRACE_S"
_STRIKE_POLL_S = 0.01  # how often a host told to kill itself is asked whether it is dead
# A run failed on a host of an island of several hosts, or that pulled values
# from other hosts: how long the controller waits for those hosts to answer a
# ping before it takes the failure as the run's own (a dead host answers with
# an error at once; a busy one answers later, on its event loop).
_HEALTH_CHECK_S = 3.0


class Watcher(Protocol):
    """What the actors' monitor reads of the backend that holds them (``ray.RayBackend``)."""

    @property
    def lost_hosts(self) -> dict[int, str]: ...
    @property
    def closed(self) -> bool: ...

    def mark_lost(self, host: int, why: str, generation: int | None = None) -> None:
        """Host ``host`` died (or hung and was killed): its island is lost."""
        ...


def _unanswered(exc: BaseException) -> str:
    """Why a host did not answer, said of it."""
    return "is already dead" if is_lost_error(exc) else f"did not answer ({type(exc).__name__}: {exc})"


def results(answers: list[concurrent.futures.Future], timeout: float) -> list:
    """The hosts' answers, waiting up to ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    return [answer.result(timeout=max(0.0, deadline - time.monotonic())) for answer in answers]


def _seconds_from_env(name: str, default: float) -> float:
    """Seconds that environment variable ``name`` says, else ``default``.

    Raises:
      ClusterError: the variable is not a number of seconds > 0.
    """
    said = os.environ.get(name)
    if said is None:
        return default
    try:
        seconds = float(said)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise errors.ClusterError(
            f"{name} must be a number of seconds > 0, got {said!r}; set it to one "
            f"(or unset it for the default {default:g})."
        )
    return seconds


def room_grace_s() -> float:
    """Seconds a placement may find too few free resources before it is refused:
    ``PATHWAYS_JAX_ROOM_GRACE_S`` in this process's environment, else ``ROOM_GRACE_S``."""
    return _seconds_from_env(ROOM_GRACE_ENV, ROOM_GRACE_S)


def hung_s() -> float:
    """Seconds of silence after which a host is hung: ``PATHWAYS_JAX_HUNG_S`` in this process's
    environment, else ``HUNG_S``."""
    return _seconds_from_env(HUNG_ENV, HUNG_S)


def place(ray: Any, pg: Any, bundle: dict[str, float], hosts: int, grace: float) -> None:
    """Waits until placement group ``pg`` (``hosts`` bundles of ``bundle``) is placed.

    Raises:
      ClusterError: the cluster had too few free resources for it for ``grace`` seconds on end
        (others hold them), naming what it needs and what is free; or it was not placed within
        ``START_TIMEOUT_S``.
    """
    ready = pg.ready()
    started = roomy = time.monotonic()
    while not ray.wait([ready], timeout=0.25)[0]:
        now = time.monotonic()
        free = ray.available_resources()
        short = {
            name: (amount * hosts, free.get(name, 0.0))
            for name, amount in bundle.items()
            if free.get(name, 0.0) < amount * hosts
        }
        if not short:
            roomy = now
        elif now - roomy > grace:
            total = ray.cluster_resources()
            said = ", ".join(
                f"{need:g} {name} (the cluster has {total.get(name, 0.0):g}, {have:g} of them free)"
                for name, (need, have) in short.items()
            )
            raise errors.ClusterError(
                f"Ray cannot place {hosts} hosts ({bundle} each): they need {said}, and no more came "
                f"free for {grace:g}s: other actors hold the rest (another controller service's "
                "or pw.init's hosts, another job's; `ray status` shows them). Stop what holds them "
                "(pw.service(name).stop(), `python -m pathways_jax stop`), add nodes, or ask for fewer hosts."
            )
        if now - started > START_TIMEOUT_S:
            raise errors.ClusterError(
                f"Ray could not place {hosts} hosts ({bundle} each) within {START_TIMEOUT_S}s. "
                "Ask for fewer hosts, or add nodes to the Ray cluster."
            )
    ray.get(ready)


class HostActors:
    """One ``ray_host.Host`` actor a host, each in its bundle of one placement group.

    ``actors[h]`` and ``info[h]`` (what host ``h`` said when it started) are
    replaced in place when a lost island is rebuilt.
    """

    link: Link  # how the hosts are reached (set by launch)

    def __init__(self, ray: Any, layout: Layout, platform: str, window_size: int) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        self.layout = layout
        self.platform = platform
        self.remove_pg = remove_placement_group
        hosts, devices_per_host = layout.hosts, layout.devices_per_host
        bundle: dict[str, float] = {"CPU": 1}
        check_cpus(ray, hosts)
        if platform != "cpu":
            bundle["GPU"] = devices_per_host
            check_gpus(ray, hosts, devices_per_host)
        grace = room_grace_s()
        self.hung_s = hung_s()
        self.pg = placement_group([bundle] * hosts, strategy="SPREAD")
        try:
            place(ray, self.pg, bundle, hosts, grace)
        except BaseException:
            remove_placement_group(self.pg)
            raise
        self.window_size = window_size  # each host's executables in flight at most
        self._x64 = bool(jax.config.read("jax_enable_x64"))
        self._strategy = PlacementGroupSchedulingStrategy
        self._actor_class = ray.remote(ray_host.Host)
        self.actors: list[Any] = []
        self.info: list[dict] = []
        self._pings: dict[int, tuple[Any, Any]] = {}  # host -> (its ping in flight, the actor pinged)
        self._resumed = time.monotonic()  # since when the monitor runs without a pause of its own

    def new_actor(self, host: int) -> Any:
        """A host actor for host ``host``, in its bundle of the placement group."""
        return self._actor_class.options(
            num_cpus=1,
            num_gpus=0 if self.platform == "cpu" else self.layout.devices_per_host,
            max_restarts=0,
            max_concurrency=1000,
            scheduling_strategy=self._strategy(placement_group=self.pg, placement_group_bundle_index=host),
        ).remote(host, self.layout.devices_per_host, self.window_size, self._x64, self.platform)

    def launch(self, link: Link) -> None:
        """Starts every host's actor, reached over ``link``; :meth:`start` sets them up."""
        self.link = link
        self.actors = [self.new_actor(h) for h in range(self.layout.hosts)]

    def start(self) -> list[dict]:
        """Joins each island's hosts into one ``jax.distributed`` system; what each host said."""
        layout = self.layout
        self.check_versions(range(layout.hosts), self.actors, START_TIMEOUT_S)
        # Every host reaches the Ray cluster's address: its route names the host's own.
        reach = self.ray.get_runtime_context().gcs_address
        coordinators: dict[int, str | None] = {}
        for island in range(layout.islands):
            first = layout.members(island)[0]
            many = layout.per_island > 1
            coordinators[island] = (
                self.ray.get(self.actors[first].address.remote(reach), timeout=START_TIMEOUT_S)
                if many
                else None
            )
        roles = [
            Role(
                layout.island_of(h),
                layout.rank(h),
                layout.per_island,
                coordinators[layout.island_of(h)],
                reach,
            )
            for h in range(layout.hosts)
        ]
        # All at once: joining an island blocks until every member has.
        info = self._setup(range(layout.hosts), self.actors, roles, START_TIMEOUT_S)
        want = layout.per_island * layout.devices_per_host
        for h, host_info in enumerate(info):
            if host_info["devices"] != layout.devices_per_host or host_info["island_devices"] != want:
                raise errors.ClusterError(
                    f"host {h} exposes {host_info['devices']} devices ({host_info['island_devices']} in its "
                    f"island), not devices_per_host={layout.devices_per_host} ({want} per island)."
                )
        self.info = info
        return info

    def check_versions(self, hosts: Any, actors: list, timeout: float) -> None:
        """Refuses host actors (``actors``, of ``hosts``) whose pathways_jax, wire format or jax differ
        from this process's: Ray starts each with what its node has installed, which on another node
        may be another version (a ClusterError naming the host, its node and both sides' versions)."""
        mine = version_check.versions()
        refs = [actor.versions.remote(version_check.versions) for actor in actors]
        for h, ref in zip(hosts, refs, strict=True):
            try:
                theirs, node = self.ray.get(ref, timeout=timeout)
            except Exception as exc:
                # Ray loads the actor class on the node by name, methods included: a node whose
                # pathways_jax lacks one of this process's (an older one, or none) fails to import it.
                if "failed to import on the worker" not in str(exc):
                    raise
                unloadable = version_check.host_unloadable(h, str(exc).strip().splitlines()[-1], mine)
                raise errors.ClusterError(f"the Ray host actors did not start: {unloadable}.") from exc
            wrong = version_check.host_mismatch(h, node, theirs, mine)
            if wrong is not None:
                raise errors.ClusterError(f"the Ray host actors did not start: {wrong}.")

    def _setup(self, hosts: Any, actors: list, roles: list[Role], timeout: float) -> list[dict]:
        link, island_of = self.link, self.layout.island_of
        return self.ray.get(
            [
                actor.setup.remote(role, link.attach(h, actor, island_of(h)))
                for h, actor, role in zip(hosts, actors, roles, strict=True)
            ],
            timeout=timeout,
        )

    def replace(self, island: int, timeout: float) -> tuple[list, list[dict]]:
        """New actors for a lost island's hosts, in their bundles, set up: (actors, what each said).

        The old ones are killed first (their bundles are free once their
        processes are gone). The new ones serve once :meth:`install` puts them in.
        """
        ray = self.ray
        members = self.layout.members(island)
        for member in members:
            with contextlib.suppress(Exception):
                ray.kill(self.actors[member], no_restart=True)
        new = [self.new_actor(member) for member in members]
        try:
            self.check_versions(members, new, timeout)
            reach = ray.get_runtime_context().gcs_address
            many = self.layout.per_island > 1
            coordinator = ray.get(new[0].address.remote(reach), timeout=timeout) if many else None
            roles = [
                Role(island, self.layout.rank(m), self.layout.per_island, coordinator, reach) for m in members
            ]
            return new, self._setup(members, new, roles, timeout)
        except Exception:
            self.kill(new)
            raise

    def install(self, members: tuple[int, ...], actors: list, info: list[dict]) -> None:
        """Puts the actors :meth:`replace` made in their hosts' places."""
        for member, actor, host_info in zip(members, actors, info, strict=True):
            self.actors[member], self.info[member] = actor, host_info
            self._pings.pop(member, None)

    def kill(self, actors: list) -> None:
        for actor in actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)

    def strike(self, host: int, fault: ray_host.Fault, timeout: float) -> None:
        """Has host ``host`` strike ``fault`` on itself (``pw.faults``).

        Returns once the host holds it (or, armed for its next run, struck
        before its answer left); a kill asked for now returns once Ray sees
        the actor dead. Raises ``ClusterError`` if the host does not answer
        within ``timeout`` seconds, or is already dead.
        """
        ray = self.ray
        actor = self.actors[host]
        deadline = time.monotonic() + timeout
        try:  # dead already (and not yet found so): nothing to inject
            ray.get(actor.ping.remote(), timeout=timeout)
        except Exception as exc:
            raise errors.ClusterError(f"host {host} {_unanswered(exc)}: no fault was injected.") from exc
        try:
            ray.get(actor.arm.remote(fault), timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:
            if not is_lost_error(exc):
                raise errors.ClusterError(f"host {host} {_unanswered(exc)}: no fault was injected.") from exc
            return  # alive a moment ago, armed for its next run: it struck before its answer left
        if fault.kind != "kill" or fault.at_run > 0 or fault.at_save > 0:
            return
        while time.monotonic() < deadline:  # it strikes just after answering: wait for Ray to see it dead
            ref = actor.ping.remote()
            ready, _ = ray.wait([ref], timeout=max(0.0, min(_PING_S, deadline - time.monotonic())))
            if not ready:
                continue
            try:
                ray.get(ref)
            except Exception as exc:
                if is_lost_error(exc):
                    return
                raise
            # Alive still: it strikes ray_host.faults.STRIKE_DELAY_S after answering.
            time.sleep(_STRIKE_POLL_S)
        raise errors.ClusterError(f"host {host} was told to kill itself and still answers after {timeout}s.")

    def isolate(self, host: int, survivors: list[int]) -> None:
        """Host ``host`` died: its island's other hosts are killed, and ``survivors`` stop waiting on them."""
        members = self.layout.members(self.layout.island_of(host))
        # An island runs as one: its other hosts' collectives would fail or hang.
        for member in members:
            if member != host:
                with contextlib.suppress(Exception):
                    self.ray.kill(self.actors[member], no_restart=True)
        for h in survivors:
            for member in members:
                with contextlib.suppress(Exception):
                    self.actors[h].peer_lost.remote(member)

    def first_dead(self, hosts: list[int]) -> tuple[int, BaseException] | None:
        """The first of ``hosts`` whose actor answers a ping saying it died, and how; None if all
        answer or are busy (up to ``_HEALTH_CHECK_S``)."""
        pings = {self.actors[h].ping.remote(): h for h in hosts}
        ready, _ = self.ray.wait(list(pings), num_returns=len(pings), timeout=_HEALTH_CHECK_S)
        for ref in ready:
            try:
                self.ray.get(ref)
            except Exception as exc:
                if is_lost_error(exc):
                    return pings[ref], exc
        return None

    def monitor(self, watcher: Watcher) -> None:
        """Pings every host; a host whose actor died is lost. A slow host is only slow."""
        ray = self.ray
        looked = time.monotonic()
        while not watcher.closed:
            now = time.monotonic()
            if now - looked > min(PAUSED_S, self.hung_s / 2):
                self._resumed = now  # this process did not run: the hosts were not heard, not silent
            looked = now
            try:
                self._look(watcher)
            except Exception as exc:  # Ray itself went away (process exit): stop looking
                if watcher.closed or not ray.is_initialized():
                    return
                logging.warning("pathways_jax: the Ray host monitor failed once: %s", exc)
            time.sleep(_PING_S)

    def _look(self, watcher: Watcher) -> None:
        ray = self.ray
        for host in range(self.layout.hosts):
            if host in watcher.lost_hosts or watcher.closed:
                continue
            silent = self.link.silent_for(host)
            if silent is not None:
                silent = min(silent, time.monotonic() - self._resumed)
            if silent is not None and silent > self.hung_s:
                with contextlib.suppress(Exception):
                    ray.kill(self.actors[host], no_restart=True)
                watcher.mark_lost(
                    host, f"it sent nothing, not even a heartbeat, for {silent:.0f}s: hung, and killed"
                )
                continue
            sent = self._pings.get(host)
            if sent is None:
                actor = self.actors[host]
                self._pings[host] = (actor.ping.remote(), actor)
                continue
            ref, actor = sent
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue  # still busy: slow is not lost
            self._pings.pop(host, None)
            try:
                ray.get(ref)
            except Exception as exc:
                # Only the actor that serves the host now: a ping to one that died and was
                # replaced since (the island rebuilt meanwhile) says nothing of its successor.
                if not watcher.closed and is_lost_error(exc) and actor is self.actors[host]:
                    watcher.mark_lost(host, str(exc))

    def close(self) -> None:
        """Kills the actors without waiting (their values go with them), closes the link, frees the bundles."""
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        link = getattr(self, "link", None)
        if link is not None:
            link.close()
        with contextlib.suppress(Exception):
            self.remove_pg(self.pg)
