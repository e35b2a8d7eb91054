"""A plan's operations made into steps: functions a host runs, in order, for each run of the plan.

A step is ``step(env, base, made, peers)``: it reads and writes the run's
slots ``env``, posts and pulls under the run's transfer uuid ``base``,
appends what it made to ``made`` (the run is done when they are ready) and
the hosts it pulled from to ``peers``. Executables are paced (:func:`pace`):
a host keeps a bounded number in flight. On a host of several devices in an
island of several hosts, executables that span hosts are also ordered
(:class:`CrossHostOrder`): XLA:CPU alone could deadlock the island.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

from pathways_jax._src.backends.ray_host.ops import ExecOp, Op, PostOp, PullOp, PutOp
from pathways_jax._src.backends.ray_host.plane import DataPlane
from pathways_jax._src.backends.ray_host.values import key_data, own_copy, place, wrap_key

# Executables a host keeps in flight that no window bounds (one device, no
# collective across processes): below XLA:CPU's own bound of 32 per device,
# so that the executor waits for many at once instead of being woken after
# each (the dispatch benchmark's cross-host chain: a host's executor thread
# 41 -> 29 us of CPU a node, the host's process 131 -> 120).
PACE = 24

Step = Callable[[dict, int, list, set], None]

# What an executable is to XLA:CPU on this host (CrossHostOrder): how many of
# this host's devices it runs on, and whether other hosts run it too.
SINGLE = "single"  # one device of this host, no other host: ordered on its device
LONE = "lone"  # one device of this host, and devices of other hosts
GANG = "gang"  # several devices of this host, no other host
CROSS_GANG = "cross-gang"  # several devices of this host, and devices of other hosts


def _wait(out: Any) -> None:
    with contextlib.suppress(Exception):  # a failed executable's error is its own run's to report
        out.block_until_ready()


def pace(in_flight: collections.deque, out: Any, bound: int) -> None:
    """Counts ``out`` in flight; at ``bound``, waits for the older half at once.

    One wait per ``bound // 2`` executables, not one per executable (as
    XLA's own bound of 32 in flight per device would have this thread
    woken after each), and never more than ``bound`` in flight. What a
    failed executable raises is its own run's to report, not this one's.
    """
    in_flight.append(out)
    if len(in_flight) < bound:
        return
    while len(in_flight) > bound // 2:
        _wait(in_flight.popleft())


def kind_of(devices: Any, process: int) -> tuple[str, tuple[int, ...]]:
    """What an executable over ``devices`` is to process ``process``'s XLA:CPU client, and its devices there."""
    mine = tuple(sorted(d.id for d in devices if d.process_index == process))
    crosses = any(d.process_index != process for d in devices)
    if len(mine) > 1:
        return (CROSS_GANG if crosses else GANG), mine
    return (LONE if crosses else SINGLE), mine


class CrossHostOrder:
    """When a host of several devices may launch an executable, in an island of several hosts.

    **Why.** XLA:CPU runs a process's executables on one pool of threads
    (``max(cores, local devices)`` of them: 2 on a 2-core machine with 2
    devices). A collective across processes holds its threads until the
    other hosts' parts arrive. XLA orders a process's executables over
    several of its devices ("gangs") one after another, and an executable on
    one device after the earlier ones on that device, but not the two kinds
    against each other. An executable on one device of this host that spans
    hosts too (``LONE``: a 2-device slice of one device per host) is ordered
    only on its device, or runs inline on the executor thread. So a later
    gang may take every pool thread while an earlier lone executable waits
    for one: host 1 ran the gang of run N+1, waiting for host 0's part,
    while its part of run N found no thread; host 0, blocked in its part of
    run N (inline, waiting for host 1's), never launched run N+1, or, its
    part of run N holding one of its two threads, never got the second that
    XLA launches its part of run N+1 on. The island hung for good (``py-spy
    dump --native`` and gdb of both hosts, DESIGN.md hazards). Every host launches in the controller's one order; what goes
    wrong is only which launched executables XLA lets hold threads.

    **The rule.** Before a ``LONE`` executable, the host waits for every
    executable it launched before (none holds a thread while it waits for
    its peers), and before a ``CROSS_GANG``, for every ``SINGLE`` or ``LONE``
    one (XLA orders gangs among themselves, not against those). What waits
    is always earlier in the one order, which every host launches alike, so
    the wait ends. Gangs over this host's devices alone and single-device
    executables wait for nothing: they never wait for another host. A host
    of one device, or an island of one host, orders nothing: XLA runs its
    executables one after another on its device.
    """

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[str, tuple[int, ...]]] = {}  # fingerprint -> kind_of(...)
        self._singles: dict[int, Any] = {}  # device id -> output of its latest SINGLE or LONE executable
        self._gang: Any = None  # output of the latest gang (XLA ran the earlier ones before it)

    def before(self, kind: str) -> None:
        """Waits for what an executable of ``kind`` must not overtake (see the class)."""
        if kind == LONE and self._gang is not None:
            gang, self._gang = self._gang, None
            _wait(gang)
        if kind in (LONE, CROSS_GANG) and self._singles:
            singles = list(self._singles.values())
            self._singles.clear()
            for out in singles:
                _wait(out)

    def after(self, kind: str, devices: tuple[int, ...], out: Any) -> None:
        """Records the output ``out`` of an executable of ``kind`` launched on this host's ``devices``."""
        if kind in (SINGLE, LONE):
            self._singles[devices[0]] = out
        else:
            self._gang = out


class Steps:
    """Makes a host's steps: over its data plane, its compiled executables and its window."""

    def __init__(self, plane: DataPlane, executables: dict[str, Any], window_size: int):
        self.plane = plane
        self.executables = executables  # fingerprint -> jitted callable
        self.window_size = window_size
        self.in_flight: collections.deque = collections.deque()  # executables' outputs, oldest first
        # Set (``order_cross_host``) on a host of several devices in an island of several hosts.
        self.order: CrossHostOrder | None = None

    def order_cross_host(self) -> None:
        """Orders executables that span hosts from now on (:class:`CrossHostOrder`)."""
        self.order = CrossHostOrder()

    def learn(self, fingerprint: str, devices: Any, process: int) -> None:
        """Executable ``fingerprint`` runs on ``devices`` (this host is process ``process``)."""
        if self.order is not None:
            self.order.kinds[fingerprint] = kind_of(devices, process)

    def unlearn(self, fingerprint: str) -> None:
        """Executable ``fingerprint`` went (no plan runs it any more)."""
        if self.order is not None:
            self.order.kinds.pop(fingerprint, None)

    def make(self, op: Op) -> Step:
        """``op`` as a function ``(env, base, made, peers)`` run for each run of its plan.

        Made once, when the plan is registered: what each run would look up
        again (the executable, shardings, pull specs) is looked up here.
        """
        plane = self.plane
        match op:
            case ExecOp():
                return self._exec(op)
            case PutOp(fresh=True):

                def copy(env: dict, base: int, made: list, peers: set) -> None:
                    env[op.dst] = own_copy(env[op.src])

                return copy
            case PutOp():
                sharding = plane.sharding(op.desc)

                def put(env: dict, base: int, made: list, peers: set) -> None:
                    env[op.dst] = place(env[op.src], sharding)

                return put
            case PostOp():
                uuid, src, pieces = op.offset, op.src, op.pieces
                raw = key_data if op.key_impl is not None else _same

                def post(env: dict, base: int, made: list, peers: set) -> None:
                    plane.post(base + uuid, plane.pieces(raw(env[src]), pieces))

                return post
            case PullOp():
                pull = self._pull(op)
                if op.key_impl is None:
                    return pull
                impl, dst = op.key_impl, op.dst

                def pull_key(env: dict, base: int, made: list, peers: set) -> None:
                    pull(env, base, made, peers)
                    env[dst] = wrap_key(env[dst], impl)

                return pull_key
        raise TypeError(f"not a host step: {op!r}")

    def _exec(self, op: ExecOp) -> Step:
        fn = self.executables[op.fingerprint]
        ins, outs_at = op.in_slots, op.out_slots
        # Windowed executables count against the host's bound (cross-process
        # collectives deadlock beyond it); the others against XLA's own.
        bound = min(self.window_size, PACE) if op.windowed else PACE
        in_flight = self.in_flight
        order = self.order
        if order is not None and op.fingerprint in order.kinds:
            return self._ordered_exec(op, fn, bound, order)
        if len(ins) == 1 and len(outs_at) == 1:  # the common node: one value in, one out
            (one_in,), (one_out,) = ins, outs_at

            def run_one(env: dict, base: int, made: list, peers: set) -> None:
                (out,) = fn(env[one_in])
                env[one_out] = out
                made.append(out)
                pace(in_flight, out, bound)

            return run_one

        def run(env: dict, base: int, made: list, peers: set) -> None:
            outs = fn(*[env[s] for s in ins])
            for slot, array in zip(outs_at, outs, strict=True):
                env[slot] = array
            if outs:
                made.append(outs[0])
                pace(in_flight, outs[0], bound)

        return run

    def _ordered_exec(self, op: ExecOp, fn: Any, bound: int, order: CrossHostOrder) -> Step:
        """:meth:`_exec` on a host whose executables spanning hosts are ordered (:class:`CrossHostOrder`)."""
        ins, outs_at = op.in_slots, op.out_slots
        kind, devices = order.kinds[op.fingerprint]
        in_flight = self.in_flight
        before, after = order.before, order.after

        def run_ordered(env: dict, base: int, made: list, peers: set) -> None:
            before(kind)
            outs = fn(*[env[s] for s in ins])
            for slot, array in zip(outs_at, outs, strict=True):
                env[slot] = array
            if outs:
                after(kind, devices, outs[0])
                made.append(outs[0])
                pace(in_flight, outs[0], bound)

        return run_ordered

    def _pull(self, op: PullOp) -> Step:
        plane = self.plane
        remote = {host for host, _, _ in op.parts if host != plane.index}
        whole = tuple((0, n) for n in op.shape)
        if len(op.parts) == 1 and remote and len(op.parts[0][2]) == 1 and op.parts[0][2][0].bounds == whole:
            # The whole value from one other host in one piece: pulled where it goes.
            (peer, offset, pieces), dst = op.parts[0], op.dst
            home = plane.home(op.desc)
            target = plane.sharding(op.desc)
            specs = plane.specs(pieces, op.dtype, home)

            def pull_whole(env: dict, base: int, made: list, peers: set) -> None:
                peers.add(peer)
                (value,) = plane.pull(peer, base + offset, pieces, op.dtype, home, specs)
                if home is not target:
                    value = place(value, target)
                env[dst] = value
                made.append(value)

            return pull_whole

        def gather(env: dict, base: int, made: list, peers: set) -> None:
            peers.update(remote)
            env[op.dst] = value = plane.gather(op, base, env)
            made.append(value)

        return gather


def _same(value: Any) -> Any:
    return value
