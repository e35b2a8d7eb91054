"""The controller service: one long-lived controller on Ray that many client processes share.

``pw.serve(name, hosts=H, ...)`` starts a :class:`ServiceActor`, a named,
detached Ray actor. It owns the host actors (a :class:`RayBackend` of its
own: placement group, islands, the transfer servers, loss and rebuild), the
record of every value the hosts keep and who may read it, and the scheduler
that decides which client's run goes to the hosts next.

A client process joins with ``pw.init(backend="ray", address=..., service=name)``
and keeps the whole API: it traces and lowers locally, against stand-in CPU
devices, as on the plain Ray backend, and its :class:`ServiceBackend` sends
what that backend would send to the hosts to the service instead, one
numbered batch per run (every host's message of the run, so that the hosts
of an island see the run at the same place in their order). Plans go once
per host (``jax.export`` blobs), a run is its plan key, input handles and
fed arguments; values stay on the hosts and the client holds handles.

**One order.** The service is the only sender to the hosts: every host
gets its messages from one asyncio loop, numbered, so collective programs
of different client processes on overlapping slices meet in the same order
on every host of an island.

**Isolation.** Client keys are namespaced by client in the service (a host
key is ``client * 2**40 + key``). A run or fetch may name only values its
client owns and still holds, or that another client shared with it
(``pw.share``); otherwise the whole batch is refused (:class:`Refused`,
raised as ``AccessError``) and nothing is forwarded. A client process that
dies (its token actor dies with it) has its queued runs dropped, its values
freed on the hosts (unless shared with a live client) and its plans and
slices forgotten, within seconds.

**Scheduling.** Each client process has a FIFO queue (its own order, which
its own controller chose among its threads, is kept). The service sends
the head of one queue at a time, when every island the run touches has
fewer than ``window`` runs in flight, choosing by the policy: ``fifo``
(arrival), ``priority`` (the head's ``pw.client`` priority) or ``fair``
(device time charged per client process, in proportion to the head's
``pw.client`` weight): the in-process controller's policy objects
(``runtime/scheduler.py``), keyed by client process, charged with the
device time each host measures. The small window is what lets the policy
choose: the hosts never hold more than ``window`` runs per island. Other
batches (fetch, free, forget, share) go at once, ahead of the client's
queued runs unless they name a value one of those makes or reads; a fetch
is answered with the host's own answer, so values come from the host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import os
import pickle
import secrets
import sys
import time
from typing import TYPE_CHECKING, Any

from absl import logging

from pathways_jax._src.backends import ray as ray_backend
from pathways_jax._src.backends.ray_host import Refused, RunDone, RunFailure
from pathways_jax._src.backends.service_client import NAMESPACE, connect, find
from pathways_jax._src.core import errors
from pathways_jax._src.runtime import admission
from pathways_jax._src.runtime import scheduler as scheduler_lib
from pathways_jax._src.runtime.scheduler import Head

if TYPE_CHECKING:  # the channels need the ray extra (pyzmq, msgspec): imported where used
    from pathways_jax._src import wire

DEFAULT_WINDOW = 4  # runs in flight per island on the service's hosts
_KEY_SPACE = 2**40  # host key = client * _KEY_SPACE + the client's key
_POOL = 0  # the service's memory budget is one pool of bytes for all its hosts
_START_TIMEOUT_S = 180.0
_DEPARTED_KEPT = 64  # clients that went, still listed in stats
# A client's answers its channel cannot take now wait in its outbox, sent again after
# _DRAIN_FIRST_S, doubling up to _DRAIN_MAX_S; past this many bytes the client is dropped.
_DRAIN_FIRST_S = 0.002
_SEND_NOW_S = 0.002  # how long an answer's send may wait before it goes to the outbox
_DRAIN_MAX_S = 0.1
_OUTBOX_BYTES = 256 * 2**20


def host_key(client: int, key: int) -> int:
    """The key the hosts know a client's value or plan by."""
    return client * _KEY_SPACE + key


# --- the service (a detached Ray actor) -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """A controller service's settings (``pw.serve``'s arguments, and the 64-bit mode it runs in)."""

    name: str
    hosts: int
    devices_per_host: int
    islands: int | None
    platform: str
    replace_lost_hosts: bool
    scheduler: str
    window: int
    max_clients: int | None
    memory_budget: int | None
    backpressure_timeout: float | None
    starvation_limit: int
    max_in_flight: int
    x64: bool
    stalled_client_timeout: float = 30.0
    silent_client_timeout: float | None = 30.0


@dataclasses.dataclass(eq=False)
class _Batch:
    """A client's numbered batch: its messages (``wire.Routed``) and what the scheduler needs."""

    client: int
    messages: list[wire.Routed]
    run: wire.RunMeta | None  # set for a run
    future: asyncio.Future
    seq: int = 0  # its number among its client's batches
    arrival: int = 0
    islands: tuple = ()
    nbytes: int = 0
    queued_at: float = 0.0
    charged: float = 0.0  # the estimate the policy was charged when it went


@dataclasses.dataclass(eq=False)
class _Value:
    """A value kept on the hosts: whose, where, how big, and who else may read it."""

    owner: int
    hosts: tuple
    nbytes: int
    readers: set = dataclasses.field(default_factory=set)
    owner_holds: bool = True


@dataclasses.dataclass(eq=False)
class _Client:
    """A client process of the service."""

    id: int
    name: str
    pid: int
    node: str
    token: Any
    joined: float
    alive: bool = True
    why: str = ""
    next_seq: int = 0
    pending: dict = dataclasses.field(default_factory=dict)  # seq -> batch, until its turn
    # Its batches other than runs, in arrival order (its runs queue in the service's admission).
    others: collections.deque = dataclasses.field(default_factory=collections.deque)
    plans: dict = dataclasses.field(default_factory=dict)  # host plan key -> hosts
    runs: int = 0
    in_flight: int = 0  # runs sent to the hosts and not completed
    failures: int = 0
    refused: int = 0
    device_s: float = 0.0
    by_name: dict = dataclasses.field(default_factory=dict)  # pw.client name -> device seconds
    estimates: dict = dataclasses.field(default_factory=dict)  # program -> seconds per run
    slices: dict = dataclasses.field(default_factory=dict)  # slice id -> device ids
    inbox: Any = None  # its own channel (a wire.Reply with no ticket): where fetched values go
    # Answers its channel could not take yet (a slow reader), oldest first, and since when.
    outbox: collections.deque = dataclasses.field(default_factory=collections.deque)
    outbox_bytes: int = 0
    stalled_since: float | None = None
    # time.monotonic() at its join: its silence counts from there until its channel is heard.
    joined_at: float = dataclasses.field(default_factory=time.monotonic)


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
        standins = sorted(jax.devices("cpu"), key=lambda d: d.id)
        self.backend = ray_backend.RayBackend(
            address=None,
            hosts=config.hosts,
            devices_per_host=config.devices_per_host,
            standins=standins[:total],
            window=config.max_in_flight,
            on_lost=None,
            islands=config.islands,
            platform=config.platform,
            replace_lost=config.replace_lost_hosts,
        )
        self.layout = self.backend.layout
        self.window = config.window
        self.policy = config.scheduler
        # The in-process controller's admission core (runtime/admission.py): a queue of runs per
        # client process, its policies (runtime/scheduler.py), and one byte budget for the hosts.
        self.admission: admission.Queues[int, _Batch] = admission.Queues(
            scheduler_lib.make(self.policy, starvation_limit=config.starvation_limit)
        )
        self.budget = admission.Budget({_POOL: config.memory_budget or sys.maxsize})
        self.max_clients = config.max_clients
        self.memory_budget = config.memory_budget
        self.backpressure_timeout = config.backpressure_timeout
        self.clients: dict[int, _Client] = {}
        self.values: dict[int, _Value] = {}
        self.in_flight: collections.Counter[int] = collections.Counter()
        self.busy_until: dict[int, float] = {}
        self.started = time.monotonic()
        self._ids = itertools.count(1)
        self._arrival = itertools.count()
        self._ticker: Any = None
        self._loop: Any = None  # the actor's event loop (set by its first async call)
        # Clients send their batches on this channel (signed with the service's key).
        self.key = secrets.token_bytes(32)
        from pathways_jax._src import wire
        from pathways_jax._src.backends import channel_link

        transport, ip = channel_link.listen_on()
        self.channel = wire.Server(
            self.key, transport=transport, host=ip, on_message=self._from_client, send_timeout=30.0
        )
        self._by_identity: dict[bytes, _Client] = {}
        # Signed messages refused all the same: from no joined client, or not a batch.
        self.refused_batches: collections.Counter[str] = collections.Counter()
        self.fetches: collections.Counter[str] = collections.Counter({"direct": 0, "relayed": 0})

    # --- clients ---------------------------------------------------------------------------

    def info(self) -> dict:
        """What a client needs to lower for the service's hosts."""
        backend = self.backend
        return {
            "name": self.config.name,
            "hosts": self.layout.hosts,
            "devices_per_host": self.layout.devices_per_host,
            "per_island": self.layout.per_island,
            "platform": self.config.platform,
            "x64": self.config.x64,
            "scheduler": self.policy,
            "window": self.window,
            "generations": list(backend.generations),
            "lost": dict(backend.lost),
            "info": backend.info,
            "pid": os.getpid(),
        }

    async def ready(self) -> dict:
        self._loop = asyncio.get_running_loop()
        return self.info()

    async def join(self, name: str, pid: int, node: str, token: Any, x64: bool) -> dict:
        """Admits a client process (or refuses it, saying why); its id and the cluster's shape."""
        live = [c for c in self.clients.values() if c.alive]
        if self.max_clients is not None and len(live) >= self.max_clients:
            who = ", ".join(f"{c.name} (pid {c.pid})" for c in live)
            return {"refused": f"the service admits {self.max_clients} client processes and has them: {who}"}
        if self.memory_budget is not None and self.held >= self.memory_budget:
            return {
                "refused": f"the service's hosts hold {self.held} bytes of values, its whole memory budget "
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
                f"{x64}: their computations would not match"
            }
        client = _Client(next(self._ids), name, pid, node, token, time.time())
        self.clients[client.id] = client
        self._loop = asyncio.get_running_loop()
        self._loop.create_task(self._watch(client))
        if self._ticker is None:
            self._ticker = self._loop.create_task(self._tick())
        identity = f"client-{client.id}".encode()
        self._by_identity[identity] = client
        from pathways_jax._src.backends import channel_link

        channel = channel_link.Endpoint(self.channel.address, self.key, identity)
        return {"client": client.id, "channel": channel, **self.info()}

    async def _watch(self, client: _Client) -> None:
        """Waits on the client's token actor: it dies with the client's process."""
        try:
            await client.token.hold.remote()
            why = "it left"
        except Exception as exc:
            why = f"its process died ({type(exc).__name__})"
        if client.alive:
            self._drop_client(client, why)

    async def leave(self, client_id: int) -> None:
        client = self.clients.get(client_id)
        if client is not None and client.alive:
            self._drop_client(client, "it left")

    def _drop_client(self, client: _Client, why: str) -> None:
        """A client went: its queued runs are dropped, its values, plans and slices released."""
        client.alive = False
        client.why = why
        identity = f"client-{client.id}".encode()
        self._by_identity.pop(identity, None)
        self.channel.forget(identity)
        refused = Refused(f"client {client.name!r} is gone: {why}", "gone")
        queued = self.admission.close(client.id, lambda batch: Head(client.id, batch.arrival))
        for batch in [*queued, *client.others, *client.pending.values()]:
            if not batch.future.done():
                batch.future.set_result([refused] * len(batch.messages))
        client.others.clear()
        client.pending.clear()
        client.outbox.clear()
        client.outbox_bytes = 0
        frees: dict[int, list[int]] = collections.defaultdict(list)
        for key, value in list(self.values.items()):
            value.readers.discard(client.id)
            if value.owner == client.id:
                value.owner_holds = False
            if not value.owner_holds and not value.readers:
                self._release(key, frees)
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
        self._pump()

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
        value = self.values.get(host_key(client_id, key))
        if value is None or value.owner != client_id or not value.owner_holds:
            return Refused(f"value {key} of this client is not on the hosts (freed, or never made)")
        readers = [c for c in self.clients.values() if c.alive and (c.name == reader or str(c.id) == reader)]
        if not readers:
            names = sorted(c.name for c in self.clients.values() if c.alive)
            return Refused(f"no client process named {reader!r} is connected (connected: {names})")
        value.readers.update(c.id for c in readers)
        return None

    # --- batches ---------------------------------------------------------------------------

    def _from_client(self, received: wire.Received) -> None:
        """A message on the service's channel (its receive thread): handled on the actor's loop."""
        self._loop.call_soon_threadsafe(self._client_message, received)

    def _client_message(self, received: wire.Received) -> None:
        from pathways_jax._src import wire

        client = self._by_identity.get(received.peer)
        if client is None:  # signed with the key, but no client joined under that name
            self.refused_batches["unknown_client"] += 1
            return
        match received.body:
            case wire.Submit(seq, messages, run):
                future = self._submit(client, seq, messages, run)
                peer = received.peer
                future.add_done_callback(lambda done: self._answer(peer, seq, done.result()))
            case _:
                self.refused_batches["not_a_batch"] += 1  # clients send only batches

    def _answer(self, peer: bytes, seq: int, answers: list) -> None:
        """Sends a client the answers to its batch ``seq`` (a client that went gets nothing).

        Never waits: the loop serves every client. An answer the client's
        channel cannot take now (a slow or stopped reader: its queue is at the
        high-water mark) waits in the client's outbox, behind which its later
        answers queue, and is sent again from the loop (:meth:`_drain`).
        """
        from pathways_jax._src import wire

        client = self._by_identity.get(peer)
        if client is None:
            return
        try:
            blob = wire.Blob(pickle.dumps(answers, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:  # an answer that cannot be pickled still answers
            refused = Refused(f"the service could not send the answer: {type(exc).__name__}: {exc}")
            blob = wire.Blob(pickle.dumps([refused] * len(answers), protocol=pickle.HIGHEST_PROTOCOL))
        message = wire.Answered(seq, blob)
        if not client.outbox and self._send_now(peer, message):
            return
        client.outbox.append(message)
        client.outbox_bytes += len(blob.view)
        if client.stalled_since is None:
            client.stalled_since = time.monotonic()
            self._loop.call_later(_DRAIN_FIRST_S, self._drain, client, _DRAIN_FIRST_S)

    def _send_now(self, peer: bytes, message: Any) -> bool:
        """Sends ``message`` if the client's channel takes it at once; False if it is full."""
        from pathways_jax._src import wire

        try:
            # A moment's wait: the channel's heartbeat thread may hold its send lock now.
            self.channel.send(peer, message, timeout=_SEND_NOW_S)
        except wire.ChannelFull:
            return False
        except wire.ChannelClosed:  # the service is stopping: nothing more goes out
            pass
        return True

    def _drain(self, client: _Client, pause: float) -> None:
        """Sends what waits in a client's outbox; a client that took nothing for too long is dropped."""
        peer = f"client-{client.id}".encode()
        while client.outbox and client.alive:
            if not self._send_now(peer, client.outbox[0]):
                break
            client.outbox_bytes -= len(client.outbox.popleft().answers.view)
            client.stalled_since = time.monotonic() if client.outbox else None
        if not client.outbox or not client.alive:
            client.stalled_since = None
            return
        stalled = time.monotonic() - (client.stalled_since or time.monotonic())
        if stalled >= self.config.stalled_client_timeout or client.outbox_bytes > _OUTBOX_BYTES:
            self._drop_client(
                client,
                f"it stopped reading its answers ({len(client.outbox)} answers, {client.outbox_bytes} bytes "
                f"waited {stalled:.1f}s; stalled_client_timeout={self.config.stalled_client_timeout}s)",
            )
            return
        pause = min(pause * 2, _DRAIN_MAX_S)
        self._loop.call_later(pause, self._drain, client, pause)

    def _submit(self, client: _Client, seq: int, messages: list, run: wire.RunMeta | None) -> asyncio.Future:
        """A client's batch number ``seq``; its future is set to each message's answer once they are done."""
        batch = _Batch(client.id, messages, run, self._loop.create_future(), seq)
        if not client.alive:
            gone = Refused(f"client {client.name!r} is not connected to this service ({client.why})", "gone")
            batch.future.set_result([gone] * len(messages))
            return batch.future
        client.pending[seq] = batch
        while client.next_seq in client.pending:
            ready = client.pending.pop(client.next_seq)
            client.next_seq += 1
            ready.arrival = next(self._arrival)
            ready.queued_at = time.monotonic()
            if ready.run is not None:
                ready.islands = tuple(ready.run.islands)
                ready.nbytes = sum(ready.run.nbytes.values())
                self.admission.push(client.id, ready)
            else:
                client.others.append(ready)
        self._pump()
        return batch.future

    @property
    def held(self) -> int:
        """Bytes of values on the hosts."""
        return self.budget.used[_POOL]

    async def _tick(self) -> None:
        """Looks at the queues and the clients now and then: a run waiting for memory fails in
        time even when nothing else happens, and a silent client is dropped."""
        while True:
            await asyncio.sleep(0.5)
            with contextlib.suppress(Exception):
                self._drop_silent()
            with contextlib.suppress(Exception):
                self._pump()

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
            silent = now - max(client.joined_at, heard or client.joined_at)
            if client.alive and silent > timeout:
                self._drop_client(
                    client,
                    f"its channel sent nothing, not even a heartbeat, for {silent:.1f}s: a stopped or hung "
                    f"process (silent_client_timeout={timeout}s)",
                )

    def _pump(self) -> None:
        """Sends queue heads while the policy finds one that may go."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        while True:
            # Everything but runs goes at once, ahead of the client's queued runs
            # unless it names what they read or make (a fetch of a queued run's
            # output waits for that run, a free for the runs reading the value).
            others = [(c, b) for c in self.clients.values() if c.alive for b in self._unblocked(c)]
            if others:
                for client, batch in others:
                    client.others.remove(batch)
                    self._forward(client, batch)
                continue
            heads = [(self.clients[key], batch) for key, batch in self.admission.heads()]
            if not heads:
                return
            if any(self._over_budget(c, b) for c, b in heads):
                continue  # a run failed for memory: look at the queues again
            runs = [(c, b) for c, b in heads if self._may_go(b)]
            if not runs:
                return
            choices = [self._head(c, b) for c, b in runs]
            index = self.admission.pick(choices)
            client, batch = runs[index]
            batch.charged = choices[index].cost
            self.admission.pop(client.id)
            self._forward(client, batch)

    @staticmethod
    def _head(client: _Client, batch: _Batch) -> Head:
        """A queued run as the policy sees it."""
        run = batch.run
        assert run is not None  # only runs queue for the policy
        return Head(
            client.id, batch.arrival, run.priority, run.weight, client.estimates.get(run.program, 0.0)
        )

    def _unblocked(self, client: _Client) -> list[_Batch]:
        """The client's batches other than runs that need none of its earlier queued runs to go first."""
        from pathways_jax._src import wire

        if not client.others:
            return []
        runs = iter(self.admission.queues.get(client.id, ()))  # in arrival order
        run = next(runs, None)
        reads: set = set()
        makes: set = set()
        plans: set = set()
        ready = []
        for batch in client.others:
            while run is not None and run.arrival < batch.arrival:
                for routed in run.messages:
                    match routed.item:
                        case wire.Run(plan=plan, feeds=feeds, keep=keep):
                            plans.add(plan)
                            reads.update(feed.value for feed in feeds if feed.value is not None)
                            makes.update(local for _slot, local in keep)
                run = next(runs, None)
            blocked = False
            for routed in batch.messages:
                match routed.item:
                    case wire.Fetch(key=key) | wire.Share(key=key):
                        blocked |= key in makes
                    case wire.Free(keys=keys):
                        blocked |= any(key in makes or key in reads for key in keys)
                    case wire.Forget(plan=plan):
                        blocked |= plan in plans
            if not blocked:
                ready.append(batch)
        return ready

    def _may_go(self, batch: _Batch) -> bool:
        if not all(admission.has_room(self.in_flight[island], 1, self.window) for island in batch.islands):
            return False
        return self.budget.fits(((_POOL, batch.nbytes),))

    def _over_budget(self, client: _Client, batch: _Batch) -> bool:
        """Fails (and takes off the queue) a run that will never fit, or waited too long to; True if it did."""
        charge = ((_POOL, batch.nbytes),)
        if self.budget.fits(charge):
            return False
        waited = time.monotonic() - batch.queued_at
        never = self.budget.exceeds(charge)
        if not never and not admission.waited_too_long(
            batch.queued_at, time.monotonic(), self.backpressure_timeout
        ):
            return False
        # It can never fit, or waited too long: it fails, and the queue goes on.
        self.admission.drop(client.id, Head(client.id, batch.arrival))
        why = (
            f"its outputs ({batch.nbytes} bytes) exceed the service's whole memory budget "
            f"({self.memory_budget} bytes)"
            if never
            else f"it waited {waited:.1f}s for memory under the service's budget ({self.memory_budget} bytes, "
            f"{self.held} held)"
        )
        client.failures += 1
        self._fail(client, batch, Refused(f"the run cannot be admitted: {why}", "memory"))
        return True

    def _fail(self, client: _Client, batch: _Batch, answer: Refused) -> None:
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
        batch.future.set_result([answer] * len(batch.messages))

    def _release(self, key: int, frees: dict[int, list[int]]) -> None:
        value = self.values.pop(key)
        self.budget.release(((_POOL, value.nbytes),), locked=True)
        for host in value.hosts:
            frees[host].append(key)

    def _readable(self, client: _Client, key: Any) -> int:
        """The host key of a value ``client`` names (its own, or ``(owner, key)``), if it may read it."""
        owner, local = (client.id, key) if isinstance(key, int) else key
        hk = host_key(owner, local)
        value = self.values.get(hk)
        if value is None:
            raise _Refuse(
                f"the value handle (client {owner}, key {local}) names no value on the hosts: freed, or "
                "never made"
            )
        if owner == client.id and value.owner_holds:
            return hk
        if client.id in value.readers:
            return hk
        if owner == client.id:
            raise _Refuse(f"value {local} of this client was freed (a stale handle)")
        raise _Refuse(
            f"the value handle (client {owner}, key {local}) belongs to another client process and was not "
            "shared with this one (pw.share(future, client=...) in its owner)"
        )

    def _frees(self, client: _Client, keys: list, frees: dict[int, list[int]]) -> None:
        """``client`` dropped its handles ``keys``: values nobody holds any more are freed."""
        for key in keys:
            if isinstance(key, int):
                owner, local, owned = client.id, key, True
            else:  # a received handle (pw.receive), of another process or of this one
                (owner, local), owned = key, False
                if owner == client.id:
                    continue  # the owner's own future frees it
            hk = host_key(owner, local)
            value = self.values.get(hk)
            if value is None:
                continue
            if owned:
                value.owner_holds = False
            else:
                value.readers.discard(client.id)
            if not value.owner_holds and not value.readers:
                self._release(hk, frees)

    def _translate(self, client: _Client, batch: _Batch) -> tuple[list, dict]:
        """The batch in host keys, ``(host, item)``, and the frees it makes; raises _Refuse before
        changing anything."""
        from pathways_jax._src import wire

        cid = client.id
        for routed in batch.messages:  # every handle is checked first
            match routed.item:
                case wire.Run(feeds=feeds):
                    for feed in feeds:
                        if feed.value is not None:
                            self._readable(client, feed.value)
                case wire.Fetch(key=key):
                    self._readable(client, key)
                case wire.Register() | wire.Forget() | wire.Free():
                    pass
                case other:
                    raise _Refuse(
                        f"a client may not send {type(other).__name__} messages in a batch of others"
                    )
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
                    client.plans.get(key, set()).discard(host)
                    out.append((host, wire.Forget(key)))
                case wire.Run(plan, run_id, _base, feeds, keep, drop):
                    self._frees(client, drop, frees)
                    feeds = [
                        feed
                        if feed.value is None
                        else wire.Feed(feed.slot, self._readable(client, feed.value))
                        for feed in feeds
                    ]
                    kept = []
                    for slot, local in keep:
                        hk = host_key(cid, local)
                        kept.append((slot, hk))
                        value = self.values.get(hk)
                        if value is None:
                            size = int(nbytes.get(local, 0))
                            self.values[hk] = _Value(cid, (host,), size)
                            self.budget.hold(((_POOL, size),))
                        elif host not in value.hosts:
                            value.hosts = (*value.hosts, host)
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
                    self._frees(client, keys, frees)
                    out.append((host, wire.Free(list[wire.Handle](frees.pop(host, [])))))
                case wire.Fetch(key):
                    # The host sends the value straight to the client's own channel, if it has one.
                    inbox = client.inbox
                    reply = None
                    if inbox is not None and self.backend.link.name == "channel":
                        reply = wire.Reply(inbox.up, inbox.down, inbox.key, batch.seq)
                    out.append((host, wire.Fetch(self._readable(client, key), reply)))
        return out, frees

    def _forward(self, client: _Client, batch: _Batch) -> None:
        """Sends a batch to its hosts, all at once; its answers come back through :meth:`_complete`."""
        from pathways_jax._src import wire

        shares = [routed.item for routed in batch.messages if isinstance(routed.item, wire.Share)]
        if shares and len(shares) == len(batch.messages):
            batch.future.set_result([self._share(client.id, share.key, share.reader) for share in shares])
            return
        try:
            messages, frees = self._translate(client, batch)
        except _Refuse as refused:
            client.refused += 1
            self._fail(client, batch, Refused(str(refused)))
            return
        sent = time.monotonic()
        generations = tuple(self.backend.generations)  # a loss seen later is of these islands
        refs = self.backend.send_items(
            messages + [(host, wire.Free(list[wire.Handle](keys))) for host, keys in frees.items()]
        )
        refs = refs[: len(messages)]
        if batch.run is None:
            if not any(isinstance(item, wire.Fetch) for _host, item in messages):
                batch.future.set_result([None] * len(messages))  # answered at once
            else:  # a fetch: with the host's answer
                asyncio.get_running_loop().create_task(
                    self._complete(client, batch, messages, refs, sent, generations)
                )
            return
        for island in batch.islands:
            self.in_flight[island] += 1
        client.in_flight += 1
        asyncio.get_running_loop().create_task(
            self._complete(client, batch, messages, refs, sent, generations)
        )

    async def _complete(
        self, client: _Client, batch: _Batch, messages: list, refs: list, sent: float, generations: tuple
    ) -> None:
        from pathways_jax._src import wire

        answers: list[Any] = []
        lost_host = None
        for (host, _item), ref in zip(messages, refs, strict=True):
            try:
                answers.append(await asyncio.wrap_future(ref))
            except Exception as exc:
                if ray_backend.is_lost_error(exc):
                    lost_host = host
                    answers.append(RunFailure("lost", host, f"host {host} died: {exc}", ""))
                else:
                    answers.append(RunFailure("error", None, f"host {host}: {type(exc).__name__}: {exc}", ""))
        for (_host, item), answer in zip(messages, answers, strict=True):
            if isinstance(item, wire.Fetch):  # its value went straight to the client, or through here
                self.fetches["direct" if item.reply_to is not None and answer is None else "relayed"] += 1
        if lost_host is not None:
            island = self.layout.island_of(lost_host)
            await asyncio.get_running_loop().run_in_executor(
                None, self.backend.mark_lost, lost_host, "its actor died", generations[island]
            )
        if batch.run is not None:
            done = time.monotonic()
            for island in batch.islands:
                self.in_flight[island] -= 1
            client.in_flight -= 1
            first = min(batch.islands) if batch.islands else -1
            start = max(sent, self.busy_until.get(first, 0.0))
            self.busy_until[first] = done
            # The hosts measure it (see ray_host's completer); a failed run: as seen from here.
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
            estimate = client.estimates.get(program, 0.0)
            # The policy was charged an estimate when the run went: now the difference.
            self.admission.policy.charge(client.id, device_s - batch.charged, batch.run.weight)
            client.estimates[program] = admission.smoothed(estimate, device_s)
            client.device_s += device_s
            name = batch.run.client or client.name
            client.by_name[name] = client.by_name.get(name, 0.0) + device_s
            client.runs += 1
            if any(isinstance(a, RunFailure) for a in answers):
                client.failures += 1
        if not batch.future.done():
            batch.future.set_result(answers)
        self._pump()

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
        for value in self.values.values():
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
                "queued": self.admission.queued(c.id) + len(c.others),
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
            "window": self.window,
            "hosts": self.layout.hosts,
            "islands": self.layout.islands,
            "in_flight": dict(self.in_flight),
            "bytes_held": self.held,
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
        for client in self.clients.values():
            if client.alive:
                self._drop_client(client, "the service stopped")
        await asyncio.get_running_loop().run_in_executor(None, self.backend.close, 5.0)
        self.channel.close()


class _Refuse(Exception):
    """A batch names a value its client may not use: it is refused whole."""


# --- starting and stopping a service -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Service:
    """A running controller service (``pw.serve`` returns one; ``pw.service(name)`` finds one).

    Attributes:
      name: the name clients join with (``pw.init(backend="ray", service=name)``).
      address: the Ray cluster's address (the GCS address) clients pass as ``address=``.
    """

    name: str
    address: str
    actor: Any = dataclasses.field(repr=False, compare=False)

    def stats(self, timeout: float = 30.0) -> dict:
        """The service's ``stats``: every client process with its runs, device time, bytes held, failures."""
        import ray

        return ray.get(self.actor.stats.remote(), timeout=timeout)

    def host_stats(self, timeout: float = 30.0) -> dict:
        """Each host's counts (values kept, runs done, executables, plans, transfers)."""
        import ray

        return ray.get(self.actor.host_stats.remote(), timeout=timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the service: its hosts are killed, its clients' values go, the actor ends."""
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(), timeout=timeout)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


def serve(
    name: str = "pathways",
    *,
    hosts: int,
    devices_per_host: int = 1,
    islands: int | None = None,
    address: str | None = None,
    scheduler: str = "fifo",
    window: int = DEFAULT_WINDOW,
    max_clients: int | None = None,
    memory_budget: int | None = None,
    backpressure_timeout: float | None = 60.0,
    starvation_limit: int = scheduler_lib.DEFAULT_STARVATION_LIMIT,
    max_in_flight: int = ray_backend.RUNS_IN_FLIGHT,
    platform: str = "cpu",
    replace_lost_hosts: bool = True,
    stalled_client_timeout: float = 30.0,
    silent_client_timeout: float | None = 30.0,
) -> Service:
    """Starts a controller service: a named, detached Ray actor owning ``hosts`` host actors.

    Client processes join it with ``pw.init(backend="ray", address=...,
    service=name)``. The service outlives the process that started it; stop
    it with :meth:`Service.stop` (or ``python -m pathways_jax.serve --stop``).

    Args:
      name: the service's name in the Ray cluster (namespace ``"pathways_jax"``).
      hosts, devices_per_host, islands, platform, replace_lost_hosts: the hosts,
        as for ``pw.init(backend="ray", ...)``.
      address: the Ray cluster (``"auto"``: the one ``ray start`` started on
        this machine). ``None``: this process's Ray session, else ``"auto"``.
      scheduler: ``"fifo"``, ``"priority"`` or ``"fair"``: how the service picks
        the next run among client processes.
      window: runs in flight per island on the hosts; small, so the policy decides.
      max_clients: client processes admitted at once (``None``: no limit).
      memory_budget: bytes of values the hosts may hold for all clients
        together; a run whose outputs do not fit waits (at most
        ``backpressure_timeout`` seconds), a client is not admitted while it is full.
      backpressure_timeout: seconds a run may wait for memory before it fails.
      starvation_limit: under ``"priority"``, a run passed over more than
        this many times goes next.
      max_in_flight: executables each host keeps in flight.
      stalled_client_timeout: seconds a client process may leave its answers
        unread (its channel full: a stopped or stuck process) before the
        service drops it as if it had died (its values freed). Meanwhile its
        answers wait in a bounded outbox and the other clients are served.
      silent_client_timeout: seconds a joined client process's channel may
        send nothing, not even its heartbeat (one a second of quiet, from a
        thread of its own), before the service drops it as if it had died: a
        stopped (``SIGSTOP``, Ctrl-Z), hung or unreachable process, which
        Ray's supervision does not see. ``None``: never.

    Returns:
      The :class:`Service`.

    Raises:
      ClusterError: bad arguments, a service of that name exists, or Ray could not start the hosts.
    """
    import jax

    if not isinstance(name, str) or not name:
        raise errors.ClusterError(f"a service's name must be a non-empty string, got {name!r}.")
    for label, value, low in (
        ("hosts", hosts, 1),
        ("devices_per_host", devices_per_host, 1),
        ("window", window, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise errors.ClusterError(f"{label} must be an int >= {low}, got {value!r}.")
    if islands is not None and (
        isinstance(islands, bool) or not isinstance(islands, int) or islands < 1 or hosts % islands
    ):
        raise errors.ClusterError(
            f"islands must be None or a number of islands dividing hosts={hosts}, got {islands!r}."
        )
    if scheduler not in scheduler_lib.POLICIES:
        raise errors.ClusterError(
            f"scheduler={scheduler!r} is not a policy; use one of {scheduler_lib.POLICIES}."
        )
    if max_clients is not None and (
        isinstance(max_clients, bool) or not isinstance(max_clients, int) or max_clients < 1
    ):
        raise errors.ClusterError(f"max_clients must be None or an int >= 1, got {max_clients!r}.")
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1
    ):
        raise errors.ClusterError(
            f"memory_budget must be None or a number of bytes >= 1, got {memory_budget!r}."
        )
    if (
        isinstance(stalled_client_timeout, bool)
        or not isinstance(stalled_client_timeout, int | float)
        or not stalled_client_timeout > 0
    ):
        raise errors.ClusterError(
            f"stalled_client_timeout must be a number of seconds > 0, got {stalled_client_timeout!r}."
        )
    if silent_client_timeout is not None and (
        isinstance(silent_client_timeout, bool)
        or not isinstance(silent_client_timeout, int | float)
        or not silent_client_timeout > 0
    ):
        raise errors.ClusterError(
            f"silent_client_timeout must be None or a number of seconds > 0, got {silent_client_timeout!r}."
        )
    ray = connect(address, start=True)
    with contextlib.suppress(ValueError):
        ray.get_actor(name, namespace=NAMESPACE)
        raise errors.ClusterError(
            f"a controller service named {name!r} is already running in this Ray cluster; join it with "
            f"pw.init(backend='ray', service={name!r}), or stop it first (pw.service({name!r}).stop())."
        )
    config = ServiceConfig(
        name=name,
        hosts=hosts,
        devices_per_host=devices_per_host,
        islands=islands,
        platform=platform,
        replace_lost_hosts=replace_lost_hosts,
        scheduler=scheduler,
        window=window,
        max_clients=max_clients,
        memory_budget=memory_budget,
        backpressure_timeout=backpressure_timeout,
        starvation_limit=starvation_limit,
        max_in_flight=max_in_flight,
        x64=bool(jax.config.read("jax_enable_x64")),
        stalled_client_timeout=float(stalled_client_timeout),
        silent_client_timeout=None if silent_client_timeout is None else float(silent_client_timeout),
    )
    actor = (
        ray.remote(ServiceActor)
        .options(name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=10000)
        .remote(config)
    )
    try:
        ray.get(actor.ready.remote(), timeout=_START_TIMEOUT_S)
    except Exception as exc:
        with contextlib.suppress(Exception):
            ray.kill(actor)
        raise errors.ClusterError(f"the controller service {name!r} did not start: {exc}") from exc
    return Service(name, ray.get_runtime_context().gcs_address, actor)


def service(name: str = "pathways", *, address: str | None = None) -> Service:
    """The running controller service named ``name`` (ClusterError if there is none)."""
    ray = connect(address)
    return Service(name, ray.get_runtime_context().gcs_address, find(ray, name, f"pw.service({name!r})"))


__all__ = ["DEFAULT_WINDOW", "Service", "ServiceActor", "host_key", "serve", "service"]
