"""Starting and finding a controller service: ``pw.serve``, ``pw.service`` and the ``Service`` handle."""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from typing import Any

from pathways_jax._src.backends import ray as ray_backend
from pathways_jax._src.backends import ray_fleet
from pathways_jax._src.backends.ray_boot import check_cpus, check_gpus
from pathways_jax._src.backends.ray_failures import is_lost_error
from pathways_jax._src.backends.service_client import NAMESPACE, connect, find
from pathways_jax._src.core import errors
from pathways_jax._src.runtime import init_args
from pathways_jax._src.runtime import scheduler as scheduler_lib
from pathways_jax._src.runtime.serving.actor import ServiceActor
from pathways_jax._src.runtime.serving.config import DEFAULT_WINDOW, ServiceConfig

_START_TIMEOUT_S = 180.0


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
        """The service's ``stats``: every client process with its runs, device time, bytes held, failures.

        Raises:
          ClusterError: the service is gone (stopped, or its actor died), or did not answer in ``timeout`` s.
        """
        return self._ask("stats", timeout)

    def host_stats(self, timeout: float = 30.0) -> dict:
        """Each host's counts (values kept, runs done, executables, plans, transfers).

        Raises:
          ClusterError: the service is gone (stopped, or its actor died), or did not answer in ``timeout`` s.
        """
        return self._ask("host_stats", timeout)

    def _ask(self, method: str, timeout: float) -> dict:
        import ray

        wait = init_args.seconds(f"Service.{method}(timeout=...)", timeout)
        try:
            return ray.get(getattr(self.actor, method).remote(), timeout=wait)
        except Exception as exc:
            if is_lost_error(exc):
                raise errors.ClusterError(
                    f"Service.{method}(): the controller service {self.name!r} is gone (stopped, or its actor "
                    f"died): {type(exc).__name__}. Start it again with pw.serve({self.name!r}, hosts=...)."
                ) from exc
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise errors.ClusterError(
                    f"Service.{method}(): the controller service {self.name!r} did not answer within "
                    f"{timeout}s; pass a longer timeout=, or check that it runs (`ray list actors`)."
                ) from exc
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the service: its hosts are killed, its clients' values go, the actor ends. A service
        already gone: nothing to do.

        Args:
          timeout: seconds the service is given to stop its hosts before its actor is killed.
        """
        import ray

        wait = init_args.seconds("Service.stop(timeout=...)", timeout)
        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(), timeout=wait)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


def _check_name_and_address(name: object, address: object) -> None:
    if not isinstance(name, str) or not name:
        raise errors.ClusterError(f"a service's name must be a non-empty string, got {name!r}.")
    if address is not None and not isinstance(address, str):
        raise errors.ClusterError(f"address must be None or a Ray address string, got {address!r}.")


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
    it with :meth:`Service.stop` (or ``python -m pathways_jax stop``).

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

    _check_name_and_address(name, address)
    if platform not in ("cpu", "gpu"):
        raise errors.ClusterError(f"platform must be 'cpu' or 'gpu', got {platform!r}.")
    if not isinstance(replace_lost_hosts, bool):
        raise errors.ClusterError(f"replace_lost_hosts must be True or False, got {replace_lost_hosts!r}.")
    max_in_flight = init_args.count("max_in_flight", max_in_flight, 1)
    starvation_limit = init_args.count("starvation_limit", starvation_limit, 0)
    backpressure_timeout = init_args.seconds("backpressure_timeout", backpressure_timeout)
    # Counts as pw.init takes them: any integer (a NumPy one too), not a bool.
    hosts = init_args.count("hosts", hosts, 1)
    devices_per_host = init_args.count("devices_per_host", devices_per_host, 1)
    window = init_args.count("window", window, 1)
    if islands is not None and (
        isinstance(islands, bool)
        or not isinstance(islands, numbers.Integral)
        or islands < 1
        or hosts % islands
    ):
        raise errors.ClusterError(
            f"islands must be None or a number of islands dividing hosts={hosts}, got {islands!r}."
        )
    islands = None if islands is None else int(islands)
    if scheduler not in scheduler_lib.POLICIES:
        raise errors.ClusterError(
            f"scheduler={scheduler!r} is not a policy; use one of {scheduler_lib.POLICIES}."
        )
    max_clients = init_args.count("max_clients", max_clients, 1, optional=True)
    if memory_budget is not None and (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, numbers.Integral)
        or memory_budget < 1
    ):
        raise errors.ClusterError(
            f"memory_budget must be None or a number of bytes >= 1, got {memory_budget!r}."
        )
    memory_budget = None if memory_budget is None else int(memory_budget)
    if (
        isinstance(stalled_client_timeout, bool)
        or not isinstance(stalled_client_timeout, numbers.Real)
        or not stalled_client_timeout > 0
    ):
        raise errors.ClusterError(
            f"stalled_client_timeout must be a number of seconds > 0, got {stalled_client_timeout!r}."
        )
    if silent_client_timeout is not None and (
        isinstance(silent_client_timeout, bool)
        or not isinstance(silent_client_timeout, numbers.Real)
        or not silent_client_timeout > 0
    ):
        raise errors.ClusterError(
            f"silent_client_timeout must be None or a number of seconds > 0, got {silent_client_timeout!r}."
        )
    # This process's PATHWAYS_JAX_ROOM_GRACE_S and PATHWAYS_JAX_HUNG_S, for the service.
    room_grace_s, hung_s = ray_fleet.room_grace_s(), ray_fleet.hung_s()
    ray = connect(address, start=True, hosts=hosts)
    check_cpus(ray, hosts)
    if platform == "gpu":
        check_gpus(ray, hosts, devices_per_host)
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
        room_grace_s=room_grace_s,
        hung_s=hung_s,
    )
    actor = (
        ray.remote(ServiceActor)
        .options(name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=10000)
        .remote(config)
    )
    try:
        started = ray.get(actor.ready.remote(), timeout=_START_TIMEOUT_S)
    except BaseException as exc:
        # Detached, it would outlive a start cut short (Ctrl-C) and serve on, holding its hosts' CPUs.
        with contextlib.suppress(Exception):
            ray.kill(actor)
        if not isinstance(exc, Exception):
            raise
        raise errors.ClusterError(f"the controller service {name!r} did not start: {exc}") from exc
    if "failed" in started:  # its hosts could not start: the actor says why
        with contextlib.suppress(Exception):
            ray.kill(actor)
        raise errors.ClusterError(f"the controller service {name!r} did not start: {started['failed']}")
    return Service(name, ray.get_runtime_context().gcs_address, actor)


def service(name: str = "pathways", *, address: str | None = None) -> Service:
    """The running controller service named ``name`` (ClusterError if there is none)."""
    _check_name_and_address(name, address)
    ray = connect(address)
    return Service(name, ray.get_runtime_context().gcs_address, find(ray, name, f"pw.service({name!r})"))
