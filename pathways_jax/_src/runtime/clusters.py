"""The running cluster (devices in islands, the resource manager, the controller) and its life.

``pw.init`` starts it (its arguments: ``init_args``), ``pw.cluster`` reads it and
``pw.shutdown`` ends it.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import math
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import jax
from absl import logging

from pathways_jax._src.backends import registry
from pathways_jax._src.backends.base import (
    Backend,
    DefaultInt,
    DefaultStr,
    DefaultTrue,
    HostFleet,
    QueuesRuns,
    ServiceView,
    given,
)
from pathways_jax._src.compile.executable_cache import ExecutableCache
from pathways_jax._src.core import errors, events
from pathways_jax._src.runtime import context, exit_wait
from pathways_jax._src.runtime import scheduler as scheduler_lib
from pathways_jax._src.runtime.admission import Budget
from pathways_jax._src.runtime.init_args import (
    DEFAULT_IN_FLIGHT,
    DEFAULT_MAX_QUEUED,
    InitArgs,
    checked,
    device_budget,
    freeze_islands,
)
from pathways_jax._src.runtime.object_store import ObjectStore
from pathways_jax._src.runtime.resources import Island, ResourceManager

# How long a backend that started is given to close when the cluster cannot be made after all.
_START_FAILED_CLOSE_S = 10.0
# pw.init's defaults for the Ray hosts' shape: equal to "cpu" and 1, and told apart from them given
# (joining a controller service, those given are checked against the service's hosts).
_PLATFORM = cast(Literal["cpu", "gpu"], DefaultStr("cpu"))
_DEVICES_PER_HOST = DefaultInt(1)
# replace_lost_hosts's default: shown as True, turned into True by init, which records it was left out.
_REPLACE_LOST_HOSTS = cast(bool, DefaultTrue())


class Cluster:
    """The devices a process uses, grouped into islands, and the runtime serving them.

    Made by :func:`pw.init` (or on first use with the defaults); read it with
    :func:`pw.cluster`.
    """

    def __init__(
        self,
        backend: Backend,
        init_args: InitArgs,
        in_flight: int,
        inline_dispatch: bool = True,
        *,
        max_queued: int = DEFAULT_MAX_QUEUED,
        scheduler: str = "fifo",
        starvation_limit: int = scheduler_lib.DEFAULT_STARVATION_LIMIT,
        budget: dict[int, int] | None = None,
        backpressure_timeout: float | None = None,
    ):
        # What the controller dispatches through (backends/base.Backend); its
        # ``name`` is the one it was started under (backends/registry).
        self.backend: Backend = backend
        backend.on_lost = self.host_lost
        self.store = ObjectStore()
        self.store.wait_for_readers = self.wait_for_readers
        self.resources = ResourceManager(backend.islands, reclaim=self._reclaim, holders=self._holders)
        if budget is not None:
            self.store.budget = Budget(budget)
        self.in_flight = in_flight
        # Runs one client may have queued before its next call waits (the controller).
        self.max_queued = max_queued
        self.inline_dispatch = inline_dispatch
        self.scheduler = scheduler
        self.starvation_limit = starvation_limit
        self.backpressure_timeout = backpressure_timeout
        # Bumped whenever a slice is released or the cluster closes: cached plans
        # check their slices again only then.
        self.mapping_epoch = 0
        # Compiled executables by (node function, mesh, shardings): shared by plans.
        self.executables = ExecutableCache()
        # Shared slices of programs with no placement, by (devices, mesh, axis types);
        # weak: such a slice goes with the last program, plan and value placed on it.
        self.implied_slices: weakref.WeakValueDictionary[tuple, Any] = weakref.WeakValueDictionary()
        self.implied_lock = threading.Lock()
        self._init_args = init_args
        self._closed = False
        self._controller = None
        self._stopping = None  # the controller a close took (see close)
        self._controller_lock = threading.Lock()
        # Live slices, for views (weak: a dropped slice leaves by itself).
        self._slices: weakref.WeakSet = weakref.WeakSet()
        self._slices_lock = threading.Lock()
        if isinstance(backend, HostFleet):  # last: the hosts' threads may call these at once
            backend.on_restored = self.island_restored
            backend.collect = self.store.collect
            backend.slices_of = self.slice_devices

    @property
    def islands(self) -> tuple[Island, ...]:
        return self.resources.islands

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(d for isl in self.islands for d in isl.devices)

    def device_places(self) -> tuple[events.Device, ...]:
        """Where each device is, as plain values (what a trace names its tracks by)."""
        backend = self.backend
        fleet = backend if isinstance(backend, HostFleet) else None
        return tuple(
            events.Device(
                d.id,
                island.index,
                d.platform,
                fleet.place_of(d)[2] if fleet is not None else getattr(d, "process_index", 0),
            )
            for island in self.islands
            for d in island.devices
        )

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
                    from pathways_jax._src.runtime.controller import Controller

                    self._controller = Controller(self)
        return self._controller

    def close(self, timeout: float) -> None:
        """Stops the controller and the hosts, returning within ``timeout`` seconds whatever they do.

        Each part gets the time left of one deadline; a thread that does not end
        in time is left running as a daemon (and logged).
        """
        deadline = time.monotonic() + timeout
        with self._controller_lock:
            self._closed = True
            self.mapping_epoch += 1
            if self._controller is not None:
                # Kept, not dropped, until it stopped: a close that a Ctrl-C cut short is
                # finished by the next one (no call here: no signal handler runs in between).
                self._stopping, self._controller = self._controller, None
        controller = self._stopping
        try:
            if isinstance(self.backend, ServiceView):
                # A controller service's client leaves it first, at once: the service drops the runs
                # it still queues for this process and frees its values, so the runs queued here could
                # only be sent to be dropped (their values unreadable after this), one window at a time
                # as the hosts compute the runs before them: a long queue took the whole timeout to exit.
                self.backend.close(timeout)
        finally:  # (a Ctrl-C in the leave: the controller still stops)
            if controller is not None:
                controller.stop(max(0.0, deadline - time.monotonic()))
        self.backend.close(max(0.0, deadline - time.monotonic()))

    def _reclaim(self) -> None:
        """Frees what nothing holds any more, so that the slices only it held are released.

        Called when a request for devices finds none free: values and programs
        caught in reference cycles live until the garbage collector runs (a
        value goes with its future at once otherwise), and the store forgets
        the values gone at its next collect.
        """
        for hook in RECLAIM_HOOKS:  # caches of the layers above that may hold what nothing else does
            hook()
        gc.collect()
        self.store.collect()

    def _holders(self, device_ids: set[int], exclusive: bool) -> str:
        """The live slices on ``device_ids`` (only exclusive ones unless ``exclusive``), for an error."""
        implied = set(map(id, self.implied_slices.values()))
        lines = []
        for slice_ in self.live_slices():
            if (exclusive or slice_.exclusive) and any(d.id in device_ids for d in slice_._devices):
                if id(slice_) in implied:
                    lines.append(
                        f"{slice_!r}: the slice of programs and pw.jit functions given no slice (they run "
                        "where jax.jit would); it goes once they and their values are dropped"
                    )
                else:
                    lines.append(f"{slice_!r}: asked for with pw.devices(); .release() gives it back")
        if not lines:
            return ""
        return " Held by " + "; ".join(lines) + "."

    def host_lost(self, island: int) -> None:
        """A host died (Ray backend): its island leaves placement; its slices move to survivors.

        A slice moves to the least-loaded surviving island where it fits; plans
        using it are lowered again on their next call (graphs are not traced
        again). A slice that fits nowhere stays on the lost island and its
        programs fail with ``HostLostError``.
        """
        self.resources.lose(island, self.backend.lost.get(island, "it died"))
        for slice_ in self.live_slices():
            if slice_.island != island:
                continue
            try:
                new_island, devices, hold = self.resources.acquire(
                    slice_.size, None, slice_.exclusive, timeout=0
                )
            except errors.ResourceError as exc:
                logging.warning("pathways_jax: %r could not move off lost island %d: %s", slice_, island, exc)
                continue
            slice_._move(new_island, devices, hold)
            logging.warning("pathways_jax: %r moved off lost island %d", slice_, island)
        self.mapping_epoch += 1

    def island_restored(self, island: int) -> None:
        """A lost island was rebuilt on new hosts (Ray backend): slices may be placed there again.

        Slices that moved off it stay where they went; new ones may land there.
        """
        self.resources.restore(island)
        self.mapping_epoch += 1

    def close_client(self, client) -> None:
        """Cancels a client's queued runs, frees the values it owns and forgets its usage.

        Its usage joins the ``pw.stats()`` row of closed clients, as do its runs
        that finish after this.
        """
        controller = self._controller
        if controller is not None:
            controller.close_client(client)
            controller.accounting.forget(client)
        else:
            self.store.free(self.store.owned_by(client.key))
        if isinstance(self.backend, QueuesRuns):  # its runs queued past this process, at a service
            self.backend.cancel_client(client.key)

    def retire_client(self, client) -> None:
        """A thread's default client whose thread ended: its usage joins the closed clients' row.

        Nothing is cancelled or freed: its queued runs still run, and its values
        live as long as their futures (the thread may have handed them on).
        """
        controller = self._controller
        if controller is not None:
            controller.retire_client(client)
            controller.accounting.forget(client)

    def wait_for_readers(self, queued: bool) -> None:
        """Waits for the runs submitted so far (``queued``: also those still queued) to finish on their devices.

        What ``Future.delete()`` waits for before it deletes a buffer those runs may read.
        """
        controller = self._controller
        if controller is not None:
            if queued:
                controller.wait_dispatched()
            controller.wait_settled()

    def add_slice(self, slice_) -> None:
        """Registers a new slice for :meth:`live_slices` (weakly)."""
        with self._slices_lock:
            self._slices.add(slice_)

    def slice_devices(self) -> dict[int, list[int]]:
        """Each live slice's device ids, by slice id."""
        return {s.id: [d.id for d in s.devices] for s in self.live_slices()}

    def live_slices(self) -> list:
        """The slices of this cluster not released yet, by id."""
        with self._slices_lock:
            slices = list(self._slices)
        return sorted((s for s in slices if not s.released), key=lambda s: s.id)

    def __repr__(self) -> str:
        return f"Cluster(backend={self.backend.name!r}, {self.resources.describe()})"

    def _repr_html_(self) -> str:
        from pathways_jax._src.views import notebook

        return notebook.cluster_html(self)


_lock = threading.RLock()
_current: Cluster | None = None
# Called by a request for devices that finds none free, before the garbage collector runs: each
# lets go of what a cache above the runtime keeps that nothing else holds (api/decorator.py).
RECLAIM_HOOKS: list[Callable[[], None]] = []
# Set by pw.shutdown() once it ended a cluster: from then on nothing starts a
# default cluster by itself; pw.init() starts the next one.
_shut_down = False
# The cluster pw.shutdown() (or the exit hook) forgot and is closing; None once closed.
_closing: Cluster | None = None
# How long a close that a Ctrl-C cut short still waits for the cluster's threads to end.
_INTERRUPTED_CLOSE_S = 1.0
_SHUT_DOWN = (
    "the cluster was shut down (pw.shutdown()); call pw.init(...) to start a new one. Only the "
    "first use of pathways_jax in a process starts a default cluster by itself."
)


def init(
    *,
    backend: str = "local",
    num_cpu_devices: int | None = None,
    islands: int | Sequence[Sequence[int]] | None = None,
    max_in_flight: int = DEFAULT_IN_FLIGHT,
    max_queued: int = DEFAULT_MAX_QUEUED,
    inline_dispatch: bool = True,
    scheduler: Literal["fifo", "priority", "fair"] = "fifo",
    starvation_limit: int = scheduler_lib.DEFAULT_STARVATION_LIMIT,
    memory_budget: int | float | None = None,
    backpressure_timeout: float | None = None,
    address: str | None = None,
    hosts: int | None = None,
    devices_per_host: int = _DEVICES_PER_HOST,
    platform: Literal["cpu", "gpu"] = _PLATFORM,
    replace_lost_hosts: bool = _REPLACE_LOST_HOSTS,
    service: str | None = None,
    client_name: str | None = None,
) -> Cluster:
    """Starts the cluster this process runs programs on.

    Args:
      backend: ``"local"``: this process's JAX devices. ``"ray"``: ``hosts``
        Ray actors, each owning ``devices_per_host`` devices of its own (on
        this machine or others), grouped into ``islands``. Needs
        ``pip install pathways-jax[ray]``. Or the name of a backend added
        with ``backends.registry.register(name, start)``: ``start`` gets
        these arguments and returns a ``Backend``.
      num_cpu_devices: how many CPU devices JAX should expose. Must come before
        JAX's backend starts (or match the count it started with).
      islands: ``None`` (one island of all devices), an int (split the devices
        evenly, islands numbered from 0) or a list of lists of device ids.
        Ray backend: ``None`` (each host is an island) or an int ``K``
        dividing ``hosts``: islands of ``hosts / K`` hosts each, whose hosts
        run each program together as one SPMD program over the island's
        devices (``jax.distributed``, one coordinator per island).
      max_in_flight: executables in flight per island before the controller
        waits (a correctness bound for collectives, DESIGN §5); a full window
        is drained to half before dispatch goes on. On the Ray backend each
        host applies it to its own executables, waiting for the oldest.
      max_queued: runs one client may have queued (submitted, not yet
        dispatched); a caller that would queue more blocks until one is
        dispatched, and raises ``BackPressureTimeout`` after
        ``backpressure_timeout`` seconds.
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
      backpressure_timeout: seconds a run may wait for memory (or a caller for
        room in its client's queue) before ``BackPressureTimeout`` is raised
        (``None``: wait as long as it takes).
      address: Ray backend: the Ray cluster to join (``"host:port"``, ``"auto"``
        for the one ``ray start`` started on this machine, ``"ray://..."``).
        ``None``: the Ray session this process already has, or a new local one.
        Once the process has joined a Ray cluster, an address naming another
        is refused (call ``ray.shutdown()`` first to join it).
      hosts: Ray backend: how many host actors to start.
      devices_per_host: Ray backend: devices each host exposes. This
        process traces and lowers against as many of its own CPU devices
        (stand-ins, ``num_cpu_devices`` defaults to ``hosts * devices_per_host``).
      platform: Ray backend: ``"cpu"`` (CPU devices, the default) or
        ``"gpu"``: each host asks Ray for ``devices_per_host`` GPUs
        (``num_gpus``) and runs on them.
      replace_lost_hosts: Ray backend: an island that lost a host (and with
        it the island's other hosts) is rebuilt on new hosts in the same
        placement-group bundles when Ray has room for them, and placed on
        again. ``False``: it stays out of placement.
      service: Ray backend: join the controller service of this name
        (``pw.serve``) in the Ray cluster at ``address`` instead of starting
        hosts: this process becomes one of the service's client processes,
        sharing its hosts with the others. ``hosts``, ``devices_per_host``,
        ``islands`` and ``platform`` come from the service (give them only
        to check them: one that differs is a ``ClusterError``);
        ``replace_lost_hosts`` given is refused when it differs from the
        service's (its own ``pw.serve(replace_lost_hosts=...)`` decides):
        ``False`` against a service that rebuilds lost islands, ``True``
        against one that does not.
      client_name: with ``service``: this process's name in the service's
        stats and for ``pw.share(future, client=...)`` (default
        ``"<hostname>:<pid>"``).

    Returns:
      The :class:`Cluster`. Calling ``init`` again with the same arguments
      returns it unchanged. Joined to a controller service, the same join
      (``service``, ``address``, ``client_name`` and the rest) returns it after
      checking the hosts' shape given again, as a first join does, and that
      the service still serves this process (``ClusterError`` if not: call
      ``pw.shutdown()`` first).

    Raises:
      ClusterError: an argument of the wrong type or out of range (the message
        says what was expected), a cluster with other arguments is running
        (call ``pw.shutdown()`` first), the arguments cannot be met, or this
        process was forked from one running pathways_jax.

    Example:
      >>> import pathways_jax as pw
      >>> pw.cluster().backend.name
      'local'
    """
    global _current, _shut_down
    replace_given = replace_lost_hosts is not _REPLACE_LOST_HOSTS
    args = checked(
        InitArgs(
            backend=backend,
            num_cpu_devices=num_cpu_devices,
            islands=freeze_islands(islands),
            max_in_flight=max_in_flight,
            max_queued=max_queued,
            inline_dispatch=inline_dispatch,
            scheduler=scheduler,
            starvation_limit=starvation_limit,
            memory_budget=memory_budget,
            backpressure_timeout=backpressure_timeout,
            address=address,
            hosts=hosts,
            devices_per_host=devices_per_host,
            platform=platform,
            replace_lost_hosts=replace_lost_hosts if replace_given else True,
            service=service,
            client_name=client_name,
            replace_lost_hosts_given=replace_given,
        )
    )
    if not given(devices_per_host):  # checked() made it a plain int
        args = dataclasses.replace(args, devices_per_host=_DEVICES_PER_HOST)
    with _lock:
        if _current is not None:
            joined = _current.backend
            if args.service is not None and isinstance(joined, ServiceView):
                # The hosts' shape given joining a service only checks the service's: the same join
                # with other checks is the same cluster, if they hold (a joined process's pw.init
                # skipped them, and returned a cluster whose service was gone).
                if _service_join(args) == _service_join(_current._init_args):
                    joined.check_again(args)
                    return _current
            elif _current._init_args == args:
                return _current
            raise errors.ClusterError(
                f"pw.init{args.describe()} was called, but a cluster started with "
                f"pw.init{_current._init_args.describe()} is running (they differ in "
                f"{args.differences(_current._init_args)}). Call pw.shutdown() first to start one "
                "with other arguments."
            )
        from pathways_jax._src.runtime.controller import refuse_if_forked

        refuse_if_forked()  # JAX's runtime does not survive a fork: the new cluster could run nothing
        _finish_closing(time.monotonic() + _INTERRUPTED_CLOSE_S)  # one a second Ctrl-C cut short
        started = registry.start(args.backend, args)
        try:
            budget = device_budget([d for group in started.islands for d in group], args.memory_budget)
        except errors.ClusterError:
            started.close(_START_FAILED_CLOSE_S)
            raise
        _current = Cluster(
            started,
            args,
            args.max_in_flight,
            args.inline_dispatch,
            max_queued=args.max_queued,
            scheduler=args.scheduler,
            starvation_limit=args.starvation_limit,
            budget=budget,
            backpressure_timeout=args.backpressure_timeout,
        )
        _shut_down = False
        sink = events.SINK
        if sink is not None:
            sink(events.Devices(_current.device_places()))
        if isinstance(started, HostFleet):
            # Ray registered its own exit hook when it started; exit hooks run last
            # first, so this one stops the controller and the hosts while Ray still runs.
            atexit.register(_shutdown_at_exit)
        return _current


def _service_join(args: InitArgs) -> InitArgs:
    """``args`` without what joining a controller service only checks (the hosts' shape)."""
    return dataclasses.replace(
        args,
        hosts=None,
        islands=None,
        devices_per_host=_DEVICES_PER_HOST,
        platform=_PLATFORM,
        replace_lost_hosts=True,
        replace_lost_hosts_given=False,
    )


def cluster() -> Cluster:
    """The running cluster; the first use in a process starts one with the defaults.

    Raises:
      ClusterError: ``pw.shutdown()`` ended the cluster and ``pw.init`` was not
        called since.
    """
    current = _current
    if current is not None:
        return current
    with _lock:
        if _current is not None:
            return _current
        if _shut_down:
            raise errors.ClusterError(_SHUT_DOWN)
        return init()


def running() -> Cluster | None:
    """The running cluster, or None (never starts one)."""
    return _current


def wait_for_programs() -> None:
    """Waits until the programs submitted so far were dispatched and finished on their devices.

    What ``jax.effects_barrier()`` waits for first (``compat.jax_effects``): a
    program whose computation calls back into Python (``jax.debug.print``,
    ``io_callback``) may still be queued for the controller, and JAX's own
    barrier knows neither it nor the runs dispatched here.
    """
    current = _current
    if current is not None and current._controller is not None:
        current._controller.wait_dispatched()
        # JAX's barrier does not know the runs dispatched here either: their callbacks may not
        # have run (the first call of a program gave back no callback at all before this).
        current._controller.wait_settled()


def shutdown(timeout: float = 60.0) -> None:
    """Finishes queued work, stops the controller and forgets the cluster.

    Returns within ``timeout`` seconds whatever the devices or hosts do (work
    still running then is abandoned). Slices of the old cluster become
    unusable; futures already computed stay readable on the local backend. On
    the Ray backend the host actors end with the cluster and the values on
    them go too (a future whose ``.result()`` was taken keeps its value). Safe
    to call when no cluster runs. A Ctrl-C while it waits ends the wait, not
    the shutdown: every part of the cluster is still told to stop.

    After it, ``pw.cluster()``, ``pw.stats()``, ``pw.devices()`` and program
    calls raise ``ClusterError`` until ``pw.init(...)`` starts a new cluster:
    only the first use in a process starts a default cluster by itself.

    Raises:
      ClusterError: ``timeout`` is not a finite number >= 0.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 <= timeout < math.inf:
        raise errors.ClusterError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}.")
    _close(float(timeout), by_user=True)


def _close(timeout: float, *, by_user: bool) -> None:
    global _current, _shut_down, _closing
    deadline = time.monotonic() + timeout
    try:
        with _lock:
            if _current is not None:
                # Forgotten and noted as closing at once (no call in between, so no signal
                # handler): from here on a Ctrl-C cannot leave it running, forgotten.
                _closing = _current
                _current = None
                if by_user:
                    _shut_down = True
        _finish_closing(deadline)
    except KeyboardInterrupt:
        # The user stops waiting for the close: every part is still told to stop, waiting a
        # moment at most (the controller dispatches what is queued and ends, and so do the
        # other threads). One landing even here leaves the close to the next pw.shutdown(),
        # pw.init() or the process's exit.
        _finish_closing(min(deadline, time.monotonic() + _INTERRUPTED_CLOSE_S))
        raise


def _finish_closing(deadline: float) -> None:
    """Closes the cluster forgotten last, unless its close ended, waiting for it until ``deadline``."""
    global _closing
    closing = _closing
    if closing is not None:
        closing.close(max(0.0, deadline - time.monotonic()))
        if _closing is closing:
            _closing = None


def _shutdown_at_exit() -> None:
    """The exit hook: stops a running cluster without counting as a user's ``pw.shutdown()``."""
    timeout = 60.0
    try:
        # A daemon thread compiling a program now is waited for: inside XLA as the interpreter
        # finalises, it aborted the process. One that would start a compile from here is held.
        timeout = context.begin_exit(timeout)
        current = _current
        # A controller service's client leaves at once (Cluster.close): the service drops what it
        # still queues for this process, so waiting here for the runs queued to finish only sent
        # them to be dropped, one window at a time: a long queue held the exit up to the minute.
        # (Its programs have no host callbacks to wait for: the Ray backend refuses them.)
        if (
            current is not None
            and current._controller is not None
            and not isinstance(current.backend, ServiceView)
        ):
            # Not a minute for a host callback that never returns (exit_wait): a few seconds.
            timeout = exit_wait.exit_timeout(current._controller, timeout)
    except KeyboardInterrupt:  # a Ctrl-C as the exit waits: every part is still told to stop
        _close(_INTERRUPTED_CLOSE_S, by_user=False)
        raise
    except Exception:  # the watch failed (a thread's clock gone meanwhile): the close waits as before
        logging.exception("pathways_jax: at exit, watching for stuck host callbacks failed")
    _close(timeout, by_user=False)


def _forget_shutdown() -> None:
    """tests: act as a fresh process (the next use starts a default cluster again)."""
    global _shut_down
    with _lock:
        _shut_down = False


# Stop the controller before the interpreter finalises: a dispatch thread still
# inside XLA while the runtime is torn down can abort the process at exit.
atexit.register(_shutdown_at_exit)
