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
import concurrent.futures
import contextlib
import dataclasses
import os
import pickle
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from absl import logging

from pathways_jax._src.backends import ray as ray_backend
from pathways_jax._src.backends.host_link import HostGone
from pathways_jax._src.backends.ray_host import Refused, RunFailure, sharding_of
from pathways_jax._src.backends.ray_values import RemoteArray
from pathways_jax._src.core import errors, reentry

if TYPE_CHECKING:  # the channel needs the ray extra (pyzmq, msgspec): imported where used
    from pathways_jax._src import wire

NAMESPACE = "pathways_jax"  # the Ray namespace services are named in
_HEALTH_S = 0.25  # how often a client asks the service about lost islands
_JOIN_TIMEOUT_S = 60.0
_SEND_TIMEOUT_S = 10.0  # a service that takes no batch for this long is stuck (or gone)
# A value its host says it sent straight here fails if it has not come within this long.
_DIRECT_TIMEOUT_S = 30.0


def connect(address: str | None, *, start: bool = False) -> Any:
    """This process's Ray session: the cluster at ``address``; ``None``: the running one (``start``: else a new one)."""
    ray = ray_backend.import_ray()
    if not ray.is_initialized():
        if address is None and start:
            logging.warning(
                "pathways_jax: pw.serve started a new local Ray cluster in this process; the service lives as "
                "long as this process does. Start one with `ray start --head` for a service that outlives it."
            )
        where = address or ("local" if start else "auto")
        try:
            ray.init(
                address=where,
                namespace=NAMESPACE,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
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

    ray = connect(address)
    actor = find(ray, name, f"pw.init(service={name!r})")
    token = ray.remote(Token).options(num_cpus=0).remote()
    me = client_name or f"{socket.gethostname()}:{os.getpid()}"
    try:
        joined = ray.get(
            actor.join.remote(
                me, os.getpid(), socket.gethostname(), token, bool(jax.config.read("jax_enable_x64"))
            ),
            timeout=_JOIN_TIMEOUT_S,
        )
    except Exception as exc:
        with contextlib.suppress(Exception):
            ray.kill(token)
        raise errors.ClusterError(f"pw.init(service={name!r}): the service did not answer: {exc}") from exc
    if "refused" in joined:
        with contextlib.suppress(Exception):
            ray.kill(token)
        raise errors.ClusterError(
            f"the controller service {name!r} did not admit this process: {joined['refused']}."
        )
    return actor, token, joined


class ServiceBackend(ray_backend.RayBackend):
    """A client process's side of a controller service: the Ray backend, sending to the service.

    Lowering, plans, handles and fetches are the Ray backend's; every message
    goes to the service instead of a host, in numbered batches (a run's
    messages in one), and the service answers for the hosts.
    """

    def __init__(self, *, actor: Any, token: Any, joined: dict, standins: list, on_lost: Any):
        ray = ray_backend.import_ray()
        layout = ray_backend.Layout(joined["hosts"], joined["devices_per_host"], joined["per_island"])
        self._common(ray, layout, joined["platform"], standins, on_lost)
        self.replace_lost = False  # the service rebuilds lost islands, not this process
        self.service = actor
        self.service_name = joined["name"]
        self.client_id = joined["client"]
        self.info = joined["info"]
        self._token = token
        self.generations = list(joined["generations"])
        for island, why in joined["lost"].items():
            self._mark(int(island), why)
        self._batches = 0
        self._owed: dict[int, list[concurrent.futures.Future]] = {}  # batch -> its answers' futures
        self._owed_lock = threading.Lock()
        self._gone: str | None = None  # why the service will answer nothing more
        self._dropped_why: str | None = None  # why the service dropped this process (it runs on)
        self.channel = joined["channel"]  # the service's channel, this process's identity there
        self._peer = self.channel.peer(self._answered, _SEND_TIMEOUT_S)
        # This process's own channel: the hosts send the values it fetches straight here.
        # Fetch batches whose value comes here: batch -> the host it comes from.
        self._direct: dict[int, int] = {}
        # Those the host said it sent (the service's None): when, to fail one that never came.
        self._sent_at: dict[int, float] = {}
        from pathways_jax._src import wire
        from pathways_jax._src.backends import channel_link

        transport, ip = channel_link.listen_on()
        inbox_key = os.urandom(32)
        self._inbox = wire.Server(inbox_key, transport=transport, host=ip, on_message=self._fetched_here)
        try:
            address = self._inbox.address
            ray.get(
                actor.inbox.remote(self.client_id, address.up, address.down, inbox_key),
                timeout=_JOIN_TIMEOUT_S,
            )
        except Exception:
            self._inbox.close()
            self._peer.close()
            raise
        self._threads = [
            reentry.runtime_thread(self._monitor, name="pathways-service-health"),
            reentry.runtime_thread(self._flush_loop, name="pathways-service-flush"),
        ]
        for thread in self._threads:
            thread.start()

    def _submit(self, batch: list, run: wire.RunMeta | None) -> list[concurrent.futures.Future]:
        """Sends a numbered batch to the service; one answer's future per message. Call with ``_lock`` held."""
        from pathways_jax._src import wire

        seq = self._batches
        self._batches += 1
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in batch]
        with self._owed_lock:
            if self._gone is not None:  # nothing will answer
                for future in futures:
                    future.set_exception(
                        HostGone(-1, f"the controller service {self.service_name!r}: {self._gone}")
                    )
                return futures
            self._owed[seq] = futures
            if len(batch) == 1 and batch[0][1] == "fetch":  # its value comes straight from the host
                self._direct[seq] = batch[0][0]
        try:
            from pathways_jax._src.backends.channel_link import encode

            routed = [
                wire.Routed(host, cast("wire.Request", encode(kind, args))) for host, kind, args in batch
            ]
            self._peer.send(wire.Submit(seq, routed, run))
        except wire.ChannelError as exc:  # this batch fails; the health monitor says if the service went
            with self._owed_lock:
                self._owed.pop(seq, None)
            for future in futures:
                if not future.done():
                    future.set_exception(
                        HostGone(-1, f"the controller service {self.service_name!r} took no message: {exc}")
                    )
        return futures

    def _answered(self, received: wire.Received) -> None:
        """The service's answers to a batch (the channel's receive thread)."""
        from pathways_jax._src import wire

        match received.body:
            case wire.Answered(seq, answers):
                try:
                    values = pickle.loads(answers.view)
                except Exception as exc:  # every message of the batch fails, saying why
                    values = [Refused(f"the service's answer did not decode: {exc}", "gone")]
                with self._owed_lock:
                    if seq in self._direct and values == [None]:
                        self._sent_at[seq] = time.monotonic()
                        return  # the host sent the value here: fetched_here settles it
                    futures = self._owed.pop(seq, None)
                    self._direct.pop(seq, None)
                    self._sent_at.pop(seq, None)
                if futures is None:
                    return
                if len(values) != len(futures):  # one answer for the whole batch (a refusal)
                    values = [values[0] if values else Refused("the service answered nothing", "gone")] * len(
                        futures
                    )
                for future, value in zip(futures, values, strict=True):
                    if not future.done():
                        future.set_result(value)

    def _fetched_here(self, received: wire.Received) -> None:
        """A value a host sent straight to this process (its channel's receive thread)."""
        from pathways_jax._src import wire
        from pathways_jax._src.backends import channel_link

        match received.body:
            case wire.Fetched(ticket) | wire.Failed(ticket):
                pass
            case _:
                return  # hosts send this channel nothing else
        try:
            value: Any = channel_link.answer_value(received.body)
        except Exception as exc:
            value = Refused(f"a host's value did not decode: {type(exc).__name__}: {exc}", "gone")
        with self._owed_lock:
            if ticket not in self._direct:
                return  # answered already (a failure the service saw first)
            del self._direct[ticket]
            self._sent_at.pop(ticket, None)
            futures = self._owed.pop(ticket, None)
        if futures and not futures[0].done():
            futures[0].set_result(value)

    def _fail_direct(self, hosts: set[int], why: str, *, sent_before: float | None = None) -> None:
        """Fetches whose values were to come from ``hosts`` (lost) fail: nothing will come. With
        ``sent_before``: those the host said it sent before then (a value lost on its way)."""
        with self._owed_lock:
            tickets = [
                ticket
                for ticket, host in self._direct.items()
                if host in hosts
                and (sent_before is None or self._sent_at.get(ticket, sent_before) < sent_before)
            ]
            futures: list[concurrent.futures.Future] = []
            for ticket in tickets:
                del self._direct[ticket]
                self._sent_at.pop(ticket, None)
                futures.extend(self._owed.pop(ticket, ()))
        for future in futures:
            if not future.done():
                future.set_result(RunFailure("lost", None, why, ""))

    def _fail_owed(self, why: str) -> None:
        """Every answer still owed fails, and every later one: the service is gone (or this side closed)."""
        with self._owed_lock:
            self._gone = why
            owed = [f for futures in self._owed.values() for f in futures]
            self._owed.clear()
            self._direct.clear()
            self._sent_at.clear()
        for future in owed:
            if not future.done():
                future.set_exception(HostGone(-1, f"the controller service {self.service_name!r}: {why}"))

    def _message(self, host: int, kind: str, *args: Any) -> Any:
        return self._submit([(host, kind, args)], None)[0]

    def _send_run(self, batch: list, run: Any, remote: Any) -> list:
        plan = run.plan
        nbytes = {}
        for _host, kind, args in batch:
            if kind == "run":
                for slot, key in args[4]:
                    aval = plan.slot_outputs[slot].aval
                    nbytes[key] = int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
        from pathways_jax._src import wire

        client = run.client
        meta = wire.RunMeta(
            sorted(remote.islands),
            remote.uuids,
            nbytes,
            plan.graph.name,
            getattr(client, "name", ""),
            float(getattr(client, "weight", 1.0)),
            int(getattr(client, "priority", 0)),
        )
        return self._submit(batch, meta)

    def _take_uuids(self, count: int) -> int:
        return 0  # the service numbers every run's transfers

    def _fetched(self, host: int, answer: Any) -> Any:
        """The service answers a fetch with the host's answer, or says the host was lost."""
        if isinstance(answer, RunFailure) and answer.kind == "lost":
            raise self._value_lost(host)
        return answer

    def _value_lost(self, host: int) -> errors.HostLostError:
        """The error of a fetch whose host was lost, once the health check has marked its island."""
        self._health_check({host})
        return errors.HostLostError(self._lost_message(self.layout.island_of(host), "a value"))

    def _loss(self, host: int, exc: BaseException, generation: int, what: str) -> BaseException | None:
        if not ray_backend.is_lost_error(exc):
            return None
        if self._dropped_why is not None:
            return errors.ClusterError(
                f"{what} could not be read: the controller service {self.service_name!r} dropped this "
                f"process: {self._dropped_why}. Call pw.shutdown() and pw.init(...) to join it again."
            )
        return errors.ClusterError(
            f"{what} could not be read: the controller service {self.service_name!r} is gone ({exc}). "
            "Call pw.shutdown(), start the service again and pw.init(...) to join it."
        )

    def _health_check(self, hosts: set[int]) -> int | None:
        with contextlib.suppress(Exception):
            self._apply(self.ray.get(self.service.health.remote(), timeout=3.0))
        for host in sorted(hosts):
            if self.layout.island_of(host) in self.lost:
                return self.layout.island_of(host)
        return None

    def host_stats(self, timeout: float = ray_backend.CALL_TIMEOUT_S) -> dict[int, dict]:
        return self.ray.get(self.service.host_stats.remote(), timeout=timeout)

    def handle_of(self, array: Any) -> Handle:
        """The handle of a value this process holds (its own or received)."""
        owner, key = (self.client_id, array.key) if isinstance(array.key, int) else array.key
        placed = self.where(array.sharding, "the shared value")
        return Handle(
            self.service_name,
            owner,
            key,
            tuple(array.hosts),
            placed.island,
            placed.desc,
            tuple(array.aval.shape),
            str(array.aval.dtype),
            array.generation,
        )

    def array_of(self, handle: Handle) -> Any:
        """A RemoteArray of this process for ``handle`` (whether it may be read is the service's call)."""
        import jax

        if handle.service != self.service_name:
            raise errors.AccessError(
                f"the handle is of controller service {handle.service!r}; this process joined {self.service_name!r}."
            )
        devices = self.islands[handle.island]
        sharding = sharding_of(handle.desc, list(devices))
        aval = jax.core.ShapedArray(handle.shape, np.dtype(handle.dtype))
        # Named (owner, key) even for this process's own value: dropping it frees nothing (the
        # owner's own future does), and reading it after that is refused as stale.
        key = (handle.owner, handle.key)
        return RemoteArray(self, handle.hosts, key, aval, sharding, (), handle.generation)

    def service_stats(self, timeout: float = 30.0) -> dict:
        return self.ray.get(self.service.stats.remote(), timeout=timeout)

    def share(self, key: int, reader: str) -> None:
        """Lets client process ``reader`` read value ``key``, once the runs sent before it are at the service."""
        with self._lock:  # in this process's order: after the run that makes the value
            future = self._submit([(-1, "share", (key, reader))], None)[0]
        answer = future.result(timeout=60.0)
        if isinstance(answer, Refused):
            raise errors.AccessError(f"pw.share: {answer.message}.")

    def mark_lost(self, host: int, why: str, generation: int | None = None) -> None:
        # The service sees its hosts die and says so (health, run answers).
        self._health_check({host})

    def _mark(self, island: int, why: str) -> None:
        with self._lock:
            if not self._record_lost(island, why):
                return
        if self.on_lost is not None:
            self.on_lost(island)

    def _apply(self, health: dict) -> None:
        """The service's word on lost and rebuilt islands, applied here."""
        lost = {int(k): v for k, v in health["lost"].items()}
        for island, why in lost.items():
            self._mark(island, why)
            self._fail_direct(set(self.layout.members(island)), f"island {island} was lost: {why}")
        for island, generation in enumerate(health["generations"]):
            if island in lost or (island not in self.lost and generation == self.generations[island]):
                continue
            with self._lock:
                self.lost.pop(island, None)
                self.generations[island] = generation
                for member in self.layout.members(island):
                    self.lost_hosts.pop(member, None)
                    self.sender.known[member] = set()  # new hosts: plans go again
                    self.sender.fingerprints[member] = set()
            if self.on_restored is not None:
                self.on_restored(island)

    def _monitor(self) -> None:
        reported: dict = {}
        while not self._closed:
            try:
                health = self.ray.get(self.service.health.remote(self.client_id), timeout=10.0)
                self._apply(health)
                if "dropped" in health:  # it answers this process nothing more: said once
                    self._dropped_why = health["dropped"]
                    self._fail_owed(f"it dropped this process: {health['dropped']}")
                    logging.warning(
                        "pathways_jax: the controller service %r dropped this process (%s); its programs "
                        "fail until pw.shutdown() and pw.init(...) join again.",
                        self.service_name,
                        health["dropped"],
                    )
                    return
                if self._sent_at:  # a value its host sent that never came (lost on its way)
                    self._fail_direct(
                        set(range(self.hosts)),
                        f"a fetched value its host sent did not arrive within {_DIRECT_TIMEOUT_S:.0f}s",
                        sent_before=time.monotonic() - _DIRECT_TIMEOUT_S,
                    )
                slices = self.slices_of() if self.slices_of is not None else {}
                if slices != reported:  # for the service's stats
                    self.service.slices.remote(self.client_id, slices)
                    reported = slices
            except Exception as exc:
                if self._closed or not self.ray.is_initialized():
                    return
                if ray_backend.is_lost_error(exc):  # said once: every later call fails saying so too
                    self._fail_owed("it is gone")
                    logging.warning(
                        "pathways_jax: the controller service %r is gone (%s); this process's programs "
                        "fail until pw.shutdown() and pw.init(...) join a running one.",
                        self.service_name,
                        exc,
                    )
                    return
                logging.warning("pathways_jax: asking the controller service about its hosts failed: %s", exc)
            time.sleep(_HEALTH_S)

    def close(self, timeout: float | None = ray_backend.CLOSE_TIMEOUT_S) -> None:
        """Leaves the service (its values and plans are released there) and stops this side's threads."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                self.ray.get(self.service.leave.remote(self.client_id), timeout=min(timeout or 5.0, 5.0))
            with contextlib.suppress(Exception):
                self.ray.kill(self._token)
            self._fail_owed("this process left it")
            self._peer.close()
            self._inbox.close()
        for thread in self._threads:
            if thread is threading.current_thread():
                continue
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


# --- handles -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Handle:
    """A value on a controller service's hosts, as another client process can name it.

    Made by ``pw.share(future, client=...)``; picklable. Pass it to another
    process, which turns it into a future with ``pw.receive(handle)``. The
    service lets only the value's owner and the clients it was shared with
    read it; a handle does not keep its value alive (the owner's future, or a
    receiver's, does).
    """

    service: str
    owner: int
    key: int
    hosts: tuple
    island: int
    desc: Any
    shape: tuple
    dtype: str
    generation: int


__all__ = [
    "NAMESPACE",
    "Handle",
    "ServiceBackend",
    "Token",
    "connect",
    "find",
    "join",
]
