"""The host actor: one host process owning its own JAX devices (``ray.remote(Host)`` in ``ray.py``).

The controller sends a host numbered messages (``call``, or its channel);
the host handles them strictly in that order on one executor thread,
whatever order they arrive in, so every host sees the controller's one order
of runs. A completer thread answers each run once its values are ready.

Message kinds, in the order the controller numbered them:

- ``"register"``: a plan's part for this host (its operations, constants) and
  the serialized computations (``jax.export``) the host has not seen, cached
  by fingerprint and compiled here (with their donation); a computation goes
  with the ``"forget"`` of the last plan that runs it.
- ``"run"``: one run of a registered plan: its transfer uuid base, its inputs
  (values already here, or data), which results to keep under which keys.
  Answered once the run's work on this host is complete: its device time, a
  ``RunDone`` with its small kept values, or a ``RunFailure``.
- ``"fetch"``: a kept value as a numpy array (or this host's shards of one
  spanning hosts). ``"free"``: drop kept values. ``"forget"``: drop a plan.
  ``"peers"``: the other hosts' transfer server addresses. ``"colocated"``: a
  ``colocated_python`` call, run here in this order (``colocated.py``).

**Islands of several hosts.** The hosts of an island form one
``jax.distributed`` system (``setup``): each sees the island's devices as one
global mesh and runs the island's SPMD executables itself, in the
controller's order, as a multi-controller JAX program would. That order is
what makes their collectives meet.

**Transport.** With the controller's channel (``channel_link``, the default)
``setup`` is given an endpoint that connects this host to it: messages arrive
over ZeroMQ in the controller's order and answers go back batched. The
``call`` method serves a controller that sends one Ray actor call per message
(``host_link.RayCallLink``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pathways_jax._src.backends.ray_host import checkpoint
from pathways_jax._src.backends.ray_host.answers import (
    MessageFailed,
    Role,
    RunDone,
    RunFailure,
    describe_failure,
    trace_of,
)
from pathways_jax._src.backends.ray_host.colocated import Colocated
from pathways_jax._src.backends.ray_host.faults import Armed, Fault
from pathways_jax._src.backends.ray_host.ops import Op, donated_slots, fingerprints_of, sharding_of
from pathways_jax._src.backends.ray_host.plane import DataPlane, node_ip
from pathways_jax._src.backends.ray_host.steps import Steps
from pathways_jax._src.backends.ray_host.values import (
    KeyData,
    from_wire,
    is_ready,
    is_small,
    own_copy,
    place,
    readable,
)


class Host:
    """A host: its devices, the values it keeps, compiled computations and registered plans."""

    def __init__(
        self, index: int, num_devices: int, window_size: int, x64: bool = False, platform: str = "cpu"
    ):
        import jax

        # The process is fresh: JAX's backend has not started, so the device
        # count and platform can still be set (DESIGN §5). Dtypes follow the
        # controller's: exported computations expect its 64-bit mode. The
        # backend starts in ``setup``, after ``jax.distributed`` is set up.
        if platform == "cpu":
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", num_devices)
        else:  # the accelerators Ray gave this actor (num_gpus), CPU beside them
            jax.config.update("jax_platforms", f"{'cuda' if platform == 'gpu' else platform},cpu")
        jax.config.update("jax_enable_x64", x64)
        self.x64 = x64  # the process's mode; a plan lowered in the other runs under its own
        self.index = index
        self.platform = platform
        self.num_devices = num_devices
        self.window_size = window_size
        self.role = Role(index, 0, 1, None)
        self.plane = DataPlane(index)
        self.values: dict[int, Any] = {}
        # Why values this host was to keep were never made (their run or call failed), until freed:
        # a run that reads one fails saying so, not that the value is missing.
        self.unmade: dict[int, str] = {}
        self.executables: dict[str, Any] = {}  # fingerprint -> jitted callable
        # fingerprint -> how many registered plans (kept or broken) run it: an executable no plan
        # runs any more goes with the last one's Forget, so a client that compiles many programs
        # and drops them leaves nothing behind (the controller forgets it has it at the same time).
        self.uses: collections.Counter[str] = collections.Counter()
        self.consuming: dict[int, frozenset[int]] = {}  # plan key -> slots its computations donate
        self.steps = Steps(self.plane, self.executables, window_size)
        # plan key -> (ops, constants, steps, the 64-bit mode it runs under: None for the process's)
        self.plans: dict[int, tuple[list[Op], dict, list, bool | None]] = {}
        # plan key -> (why its registration failed, the host's traceback, its ops)
        self.broken: dict[int, tuple[str, str, list[Op]]] = {}
        self.runs_done = 0
        self.fed = 0  # values that came with a run's message (arguments)
        self.fed_bytes = 0  # and their bytes (of an argument over several hosts: this host's blocks)
        self.faults = Armed()  # a fault pw.faults asked this host to strike (faults.py)
        self.saves: dict[int, checkpoint.Stashed] = {}  # checkpoint saves' copies, by ticket
        self.writer = checkpoint.Worker("pathways-ckpt-write")  # writes them to storage
        self.reader = checkpoint.Worker("pathways-ckpt-read")  # reads restored values
        self.colocated = Colocated(index)  # colocated_python functions and objects (colocated.py)
        self._queue: dict[int, tuple] = {}
        self._next_seq = 0
        self._next_arrival = 0  # the number the next message from the channel takes
        self._queue_cv = threading.Condition()
        self._last_done = 0.0  # when the completer saw the previous run end
        self._done = _Work()  # (kind, arrays or array, future, peers): answered once ready
        self._loop: Any = None
        self._channel: Any = None  # the host's end of the controller's channel (channel_link)
        for target, name in ((self._execute_loop, "executor"), (self._done_loop, "completer")):
            threading.Thread(target=target, name=f"pathways-host{index}-{name}", daemon=True).start()

    # --- set-up (called on the actor's event loop, before any message) --------------------

    async def address(self, reach: str | None) -> str:
        """A free ``ip:port`` on this host's node: its island's coordinator listens there."""
        import socket

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"{node_ip(reach)}:{port}"

    async def setup(self, role: Role, link: Any = None) -> dict:
        """Starts JAX (joining the island's ``jax.distributed`` system) and the transfer server.

        The members of an island of several hosts must all be in ``setup`` at
        once: joining blocks until every member has.
        """
        import asyncio

        import jax

        self._loop = asyncio.get_running_loop()
        self.role = role
        if link is not None:  # the controller's channel (channel_link.Endpoint): messages come there
            self._channel = link.connect(self._arrived)
        if role.size > 1:
            jax.distributed.initialize(role.coordinator, role.size, role.rank)
        plane = self.plane
        plane.start(
            sorted(jax.local_devices(), key=lambda d: d.id),
            sorted(jax.devices(), key=lambda d: (d.process_index, d.id)),
            node_ip(role.reach),
        )
        if role.size > 1 and len(plane.devices) > 1:  # several hosts of several devices: see CrossHostOrder
            self.steps.order_cross_host()
        return {
            "pid": os.getpid(),
            "platform": plane.devices[0].platform,
            "devices": len(plane.devices),
            "island_devices": len(plane.island_devices),
            "transfer": plane.server.address(),
            "jax": jax.__version__,
        }

    # --- messages (called on the actor's event loop) -----------------------------------

    async def call(self, seq: int, kind: str, *args: Any) -> Any:
        """A numbered message from the controller; answered when it has been handled."""
        future = self._loop.create_future()
        with self._queue_cv:
            self._queue[seq] = (kind, args, future)
            self._queue_cv.notify()
        return await future

    def _arrived(self, kind: str, args: tuple, seq: int) -> None:
        """A message from the controller's channel (its receive thread), numbered in arrival order.

        The channel delivers one connection's messages in the order they were
        sent, and refuses replayed ones: arrival order is the controller's. A
        fetch of a value that is here and computed is answered at once, on the
        channel's thread: nothing it could wait for in the queue changes it.
        """
        if kind == "fetch":
            value = self.values.get(args[0])
            if value is not None and not isinstance(value, checkpoint.Pending) and is_ready(value):
                self._reply(seq, self._read(value), args[1] if len(args) > 1 else None)
                return
        with self._queue_cv:
            self._queue[self._next_arrival] = (kind, args, seq)
            self._next_arrival += 1
            self._queue_cv.notify()

    async def peer_lost(self, peer: int) -> None:
        """Host ``peer`` was lost: pulls from it fail now, and later ones are not tried."""
        self.plane.lose(peer)

    async def ping(self) -> int:
        return self.index

    async def versions(self, read: Callable[[], dict[str, str]]) -> tuple[dict[str, str], str]:
        """``read()``: this host's versions of pathways_jax, its wire format and jax (those installed
        on its node: ``read`` comes pickled by reference, so its module is the node's), and the node's
        name: the controller refuses a host of other versions at its start."""
        import socket

        return read(), socket.gethostname()

    async def arm(self, fault: Fault) -> None:
        """Holds ``fault`` until the run it strikes in (``pw.faults``); one for now strikes just after this answer."""
        self.faults.arm(fault)

    async def stats(self) -> dict:
        return {
            "values": len(self.values),
            "runs": self.runs_done,
            "executables": len(self.executables),
            "plans": len(self.plans),
            "pulls": self.plane.pulls,
            "posts": self.plane.posts,
            "fed": self.fed,
            "fed_bytes": self.fed_bytes,
            "colocated": self.colocated.stats(),
            "pid": os.getpid(),
            # The whole process's CPU seconds (every thread: the executor, Ray's, XLA's):
            # what the simulator's calibration charges a host.
            "cpu_s": time.process_time(),
        }

    # --- the executor ----------------------------------------------------------------

    def _answer(self, future: Any, value: Any) -> None:
        if isinstance(future, int):  # a message that came over the channel: its number
            self._channel.answer(future, value)
            return

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
                result = self._failed(exc)
            if kind == "fetch" and not isinstance(result, MessageFailed):
                reply = args[1] if len(args) > 1 else None
                if is_ready(result):  # answered here: no hand-off to the completer
                    self._reply(future, self._read(result), reply)
                else:
                    self._done.put(("fetch", result, future, reply))
            elif isinstance(result, concurrent.futures.Future):  # answered once done (a checkpoint's write)
                result.add_done_callback(functools.partial(self._answer_when_done, future))
            else:
                self._answer(future, result)

    def _failed(self, exc: BaseException) -> MessageFailed:
        """A message's failure as its answer: the error, this host, and its traceback."""
        return MessageFailed(f"host {self.index}: {type(exc).__name__}: {exc}", trace_of(exc))

    def _answer_when_done(self, future: Any, done: concurrent.futures.Future) -> None:
        exc = done.exception()
        if exc is None:
            self._answer(future, done.result())
        else:
            self._answer(future, self._failed(exc))

    def _reply(self, future: Any, value: Any, reply: Any) -> None:
        """A fetch's answer: straight to the client ``reply`` names (its sender, the controller
        service, then gets ``None``), or to the sender when it names none, or when that client's
        channel does not take it in time (the service passes it on)."""
        if reply is not None and self._channel is not None and self._channel.reply(reply, value):
            self._answer(future, None)
            return
        self._answer(future, value)

    def _read(self, value: Any) -> Any:
        """A kept value as its fetch's answer (what cannot be read answers as an error)."""
        import numpy as np

        try:
            return readable(value, np)
        except Exception as exc:
            return self._failed(exc)

    def _peers(self, addresses: dict[int, str]) -> None:
        """The transfer server of every host: see :meth:`DataPlane.connect`."""
        self.plane.connect(addresses)

    def _register(
        self, key: int, ops: list[Op], constants: dict, blobs: dict, x64: bool | None = None
    ) -> None:
        """Compiles a plan's computations and places its constants.

        ``x64``: the controller's ``jax_enable_x64`` when it lowered the plan.
        It may have changed since the host started (a script that turns it on
        after ``pw.init``): the plan's runs then run under that mode (JAX's
        thread-local ``jax.enable_x64``), so its 64-bit inputs stay 64-bit.
        """
        mode = None if x64 is None or x64 == self.x64 else x64
        self.uses.update(fingerprints_of(ops))
        self._forget(key)  # registered before: its old ops are counted out (after: nothing shared goes)
        try:
            with _mode(mode):
                self._compile_plan(key, ops, constants, blobs, mode)
        except BaseException as exc:  # its runs fail with this reason
            self.broken[key] = (
                f"registering the plan failed: {type(exc).__name__}: {exc}",
                trace_of(exc),
                ops,
            )
            raise

    def _compile_plan(self, key: int, ops: list[Op], constants: dict, blobs: dict, mode: bool | None) -> None:
        import jax

        devices = self.plane.island_devices
        for fingerprint, (blob, in_descs, out_descs, donated) in blobs.items():
            if fingerprint in self.executables:
                continue
            exported = jax.export.deserialize(blob)
            in_shardings = tuple(sharding_of(d, devices) for d in in_descs)
            out_shardings = tuple(sharding_of(d, devices) for d in out_descs)
            self.executables[fingerprint] = jax.jit(
                exported.call,
                in_shardings=in_shardings,
                out_shardings=out_shardings,
                donate_argnums=donated,
            )
            self.steps.learn(
                fingerprint,
                {d for sharding in (*in_shardings, *out_shardings) for d in sharding.device_set},
                jax.process_index(),
            )
        placed = {
            slot: place(from_wire(data), sharding_of(desc, devices))
            for slot, (data, desc) in constants.items()
        }
        self.plans[key] = (ops, placed, [self.steps.make(op) for op in ops], mode)
        # The slots the plan's computations consume: a value fed there that other clients of a
        # controller service may read too is copied first, so that their value stays.
        self.consuming[key] = donated_slots(ops)

    def _forget(self, key: int) -> None:
        """Drops plan ``key``, and the executables no other plan runs."""
        plan, broken = self.plans.pop(key, None), self.broken.pop(key, None)
        self.consuming.pop(key, None)
        ops = plan[0] if plan is not None else broken[2] if broken is not None else []
        for fingerprint in fingerprints_of(ops):
            self.uses[fingerprint] -= 1
            if self.uses[fingerprint] <= 0:
                del self.uses[fingerprint]
                self.executables.pop(fingerprint, None)
                self.steps.unlearn(fingerprint)

    def _free(self, keys: list[int]) -> None:
        for key in keys:
            self.values.pop(key, None)
            self.unmade.pop(key, None)
            self.colocated.free(key)

    def _colocated(self, order: Any, feeds: list) -> Any:
        """A colocated_python call (or its outputs adopted): see ``colocated.py``."""
        unmade = [self.unmade[p] for _slot, kind, p in feeds if kind == "value" and p in self.unmade]
        if unmade:
            answer = MessageFailed(f"host {self.index}: an input of the call was never made: {unmade[0]}")
        else:
            answer = self.colocated.handle(order, feeds, self.values, self.plane.island_devices)
        if isinstance(answer, MessageFailed):
            self._not_made((kept.key for kept in order.keep or ()), answer.message)
        return answer

    def _not_made(self, keys: Any, message: str) -> None:
        """The values under ``keys`` will never be made here: their run or call failed with ``message``."""
        for key in keys:
            if key not in self.values:
                self.unmade[key] = message

    def _stash(self, ticket: int, writes: list[checkpoint.Write], ocdbt: bool) -> None:
        """Copies the values a checkpoint saves (``checkpoint.stash``): later runs may free them."""
        self.saves[ticket] = checkpoint.stash(self._kept, writes, ocdbt)

    def _store(self, ticket: int, write: bool) -> concurrent.futures.Future | None:
        """Writes save ``ticket``'s copies to storage in the background (or drops them)."""
        stashed = self.saves.pop(ticket, None)
        if not write:
            return None
        if stashed is None:
            raise KeyError(f"checkpoint save {ticket} has no copies on this host")
        self.faults.save_started()
        return self.writer.store(stashed)

    def _load(self, reads: list[checkpoint.Read]) -> concurrent.futures.Future:
        """Reads checkpointed values onto this host's devices, each kept under its key.

        The reads go on in the background (answered once done); meanwhile each value is
        :class:`checkpoint.Pending`, which :meth:`_kept` waits for.
        """
        reading = self.reader.load(reads, self.plane.island_devices, sharding_of)
        for read in reads:
            self.values[read.key] = checkpoint.Pending(reading, read.key)
        return checkpoint.finished(reading)

    def _kept(self, key: int) -> Any:
        """The value kept under ``key`` (a restored one once read: on the executor only)."""
        if key not in self.values:
            why = self.unmade.get(key)
            if why is not None:
                raise InputFailed(f"an input of it (value {key}) was never made: {why}")
            raise KeyError(f"value {key} is not on host {self.index} (freed, or its run failed)")
        value = self.values[key]
        if isinstance(value, checkpoint.Pending):
            value = value.value()
            if self.values.get(key) is not None:
                self.values[key] = value
        return value

    def _fetch(self, key: int, reply: Any = None) -> Any:
        return self._kept(key)

    def _run(
        self, future: Any, key: int, run_id: int, base: int, feeds: list, keep: list, frees: list
    ) -> None:
        self._free(frees)
        if key not in self.plans:
            why, trace, ops = self.broken.get(key, ("it was never registered", "", []))
            message = f"host {self.index}: plan {key} cannot run: {why}"
            self.plane.abandon(ops, 0, base, message)
            self._not_made((value_key for _slot, value_key in keep), message)
            self._answer(future, RunFailure("error", None, message, trace))
            return
        ops, constants, steps, mode = self.plans[key]
        with _mode(mode):
            self._run_plan(future, ops, constants, steps, base, feeds, keep, self.consuming[key])

    def _run_plan(
        self,
        future: Any,
        ops: list[Op],
        constants: dict,
        steps: list,
        base: int,
        feeds: list,
        keep: list,
        consuming: frozenset[int],
    ) -> None:
        """Runs a plan's steps on its inputs ``feeds``; ``consuming``: the slots its computations
        consume (donation): a shared value fed there (another client may read it) is copied first."""
        enqueued = time.monotonic()
        env: dict[int, Any] = dict(constants)
        made: list = []
        peers: set[int] = set()
        step = -1
        try:
            for slot, kind, payload in feeds:
                if kind == "value":
                    env[slot] = self._kept(payload)
                elif kind == "shared":  # a value other clients of a service may read too
                    value = self._kept(payload)
                    env[slot] = own_copy(value) if slot in consuming else value
                else:
                    data, desc = payload
                    env[slot] = place(from_wire(data), self.plane.sharding(desc))
                    self.fed += 1
                    self.fed_bytes += _nbytes(data)
            for index, run_step in enumerate(steps):
                step = index
                run_step(env, base, made, peers)
            self.faults.run_enqueued()
        except BaseException as exc:
            # Peers waiting for this run's values get errors in their place, and
            # what peers posted for it is taken off their servers: nothing waits.
            message = f"host {self.index}: {describe_failure(exc, ops, step)}"
            self.plane.abandon(ops, step + 1 if step >= 0 else 0, base, message)
            self._not_made((value_key for _slot, value_key in keep), message)
            self._answer(
                future,
                RunFailure("error", None, message, trace_of(exc), tuple(sorted(peers)), _error_class(exc)),
            )
            return
        small = []
        for slot, value_key in keep:
            value = env[slot]
            self.values[value_key] = value
            made.append(value)
            if is_small(value):
                small.append((value_key, value))
        self._done.put(("run", made, future, (tuple(sorted(peers)), enqueued, small)))

    # --- completions ---------------------------------------------------------------------

    def _done_loop(self) -> None:
        import numpy as np

        while True:
            kind, what, future, peers = self._done.take()
            if kind == "fetch":
                self._reply(future, self._read(what), peers)  # (a fetch's reply rides in that slot)
                continue
            peers, enqueued, small = peers
            status: RunFailure | RunDone | float | None = None
            try:
                # Newest first: once it is done the older ones mostly are, so this
                # thread wakes about once per run, not once per array.
                for array in reversed(what):
                    array.block_until_ready()
            except Exception as exc:
                lost = [peer for peer in peers if peer in self.plane.lost_peers]
                status = RunFailure(
                    "lost" if lost else "error",
                    lost[0] if lost else None,
                    f"host {self.index}: execution failed: {type(exc).__name__}: {exc}",
                    trace_of(exc),
                    peers,
                    _error_class(exc),
                )
            self.runs_done += 1
            if status is None:
                # Success is the run's device time here: from when its work was
                # enqueued or the previous run ended, whichever is later, to its end.
                now = time.monotonic()
                device_s = now - max(enqueued, self._last_done)
                status = device_s
                self._last_done = now
                if small:  # read later, by a fetch, if it cannot be read now (the fetch says why)
                    with contextlib.suppress(Exception):
                        status = RunDone(device_s, {key: readable(value, np) for key, value in small})
            self._answer(future, status)


def _error_class(exc: BaseException) -> str:
    """What :class:`RunFailure` says of the class of ``exc``: "JaxRuntimeError" for JAX's runtime
    errors (an allocation that failed...), which the controller raises as that class too."""
    import jax

    return "JaxRuntimeError" if isinstance(exc, jax.errors.JaxRuntimeError) else ""


class InputFailed(Exception):
    """A run's input was never made here: the run or call that was to make it failed."""


def _mode(x64: bool | None) -> Any:
    """A context running JAX in 64-bit mode ``x64`` on this thread (None: as the process runs)."""
    if x64 is None:
        return contextlib.nullcontext()
    import jax

    return jax.enable_x64(x64)


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


def _nbytes(data: Any) -> int:
    """The bytes of a fed value as it came (numpy, this host's blocks, or typed keys' data)."""
    return int(getattr(data.data if isinstance(data, KeyData) else data, "nbytes", 0))
