"""The typed wire messages of the control plane, and their encoding into ZeroMQ frames.

Every message is a frozen, tagged, array-like ``msgspec.Struct``; together they
form the :data:`Message` union, which a receiver dispatches with ``match``.
Opaque payloads (pickled plan parts, numpy buffers) are :class:`Blob`\\ s: a
blob of at least :data:`INLINE_LIMIT` bytes travels in a frame of its own,
referenced from the encoded struct by index, so a numpy array's buffer is
handed to ZeroMQ without a copy on the sender and read without a copy on the
receiver.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, TypeAlias

import msgspec
from msgspec.msgpack import Ext

__all__ = [
    "INLINE_LIMIT",
    "WIRE_VERSION",
    "Answered",
    "Batch",
    "Blob",
    "Codec",
    "Colocated",
    "Done",
    "Failed",
    "Fanout",
    "Fetch",
    "Fetched",
    "Forget",
    "Free",
    "Heartbeat",
    "Item",
    "Message",
    "Part",
    "Peers",
    "Feed",
    "Handle",
    "Register",
    "Reply",
    "Request",
    "Routed",
    "RunMeta",
    "Run",
    "Share",
    "Cancel",
    "Stash",
    "Store",
    "Load",
    "Submit",
]

# The format of these messages (and of what a controller service and its clients say when one
# joins): a client process joins a service only of the same format (and pathways_jax and jax
# versions). Raise it with any change a process of the other format would misread.
WIRE_VERSION = 1

# Blobs shorter than this are encoded inside the struct; longer ones get a frame of their own.
INLINE_LIMIT = 1024
_FRAME_EXT = 1
_INDEX = struct.Struct("<I")


class Blob:
    """An opaque payload: any C-contiguous buffer (bytes, memoryview, numpy array).

    Received blobs hold a read-only ``memoryview`` of the ZeroMQ frame (no copy):
    ``np.frombuffer(blob.view, dtype)`` rebuilds an array in place.

    Args:
        data: the buffer to carry. It must not change until the send returns.
    """

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data

    @property
    def view(self) -> memoryview:
        """The payload as a flat memoryview of bytes."""
        view = memoryview(self.data)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")

    def __bytes__(self) -> bytes:
        return bytes(self.view)

    def __len__(self) -> int:
        return self.view.nbytes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Blob) and self.view == other.view

    def __hash__(self) -> int:
        return hash(bytes(self.view))

    def __repr__(self) -> str:
        return f"Blob({len(self)} bytes)"


class Register(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Controller -> host: compile and keep plan ``plan`` (parts pickled by the caller)."""

    plan: int
    ops: Blob
    constants: Blob
    blobs: Blob
    x64: bool | None = None


# A value's key: its owner's own key, or (owner client, key) for a value another client shared.
Handle: TypeAlias = int | tuple[int, int]


class Feed(msgspec.Struct, frozen=True, array_like=True):
    """An input of a run: a kept value by its key (``value``), or a fed value (``data``, pickled).

    ``shared``: a kept value other clients of a service may read too (another's, or one its
    owner shared): a computation that consumes it (donation) consumes a copy.
    """

    slot: int
    value: Handle | None = None
    data: Blob | None = None
    shared: bool = False


class Run(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Controller -> host: run plan ``plan`` as run ``run_id``; value keys from ``base``."""

    plan: int
    run_id: int
    base: int
    feeds: list[Feed]
    keep: list[tuple[int, int]] = []
    frees: list[Handle] = []


class Colocated(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Controller -> host: a ``colocated_python`` call (``order``: a pickled ``ray_host.colocated``
    record) on its inputs ``feeds``, in the host's order of messages."""

    order: Blob
    feeds: list[Feed] = []


class Reply(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Where a fetched value goes straight to: a client's own channel (its :class:`Server`'s
    ``up`` and ``down`` endpoints and key), answered as message ``ticket`` there."""

    up: str
    down: str
    key: bytes
    ticket: int


class Fetch(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Ask for value ``key``; ``reply_to``: the client that gets it directly (None: the sender,
    which then gets the value; else the sender gets ``Done`` once the value went)."""

    key: Handle
    reply_to: Reply | None = None


class Free(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Drop the values ``keys``."""

    keys: list[Handle]


class Forget(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Drop plan ``plan`` and its compiled executables."""

    plan: int


class Share(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Let client ``reader`` use value ``key``."""

    key: int
    reader: str


class Cancel(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Client -> service: the runs of ``pw.client`` number ``client`` still queued at the service
    are cancelled (the client was closed); those already sent to the hosts complete."""

    client: int


class Stash(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Controller -> host: copy the values a checkpoint saves (``writes``: pickled
    ``ray_host.checkpoint.Write`` list), kept as save ``ticket`` until a :class:`Store`."""

    ticket: int
    writes: Blob
    ocdbt: bool


class Store(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Controller -> host: write save ``ticket``'s copies (answered once on storage), or drop them."""

    ticket: int
    write: bool = True


class Load(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Controller -> host: read values of a checkpoint onto this host's devices (``reads``: pickled
    ``ray_host.checkpoint.Read`` list, each kept under its key)."""

    reads: Blob


class Peers(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Controller -> host: the transfer server address of every host (the data plane's peers)."""

    addresses: dict[int, str]


class Done(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The request numbered ``seq`` completed; ``value`` e.g. measured device seconds.

    ``values``: small results that ride along with the completion, ``(key, blob)``
    each (the blob as a :class:`Fetched` payload), so that reading them costs no
    round trip.
    """

    seq: int
    value: float | None = None
    values: list[tuple[int, Blob]] | None = None


class Failed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The request numbered ``seq`` failed; ``trace`` is the remote traceback text."""

    seq: int
    kind: str
    host: int | None
    message: str
    trace: str = ""
    peers: list[int] = []
    error: str = ""  # the class of the host's error where the controller raises it as such (JaxRuntimeError)


class Fetched(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The value asked for by the request numbered ``seq``."""

    seq: int
    payload: Blob


class RunMeta(msgspec.Struct, frozen=True, array_like=True):
    """What a controller service's scheduler needs of a client's run."""

    islands: list[int]  # the islands it runs on
    uuids: int  # transfer numbers it takes
    nbytes: dict[int, int]  # bytes of each value it keeps, by the client's key
    program: str
    client: str  # the pw.client it was submitted under
    weight: float = 1.0
    priority: int = 0
    client_key: int = -1  # the pw.client's number in its process (what a Cancel names)


# What a client asks of its controller service's hosts (a Share: of the service itself).
Request: TypeAlias = "Register | Run | Fetch | Free | Forget | Share | Cancel"


class Routed(msgspec.Struct, frozen=True, array_like=True):
    """A message for host ``host`` (-1: for the service itself, as a :class:`Share` or :class:`Cancel`)."""

    host: int
    item: Request


class Submit(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Client -> service: the client's batch number ``batch`` of host messages.

    ``messages``: the Ray backend's host messages, in the client's keys; ``run``:
    set when the batch is a run.
    """

    batch: int
    messages: list[Routed]
    run: RunMeta | None = None


class Answered(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Service -> client: the answers to batch ``batch``, one per message, each as a host's answer
    numbered by its message's place in the batch."""

    batch: int
    answers: list[Done | Failed | Fetched]


class Heartbeat(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Liveness: sent by a channel that has been quiet; consumed by the receiving channel."""

    sent_at: float


Item: TypeAlias = (
    Register
    | Run
    | Fetch
    | Free
    | Forget
    | Share
    | Cancel
    | Stash
    | Store
    | Load
    | Peers
    | Colocated
    | Done
    | Failed
    | Fetched
    | Submit
    | Answered
    | Heartbeat
)


class Batch(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Several messages in one frame; item ``i`` is numbered ``seq + i``."""

    items: list[Item]


Message: TypeAlias = Item | Batch


class Part(msgspec.Struct, frozen=True, array_like=True):
    """One peer's share of a :class:`Fanout`: its message, numbered ``seq`` in that peer's order."""

    seq: int
    body: Message


class Fanout(msgspec.Struct, frozen=True, array_like=True):
    """One frame for several peers: ``parts`` maps a peer's identity to ``(seq, index)`` of its
    message in ``bodies``, each distinct message encoded once (peers given the same message
    object share it: an SPMD run's hosts usually get equal ones).

    A receiver decodes only its own body (the others stay undecoded ``Raw``);
    blobs of every body share the frame's out-of-band buffers.
    """

    bodies: list[msgspec.Raw]
    parts: dict[bytes, tuple[int, int]]


def _encode_hook(frames: list[Any]) -> Any:
    def hook(obj: Any) -> Any:
        if isinstance(obj, Blob):
            view = obj.view
            if view.nbytes < INLINE_LIMIT:
                return view
            frames.append(view)
            return Ext(_FRAME_EXT, _INDEX.pack(len(frames) - 1))
        raise TypeError(f"cannot put a {type(obj).__name__} on the wire; wrap buffers in Blob")

    return hook


class Codec:
    """Encodes messages to (header, frames) and decodes them back; one per thread.

    Not thread safe: it reuses its buffers. The receiving side's blobs view the
    frames given to :meth:`decode` (keep those alive as long as the blobs).

    Example:
        >>> codec = Codec()
        >>> header, frames = codec.encode(Fetched(seq=3, payload=Blob(b"x" * 2000)))
        >>> len(frames)
        1
        >>> codec.decode(header, frames) == Fetched(seq=3, payload=Blob(b"x" * 2000))
        True
    """

    def __init__(self) -> None:
        self._out: list[Any] = []
        self._in: Sequence[Any] = ()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook(self._out))
        self._decoder = msgspec.msgpack.Decoder(Message, ext_hook=self._ext, dec_hook=self._dec)
        self._fanout_decoder = msgspec.msgpack.Decoder(Fanout)

    def encode(self, message: Message) -> tuple[bytes, list[Any]]:
        """The encoded struct and the out-of-band buffers it references, in order."""
        self._out.clear()
        header = self._encoder.encode(message)
        frames = list(self._out)
        self._out.clear()
        return header, frames

    def encode_fanout(self, parts: dict[bytes, tuple[int, Message]]) -> tuple[bytes, list[Any]]:
        """A :class:`Fanout` of ``parts`` (peer -> ``(seq, message)``) and the buffers of all of them;
        a message object given to several peers is encoded once."""
        self._out.clear()
        index: dict[int, int] = {}  # id(message) -> its place in bodies
        bodies: list[msgspec.Raw] = []
        where: dict[bytes, tuple[int, int]] = {}
        for peer, (seq, body) in parts.items():
            at = index.get(id(body))
            if at is None:
                at = index[id(body)] = len(bodies)
                bodies.append(msgspec.Raw(self._encoder.encode(body)))
            where[peer] = (seq, at)
        header = self._encoder.encode(Fanout(bodies, where))
        frames = list(self._out)
        self._out.clear()
        return header, frames

    def decode_part(self, header: Any, frames: Sequence[Any], peer: bytes) -> Part | None:
        """Peer ``peer``'s part of the :class:`Fanout` in ``header`` (None: it has none).

        Raises:
            msgspec.DecodeError: as :meth:`decode`.
        """
        fanout = self._fanout_decoder.decode(header)
        where = fanout.parts.get(peer)
        if where is None:
            return None
        seq, at = where
        if not 0 <= at < len(fanout.bodies):
            raise msgspec.DecodeError(f"part {at} referenced, {len(fanout.bodies)} carried")
        self._in = frames
        try:
            return Part(seq, self._decoder.decode(fanout.bodies[at]))
        finally:
            self._in = ()

    def decode(self, header: Any, frames: Sequence[Any] = ()) -> Message:
        """The message in ``header``, its blobs viewing ``frames``.

        Raises:
            msgspec.DecodeError: ``header`` is not a message (``ValidationError``: wrong types),
                or references a frame that is not there.
        """
        self._in = frames
        try:
            return self._decoder.decode(header)
        finally:
            self._in = ()

    def _ext(self, code: int, data: memoryview) -> Blob:
        if code != _FRAME_EXT or len(data) != _INDEX.size:
            raise msgspec.DecodeError(f"unknown extension {code}")
        (index,) = _INDEX.unpack(data)
        if index >= len(self._in):
            raise msgspec.DecodeError(f"frame {index} referenced, {len(self._in)} carried")
        return Blob(self._in[index])

    @staticmethod
    def _dec(kind: type, obj: Any) -> Any:
        if kind is Blob:
            return obj if isinstance(obj, Blob) else Blob(obj)
        raise NotImplementedError(f"cannot decode {kind}")
