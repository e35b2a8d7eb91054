"""The cluster: devices grouped into islands, the resource manager and the controller."""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import jax
from absl import logging

from pathways_jax._src import errors
from pathways_jax._src import scheduler as scheduler_lib
from pathways_jax._src.backends import local
from pathways_jax._src.object_store import Budget, ObjectStore
from pathways_jax._src.resources import Island, ResourceManager

# How many executables may be in flight on one island before the controller
# waits for the oldest. Unbounded asynchronous dispatch of collectives
# deadlocks XLA's CPU rendezvous (DESIGN §5: 64+ in flight on 8 devices); 16
# was measured safe, 8 leaves a margin and costs no throughput.
DEFAULT_IN_FLIGHT = 8


class Cluster:
    """The devices a process uses, grouped into islands, and the runtime serving them.

    Made by :func:`pw.init` (or on first use with the defaults); read it with
    :func:`pw.cluster`.
    """

    def __init__(
        self,
        backend: str,
        islands: tuple[tuple[jax.Device, ...], ...],
        init_args: tuple,
        in_flight: int,
        inline_dispatch: bool = True,
        *,
        scheduler: str = "fifo",
        starvation_limit: int = scheduler_lib.DEFAULT_STARVATION_LIMIT,
        budget: dict[int, int] | None = None,
        backpressure_timeout: float | None = None,
        remote: Any = None,
    ):
        self.backend = backend
        # The Ray backend's hosts (None on the local backend).
        self.remote = remote
        self.resources = ResourceManager(islands)
        self.store = ObjectStore()
        if budget is not None:
            self.store.budget = Budget(budget)
        self.in_flight = in_flight
        self.inline_dispatch = inline_dispatch
        self.scheduler = scheduler
        self.starvation_limit = starvation_limit
        self.backpressure_timeout = backpressure_timeout
        # Bumped whenever a slice is released or the cluster closes: cached plans
        # check their slices again only then.
        self.mapping_epoch = 0
        # Compiled executables by (node function, mesh, shardings): shared by plans.
        self.executables: dict = {}
        # Shared slices of programs with no placement, by (devices, mesh, axis types).
        self.implied_slices: dict[tuple, Any] = {}
        self.implied_lock = threading.Lock()
        self._init_args = init_args
        self._closed = False
        self._controller = None
        self._controller_lock = threading.Lock()
        # Live slices, for views (weak: a dropped slice leaves by itself).
        self._slices: weakref.WeakSet = weakref.WeakSet()
        self._slices_lock = threading.Lock()

    @property
    def islands(self) -> tuple[Island, ...]:
        return self.resources.islands

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(d for isl in self.islands for d in isl.devices)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def controller(self):
        """The background controller; its thread starts on first use."""
        if self._controller is None:
            with self._controller_lock:
                if self._closed:
                    raise errors.ClusterError("the cluster was shut down; call pw.init() to start a new one.")
                if self._controller is None:
                    from pathways_jax._src.controller import Controller

                    self._controller = Controller(self)
        return self._controller

    def close(self, timeout: float) -> None:
        with self._controller_lock:
            self._closed = True
            self.mapping_epoch += 1
            controller, self._controller = self._controller, None
        if controller is not None:
            controller.stop(timeout)
        if self.remote is not None:
            self.remote.close()

    def host_lost(self, island: int) -> None:
        """A host died (Ray backend): its island leaves placement; its slices move to survivors.

        A slice moves to the least-loaded surviving island where it fits; plans
        using it are lowered again on their next call (graphs are not traced
        again). A slice that fits nowhere stays on the lost island and its
        programs fail with ``HostLostError``.
        """
        self.resources.lose(island, self.remote.lost.get(island, "it died"))
        for slice_ in self.live_slices():
            if slice_.island != island:
                continue
            try:
                new_island, devices = self.resources.acquire(slice_.size, None, slice_.exclusive, timeout=0)
            except errors.ResourceError as exc:
                logging.warning("pathways_jax: %r could not move off lost island %d: %s", slice_, island, exc)
                continue
            slice_._move(new_island, devices)
            logging.warning("pathways_jax: %r moved off lost island %d", slice_, island)
        self.mapping_epoch += 1

    def close_client(self, client) -> None:
        """Cancels a client's queued runs and frees the values it owns."""
        controller = self._controller
        if controller is not None:
            controller.close_client(client)
        else:
            self.store.free(self.store.owned_by(client.key))

    def add_slice(self, slice_) -> None:
        """Registers a new slice for :meth:`live_slices` (weakly)."""
        with self._slices_lock:
            self._slices.add(slice_)

    def live_slices(self) -> list:
        """The slices of this cluster not released yet, by id."""
        with self._slices_lock:
            slices = list(self._slices)
        return sorted((s for s in slices if not s.released), key=lambda s: s.id)

    def __repr__(self) -> str:
        return f"Cluster(backend={self.backend!r}, {self.resources.describe()})"

    def _repr_html_(self) -> str:
        from pathways_jax._src import notebook

        return notebook.cluster_html(self)


_lock = threading.RLock()
_current: Cluster | None = None


def init(
    *,
    backend: Literal["local", "ray"] = "local",
    num_cpu_devices: int | None = None,
    islands: int | Sequence[Sequence[int]] | None = None,
    max_in_flight: int = DEFAULT_IN_FLIGHT,
    inline_dispatch: bool = True,
    scheduler: Literal["fifo", "priority", "fair"] = "fifo",
    starvation_limit: int = scheduler_lib.DEFAULT_STARVATION_LIMIT,
    memory_budget: int | float | None = None,
    backpressure_timeout: float | None = None,
    address: str | None = None,
    hosts: int | None = None,
    devices_per_host: int = 1,
) -> Cluster:
    """Starts the cluster this process runs programs on.

    Args:
      backend: ``"local"``: this process's JAX devices. ``"ray"``: ``hosts``
        Ray actors, each owning ``devices_per_host`` devices of its own (on
        this machine or others); each host is an island. Needs
        ``pip install pathways-jax[ray]``.
      num_cpu_devices: how many CPU devices JAX should expose. Must come before
        JAX's backend starts (or match the count it started with).
      islands: ``None`` (one island of all devices), an int (split the devices
        evenly, islands numbered from 0) or a list of lists of device ids.
      max_in_flight: executables in flight per island before the controller
        waits (a correctness bound for collectives, DESIGN §5); a full window
        is drained to half before dispatch goes on. On the Ray backend each
        host applies it to its own executables, waiting for the oldest.
      inline_dispatch: let a submitting thread dispatch its run itself when
        the controller is idle and nothing would wait (same order, no thread
        hand-off). ``False`` sends every run through the background thread.
      scheduler: how the controller picks the next queued run among clients
        (``pw.client``): ``"fifo"`` (submission order), ``"priority"`` (higher
        priority first, FIFO within a level) or ``"fair"`` (device time shared
        in proportion to client weights).
      starvation_limit: under ``"priority"``, a run passed over more than this
        many times goes next.
      memory_budget: bytes each device may hold in program values (an int), or
        a fraction of each device's memory (a float in (0, 1]; the device must
        report its memory). ``None``: no budget. A run whose outputs do not fit
        waits until values are freed.
      backpressure_timeout: seconds a run may wait for memory before its
        futures raise ``BackPressureTimeout`` (``None``: wait as long as it takes).
      address: Ray backend: the Ray cluster to join (``"host:port"``, ``"auto"``
        for the one ``ray start`` started on this machine, ``"ray://..."``).
        ``None``: the Ray session this process already has, or a new local one.
      hosts: Ray backend: how many host actors to start (one island each).
      devices_per_host: Ray backend: CPU devices each host exposes. This
        process traces and lowers against as many of its own CPU devices
        (stand-ins, ``num_cpu_devices`` defaults to ``hosts * devices_per_host``).

    Returns:
      The :class:`Cluster`. Calling ``init`` again with the same arguments
      returns it unchanged.

    Raises:
      ClusterError: a cluster with other arguments is running (call
        ``pw.shutdown()`` first), or the arguments cannot be met.

    Example:
      >>> import pathways_jax as pw
      >>> pw.cluster().backend
      'local'
    """
    global _current
    args = (
        backend,
        num_cpu_devices,
        _freeze(islands),
        max_in_flight,
        inline_dispatch,
        scheduler,
        starvation_limit,
        memory_budget,
        backpressure_timeout,
        address,
        hosts,
        devices_per_host,
    )
    with _lock:
        if _current is not None:
            if _current._init_args == args:
                return _current
            raise errors.ClusterError(
                f"pw.init{_describe(args)} was called, but a cluster started with "
                f"pw.init{_describe(_current._init_args)} is running. Call "
                "pw.shutdown() first to start one with other arguments."
            )
        if backend not in ("local", "ray"):
            raise errors.ClusterError(f"backend={backend!r} is not a backend; use 'local' or 'ray'.")
        if backend == "local" and (address is not None or hosts is not None or devices_per_host != 1):
            raise errors.ClusterError(
                "address=, hosts= and devices_per_host= describe Ray hosts; pass backend='ray' with "
                "them, or leave them out for the local backend."
            )
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise errors.ClusterError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}.")
        if scheduler not in scheduler_lib.POLICIES:
            raise errors.ClusterError(
                f"scheduler={scheduler!r} is not a scheduling policy; use one of {scheduler_lib.POLICIES}."
            )
        if (
            not isinstance(starvation_limit, int)
            or isinstance(starvation_limit, bool)
            or starvation_limit < 0
        ):
            raise errors.ClusterError(f"starvation_limit must be an int >= 0, got {starvation_limit!r}.")
        if backpressure_timeout is not None and (
            not isinstance(backpressure_timeout, int | float) or backpressure_timeout < 0
        ):
            raise errors.ClusterError(
                f"backpressure_timeout must be None or a number >= 0, got {backpressure_timeout!r}."
            )
        remote = None
        if backend == "ray":
            remote = _start_ray(address, hosts, devices_per_host, islands, num_cpu_devices, max_in_flight)
            carved = remote.islands
        else:
            if num_cpu_devices is not None:
                local.set_cpu_device_count(num_cpu_devices)
            carved = local.carve_islands(local.local_devices(), islands)
        try:
            budget = _budget([d for group in carved for d in group], memory_budget)
        except errors.ClusterError:
            if remote is not None:
                remote.close()
            raise
        _current = Cluster(
            backend,
            carved,
            args,
            max_in_flight,
            inline_dispatch,
            scheduler=scheduler,
            starvation_limit=starvation_limit,
            budget=budget,
            backpressure_timeout=backpressure_timeout,
            remote=remote,
        )
        if remote is not None:
            remote.on_lost = _current.host_lost
            remote.collect = _current.store.collect
            # Ray registered its own exit hook when it started; exit hooks run last
            # first, so this one stops the controller and the hosts while Ray still runs.
            atexit.register(shutdown)
        return _current


def _start_ray(
    address: str | None,
    hosts: int | None,
    devices_per_host: int,
    islands: Any,
    num_cpu_devices: int | None,
    max_in_flight: int,
) -> Any:
    """Checks the Ray backend's arguments, sets up the stand-in devices and starts the hosts."""
    if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
        raise errors.ClusterError(
            f"pw.init(backend='ray') needs hosts=N, a positive int (one host actor per island); got {hosts!r}."
        )
    if not isinstance(devices_per_host, int) or isinstance(devices_per_host, bool) or devices_per_host < 1:
        raise errors.ClusterError(f"devices_per_host must be a positive int, got {devices_per_host!r}.")
    if islands is not None and islands != hosts:
        raise errors.ClusterError(
            f"on the Ray backend each host is its own island (islands=None or islands={hosts}); got "
            f"islands={islands!r}. Islands of several hosts are not supported yet."
        )
    if address is not None and not isinstance(address, str):
        raise errors.ClusterError(f"address must be None or a Ray address string, got {address!r}.")
    total = hosts * devices_per_host
    if num_cpu_devices is not None and num_cpu_devices < total:
        raise errors.ClusterError(
            f"num_cpu_devices={num_cpu_devices} is fewer than the {total} stand-in devices that "
            f"hosts={hosts} x devices_per_host={devices_per_host} need in this process."
        )
    if not local._backend_started():
        # Never fewer CPU devices than the process already asked JAX for.
        configured = getattr(jax.config, "jax_num_cpu_devices", -1) or -1
        local.set_cpu_device_count(num_cpu_devices or max(total, configured))
    standins = sorted(jax.devices("cpu"), key=lambda d: d.id)
    if len(standins) < total:
        raise errors.ClusterError(
            f"hosts={hosts} x devices_per_host={devices_per_host} needs {total} CPU devices in this "
            f"process to stand in for the hosts' devices, but JAX started with {len(standins)}. Call "
            f"pw.init before any JAX computation, or set jax.config.update('jax_num_cpu_devices', {total}) "
            "first."
        )
    from pathways_jax._src.backends import ray as ray_backend

    return ray_backend.RayBackend(
        address=address,
        hosts=hosts,
        devices_per_host=devices_per_host,
        standins=standins[:total],
        window=max_in_flight,
        on_lost=None,
    )


def _budget(devices: list[jax.Device], memory_budget: int | float | None) -> dict[int, int] | None:
    """Bytes per device id for ``pw.init(memory_budget=...)``."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int | float):
        raise errors.ClusterError(
            f"memory_budget must be None, an int (bytes) or a float fraction in (0, 1], got {memory_budget!r}."
        )
    if isinstance(memory_budget, int):
        if memory_budget <= 0:
            raise errors.ClusterError(f"memory_budget must be > 0 bytes, got {memory_budget!r}.")
        return {d.id: memory_budget for d in devices}
    if not 0 < memory_budget <= 1:
        raise errors.ClusterError(f"a fractional memory_budget must be in (0, 1], got {memory_budget!r}.")
    limits = {}
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:
            stats = None
        total = (stats or {}).get("bytes_limit")
        if not total:
            raise errors.ClusterError(
                f"memory_budget={memory_budget!r} is a fraction of device memory, but {d} "
                f"({d.platform}) does not report its memory. Pass the budget in bytes instead, "
                "e.g. memory_budget=2**30."
            )
        limits[d.id] = int(total * memory_budget)
    return limits


def _freeze(islands):
    if islands is None or isinstance(islands, int):
        return islands
    try:
        return tuple(tuple(group) for group in islands)
    except TypeError:
        return islands


def _describe(args: tuple) -> str:
    backend, count, islands, in_flight, inline, policy, starvation, budget, bp_timeout = args[:9]
    address, hosts, per_host = args[9:]
    where = (
        f", address={address!r}, hosts={hosts!r}, devices_per_host={per_host!r}" if backend == "ray" else ""
    )
    return (
        f"(backend={backend!r}{where}, num_cpu_devices={count!r}, islands={islands!r}, "
        f"max_in_flight={in_flight!r}, inline_dispatch={inline!r}, scheduler={policy!r}, "
        f"starvation_limit={starvation!r}, memory_budget={budget!r}, backpressure_timeout={bp_timeout!r})"
    )


def cluster() -> Cluster:
    """The running cluster, started with the defaults if ``pw.init`` was not called."""
    current = _current
    if current is not None:
        return current
    with _lock:
        return _current if _current is not None else init()


def running() -> Cluster | None:
    """The running cluster, or None (never starts one)."""
    return _current


def shutdown(timeout: float = 60.0) -> None:
    """Finishes queued work, stops the controller and forgets the cluster.

    Slices of the old cluster become unusable; futures already computed stay
    readable on the local backend. On the Ray backend the host actors end with
    the cluster and the values on them go too (a future whose ``.result()``
    was taken keeps its value). Safe to call when no cluster runs.
    """
    global _current
    with _lock:
        current, _current = _current, None
    if current is not None:
        current.close(timeout)


# Stop the controller before the interpreter finalises: a dispatch thread still
# inside XLA while the runtime is torn down can abort the process at exit.
atexit.register(shutdown)
