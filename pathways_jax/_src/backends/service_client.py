"""A client process's side of a controller service (``pw.init(backend="ray", service=...)``).

The service itself (``pw.serve``) is ``runtime/serving/``: a named, detached
Ray actor owning the hosts. A client process joins it (:func:`join`: a
token actor that dies with the process tells the service when it went) and
keeps the whole API: it traces and lowers locally, against stand-in CPU
devices, as on the plain Ray backend, and its :class:`ServiceBackend` sends
what that backend would send to the hosts to the service instead, one
numbered batch per run (every host's message of the run at once, so the
hosts of an island see the run at the same place in their order). Plans go
once per host; a run is its plan key, input handles and fed arguments;
values stay on the hosts and the client holds handles. A value another
client process shared with this one (``pw.share``) is named by a
:class:`Handle` and read as ``(owner, key)``: the service checks that it may be.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from absl import logging

from pathways_jax._src.backends import ray_fleet
from pathways_jax._src.backends.base import Dispatched, Prepared, StartOptions, Windows, given
from pathways_jax._src.backends.host_link import HostGone
from pathways_jax._src.backends.ray import CLOSE_TIMEOUT_S, RUNS_IN_FLIGHT
from pathways_jax._src.backends.ray_boot import (
    Layout,
    check_joined,
    check_reachable,
    import_ray,
    ray_init_uninterrupted,
    send_saved_token,
)
from pathways_jax._src.backends.ray_dispatch import CALL_TIMEOUT_S, Dispatcher
from pathways_jax._src.backends.ray_failures import is_lost_error
from pathways_jax._src.backends.ray_host import Refused, sharding_of
from pathways_jax._src.backends.ray_losses import Losses
from pathways_jax._src.backends.ray_places import Places
from pathways_jax._src.backends.ray_send import Sender
from pathways_jax._src.backends.ray_values import RemoteArray
from pathways_jax._src.backends.service_route import STOPPED, ServiceRoute
from pathways_jax._src.backends.version_check import version_mismatch, versions
from pathways_jax._src.core import checks, errors, events, reentry

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan

NAMESPACE = "pathways_jax"  # the Ray namespace services are named in
_HEALTH_S = 0.25  # how often a client asks the service about lost islands
_HEALTH_TIMEOUT_S = 10.0  # a health check the service does not answer in this long is logged
_JOIN_TIMEOUT_S = 60.0
_SHARE_TIMEOUT_S = 60.0  # for the service's answer to a share
# How long a close waits for the service to take this process's leave (a service that does not
# answer, stopped or hung, still hears of it when this process's token actor is killed).
_LEAVE_TIMEOUT_S = 5.0
_REACH_S = 1.0  # for the Ray cluster's head to take a connection, as this process leaves
# The Ray clusters (their heads' GCS addresses) a client's join connected this process to, where it
# had no Ray session: leaving a service that is gone ends that session (ServiceBackend.close).
_JOINED_RAY: set[str] = set()


def connect(address: str | None, *, start: bool = False, hosts: int = 1) -> Any:
    """This process's Ray session: the cluster at ``address``; ``None``: the running one (``start``: else a
    new one, with a logical CPU for each of ``hosts`` host actors at least)."""
    ray = import_ray()
    if ray.is_initialized():
        check_joined(ray, address)
    else:
        if address is None and start:
            logging.warning(
                "pathways_jax: pw.serve started a new local Ray cluster in this process; the service lives as "
                "long as this process does. Start one with `ray start --head` for a service that outlives it."
            )
        where = address or ("local" if start else "auto")
        if where != "local":
            check_reachable(where)
            send_saved_token(where)
        try:
            with ray_init_uninterrupted():
                ray.init(
                    address=where,
                    namespace=NAMESPACE,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                    num_cpus=max(hosts, os.cpu_count() or 1) if where == "local" else None,
                )
        except Exception as exc:
            raise errors.ClusterError(
                f"could not reach the Ray cluster at {where!r}: {exc}. Start one with `ray start --head`, or "
                "pass the address of the one the controller service runs in (pw.Service.address)."
            ) from exc
    return ray


def find(ray: Any, name: str, what: str) -> Any:
    """The actor of the controller service ``name`` in this process's Ray cluster (ClusterError if none)."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError as exc:
        raise errors.ClusterError(
            f"{what}: no controller service named {name!r} runs in this Ray cluster "
            f"({ray.get_runtime_context().gcs_address}); start one with pw.serve({name!r}, hosts=...) or "
            f"`python -m pathways_jax --name {name} serve --hosts N`."
        ) from exc


class Token:
    """A client process's token actor: it dies with the process, which tells the service."""

    async def hold(self) -> None:
        await asyncio.Event().wait()


# --- the client's side ---------------------------------------------------------------------------


def join(name: str, address: str | None, client_name: str | None) -> tuple[Any, Any, dict]:
    """Joins service ``name``: (its actor, this process's token actor, what the service said)."""
    import jax

    fresh = not import_ray().is_initialized()
    ray = connect(address)
    if fresh:  # this join made the process's Ray session: its close may end it (ServiceBackend.close)
        _JOINED_RAY.add(str(ray.get_runtime_context().gcs_address))
    actor = find(ray, name, f"pw.init(service={name!r})")
    token = ray.remote(Token).options(num_cpus=0).remote()
    me = client_name or f"{socket.gethostname()}:{os.getpid()}"
    mine = versions()
    try:
        # The versions go first and by name: a service of any version since this check reads them
        # before the rest, and refuses a process of another one, saying both.
        joined = ray.get(
            actor.join.remote(
                me,
                os.getpid(),
                socket.gethostname(),
                token,
                bool(jax.config.read("jax_enable_x64")),
                versions=mine,
            ),
            timeout=_JOIN_TIMEOUT_S,
        )
    except BaseException as exc:
        # The service may have admitted this process already (a Ctrl-C as its answer came): the
        # token's end drops it there, or its name would stay taken until it fell silent for long.
        with contextlib.suppress(Exception):
            ray.kill(token)
        if not isinstance(exc, Exception):
            raise
        if isinstance(exc, TypeError) and "versions" in str(exc):  # a service from before the check
            raise errors.ClusterError(f"pw.init(service={name!r}): {version_mismatch(mine, None)}.") from exc
        raise errors.ClusterError(f"pw.init(service={name!r}): the service did not answer: {exc}") from exc
    if "refused" not in joined:
        wrong = version_mismatch(mine, joined.get("versions"))
        if wrong is not None:
            joined = {"refused": wrong}
    if "refused" in joined:
        with contextlib.suppress(Exception):
            ray.kill(token)
        raise errors.ClusterError(
            f"the controller service {name!r} did not admit this process: {joined['refused']}."
        )
    return actor, token, joined


def mismatches(args: StartOptions, joined: dict) -> list[str]:
    """The hosts' shape ``pw.init`` was given (``args``) that differs from the service's (``joined``, its
    answer to the join): each as ``"name=value (what the service has)"``; those left out are not checked."""
    hosts, per_host, per_island = joined["hosts"], joined["devices_per_host"], joined["per_island"]
    asked = {"hosts": args.hosts, "islands": args.islands}
    has = {"hosts": hosts, "islands": hosts // per_island}
    wrong = [f"{k}={asked[k]!r} (the service has {has[k]})" for k in asked if asked[k] not in (None, has[k])]
    if isinstance(args.islands, tuple):  # device ids, as the local backend takes them (frozen by pw.init)
        wrong[-1] = (
            f"islands={[list(group) for group in args.islands]!r} (the Ray backend takes None or a number "
            f"of islands: the service has {has['islands']})"
        )
    if given(args.devices_per_host) and args.devices_per_host != per_host:
        wrong.append(f"devices_per_host={int(args.devices_per_host)!r} (the service has {per_host})")
    if given(args.platform) and args.platform != joined["platform"]:
        wrong.append(f"platform={str(args.platform)!r} (the service's hosts are {joined['platform']!r})")
    rebuilds = joined.get("replace_lost_hosts", True)
    if args.replace_lost_hosts is False and rebuilds:
        wrong.append(
            "replace_lost_hosts=False (the service rebuilds its lost islands for all its clients, as "
            "pw.serve(replace_lost_hosts=True) started it)"
        )
    elif args.replace_lost_hosts is True and args.replace_lost_hosts_given and not rebuilds:
        wrong.append(
            "replace_lost_hosts=True (the service does not rebuild lost islands: pw.serve("
            "replace_lost_hosts=False) started it, so an island that loses a host stays out of "
            "placement for all its clients; to have them rebuilt, start the service with "
            "pw.serve(replace_lost_hosts=True))"
        )
    return wrong


class ServiceBackend:
    """A client process's side of a controller service: the Ray backend's dispatch, sent to the service.

    Implements :class:`~pathways_jax._src.backends.base.Backend` (and the
    ``HostFleet``, ``Shares`` and ``ServiceView`` capabilities). Lowering,
    plans, handles and fetches are a :class:`~.ray_dispatch.Dispatcher`'s, as
    on the Ray backend, given a :class:`~.service_route.ServiceRoute`: every
    message goes to the service instead of a host, in numbered batches (a
    run's messages in one), and the service answers for the hosts. Lost and
    rebuilt islands are the service's word, applied here (``losses``).
    """

    name = "ray"
    window_size: int | None = RUNS_IN_FLIGHT
    donates = True  # hosts compile the exported nodes with the donation this process's have
    exports = True
    calls_back = False
    stages_inputs = False  # host inputs travel with the run's message

    def __init__(self, *, actor: Any, token: Any, joined: dict, standins: list, on_lost: Any):
        ray = self.ray = import_ray()
        # The service's channel heartbeats once a second of quiet: silent this long, its process is
        # stopped or hung (Ray still sees its actor alive), and what it owes this process fails.
        self.hung_s = ray_fleet.hung_s()
        # Since when it is known to run (an answer to a health check), and since when this process
        # runs without a pause of its own (its own pauses are not the service's silence).
        self._answered = self._looked = self._resumed = time.monotonic()
        layout = self.layout = Layout(joined["hosts"], joined["devices_per_host"], joined["per_island"])
        self.places = Places(layout, standins, joined["platform"])
        self.export_platforms = self.places.export_platforms
        self.losses = Losses(layout)
        self.lost = self.losses.lost
        self.losses.generations[:] = joined["generations"]
        for island, why in joined["lost"].items():
            self.losses.record(int(island), why)
        self.on_lost = on_lost  # set by the cluster: called with a lost island
        self.on_restored: Any = None  # set by the cluster: called with a rebuilt island
        self.collect: Any = None  # set by the cluster: frees the store's values whose futures went
        self.slices_of: Any = None  # set by the cluster: its live slices' device ids, by slice id
        self.service = actor
        # The Ray cluster this process joined (its head's GCS): one that ends (a service pw.serve started
        # in its own process takes it along) ends this process too unless it disconnects (_ray_gone).
        self._gcs = str(ray.get_runtime_context().gcs_address or "")
        self._service_gone = False  # it stopped, or its actor died (not: it dropped this process only)
        self.service_name = joined["name"]
        self.incarnation = joined["incarnation"]
        self.client_id = joined["client"]
        self.info = joined["info"]
        # The hosts' shape the service said it has: pw.init called again checks what it is given against it.
        self.shape = {k: joined[k] for k in ("hosts", "devices_per_host", "per_island", "platform")}
        self.shape["replace_lost_hosts"] = joined.get("replace_lost_hosts", True)
        self._token = token
        self._said: list[str] = []  # causes of runs' failures said once (events.said_once), until the close
        self.channel = joined["channel"]  # the service's channel, this process's identity there
        self.sender = Sender(layout)  # what each host has and is to free (the service numbers)
        self.route = ServiceRoute(self.service_name, self.channel, self.losses, self.refresh)
        left = (
            f"this process left the controller service {self.service_name!r} (pw.shutdown(), or its exit); "
            "its values there went with it, the service and its hosts serve on. Call .result() before "
            "pw.shutdown() to keep a value."
        )
        self.dispatcher = Dispatcher(ray, self.places, self.losses, self.sender, self.route, left)
        try:
            address = self.route.inbox.address
            ray.get(
                actor.inbox.remote(self.client_id, address.up, address.down, self.route.inbox_key),
                timeout=_JOIN_TIMEOUT_S,
            )
        except Exception:
            self.route.close()
            raise
        self._threads = [
            reentry.runtime_thread(self._monitor, name="pathways-service-health"),
            reentry.runtime_thread(self.dispatcher.flush_loop, args=(self,), name="pathways-service-flush"),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def closed(self) -> bool:
        return self.dispatcher.closed

    # --- the Backend protocol: the dispatcher's ------------------------------------------------

    @property
    def islands(self) -> tuple[tuple[Any, ...], ...]:
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

    # --- the service's own -------------------------------------------------------------------------

    def host_stats(self, timeout: float = CALL_TIMEOUT_S) -> dict[int, dict]:
        return self._ask("host_stats", timeout)

    def _ask(self, method: str, timeout: float) -> Any:
        """The service's answer to ``method``; ClusterError if it is gone or does not answer in time."""
        if timeout is not None and not checks.is_seconds(timeout):
            raise errors.ClusterError(
                f"{method}(timeout=...) must be None (no limit) or a finite number of seconds >= 0, got "
                f"{timeout!r} ({type(timeout).__name__})."
            )
        return self._answer(
            getattr(self.service, method).remote(),
            timeout,
            method,
            "Call pw.shutdown(), start the service again and pw.init(...) to join it.",
        )

    def _answer(self, ref: Any, timeout: float | None, what: str, then: str, call: str = "") -> Any:
        """The service's answer (``ref``, a call of it named ``what``), else a ClusterError: it is
        gone (saying ``then``: what to do), or it did not answer within ``timeout`` seconds.
        ``call``: the user's call the message opens with."""
        try:
            return self.ray.get(ref, timeout=timeout)
        except Exception as exc:
            if is_lost_error(exc):
                raise errors.ClusterError(
                    f"{call}the controller service {self.service_name!r} is gone (stopped, or its actor "
                    f"died: {type(exc).__name__}). {then}"
                ) from exc
            if isinstance(exc, self.ray.exceptions.GetTimeoutError):
                raise errors.ClusterError(
                    f"{call}the controller service {self.service_name!r} did not answer {what} within "
                    f"{timeout}s; check that it runs (`python -m pathways_jax stats`, `ray list actors`)."
                ) from exc
            raise

    def handle_of(self, array: Any) -> Handle:
        """The handle of a value this process holds (its own or received); ClusterError once the service
        is gone (a handle of it could name nothing: a service started again reuses its numbers)."""
        gone = self.route.gone_now()
        if gone is not None:
            raise errors.ClusterError(f"pw.share: {gone}")
        owner, key = (self.client_id, array.key) if isinstance(array.key, int) else array.key
        placed = self.places.where(array.sharding, "the shared value")
        return Handle(
            self.service_name,
            self.incarnation,
            owner,
            key,
            tuple(array.hosts),
            placed.island,
            placed.desc,
            tuple(array.aval.shape),
            array.aval.dtype,
            array.generation,
        )

    def array_of(self, handle: Handle) -> Any:
        """A RemoteArray of this process for ``handle`` (whether it may be read is the service's call)."""
        import jax

        if handle.service != self.service_name:
            raise errors.AccessError(
                f"the handle is of controller service {handle.service!r}; this process joined {self.service_name!r}."
            )
        if handle.incarnation != self.incarnation:
            raise errors.AccessError(
                f"the handle is of an earlier run of controller service {handle.service!r}, which was "
                "stopped (or died) and started again since: its value went with that run, and the numbers "
                "it names may now name another client's values. Share the value again from a process of "
                "this run (pw.share)."
            )
        devices = self.islands[handle.island]
        sharding = sharding_of(handle.desc, list(devices))
        aval = jax.core.ShapedArray(handle.shape, handle.dtype)
        # Named (owner, key) even for this process's own value: dropping it frees nothing (the
        # owner's own future does), and reading it after that is refused as stale.
        key = (handle.owner, handle.key)
        with self.dispatcher.lock:  # its free goes when the last such handle here went
            self.sender.receive(handle.hosts, key)
        return RemoteArray(self.dispatcher, handle.hosts, key, aval, sharding, (), handle.generation)

    def service_stats(self, timeout: float = 30.0) -> dict:
        return self._ask("stats", timeout)

    def share(self, key: int, reader: str) -> None:
        """Lets client process ``reader`` read value ``key``, once the runs sent before it are at the service."""
        with self.dispatcher.lock:  # in this process's order: after the run that makes the value
            future = self.route.submit([(-1, "share", (key, reader))], None)[0]
        try:
            answer = future.result(timeout=_SHARE_TIMEOUT_S)
        except concurrent.futures.TimeoutError as exc:
            raise errors.ClusterError(
                f"pw.share: the controller service {self.service_name!r} did not answer within "
                f"{_SHARE_TIMEOUT_S:.0f}s; check that it runs (`python -m pathways_jax stats`)."
            ) from exc
        except HostGone as exc:
            raise errors.ClusterError(f"pw.share: {self.route.gone_message(exc)}") from exc
        if isinstance(answer, Refused):
            raise errors.AccessError(f"pw.share: {answer.message}.")

    def cancel_client(self, client_key: int) -> None:
        """Cancels the runs of ``pw.client`` number ``client_key`` still queued at the service (it was
        closed); its answer is not waited for (the runs' own answers say they were cancelled)."""
        if self.closed:
            return
        with self.dispatcher.lock:  # in this process's order: after the client's last run
            self.route.submit([(-1, "cancel", (client_key,))], None)

    def check_again(self, args: StartOptions) -> None:
        """``pw.init`` called again in this process with the arguments it joined with, the hosts' shape
        aside: the shape given is checked against the service's, as a first join checks it, and the
        service must still serve this process (ClusterError, saying what to do, where either fails)."""
        call = f"pw.init(service={self.service_name!r})"
        wrong = mismatches(args, self.shape)
        if wrong:
            raise errors.ClusterError(
                f"{call}: {', '.join(wrong)}. Leave them out to take the service's (this process stays "
                "joined to it as it was)."
            )
        health = self._answer(
            self.service.health.remote(self.client_id),
            _HEALTH_TIMEOUT_S,
            "whether it serves this process",
            "This process joined it before: call pw.shutdown() first; pw.init(...) then joins the "
            "service running under that name now, if one does.",
            f"{call}: ",
        )
        if "dropped" in health:
            raise errors.ClusterError(
                f"{call}: the controller service {self.service_name!r} dropped this process "
                f"({health['dropped']}) and serves it nothing more. Call pw.shutdown() first; pw.init(...) "
                "then joins it again."
            )

    # --- health: the service's word --------------------------------------------------------------

    def mark_lost(self, host: int, why: str, generation: int | None = None) -> None:
        # The service sees its hosts die and says so (health, run answers).
        self.route.health_check({host})

    def refresh(self) -> None:
        """Asks the service which islands are lost now, and applies its word (if it answers)."""
        with contextlib.suppress(Exception):
            self._apply(self.ray.get(self.service.health.remote(), timeout=3.0))

    def _mark(self, island: int, why: str) -> None:
        with self.dispatcher.lock:
            if not self.losses.record(island, why):
                return
        if self.on_lost is not None:
            self.on_lost(island)

    def _apply(self, health: dict) -> None:
        """The service's word on lost and rebuilt islands, applied here."""
        lost = {int(k): v for k, v in health["lost"].items()}
        for island, why in lost.items():
            self._mark(island, why)
            self.route.fail_direct(set(self.layout.members(island)), f"island {island} was lost: {why}")
        generations = self.losses.generations
        for island, generation in enumerate(health["generations"]):
            if island in lost or (island not in self.lost and generation == generations[island]):
                continue
            with self.dispatcher.lock:
                self.losses.restore(island, generation)
                for member in self.layout.members(island):
                    self.sender.known[member] = set()  # new hosts: plans go again
                    self.sender.fingerprints[member] = set()
                    self.sender.plan_prints[member] = {}
            if self.on_restored is not None:
                self.on_restored(island)

    def _health_now(self) -> dict | None:
        """The service's health answer for this process; None once this side closed first. Waited for
        in steps: a close (pw.shutdown, the process's exit) does not wait for a slow or stopped service."""
        ref = self.service.health.remote(self.client_id)
        deadline = time.monotonic() + _HEALTH_TIMEOUT_S
        while not self.ray.wait([ref], timeout=_HEALTH_S)[0]:
            if self.closed:
                return None
            silent = self._silence()
            if silent is not None:
                raise _Silent(silent)
            if time.monotonic() >= deadline:
                raise self.ray.exceptions.GetTimeoutError(
                    f"the service did not answer a health check within {_HEALTH_TIMEOUT_S:.0f}s"
                )
        return self.ray.get(ref)

    def _silence(self) -> str | None:
        """Why the service counts as stopped or hung (its channel silent, and no health check answered,
        for ``hung_s`` while this process ran), or None. A look that comes late was this process's own pause (Ctrl-Z, a
        debugger, a starved machine): the service is given ``hung_s`` again from its return."""
        now = time.monotonic()
        if now - self._looked > min(ray_fleet.PAUSED_S, self.hung_s / 2):
            self._resumed = now
        self._looked = now
        silent = self.route.silent_for(now - max(self._resumed, self._answered))
        if silent <= self.hung_s:
            return None
        return (
            f"it sent nothing, not even a heartbeat, for {silent:.1f}s: its process is stopped or hung, "
            f"{ray_fleet.HUNG_ENV}={self.hung_s:g}s"
        )

    def _monitor(self) -> None:
        reported: dict = {}
        while not self.closed:
            try:
                health = self._health_now()
                if health is None:  # this side closed while the service had not answered
                    return
                self._answered = time.monotonic()
                self._silence()  # looked at now: a later look that comes late is this process's pause
                self._apply(health)
                if "dropped" in health:  # it answers this process nothing more: said once (not once a run)
                    self._service_gone = health["dropped"] == STOPPED
                    self._say_once(self.route.dropped_message(health["dropped"]))
                    self.route.dropped(health["dropped"])
                    logging.warning(
                        "pathways_jax: the controller service %r dropped this process (%s); its programs "
                        "fail until pw.shutdown() and pw.init(...) join %s.",
                        self.service_name,
                        health["dropped"],
                        "a running one" if self._service_gone else "again",
                    )
                    return
                self.route.fail_late()  # a value its host sent that never came (lost on its way)
                slices = self.slices_of() if self.slices_of is not None else {}
                if slices != reported:  # for the service's stats
                    self.service.slices.remote(self.client_id, slices)
                    reported = slices
            except Exception as exc:
                if self.closed or not self.ray.is_initialized():
                    return
                if isinstance(exc, _Silent):  # said once: every later call fails saying so too
                    self._gone(str(exc))
                    return
                if is_lost_error(exc):  # said once: every later call fails saying so too
                    self._gone(f"its Ray actor died: {type(exc).__name__}")
                    return
                logging.warning("pathways_jax: asking the controller service about its hosts failed: %s", exc)
            time.sleep(_HEALTH_S)

    def _gone(self, why: str) -> None:
        """The service is gone (``why``): what it owes fails, said in one line here (each run that fails
        for it logs no line of its own) and by every later call."""
        self._service_gone = True
        self._say_once(self.route.gone_message(HostGone(-1, why)))
        self.route.fail_owed(why)
        logging.warning(
            "pathways_jax: the controller service %r is gone (%s); this process's programs fail until "
            "pw.shutdown() and pw.init(...) join a running one.%s",
            self.service_name,
            why,
            " Its Ray cluster is gone too: Ray ends a process whose cluster is gone for a minute, and "
            "pw.shutdown() disconnects this one from it."
            if self._ray_gone()
            else "",
        )

    def _say_once(self, cause: str) -> None:
        """Runs failing with ``cause`` log no line of their own until this side's close ends (events.said_once)."""
        self._said.append(cause)
        events.said_once(cause)

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> None:
        """Leaves the service (its values and plans are released there) and stops this side's threads."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # The runs in flight fail with the close's error from here: said in one line (below), not one a
        # run. Said until the close that finds this side closed (the cluster's last, its controller stopped).
        if self.closed:
            for cause in self._said:
                events.unsaid(cause)
        else:
            self._say_once(f"ClusterError: {self.dispatcher.closed_message}")
            self.dispatcher.closed = True
            try:
                with contextlib.suppress(Exception):
                    wait = _LEAVE_TIMEOUT_S if timeout is None else min(timeout, _LEAVE_TIMEOUT_S)
                    self.ray.get(self.service.leave.remote(self.client_id), timeout=wait)
            finally:  # also under Ctrl-C: the token's end is this process's leave, and its channel heartbeats
                with contextlib.suppress(Exception):
                    self.ray.kill(self._token)
                self._said_left(self.route.close())
        for thread in self._threads:
            if thread is threading.current_thread():
                continue
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.ray.is_initialized() and (
            (self._service_gone and self._gcs in _JOINED_RAY) or self._ray_gone()
        ):
            # Ray's own worker ends a process whose cluster's head is gone for 60 s (its "Failed to
            # connect to GCS" exit): a notebook whose service stopped, and the Ray cluster pw.serve had
            # started with it, died a minute after its pw.shutdown(), and pw.init could not join the
            # next cluster meanwhile. Disconnected, it lives on and pw.init joins the next one. A Ray
            # session of the user's own is left alone while its cluster lives.
            _JOINED_RAY.discard(self._gcs)
            with contextlib.suppress(Exception):
                self.ray.shutdown()

    def _ray_gone(self) -> bool:
        """True if the head of the Ray cluster this process joined takes no connection any more."""
        host, _, port = self._gcs.rpartition(":")
        if not host or not port.isdigit():
            return False
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=_REACH_S).close()
        except OSError:
            return True
        return False

    def _said_left(self, runs: int) -> None:
        """Says in one line that ``runs`` runs were in flight as this process left (none: nothing said);
        each of them fails with the close's error, which logs no line of its own."""
        if not runs:
            return
        logging.warning(
            "pathways_jax: this process left the controller service %r with %d run%s in flight there; "
            "their values went with it (reading one raises ClusterError). Call .result() before "
            "pw.shutdown() to keep a value.",
            self.service_name,
            runs,
            "" if runs == 1 else "s",
        )


class _Silent(Exception):
    """The service's channel was silent too long (the health monitor's own signal)."""


# --- handles -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Handle:
    """A value on a controller service's hosts, as another client process can name it.

    Made by ``pw.share(future, client=...)``; picklable. Pass it to another
    process, which turns it into a future with ``pw.receive(handle)``. The
    service lets only the value's owner and the clients it was shared with
    read it. A handle does not keep its value alive: the owner's future does, and
    each client it was shared with holds it from the share on, until that client
    drops the futures ``pw.receive`` gave it, or leaves.
    """

    service: str
    incarnation: str  # the run of the service it was made under (a name may be started again)
    owner: int
    key: int
    hosts: tuple
    island: int
    desc: Any
    shape: tuple
    dtype: Any  # a numpy dtype, or a typed PRNG key's (which numpy cannot name)
    generation: int


__all__ = [
    "NAMESPACE",
    "Handle",
    "ServiceBackend",
    "Token",
    "connect",
    "find",
    "join",
    "mismatches",
    "version_mismatch",
    "versions",
]
