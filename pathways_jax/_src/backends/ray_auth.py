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
from typing import Literal

from pathways_jax._src.core import errors

_ASK_TIMEOUT_S = 5.0  # a cluster that does not answer the question in this long is left to Ray
CALL = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # the first call every Ray client makes

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
    Client address, TLS (``RAY_USE_TLS``), another error, no answer within seconds).

    One gRPC call (gRPC's own client, ``grpcio``), with an empty request, as a
    client of no mode makes it: Ray's gRPC stack would send the token it loaded.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        return "unknown"
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return "unknown"
    try:
        import grpc
    except ImportError:  # pragma: no cover - the ray extra brings it
        return "unknown"
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    try:
        with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
            call = channel.unary_unary(CALL)  # no serializers: the request and the answer are bytes
            call(b"", timeout=_ASK_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        return "refused" if exc.code() == grpc.StatusCode.UNAUTHENTICATED else "unknown"
    except ValueError:  # an address gRPC does not take
        return "unknown"
    return "answered"
