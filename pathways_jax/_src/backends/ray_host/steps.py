"""A plan's operations made into steps: functions a host runs, in order, for each run of the plan.

A step is ``step(env, base, made, peers)``: it reads and writes the run's
slots ``env``, posts and pulls under the run's transfer uuid ``base``,
appends what it made to ``made`` (the run is done when they are ready) and
the hosts it pulled from to ``peers``. Executables are paced (:func:`pace`):
a host keeps a bounded number in flight.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from pathways_jax._src.backends.ray_host.ops import ExecOp, Op, PostOp, PullOp, PutOp
from pathways_jax._src.backends.ray_host.plane import DataPlane
from pathways_jax._src.backends.ray_host.values import key_data, place, wrap_key

# Executables a host keeps in flight that no window bounds (one device, no
# collective across processes): below XLA:CPU's own bound of 32 per device,
# so that the executor waits for many at once instead of being woken after
# each (the dispatch benchmark's cross-host chain: a host's executor thread
# 41 -> 29 us of CPU a node, the host's process 131 -> 120).
PACE = 24

Step = Callable[[dict, int, list, set], None]


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
        try:
            in_flight.popleft().block_until_ready()
        except Exception:
            continue


class Steps:
    """Makes a host's steps: over its data plane, its compiled executables and its window."""

    def __init__(self, plane: DataPlane, executables: dict[str, Any], window_size: int):
        self.plane = plane
        self.executables = executables  # fingerprint -> jitted callable
        self.window_size = window_size
        self.in_flight: collections.deque = collections.deque()  # executables' outputs, oldest first

    def make(self, op: Op) -> Step:
        """``op`` as a function ``(env, base, made, peers)`` run for each run of its plan.

        Made once, when the plan is registered: what each run would look up
        again (the executable, shardings, pull specs) is looked up here.
        """
        plane = self.plane
        match op:
            case ExecOp():
                return self._exec(op)
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
