"""The Backend protocol: everything the controller asks of where the devices live.

The controller decides *when* a run goes (queues, policy, budget, in-flight
windows); a backend decides *how*: it prepares a lowered plan for its
devices, dispatches a run's steps, says which dispatched executables are
settled, reports lost hosts and closes. The controller holds one backend and
never asks which kind it is, so a backend is added by implementing this
protocol (see ``local.py`` and ``ray.py``), not by touching the controller.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

from pathways_jax._src.compile.lowering import Prepared

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan


class Dispatched(NamedTuple):
    """What :meth:`Backend.execute` gives back for a run it dispatched (made once a run: a
    NamedTuple, made in about 60% of a frozen slotted dataclass's time).

    Attributes:
      values: the run's values by slot (``values[slot]`` for each output slot).
      markers: for each of the plan's accounting groups, the array (or host
        completion) whose readiness says the group's devices are done.
      copies: by output position, the outputs of ``plan.published_copies`` the
        backend made as buffers of their own itself (None: the controller copies
        ``values[slot]``).
    """

    values: Any
    markers: tuple = ()
    copies: dict[int, Any] | None = None


class StepFailed(Exception):
    """A run's dispatch failed in the user's part of it (a node, a move, a send).

    The controller fails that run alone, with ``where`` (which program, run
    and step) as the message and ``cause`` chained.
    """

    def __init__(self, where: str, cause: BaseException):
        super().__init__(where)
        self.where = where
        self.cause = cause


class RunView(Protocol):
    """What a backend reads of a run it dispatches: the runtime's ``runs.Run`` (read only).

    ``env`` holds the run's inputs by slot (the backend may add its values to
    it); ``staged`` what holds its host inputs' copies until it is admitted
    (``None``: nothing), released by the backend once they are on devices.
    """

    @property
    def id(self) -> int: ...
    @property
    def plan(self) -> Plan: ...
    @property
    def env(self) -> list[Any]: ...
    @property
    def staged(self) -> Any: ...
    @property
    def client(self) -> Any: ...


def device_window_key(device_id: int) -> int:
    """The key of the window of runs queued on one device (``plan.windowed``, :class:`Windows`).

    An island's window has the island's index as its key (>= 0): it bounds the
    executables over several devices (or calling back into Python) in flight
    there, whose order must be one on every device. A device's window, keyed
    ``-1 - device_id`` (< 0), bounds the runs queued on that device by its
    single-device executables: without it they would all go to the device at
    once, and the scheduling policy would never choose among them.

    Example:
      >>> device_window_key(0), device_window_key(5)
      (-1, -6)
    """
    return -1 - device_id


class Windows(Protocol):
    """What a backend asks of the controller while it dispatches a run: the in-flight windows.

    A window's key is an island's index, or :func:`device_window_key` of a device.
    """

    def make_room(self, key: int) -> None:
        """Returns once window ``key`` has room for one more executable (or host message)."""
        ...

    def in_flight(self, key: int, marker: Any, run: RunView) -> None:
        """``marker`` (an output, or a host's completion marker) settles when the dispatched work does."""
        ...

    def handed_on(self, consumed: Sequence[Any], marker: Any) -> None:
        """An executable whose output is ``marker`` just took the buffers ``consumed`` (donation).

        A donated array is deleted, and a deleted array no longer says when the
        executable that made it finished: the window entries marked by one of
        ``consumed`` are marked by ``marker`` instead. The executable that took
        a buffer runs after the one that made it, so its end says both are done.
        Optional: a window without it (``getattr``) keeps its entries as they are.
        """
        ...


@runtime_checkable
class Backend(Protocol):
    """A kind of devices the controller dispatches to.

    Attributes:
      name: ``pw.init(backend=...)``'s name for it.
      window_size: executables (or host messages) in flight per island the
        controller allows; ``None``: ``pw.init(max_in_flight=...)``.
      donates: compiled executables may consume donated buffers.
      exports: nodes are also serialized with ``jax.export`` (hosts compile them).
      calls_back: nodes may call back into Python (``jax.pure_callback``).
      stages_inputs: under a memory budget, a queued run's host inputs stay on
        the host and :meth:`execute` puts them on devices once it is admitted.
      islands: the devices, one group per island (placement carves slices
        from them; on hosts, the stand-in devices of this process).
      lost: islands whose host died, with why (empty when nothing can die).
      on_lost: set by the cluster: called with an island whose host died.
    """

    name: str
    islands: tuple[tuple[Any, ...], ...]
    window_size: int | None
    donates: bool
    exports: bool
    calls_back: bool
    stages_inputs: bool
    lost: dict[int, str]
    on_lost: Callable[[int], None] | None

    def prepare(self, plan: Plan) -> Prepared:
        """Finishes lowering ``plan`` for these devices; ``plan`` is not changed.

        Returns its part of the plan: executables or messages per window key
        (an island or a :func:`device_window_key`) that count against the windows,
        the islands a run goes to, how many dispatch reports a run makes to a
        trace, and a part of the backend's own. The runtime runs
        ``plan.with_prepared(...)`` of it.
        """
        ...

    def execute(self, run: RunView, windows: Windows) -> Dispatched:
        """Dispatches ``run`` (its inputs are in ``run.env``); never waits for results.

        Raises :class:`StepFailed` for a failure of the run's own.
        """
        ...

    def settle(self, in_flight: collections.deque) -> None:
        """Drops the settled entries at the front of an island's in-flight deque (never waits)."""
        ...

    def close(self, timeout: float | None) -> None:
        """Releases the devices and hosts; returns within ``timeout`` seconds."""
        ...


class DefaultStr(str):
    """A ``pw.init`` argument left at its default: equal to it, and told apart from it given
    (joining a controller service, the arguments given are checked against the service's)."""

    __slots__ = ()


class DefaultInt(int):
    """:class:`DefaultStr` for an int argument."""

    __slots__ = ()


class DefaultTrue:
    """``pw.init``'s default for ``replace_lost_hosts``: ``True``, told apart from a ``True`` given.

    ``bool`` cannot be subclassed as ``str`` and ``int`` are (:class:`DefaultStr`): this
    sentinel stands in the signature (shown as ``True``), and ``pw.init`` turns it into
    ``True``, recording that it was left out (``replace_lost_hosts_given``).
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "True"

    def __bool__(self) -> bool:
        return True


def given(value: object) -> bool:
    """Whether a ``pw.init`` argument was given (not left at its default, :class:`DefaultStr`)."""
    return not isinstance(value, DefaultStr | DefaultInt)


class StartOptions(Protocol):
    """What a backend's start function reads of ``pw.init``'s (checked) arguments.

    Every ``pw.init`` argument is an attribute of the options a start
    function gets (``registry.start``); these are the ones the built-in
    backends read. A backend ignores those it has no use for.
    """

    @property
    def num_cpu_devices(self) -> int | None: ...
    @property
    def islands(self) -> Any: ...
    @property
    def max_in_flight(self) -> int: ...
    @property
    def address(self) -> str | None: ...
    @property
    def hosts(self) -> int | None: ...
    @property
    def devices_per_host(self) -> int: ...
    @property
    def platform(self) -> str: ...
    @property
    def replace_lost_hosts(self) -> bool: ...
    @property
    def replace_lost_hosts_given(self) -> bool:
        """Whether ``replace_lost_hosts`` was given (False: left at its default, True)."""
        ...

    @property
    def service(self) -> str | None: ...
    @property
    def client_name(self) -> str | None: ...


# --- optional capabilities: a caller checks for one (isinstance), never for a backend's class ---


@runtime_checkable
class HostFleet(Protocol):
    """A backend whose devices live on hosts it reaches over the network (the Ray backend).

    Attributes set by the cluster once it exists:
      collect: forgets the store's values whose futures went (their handles
        went with them; the hosts hear of it even when no program runs).
      slices_of: the cluster's live slices' device ids, by slice id.
      on_restored: called with an island that was rebuilt on new hosts.
    """

    collect: Callable[[], None] | None
    slices_of: Callable[[], Any] | None
    on_restored: Callable[[int], None] | None

    def place_of(self, device: Any) -> tuple[int, int, int]:
        """A stand-in device's island, position among the island's devices, and host."""
        ...

    def host_stats(self, timeout: float = ...) -> dict[int, dict]:
        """Each live host's counters (values, plans, runs), by host."""
        ...

    def mark_lost(self, host: int, why: str, generation: int | None = None) -> None:
        """Treats ``host`` as dead (its island is lost, then rebuilt where it can be)."""
        ...


@runtime_checkable
class Shares(Protocol):
    """A backend whose values other client processes may read (a controller service's client)."""

    def share(self, key: int, reader: str) -> None:
        """Lets client process ``reader`` read this process's value ``key``."""
        ...

    def handle_of(self, array: Any) -> Any:
        """The picklable handle of a value this process holds (``pw.share``)."""
        ...

    def array_of(self, handle: Any) -> Any:
        """This process's value for a handle another process made (``pw.receive``)."""
        ...


@runtime_checkable
class QueuesRuns(Protocol):
    """A backend that queues runs it was handed before they go to the devices (a controller service's
    client: its service queues them), so that a closed client's queued runs are cancelled there too."""

    def cancel_client(self, client_key: int) -> None:
        """Cancels the runs of ``pw.client`` number ``client_key`` that wait to go to the devices."""
        ...


FaultKind = Literal["kill", "hang"]


@runtime_checkable
class Strikes(Protocol):
    """A backend whose hosts fail on purpose when told (``pw.faults``): rehearsals of a lost or hung host."""

    @property
    def hosts(self) -> int:
        """How many hosts there are, numbered from 0."""
        ...

    def strike(self, host: int, kind: FaultKind, at_run: int, timeout: float = ..., at_save: int = 0) -> None:
        """Has ``host`` kill (SIGKILL) or stop (SIGSTOP) its own process: now (``at_run`` and
        ``at_save`` 0; a kill returns once the host is dead), during the ``at_run``-th run it
        starts from now, or as the ``at_save``-th checkpoint save from now starts writing there."""
        ...


@runtime_checkable
class HostWrites(Protocol):
    """A backend whose hosts write and read their own shards of a checkpoint (``compat.host_checkpoints``).

    ``checkpoints`` (``ray_checkpoints.HostCheckpoints``) sends the hosts the
    small messages; the bytes never come to this process.
    """

    checkpoints: Any

    def holds(self, value: Any) -> bool:
        """Whether ``value`` (a future's array) is a value this backend's hosts keep."""
        ...

    def where(self, sharding: Any) -> Any:
        """Where a sharding over this backend's devices lives on its hosts (``ray_plan.Placed``), or None."""
        ...


@runtime_checkable
class ServiceView(Protocol):
    """A backend that is a client of a controller service: the service's own statistics."""

    def service_stats(self, timeout: float = ...) -> dict:
        """The service's view: its clients, queues, hosts and refusals."""
        ...

    def check_again(self, args: StartOptions) -> None:
        """``pw.init`` called again with the arguments this process joined with, the hosts' shape aside:
        ClusterError if the shape given differs from the service's, or the service serves it no more."""
        ...


__all__ = [
    "Backend",
    "DefaultInt",
    "DefaultTrue",
    "DefaultStr",
    "Dispatched",
    "HostFleet",
    "Prepared",
    "RunView",
    "ServiceView",
    "Shares",
    "StartOptions",
    "StepFailed",
    "Strikes",
    "Windows",
    "device_window_key",
    "given",
]
