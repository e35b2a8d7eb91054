"""Cost profiles: every figure the simulator charges, in seconds and bytes per second.

A profile is JSON with one section per part of the system (``controller``,
``hosts``, ``device``, ``ici``, ``dcn``, ``jax``) and a ``sources`` object that
says where each figure comes from (a measurement, a datasheet, the paper).
Two ship with the package (``profiles/``): ``cpu_2core`` (measured by
``python -m pathways_jax.sim calibrate`` on the machine that built it) and
``tpu_v4`` (public figures). :func:`load_profile` takes a name or a path.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from pathways_jax.sim._errors import ProfileError

PROFILES_DIR = pathlib.Path(__file__).resolve().parent / "profiles"


@dataclasses.dataclass(frozen=True, slots=True)
class ControllerCosts:
    """What the controller's thread spends (the single controller: one at a time).

    Attributes:
      run_s: per run: submission, scheduling, the run's bookkeeping.
      node_s: per node dispatched (on the local backend this includes
        enqueueing the executable on the devices).
      transfer_s: per transfer (move) dispatched.
      run_at_s: optional, by device count: ``run_s`` for a run whose widest
        node is on that many CPU devices of the local backend (the
        controller's threads' CPU seconds; on CPU devices they move with the
        device count). Where empty, ``run_s`` at every count.
      node_at_s: optional, by device count: ``node_s`` for a node on that
        many CPU devices of the local backend (its executable's enqueue
        included). Where empty, ``node_s`` at every count.
    """

    run_s: float = 0.0
    node_s: float = 0.0
    transfer_s: float = 0.0
    run_at_s: Mapping[int, float] = dataclasses.field(default_factory=dict)
    node_at_s: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def run(self, devices: int) -> float:
        """``run_s`` for a run whose widest node is on ``devices`` devices."""
        return _by_count(self.run_at_s, devices) if self.run_at_s else self.run_s

    def node(self, devices: int) -> float:
        """``node_s`` for a node on ``devices`` devices."""
        return _by_count(self.node_at_s, devices) if self.node_at_s else self.node_s


@dataclasses.dataclass(frozen=True, slots=True)
class HostCosts:
    """Remote hosts (the Ray backend; every multi-host cluster): one message per host per run.

    Where the controller sends runs to hosts, these replace the controller's
    per-node costs: a run names a plan its hosts hold, and each host walks it.

    Attributes:
      message_s: the controller's cost of sending one host its part of a run
        (serialisation, the send, its answer's share): paid once per host per
        run, one after another (``SimCluster(fanout="tree")``: once per message
        the controller sends, and by each host per message it forwards).
      latency_s: one-way latency of that message to the host.
      run_s: the host's cost of receiving a run's message.
      enqueue_s: the host's cost of enqueueing one node on its devices.
      dispatch_s: the controller's cost per run of sending it to hosts, beyond
        ``controller.run_s`` and the messages (the Ray backend: the run's
        records, its hosts' answers).
      node_s: the controller's cost per node (and transfer) of a run it sends
        to hosts (instead of ``controller.node_s``/``transfer_s``).
      broadcast_s: ``SimCluster(fanout="broadcast")``: the controller's fixed cost of
        the one send of a run's messages to all its hosts.
      broadcast_host_s: ``SimCluster(fanout="broadcast")``: the controller's cost per
        host of that send (its part's encoding), instead of ``message_s``.
    """

    message_s: float = 0.0
    latency_s: float = 0.0
    run_s: float = 0.0
    enqueue_s: float = 0.0
    dispatch_s: float = 0.0
    node_s: float = 0.0
    broadcast_s: float = 0.0
    broadcast_host_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceCosts:
    """Device time of one node.

    A node on ``k`` devices lasts ``launch_s(k) + max(flops / flops_per_s,
    bytes / bytes_per_s)`` (per device: the work split over its ``k`` devices)
    plus its collectives (:class:`LinkCosts` of ICI).

    Attributes:
      launch_s: fixed cost of one executable, by device count (``{"1": s, "8": s}``;
        interpolated in log2 of the count, the last entry beyond the table).
      flops_per_s: one device's throughput (peak times the utilisation it reaches).
      bytes_per_s: one device's memory bandwidth.
      computation_s: device time of one of the dispatch benchmark's computations
        (a scalar all-reduce and an add) inside a fused node, by device count:
        what synthetic dispatch workloads charge per computation.
      shared_cpu: by device count, the device seconds a node loses per second
        of the controller's work while it runs: 0 for accelerators; for CPU
        devices, whose threads run on the controller's cores, up to 1 once
        their threads fill the cores (local backend only).
      inline: by device count, the fraction of a node's device time beyond
        one ``computation_s`` node's that the controller's thread spends
        inside the call that enqueues it (XLA:CPU runs a 1-device executable
        on the calling thread: about 1, above 1 where the dispatch of a longer
        node costs more than its device time; 0 for accelerators; local
        backend only).
      launch_cpu_s: optional, by device count: the CPU seconds the calling
        thread spends inside a ``jax.jit`` call of one computation (CPU
        devices). ``launch_s`` was measured with that thread's work on the
        same cores, so the devices lose only the controller's work beyond it
        (``shared_cpu``). Where empty, zero.
    """

    launch_s: Mapping[int, float] = dataclasses.field(default_factory=lambda: {1: 0.0})
    flops_per_s: float = math.inf
    bytes_per_s: float = math.inf
    computation_s: Mapping[int, float] = dataclasses.field(default_factory=lambda: {1: 0.0})
    shared_cpu: Mapping[int, float] = dataclasses.field(default_factory=lambda: {1: 0.0})
    inline: Mapping[int, float] = dataclasses.field(default_factory=lambda: {1: 0.0})
    launch_cpu_s: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def launch(self, devices: int) -> float:
        return _by_count(self.launch_s, devices)

    def computation(self, devices: int) -> float:
        return _by_count(self.computation_s, devices)

    def inline_fraction(self, devices: int) -> float:
        return _by_count(self.inline, devices)

    def shared(self, devices: int) -> float:
        return _by_count(self.shared_cpu, devices)

    def launch_cpu(self, devices: int) -> float:
        return _by_count(self.launch_cpu_s, devices) if self.launch_cpu_s else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class LinkCosts:
    """An interconnect: ``latency_s + bytes / bytes_per_s`` a transfer.

    For ICI collectives over ``k`` devices the simulator charges a ring:
    ``latency_s * ceil(log2 k) + 2 (k-1)/k * bytes / bytes_per_s``. For DCN the
    bandwidth is per host: a transfer sharded over ``h`` hosts moves ``h`` times as fast.
    """

    latency_s: float = 0.0
    bytes_per_s: float = math.inf

    def transfer(self, nbytes: float, parallel: int = 1) -> float:
        return self.latency_s + nbytes / (self.bytes_per_s * max(parallel, 1))

    def all_reduce(self, nbytes: float, devices: int) -> float:
        if devices <= 1:
            return 0.0
        steps = math.ceil(math.log2(devices))
        return self.latency_s * steps + 2 * (devices - 1) / devices * nbytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """Every cost the simulator charges. All fields default to zero cost.

    Attributes:
      name: the profile's name.
      controller, hosts, device, ici, dcn: the costs of each part.
      hosts_busy: the ``hosts`` costs measured with no idle core, or None
        (then ``hosts`` everywhere). Hosts that share one machine
        (``SimCluster(cores=n)``) pay ``hosts`` while they and the controller fit
        its cores and these from twice as many processes as cores, in
        proportion in between: a process's CPU seconds per unit of work move
        with the load (on the machine that built ``cpu_2core``, over the
        runtime's ZeroMQ channel, a host's ``run_s`` rises from 73 to 114 µs
        when no core is idle).
      jax_call_s: plain JAX's cost of one jitted call on one host (the
        multi-controller baseline: every host pays it in parallel).
      in_flight: executables in flight per island before the controller waits.
      host_in_flight: the same bound where hosts apply it (remote hosts).
      devices_per_host: devices attached to one host (a cluster's default).
      sources: where each figure comes from (``"section.field": "..."``).
      meta: anything else the file holds (machine, date, notes).
    """

    name: str = "custom"
    controller: ControllerCosts = ControllerCosts()
    hosts: HostCosts = HostCosts()
    hosts_busy: HostCosts | None = None
    device: DeviceCosts = DeviceCosts()
    ici: LinkCosts = LinkCosts()
    dcn: LinkCosts = LinkCosts()
    jax_call_s: float = 0.0
    in_flight: int = 8
    host_in_flight: int = 64
    devices_per_host: int = 1
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        """The profile as the JSON object :func:`load_profile` reads."""

        def section(obj: Any) -> dict:
            out = {}
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                if isinstance(v, Mapping) and not v:
                    continue  # an optional table left empty: absent from the file
                out[f.name] = {str(k): x for k, x in v.items()} if isinstance(v, Mapping) else v
                if out[f.name] == math.inf:
                    out[f.name] = None  # JSON has no infinity: null reads back as unbounded
            return out

        return {
            "name": self.name,
            "controller": section(self.controller),
            "hosts": section(self.hosts),
            **({"hosts_busy": section(self.hosts_busy)} if self.hosts_busy is not None else {}),
            "device": section(self.device),
            "ici": section(self.ici),
            "dcn": section(self.dcn),
            "jax": {"call_s": self.jax_call_s},
            "in_flight": self.in_flight,
            "host_in_flight": self.host_in_flight,
            "devices_per_host": self.devices_per_host,
            "sources": dict(self.sources),
            **({"meta": dict(self.meta)} if self.meta else {}),
        }

    def save(self, path: str | os.PathLike) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _by_count(table: Mapping[int, float], devices: int) -> float:
    """``table`` at ``devices``: exact, interpolated in log2 between entries, else the nearest end."""
    keys = sorted(table)
    if devices in table:
        return float(table[devices])
    i = bisect.bisect_left(keys, devices)
    if i == 0:
        return float(table[keys[0]])
    if i == len(keys):
        return float(table[keys[-1]])
    lo, hi = keys[i - 1], keys[i]
    w = (math.log2(devices) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return float(table[lo] * (1 - w) + table[hi] * w)


def _number(where: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ProfileError(f"profile field {where} must be a number, got {value!r}.")
    if value < 0 or (positive and value == 0):
        raise ProfileError(f"profile field {where} must be {'> 0' if positive else '>= 0'}, got {value!r}.")
    return float(value)


def _section(cls: type, name: str, data: Any, *, rates: tuple[str, ...] = ()) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        raise ProfileError(f"profile section {name!r} must be an object, got {type(data).__name__}.")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(
            f"profile section {name!r} has unknown fields {unknown}; expected some of {sorted(known)}."
        )
    values: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{name}.{key}"
        if isinstance(value, Mapping):
            table = {}
            for count, seconds in value.items():
                try:
                    n = int(count)
                except ValueError:
                    n = 0
                if n < 1:
                    raise ProfileError(f"profile field {where} is keyed by device count >= 1, got {count!r}.")
                table[n] = _number(f"{where}[{count}]", seconds)
            if not table:
                raise ProfileError(f"profile field {where} is an empty table.")
            values[key] = table
        elif value is None:  # JSON has no infinity: null means unbounded (a rate) or zero
            values[key] = math.inf if key in rates else 0.0
        else:
            values[key] = _number(where, value, positive=key in rates)
    return cls(**values)


def profile_from_json(data: Any, *, name: str | None = None) -> Profile:
    """A :class:`Profile` from its JSON object (as :meth:`Profile.to_json` writes it).

    Raises:
      ProfileError: a section or field is unknown, or a figure is not a number >= 0.
    """
    if not isinstance(data, Mapping):
        raise ProfileError(f"a profile is a JSON object, got {type(data).__name__}.")
    known = {
        "name", "controller", "hosts", "hosts_busy", "device", "ici", "dcn", "jax", "in_flight",
        "host_in_flight", "devices_per_host", "sources", "meta",
    }  # fmt: skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"profile has unknown sections {unknown}; expected some of {sorted(known)}.")
    jax_section = data.get("jax") or {}
    counts = {}
    for key, default in (("in_flight", 8), ("host_in_flight", 64), ("devices_per_host", 1)):
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProfileError(f"profile field {key} must be an integer >= 1, got {value!r}.")
        counts[key] = value
    return Profile(
        name=str(data.get("name", name or "custom")),
        controller=_section(ControllerCosts, "controller", data.get("controller")),
        hosts=_section(HostCosts, "hosts", data.get("hosts")),
        hosts_busy=_section(HostCosts, "hosts_busy", data["hosts_busy"]) if data.get("hosts_busy") else None,
        device=_section(DeviceCosts, "device", data.get("device"), rates=("flops_per_s", "bytes_per_s")),
        ici=_section(LinkCosts, "ici", data.get("ici"), rates=("bytes_per_s",)),
        dcn=_section(LinkCosts, "dcn", data.get("dcn"), rates=("bytes_per_s",)),
        jax_call_s=_number("jax.call_s", jax_section.get("call_s", 0.0)),
        sources=dict(data.get("sources") or {}),
        meta=dict(data.get("meta") or {}),
        **counts,
    )


def builtin_profiles() -> tuple[str, ...]:
    """The names of the profiles that ship with the package."""
    return tuple(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))


def load_profile(profile: str | os.PathLike | Profile | Mapping) -> Profile:
    """A profile by name (``"cpu_2core"``, ``"tpu_v4"``), path to a JSON file, JSON object or itself.

    Raises:
      ProfileError: no such profile, or the file is not a valid profile.

    Example:
      >>> from pathways_jax import sim
      >>> sim.load_profile("tpu_v4").devices_per_host
      4
    """
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, Mapping):
        return profile_from_json(profile)
    if not isinstance(profile, str | os.PathLike):
        raise ProfileError(
            f"a profile is a name, a path, a JSON object or a Profile, got {type(profile).__name__}."
        )
    text = os.fspath(profile)
    path = pathlib.Path(text)
    if not path.suffix and os.sep not in text:
        path = PROFILES_DIR / f"{text}.json"
        if not path.is_file():
            raise ProfileError(
                f"no profile named {text!r}; the built-in profiles are {list(builtin_profiles())}, "
                "or pass the path of a JSON profile (python -m pathways_jax.sim calibrate writes one)."
            )
    if not path.is_file():
        raise ProfileError(f"no profile file at {text!r}.")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{text!r} is not a JSON profile: {exc}") from exc
    return profile_from_json(data, name=path.stem)
