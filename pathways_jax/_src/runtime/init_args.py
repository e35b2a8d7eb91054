"""``pw.init``'s arguments: their defaults, their record, and the checks that normalise them."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, overload

import jax

from pathways_jax._src.backends import registry
from pathways_jax._src.core import checks, errors
from pathways_jax._src.runtime import scheduler as scheduler_lib

# How many executables may be in flight on one island before the controller
# waits for the oldest. Unbounded asynchronous dispatch of collectives
# deadlocks XLA's CPU rendezvous (DESIGN §5: 64+ in flight on 8 devices); 16
# was measured safe. 8 leaves a margin and keeps the scheduling policies in
# force: what is in flight is out of their hands, and with 16 two clients'
# runs on a 4-device slice all went straight into XLA ("fair" 1:3 measured
# 0.50/0.50, tests/test_policies.py). It costs throughput where a run's device
# time is short beside its dispatch: on 2 CPU devices, one all-reduce a run,
# 207 µs a run with 8 in flight against 141 with 16 (4-8 devices: 3-11%).
DEFAULT_IN_FLIGHT = 8
# How many runs one client may have queued (submitted, not dispatched yet)
# before a caller that would queue more waits.
DEFAULT_MAX_QUEUED = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class InitArgs:
    """The arguments a cluster was started with: ``pw.init`` with equal ones returns it."""

    backend: str
    num_cpu_devices: int | None
    islands: Any
    max_in_flight: int
    max_queued: int
    inline_dispatch: bool
    scheduler: str
    starvation_limit: int
    memory_budget: int | float | None
    backpressure_timeout: float | None
    address: str | None
    hosts: int | None
    devices_per_host: int
    platform: str = "cpu"
    replace_lost_hosts: bool = True
    service: str | None = None
    client_name: str | None = None
    # Whether replace_lost_hosts was given: checked against a service joined, and not compared,
    # so pw.init(replace_lost_hosts=True) returns the cluster pw.init() started, as for platform.
    replace_lost_hosts_given: bool = dataclasses.field(default=False, compare=False)

    def differences(self, running: InitArgs) -> str:
        """The arguments that differ from ``running``'s, as ``name=this (running: that)``."""
        return ", ".join(
            f"{field.name}={getattr(self, field.name)!r} (running: {getattr(running, field.name)!r})"
            for field in dataclasses.fields(self)
            if field.compare and getattr(self, field.name) != getattr(running, field.name)
        )

    def describe(self) -> str:
        """The arguments as a ``pw.init(...)`` call would spell them."""
        hosts = (self.address, self.hosts, self.devices_per_host, self.platform, self.replace_lost_hosts)
        where = (
            f", address={self.address!r}, hosts={self.hosts!r}, devices_per_host={self.devices_per_host!r}, "
            f"platform={self.platform!r}, replace_lost_hosts={self.replace_lost_hosts!r}, "
            f"service={self.service!r}, client_name={self.client_name!r}"
            if hosts != (None, None, 1, "cpu", True)
            or self.service is not None
            or self.client_name is not None
            else ""
        )
        return (
            f"(backend={self.backend!r}{where}, num_cpu_devices={self.num_cpu_devices!r}, "
            f"islands={self.islands!r}, max_in_flight={self.max_in_flight!r}, "
            f"max_queued={self.max_queued!r}, inline_dispatch={self.inline_dispatch!r}, "
            f"scheduler={self.scheduler!r}, starvation_limit={self.starvation_limit!r}, "
            f"memory_budget={self.memory_budget!r}, backpressure_timeout={self.backpressure_timeout!r})"
        )


@overload
def count(name: str, value: object, minimum: int) -> int: ...
@overload
def count(name: str, value: object, minimum: int, *, optional: bool) -> int | None: ...
def count(name: str, value: object, minimum: int, *, optional: bool = False) -> int | None:
    """``value`` as an int if it is one (not a bool) and at least ``minimum``; else ClusterError."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        expected = f"an int >= {minimum}" + (" or None" if optional else "")
        raise errors.ClusterError(f"{name} must be {expected}, got {value!r} ({type(value).__name__}).")
    return int(value)


def seconds(name: str, value: object) -> float | None:
    """``value`` as seconds if it is None or a finite number >= 0 (not a bool); else ClusterError."""
    if value is None:
        return None
    if not checks.is_seconds(value):
        raise errors.ClusterError(
            f"{name} must be None (no limit) or a finite number of seconds >= 0, got {value!r} "
            f"({type(value).__name__})."
        )
    return float(value)


def checked(args: InitArgs) -> InitArgs:
    """Checks every ``pw.init`` argument's type and range; returns them normalised (plain ints, floats)."""
    if not isinstance(args.backend, str) or args.backend not in registry.names():
        raise errors.ClusterError(
            f"backend={args.backend!r} is not a backend; use one of {list(registry.names())}."
        )
    if not isinstance(args.scheduler, str) or args.scheduler not in scheduler_lib.POLICIES:
        raise errors.ClusterError(
            f"scheduler={args.scheduler!r} is not a scheduling policy; use one of {scheduler_lib.POLICIES}."
        )
    if not isinstance(args.inline_dispatch, bool):
        raise errors.ClusterError(f"inline_dispatch must be True or False, got {args.inline_dispatch!r}.")
    if args.address is not None and not isinstance(args.address, str):
        raise errors.ClusterError(f"address must be None or a Ray address string, got {args.address!r}.")
    _check_islands(args.islands)
    _check_budget(args.memory_budget)
    if args.client_name is not None and (
        args.service is None or not isinstance(args.client_name, str) or not args.client_name
    ):
        raise errors.ClusterError(
            f"client_name={args.client_name!r}: it names this process in a controller service; pass a "
            "non-empty string together with service='<name>'."
        )
    if args.platform not in ("cpu", "gpu"):
        raise errors.ClusterError(f"platform must be 'cpu' or 'gpu', got {args.platform!r}.")
    if not isinstance(args.replace_lost_hosts, bool):
        raise errors.ClusterError(
            f"replace_lost_hosts must be True or False, got {args.replace_lost_hosts!r}."
        )
    if args.hosts is not None and (
        isinstance(args.hosts, bool) or not isinstance(args.hosts, numbers.Integral) or args.hosts < 1
    ):
        raise errors.ClusterError(
            f"pw.init(backend={args.backend!r}) needs hosts=N, a positive int (one host actor per island); "
            f"got {args.hosts!r}."
        )
    if (
        isinstance(args.devices_per_host, bool)
        or not isinstance(args.devices_per_host, numbers.Integral)
        or args.devices_per_host < 1
    ):
        raise errors.ClusterError(f"devices_per_host must be a positive int, got {args.devices_per_host!r}.")
    return dataclasses.replace(
        args,
        num_cpu_devices=count("num_cpu_devices", args.num_cpu_devices, 1, optional=True),
        max_in_flight=count("max_in_flight", args.max_in_flight, 1),
        max_queued=count("max_queued", args.max_queued, 1),
        starvation_limit=count("starvation_limit", args.starvation_limit, 0),
        backpressure_timeout=seconds("backpressure_timeout", args.backpressure_timeout),
        hosts=None if args.hosts is None else int(args.hosts),
        devices_per_host=int(args.devices_per_host),
    )


def _check_islands(islands: Any) -> None:
    """``islands`` is None, an int, or groups of int device ids (ranges are checked when carving)."""
    if islands is None or (isinstance(islands, int) and not isinstance(islands, bool)):
        return
    if isinstance(islands, tuple) and all(
        isinstance(group, tuple)
        and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in group)
        for group in islands
    ):
        return
    raise errors.ClusterError(
        f"islands must be None, an int, or a list of lists of int device ids; got {islands!r}."
    )


def _check_budget(memory_budget: object) -> None:
    """``memory_budget`` is None, an int > 0 (bytes) or a float fraction in (0, 1]."""
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int | float):
        raise errors.ClusterError(
            f"memory_budget must be None, an int (bytes) or a float fraction in (0, 1], got {memory_budget!r}."
        )
    if isinstance(memory_budget, int):
        if memory_budget <= 0:
            raise errors.ClusterError(f"memory_budget must be > 0 bytes, got {memory_budget!r}.")
    elif not 0 < memory_budget <= 1:  # NaN too
        raise errors.ClusterError(f"a fractional memory_budget must be in (0, 1], got {memory_budget!r}.")


def device_budget(devices: list[jax.Device], memory_budget: int | float | None) -> dict[int, int] | None:
    """Bytes per device id for ``pw.init(memory_budget=...)`` (checked by :func:`checked`)."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, int):
        return {d.id: memory_budget for d in devices}
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


def freeze_islands(islands: Any) -> Any:
    """``islands`` with its groups as tuples (comparable with a running cluster's)."""
    if islands is None or isinstance(islands, int | str | bytes):
        return islands
    try:
        return tuple(tuple(group) for group in islands)
    except TypeError:
        return islands
