"""The Ray backend's plans: a lowered plan split into one part per host.

A :class:`RemotePlan` holds, per host, its ops (exported computations, local
puts, transfers to and from other hosts), what it keeps, and the inputs it
is fed; a run then sends each participating host one message.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pathways_jax._src.backends import ray_host
from pathways_jax._src.backends.ray_host import ExecOp, Op, Piece, PostOp, PullOp, PutOp, ShardingDesc
from pathways_jax._src.compile.steps import ExecStep
from pathways_jax._src.core import errors

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan


class Placed(NamedTuple):
    """Where a stand-in sharding lives: its island, the hosts holding it, its descriptor there."""

    island: int
    hosts: tuple[int, ...]
    desc: ShardingDesc


class Islands(Protocol):
    """Which island a host is in (``ray.Layout``)."""

    def island_of(self, host: int) -> int: ...


class Fleet(Protocol):
    """What splitting a plan by host reads of where the hosts' devices are (``ray_places.Places``)."""

    @property
    def layout(self) -> Islands: ...

    def where(self, sharding: Any, what: str) -> Placed:
        """Where a stand-in sharding lives (island, hosts, descriptor); ``what`` names it in errors."""
        ...

    def place_of(self, device: Any) -> tuple[int, int, int]:
        """A stand-in device's island, position on its host, and host."""
        ...


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
    """A plan split by host: built once per lowering, registered on each host on first use.

    Each host's part lists, in the plan's one order, the executables it takes
    part in, the values it puts on other devices of its own, and its side of
    each host-to-host transfer (a post on the source, a pull on the
    destination, numbered ``0 .. transfers-1`` within a run).
    """

    _keys = itertools.count()

    def __init__(self, backend: Fleet, plan: Plan):
        self.key = next(self._keys)
        # The 64-bit mode it was lowered in (this thread's, as jax.jit reads it): its hosts run it so.
        self.x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]
        self.parts: dict[int, HostPlan] = {}
        self.transfers: collections.Counter[str] = collections.Counter()  # per run, by kind
        self.uuids = 0  # host-to-host transfers per run: the uuids a run takes
        self.pulls = 0  # of them, pulls from another host's transfer server
        # Future slots' shardings on the hosts: a future of a value the controller holds
        # (an argument a program returned as it was) is shipped as data.
        self.future_descs: dict[int, ShardingDesc] = {}
        where = backend.where
        slot_hosts: dict[int, tuple[int, ...]] = {}
        slot_sharding: dict[int, Any] = {}
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
        name = plan.graph.name

        def part(host: int) -> HostPlan:
            if host not in self.parts:
                self.parts[host] = HostPlan()
            return self.parts[host]

        def feed_data(slot: int, sharding: Any) -> tuple[int, ...]:
            placed = where(sharding, f"an input of program {name!r}")
            kind, source = data_src[slot]
            for host in placed.hosts:
                if kind == "const":
                    part(host).constants[slot] = (ray_host.to_wire(plan.template[source]), placed.desc)
                else:
                    part(host).data.append((source, slot, placed.desc))
            slot_hosts[slot], slot_sharding[slot] = placed.hosts, sharding
            return placed.hosts

        def locate(slot: int, sharding: Any) -> tuple[int, ...]:
            """The hosts of a slot read by a step, feeding data and future slots on first use."""
            if slot in slot_hosts:
                return slot_hosts[slot]
            if slot in data_src:
                return feed_data(slot, sharding)
            if slot in signature_sharding:
                placed = where(signature_sharding[slot], f"an input of program {name!r}")
                self.future_descs[slot] = placed.desc
                for host in placed.hosts:
                    part(host).futures.append(slot)
                slot_hosts[slot], slot_sharding[slot] = placed.hosts, signature_sharding[slot]
                return placed.hosts
            raise errors.PlacementError(f"program {name!r}: slot {slot} is read before it is made")

        for step in plan.steps:
            if isinstance(step, ExecStep):
                node = step.node
                what = f"node {node.name!r} ({node.source_info})"
                whole = NamedSharding(plan.placement.slices[node.slice.id].mesh, PartitionSpec())
                hosts = where(whole, what).hosts
                executable = step.executable
                # An input the executable does not read (dead code: flax's init(key, dummy) input)
                # has no sharding of its own: the hosts get it on the node's devices.
                in_shardings = [s if s is not None else whole for s in executable.input_shardings[0]]
                out_shardings = jax.tree_util.tree_leaves(executable.output_shardings)
                for slot, sharding in zip(step.in_slots, in_shardings, strict=True):
                    if locate(slot, sharding) != hosts:
                        raise errors.PlacementError(
                            f"{what} reads a value held on hosts {list(locate(slot, sharding))}, not on its "
                            f"own hosts {list(hosts)}; this is a bug in pathways_jax's lowering, please report it."
                        )
                if step.exported is None:
                    raise errors.PathwaysError(
                        f"{what} was compiled without its serialized computation, which the Ray hosts "
                        "need; this is a bug in pathways_jax, please report it."
                    )
                blob, exported = step.exported
                descs = (
                    tuple(where(s, what).desc for s in in_shardings),
                    tuple(where(s, what).desc for s in out_shardings),
                )
                # The hosts consume what this process's executable would (donate_argnums).
                donated = _donated(executable)
                # Hosts compile the computation for these devices in this order: the
                # same computation over the same devices in another order is another
                # executable (sharing one feeds buffers to the wrong replicas).
                digest = hashlib.sha256(repr((descs, donated) if donated else descs).encode())
                fingerprint = f"{exported}/{digest.hexdigest()[:24]}"
                # Named as the host's errors say it: "run failed in node <name>".
                name = f"{node.name!r} ({node.source_info})"
                op = ExecOp(fingerprint, step.in_slots, step.out_slots, step.windowed, name, donated)
                for host in hosts:
                    hp = part(host)
                    if fingerprint not in hp.blobs:
                        hp.blobs[fingerprint] = (blob, *descs, donated)
                    hp.ops.append(op)
                for slot, sharding in zip(step.out_slots, out_shardings, strict=True):
                    slot_hosts[slot], slot_sharding[slot] = hosts, sharding
                continue
            # A move: on one host a device_put; otherwise host to host.
            dst = where(step.sharding, f"a transfer in program {name!r}")
            if step.src in data_src and step.src not in slot_hosts:
                data_src[step.dst] = data_src[step.src]
                feed_data(step.dst, step.sharding)
                continue
            src_hosts = locate(step.src, None)
            if step.kind is not None:
                self.transfers[step.kind] += 1
            if src_hosts == dst.hosts and len(dst.hosts) == 1:
                part(dst.hosts[0]).ops.append(PutOp(step.src, step.dst, dst.desc))
            else:
                self._move(backend, step, slot_sharding[step.src], dst, part, name)
            slot_hosts[step.dst], slot_sharding[step.dst] = dst.hosts, step.sharding

        # What the run keeps on the hosts: the program's outputs.
        for out in plan.outputs:
            if out.kind != "slot":
                continue
            for host in locate(out.where, out.sharding):
                if out.where not in part(host).keep:
                    part(host).keep.append(out.where)
        # As jax.jit's, every output is a buffer of its own: an argument returned as it is, or a
        # value returned twice (OutputSlot.fresh), is a copy the hosts make into a slot of its own,
        # kept under a key of its own (one key would be donated twice, or freed with the other).
        self.copies: dict[int, int] = {}  # output position -> the slot of its copy on the hosts
        # Every slot the hosts keep -> its output (aval, sharding): the plan's, and the copies'.
        self.kept_outputs: dict[int, Any] = dict(plan.slot_outputs)
        spare = itertools.count(max([len(plan.template), *slot_hosts]) + 1)
        for position, slot in plan.published_copies:
            out = plan.outputs[position]
            hosts = locate(slot, out.sharding)
            copy = next(spare)
            desc = where(slot_sharding[slot], f"an output of program {name!r}").desc
            for host in hosts:
                part(host).ops.append(PutOp(slot, copy, desc, fresh=True))
                part(host).keep.append(copy)
            slot_hosts[copy], slot_sharding[copy] = hosts, slot_sharding[slot]
            self.copies[position] = copy
            self.kept_outputs[copy] = out
        self.slot_hosts = slot_hosts
        self.hosts = tuple(sorted(self.parts))
        self.islands = frozenset(backend.layout.island_of(h) for h in self.hosts)
        # One message per host per run, each counting once in its island's window.
        self.windowed = collections.Counter(backend.layout.island_of(h) for h in self.hosts)

    def _move(self, backend: Fleet, step: Any, src_sharding: Any, dst: Placed, part: Any, name: str) -> None:
        """Each destination host gathers what its shards need: pieces it holds locally, the rest pulled.

        A source piece goes to a destination host if it overlaps one of that
        host's shards of the destination sharding; of its copies, the host's
        own if it has one, else one chosen by host so that copies share the load.
        """
        shape, dtype = tuple(step.aval.shape), step.aval.dtype
        key_impl: str | None = None
        extra: tuple[tuple[int, int], ...] = ()
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            # A typed PRNG key (an NNX Rngs' key): its raw key data crosses, wrapped again there.
            impl = getattr(dtype, "_impl", None)
            if impl is None:
                raise errors.PlacementError(
                    f"program {name!r} moves a value of dtype {dtype} between hosts, which the transfer "
                    "servers cannot carry; move plain arrays between hosts."
                )
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
            key_impl, extra, dtype = impl.name, tuple((0, n) for n in data.shape[len(shape) :]), data.dtype
        # Every distinct shard of the source, and the hosts (devices) holding a copy.
        holders: dict[tuple, list[tuple[int, Piece]]] = {}
        for device, index in src_sharding.devices_indices_map(shape).items():
            bounds = ray_host.bounds_of(index, shape) + extra
            _, position, host = backend.place_of(device)
            piece = Piece(position, bounds, tuple(stop - start for start, stop in bounds))
            holders.setdefault(bounds, []).append((host, piece))
        needs: dict[int, list[tuple]] = {}  # destination host -> the bounds of its shards
        for device, index in step.sharding.devices_indices_map(shape).items():
            needs.setdefault(backend.place_of(device)[2], []).append(ray_host.bounds_of(index, shape) + extra)
        shape = shape + tuple(n for _, n in extra)
        for host in dst.hosts:
            by_source: dict[int, list[Piece]] = {}
            if 0 not in shape:  # an empty value is made, not moved
                for bounds, copies in holders.items():
                    if not any(_overlap(bounds, need) for need in needs[host]):
                        continue
                    source, piece = next(((h, p) for h, p in copies if h == host), copies[host % len(copies)])
                    by_source.setdefault(source, []).append(piece)
            parts = []
            for source, pieces in sorted(by_source.items()):
                if source == host:
                    parts.append((host, -1, tuple(pieces)))
                    continue
                offset = self.uuids
                self.uuids += 1
                self.pulls += 1
                part(source).ops.append(PostOp(step.src, host, offset, tuple(pieces), str(dtype), key_impl))
                parts.append((source, offset, tuple(pieces)))
            part(host).ops.append(
                PullOp(step.dst, step.src, tuple(parts), shape, str(dtype), dst.desc, key_impl)
            )


def _donated(executable: Any) -> tuple[int, ...]:
    """The argument positions ``executable`` (this process's, for the stand-ins) consumes.

    One that does not say (no ``args_info``) consumes none on the hosts: a buffer a
    host deletes must be one the controller counts as spent.
    """
    info = getattr(executable, "args_info", None)
    if info is None:
        return ()
    return tuple(i for i, arg in enumerate(jax.tree_util.tree_leaves(info[0])) if arg.donated)


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two ``(start, stop)``-per-dimension boxes share an element."""
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
