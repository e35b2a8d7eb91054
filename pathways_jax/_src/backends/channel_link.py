"""The controller's link to its hosts over ZeroMQ: typed, signed messages, batched both ways.

:class:`ChannelLink` (the controller's end) binds a :class:`wire.Server`: an
IPC socket when every host runs on this machine, TCP on this node's address
when the Ray cluster has several nodes. Each host actor connects a
:class:`HostEnd` (a :class:`wire.Peer`) in its ``setup``, given the address,
the per-link secret every frame is signed with, and its identity. Ray still
starts, places and supervises the actors; a host's death (seen by the
backend's monitor) fails what it owes here (:meth:`ChannelLink.host_lost`).

Messages to a host go in the order the controller numbered them; a run's
messages to one host (a plan's registration and the run) go as one batch.
A run on several hosts of an island goes as ONE broadcast on the island's
topic (:meth:`ChannelLink.send_group`, ``wire.Server.broadcast``): every
host's part in one signed frame that ZeroMQ's I/O thread copies to the
island's hosts, each host taking its own part in its one order of messages.
So the controller's cost of a run hardly grows with its hosts. Parts whose
blobs are large (a plan's registration, fed arrays) go host by host instead:
every host of a broadcast receives every part.
The host handles them strictly in arrival order, answering each with
``Done``, ``Failed`` or ``Fetched`` (answers posted while another is being
sent go out together as one batch). Plan parts, fed values and fetched
values cross as blobs: pickled, but a fetched numpy array of a built-in
numeric dtype as its bytes behind a small header (:func:`_array_blob`);
everything else is typed fields.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import pickle
import secrets
import socket
import struct
import threading
import time
from typing import Any, Literal, NamedTuple

import numpy as np

from pathways_jax._src import wire
from pathways_jax._src.backends.host_link import HostGone
from pathways_jax._src.backends.ray_host import MessageFailed, RunDone, RunFailure

_SEND_TIMEOUT_S = 30.0  # a host that takes no message for this long is stuck (or gone)
# A host heard from before that takes no message for this long is gone: its connection closed
# (the controller's send holds the backend's lock: it must not wait long for a dead host).
_CONNECTED_SEND_TIMEOUT_S = 2.0
# A broadcast's parts whose blobs (in frames of their own) pass this go host by host: every host
# of a broadcast receives every part.
_FANOUT_BYTES = 64 * 1024
_CLIENTS_KEPT = 32  # a host's channels to clients that fetched values (the least recently used close)
# A value a client's channel does not take within this long goes back through the service instead.
_REPLY_TIMEOUT_S = 0.5


class Endpoint(NamedTuple):
    """What a host needs to join the controller's channel (it pickles through Ray)."""

    address: wire.Address
    key: bytes
    identity: bytes
    groups: tuple[bytes, ...] = ()  # the broadcasts it hears: its island's

    def connect(self, deliver: Any) -> HostEnd:
        """This host's end of the channel; ``deliver(kind, args, seq)`` takes each message."""
        return HostEnd(self, deliver)

    def peer(self, on_message: Any, send_timeout: float) -> wire.Peer:
        """A channel peer under this endpoint's identity, signed with its key."""
        return wire.Peer(
            self.address,
            self.key,
            identity=self.identity,
            groups=self.groups,
            on_message=on_message,
            send_timeout=send_timeout,
        )


def _group(island: int) -> bytes:
    return b"island-%d" % island


def _encoded(
    batch: list[tuple[int, str, tuple]], seen: list[tuple[list[tuple[str, tuple]], list[wire.Item]]]
) -> list[wire.Item]:
    """``batch`` as wire messages: the very objects of an equal batch in ``seen`` (an SPMD run's
    hosts get equal messages: encoded once, and sent once in the broadcast), else new ones."""
    plain = [(kind, args) for _seq, kind, args in batch]
    for other, items in seen:
        try:
            if other == plain:
                return items
        except (ValueError, TypeError):  # arrays compare elementwise: not the same message
            continue
    items = [encode(kind, args) for kind, args in plain]
    if len(seen) < 4:  # a few distinct batches are compared with, no more
        seen.append((plain, items))
    return items


def _blob_bytes(items: list[wire.Item]) -> int:
    """Bytes of the blobs of ``items``."""
    total = 0
    for item in items:
        match item:
            case wire.Run(feeds=feeds):
                blobs = [feed.data for feed in feeds if feed.data is not None]
            case wire.Register(ops=ops, constants=constants, blobs=extra):
                blobs = [ops, constants, extra]
            case _:
                blobs = []
        total += sum(len(blob) for blob in blobs)
    return total


def _blob(value: Any) -> wire.Blob:
    return wire.Blob(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _unblob(blob: wire.Blob) -> Any:
    return pickle.loads(blob.view)


# A fetched array's blob: a header (this first byte, where a pickle's is 0x80; the length of its
# dtype's ``str``, e.g. ``<f4``; its number of dimensions), that ``str``, its shape, then its bytes
# in C order. Pickling would run numpy's reduce machinery on both sides.
_ARRAY = 0
_ARRAY_HEAD = struct.Struct("<BBB")


@functools.cache
def _shape_struct(ndim: int) -> struct.Struct:
    return struct.Struct(f"<{ndim}q")


@functools.cache
def _dtype(code: bytes) -> np.dtype:
    return np.dtype(code.decode())


def _array_blob(value: np.ndarray) -> wire.Blob:
    """A fetched array as a blob: its raw bytes for a built-in numeric dtype, else pickled."""
    dtype = value.dtype
    if dtype.isbuiltin != 1 or dtype.kind not in "biufc":  # bfloat16, strings, objects, ...: pickled
        return _blob(value)
    code = dtype.str.encode()
    shape = _shape_struct(value.ndim).pack(*value.shape)
    head = _ARRAY_HEAD.pack(_ARRAY, len(code), value.ndim)
    return wire.Blob(b"".join((head, code, shape, np.ascontiguousarray(value).data)))


def _value_blob(value: Any) -> wire.Blob:
    """A value as a :class:`wire.Fetched` payload: an array's raw bytes, anything else pickled."""
    return _array_blob(value) if type(value) is np.ndarray else _blob(value)


def _fetched_value(blob: wire.Blob) -> Any:
    """What :func:`_array_blob` made (a writable array of its own), or a pickled value."""
    view = blob.view
    if not view or view[0] != _ARRAY:
        return pickle.loads(view)
    _, length, ndim = _ARRAY_HEAD.unpack_from(view)
    at = _ARRAY_HEAD.size + length
    shape = _shape_struct(ndim).unpack_from(view, at)
    data = bytearray(view[at + 8 * ndim :])  # off the frame, whose memory is read-only
    return np.frombuffer(data, _dtype(bytes(view[_ARRAY_HEAD.size : at]))).reshape(shape)


def _feed(slot: int, kind: str, payload: Any) -> wire.Feed:
    """A run's input ``(slot, kind, payload)`` as its wire form: a value's key, or a fed value."""
    if kind == "value":
        return wire.Feed(slot, value=payload)
    if kind == "shared":
        return wire.Feed(slot, value=payload, shared=True)
    return wire.Feed(slot, data=_blob(payload))


def _unfeed(feed: wire.Feed) -> tuple[int, str, Any]:
    if feed.data is None:
        return feed.slot, "shared" if feed.shared else "value", feed.value
    return feed.slot, "data", _unblob(feed.data)


def encode(kind: str, args: tuple) -> wire.Item:
    """A host message ``(kind, args)`` of the Ray backend as its typed wire message."""
    match kind:
        case "run":
            key, run_id, base, feeds, keep, frees = args
            return wire.Run(key, run_id, base, [_feed(*feed) for feed in feeds], list(keep), list(frees))
        case "share":  # (a client's message to its service)
            return wire.Share(args[0], args[1])
        case "cancel":  # (a client's message to its service)
            return wire.Cancel(args[0])
        case "wire":  # already a typed message (a controller service's, in the hosts' keys)
            return args[0]
        case "register":
            key, ops, constants, blobs, *mode = args
            return wire.Register(key, _blob(ops), _blob(constants), _blob(blobs), mode[0] if mode else None)
        case "fetch":  # (key,), or (key, reply): the value goes straight to a client
            return wire.Fetch(args[0], args[1] if len(args) > 1 else None)
        case "free":
            return wire.Free(list(args[0]))
        case "forget":
            return wire.Forget(args[0])
        case "peers":
            return wire.Peers({int(h): str(a) for h, a in args[0].items()})
        case "stash":
            return wire.Stash(args[0], _blob(args[1]), args[2])
        case "store":
            return wire.Store(args[0], args[1])
        case "load":
            return wire.Load(_blob(args[0]))
        case "colocated":
            order, feeds = args
            return wire.Colocated(_blob(order), [_feed(*feed) for feed in feeds])
    raise ValueError(f"no wire message for a host message of kind {kind!r}")


def decode(item: wire.Item) -> tuple[str, tuple]:
    """A typed wire message as the host's ``(kind, args)``."""
    match item:
        case wire.Run(plan, run_id, base, feeds, keep, frees):
            return "run", (
                plan,
                run_id,
                base,
                [_unfeed(feed) for feed in feeds],
                [tuple(k) for k in keep],
                frees,
            )
        case wire.Register(plan, ops, constants, blobs, x64):
            return "register", (plan, _unblob(ops), _unblob(constants), _unblob(blobs), x64)
        case wire.Fetch(key, None):
            return "fetch", (key,)
        case wire.Fetch(key, reply):
            return "fetch", (key, reply)
        case wire.Free(keys):
            return "free", (keys,)
        case wire.Forget(plan):
            return "forget", (plan,)
        case wire.Peers(addresses):
            return "peers", (addresses,)
        case wire.Stash(ticket, writes, ocdbt):
            return "stash", (ticket, _unblob(writes), ocdbt)
        case wire.Store(ticket, write):
            return "store", (ticket, write)
        case wire.Load(reads):
            return "load", (_unblob(reads),)
        case wire.Colocated(order, feeds):
            return "colocated", (_unblob(order), [_unfeed(feed) for feed in feeds])
    raise ValueError(f"a host takes no {type(item).__name__} message")


def answer_message(seq: int, value: Any) -> wire.Done | wire.Failed | wire.Fetched:
    """A host's answer to message ``seq`` as its wire message (a controller service's answers to a
    client's batch too: what else it answers, a ``Refused``, crosses pickled as a fetched value)."""
    if type(value) is np.ndarray:  # a fetched value, the most frequent answer with a payload
        return wire.Fetched(seq, _array_blob(value))
    match value:
        case None | float():
            return wire.Done(seq, value)
        case RunDone(device_s, values):
            return wire.Done(seq, device_s, [(key, _value_blob(small)) for key, small in values.items()])
        case RunFailure(kind, peer, message, trace, peers, error):
            return wire.Failed(seq, kind, peer, message, trace, list(peers), error)
        case MessageFailed():
            return wire.Failed(seq, "ended" if value.ended else "message", None, value.message, value.trace)
    return wire.Fetched(seq, _blob(value))


def answer_value(item: wire.Item) -> Any:
    """The host's answer as the Ray backend reads it."""
    match item:
        case wire.Done(_, value, None):
            return value
        case wire.Done(_, float() as value, list() as values):
            return RunDone(value, {key: _fetched_value(blob) for key, blob in values})
        case wire.Failed(_, "message" | "ended" as kind, _, message, trace):
            return MessageFailed(message, trace, ended=kind == "ended")
        case wire.Failed(_, kind, peer, message, trace, peers, error):
            return RunFailure(kind, peer, message, trace, tuple(peers), error)  # type: ignore[arg-type]
        case wire.Fetched(_, payload):
            return _fetched_value(payload)
    raise ValueError(f"not an answer: {type(item).__name__}")


def listen_on() -> tuple[Literal["ipc", "tcp"], str]:
    """Where a channel of this process listens: IPC when the Ray cluster is this one machine, else
    TCP on this node's address (its peers may be on other nodes)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return "ipc", "127.0.0.1"
    return "tcp", ray.util.get_node_ip_address() or socket.gethostbyname(socket.gethostname())


class ChannelLink:
    """The controller's end: one signed ZeroMQ server every host connects to."""

    name = "channel"

    def __init__(self) -> None:
        transport, ip = listen_on()
        self._key = secrets.token_bytes(32)
        self._server = wire.Server(
            self._key,
            transport=transport,
            host=ip,
            on_message=self._received,
            send_timeout=_SEND_TIMEOUT_S,
            heartbeat=1.0,
        )
        self._lock = threading.Lock()
        self._identity: dict[int, bytes] = {}  # host -> its current actor's identity
        self._incarnation = 0
        # (identity, seq) -> the future of its answer; answers that came before their future
        self._owed: dict[tuple[bytes, int], concurrent.futures.Future] = {}
        self._early: dict[tuple[bytes, int], Any] = {}
        self._gone: set[bytes] = set()  # identities of hosts lost or replaced
        self.messages = 0
        self.batches = 0
        self.broadcasts = 0  # batches sent to several hosts in one send
        # While a thread has the link corked (cork(), uncork()), its messages to single hosts wait
        # in call order and then go one batch per host: one send, not one per caller's call.
        self._corker: int | None = None
        self._corked: list[tuple[int, bytes, list[wire.Item], list[concurrent.futures.Future]]] = []
        self._cork_lock = threading.Lock()

    @property
    def address(self) -> wire.Address:
        return self._server.address

    def attach(self, host: int, actor: Any, group: int | None = None) -> Endpoint:
        with self._lock:
            self._incarnation += 1
            identity = f"host-{host}-{self._incarnation}".encode()
            old = self._identity.get(host)
            self._identity[host] = identity
        if old is not None:
            self._fail(old, HostGone(host, "replaced by a new host"))
        groups = () if group is None else (_group(group),)
        return Endpoint(self._server.address, self._key, identity, groups)

    def send(self, host: int, seq: int, kind: str, args: tuple) -> concurrent.futures.Future:
        return self.send_many(host, [(seq, kind, args)])[0]

    def send_many(self, host: int, messages: list[tuple[int, str, tuple]]) -> list[concurrent.futures.Future]:
        """Sends host ``host`` its next messages as one batch; the futures of their answers."""
        return self._send_items(host, [encode(kind, args) for _seq, kind, args in messages])

    def cork(self) -> None:
        """Holds this thread's messages to single hosts until :meth:`uncork` (a controller
        service's turn of its loop): what it sends a host in the turn goes in one batch. A send
        of another thread, and a broadcast, first sends what is held: the order of sends stays
        the order of the calls."""
        self._corker = threading.get_ident()

    def uncork(self) -> None:
        """Sends what :meth:`cork` held, one batch per host, and stops holding."""
        self._corker = None
        self._send_corked()

    def _send_corked(self) -> None:
        with self._cork_lock:
            corked, self._corked = self._corked, []
            by_identity: dict[bytes, tuple[int, list[wire.Item], list[concurrent.futures.Future]]] = {}
            for host, identity, items, futures in corked:
                _host, held, owed = by_identity.setdefault(identity, (host, [], []))
                held.extend(items)
                owed.extend(futures)
            for identity, (host, items, futures) in by_identity.items():
                try:
                    self._send_now(host, identity, items, futures)
                except Exception as exc:  # each host's held messages fail on their own, none is left owed
                    for future in futures:
                        if not future.done():
                            future.set_exception(HostGone(host, f"its messages could not be sent: {exc}"))

    def _send_items(self, host: int, items: list[wire.Item]) -> list[concurrent.futures.Future]:
        """:meth:`send_many` of messages already encoded."""
        identity = self._identity[host]
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in items]
        if identity in self._gone:
            for future in futures:
                future.set_exception(HostGone(host, "it was lost"))
            return futures
        if self._corker == threading.get_ident():
            with self._cork_lock:
                self._corked.append((host, identity, items, futures))
            return futures
        if self._corked:
            self._send_corked()
        self._send_now(host, identity, items, futures)
        return futures

    def _send_now(
        self, host: int, identity: bytes, items: list[wire.Item], futures: list[concurrent.futures.Future]
    ) -> None:
        if identity in self._gone:
            for future in futures:
                future.set_exception(HostGone(host, "it was lost"))
            return
        try:
            first = self._server.send_many(identity, items, timeout=self._send_timeout([identity]))
        except wire.ChannelError as exc:
            for future in futures:
                future.set_exception(HostGone(host, f"its channel refused the message: {exc}"))
            return
        self.messages += len(items)
        self.batches += 1
        self._owe(host, identity, first, futures)

    def send_group(
        self, group: int, messages: dict[int, list[tuple[int, str, tuple]]]
    ) -> dict[int, list[concurrent.futures.Future]]:
        """Sends hosts of island ``group`` their next messages in one broadcast; their answers' futures.

        A host lost gets failed futures; parts with large blobs go host by host
        (:meth:`send_many`), as does a group of one host.
        """
        if len(messages) == 1:
            ((host, batch),) = messages.items()
            return {host: self.send_many(host, batch)}
        out: dict[int, list[concurrent.futures.Future]] = {}
        parts: dict[int, list[wire.Item]] = {}
        seen: list[tuple[list[tuple[str, tuple]], list[wire.Item]]] = []  # distinct batches, encoded
        for host, batch in messages.items():
            items = _encoded(batch, seen)
            if self._identity[host] in self._gone or _blob_bytes(items) > _FANOUT_BYTES:
                out[host] = self._send_items(host, items)  # (encoded once: a plan is pickled once)
            else:
                parts[host] = items
        if len(parts) == 1:
            ((host, items),) = parts.items()
            out[host] = self._send_items(host, items)
            return {host: out[host] for host in messages}
        if parts:
            self._broadcast(group, parts, out)
        return {host: out[host] for host in messages}

    def _broadcast(self, group: int, parts: dict[int, list[wire.Item]], out: dict) -> None:
        if self._corked:  # sent before: the order of sends is the order of the calls
            self._send_corked()
        identities = {host: self._identity[host] for host in parts}
        for host, items in parts.items():
            out[host] = [concurrent.futures.Future() for _ in items]
        try:
            firsts = self._server.broadcast(
                _group(group),
                {identities[host]: items for host, items in parts.items()},
                timeout=self._send_timeout(list(identities.values())),
            )
        except wire.ChannelError as exc:
            for host in parts:
                for future in out[host]:
                    future.set_exception(HostGone(host, f"its channel refused the message: {exc}"))
            return
        self.messages += sum(len(items) for items in parts.values())
        self.batches += 1
        self.broadcasts += 1
        for host, identity in identities.items():
            self._owe(host, identity, firsts[identity], out[host])

    def _send_timeout(self, identities: list[bytes]) -> float:
        """A host not heard from yet may still be connecting: it gets longer."""
        heard = all(self._server.last_heard(identity) is not None for identity in identities)
        return _CONNECTED_SEND_TIMEOUT_S if heard else _SEND_TIMEOUT_S

    def _owe(self, host: int, identity: bytes, first: int, futures: list[concurrent.futures.Future]) -> None:
        """Files the futures of messages ``first, first + 1, ...`` sent to ``identity``."""
        with self._lock:
            gone = identity in self._gone  # lost while this was being sent: nothing will answer
            for index, future in enumerate(futures):
                key = (identity, first + index)
                if key in self._early:
                    _settle(future, self._early.pop(key))
                elif gone:
                    future.set_exception(HostGone(host, "it was lost"))
                else:
                    self._owed[key] = future

    def _received(self, received: wire.Received) -> None:
        """An answer from a host (the channel's receive thread)."""
        match received.body:
            case wire.Done(seq) | wire.Failed(seq) | wire.Fetched(seq):
                key = (received.peer, seq)
            case _:
                return  # hosts send nothing else
        try:
            value: Any = answer_value(received.body)
        except Exception as exc:  # an answer that does not decode fails its message
            value = MessageFailed(f"host {received.peer!r} sent an answer that did not decode: {exc}")
        with self._lock:
            future = self._owed.pop(key, None)
            if future is None:
                self._early[key] = value
                return
        _settle(future, value)

    def host_lost(self, host: int, why: str) -> None:
        identity = self._identity.get(host)
        if identity is not None:
            self._fail(identity, HostGone(host, why))

    def silent_for(self, host: int) -> float | None:
        """Seconds since the host was last heard from: a host's channel beats every second while
        it has nothing else to say, from a thread of its own, so a long silence is a hung host."""
        identity = self._identity.get(host)
        heard = None if identity is None else self._server.last_heard(identity)
        return None if heard is None else time.monotonic() - heard

    def _fail(self, identity: bytes, exc: BaseException) -> None:
        with self._lock:
            self._gone.add(identity)
            owed = [key for key in self._owed if key[0] == identity]
            futures = [self._owed.pop(key) for key in owed]
            for key in [key for key in self._early if key[0] == identity]:
                del self._early[key]
        self._server.forget(identity)
        for future in futures:
            if not future.done():
                future.set_exception(exc)

    def stats(self) -> dict:
        return {
            "transport": self.name,
            "messages": self.messages,
            "batches": self.batches,
            "broadcasts": self.broadcasts,
            "refused": self._server.refused,
            "owed": len(self._owed),
        }

    def close(self) -> None:
        with self._cork_lock:
            corked, self._corked = self._corked, []
        with self._lock:
            futures = list(self._owed.values()) + [f for *_rest, held in corked for f in held]
            self._owed.clear()
        for future in futures:
            if not future.done():
                future.set_exception(HostGone(-1, "the cluster closed"))
        self._server.close()


def _settle(future: concurrent.futures.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


class HostEnd:
    """A host's end of the controller's channel: messages in arrival order, answers batched back.

    A fetch that names a client (``wire.Reply``) is answered to that client's
    own channel, straight from here (:meth:`reply`): the controller service
    that sent it gets only ``None`` once the value went.
    """

    def __init__(self, endpoint: Endpoint, deliver: Any):
        self._deliver = deliver
        self._peer = endpoint.peer(self._received, _SEND_TIMEOUT_S)
        # Channels to the clients fetched values went to, the most recently used last.
        self._clients: collections.OrderedDict[tuple[str, str, bytes], wire.Peer] = collections.OrderedDict()
        self._clients_lock = threading.Lock()

    def _received(self, received: wire.Received) -> None:
        try:
            kind, args = decode(received.body)
        except Exception as exc:  # the message fails; the host keeps serving
            self.answer(
                received.seq, MessageFailed(f"the message did not decode: {type(exc).__name__}: {exc}")
            )
            return
        self._deliver(kind, args, received.seq)

    def answer(self, seq: int, value: Any) -> None:
        try:
            message = answer_message(seq, value)
        except Exception as exc:  # an answer that cannot be pickled still answers
            message = wire.Failed(seq, "message", None, f"the answer could not be sent: {exc}")
        self._peer.post(message)

    def reply(self, reply: wire.Reply, value: Any) -> bool:
        """Sends a fetched value straight to the client ``reply`` names; False if its channel
        took nothing within a short time (a slow or gone client: the caller answers its sender)."""
        where = (reply.up, reply.down, reply.key)
        with self._clients_lock:
            peer = self._clients.pop(where, None)
            if peer is None:
                peer = wire.Peer(wire.Address(reply.up, reply.down), reply.key, heartbeat=None)
            self._clients[where] = peer
            evicted = []
            while len(self._clients) > _CLIENTS_KEPT:
                evicted.append(self._clients.popitem(last=False)[1])
        for old in evicted:
            old.close()
        try:
            message = answer_message(reply.ticket, value)
        except Exception as exc:  # an answer that cannot be pickled still answers
            message = wire.Failed(reply.ticket, "message", None, f"the answer could not be sent: {exc}")
        try:
            peer.send(message, timeout=_REPLY_TIMEOUT_S)
        except wire.ChannelError:
            return False
        return True

    def close(self) -> None:
        self._peer.close()
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), collections.OrderedDict()
        for peer in clients:
            peer.close()
