"""Authenticated ZeroMQ channels between a server (controller, service) and its peers.

A :class:`Server` binds a ROUTER (``Address.up``: peers send there) and one
XPUB (``Address.down``: peers receive from there); a :class:`Peer` connects a
DEALER to the first, under its routing identity, and a SUB to the second,
subscribed to its own topic and to each of its groups' (an island's). Each
socket has one owner: the receive socket belongs to the channel's receive
thread, the send socket to whichever thread holds the send lock (which also
reads the XPUB's subscriptions). So a send runs in the caller's thread with no
hand-off to an I/O thread (whose wake-up would wait for the GIL), and no
socket is ever touched by two threads at once.

Fan-out: :meth:`Server.broadcast` sends a group's peers their own messages as
ONE signed send on the group's topic (a :class:`Fanout`); ZeroMQ's I/O thread
copies it to every subscriber, so the sender's cost hardly grows with the
peers. One XPUB socket means one ordered pipe per peer: unicast and broadcast
messages reach a peer in the order they were sent, numbered in one sequence
per peer. ``XPUB_NODROP``: a full pipe makes the send wait (then
:class:`ChannelFull`), never drops. Nothing is sent to a peer, alone or in a
group, before its subscription is seen (a peer subscribes its groups first,
its own topic last, so its own topic's arrival says it hears them all).

Frames of one message: ``[route, signature, header, *buffers]``; ``route`` is
the sender's identity (peer -> server, added by the ROUTER) or the topic
(server -> peer). ``signature`` is ``<count:u16><seq:u64><hmac:32>``: the
HMAC-SHA256, under the service key, of a direction byte, the peer's identity
(up) or the topic (down), ``count`` and ``seq``, and every later frame with
its length. A receiver refuses, counts by reason and otherwise ignores what is
truncated, forged, replayed (``seq``, or a fan-out part's, not above the last
accepted from that peer or topic) or malformed; the receive loop never raises.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Self, cast

import msgspec
import zmq

from pathways_jax._src.core.errors import PathwaysError
from pathways_jax._src.wire.messages import Batch, Codec, Heartbeat, Item, Message

__all__ = ["SERVER", "Address", "ChannelClosed", "ChannelError", "ChannelFull", "Peer", "Received", "Server"]

_log = logging.getLogger(__name__)

# The name a Peer gives its server in Received.peer and silent_peers().
SERVER = b""
_PREFIX = struct.Struct("<HQ")
_MAC_SIZE = hashlib.sha256().digest_size
_SIGNATURE_SIZE = _PREFIX.size + _MAC_SIZE
_LENGTH = struct.Struct("<Q")
_NAME = struct.Struct("<H")
_PEER_TOPIC = b"p"  # sorts after _GROUP_TOPIC: a SUB sends its subscriptions in byte order
_GROUP_TOPIC = b"g"
_UP = b"u"  # peer -> server
_DOWN = b"d"  # server -> peer
_REASONS = ("truncated", "forged", "replayed", "malformed")
# Plain ints: pyzmq's enum flags cost a microsecond or more an operation, on every frame.
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


class _Socket(zmq.Socket):
    """A ZeroMQ socket whose ``send_multipart`` sends its frames as they are, with plain int flags.

    pyzmq's checks each frame's type and combines its enum flags per frame: five
    times the cost of the send itself for a message of a few frames. A
    message's frames still go all or none (ZeroMQ's own guarantee).
    """

    def send_multipart(
        self, msg_parts: Sequence[Any], flags: int = 0, copy: bool = True, track: bool = False, **kwargs: Any
    ) -> zmq.MessageTracker | None:
        if track or kwargs:
            return super().send_multipart(msg_parts, flags, copy, track, **kwargs)
        flags = int(flags)
        more = flags | _SNDMORE
        last = len(msg_parts) - 1
        for frame in msg_parts[:last]:
            self.send(frame, more, copy=copy)
        return self.send(msg_parts[last], flags, copy=copy)


class _Context(zmq.Context[_Socket]):
    _socket_class = _Socket


class ChannelError(PathwaysError, RuntimeError):
    """Base class of the errors a wire channel raises."""


class ChannelFull(ChannelError, TimeoutError):
    """A send did not complete within its timeout: the peer is slow, gone, or not yet connected.

    Nothing of the message was sent. Retry later, or treat the peer as lost
    when ``silent_peers`` names it too.
    """


class ChannelClosed(ChannelError):
    """The channel was closed (``close()``): it sends and receives nothing more."""


@dataclasses.dataclass(frozen=True, slots=True)
class Address:
    """Where a :class:`Server` listens: pass it (it pickles) to the processes that connect.

    Attributes:
        up: the endpoint peers send to.
        down: the endpoint peers receive from.
    """

    up: str
    down: str


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
    """One accepted message.

    Attributes:
        peer: the sender's identity (a Peer sees its server as ``SERVER``, ``b""``).
        seq: the message's number on its channel (item ``i`` of a batch is ``seq + i``).
        body: the message (a batch arrives as its items, one ``Received`` each).
    """

    peer: bytes
    seq: int
    body: Item


Handler = Callable[[Received], None]


class _Channel:
    """What a server and a peer share: signing, sending, the receive thread, liveness."""

    _router: bool
    _out: bytes
    _in: bytes

    def __init__(
        self,
        key: bytes,
        *,
        on_message: Handler | None,
        queue_size: int,
        hwm: int,
        send_timeout: float,
        heartbeat: float | None,
        max_pending: int,
    ) -> None:
        if not isinstance(key, bytes | bytearray) or len(key) < 16:
            raise ValueError(
                f"a channel key is at least 16 bytes (secrets.token_bytes(32)); got {type(key).__name__}"
                f" of length {len(key) if isinstance(key, bytes | bytearray) else '-'}"
            )
        if hwm < 1 or queue_size < 1 or max_pending < 1:
            raise ValueError(
                f"hwm, queue_size and max_pending must be >= 1; got {hwm}, {queue_size}, {max_pending}"
            )
        self._mac = hmac.new(bytes(key), digestmod=hashlib.sha256)
        self._keyed: dict[tuple[bytes, bytes], Any] = {}
        self._on_message = on_message
        # SimpleQueue (C) costs ~10 µs less a hand-off than Queue; _deliver keeps it bounded.
        self._queue: queue.SimpleQueue[Received] = queue.SimpleQueue()
        self._queue_size = queue_size
        self._hwm = hwm
        self._send_timeout = send_timeout
        self._heartbeat = heartbeat
        self._max_pending = max_pending
        self._context = _Context(io_threads=1)
        self._send_lock = threading.Lock()
        self._send_codec = Codec()
        self._recv_codec = Codec()
        self._next_seq: dict[bytes, int] = {}
        self._last_seq: dict[bytes, int] = {}
        self._last_heard: dict[bytes, float] = {}
        self._last_sent: dict[bytes, float] = {}
        self._pending: list[tuple[bytes, Item]] = []
        self._pending_lock = threading.Lock()
        self._refused: collections.Counter[str] = collections.Counter()
        self.sent = 0
        """Messages sent (a batch counts once)."""
        self.received = 0
        """Messages accepted (a batch counts once)."""
        self.handler_errors = 0
        """Exceptions raised by ``on_message`` (logged, then the loop goes on)."""
        self.dropped = 0
        """Posted messages not sent within their timeout (logged)."""
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ipc_dir: str | None = None

    def _socket(self, kind: int, identity: bytes | None = None) -> zmq.Socket:
        sock = self._context.socket(kind)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_NODROP, 1)  # a full pipe: EAGAIN, then ChannelFull
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if kind == zmq.DEALER:
            # Queue only to a live connection: a send to a server not (or no longer) there
            # gives ChannelFull in time, not a message kept for a reconnection that may not come.
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # The first connection under a name keeps it while it lives: a newcomer under a peer's
            # name (no secret: the topic of what the server sends it) is turned away by ZeroMQ, where
            # a hand-over gave it the route and the peer's frames, signed or not, went nowhere.
            sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        return sock

    def _start(self, send_sock: zmq.Socket, recv_sock: zmq.Socket, name: str) -> None:
        self._send_sock = send_sock
        self._recv_sock = recv_sock
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_out = self._context.socket(zmq.PAIR)
        endpoint = f"inproc://wake-{id(self)}"
        self._wake_in.bind(endpoint)
        self._wake_out.connect(endpoint)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- counters and liveness ------------------------------------------------------------

    @property
    def refused(self) -> dict[str, int]:
        """Frames refused, by reason: ``truncated``, ``forged``, ``replayed``, ``malformed``."""
        return dict(self._refused)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def silent_peers(self, timeout: float) -> list[bytes]:
        """The peers heard from (a Peer: its server, from its start) but not in the last ``timeout`` s."""
        limit = time.monotonic() - timeout
        return sorted(peer for peer, heard in list(self._last_heard.items()) if heard < limit)

    def last_heard(self, peer: bytes) -> float | None:
        """``time.monotonic()`` when ``peer`` was last heard from, or None if never."""
        return self._last_heard.get(peer)

    # -- receiving --------------------------------------------------------------------------

    def recv(self, timeout: float | None = None) -> Received | None:
        """The next message, or None after ``timeout`` seconds (channels made without ``on_message``).

        Raises:
            ChannelClosed: the channel is closed and nothing is left to read.
        """
        if self._on_message is not None:
            raise RuntimeError("this channel delivers to its on_message handler; recv() gets nothing")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.05 if deadline is None else min(0.05, max(0.0, deadline - time.monotonic()))
            try:
                return self._queue.get(timeout=wait)
            except queue.Empty:
                if self._closed:
                    raise ChannelClosed("the channel is closed") from None
                if deadline is not None and time.monotonic() >= deadline:
                    return None

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._recv_sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        tick = None if self._heartbeat is None else max(1, int(self._heartbeat * 1000 / 2))
        # Who is due a heartbeat is looked at a few times an interval, not after every message:
        # after a message this thread goes straight back to its poll, giving the GIL to the
        # thread the message woke (a caller waiting for its answer).
        look = 0.0
        while not self._closed:
            try:
                events = dict(poller.poll(tick))
            except zmq.ZMQError:
                break
            if self._wake_in in events:
                break
            if self._heartbeat is not None and time.monotonic() >= look:
                self._beat()
                look = time.monotonic() + self._heartbeat / 4
            if self._recv_sock in events:
                for _ in range(256):
                    try:
                        parts = self._read()
                    except zmq.Again:
                        break
                    except zmq.ZMQError:
                        return
                    self._accept(parts)
                    if self._closed:
                        return
                    try:
                        if not _waiting(self._recv_sock):
                            break
                    except zmq.ZMQError:
                        return

    def _read(self) -> list[Any]:
        """One message's frames: the small leading ones as bytes, buffers as zero-copy frames."""
        sock = self._recv_sock
        parts: list[Any] = [sock.recv(_NOBLOCK)]
        small = 3  # route, signature, header
        while sock.getsockopt(_RCVMORE):
            parts.append(sock.recv(copy=len(parts) < small))
        return parts

    def _accept(self, parts: list[Any]) -> None:
        """Checks one message's frames; delivers it, or counts why it was refused. Never raises."""
        try:
            if not parts:
                self._refused["truncated"] += 1
                return
            route = bytes(parts[0])
            parts = parts[1:]
            peer = self._sender(route)
            if len(parts) < 2:
                self._refused["truncated"] += 1
                return
            signature = memoryview(parts[0])
            if len(signature) != _SIGNATURE_SIZE:
                self._refused["malformed"] += 1
                return
            count, seq = _PREFIX.unpack_from(signature)
            if count != len(parts):
                self._refused["truncated" if count > len(parts) else "malformed"] += 1
                return
            frames = [memoryview(part) for part in parts[1:]]
            if peer is None:  # a topic this peer did not subscribe to
                self._refused["forged"] += 1
                return
            mac = self._sign(self._in, route, signature[: _PREFIX.size], frames)
            if not hmac.compare_digest(mac, signature[_PREFIX.size :]):
                self._refused["forged"] += 1
                return
            group = not self._router and route.startswith(_GROUP_TOPIC)
            outer = route if group else peer  # a group's frames are numbered per topic
            if seq <= self._last_seq.get(outer, 0):
                self._refused["replayed"] += 1
                return
            try:
                if group:
                    self._last_seq[route] = seq
                    part = self._recv_codec.decode_part(frames[0], frames[1:], self._own_name())
                    if part is None:  # a broadcast to others of the group
                        return
                    seq, body = part.seq, part.body
                    if seq <= self._last_seq.get(peer, 0):
                        self._refused["replayed"] += 1
                        return
                else:
                    body = self._recv_codec.decode(frames[0], frames[1:])
            except (msgspec.DecodeError, ValueError, TypeError):
                self._last_seq[outer] = seq
                self._refused["malformed"] += 1
                return
            items: list[Item] = body.items if isinstance(body, Batch) else [body]
            self._last_seq[peer] = seq + max(0, len(items) - 1)
            self._last_heard[peer] = time.monotonic()
            self.received += 1
        except Exception:  # a frame must never stop the loop
            _log.exception("wire: refusing a frame that could not be checked")
            self._refused["malformed"] += 1
            return
        for index, item in enumerate(items):
            match item:
                case Heartbeat():
                    continue
                case _:
                    self._deliver(Received(peer, seq + index, item))

    def _deliver(self, received: Received) -> None:
        if self._on_message is not None:
            try:
                self._on_message(received)
            except Exception:  # the handler's bug must not stop the channel
                self.handler_errors += 1
                _log.exception("wire: on_message raised on %r", received)
            return
        # Full: stop reading (the socket fills to its HWM and senders get ChannelFull) until
        # recv() makes room. Rare, so a short sleep is cheaper than a condition per message.
        while self._queue.qsize() >= self._queue_size:
            if self._closed:
                return
            time.sleep(0.001)
        self._queue.put(received)

    # -- sending ----------------------------------------------------------------------------

    def _sign(self, direction: bytes, peer: bytes, prefix: Any, frames: Iterable[Any]) -> bytes:
        keyed = self._keyed.get((direction, peer))
        if keyed is None:
            keyed = self._mac.copy()
            keyed.update(direction + _LENGTH.pack(len(peer)) + peer)
            if len(self._keyed) < 4096:  # a cache, bounded
                self._keyed[(direction, peer)] = keyed
        mac = keyed.copy()
        mac.update(prefix)
        for frame in frames:
            mac.update(_LENGTH.pack(len(frame)))
            mac.update(frame)
        return mac.digest()

    def _timeout(self, timeout: float | None) -> float:
        return self._send_timeout if timeout is None else timeout

    def _acquire(self, timeout: float) -> None:
        if self._closed:
            raise ChannelClosed("the channel is closed: it sends nothing more")
        if not self._send_lock.acquire(timeout=max(timeout, 0.0)):
            raise ChannelFull(f"another send held the channel for the whole timeout ({timeout} s)")
        if self._closed:
            self._send_lock.release()
            raise ChannelClosed("the channel is closed: it sends nothing more")

    def _route(self, to: bytes) -> bytes:
        """The first frame of a message to ``to``, which its signature names too."""
        raise NotImplementedError

    def _send_locked(self, to: bytes, body: Message, deadline: float) -> int:
        """Signs and sends ``body`` to ``to``; the send lock is held. Returns its seq."""
        seq = self._next_seq.get(to, 1)
        header, buffers = self._send_codec.encode(body)
        self._put(self._route(to), seq, [header, *buffers], deadline, [to])
        items = len(body.items) if isinstance(body, Batch) else 1
        self._next_seq[to] = seq + max(items, 1)
        self._last_sent[to] = time.monotonic()
        self.sent += 1
        return seq

    def _put(self, route: bytes, seq: int, frames: list[Any], deadline: float, to: list[bytes]) -> None:
        """Signs ``frames`` as message ``seq`` on ``route`` and sends them, waiting for room and
        for the receivers ``to`` until ``deadline``; the send lock is held."""
        prefix = _PREFIX.pack(len(frames) + 1, seq)
        signature = prefix + self._sign(self._out, route, prefix, frames)
        parts: list[Any] = [route, signature, *frames] if self._router else [signature, *frames]
        delay = 20e-6
        while True:
            try:
                absent = self._absent(to)
                if not absent:
                    # Copied into ZeroMQ's own memory: a zero-copy frame's Python buffer can be
                    # freed under ZeroMQ's I/O thread at interpreter exit (libzmq then aborts the
                    # process: "Bad address (src/tcp.cpp)"), with a message to a host still queued.
                    self._send_sock.send_multipart(parts, _NOBLOCK, copy=True)
                    return
                why = f"{_name(absent[0])} is not connected (yet, or any more)"
            except zmq.Again:
                why = "a queue is full (a slow or stopped reader)"
            except zmq.ZMQError as error:
                if error.errno != zmq.EHOSTUNREACH:
                    raise ChannelClosed(f"the socket failed: {error}") from error
                why = "it is not connected (yet, or any more)"
            if time.monotonic() >= deadline:
                names = _name(to[0]) if len(to) == 1 else f"{len(to)} peers"
                raise ChannelFull(f"could not send to {names} before the timeout: {why}")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def _absent(self, to: list[bytes]) -> list[bytes]:
        """Which of ``to`` cannot be sent to yet (a server: no subscription seen)."""
        return []

    def _sender(self, route: bytes) -> bytes | None:
        """Who sent a message that came on ``route`` (None: nobody this channel hears)."""
        raise NotImplementedError

    def _own_name(self) -> bytes:
        raise NotImplementedError

    def _send(self, to: bytes, body: Message, timeout: float | None) -> int:
        limit = self._timeout(timeout)
        deadline = time.monotonic() + limit
        self._acquire(limit)
        try:
            self._flush_locked(deadline)
            return self._send_locked(to, body, deadline)
        finally:
            self._send_lock.release()
            self._flush_again()

    def _send_many(self, to: bytes, bodies: list[Item], timeout: float | None) -> int:
        if not bodies:
            raise ValueError("send_many needs at least one message")
        return self._send(to, bodies[0] if len(bodies) == 1 else Batch(bodies), timeout)

    def _post(self, to: bytes, body: Item, timeout: float | None) -> None:
        with self._pending_lock:
            full = len(self._pending) >= self._max_pending
            if not full:
                self._pending.append((to, body))
        if full:  # bounded: wait for the sender in progress, then send in order
            self._send(to, body, timeout)
            return
        if self._send_lock.acquire(blocking=False):
            try:
                self._flush_locked(time.monotonic() + self._timeout(timeout))
            finally:
                self._send_lock.release()
                self._flush_again()

    def _flush_locked(self, deadline: float) -> None:
        """Sends what ``post`` queued, one batch per peer; the send lock is held. Never raises:
        what cannot be sent by ``deadline`` is dropped, counted in ``dropped`` and logged."""
        with self._pending_lock:
            if not self._pending:
                return
            pending, self._pending = self._pending, []
        by_peer: dict[bytes, list[Item]] = {}
        for to, body in pending:
            by_peer.setdefault(to, []).append(body)
        for to, bodies in by_peer.items():
            try:
                self._send_locked(to, bodies[0] if len(bodies) == 1 else Batch(bodies), deadline)
            except (ChannelFull, ChannelClosed) as error:
                self.dropped += len(bodies)
                _log.warning("wire: dropped %d posted message(s) to %s: %s", len(bodies), _name(to), error)

    def _flush_again(self) -> None:
        """After releasing the send lock: sends what was posted while it was held."""
        while self._pending and not self._closed:
            if not self._send_lock.acquire(blocking=False):
                return  # the new holder flushes
            try:
                self._flush_locked(time.monotonic() + self._send_timeout)
            finally:
                self._send_lock.release()

    def _targets(self) -> list[bytes]:
        raise NotImplementedError

    def _beat(self) -> None:
        interval = self._heartbeat
        if interval is None:
            return
        now = time.monotonic()
        due = [to for to in self._targets() if now - self._last_sent.setdefault(to, now) >= interval]
        if not due or not self._send_lock.acquire(blocking=False):
            return
        try:
            for to in due:
                with contextlib.suppress(ChannelFull, ChannelClosed):
                    self._send_locked(to, Heartbeat(sent_at=time.time()), now)
        finally:
            self._send_lock.release()
            self._flush_again()  # what was posted while the heartbeat held the lock

    # -- closing ----------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Stops the receive thread, closes the sockets, removes IPC files. Idempotent.

        Args:
            timeout: how long to wait for the receive thread (a handler still running).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        thread = self._thread
        if thread is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._wake_out.send(b"", zmq.NOBLOCK)
            if thread is not threading.current_thread():
                thread.join(timeout)
        stuck = thread is not None and thread.is_alive()
        locked = self._send_lock.acquire(timeout=timeout)
        try:
            if thread is not None:
                self._send_sock.close(linger=0)
                self._wake_out.close(linger=0)
                if not stuck:
                    self._recv_sock.close(linger=0)
                    self._wake_in.close(linger=0)
        finally:
            if locked:
                self._send_lock.release()
        if stuck:
            _log.warning(
                "wire: the receive thread did not stop within %s s; its socket is left open", timeout
            )
        else:
            self._context.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _waiting(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock``: asked, not tried (a read that finds none raises, a few µs)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


def _topic(kind: bytes, name: bytes) -> bytes:
    """A subscription topic: length-prefixed, so that no name's topic is a prefix of another's."""
    return kind + _NAME.pack(len(name)) + name


def _name(peer: bytes) -> str:
    return "the server" if peer == SERVER else f"peer {peer!r}"


# The longest path a Unix socket may have (sockaddr_un's sun_path; 107 on Linux, 103 on macOS).
_IPC_PATH_MAX = int(getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 103)


def _ipc_dir() -> str | None:
    """A fresh folder for a server's socket files, their paths short enough for a Unix socket: in
    the temporary folder (TMPDIR), else in /tmp when TMPDIR is too deep (a job scheduler's
    per-job folder, a build sandbox); None when neither will do."""
    for base in (None, "/tmp"):
        try:
            path = tempfile.mkdtemp(prefix="pw-wire-", dir=base)
        except OSError:
            continue
        if len(os.path.join(path, "down")) <= _IPC_PATH_MAX:
            return path
        shutil.rmtree(path, ignore_errors=True)
    return None


class Server(_Channel):
    """The bound end: many :class:`Peer`\\ s connect, each named by its identity.

    Args:
        key: the per-service secret every frame is signed with (``secrets.token_bytes(32)``).
        transport: ``"ipc"`` (a socket file in a fresh temporary directory, one machine; in
            ``/tmp`` when TMPDIR is too deep for a socket's path, else loopback TCP) or ``"tcp"``.
        host: the interface a tcp server binds; loopback unless asked (``"0.0.0.0"``).
        on_message: called on the receive thread with every accepted message; when None,
            messages wait for :meth:`recv` in a queue of ``queue_size``.
        queue_size: bound of that queue; when full, the receive thread stops reading, the
            socket fills to ``hwm`` and senders get :class:`ChannelFull`.
        hwm: ZeroMQ's send and receive high-water marks (messages), per peer.
        send_timeout: the default seconds a send may wait before :class:`ChannelFull`.
        heartbeat: seconds of quiet after which a heartbeat is sent to each peer heard from
            (None: never).
        max_pending: bound of the messages :meth:`post` may queue behind a send in progress.

    Example:
        >>> import secrets
        >>> from pathways_jax._src.wire import Done, Fetch
        >>> key = secrets.token_bytes(32)
        >>> with Server(key) as server, Peer(server.address, key, identity=b"host-0") as host:
        ...     _ = host.send(Done(seq=0))  # hosts speak first: the server learns their names
        ...     hello = server.recv(timeout=5)
        ...     asked = server.send(hello.peer, Fetch(key=7))
        ...     got = host.recv(timeout=5)
        >>> got.body, got.seq == asked
        (Fetch(key=7, reply_to=None), True)
    """

    _router = True
    _out = _DOWN
    _in = _UP

    def __init__(
        self,
        key: bytes,
        *,
        transport: Literal["ipc", "tcp"] = "ipc",
        host: str = "127.0.0.1",
        on_message: Handler | None = None,
        queue_size: int = 10_000,
        hwm: int = 10_000,
        send_timeout: float = 5.0,
        heartbeat: float | None = 1.0,
        max_pending: int = 10_000,
    ) -> None:
        super().__init__(
            key,
            on_message=on_message,
            queue_size=queue_size,
            hwm=hwm,
            send_timeout=send_timeout,
            heartbeat=heartbeat,
            max_pending=max_pending,
        )
        up = self._socket(zmq.ROUTER)
        down = self._socket(zmq.XPUB)
        self._joined: set[bytes] = set()  # the topics subscribed to, as the XPUB told them
        try:
            match transport:
                case "ipc":
                    self._ipc_dir = _ipc_dir()
                    if self._ipc_dir is None:  # no folder short enough: loopback serves one machine too
                        up.bind("tcp://127.0.0.1:*")
                        down.bind("tcp://127.0.0.1:*")
                    else:
                        up.bind(f"ipc://{os.path.join(self._ipc_dir, 'up')}")
                        down.bind(f"ipc://{os.path.join(self._ipc_dir, 'down')}")
                case "tcp":
                    up.bind(f"tcp://{host}:*")
                    down.bind(f"tcp://{host}:*")
                case _:
                    raise ValueError(f"transport is 'ipc' or 'tcp'; got {transport!r}")
        except BaseException:
            up.close(0)
            down.close(0)
            self._context.term()
            if self._ipc_dir is not None:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            raise
        self.address = Address(
            up=up.getsockopt_string(zmq.LAST_ENDPOINT), down=down.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        """Where peers connect: pass it to them."""
        self._start(down, up, name="pw-wire-server")

    def peers(self) -> list[bytes]:
        """The identities heard from (and not forgotten)."""
        return sorted(self._last_heard)

    def broadcast(
        self, group: bytes, parts: dict[bytes, list[Item]], *, timeout: float | None = None
    ) -> dict[bytes, int]:
        """Sends each peer of ``parts`` its own messages, all in ONE send to the peers of ``group``.

        Each peer takes only its part, a :class:`Batch` when several, numbered in
        its own sequence (as :meth:`send_many`): it reaches the peer in the order
        sent among that peer's unicast messages. ZeroMQ's I/O thread copies the
        frame to every subscriber of ``group``; the caller signs and sends once.
        Every peer named must have joined ``group`` (``Peer(groups=...)``).

        Returns:
            Each peer's first seq.

        Raises:
            ChannelFull: a peer named had not subscribed, or a pipe stayed full, until
                ``timeout``: nothing was sent to anyone.
            ChannelClosed: the channel is closed.
        """
        if not parts or not all(parts.values()):
            raise ValueError("broadcast needs at least one message for each peer it names")
        limit = self._timeout(timeout)
        deadline = time.monotonic() + limit
        self._acquire(limit)
        try:
            self._flush_locked(deadline)
            seqs = {to: self._next_seq.get(to, 1) for to in parts}
            batches: dict[tuple[int, ...], Message] = {}  # peers given the same items share one body
            bodies: dict[bytes, tuple[int, Message]] = {}
            for to, items in parts.items():
                body = (
                    items[0] if len(items) == 1 else batches.setdefault(tuple(map(id, items)), Batch(items))
                )
                bodies[to] = (seqs[to], body)
            header, buffers = self._send_codec.encode_fanout(bodies)
            topic = _topic(_GROUP_TOPIC, group)
            seq = self._next_seq.get(topic, 1)
            self._put(topic, seq, [header, *buffers], deadline, list(parts))
            self._next_seq[topic] = seq + 1
            now = time.monotonic()
            for to, items in parts.items():
                self._next_seq[to] = seqs[to] + len(items)
                self._last_sent[to] = now
            self.sent += 1
            return seqs
        finally:
            self._send_lock.release()
            self._flush_again()

    def _route(self, to: bytes) -> bytes:
        return _topic(_PEER_TOPIC, to)

    def _absent(self, to: list[bytes]) -> list[bytes]:
        self._read_subscriptions()
        return [peer for peer in to if _topic(_PEER_TOPIC, peer) not in self._joined]

    def _read_subscriptions(self) -> None:
        """What the XPUB says of its subscribers (``\\x01topic`` / ``\\x00topic``); the send lock is held."""
        sock = self._send_sock
        while _waiting(sock):  # (every send of the server comes here)
            try:
                event = sock.recv(_NOBLOCK)
            except zmq.Again:
                return
            if event[:1] == b"\x01":
                self._joined.add(event[1:])
            elif event[:1] == b"\x00":
                self._joined.discard(event[1:])

    def _sender(self, route: bytes) -> bytes | None:
        return route

    def forget(self, peer: bytes) -> None:
        """Drops what the server keeps about ``peer``, a peer gone for good (a live one would
        refuse what the server sends it next, numbered from 1 again)."""
        for table in (self._last_heard, self._last_seq, self._next_seq, self._last_sent):
            table.pop(peer, None)
        self._keyed.pop((_UP, peer), None)
        self._keyed.pop((_DOWN, peer), None)

    def send(self, to: bytes, body: Message, *, timeout: float | None = None) -> int:
        """Sends ``body`` to peer ``to`` now, after anything posted before it.

        Returns:
            The message's seq (a batch's first item's).

        Raises:
            ChannelFull: not sent within ``timeout`` (default: the channel's ``send_timeout``).
            ChannelClosed: the channel is closed.
        """
        return self._send(to, body, timeout)

    def send_many(self, to: bytes, bodies: list[Item], *, timeout: float | None = None) -> int:
        """Sends ``bodies`` to ``to`` as one :class:`Batch`; returns the first one's seq."""
        return self._send_many(to, bodies, timeout)

    def post(self, to: bytes, body: Item, *, timeout: float | None = None) -> None:
        """Sends ``body`` to ``to`` now when no send is in progress, else queues it: the sender in
        progress then sends everything queued for a peer as one :class:`Batch`, right after its
        own message. Posted messages that cannot be sent within ``timeout`` are dropped and
        counted in :attr:`dropped`. When ``max_pending`` are queued, waits as :meth:`send`."""
        self._post(to, body, timeout)

    def _targets(self) -> list[bytes]:
        return list(self._last_heard)


class Peer(_Channel):
    """The connecting end (a host or client process) of a :class:`Server`.

    Args:
        address: the server's :attr:`Server.address`.
        key: the server's key.
        identity: this peer's name at the server, unique per ``Peer`` (default: random).
        groups: the groups whose broadcasts this peer hears (:meth:`Server.broadcast`).
        others: as :class:`Server`'s.
    """

    _router = False
    _out = _UP
    _in = _DOWN

    def __init__(
        self,
        address: Address,
        key: bytes,
        *,
        identity: bytes | None = None,
        groups: Iterable[bytes] = (),
        on_message: Handler | None = None,
        queue_size: int = 10_000,
        hwm: int = 10_000,
        send_timeout: float = 5.0,
        heartbeat: float | None = 1.0,
        max_pending: int = 10_000,
    ) -> None:
        super().__init__(
            key,
            on_message=on_message,
            queue_size=queue_size,
            hwm=hwm,
            send_timeout=send_timeout,
            heartbeat=heartbeat,
            max_pending=max_pending,
        )
        self.identity = identity if identity is not None else b"peer-" + os.urandom(6).hex().encode()
        """This peer's name at the server."""
        if not self.identity:
            raise ValueError("a peer's identity is a non-empty byte string")
        up = self._socket(zmq.DEALER, self.identity)
        down = self._socket(zmq.SUB)
        own = _topic(_PEER_TOPIC, self.identity)
        self._topics = {own, *(_topic(_GROUP_TOPIC, group) for group in groups)}
        # Its groups first, its own topic last: the server, seeing that one, knows it hears all.
        for topic in sorted(self._topics - {own}):
            down.setsockopt(zmq.SUBSCRIBE, topic)
        down.setsockopt(zmq.SUBSCRIBE, own)
        up.connect(address.up)
        down.connect(address.down)
        self._last_heard[SERVER] = time.monotonic()
        self._start(up, down, name=f"pw-wire-peer-{self.identity.decode(errors='replace')}")

    def send(self, body: Message, *, timeout: float | None = None) -> int:
        """Sends ``body`` to the server now, after anything posted before it.

        Returns:
            The message's seq (a batch's first item's).

        Raises:
            ChannelFull: not sent within ``timeout`` (default: the channel's ``send_timeout``).
            ChannelClosed: the channel is closed.
        """
        return self._send(SERVER, body, timeout)

    def send_many(self, bodies: list[Item], *, timeout: float | None = None) -> int:
        """Sends ``bodies`` as one :class:`Batch`; returns the first one's seq."""
        return self._send_many(SERVER, bodies, timeout)

    def post(self, body: Item, *, timeout: float | None = None) -> None:
        """As :meth:`Server.post`, to the server."""
        self._post(SERVER, body, timeout)

    def _targets(self) -> list[bytes]:
        return [SERVER]

    def _route(self, to: bytes) -> bytes:
        return self.identity  # what the server's ROUTER puts in front, and checks the MAC with

    def _sender(self, route: bytes) -> bytes | None:
        return SERVER if route in self._topics else None

    def _own_name(self) -> bytes:
        return self.identity
