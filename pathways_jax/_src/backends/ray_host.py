"""The host side of the Ray backend: one host process owning its own JAX devices.

Runs inside a Ray actor (``backends/ray.py`` wraps :class:`Host` with
``ray.remote``); this module imports no Ray itself. The controller sends a
host numbered messages (``call``); the host handles them strictly in that
order on one executor thread, whatever order Ray delivers them in, so every
host sees the controller's one order of runs. The data plane is direct: a
value needed by another host is pushed to it (``receive``) by a sender
thread; it never passes through the controller.

Message kinds, in the order the controller numbered them:

- ``"register"``: a plan's part for this host (its steps, constants) and the
  serialized computations (``jax.export``) the host has not seen, cached by
  fingerprint and compiled here.
- ``"run"``: one run of a registered plan: its inputs (values already here,
  or data), which results to keep under which keys. Answered once the run's
  work on this host is complete: ``None``, or a :class:`RunFailure`.
- ``"fetch"``: a kept value as a numpy array. ``"free"``: drop kept values.

A plan's part is a list of operations (:class:`ExecOp`, :class:`PutOp`,
:class:`SendOp`, :class:`RecvOp`) whose shardings are host-local descriptors
(:class:`SingleDesc`, :class:`NamedDesc`). They are NamedTuples defined here,
so both sides pickle them without this module importing the rest of
pathways_jax.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import traceback
from typing import Any, Literal, NamedTuple

# How long a host waits for a value another host pushes before failing the run.
RECEIVE_TIMEOUT_S = 600.0


class Lost(Exception):
    """A value this host waited for comes from a host that was lost."""

    def __init__(self, peer: int, message: str):
        super().__init__(message)
        self.peer = peer


class RemoteFailure(Exception):
    """A value this host waited for comes from a run that failed on its host."""


class SingleDesc(NamedTuple):
    """A value on one device: the host's device number ``device_index``."""

    device_index: int
    kind: Literal["single"] = "single"


class NamedDesc(NamedTuple):
    """A value sharded with ``spec`` over a mesh of the host's devices."""

    device_indices: tuple[int, ...]  # the host's devices, in the mesh's order
    grid_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    spec: Any  # a jax.sharding.PartitionSpec
    kind: Literal["named"] = "named"


ShardingDesc = SingleDesc | NamedDesc


class ExecOp(NamedTuple):
    """Run a compiled computation (by fingerprint) on the values in ``in_slots``."""

    fingerprint: str
    in_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    windowed: bool  # counts against the host's bound of executables in flight
    name: str  # the node, as messages name it
    kind: Literal["exec"] = "exec"


class PutOp(NamedTuple):
    """Copy slot ``src`` to slot ``dst`` with another sharding, on this host."""

    src: int
    dst: int
    desc: ShardingDesc
    kind: Literal["put"] = "put"


class SendOp(NamedTuple):
    """Push slot ``src`` to host ``peer``; ``tag`` (the plan's step) names it there."""

    src: int
    peer: int
    tag: int
    kind: Literal["send"] = "send"


class RecvOp(NamedTuple):
    """Wait for the value host ``peer`` pushes under ``tag``; put it in slot ``dst``."""

    dst: int
    peer: int
    tag: int
    desc: ShardingDesc
    kind: Literal["recv"] = "recv"


Op = ExecOp | PutOp | SendOp | RecvOp


class RunFailure(NamedTuple):
    """Why a host's part of a run failed: the answer to its ``"run"`` message."""

    kind: Literal["error", "lost"]  # "lost": a value was to come from the lost host ``peer``
    peer: int | None
    message: str
    trace: str  # the host's formatted traceback ("" if none)


def sharding_of(desc: ShardingDesc, devices: list) -> Any:
    """The host-local ``jax.sharding.Sharding`` a controller descriptor names."""
    import jax
    import numpy as np

    if isinstance(desc, SingleDesc):
        return jax.sharding.SingleDeviceSharding(devices[desc.device_index])
    grid = np.array([devices[i] for i in desc.device_indices], dtype=object).reshape(desc.grid_shape)
    return jax.sharding.NamedSharding(jax.sharding.Mesh(grid, desc.axis_names), desc.spec)


class Host:
    """A host: its devices, the values it keeps, compiled computations and registered plans."""

    def __init__(self, index: int, num_devices: int, window: int, x64: bool = False):
        import jax

        # The process is fresh: JAX's backend has not started, so the device
        # count and platform can still be set (DESIGN §5). Dtypes follow the
        # controller's: exported computations expect its 64-bit mode.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", num_devices)
        jax.config.update("jax_enable_x64", x64)
        self.index = index
        self.devices = sorted(jax.devices(), key=lambda d: d.id)
        self.window = window
        self.peers: list[Any] = []
        self.values: dict[int, Any] = {}
        self.executables: dict[str, Any] = {}  # fingerprint -> jitted callable
        self.plans: dict[int, tuple[list[Op], dict]] = {}  # plan key -> (ops, constants)
        # plan key -> why its registration failed, and the host's traceback
        self.broken: dict[int, tuple[str, str]] = {}
        self.lost_peers: set[int] = set()
        self.runs_done = 0
        self._inbox: dict[tuple, Any] = {}
        self._inbox_cv = threading.Condition()
        self._queue: dict[int, tuple] = {}
        self._next_seq = 0
        self._queue_cv = threading.Condition()
        self._in_flight: collections.deque = collections.deque()
        self._sends = _Work()  # (peer, tag, value): values to push to other hosts
        self._done = _Work()  # (kind, arrays or array, future): answered once ready
        self._loop: Any = None
        for target, name in (
            (self._execute_loop, "executor"),
            (self._send_loop, "sender"),
            (self._done_loop, "completer"),
        ):
            threading.Thread(target=target, name=f"pathways-host{index}-{name}", daemon=True).start()

    # --- messages (called on the actor's event loop) -----------------------------------

    async def setup(self, peers: list[Any]) -> dict:
        import asyncio

        import jax

        self._loop = asyncio.get_running_loop()
        self.peers = list(peers)
        return {
            "pid": os.getpid(),
            "platform": self.devices[0].platform,
            "devices": len(self.devices),
            "jax": jax.__version__,
        }

    async def call(self, seq: int, kind: str, *args: Any) -> Any:
        """A numbered message from the controller; answered when it has been handled."""
        future = self._loop.create_future()
        with self._queue_cv:
            self._queue[seq] = (kind, args, future)
            self._queue_cv.notify()
        return await future

    async def receive(self, tag: tuple, payload: Any) -> None:
        """A value (or a failure marker) pushed by another host for one of this host's runs."""
        with self._inbox_cv:
            self._inbox[tag] = payload
            self._inbox_cv.notify_all()

    async def peer_lost(self, peer: int) -> None:
        with self._inbox_cv:
            self.lost_peers.add(peer)
            self._inbox_cv.notify_all()

    async def ping(self) -> int:
        return self.index

    async def stats(self) -> dict:
        return {
            "values": len(self.values),
            "runs": self.runs_done,
            "executables": len(self.executables),
            "plans": len(self.plans),
        }

    # --- the executor ----------------------------------------------------------------

    def _answer(self, future: Any, value: Any) -> None:
        def settle() -> None:
            if not future.done():
                future.set_result(value)

        self._loop.call_soon_threadsafe(settle)

    def _execute_loop(self) -> None:
        while True:
            with self._queue_cv:
                while self._next_seq not in self._queue:
                    self._queue_cv.wait()
                kind, args, future = self._queue.pop(self._next_seq)
                self._next_seq += 1
            try:
                if kind == "run":
                    self._run(future, *args)
                    continue
                result = getattr(self, f"_{kind}")(*args)
            except BaseException as exc:  # the message fails, the host keeps serving
                result = _Error(f"host {self.index}: {type(exc).__name__}: {exc}", _trace(exc))
            if kind == "fetch" and not isinstance(result, _Error):
                self._done.put(("fetch", result, future))
            else:
                self._answer(future, result)

    def _register(self, key: int, ops: list[Op], constants: dict, blobs: dict) -> None:
        try:
            self._compile_plan(key, ops, constants, blobs)
        except BaseException as exc:  # its runs fail with this reason
            self.broken[key] = (f"registering the plan failed: {type(exc).__name__}: {exc}", _trace(exc))
            raise

    def _compile_plan(self, key: int, ops: list[Op], constants: dict, blobs: dict) -> None:
        import jax

        for fingerprint, (blob, in_descs, out_descs) in blobs.items():
            if fingerprint in self.executables:
                continue
            exported = jax.export.deserialize(blob)
            self.executables[fingerprint] = jax.jit(
                exported.call,
                in_shardings=tuple(sharding_of(d, self.devices) for d in in_descs),
                out_shardings=tuple(sharding_of(d, self.devices) for d in out_descs),
            )
        placed = {
            slot: jax.device_put(data, sharding_of(desc, self.devices))
            for slot, (data, desc) in constants.items()
        }
        self.plans[key] = (ops, placed)

    def _forget(self, key: int) -> None:
        self.plans.pop(key, None)

    def _free(self, keys: list[int]) -> None:
        for key in keys:
            self.values.pop(key, None)

    def _fetch(self, key: int) -> Any:
        if key not in self.values:
            raise KeyError(f"value {key} is not on this host (freed, or its run failed)")
        return self.values[key]

    def _run(self, future: Any, key: int, run_id: int, feeds: list, keep: list, frees: list) -> None:
        import jax

        self._free(frees)
        if key not in self.plans:
            why, trace = self.broken.get(key, ("it was never registered", ""))
            self._answer(
                future, RunFailure("error", None, f"host {self.index}: plan {key} cannot run: {why}", trace)
            )
            return
        ops, constants = self.plans[key]
        env: dict[int, Any] = dict(constants)
        made: list = []
        step = -1
        try:
            for slot, kind, payload in feeds:
                if kind == "value":
                    if payload not in self.values:
                        raise KeyError(
                            f"input value {payload} is not on host {self.index} (freed, or its run failed)"
                        )
                    env[slot] = self.values[payload]
                else:
                    data, desc = payload
                    env[slot] = jax.device_put(data, sharding_of(desc, self.devices))
            for index, op in enumerate(ops):
                step = index
                match op:
                    case ExecOp():
                        if op.windowed:
                            while len(self._in_flight) >= self.window:
                                self._in_flight.popleft().block_until_ready()
                        outs = self.executables[op.fingerprint](*[env[s] for s in op.in_slots])
                        for slot, array in zip(op.out_slots, outs, strict=True):
                            env[slot] = array
                        if outs:
                            made.append(outs[0])
                            if op.windowed:
                                self._in_flight.append(outs[0])
                    case PutOp():
                        env[op.dst] = jax.device_put(env[op.src], sharding_of(op.desc, self.devices))
                    case SendOp():
                        self._send(op.peer, (run_id, op.tag), env[op.src])
                    case RecvOp():
                        data = self._wait_inbox(op.peer, (run_id, op.tag))
                        env[op.dst] = jax.device_put(data, sharding_of(op.desc, self.devices))
                        made.append(env[op.dst])
        except BaseException as exc:
            # Peers waiting for this run's values hear that they will not come.
            for later in ops[step + 1 :] if step >= 0 else ops:
                if isinstance(later, SendOp):
                    self._send(later.peer, (run_id, later.tag), RemoteFailure(f"host {self.index} failed"))
            detail = f"host {self.index}: {_describe(exc, ops, step)}"
            self._answer(
                future,
                RunFailure("lost", exc.peer, detail, "")
                if isinstance(exc, Lost)
                else RunFailure("error", None, detail, _trace(exc)),
            )
            return
        for slot, value_key in keep:
            self.values[value_key] = env[slot]
            made.append(env[slot])
        self._done.put(("run", made, future))

    def _wait_inbox(self, peer: int, tag: tuple) -> Any:
        deadline = time.monotonic() + RECEIVE_TIMEOUT_S
        with self._inbox_cv:
            while tag not in self._inbox:
                if peer in self.lost_peers:
                    raise Lost(peer, f"host {peer}, which was to send this value, was lost")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no value from host {peer} within {RECEIVE_TIMEOUT_S}s")
                self._inbox_cv.wait(min(remaining, 1.0))
            payload = self._inbox.pop(tag)
        if isinstance(payload, Exception):
            raise payload
        return payload

    # --- the data plane and completions -------------------------------------------------

    def _send(self, peer: int, tag: tuple, value: Any) -> None:
        self._sends.put((peer, tag, value))

    def _send_loop(self) -> None:
        import numpy as np

        while True:
            peer, tag, value = self._sends.take()
            if not isinstance(value, Exception):
                try:
                    value = np.asarray(value)  # waits for the value; the executor goes on
                except Exception as exc:
                    value = RemoteFailure(f"host {self.index}: computing the value failed: {exc}")
            # A peer that is gone raises here; the controller handles lost hosts.
            with contextlib.suppress(Exception):
                self.peers[peer].receive.remote(tag, value)

    def _done_loop(self) -> None:
        import numpy as np

        while True:
            kind, what, future = self._done.take()
            if kind == "fetch":
                try:
                    result: Any = np.asarray(what)
                except Exception as exc:
                    result = _Error(f"host {self.index}: {type(exc).__name__}: {exc}", _trace(exc))
                self._answer(future, result)
                continue
            status: RunFailure | None = None
            for array in what:
                try:
                    array.block_until_ready()
                except Exception as exc:
                    status = RunFailure(
                        "error",
                        None,
                        f"host {self.index}: execution failed: {type(exc).__name__}: {exc}",
                        _trace(exc),
                    )
                    break
            self.runs_done += 1
            self._answer(future, status)


class _Work:
    """A FIFO one thread fills and one worker thread drains, waiting when it is empty."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()

    def put(self, item: Any) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def take(self) -> Any:
        with self._cv:
            while not self._items:
                self._cv.wait()
            return self._items.popleft()


class _Error:
    """A failed message's answer (an exception would lose its type crossing Ray).

    ``trace``: the host's formatted traceback, for the controller to attach.
    """

    def __init__(self, message: str, trace: str = ""):
        self.message = message
        self.trace = trace

    def __repr__(self) -> str:
        return f"_Error({self.message!r})"


def _describe(exc: BaseException, ops: list[Op], step: int) -> str:
    where = ""
    if 0 <= step < len(ops):
        op = ops[step]
        where = f" in node {op.name}" if isinstance(op, ExecOp) else f" in a {op.kind} step"
    if isinstance(exc, Lost | RemoteFailure):
        return f"{exc}{where}"
    return f"run failed{where}: {type(exc).__name__}: {exc}"


def _trace(exc: BaseException) -> str:
    """``exc``'s traceback on this host, as text: it crosses to the controller with the error."""
    return "".join(traceback.format_exception(exc))
