"""Starting the Ray side: Ray imported and joined, GPUs checked, the hosts' layout and link.

Ray is imported only through :func:`import_ray`, lazily: ``pip install pathways-jax[ray]``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

from pathways_jax._src.backends import ray_auth
from pathways_jax._src.backends.host_link import Link, RayCallLink
from pathways_jax._src.core import errors


@contextlib.contextmanager
def ray_init_uninterrupted() -> Iterator[None]:
    """A Ctrl-C during ``ray.init`` waits until it returned, then raises ``KeyboardInterrupt``; a second
    one raises at once.

    One landing as Ray builds its core worker left it half made: the next ``ray.init`` (``pw.init``
    again, as a notebook's next cell does) aborted the whole process in Ray's native code ("An
    unexpected system state has occurred"). Only on the main thread, with Python's own handler.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed: list[int] = []

    def later(signum: int, frame: Any) -> None:
        if pressed:  # pressed again: the user will not wait
            raise KeyboardInterrupt
        pressed.append(signum)

    signal.signal(signal.SIGINT, later)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise errors.ClusterError(
            "pw.init(backend='ray') needs Ray, which is not installed. Install it with "
            "`pip install pathways-jax[ray]` (Ray and flatbuffers), or use backend='local'."
        ) from exc
    try:
        import flatbuffers  # noqa: F401  (jax.export serialization needs it)
    except ImportError as exc:
        raise errors.ClusterError(
            "pw.init(backend='ray') ships computations with jax.export, whose serialization "
            "needs the flatbuffers package. Install it with `pip install pathways-jax[ray]`."
        ) from exc
    return ray


def check_gpus(ray: Any, hosts: int, devices_per_host: int) -> None:
    """Refuses at once GPU hosts a Ray cluster has no GPUs for (its placement would wait in vain)."""
    wanted = hosts * devices_per_host
    have = ray.cluster_resources().get("GPU", 0)
    if have < wanted:
        raise errors.ClusterError(
            f"platform='gpu' asks Ray for {hosts} hosts x {devices_per_host} GPUs = {wanted} GPUs, but the "
            f"Ray cluster has {have:g}. Start the Ray nodes that have the GPUs first (Ray must see them: "
            "`ray status` lists them), ask for fewer hosts or devices_per_host, or use platform='cpu'."
        )


def check_cpus(ray: Any, hosts: int) -> None:
    """Refuses at once CPU hosts a Ray cluster has too few logical CPUs for (its placement would wait in vain)."""
    have = ray.cluster_resources().get("CPU", 0)
    if have < hosts:
        raise errors.ClusterError(
            f"{hosts} hosts ask Ray for a logical CPU each, but the Ray cluster has {have:g}. Start Ray "
            f"with more (`ray start --head --num-cpus={hosts}`, ray.init(num_cpus={hosts})) or add nodes, "
            "or ask for fewer hosts."
        )


_REACH_TIMEOUT_S = 5.0  # a Ray address whose port takes no connection in this long is refused


def check_reachable(address: str) -> None:
    """Refuses at once a ``host:port`` (or ``ray://host:port``) address where nothing takes a connection.

    ``ray.init`` retries such an address for minutes. ``"auto"`` is checked as
    the address it stands for (``RAY_ADDRESS``, or the cluster ``ray start`` last
    recorded on this machine, whose record outlives a cluster that stopped or
    crashed); ``"local"`` and other forms are left to Ray.
    """
    shown = repr(address)
    if address == "auto":
        found = _auto_address()
        if found is None:
            return  # nothing recorded: Ray says so at once
        address = found
        shown = (
            f"'auto' ({found!r}: what RAY_ADDRESS, or else `ray start`'s record in "
            "/tmp/ray/ray_current_cluster, names; a cluster that stopped or crashed leaves its record behind, "
            "and `ray start --head` records a new one)"
        )
    where = address.removeprefix("ray://")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or "/" in where:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise errors.ClusterError(
            f"could not reach the Ray cluster at {shown}: nothing took a connection there within "
            f"{_REACH_TIMEOUT_S:g}s ({exc}). Check the address (the head's `ray start` prints it; a "
            "controller service's is pw.Service.address), or start a cluster with `ray start --head`."
        ) from exc
    answer = _grpc_answer(where)
    if answer is not None:
        raise errors.ClusterError(
            f"{shown} is not a Ray cluster's address: something takes connections there, but it does "
            f"not speak gRPC as Ray's GCS (or Ray Client server) does; it {answer}. Check the address (the "
            "head's `ray start` prints it, as 'ray start --address=...'; a controller service's is "
            "pw.Service.address), or start a cluster with `ray start --head`."
        )
    mixed = _other_ray_port(where, client=address.startswith("ray://"))
    if mixed is not None:
        raise errors.ClusterError(f"{shown} {mixed}")


def check_joined(ray: Any, address: str | None) -> None:
    """Refuses ``address`` if it names another Ray cluster than the one this process joined already.

    A process joins one Ray cluster (``ray.init``, or an earlier ``pw.init`` or
    ``pw.serve``): an address naming another was ignored, and the hosts started
    or the service looked for in the one joined. ``None`` and ``"local"`` pass,
    as does an address whose cluster cannot be told (``"auto"`` with nothing
    recorded, a Ray Client connection).
    """
    if address is None or address == "local":
        return
    try:
        current = ray.get_runtime_context().gcs_address
    except Exception:  # a Ray Client connection: its cluster's address is not at hand
        return
    wanted = _auto_address() if address == "auto" else address
    if not isinstance(current, str) or wanted is None or _same_cluster(ray, wanted, current):
        return
    shown = repr(address) if wanted == address else f"{address!r} ({wanted!r})"
    raise errors.ClusterError(
        f"address={shown} names another Ray cluster than the one this process joined already, at "
        f"{current!r} (with ray.init, or an earlier pw.init or pw.serve); a process joins one Ray "
        f"cluster. Pass address=None (or {current!r}) to use that one, or call ray.shutdown() first to "
        f"join {address!r}."
    )


def _same_cluster(ray: Any, wanted: str, current: str) -> bool:
    """Whether ``wanted`` (``host:port``, or ``ray://host:port``) names the cluster at ``current``.

    A Ray Client address names the head's client server, not its GCS port: its
    host alone is compared. This machine's names and addresses are one host.
    """
    client = wanted.startswith("ray://")
    host, _, port = wanted.removeprefix("ray://").rpartition(":")
    here_host, _, here_port = current.rpartition(":")
    if not host or not port.isdigit():
        return True  # a form this does not read: left to Ray
    if not client and port != here_port:
        return False
    try:
        node = ray.util.get_node_ip_address()
    except Exception:
        node = None
    ours = {node, _ip(socket.gethostname()), "0.0.0.0"}
    a, b = _ip(host.strip("[]")), _ip(here_host.strip("[]"))
    return a == b or all(ip in ours or ip.startswith("127.") or ip == "::1" for ip in (a, b))


def _ip(host: str) -> str:
    """``host``'s IPv4 address, or ``host`` itself if it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _auto_address() -> str | None:
    """The address ``ray.init(address="auto")`` would join, as Ray finds it; None if none is known."""
    try:
        from ray._private import services

        found = services.get_ray_address_from_environment("auto", None)
    except Exception:  # no cluster known (Ray says so at once), or another Ray: left to it
        return None
    return found if isinstance(found, str) and found != "auto" else None


def _grpc_answer(address: str) -> str | None:
    """None if the server at ``address`` may be a gRPC server (Ray's GCS, or Ray Client's); else what it did.

    One call with gRPC's own client (``grpcio``): a gRPC server answers it, or
    refuses it with a status of its own (unauthenticated, unimplemented); an
    HTTP/1 server, a ZeroMQ socket or one that hangs up gives none. A server
    that says nothing in time, or one behind TLS (``RAY_USE_TLS``), is left to Ray.
    """
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    try:
        import grpc
    except ImportError:  # pragma: no cover - the ray extra brings it
        return None
    try:
        with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
            channel.unary_unary(ray_auth.CALL)(b"", timeout=_REACH_TIMEOUT_S)
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
            return f"gave no gRPC answer ({exc.details()})"
        return None  # a gRPC server's own status, or no answer in time: left to Ray
    except ValueError:  # an address gRPC does not take: left to Ray
        return None
    return None


# A call only Ray Client's server answers (the head's port 10001 by default); the GCS has no such method.
_CLIENT_CALL = "/ray.rpc.RayletDriver/ClusterInfo"


def _grpc_code(address: str, call: str) -> Any:
    """The gRPC status the server at ``address`` gives ``call`` (an empty request): a
    ``grpc.StatusCode`` (``OK`` for an answer); None when it cannot be told (no answer in time)."""
    import grpc

    try:
        with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
            channel.unary_unary(call)(b"", timeout=_REACH_TIMEOUT_S)
    except grpc.RpcError as exc:
        code = exc.code()
        return None if code == grpc.StatusCode.DEADLINE_EXCEEDED else code
    except ValueError:
        return None
    return grpc.StatusCode.OK


def _other_ray_port(where: str, *, client: bool) -> str | None:
    """What to say when the gRPC server at ``where`` is Ray's other port than the one asked for: its
    Ray Client server given as the cluster's (GCS) address, or its GCS given with ``ray://`` (which
    Ray takes as a Ray Client address, and retries for 30 s); None when it is not that (or cannot be told).

    Each has a method the other lacks (``UNIMPLEMENTED`` there, whether or not a token is sent)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    try:
        import grpc
    except ImportError:  # pragma: no cover - the ray extra brings it
        return None
    missing = grpc.StatusCode.UNIMPLEMENTED
    asked, other = (_CLIENT_CALL, ray_auth.CALL) if client else (ray_auth.CALL, _CLIENT_CALL)
    if _grpc_code(where, asked) != missing or _grpc_code(where, other) in (None, missing):
        return None
    if client:
        return (
            "names a Ray cluster's GCS port (the head's 6379 by default, the address `ray start` prints) "
            "with 'ray://', which is for Ray Client's server (the head's port 10001 by default). On a node "
            f"of the cluster pass address={where!r}, without 'ray://'; from elsewhere, 'ray://<head>:10001'."
        )
    return (
        "is Ray Client's server (the head's port 10001 by default), not a Ray cluster's GCS address: "
        f"pass address='ray://{where}' to connect through it, or, on a node of the cluster, the address "
        "`ray start` prints (the head's port 6379 by default)."
    )


def send_saved_token(address: str) -> None:
    """Joining the running Ray cluster at ``address``: sends the token Ray saved if the cluster asks for
    one, unless this process chose a mode (``ray_auth.choose_mode``; ``"auto"`` is the address it stands for).
    """
    ray_auth.choose_mode((_auto_address() or address) if address == "auto" else address)


# The local Ray session pathways_jax started itself, by its node id (none: none or the user's).
_OWN_SESSION: dict[str, Any] = {}


def join_ray(ray: Any, address: str | None, hosts: int) -> None:
    """Joins the Ray session ``address`` names, the one this process has, or starts a local one.

    A local session is sized for the hosts asked for (a logical CPU each); a
    later ``pw.init`` asking for more than a session pathways_jax started has
    gets a new one (placement would wait in vain), and one asking for more than
    a session of the user's has is refused at once.
    """
    if ray.is_initialized():
        check_joined(ray, address)
        have = int(ray.cluster_resources().get("CPU", 0))
        if have >= hosts or address is not None:
            return
        if _OWN_SESSION.get("node") != ray.get_runtime_context().get_node_id():
            raise errors.ClusterError(
                f"pw.init asks for {hosts} hosts (a Ray CPU each), but this process's Ray session has "
                f"{have} CPUs. Start Ray with more (ray.init(num_cpus={hosts})) or ask for fewer hosts."
            )
        ray.shutdown()  # the local session pathways_jax started for fewer hosts: a larger one
    if address is not None:
        check_reachable(address)
        send_saved_token(address)
    with warnings.catch_warnings():
        # Ray starts its own processes with fork + exec; JAX's fork hook
        # warns about forking a multithreaded process, which matters only
        # when the child goes on running Python.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        try:
            with ray_init_uninterrupted():
                ray.init(
                    # None: a new local cluster, never one a stale `ray start` file names.
                    address=address or "local",
                    include_dashboard=False,
                    log_to_driver=False,
                    num_cpus=None if address else max(hosts, os.cpu_count() or 1),
                    configure_logging=False,
                )
        except ConnectionError as exc:
            raise errors.ClusterError(
                f"could not reach the Ray cluster at {address!r}: {exc}. Check the address, or start a "
                "cluster with `ray start --head`."
            ) from exc
    if address is None:
        _OWN_SESSION["node"] = ray.get_runtime_context().get_node_id()


class Layout(NamedTuple):
    """Which hosts make which island: ``hosts`` hosts of ``devices_per_host``, ``per_island`` each."""

    hosts: int
    devices_per_host: int
    per_island: int

    @property
    def islands(self) -> int:
        return self.hosts // self.per_island

    def island_of(self, host: int) -> int:
        return host // self.per_island

    def members(self, island: int) -> tuple[int, ...]:
        return tuple(range(island * self.per_island, (island + 1) * self.per_island))

    def rank(self, host: int) -> int:
        return host % self.per_island


def make_link(transport: str) -> Link:
    """The link to the hosts for ``transport``: ``"channel"`` (ZeroMQ) or ``"ray"`` (actor calls)."""
    if transport == "ray":
        return RayCallLink()
    if transport == "channel":
        from pathways_jax._src.backends.channel_link import ChannelLink

        return ChannelLink()
    raise errors.ClusterError(f"transport must be 'channel' or 'ray', not {transport!r}.")
