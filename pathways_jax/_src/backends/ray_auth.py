"""Joining a running Ray cluster by address: whether to send Ray's authentication token, and which.

``ray start`` turns on Ray's token authentication by default (Ray 2.59 and
later) and saves the token for the user (``~/.ray/auth_token``); a local
``ray.init()`` saves one too. A driver joining by address sends it only with
``RAY_AUTH_MODE=token``, and ``ray.init`` retries a cluster that refuses its
token, or asks for one it lacks, for 20 s, then says it could not connect. A
driver that sends a token to a cluster started without authentication
(``RAY_AUTH_MODE=disabled``, or before any token was saved on the machine)
joins it, but every actor it makes there dies before it starts ("all
references to the actor were removed"). So the cluster is asked first: one
gRPC call to its GCS without a token (as a client of no mode makes it) and,
if that is refused, one with the token at hand.
"""

from __future__ import annotations

import os
import pathlib
import socket
from typing import Literal

from pathways_jax._src.core import errors

_ASK_TIMEOUT_S = 5.0  # a cluster that does not answer the question in this long is left to Ray

# HTTP/2, as a gRPC client speaks it: the connection preface with an empty SETTINGS frame, then
# frames of a 9-byte head (length, type, flags, stream).
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_CALL = b"/ray.rpc.NodeInfoGcsService/GetClusterId"  # the first call every Ray client makes
_EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"  # a gRPC message: not compressed, 0 bytes (an empty request)
_MOST_FRAMES = 64  # frames read for the answer (settings, window updates, pings come first)
_UNAUTHENTICATED = b"16"  # gRPC's status code

Answer = Literal["answered", "refused", "unknown"]


def choose_mode(address: str) -> None:
    """Joining the running Ray cluster at ``address`` (``host:port``): sends the token at hand if the
    cluster asks for one, unless this process chose a mode (``RAY_AUTH_MODE``).

    A cluster that answers a call without a token is joined without one
    (``RAY_AUTH_MODE=disabled``, which ``ray.init(address="auto")`` would turn to
    token mode where a token is saved); one that refuses it is joined in token
    mode, as Ray's own commands join it, with the token at hand
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or the saved file).

    Raises:
      ClusterError: the cluster asks for a token, and none is at hand, or it refuses the one at hand.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return  # the user's choice
    token, source = token_at_hand()
    without = ask(address)
    if without == "answered":
        if token is not None:
            os.environ["RAY_AUTH_MODE"] = "disabled"
        return
    if without == "refused" and token is None:
        raise errors.ClusterError(
            f"the Ray cluster at {address!r} asks for an authentication token (Ray's token authentication), "
            "and this process has none: set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on "
            "its head prints it), or RAY_AUTH_TOKEN_PATH to a file holding it."
        )
    if without == "refused" and ask(address, token) == "refused":
        raise errors.ClusterError(
            f"the Ray cluster at {address!r} refused the authentication token at hand ({source}): it is not "
            "that cluster's token (a `ray start` or a local ray.init() of another cluster saves its own). Set "
            "RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head prints it), or "
            "RAY_AUTH_TOKEN_PATH to a file holding it."
        )
    if token is None:
        return
    try:
        from ray._private.authentication import authentication_token_setup as setup

        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except (ImportError, AttributeError, TypeError):  # another Ray: its documented variable
        os.environ["RAY_AUTH_MODE"] = "token"


def token_at_hand() -> tuple[str | None, str]:
    """The token Ray would send in token mode, and where it comes from; ``(None, ...)`` if none.

    Read as Ray documents it (``RAY_AUTH_TOKEN``, then the file
    ``RAY_AUTH_TOKEN_PATH`` names, then ``~/.ray/auth_token``), not asked of
    Ray's own token loader: it keeps the token it finds, and a process whose
    loader holds one sends it whatever its mode.
    """
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = pathlib.Path(named).expanduser() if named else pathlib.Path.home() / ".ray" / "auth_token"
    source = f"RAY_AUTH_TOKEN_PATH={named}" if named else str(path)
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None, source
    return token or None, source


def ask(address: str, token: str | None = None) -> Answer:
    """What the GCS of the Ray cluster at ``address`` (``host:port``) does with a call bearing ``token``
    (None: no token): ``"answered"``, ``"refused"`` (unauthenticated), or ``"unknown"`` (a Ray
    Client address, TLS (``RAY_USE_TLS``), another error, no answer within seconds)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        return "unknown"
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return "unknown"
    try:
        headers = (
            b"\x83\x86"  # :method POST, :scheme http (HPACK's static table)
            + b"\x04"  # :path (a static name), not indexed
            + _string(_CALL)
            + b"\x01"  # :authority
            + _string(address.encode())
            + b"\x00"  # a new name, not indexed
            + _string(b"content-type")
            + _string(b"application/grpc")
            + b"\x00"
            + _string(b"te")
            + _string(b"trailers")
        )
        if token is not None:
            headers += (
                b"\x10" + _string(b"authorization") + _string(f"Bearer {token}".encode())
            )  # never indexed
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_ASK_TIMEOUT_S) as sock:
            sock.sendall(
                _PREFACE
                + _frame(_HEADERS, _END_HEADERS, 1, headers)
                + _frame(_DATA, _END_STREAM, 1, _EMPTY_MESSAGE)
            )
            for _ in range(_MOST_FRAMES):
                kind, flags, stream, payload = _read_frame(sock)
                if kind == _SETTINGS and not flags & _ACK:
                    sock.sendall(_frame(_SETTINGS, _ACK, 0, b""))
                elif stream == 1 and kind == _DATA and payload:
                    return "answered"  # the reply: the call went through
                elif stream == 1 and kind == _HEADERS and flags & _END_STREAM:  # trailers only: an error
                    status = _fields(payload).get(b"grpc-status")
                    return "refused" if status == _UNAUTHENTICATED else "unknown"
                elif (stream == 1 and kind == _RST_STREAM) or kind == _GOAWAY:
                    return "unknown"
    except (OSError, ValueError, IndexError):  # no answer, or one this does not read
        return "unknown"
    return "unknown"


def _string(text: bytes) -> bytes:
    """An HPACK string (no Huffman coding) of under 127 bytes: its length, then itself."""
    if len(text) >= 127:
        raise ValueError(f"{len(text)} bytes is too long a header here")
    return bytes([len(text)]) + text


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _read_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    head = _read(sock, 9)
    payload = _read(sock, int.from_bytes(head[:3], "big"))
    return head[3], head[4], int.from_bytes(head[5:], "big") & 0x7FFFFFFF, payload


def _read(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        more = sock.recv(count - len(data))
        if not more:
            raise ConnectionError("the server hung up")
        data += more
    return data


def _fields(block: bytes) -> dict[bytes, bytes]:
    """The header fields of an HPACK block that are literals with literal names, not Huffman coded
    (how gRPC sends its status); the others are passed over."""
    found: dict[bytes, bytes] = {}
    added: list[bytes] = []  # names this block added to the dynamic table, newest first
    at = 0
    while at < len(block):
        first = block[at]
        if first & 0x80:  # an indexed field
            _, at = _integer(block, at, 7)
            continue
        if first & 0xE0 == 0x20:  # a dynamic table size update
            _, at = _integer(block, at, 5)
            continue
        indexing = first & 0xC0 == 0x40
        index, at = _integer(block, at, 6 if indexing else 4)
        if index == 0:
            name, at = _literal(block, at)
        else:
            name = added[index - 62] if 62 <= index < 62 + len(added) else None
        value, at = _literal(block, at)
        if indexing:
            added.insert(0, name or b"")
        if name is not None and value is not None:
            found[name] = value
    return found


def _integer(block: bytes, at: int, prefix: int) -> tuple[int, int]:
    """An HPACK integer of an ``prefix``-bit prefix at ``block[at]``: its value and the next offset."""
    limit = (1 << prefix) - 1
    value = block[at] & limit
    at += 1
    if value < limit:
        return value, at
    shift = 0
    while True:
        byte = block[at]
        at += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _literal(block: bytes, at: int) -> tuple[bytes | None, int]:
    """An HPACK string at ``block[at]`` (None if Huffman coded) and the next offset."""
    huffman = bool(block[at] & 0x80)
    length, at = _integer(block, at, 7)
    if at + length > len(block):
        raise ValueError("a header block cut short")
    return (None if huffman else block[at : at + length]), at + length
