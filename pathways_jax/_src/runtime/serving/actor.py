"""The controller service's actor: one order to the hosts, isolation, and scheduling among clients.

**One order.** The service is the only sender to the hosts: every host
gets its messages from one asyncio loop, numbered, so collective programs
of different client processes on overlapping slices meet in the same order
on every host of an island.

**Isolation.** Client keys are namespaced by client in the service (the
``ledger``). A run or fetch may name only values its client owns and still
holds, or that another client shared with it (``pw.share``); otherwise the
whole batch is refused (``Refused``, raised as ``AccessError``) and nothing
is forwarded. A client process that dies (its token actor dies with it) has
its queued runs dropped, its values freed on the hosts (unless shared with a
live client) and its plans and slices forgotten, within seconds.

**Scheduling.** Each client process has a FIFO queue (its own order, which
its own controller chose among its threads, is kept). The service sends
the head of one queue at a time, when every island the run touches has
fewer than ``window`` runs in flight, choosing by the policy: ``fifo``
(arrival), ``priority`` (the head's ``pw.client`` priority) or ``fair``
(device time charged per client process, in proportion to the head's
``pw.client`` weight): the in-process controller's admission core and
policies (``runtime/admission.py``, ``runtime/scheduler.py``), keyed by
client process, charged with the device time each host measures. Other
batches (fetch, free, forget, share) go at once, ahead of the client's
queued runs unless they name a value one of those makes or reads; a fetch
is answered with the host's own answer, so values come from the host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import os
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from absl import logging

from pathways_jax._src.backends import ray as ray_backend
from pathways_jax._src.backends import ray_fleet, service_client
from pathways_jax._src.backends.ray_host import Refused, RunDone, RunFailure
from pathways_jax._src.core import errors
from pathways_jax._src.runtime import admission
from pathways_jax._src.runtime import scheduler as scheduler_lib
from pathways_jax._src.runtime.scheduler import Head
from pathways_jax._src.runtime.serving.config import ServiceConfig, host_key
from pathways_jax._src.runtime.serving.gate import Gate
from pathways_jax._src.runtime.serving.handoff import Handoff
from pathways_jax._src.runtime.serving.ledger import Ledger, Refuse
from pathways_jax._src.runtime.serving.outbox import Outbox
from pathways_jax._src.runtime.serving.records import Batch, ClientProcess

if TYPE_CHECKING:  # the channels need the ray extra (pyzmq, msgspec): imported where used
    from pathways_jax._src import wire

_DEPARTED_KEPT = 64  # clients that went, still listed in stats
_TICK_S = 0.5  # how often the service looks at its queues and clients
# A tick that came this late found the service not running itself (its process stopped or starved):
# its clients' silence meanwhile is its own, and each gets silent_client_timeout again from its return.
_PAUSED_S = 2.0


def _token_death(exc: BaseException) -> str:
    """Why a client went, from its token actor's death (``exc``): its process ended (Ray ends the
    token with the process that made it), or the token alone was killed (`ray kill`, Ray's memory
    monitor) while the process may live on, as Ray's reason says."""
    said = [line.strip() for line in str(exc).splitlines()]
    reason = next((line for line in said if line.startswith("The actor is dead because")), "")
    if not reason or "owner" in reason:  # the process that made it is gone
        return f"its process died ({type(exc).__name__})"
    reason = reason.removeprefix("The actor is dead because").strip().rstrip(".")
    return (
        f"its token actor, through which the service sees the process live, died ({reason}; "
        f"{type(exc).__name__}) though the process may live on"
    )


class ServiceActor:
    """The controller service's actor (made with ``ray.remote`` by :func:`serve`)."""

    def __init__(self, config: ServiceConfig):
        import jax

        # A fresh worker process: the stand-in devices can still be set.
        total = config.hosts * config.devices_per_host
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", total)
        jax.config.update("jax_enable_x64", bool(config.x64))
        self.config = config
        self._versions = service_client.versions()  # a client process of others is refused at join
        # Why the hosts could not start (no room in the Ray cluster...): ready() says so, and the
        # service's starter ends this actor; until then a client that joins is refused with it.
        self.failed: str | None = None
        # This process places and watches the hosts: as the process that started the service says.
        os.environ[ray_fleet.ROOM_GRACE_ENV] = repr(config.room_grace_s)
        os.environ[ray_fleet.HUNG_ENV] = repr(config.hung_s)
        standins = sorted(jax.devices("cpu"), key=lambda d: d.id)
        try:
            self.backend = ray_backend.RayBackend(
                address=None,
                hosts=config.hosts,
                devices_per_host=config.devices_per_host,
                standins=standins[:total],
                window_size=config.max_in_flight,
                on_lost=None,
                islands=config.islands,
                platform=config.platform,
                replace_lost=config.replace_lost_hosts,
            )
        except errors.PathwaysError as exc:
            self.failed = str(exc)
            return
        self.layout = self.backend.layout
        self.window_size = config.window
        self.policy = config.scheduler
        self.ledger = Ledger(config.memory_budget)  # the values on the hosts, under the byte budget
        self.max_clients = config.max_clients
        self.memory_budget = config.memory_budget
        self.clients: dict[int, ClientProcess] = {}
        # Which client's run goes next: the in-process controller's admission core
        # (runtime/admission.py, runtime/scheduler.py), the windows and the byte budget.
        self.gate = Gate(
            scheduler_lib.make(self.policy, starvation_limit=config.starvation_limit),
            self.clients,
            self.ledger,
            window_size=config.window,
            memory_budget=config.memory_budget,
            backpressure_timeout=config.backpressure_timeout,
            forward=self._forward,
            fail=self._fail,
        )
        self.busy_until: dict[int, float] = {}
        self.started = time.monotonic()
        # This run of the service: a handle made under an earlier one of the same name names no value here.
        self.incarnation = secrets.token_hex(8)
        self._ids = itertools.count(1)
        self._ticker: Any = None
        self._resumed = time.monotonic()  # since when the service runs without a pause of its own
        self._loop: Any = None  # the actor's event loop (set by its first async call)
        self._handoff: Any = None  # what the channels' threads hand that loop (made with it)
        # Clients send their batches on this channel (signed with the service's key).
        self.key = secrets.token_bytes(32)
        from pathways_jax._src import wire
        from pathways_jax._src.backends import channel_link

        transport, ip = channel_link.listen_on()
        self.channel = wire.Server(
            self.key, transport=transport, host=ip, on_message=self._from_client, send_timeout=30.0
        )
        self._by_identity: dict[bytes, ClientProcess] = {}
        self.outbox = Outbox(
            self.channel, self._by_identity, config.stalled_client_timeout, self._drop_client
        )
        # Signed messages refused all the same: from no joined client, or not a batch.
        self.refused_batches: collections.Counter[str] = collections.Counter()
        self.fetches: collections.Counter[str] = collections.Counter({"direct": 0, "relayed": 0})

    # --- clients ---------------------------------------------------------------------------

    def info(self) -> dict:
        """What a client needs to lower for the service's hosts."""
        backend = self.backend
        return {
            "name": self.config.name,
            "incarnation": self.incarnation,
            "hosts": self.layout.hosts,
            "devices_per_host": self.layout.devices_per_host,
            "per_island": self.layout.per_island,
            "platform": self.config.platform,
            "replace_lost_hosts": self.config.replace_lost_hosts,
            "x64": self.config.x64,
            "scheduler": self.policy,
            "window": self.window_size,
            "generations": list(backend.generations),
            "lost": dict(backend.lost),
            "info": backend.info,
            "pid": os.getpid(),
            "versions": self._versions,
        }

    async def ready(self) -> dict:
        if self.failed is not None:
            return {"failed": self.failed}
        self._set_loop()
        return self.info()

    def _set_loop(self) -> None:
        """Notes the actor's event loop (called on it): the channels' threads hand it their messages."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            from pathways_jax._src.backends.channel_link import ChannelLink

            link = self.backend.link
            # A turn's messages to a host (the runs its completions let go) go in one batch.
            turn = (link.cork, link.uncork) if isinstance(link, ChannelLink) else None
            self._handoff = Handoff(self._loop, turn)

    async def join(
        self, name: str, pid: int, node: str, token: Any, x64: bool, versions: dict | None = None
    ) -> dict:
        """Admits a client process (or refuses it, saying why); its id and the cluster's shape.

        ``versions``: the client's (``service_client.versions``), checked first: a process of
        another pathways_jax, wire format or jax (``None``: one from before the check) would misread
        the service's messages, and is refused saying both versions.
        """
        wrong = service_client.version_mismatch(versions, self._versions)
        if wrong is not None:
            return {"refused": wrong, "versions": self._versions}
        if self.failed is not None:
            return {"refused": f"its hosts did not start: {self.failed}"}
        live = [c for c in self.clients.values() if c.alive]
        if self.max_clients is not None and len(live) >= self.max_clients:
            who = ", ".join(f"{c.name} (pid {c.pid})" for c in live)
            return {"refused": f"the service admits {self.max_clients} client processes and has them: {who}"}
        if self.memory_budget is not None and self.ledger.held >= self.memory_budget:
            return {
                "refused": f"the service's hosts hold {self.ledger.held} bytes of values, its whole memory budget "
                f"({self.memory_budget} bytes)"
            }
        if any(c.name == name for c in live):
            return {
                "refused": f"a client process named {name!r} is connected already (pw.share names clients "
                "by name): give this one another client_name"
            }
        if bool(x64) != bool(self.config.x64):
            return {
                "refused": f"the service runs with jax_enable_x64={self.config.x64}, this process with "
                f"{x64}: their computations would not match. Set jax.config.update('jax_enable_x64', "
                f"{self.config.x64}) in this process before pw.init, or join a service started from a "
                f"process with it {x64} (pw.serve, or JAX_ENABLE_X64={int(x64)} for "
                "`python -m pathways_jax serve`)"
            }
        client = ClientProcess(next(self._ids), name, pid, node, token, time.time())
        self.clients[client.id] = client
        self._set_loop()
        self._loop.create_task(self._watch(client))
        if self._ticker is None:
            self._ticker = self._loop.create_task(self._tick())
        identity = f"client-{client.id}".encode()
        self._by_identity[identity] = client
        from pathways_jax._src.backends import channel_link

        channel = channel_link.Endpoint(self.channel.address, self.key, identity)
        return {"client": client.id, "channel": channel, **self.info()}

    async def _watch(self, client: ClientProcess) -> None:
        """Waits on the client's token actor: it dies with the client's process."""
        try:
            await client.token.hold.remote()
            why = "it left"
        except Exception as exc:
            why = _token_death(exc)
        if client.alive:
            self._drop_client(client, why)

    async def leave(self, client_id: int) -> None:
        client = self.clients.get(client_id)
        if client is not None and client.alive:
            self._drop_client(client, "it left")

    def _drop_client(self, client: ClientProcess, why: str) -> None:
        """A client went: its queued runs are dropped, its values, plans and slices released."""
        client.alive = False
        client.why = why
        identity = f"client-{client.id}".encode()
        self._by_identity.pop(identity, None)
        self.channel.forget(identity)
        refused = Refused(f"client {client.name!r} is gone: {why}", "gone")
        queued = self.gate.admission.close(client.id, lambda batch: Head(client.id, batch.arrival))
        for batch in [*queued, *client.others, *client.pending.values()]:
            batch.answer([refused] * len(batch.messages))
        client.others.clear()
        client.pending.clear()
        client.outbox.clear()
        client.outbox_bytes = 0
        frees: dict[int, list[int]] = collections.defaultdict(list)
        self.ledger.forget_client(client.id, frees)
        self.backend.send_batch(
            [(host, "free", (keys,)) for host, keys in frees.items()]
            + [(host, "forget", (plan,)) for plan, hosts in client.plans.items() for host in hosts]
        )
        client.plans.clear()
        client.slices.clear()
        # Stats keep the last clients that went; older ones are forgotten.
        gone = [c.id for c in self.clients.values() if not c.alive]
        for old in gone[: max(0, len(gone) - _DEPARTED_KEPT)]:
            del self.clients[old]
        logging.info("pathways_jax service: client %s (pid %d) is gone: %s", client.name, client.pid, why)
        self.gate.pump()

    async def inbox(self, client_id: int, up: str, down: str, key: bytes) -> None:
        """The client's own channel: the hosts send the values it fetches there, not through here."""
        from pathways_jax._src import wire

        client = self.clients.get(client_id)
        if client is not None and client.alive:
            client.inbox = wire.Reply(up, down, key, 0)

    async def slices(self, client_id: int, slices: dict) -> None:
        """The client's slices now (slice id -> device ids), for stats."""
        client = self.clients.get(client_id)
        if client is not None and client.alive:
            client.slices = dict(slices)

    def _share(self, client_id: int, key: int, reader: str) -> Any:
        """Lets the client named ``reader`` read a value of client ``client_id``; None or a Refused."""
        value = self.ledger.values.get(host_key(client_id, key))
        if value is None or value.owner != client_id or not value.owner_holds:
            return Refused(f"value {key} of this client is not on the hosts (freed, or never made)")
        readers = [c for c in self.clients.values() if c.alive and (c.name == reader or str(c.id) == reader)]
        if not readers:
            names = sorted(c.name for c in self.clients.values() if c.alive)
            return Refused(
                f"no client process named {reader!r} is connected (connected: {names}): a value is shared "
                f"with a process joined now; share it once that process has joined "
                f"(pw.init(..., client_name={reader!r}))"
            )
        self.ledger.share(host_key(client_id, key), {c.id for c in readers})
        return None

    # --- batches ---------------------------------------------------------------------------

    def _from_client(self, received: wire.Received) -> None:
        """A message on the service's channel (its receive thread): handled on the actor's loop."""
        self._handoff.post(self._client_message, received)

    def _client_message(self, received: wire.Received) -> None:
        from pathways_jax._src import wire

        client = self._by_identity.get(received.peer)
        if client is None:  # signed with the key, but no client joined under that name
            self.refused_batches["unknown_client"] += 1
            return
        match received.body:
            case wire.Submit(seq, messages, run):
                self.gate.submit(
                    client, seq, messages, run, functools.partial(self.outbox.answer, received.peer, seq)
                )
            case _:
                self.refused_batches["not_a_batch"] += 1  # clients send only batches

    async def _tick(self) -> None:
        """Looks at the queues and the clients now and then: a run waiting for memory fails in
        time even when nothing else happens, and a silent client is dropped."""
        looked = time.monotonic()
        while True:
            await asyncio.sleep(_TICK_S)
            now = time.monotonic()
            if now - looked > _PAUSED_S:
                self._resumed = now  # the service did not run: its clients were not heard, not silent
            looked = now
            with contextlib.suppress(Exception):
                self._drop_silent()
            with contextlib.suppress(Exception):
                self._unbudget_lost()
            with contextlib.suppress(Exception):
                self.gate.pump()

    def _unbudget_lost(self) -> None:
        """Values on the hosts of a lost island went with them: their bytes leave the memory budget
        (they stay on the ledger, so that reading them says they were lost, until their futures go)."""
        lost = set(self.backend.lost_hosts)
        if lost:
            self.ledger.unmade(
                [
                    key
                    for key, value in self.ledger.values.items()
                    if value.nbytes and not lost.isdisjoint(value.hosts)
                ]
            )

    def _drop_silent(self) -> None:
        """Drops every client whose channel sent nothing, not even a heartbeat, for too long.

        A client's channel heartbeats once a second of quiet from a thread of its own, so
        silence means a stopped or hung process (or a lost network): its Ray token actor,
        a process of its own, lives on and says nothing.
        """
        timeout = self.config.silent_client_timeout
        if timeout is None:
            return
        now = time.monotonic()
        for identity, client in list(self._by_identity.items()):
            heard = self.channel.last_heard(identity)
            silent = now - max(client.joined_at, heard or client.joined_at, self._resumed)
            if client.alive and silent > timeout:
                self._drop_client(
                    client,
                    f"its channel sent nothing, not even a heartbeat, for {silent:.1f}s: a stopped or hung "
                    f"process (silent_client_timeout={timeout}s)",
                )

    def _fail(self, client: ClientProcess, batch: Batch, answer: Refused) -> None:
        """Answers a batch that will not run with ``answer``: nothing of it runs and no value is touched.

        Its plans are still registered: the client counts them as sent, and a
        plan reads no value.
        """
        from pathways_jax._src import wire

        registers = []
        for routed in batch.messages:
            match routed.item:
                case wire.Register(plan, ops, constants, blobs, x64):
                    key = host_key(client.id, plan)
                    client.plans.setdefault(key, set()).add(routed.host)
                    registers.append((routed.host, wire.Register(key, ops, constants, blobs, x64)))
        self.backend.send_items(registers)
        batch.answer([answer] * len(batch.messages))

    def _cancel(self, client: ClientProcess, client_key: int) -> None:
        """Fails the runs of the client process's ``pw.client`` number ``client_key`` that wait in its
        queue here (the client was closed): they never go to the hosts; those sent already complete."""
        doomed = self.gate.admission.cancel(
            client.id,
            lambda batch: batch.run is not None and batch.run.client_key == client_key,
            lambda batch: Head(client.id, batch.arrival),
        )
        for batch in doomed:
            name = batch.run.client if batch.run is not None else ""
            self._fail(
                client, batch, Refused(f"the run was cancelled: client {name!r} was closed", "cancelled")
            )

    def _check(self, client: ClientProcess, batch: Batch) -> None:
        """Raises :class:`Refuse` if the batch names a host the service lacks, a value its client may
        not read, or a message a client may not send; changes nothing."""
        from pathways_jax._src import wire

        hosts = self.layout.hosts
        for routed in batch.messages:
            if isinstance(routed.host, bool) or not 0 <= routed.host < hosts:
                raise Refuse(
                    f"a {type(routed.item).__name__} message for host {routed.host!r}: the service has "
                    f"hosts 0 to {hosts - 1}"
                )
            match routed.item:
                case wire.Run(feeds=feeds):
                    for feed in feeds:
                        if feed.value is not None:
                            self.ledger.readable(client.id, feed.value)
                case wire.Fetch(key=key):
                    self.ledger.readable(client.id, key)
                case wire.Register() | wire.Forget() | wire.Free():
                    pass
                case other:
                    raise Refuse(
                        f"a client may not send {type(other).__name__} messages in a batch of others"
                    )

    def _translate(self, client: ClientProcess, batch: Batch) -> tuple[list, dict]:
        """The batch in host keys, ``(host, item)``, and the frees it makes; raises :class:`Refuse`
        before changing anything."""
        from pathways_jax._src import wire

        self._check(client, batch)  # every handle is checked first
        cid = client.id
        frees: dict[int, list[int]] = collections.defaultdict(list)
        out: list[tuple[int, wire.Item]] = []
        base = 0
        if batch.run is not None:
            base = self.backend.take_uuids(batch.run.uuids)
        nbytes = batch.run.nbytes if batch.run is not None else {}
        for routed in batch.messages:
            host = routed.host
            match routed.item:
                case wire.Register(plan, ops, constants, blobs, x64):
                    key = host_key(cid, plan)
                    client.plans.setdefault(key, set()).add(host)
                    out.append((host, wire.Register(key, ops, constants, blobs, x64)))
                case wire.Forget(plan):
                    key = host_key(cid, plan)
                    hosts = client.plans.get(key)
                    if hosts is not None:
                        hosts.discard(host)
                        if not hosts:  # no host has it: no more one of the client's programs
                            del client.plans[key]
                    out.append((host, wire.Forget(key)))
                case wire.Run(plan, run_id, _base, feeds, keep, drop):
                    self.ledger.drop(cid, drop, frees)
                    feeds = [
                        feed if feed.value is None else self._feed(cid, feed.slot, feed.value)
                        for feed in feeds
                    ]
                    kept = []
                    for slot, local in keep:
                        hk = host_key(cid, local)
                        kept.append((slot, hk))
                        self.ledger.keep(cid, hk, host, int(nbytes.get(local, 0)))
                    out.append(
                        (
                            host,
                            wire.Run(
                                host_key(cid, plan),
                                run_id,
                                base,
                                feeds,
                                kept,
                                list[wire.Handle](frees.pop(host, [])),
                            ),
                        )
                    )
                case wire.Free(keys):
                    self.ledger.drop(cid, keys, frees)
                    out.append((host, wire.Free(list[wire.Handle](frees.pop(host, [])))))
                case wire.Fetch(key):
                    # The host sends the value straight to the client's own channel, if it has one.
                    inbox = client.inbox
                    reply = None
                    if inbox is not None and self.backend.link.name == "channel":
                        reply = wire.Reply(inbox.up, inbox.down, inbox.key, batch.seq)
                    out.append((host, wire.Fetch(self.ledger.read(cid, key), reply)))
        return out, frees

    def _feed(self, cid: int, slot: int, handle: Any) -> Any:
        """A run's input value in its host key, marked shared if other clients may read it (a
        computation that consumes it then consumes a copy: theirs stays)."""
        from pathways_jax._src import wire

        key = self.ledger.read(cid, handle)
        kept = self.ledger.values[key]
        return wire.Feed(slot, key, shared=kept.owner != cid or bool(kept.readers))

    def _forward(self, client: ClientProcess, batch: Batch) -> None:
        """Sends a batch to its hosts, all at once; its answers come back through :meth:`_complete`,
        called on the loop once the hosts answered every message."""
        from pathways_jax._src import wire

        shares = [routed.item for routed in batch.messages if isinstance(routed.item, wire.Share)]
        if shares and len(shares) == len(batch.messages):
            batch.answer([self._share(client.id, share.key, share.reader) for share in shares])
            return
        cancels = [routed.item for routed in batch.messages if isinstance(routed.item, wire.Cancel)]
        if cancels and len(cancels) == len(batch.messages):
            for cancel in cancels:
                self._cancel(client, cancel.client)
            batch.answer([None] * len(cancels))
            return
        try:
            messages, frees = self._translate(client, batch)
        except Refuse as refused:
            client.refused += 1
            self._fail(client, batch, Refused(str(refused)))
            return
        sent = time.monotonic()
        generations = tuple(self.backend.generations)  # a loss seen later is of these islands
        refs = self.backend.send_items(
            messages + [(host, wire.Free(list[wire.Handle](keys))) for host, keys in frees.items()]
        )
        refs = refs[: len(messages)]
        complete = functools.partial(self._complete, client, batch, messages, refs, sent, generations)
        if batch.run is None:
            if not any(isinstance(item, wire.Fetch) for _host, item in messages):
                batch.answer([None] * len(messages))  # answered at once
            else:  # a fetch: with the host's answer
                self._handoff.when_done(refs, complete)
            return
        in_flight = self.gate.in_flight
        for island in batch.islands:
            in_flight[island] += 1
        client.in_flight += 1
        self._handoff.when_done(refs, complete)

    def _complete(
        self, client: ClientProcess, batch: Batch, messages: list, refs: list, sent: float, generations: tuple
    ) -> None:
        """A batch the hosts answered (every future of ``refs`` is done): its accounting, then its answer."""
        from pathways_jax._src import wire

        answers: list[Any] = []
        lost_host = None
        for (host, _item), ref in zip(messages, refs, strict=True):
            try:
                answers.append(ref.result())
            except Exception as exc:
                if ray_backend.is_lost_error(exc):
                    lost_host = host
                    answers.append(RunFailure("lost", host, f"host {host} died: {exc}", ""))
                else:
                    answers.append(RunFailure("error", None, f"host {host}: {type(exc).__name__}: {exc}", ""))
        for (_host, item), answer in zip(messages, answers, strict=True):
            if isinstance(item, wire.Fetch):  # its value went straight to the client, or through here
                self.fetches["direct" if item.reply_to is not None and answer is None else "relayed"] += 1
        finish = functools.partial(self._finish, client, batch, messages, answers, sent)
        if lost_host is not None:  # its island is marked lost (off the loop) before the batch is answered
            generation = generations[self.layout.island_of(lost_host)]
            asyncio.get_running_loop().create_task(self._lost(lost_host, generation, finish))
            return
        finish()

    async def _lost(self, host: int, generation: int, then: Callable[[], None]) -> None:
        await asyncio.get_running_loop().run_in_executor(
            None, self.backend.mark_lost, host, "its actor died", generation
        )
        then()

    def _finish(
        self, client: ClientProcess, batch: Batch, messages: list, answers: list, sent: float
    ) -> None:
        """Charges a completed run to its client and policy, and answers the batch."""
        from pathways_jax._src import wire

        if batch.run is not None:
            done = time.monotonic()
            in_flight = self.gate.in_flight
            for island in batch.islands:
                in_flight[island] -= 1
            client.in_flight -= 1
            first = min(batch.islands) if batch.islands else -1
            start = max(sent, self.busy_until.get(first, 0.0))
            self.busy_until[first] = done
            # The hosts measure it (see ray_host.actor's completer); a failed run: as seen from here.
            measured = [
                a.device_s if isinstance(a, RunDone) else a
                for a, (_h, item) in zip(answers, messages, strict=True)
                if isinstance(item, wire.Run)
            ]
            device_s = (
                max(measured)
                if measured and all(isinstance(a, float) for a in measured)
                else max(done - start, 0.0)
            )
            # Small values that came with the completion, in the client's keys.
            answers = [
                RunDone(a.device_s, {key - host_key(client.id, 0): v for key, v in a.values.items()})
                if isinstance(a, RunDone)
                else a
                for a in answers
            ]
            program = batch.run.program
            # The policy was charged an estimate when the run went: now the difference.
            self.gate.admission.policy.charge(client.id, device_s - batch.charged, batch.run.weight)
            admission.fold(client.estimates, client.measured_once, program, device_s)
            client.device_s += device_s
            name = batch.run.client or client.name
            client.by_name[name] = client.by_name.get(name, 0.0) + device_s
            client.runs += 1
            if any(isinstance(a, RunFailure) for a in answers):
                client.failures += 1
                # Its outputs were never made: their bytes go back to the budget now (a run waiting
                # for memory, a client asking to join, would otherwise wait on values that hold none).
                self.ledger.unmade(
                    hk for _h, item in messages if isinstance(item, wire.Run) for _slot, hk in item.keep
                )
        batch.answer(answers)
        self.gate.pump()

    # --- reading ---------------------------------------------------------------------------

    async def health(self, client_id: int | None = None) -> dict:
        """Lost islands and generations; with ``client_id``, why that client was dropped (if it was)."""
        health: dict = {"lost": dict(self.backend.lost), "generations": list(self.backend.generations)}
        if client_id is not None:
            client = self.clients.get(client_id)
            if client is None or not client.alive:
                health["dropped"] = client.why if client is not None else "it is not joined (any more)"
        return health

    async def host_stats(self) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self.backend.host_stats)

    async def stats(self) -> dict:
        """Every client process: programs, device time, bytes held, failures, slices; and the service's state."""
        elapsed = time.monotonic() - self.started
        owned: collections.Counter[int] = collections.Counter()
        count: collections.Counter[int] = collections.Counter()
        for value in self.ledger.values.values():
            if value.owner_holds:
                owned[value.owner] += value.nbytes
                count[value.owner] += 1
        clients = {}
        for c in self.clients.values():
            clients[c.id] = {
                "name": c.name,
                "pid": c.pid,
                "node": c.node,
                "alive": c.alive,
                "gone": c.why,
                "programs": len(c.plans),
                "runs": c.runs,
                "failures": c.failures,
                "refused": c.refused,
                "queued": self.gate.admission.queued(c.id) + len(c.others),
                "in_flight": c.in_flight,
                "answers_waiting": len(c.outbox),
                "device_time_s": c.device_s,
                "by_client": dict(c.by_name),
                "bytes_held": owned[c.id],
                "values": count[c.id],
                "slices": {k: list(v) for k, v in c.slices.items()},
            }
        return {
            "name": self.config.name,
            "elapsed_s": elapsed,
            "scheduler": self.policy,
            "window": self.window_size,
            "hosts": self.layout.hosts,
            "islands": self.layout.islands,
            "in_flight": dict(self.gate.in_flight),
            "bytes_held": self.ledger.held,
            "memory_budget": self.memory_budget,
            "max_clients": self.max_clients,
            "lost": dict(self.backend.lost),
            "clients": clients,
            # Fetched values the hosts sent straight to their clients, and those that came through here.
            "fetches": dict(self.fetches),
            # Frames refused on the clients' channel (forged, replayed, truncated, malformed;
            # signed ones from no joined client, or not a batch), and on the hosts' channel.
            "refused": {
                "clients": {**self.channel.refused, **self.refused_batches},
                "hosts": self.backend.link.stats().get("refused", {}),
            },
        }

    async def stop(self) -> None:
        """Kills the hosts and ends the service (clients' later calls fail with ClusterError)."""
        # A copy: dropping a client forgets the oldest of those that went (the table changes).
        for client in list(self.clients.values()):
            if client.alive:
                self._drop_client(client, "the service stopped")
        await asyncio.get_running_loop().run_in_executor(None, self.backend.close, 5.0)
        self.channel.close()
