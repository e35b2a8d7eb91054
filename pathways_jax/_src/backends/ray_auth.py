"""Joining a running Ray cluster by address: whether to send Ray's authentication token.

``ray start`` turns on Ray's token authentication by default (Ray 2.59 and
later) and saves the token for the user (``~/.ray/auth_token``); a local
``ray.init()`` saves one too. A driver joining by address sends it only with
``RAY_AUTH_MODE=token``, and without it ``ray.init`` retries a cluster that asks
for one for 20 s and fails. A driver that sends a token to a cluster started
without authentication (``RAY_AUTH_MODE=disabled``, or before any token was
saved on the machine) joins it, but every actor it makes there dies before it
starts ("all references to the actor were removed"). So the cluster is asked
first, with one gRPC call carrying no token, as a client of no mode makes it.
"""

from __future__ import annotations

import os
import pathlib
import socket

_ASK_TIMEOUT_S = 5.0  # a cluster that does not answer the question in this long is sent the token

# HTTP/2, as a gRPC client speaks it: the connection preface with an empty SETTINGS frame, then
# frames of a 9-byte head (length, type, flags, stream).
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_CALL = b"/ray.rpc.NodeInfoGcsService/GetClusterId"  # the first call every Ray client makes
_EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"  # a gRPC message: not compressed, 0 bytes (an empty request)
_MOST_FRAMES = 64  # frames read for the answer (settings, window updates, pings come first)


def choose_mode(address: str) -> None:
    """Joining the running Ray cluster at ``address`` (``host:port``): sends the token Ray saved if the
    cluster asks for one, unless this process chose a mode.

    With ``RAY_AUTH_MODE`` unset and a token at hand (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or the saved file), token mode is turned on for this
    process, as Ray's own commands turn it on, unless the cluster answers a call
    without a token: then it is joined without one (``RAY_AUTH_MODE=disabled``,
    which ``ray.init(address="auto")`` would otherwise turn to token mode).
    """
    if "RAY_AUTH_MODE" in os.environ:
        return  # the user's choice
    if not _token_at_hand():
        return
    if answers_without_token(address):
        os.environ["RAY_AUTH_MODE"] = "disabled"
        return
    try:
        from ray._private.authentication import authentication_token_setup as setup

        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except (ImportError, AttributeError, TypeError):  # another Ray: its documented variable
        os.environ["RAY_AUTH_MODE"] = "token"


def _token_at_hand() -> bool:
    """Whether a token is at hand for Ray: its documented variables, or the file Ray saved.

    Ray's own token loader is not asked: it keeps the token it finds, and a
    process whose loader holds one sends it whatever its mode.
    """
    saved = pathlib.Path.home() / ".ray" / "auth_token"
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or saved.is_file())


def answers_without_token(address: str) -> bool:
    """Whether the Ray cluster's GCS at ``address`` (``host:port``) answers a call that carries no token.

    False where it refuses it (its authentication), and where it cannot be told:
    a Ray Client address, TLS (``RAY_USE_TLS``), a server that does not answer
    within seconds.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        return False
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return False
    headers = (
        b"\x83\x86"  # :method POST, :scheme http (HPACK's static table)
        + _field(b"\x04", _CALL)  # :path
        + _field(b"\x01", address.encode())  # :authority
        + _field(b"\x00" + _length(b"content-type"), b"application/grpc")
        + _field(b"\x00" + _length(b"te"), b"trailers")
    )
    try:
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
                    return True  # the reply: the call went through without a token
                elif stream == 1 and (kind == _RST_STREAM or (kind == _HEADERS and flags & _END_STREAM)):
                    return False  # refused (trailers only): unauthenticated
                elif kind == _GOAWAY:
                    return False
    except (OSError, ValueError):
        return False
    return False


def _length(text: bytes) -> bytes:
    """An HPACK string of under 127 bytes: its length (no Huffman coding), then itself."""
    if len(text) >= 127:
        raise ValueError(f"{len(text)} bytes is too long a header here")
    return bytes([len(text)]) + text


def _field(name: bytes, value: bytes) -> bytes:
    """An HPACK header field, not indexed: ``name`` (a static index, or 0 and a literal), then ``value``."""
    return name + _length(value)


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
