"""A simulated cluster: hosts, their devices, islands, and the profile of what everything costs."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import Literal

from pathways_jax import errors
from pathways_jax._src.runtime import scheduler as scheduler_lib
from pathways_jax._src.runtime.controller import DEVICE_WINDOW
from pathways_jax.sim._fanout import FANOUTS, Fanout
from pathways_jax.sim._profile import Profile, load_profile

Dispatch = Literal["local", "hosts"]


def _count(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise errors.ResourceError(f"pw.sim.SimCluster: {name} must be an integer >= {low}, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class SimCluster:
    """The cluster a simulation runs on.

    Devices are numbered ``0 .. hosts * devices_per_host - 1``; host ``h`` owns
    devices ``h * devices_per_host ..``; the hosts are split evenly into
    ``islands`` (consecutive hosts share an island, and ICI).

    Args:
      hosts: how many hosts.
      devices_per_host: devices per host (default: the profile's).
      profile: the costs: a :class:`Profile`, the name of a built-in profile
        (``"cpu_2core"``, ``"tpu_v4"``) or the path of a JSON profile.
      islands: how many islands the hosts form (must divide ``hosts``).
      dispatch: ``"local"``: the controller enqueues on the devices itself (the
        local backend); ``"hosts"``: it sends each host one message per run and
        the host enqueues (the Ray backend, any multi-host cluster). Default:
        local for one host, hosts otherwise.
      in_flight: executables in flight per island (local) or per host (hosts)
        before dispatch waits; default: the profile's.
      device_in_flight: single-device executables in flight per device (local)
        before dispatch waits; default: the runtime's (4). (``device_window``,
        its former name, still works and warns.)
      scheduler: the controller's policy among clients (``"fifo"``, ``"fair"``, ``"priority"``).
      cores: the controller and every host share one machine of this many CPU
        cores (several Ray hosts on one workstation), and their devices are
        that machine's CPU devices: the controller's and the hosts' work and
        every node's device time each hold one core while they run, and wait
        for one when all are busy; as the hosts and the controller go from
        as many as the cores to twice as many, the hosts' costs go from the
        profile's ``hosts`` to its ``hosts_busy`` (measured with no idle
        core), where it has them. ``None`` (default): each host and the
        controller have cores of their own. Only with ``dispatch="hosts"`` (on
        the local backend, ``device.shared_cpu`` of the profile models it).
      fanout: how a run's messages reach its hosts (``dispatch="hosts"``):
        ``"serial"`` (default, the runtime's way): the controller sends each
        host its message, one after another; ``"tree"``: the controller sends
        to ``fanout_degree`` hosts a round and every host reached forwards to
        as many more, so the controller's messages grow with
        ``log(hosts)`` and each hop adds its latency; ``"broadcast"`` (the
        runtime's channel): ONE send carries every host's part, the
        controller paying ``hosts.broadcast_s`` once and
        ``hosts.broadcast_host_s`` a host (see :mod:`pathways_jax.sim._fanout`).
      fanout_degree: ``k`` of ``fanout="tree"``: messages each sender sends a round.

    Raises:
      ResourceError: a size is not a positive integer, ``islands`` does not divide
        ``hosts``, ``cores`` or ``fanout="tree"`` is given with ``dispatch="local"``,
        or ``fanout`` is not one of ``"serial"``, ``"tree"``, ``"broadcast"``.
      ProfileError: the profile cannot be found or read.

    Example:
      >>> from pathways_jax import sim
      >>> sim.SimCluster(hosts=16, profile="tpu_v4").devices
      64
    """

    hosts: int
    devices_per_host: int
    profile: Profile
    islands: int
    dispatch: Dispatch
    in_flight: int
    scheduler: str
    device_in_flight: int
    cores: int | None
    fanout: Fanout
    fanout_degree: int

    def __init__(
        self,
        hosts: int = 1,
        devices_per_host: int | None = None,
        profile: str | os.PathLike | Profile | Mapping = "cpu_2core",
        *,
        islands: int = 1,
        dispatch: Dispatch | None = None,
        in_flight: int | None = None,
        scheduler: Literal["fifo", "fair", "priority"] = "fifo",
        device_in_flight: int | None = None,
        cores: int | None = None,
        fanout: Fanout = "serial",
        fanout_degree: int = 4,
        device_window: int | None = None,
    ):
        if device_window is not None:
            warnings.warn(
                "pw.sim.SimCluster(device_window=...) is now device_in_flight=...; the old name goes in a "
                "later release.",
                DeprecationWarning,
                stacklevel=2,
            )
            if device_in_flight is None:
                device_in_flight = device_window
        prof = load_profile(profile)
        hosts = _count("hosts", hosts)
        per_host = _count(
            "devices_per_host", prof.devices_per_host if devices_per_host is None else devices_per_host
        )
        islands = _count("islands", islands)
        if hosts % islands:
            raise errors.ResourceError(
                f"pw.sim.SimCluster: {islands} islands cannot split {hosts} hosts evenly; "
                "pass an island count that divides the host count."
            )
        mode = dispatch if dispatch is not None else ("local" if hosts == 1 else "hosts")
        if mode not in ("local", "hosts"):
            raise errors.ResourceError(
                f"pw.sim.SimCluster: dispatch must be 'local' or 'hosts', got {mode!r}."
            )
        if mode == "local" and hosts > 1:
            raise errors.ResourceError(
                f"pw.sim.SimCluster: dispatch='local' drives the devices of one host, got hosts={hosts}."
            )
        window = (
            in_flight
            if in_flight is not None
            else (prof.in_flight if mode == "local" else prof.host_in_flight)
        )
        if scheduler not in scheduler_lib.POLICIES:
            raise errors.ResourceError(
                f"pw.sim.SimCluster: scheduler must be one of {scheduler_lib.POLICIES}, got {scheduler!r}."
            )
        if cores is not None:
            cores = _count("cores", cores)
            if mode == "local":
                raise errors.ResourceError(
                    "pw.sim.SimCluster: cores= models hosts that share one machine (dispatch='hosts'); "
                    "with dispatch='local' the profile's device.shared_cpu models the shared cores."
                )
        if fanout not in FANOUTS:
            raise errors.ResourceError(f"pw.sim.SimCluster: fanout must be one of {FANOUTS}, got {fanout!r}.")
        if fanout != "serial" and mode == "local":
            raise errors.ResourceError(
                f"pw.sim.SimCluster: fanout={fanout!r} is how a run's messages reach its hosts (dispatch='hosts'); "
                "with dispatch='local' the controller sends no messages."
            )
        for name, value in (
            ("hosts", hosts),
            ("devices_per_host", per_host),
            ("profile", prof),
            ("islands", islands),
            ("dispatch", mode),
            ("in_flight", _count("in_flight", window)),
            ("scheduler", scheduler),
            (
                "device_in_flight",
                _count("device_in_flight", DEVICE_WINDOW if device_in_flight is None else device_in_flight),
            ),
            ("cores", cores),
            ("fanout", fanout),
            ("fanout_degree", _count("fanout_degree", fanout_degree)),
        ):
            object.__setattr__(self, name, value)

    @property
    def device_window(self) -> int:
        """The former name of :attr:`device_in_flight`."""
        warnings.warn("SimCluster.device_window is now device_in_flight.", DeprecationWarning, stacklevel=2)
        return self.device_in_flight

    @property
    def devices(self) -> int:
        """How many devices the cluster has."""
        return self.hosts * self.devices_per_host

    @property
    def hosts_per_island(self) -> int:
        return self.hosts // self.islands

    @property
    def devices_per_island(self) -> int:
        return self.hosts_per_island * self.devices_per_host

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    def island_of(self, device: int) -> int:
        return self.host_of(device) // self.hosts_per_island

    def island_devices(self, island: int) -> tuple[int, int]:
        """The ``[start, stop)`` device range of ``island``."""
        if not 0 <= island < self.islands:
            raise errors.ResourceError(f"pw.sim.SimCluster has islands 0..{self.islands - 1}, not {island}.")
        return island * self.devices_per_island, (island + 1) * self.devices_per_island

    def __repr__(self) -> str:
        return (
            f"sim.SimCluster(hosts={self.hosts}, devices_per_host={self.devices_per_host}, "
            f"islands={self.islands}, profile={self.profile.name!r}, dispatch={self.dispatch!r}, "
            f"in_flight={self.in_flight}"
            + (f", cores={self.cores}" if self.cores else "")
            + (f", fanout='tree', fanout_degree={self.fanout_degree})" if self.fanout == "tree" else "")
            + (", fanout='broadcast')" if self.fanout == "broadcast" else "")
            + (")" if self.fanout == "serial" else "")
        )
