"""The Ray backend: host actors owning their own devices, driven by the one controller.

``pw.init(backend="ray", hosts=N, devices_per_host=M)`` starts (or connects
to) a Ray cluster and one host actor per host (``ray_host.Host``), placed with
a placement group of one bundle per host. Each host is an island.

**Stand-in devices.** The controller process traces and lowers programs
exactly as on the local backend, against N x M of its own CPU devices that
stand in for the hosts' devices (host ``h`` owns stand-ins ``h*M .. h*M+M-1``):
graphs, plans, shardings, byte counts and the scheduler do not change. What
changes is dispatch: a lowered plan is split into one part per host (its
computations serialized with ``jax.export``, its moves either local puts or
sends/receives between hosts), registered once per host, and each run sends
each participating host ONE message. Values stay on the hosts; a future holds
a :class:`RemoteArray` handle, and ``Future.result()`` fetches the value.

Ray is imported only here, lazily: ``pip install pathways-jax[ray]``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from absl import logging

from pathways_jax._src.backends import ray_host
from pathways_jax._src.backends.base import StepFailed, Window
from pathways_jax._src.backends.ray_host import (
    ExecOp,
    NamedDesc,
    Op,
    PutOp,
    RecvOp,
    RunFailure,
    SendOp,
    ShardingDesc,
    SingleDesc,
)
from pathways_jax._src.core import counts as counters
from pathways_jax._src.core import errors, timeline

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan

_PING_S = 0.25  # how often the monitor looks at every host
_FLUSH_S = 0.05  # how often freed values are sent back to their hosts
_START_TIMEOUT_S = 120.0
_CALL_TIMEOUT_S = 120.0
_CLOSE_TIMEOUT_S = 10.0  # how long close() waits for this side's threads unless told
_WAIT_STEP_S = 0.1  # a wait for a host's answer looks whether the cluster closed this often
_CLOSED = (
    "the cluster was shut down and its Ray hosts with it; values that lived on them are gone. "
    "Call .result() before pw.shutdown() to keep a value."
)


def _import_ray() -> Any:
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


def with_remote_traceback(exc: BaseException, host: int, trace: str) -> BaseException:
    """Attaches the traceback a host sent with a failure (if any) to ``exc`` as a note."""
    if trace:
        exc.add_note(f"remote traceback (host {host}):\n{trace.rstrip()}")
    return exc


def is_lost_error(exc: BaseException) -> bool:
    """True if ``exc`` is Ray's way of saying the actor (the host) is gone."""
    import ray.exceptions as rex

    return isinstance(exc, rex.RayActorError | rex.ActorDiedError | rex.ActorUnavailableError)


_UNSETTLED = object()


class RemoteArray:
    """A value living on a host: a handle the object store keeps instead of a ``jax.Array``.

    ``sharding`` names the controller's stand-in devices; the host holds the
    real buffers. Readiness is that of the host's part of the run that made
    it. Dropping the handle frees the value on its host.
    """

    __slots__ = (
        "__weakref__",
        "_outcome",
        "_ready",
        "_value",
        "aval",
        "backend",
        "done",
        "host",
        "key",
        "sharding",
    )

    def __init__(self, backend: RayBackend, host: int, key: int | None, aval: Any, sharding: Any, done: Any):
        self.backend = backend
        self.host = host
        self.key = key
        self.aval = aval
        self.sharding = sharding
        self.done = done
        self._outcome: Any = _UNSETTLED
        self._ready = False
        self._value: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self) -> Any:
        return self.aval.dtype

    def is_deleted(self) -> bool:
        return False

    def is_ready(self) -> bool:
        if self._ready or self.backend.closed:
            return True
        ready, _ = self.backend.ray.wait([self.done], timeout=0)
        self._ready = bool(ready)
        return self._ready

    def _settle(self) -> Any:
        if self._outcome is _UNSETTLED:
            self._outcome = self.backend.outcome(self.host, self.done)
        return self._outcome

    def block_until_ready(self) -> RemoteArray:
        outcome = self._settle()
        if outcome is not None:
            raise outcome
        return self

    def fetch(self) -> jax.Array:
        """Brings the value to the controller as a ``jax.Array`` (on the stand-in devices)."""
        if self._value is None:
            self.block_until_ready()
            if self.key is None:  # a completion marker: no value of its own
                raise errors.PathwaysError(f"{self!r} holds no value to fetch.")
            data = self.backend.fetch(self.host, self.key)
            counters.bump("fetches")
            self._value = jax.device_put(data, self.sharding)
        return self._value

    def __del__(self) -> None:
        try:
            if self.key is not None:
                self.backend.drop(self.host, self.key)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"RemoteArray(host={self.host}, key={self.key}, shape={self.shape}, dtype={self.dtype})"


class HostPlan:
    """One plan's part for one host: steps, constants, computations, and per-run feeds."""

    __slots__ = ("blobs", "constants", "data", "futures", "keep", "ops")

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.constants: dict[int, tuple[np.ndarray, ShardingDesc]] = {}  # slot -> (value, desc)
        self.blobs: dict[str, tuple] = {}  # fingerprint -> (bytes, in descs, out descs)
        self.data: list[tuple[int, int, ShardingDesc]] = []  # (run slot, host slot, desc): fed per run
        self.futures: list[int] = []  # slots fed by values already on the host
        self.keep: list[int] = []  # slots kept after the run (program outputs)


class RemotePlan:
    """A plan split by host: built once per lowering, registered on each host on first use."""

    _keys = itertools.count()

    def __init__(self, backend: RayBackend, plan: Plan):
        from pathways_jax._src.compile.lowering import ExecStep

        self.key = next(self._keys)
        self.parts: dict[int, HostPlan] = {}
        self.transfers: collections.Counter[str] = collections.Counter()  # per run, by kind
        where = backend.where
        slot_host: dict[int, int] = {}
        # Slots whose value the controller has (arguments, constants): shipped as data.
        data_src: dict[int, tuple[str, int]] = {}
        for _index, slot, _sharding in plan.host_feeds:
            data_src[slot] = ("env", slot)
        for _index, slot in plan.array_feeds:
            data_src[slot] = ("env", slot)
        for slot, value in enumerate(plan.template):
            if value is not None:
                data_src[slot] = ("const", slot)
        signature_sharding = {slot: plan.feed_shardings[slot] for _index, slot in plan.future_feeds}

        def part(host: int) -> HostPlan:
            if host not in self.parts:
                self.parts[host] = HostPlan()
            return self.parts[host]

        def feed_data(slot: int, sharding: Any) -> int:
            host, desc = where(sharding, f"an input of program {plan.graph.name!r}")
            kind, source = data_src[slot]
            if kind == "const":
                part(host).constants[slot] = (np.asarray(plan.template[source]), desc)
            else:
                part(host).data.append((source, slot, desc))
            slot_host[slot] = host
            return host

        def locate(slot: int, sharding: Any) -> int:
            """The host of a slot read by a step, feeding data and future slots on first use."""
            if slot in slot_host:
                return slot_host[slot]
            if slot in data_src:
                return feed_data(slot, sharding)
            if slot in signature_sharding:
                host, _ = where(signature_sharding[slot], f"an input of program {plan.graph.name!r}")
                part(host).futures.append(slot)
                slot_host[slot] = host
                return host
            raise errors.PlacementError(f"program {plan.graph.name!r}: slot {slot} is read before it is made")

        for index, step in enumerate(plan.steps):
            if isinstance(step, ExecStep):
                node = step.node
                host = where(node.slice.sharding(), f"node {node.name!r} ({node.source_info})")[0]
                executable = step.executable
                in_shardings = executable.input_shardings[0]
                out_shardings = jax.tree_util.tree_leaves(executable.output_shardings)
                for slot, sharding in zip(step.in_slots, in_shardings, strict=True):
                    if locate(slot, sharding) != host:
                        raise errors.PlacementError(
                            f"node {node.name!r} ({node.source_info}) reads a value held on another host; "
                            "this is a bug in pathways_jax's lowering, please report it."
                        )
                if step.exported is None:
                    raise errors.PathwaysError(
                        f"node {node.name!r} ({node.source_info}) was compiled without its serialized "
                        "computation, which the Ray hosts need; this is a bug in pathways_jax, please report it."
                    )
                blob, fingerprint = step.exported
                hp = part(host)
                if fingerprint not in hp.blobs:
                    hp.blobs[fingerprint] = (
                        blob,
                        tuple(where(s, node.name)[1] for s in in_shardings),
                        tuple(where(s, node.name)[1] for s in out_shardings),
                    )
                hp.ops.append(
                    ExecOp(
                        fingerprint,
                        step.in_slots,
                        step.out_slots,
                        step.windowed,
                        f"{node.name!r} ({node.source_info})",
                    )
                )
                for slot in step.out_slots:
                    slot_host[slot] = host
                continue
            # A move: within a host a device_put, across hosts a push from one to the other.
            dst_host, desc = where(step.sharding, f"a transfer in program {plan.graph.name!r}")
            if step.src in data_src and step.src not in slot_host:
                data_src[step.dst] = data_src[step.src]
                feed_data(step.dst, step.sharding)
                continue
            src_host = locate(step.src, None)
            if step.kind is not None:
                self.transfers[step.kind] += 1
            if src_host == dst_host:
                part(dst_host).ops.append(PutOp(step.src, step.dst, desc))
            else:
                part(src_host).ops.append(SendOp(step.src, dst_host, index))
                part(dst_host).ops.append(RecvOp(step.dst, src_host, index, desc))
            slot_host[step.dst] = dst_host

        # What the run keeps on the hosts: the program's outputs.
        for out in plan.outputs:
            if out.kind != "slot":
                continue
            host = locate(out.where, out.sharding)
            if out.where not in part(host).keep:
                part(host).keep.append(out.where)
        self.slot_host = slot_host
        self.hosts = tuple(sorted(self.parts))
        self.islands = frozenset(self.hosts)


# Runs sent to one host and not complete yet before dispatch there waits (each
# host bounds its own executables in flight with pw.init(max_in_flight=...)).
RUNS_IN_FLIGHT = 64


class RayBackend:
    """The controller's side of the Ray backend: host actors, messages, values and health.

    Implements :class:`~pathways_jax._src.backends.base.Backend`: a run is one
    message per host, and each host dispatches its part of the plan itself.
    """

    name = "ray"
    window: int | None = RUNS_IN_FLIGHT
    donates = False  # hosts compile the exported nodes without donation
    exports = True
    calls_back = False
    stages_inputs = False  # host inputs travel with the run's message

    def __init__(
        self,
        *,
        address: str | None,
        hosts: int,
        devices_per_host: int,
        standins: list[jax.Device],
        window: int,
        on_lost: Any,
    ):
        ray = _import_ray()
        self.ray = ray
        self.hosts = hosts
        self.devices_per_host = devices_per_host
        self.standins = standins
        self._where = {d.id: (i // devices_per_host, i % devices_per_host) for i, d in enumerate(standins)}
        self.on_lost = on_lost  # set by the cluster: called with a lost host's island
        # Set by the cluster: frees the store's values whose futures went, so that
        # their handles go and the hosts hear of it even when no program runs.
        self.collect: Any = None
        self._lock = threading.Lock()  # message numbering and sending
        self._seq = [0] * hosts
        self._known: list[set] = [set() for _ in range(hosts)]  # plan keys each host has
        self._fingerprints: list[set] = [set() for _ in range(hosts)]
        self._dropped: list[collections.deque] = [collections.deque() for _ in range(hosts)]
        self._keys = itertools.count()
        self.lost: dict[int, str] = {}
        self._closed = False
        if not ray.is_initialized():
            import os

            with warnings.catch_warnings():
                # Ray starts its own processes with fork + exec; JAX's fork hook
                # warns about forking a multithreaded process, which matters only
                # when the child goes on running Python.
                warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
                ray.init(
                    # None: a new local cluster, never one a stale `ray start` file names.
                    address=address or "local",
                    include_dashboard=False,
                    log_to_driver=False,
                    num_cpus=None if address else max(hosts, os.cpu_count() or 1),
                    configure_logging=False,
                )
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_pg = remove_placement_group
        self.pg = placement_group([{"CPU": 1}] * hosts, strategy="SPREAD")
        try:
            ray.get(self.pg.ready(), timeout=_START_TIMEOUT_S)
        except Exception as exc:
            remove_placement_group(self.pg)
            raise errors.ClusterError(
                f"Ray could not place {hosts} hosts (one CPU each) within {_START_TIMEOUT_S}s: {exc}. "
                "Ask for fewer hosts, or add nodes to the Ray cluster."
            ) from exc
        actor = ray.remote(ray_host.Host)
        self.actors = [
            actor.options(
                num_cpus=1,
                max_restarts=0,
                max_concurrency=1000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=h
                ),
            ).remote(h, devices_per_host, window, bool(jax.config.read("jax_enable_x64")))
            for h in range(hosts)
        ]
        try:
            self.info = ray.get([a.setup.remote(self.actors) for a in self.actors], timeout=_START_TIMEOUT_S)
        except Exception as exc:
            self.close()
            raise errors.ClusterError(f"the Ray host actors did not start: {exc}") from exc
        for h, info in enumerate(self.info):
            if info["devices"] != devices_per_host:
                self.close()
                raise errors.ClusterError(
                    f"host {h} exposes {info['devices']} devices, not devices_per_host={devices_per_host}."
                )
        self._pings: dict[int, Any] = {}
        self._threads = [
            threading.Thread(target=self._monitor, name="pathways-ray-monitor", daemon=True),
            threading.Thread(target=self._flush_loop, name="pathways-ray-flush", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- devices --------------------------------------------------------------------------

    @property
    def islands(self) -> tuple[tuple[jax.Device, ...], ...]:
        m = self.devices_per_host
        return tuple(tuple(self.standins[h * m : (h + 1) * m]) for h in range(self.hosts))

    def where(self, sharding: Any, what: str) -> tuple[int, ShardingDesc]:
        """The host of a stand-in sharding and its host-local descriptor."""
        if isinstance(sharding, jax.sharding.SingleDeviceSharding):
            device: Any  # a jax.Device; its stub type does not resolve here
            (device,) = sharding.device_set
            host, index = self._where[device.id]
            return host, SingleDesc(index)
        if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
            places = [self._where[d.id] for d in sharding.mesh.devices.flat]
            hosts = {h for h, _ in places}
            if len(hosts) != 1:
                raise errors.PlacementError(
                    f"{what} is sharded over devices of hosts {sorted(hosts)}; on the Ray backend a "
                    "value lives on one host (islands are single hosts)."
                )
            return places[0][0], NamedDesc(
                tuple(i for _, i in places),
                sharding.mesh.devices.shape,
                sharding.mesh.axis_names,
                sharding.spec,
            )
        raise errors.PlacementError(
            f"{what} has sharding {sharding!r}; the Ray backend ships NamedSharding and "
            "SingleDeviceSharding values only. Give the value a pw.P(...) spec on its slice."
        )

    # --- messages ------------------------------------------------------------------------

    def _message(self, host: int, kind: str, *args: Any) -> Any:
        """Sends host ``host`` its next numbered message; call with ``_lock`` held."""
        seq = self._seq[host]
        self._seq[host] = seq + 1
        return self.actors[host].call.remote(seq, kind, *args)

    def prepare(self, plan: Plan) -> None:
        """Splits ``plan`` into one part per host; a run then makes one message (and report) per host."""
        remote = RemotePlan(self, plan)
        for host in remote.hosts:
            if host in self.lost:
                raise errors.HostLostError(self._lost_message(host, f"program {plan.graph.name!r}"))
        weakref.finalize(plan, self._forget, remote.key, remote.hosts)
        plan.remote = remote
        # One message per host per run: each host counts once in its island's window.
        plan.windowed = dict.fromkeys(remote.islands, 1)
        plan.islands = remote.islands
        plan.reports = len(remote.hosts)

    def execute(self, run: Any, window: Window) -> tuple[Any, tuple]:
        """Sends each host of ``run`` its one message; the hosts do the rest."""
        plan = run.plan
        remote: RemotePlan = plan.remote
        for island in plan.windowed:
            window.make_room(island)
        rec = timeline.ACTIVE
        t0 = rec.now() if rec is not None else 0
        try:
            outputs, markers = self.dispatch(run)
        except Exception as exc:
            raise StepFailed(
                f"program {plan.graph.name!r} run {run.id} could not be sent to its hosts", exc
            ) from exc
        counters.bump("dispatches", len(markers))
        for kind, count in remote.transfers.items():
            counters.bump(f"transfers_{kind}", count)
        for host, marker in markers.items():
            window.in_flight(host, marker, run)
            if rec is not None:
                rec.sent(run, host, marker, t0)
        slot_host = remote.slot_host
        return outputs, tuple([markers[slot_host[group.slot]] for group in plan.acct_groups])

    def settle(self, in_flight: collections.deque) -> None:
        self.retire_ready(in_flight)

    def _forget(self, key: int, hosts: tuple[int, ...]) -> None:
        if self._closed:
            return
        with self._lock:
            for host in hosts:
                if key in self._known[host] and host not in self.lost:
                    self._known[host].discard(key)
                    self._message(host, "forget", key)

    def dispatch(self, run: Any) -> tuple[dict[int, RemoteArray], dict[int, RemoteArray]]:
        """Sends each host of ``run`` its one message; returns output handles and one marker per host."""
        plan = run.plan
        remote: RemotePlan = plan.remote
        env = run.env
        outputs: dict[int, RemoteArray] = {}
        markers: dict[int, RemoteArray] = {}
        with self._lock:
            for host in remote.hosts:
                if host in self.lost:
                    raise errors.HostLostError(self._lost_message(host, f"program {plan.graph.name!r}"))
            for host in remote.hosts:
                hp = remote.parts[host]
                if remote.key not in self._known[host]:
                    have = self._fingerprints[host]
                    blobs = {f: b for f, b in hp.blobs.items() if f not in have}
                    self._message(host, "register", remote.key, hp.ops, hp.constants, blobs)
                    have.update(blobs)
                    self._known[host].add(remote.key)
                feeds: list[tuple] = []
                for slot in hp.futures:
                    value = env[slot]
                    if not isinstance(value, RemoteArray) or value.backend is not self:
                        raise errors.PlacementError(
                            f"program {plan.graph.name!r}: an input future belongs to another cluster "
                            "(one shut down since); pass its .result() instead"
                        )
                    if value.host != host:
                        raise errors.PlacementError(
                            f"program {plan.graph.name!r}: an input future is not on host {host}, "
                            "where the program reads it"
                        )
                    feeds.append((slot, "value", value.key))
                for source, slot, desc in hp.data:
                    feeds.append((slot, "data", (np.asarray(env[source]), desc)))
                keep = [(slot, next(self._keys)) for slot in hp.keep]
                frees = self._take_dropped(host)
                done = self._message(host, "run", remote.key, run.id, feeds, keep, frees)
                markers[host] = RemoteArray(self, host, None, None, None, done)
                for slot, key in keep:
                    outputs[slot] = RemoteArray(self, host, key, None, None, done)
        for slot, array in outputs.items():
            out = plan.slot_outputs[slot]
            array.aval, array.sharding = out.aval, out.sharding
        return outputs, markers

    def retire_ready(self, in_flight: collections.deque) -> None:
        """Drops the completed head of a host's in-flight deque (one look at Ray for all)."""
        items = list(in_flight)
        unknown = [marker.done for marker, _ in items if not marker._ready]
        if unknown:
            ready, _ = self.ray.wait(unknown, num_returns=len(unknown), timeout=0)
            done = set(ready)
            for marker, _ in items:
                if marker.done in done:
                    marker._ready = True
        while in_flight and in_flight[0][0]._ready:
            in_flight.popleft()

    def _take_dropped(self, host: int) -> list[int]:
        dropped = self._dropped[host]
        keys = []
        while dropped:
            try:
                keys.append(dropped.popleft())
            except IndexError:
                break
        return keys

    def drop(self, host: int, key: int) -> None:
        """A handle went: its value is freed on its host with the next message there."""
        self._dropped[host].append(key)

    def _flush_loop(self) -> None:
        while not self._closed:
            time.sleep(_FLUSH_S)
            try:
                if self.collect is not None:
                    self.collect()
                if not any(self._dropped):
                    continue
                with self._lock:
                    for host in range(self.hosts):
                        if self._dropped[host] and host not in self.lost and not self._closed:
                            self._message(host, "free", self._take_dropped(host))
            except Exception as exc:  # Ray itself went away (process exit): stop
                if self._closed or not self.ray.is_initialized():
                    return
                logging.warning("pathways_jax: freeing values on the Ray hosts failed once: %s", exc)

    def fetch(self, host: int, key: int) -> np.ndarray:
        if self._closed:
            raise errors.ClusterError(_CLOSED)
        with self._lock:
            if host in self.lost:
                raise errors.HostLostError(self._lost_message(host, "a value"))
            ref = self._message(host, "fetch", key)
        try:
            result = self.ray.get(ref, timeout=_CALL_TIMEOUT_S)
        except Exception as exc:
            if is_lost_error(exc):
                self.mark_lost(host, str(exc))
                raise errors.HostLostError(self._lost_message(host, "a value")) from exc
            raise
        if not isinstance(result, np.ndarray):
            raise with_remote_traceback(
                errors.ProgramFailedError(f"fetching a value from host {host} failed: {result.message}"),
                host,
                getattr(result, "trace", ""),
            )
        return result

    def outcome(self, host: int, done: Any) -> BaseException | None:
        """None if a host's part of a run completed, else the error its values raise."""
        if self._closed:
            return errors.ClusterError(_CLOSED)
        try:
            # In steps, so that a wait on a hung host ends when the cluster closes.
            while not self.ray.wait([done], timeout=_WAIT_STEP_S)[0]:
                if self._closed:
                    return errors.ClusterError(_CLOSED)
            status = self.ray.get(done)
        except Exception as exc:
            if is_lost_error(exc):
                self.mark_lost(host, str(exc))
                return errors.HostLostError(self._lost_message(host, "a run"))
            return errors.ProgramFailedError(f"host {host} failed: {exc}")
        if status is None:
            return None
        if not isinstance(status, RunFailure):  # a message that failed before its run began
            return with_remote_traceback(
                errors.ProgramFailedError(f"host {host} failed: {getattr(status, 'message', status)}"),
                host,
                getattr(status, "trace", ""),
            )
        if status.kind == "lost" and status.peer is not None:
            return errors.HostLostError(self._lost_message(status.peer, f"a run on host {host}"))
        return with_remote_traceback(errors.ProgramFailedError(status.message), host, status.trace)

    def host_stats(self, timeout: float = _CALL_TIMEOUT_S) -> dict[int, dict]:
        """Each live host's counts: values kept, runs done, executables and plans cached."""
        live = [h for h in range(self.hosts) if h not in self.lost]
        stats = self.ray.get([self.actors[h].stats.remote() for h in live], timeout=timeout)
        return dict(zip(live, stats, strict=True))

    # --- health ------------------------------------------------------------------------

    def _lost_message(self, host: int, what: str) -> str:
        lost = (
            f"{what} needed host {host} (island {host}), which was lost: {self.lost.get(host, 'it died')}. "
        )
        if all(h in self.lost for h in range(self.hosts)):
            return lost + (
                f"Its values are gone, and no host survives (all {self.hosts} were lost), so nothing can "
                "run on this cluster: call pw.shutdown() and then pw.init(...) to start new hosts."
            )
        return lost + (
            "Its values are gone; slices on it were moved to surviving hosts where they fit, so "
            "calling the program again runs there."
        )

    def mark_lost(self, host: int, why: str) -> None:
        with self._lock:
            if host in self.lost or self._closed:
                return
            self.lost[host] = why.splitlines()[0] if why else "it died"
            survivors = [h for h in range(self.hosts) if h not in self.lost]
        logging.warning("pathways_jax: host %d was lost: %s", host, self.lost[host])
        for h in survivors:
            with contextlib.suppress(Exception):
                self.actors[h].peer_lost.remote(host)
        if self.on_lost is not None:
            self.on_lost(host)

    def _monitor(self) -> None:
        """Pings every host; a host whose actor died is lost. A slow host is only slow."""
        ray = self.ray
        while not self._closed:
            try:
                self._look(ray)
            except Exception as exc:  # Ray itself went away (process exit): stop looking
                if self._closed or not ray.is_initialized():
                    return
                logging.warning("pathways_jax: the Ray host monitor failed once: %s", exc)
            time.sleep(_PING_S)

    def _look(self, ray: Any) -> None:
        for host in range(self.hosts):
            if host in self.lost or self._closed:
                continue
            ref = self._pings.get(host)
            if ref is None:
                self._pings[host] = self.actors[host].ping.remote()
                continue
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue  # still busy: slow is not lost
            del self._pings[host]
            try:
                ray.get(ref)
            except Exception as exc:
                if not self._closed and is_lost_error(exc):
                    self.mark_lost(host, str(exc))

    def close(self, timeout: float | None = _CLOSE_TIMEOUT_S) -> None:
        """Kills the host actors (their values go with them) and stops this side's threads.

        Never waits for a host: the actors are killed without waiting, and this
        side's threads are waited for up to ``timeout`` seconds in all
        (``None``: as long as they take); one still running then is left as a
        daemon thread, and logged.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._closed = True
        for actor in getattr(self, "actors", []):
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        with contextlib.suppress(Exception):
            self._remove_pg(self.pg)
        for thread in getattr(self, "_threads", []):
            if thread is threading.current_thread():
                continue
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logging.warning(
                    "pathways_jax: Ray backend thread %s did not stop within %ss; it is left running "
                    "as a daemon thread.",
                    thread.name,
                    timeout,
                )
