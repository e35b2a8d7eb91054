"""The host side of the Ray backend: one host process owning its own JAX devices.

Runs inside a Ray actor (``backends/ray.py`` wraps :class:`Host` with
``ray.remote``); this module imports Ray only to learn its node's address.
The controller sends a host numbered messages (``call``); the host handles
them strictly in that order on one executor thread, whatever order Ray
delivers them in, so every host sees the controller's one order of runs.

**Islands of several hosts.** The hosts of an island form one
``jax.distributed`` system (``setup``): each sees the island's devices as
one global mesh, and each runs the island's SPMD executables itself, in
the controller's order, as a multi-controller JAX program would. That order
is what makes their collectives meet: the same programs in another order on
another host would pair the wrong collectives (wrong results or a hang).

**The data plane.** Each host starts a transfer server
(``jax.experimental.transfer``). A value another host needs is offered
there (:class:`PostOp`) under a uuid the controller handed out with the
run, and pulled by that host (:class:`PullOp`): host to host, never through
the controller or a Ray call. A run that fails offers errors in place of
its values, so a pull never waits for a value that will not come; a lost
peer's pulls are failed at once (``peer_lost``).

Message kinds, in the order the controller numbered them:

- ``"register"``: a plan's part for this host (its steps, constants) and the
  serialized computations (``jax.export``) the host has not seen, cached by
  fingerprint and compiled here.
- ``"run"``: one run of a registered plan: its transfer uuid base, its inputs
  (values already here, or data), which results to keep under which keys.
  Answered once the run's work on this host is complete: ``None``, or a
  :class:`RunFailure`.
- ``"fetch"``: a kept value as a numpy array (or this host's shards of one
  spanning hosts). ``"free"``: drop kept values. ``"peers"``: the other
  hosts' transfer server addresses.

A plan's part is a list of operations (:class:`ExecOp`, :class:`PutOp`,
:class:`PostOp`, :class:`PullOp`) whose shardings are descriptors over the
island's devices (:class:`SingleDesc`, :class:`NamedDesc`). They are
NamedTuples defined here, so both sides pickle them without this module
importing the rest of pathways_jax.

**Transport.** With the controller's channel (``channel_link``, the default)
``setup`` is given an endpoint that connects this host to it: messages arrive
over ZeroMQ in the controller's order and answers go back batched. The
``call`` actor method serves a controller that sends one Ray actor call per
message (``host_link.RayCallLink``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import traceback
from typing import Any, Literal, NamedTuple

# Executables a host keeps in flight that no window bounds (one device, no
# collective across processes): below XLA:CPU's own bound of 32 per device,
# so that the executor waits for many at once instead of being woken after
# each (the dispatch benchmark's cross-host chain: a host's executor thread
# 41 -> 29 us of CPU a node, the host's process 131 -> 120).
PACE = 24


class SingleDesc(NamedTuple):
    """A value on one device: number ``device_index`` of its island's devices."""

    device_index: int
    kind: Literal["single"] = "single"


class NamedDesc(NamedTuple):
    """A value sharded with ``spec`` over a mesh of its island's devices (of one host or several)."""

    device_indices: tuple[int, ...]  # the island's devices, in the mesh's order
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


class Piece(NamedTuple):
    """One distinct shard of a value moving between hosts.

    ``position``: the device holding it, numbered in its island's global
    device order; ``bounds``: ``(start, stop)`` per dimension of the value;
    ``shape``: the shard's shape.
    """

    position: int
    bounds: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]


class PostOp(NamedTuple):
    """Offer this host's ``pieces`` of slot ``src`` to host ``peer`` on the transfer server.

    The uuid is the run's transfer base (sent with the run) plus ``offset``;
    the peer pulls it, host to host, without the controller.
    """

    src: int
    peer: int
    offset: int
    pieces: tuple[Piece, ...]
    dtype: str
    key_impl: str | None = None  # a typed key's: its key_data goes (pieces and dtype are the data's)
    kind: Literal["post"] = "post"


class PullOp(NamedTuple):
    """Gather a value from its hosts into slot ``dst`` with sharding ``desc``.

    ``parts``: ``(host, offset, pieces)`` per source host; this host's own
    pieces (``host`` is this one) are read from slot ``src`` directly, the
    others are pulled from their hosts' transfer servers. The pieces are put
    together on this host, then placed (resharded locally).
    """

    dst: int
    src: int
    parts: tuple[tuple[int, int, tuple[Piece, ...]], ...]
    shape: tuple[int, ...]
    dtype: str
    desc: Any  # ShardingDesc
    key_impl: str | None = (
        None  # a typed key's: its key_data comes (shape and dtype are the data's), then wrapped
    )
    kind: Literal["pull"] = "pull"


Op = ExecOp | PutOp | PostOp | PullOp


class RunFailure(NamedTuple):
    """Why a host's part of a run failed: the answer to its ``"run"`` message."""

    kind: Literal["error", "lost"]  # "lost": a value was to come from the lost host ``peer``
    peer: int | None
    message: str
    trace: str  # the host's formatted traceback ("" if none)
    peers: tuple[int, ...] = ()  # the hosts this run pulled values from


class RunDone(NamedTuple):
    """A host's part of a run completed: its device time, and its small kept values.

    ``values``: each kept value of at most :data:`SMALL_BYTES` held whole on
    this host, as the controller would fetch it (key -> numpy array or
    :class:`KeyData`), so reading it costs no round trip.
    """

    device_s: float
    values: dict[int, Any]


# Kept values up to this size come back with the run's completion (a loss, a metric).
SMALL_BYTES = 64


class Refused(NamedTuple):
    """The controller service's answer to a message it would not forward (a handle not the sender's)."""

    message: str
    kind: str = "access"  # "access": a handle not the sender's; "memory": over budget; "gone": client left


class Role(NamedTuple):
    """A host's place in its island, sent with ``setup``.

    An island of several hosts is one ``jax.distributed`` system: ``rank``
    is this host's process id in it, ``size`` the number of hosts and
    ``coordinator`` the address of the coordination service (on rank 0).
    ``reach``: an address every host reaches (the Ray cluster's), whose route
    gives the address this host serves on.
    """

    island: int
    rank: int
    size: int
    coordinator: str | None
    reach: str | None = None


def sharding_of(desc: ShardingDesc, devices: list) -> Any:
    """The ``jax.sharding.Sharding`` a controller descriptor names over an island's devices."""
    import jax
    import numpy as np

    if isinstance(desc, SingleDesc):
        return jax.sharding.SingleDeviceSharding(devices[desc.device_index])
    grid = np.array([devices[i] for i in desc.device_indices], dtype=object).reshape(desc.grid_shape)
    return jax.sharding.NamedSharding(jax.sharding.Mesh(grid, desc.axis_names), desc.spec)


class KeyData(NamedTuple):
    """Typed PRNG keys on their way between the controller and a host: raw data and implementation.

    ``data``: ``jax.random.key_data`` of the keys (numpy, or a host's
    :class:`Shards` of it); ``impl``: the implementation's name
    (``"threefry2x32"``, ``"rbg"``, ...), for ``jax.random.wrap_key_data``.
    """

    data: Any
    impl: str


def to_wire(value: Any) -> Any:
    """``value`` as Ray ships it: a numpy array, or :class:`KeyData` for typed keys."""
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.extended):
        return KeyData(np.asarray(jax.random.key_data(value)), str(jax.random.key_impl(value)))
    return np.asarray(value)


def from_wire(data: Any) -> Any:
    """What :func:`to_wire` made, as a value again (typed keys wrapped back)."""
    if isinstance(data, KeyData):
        import jax

        return jax.random.wrap_key_data(data.data, impl=data.impl)
    return data


def place(data: Any, sharding: Any) -> Any:
    """``data`` (numpy, or an array on this host) put on ``sharding``, which may span hosts.

    Over devices of several hosts, each host makes its own shards (every
    host of the island holds the same ``data``) and the result is one global
    array, as a multi-controller JAX program would build it.
    """
    import jax

    if getattr(data, "sharding", None) == sharding:  # already there (a pulled value, most often)
        return data
    if sharding.is_fully_addressable:
        return jax.device_put(data, sharding)
    shape = tuple(data.shape)
    shards = [
        jax.device_put(data[index], device)
        for device, index in sharding.addressable_devices_indices_map(shape).items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def transfer_options(platform: str) -> dict[str, Any]:
    """How a host's transfer server is started on ``platform`` (``start_transfer_server``'s options).

    On CPU a posted value is sent from its own buffer (``use_raw_buffers``),
    not first copied into the server's staging memory: a small hop between
    two hosts' servers took 145 us instead of 175-180 (the dispatch
    benchmark's chain by hand, alternated in one run). Failed values still
    reach the puller as errors, and a value freed after its post is still
    sent whole. Accelerator buffers keep the staged path.
    """
    return {"use_raw_buffers": platform == "cpu"}


def node_ip(reach: str | None) -> str:
    """This machine's address on the interface that reaches ``reach`` (``"host:port"``).

    Other hosts connect to it (the island's coordinator, the transfer
    server). No packet is sent: connecting a UDP socket only picks the route.
    """
    import socket

    if not reach:
        return "127.0.0.1"
    host, _, port = reach.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, int(port or 1)))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class Host:
    """A host: its devices, the values it keeps, compiled computations and registered plans."""

    def __init__(self, index: int, num_devices: int, window: int, x64: bool = False, platform: str = "cpu"):
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
        self.devices: list[Any] = []  # this host's devices
        self.island_devices: list[Any] = []  # every device of its island, in rank order
        self.window = window
        self.role = Role(index, 0, 1, None)
        self.server: Any = None  # the transfer server (jax.experimental.transfer)
        self.addresses: dict[int, str] = {}  # host -> transfer server address
        self._connections: dict[int, Any] = {}
        self._connections_lock = threading.Lock()
        self.values: dict[int, Any] = {}
        self.executables: dict[str, Any] = {}  # fingerprint -> jitted callable
        # plan key -> (ops, constants, steps, the 64-bit mode it runs under: None for the process's)
        self.plans: dict[int, tuple[list[Op], dict, list, bool | None]] = {}
        # plan key -> (why its registration failed, the host's traceback, its ops)
        self.broken: dict[int, tuple[str, str, list[Op]]] = {}
        self.lost_peers: set[int] = set()
        self.runs_done = 0
        self.pulls = 0  # values pulled from other hosts' transfer servers
        self.posts = 0
        self.fed = 0  # values that came with a run's message (arguments)
        self._assemblers: dict[tuple, Any] = {}
        self._shardings: dict[Any, Any] = {}  # descriptor -> sharding on the island's devices
        self._homes: dict[Any, Any] = {}  # descriptor -> where a value moving to it is pulled
        self._spec_cache: dict[tuple, list] = {}  # (pieces, dtype, descriptor) -> pull specs
        self._single = jax.sharding.SingleDeviceSharding
        self._queue: dict[int, tuple] = {}
        self._next_seq = 0
        self._next_arrival = 0  # the number the next message from the channel takes
        self._queue_cv = threading.Condition()
        self._in_flight: collections.deque = collections.deque()
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
        from jax.experimental import transfer

        self._loop = asyncio.get_running_loop()
        self.role = role
        if link is not None:  # the controller's channel (channel_link.Endpoint): messages come there
            self._channel = link.connect(self._arrived)
        if role.size > 1:
            jax.distributed.initialize(role.coordinator, role.size, role.rank)
        self.devices = sorted(jax.local_devices(), key=lambda d: d.id)
        self.island_devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        ip = node_ip(role.reach)
        # One transport address per device, as the server copies in parallel.
        self.server = transfer.start_transfer_server(
            self.devices[0].client,
            f"{ip}:0",
            [f"{ip}:0"] * len(self.devices),
            **transfer_options(self.devices[0].platform),
        )
        return {
            "pid": os.getpid(),
            "platform": self.devices[0].platform,
            "devices": len(self.devices),
            "island_devices": len(self.island_devices),
            "transfer": self.server.address(),
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
            if value is not None and _ready(value):
                self._reply(seq, self._read(value), args[1] if len(args) > 1 else None)
                return
        with self._queue_cv:
            self._queue[self._next_arrival] = (kind, args, seq)
            self._next_arrival += 1
            self._queue_cv.notify()

    async def peer_lost(self, peer: int) -> None:
        """Host ``peer`` was lost: pulls from it fail now, and later ones are not tried."""
        with self._connections_lock:
            self.lost_peers.add(peer)
            connection = self._connections.pop(peer, None)
        if connection is not None:
            # A pull waiting on a peer that died before it posted would wait
            # forever (the pull's timeout is not applied on every platform).
            with contextlib.suppress(Exception):
                connection._poison_connection()

    async def ping(self) -> int:
        return self.index

    async def stats(self) -> dict:
        return {
            "values": len(self.values),
            "runs": self.runs_done,
            "executables": len(self.executables),
            "plans": len(self.plans),
            "pulls": self.pulls,
            "posts": self.posts,
            "fed": self.fed,
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
                result = _Error(f"host {self.index}: {type(exc).__name__}: {exc}", _trace(exc))
            if kind == "fetch" and not isinstance(result, _Error):
                reply = args[1] if len(args) > 1 else None
                if _ready(result):  # answered here: no hand-off to the completer
                    self._reply(future, self._read(result), reply)
                else:
                    self._done.put(("fetch", result, future, reply))
            else:
                self._answer(future, result)

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
            return _readable(value, np)
        except Exception as exc:
            return _Error(f"host {self.index}: {type(exc).__name__}: {exc}", _trace(exc))

    def _peers(self, addresses: dict[int, str]) -> None:
        """The transfer server of every host (numbered: a new host's address comes in order).

        Connects to each at once, while they all live: connecting to a server
        that is already gone would wait forever.
        """
        with self._connections_lock:
            for host, address in addresses.items():
                if self.addresses.get(host) != address:
                    self._connections.pop(host, None)
                self.addresses[host] = address
                self.lost_peers.discard(host)
                if host != self.index and host not in self._connections:
                    self._connections[host] = self.server.connect(address)

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
        try:
            with _mode(mode):
                self._compile_plan(key, ops, constants, blobs, mode)
        except BaseException as exc:  # its runs fail with this reason
            self.broken[key] = (
                f"registering the plan failed: {type(exc).__name__}: {exc}",
                _trace(exc),
                ops,
            )
            raise

    def _compile_plan(self, key: int, ops: list[Op], constants: dict, blobs: dict, mode: bool | None) -> None:
        import jax

        devices = self.island_devices
        for fingerprint, (blob, in_descs, out_descs) in blobs.items():
            if fingerprint in self.executables:
                continue
            exported = jax.export.deserialize(blob)
            self.executables[fingerprint] = jax.jit(
                exported.call,
                in_shardings=tuple(sharding_of(d, devices) for d in in_descs),
                out_shardings=tuple(sharding_of(d, devices) for d in out_descs),
            )
        placed = {
            slot: place(from_wire(data), sharding_of(desc, devices))
            for slot, (data, desc) in constants.items()
        }
        self.plans[key] = (ops, placed, [self._step(op) for op in ops], mode)

    def _forget(self, key: int) -> None:
        self.plans.pop(key, None)
        self.broken.pop(key, None)

    def _free(self, keys: list[int]) -> None:
        for key in keys:
            self.values.pop(key, None)

    def _fetch(self, key: int, reply: Any = None) -> Any:
        if key not in self.values:
            raise KeyError(f"value {key} is not on this host (freed, or its run failed)")
        return self.values[key]

    def _run(
        self, future: Any, key: int, run_id: int, base: int, feeds: list, keep: list, frees: list
    ) -> None:
        self._free(frees)
        if key not in self.plans:
            why, trace, ops = self.broken.get(key, ("it was never registered", "", []))
            message = f"host {self.index}: plan {key} cannot run: {why}"
            self._abandon(ops, 0, base, message)
            self._answer(future, RunFailure("error", None, message, trace))
            return
        ops, constants, steps, mode = self.plans[key]
        with _mode(mode):
            self._run_plan(future, ops, constants, steps, base, feeds, keep)

    def _run_plan(
        self, future: Any, ops: list[Op], constants: dict, steps: list, base: int, feeds: list, keep: list
    ) -> None:
        enqueued = time.monotonic()
        env: dict[int, Any] = dict(constants)
        made: list = []
        peers: set[int] = set()
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
                    env[slot] = place(from_wire(data), self._sharding(desc))
                    self.fed += 1
            for index, run_step in enumerate(steps):
                step = index
                run_step(env, base, made, peers)
        except BaseException as exc:
            # Peers waiting for this run's values get errors in their place, and
            # what peers posted for it is taken off their servers: nothing waits.
            message = f"host {self.index}: {_describe(exc, ops, step)}"
            self._abandon(ops, step + 1 if step >= 0 else 0, base, message)
            self._answer(future, RunFailure("error", None, message, _trace(exc), tuple(sorted(peers))))
            return
        small = []
        for slot, value_key in keep:
            value = env[slot]
            self.values[value_key] = value
            made.append(value)
            if _small(value):
                small.append((value_key, value))
        self._done.put(("run", made, future, (tuple(sorted(peers)), enqueued, small)))

    def _step(self, op: Op) -> Any:
        """``op`` as a function ``(env, base, made, peers)`` run for each run of its plan.

        Made once, when the plan is registered: what each run would look up
        again (the executable, shardings, pull specs) is looked up here.
        """
        match op:
            case ExecOp():
                return self._exec_step(op)
            case PutOp():
                sharding = self._sharding(op.desc)

                def put(env: dict, base: int, made: list, peers: set) -> None:
                    env[op.dst] = place(env[op.src], sharding)

                return put
            case PostOp():
                uuid, src, pieces = op.offset, op.src, op.pieces
                raw = _key_data if op.key_impl is not None else _same

                def post(env: dict, base: int, made: list, peers: set) -> None:
                    self._post(base + uuid, self._pieces(raw(env[src]), pieces))

                return post
            case PullOp():
                pull = self._pull_step(op)
                if op.key_impl is None:
                    return pull
                impl, dst = op.key_impl, op.dst

                def pull_key(env: dict, base: int, made: list, peers: set) -> None:
                    pull(env, base, made, peers)
                    env[dst] = _wrap_key(env[dst], impl)

                return pull_key
        raise TypeError(f"not a host step: {op!r}")

    def _exec_step(self, op: ExecOp) -> Any:
        fn = self.executables[op.fingerprint]
        ins, outs_at = op.in_slots, op.out_slots
        # Windowed executables count against the host's bound (cross-process
        # collectives deadlock beyond it); the others against XLA's own.
        bound = min(self.window, PACE) if op.windowed else PACE
        pace = self._pace
        if len(ins) == 1 and len(outs_at) == 1:  # the common node: one value in, one out
            (one_in,), (one_out,) = ins, outs_at

            def run_one(env: dict, base: int, made: list, peers: set) -> None:
                (out,) = fn(env[one_in])
                env[one_out] = out
                made.append(out)
                pace(out, bound)

            return run_one

        def run(env: dict, base: int, made: list, peers: set) -> None:
            outs = fn(*[env[s] for s in ins])
            for slot, array in zip(outs_at, outs, strict=True):
                env[slot] = array
            if outs:
                made.append(outs[0])
                pace(outs[0], bound)

        return run

    def _pace(self, out: Any, bound: int) -> None:
        """Counts ``out`` in flight; at ``bound``, waits for the older half at once.

        One wait per ``bound // 2`` executables, not one per executable (as
        XLA's own bound of 32 in flight per device would have this thread
        woken after each), and never more than ``bound`` in flight. What a
        failed executable raises is its own run's to report, not this one's.
        """
        in_flight = self._in_flight
        in_flight.append(out)
        if len(in_flight) < bound:
            return
        while len(in_flight) > bound // 2:
            try:
                in_flight.popleft().block_until_ready()
            except Exception:
                continue

    def _pull_step(self, op: PullOp) -> Any:
        remote = {host for host, _, _ in op.parts if host != self.index}
        whole = tuple((0, n) for n in op.shape)
        if len(op.parts) == 1 and remote and len(op.parts[0][2]) == 1 and op.parts[0][2][0].bounds == whole:
            # The whole value from one other host in one piece: pulled where it goes.
            (peer, offset, pieces), dst = op.parts[0], op.dst
            home = self._home(op.desc)
            target = self._sharding(op.desc)
            specs = self._specs(pieces, op.dtype, home)

            def pull_whole(env: dict, base: int, made: list, peers: set) -> None:
                peers.add(peer)
                (value,) = self._pull(peer, base + offset, pieces, op.dtype, home, specs)
                if home is not target:
                    value = place(value, target)
                env[dst] = value
                made.append(value)

            return pull_whole

        def gather(env: dict, base: int, made: list, peers: set) -> None:
            peers.update(remote)
            env[op.dst] = value = self._gather(op, base, env)
            made.append(value)

        return gather

    # --- the data plane: jax.experimental.transfer, host to host -------------------------

    def _post(self, uuid: int, arrays: list) -> None:
        self.server.await_pull(uuid, arrays)
        self.posts += 1

    def _pieces(self, value: Any, pieces: tuple[Piece, ...]) -> list:
        """The single-device arrays of ``value`` on the devices ``pieces`` name."""
        if len(pieces) == 1 and len(value.sharding.device_set) == 1:
            return [value]  # a value on one device is its own piece
        by_device = {shard.device: shard.data for shard in value.addressable_shards}
        return [by_device[self.island_devices[piece.position]] for piece in pieces]

    def _connection(self, peer: int) -> Any:
        """The connection to ``peer``'s transfer server, or None if the peer was lost."""
        with self._connections_lock:
            if peer in self.lost_peers:
                return None
            connection = self._connections.get(peer)
            if connection is None:
                connection = self.server.connect(self.addresses[peer])
                self._connections[peer] = connection
            return connection

    def _sharding(self, desc: ShardingDesc) -> Any:
        """The sharding ``desc`` names on this island's devices (made once per descriptor)."""
        sharding = self._shardings.get(desc)
        if sharding is None:
            sharding = self._shardings[desc] = sharding_of(desc, self.island_devices)
        return sharding

    def _home(self, desc: Any) -> Any:
        """Where a moving value is put together: on ``desc``'s sharding itself if that is one device of
        this host's (the pull lands where the value goes: no copy after it), else on this host's first device."""
        home = self._homes.get(desc)
        if home is None:
            target = self._sharding(desc)
            single = target.is_fully_addressable and len(target.device_set) == 1
            home = self._homes[desc] = target if single else self._single(self.devices[0])
        return home

    def _specs(self, pieces: tuple[Piece, ...], dtype: str, home: Any) -> list:
        """What a pull (or a post) of ``pieces`` of a ``dtype`` value is, on device sharding ``home``."""
        key = (pieces, dtype, home)
        specs = self._spec_cache.get(key)
        if specs is None:
            import jax

            specs = self._spec_cache[key] = [
                jax.ShapeDtypeStruct(piece.shape, dtype, sharding=home) for piece in pieces
            ]
        return specs

    def _pull(
        self,
        peer: int,
        uuid: int,
        pieces: tuple[Piece, ...],
        dtype: str,
        home: Any,
        specs: list | None = None,
    ) -> list:
        """``peer``'s pieces, arriving in the background on ``home`` (or errors if the peer was lost).

        ``specs``: what :meth:`_specs` gives for them, when the caller has it already.
        """
        from jax.experimental import transfer

        specs = specs or self._specs(pieces, dtype, home)
        connection = self._connection(peer)
        if connection is None:
            why = f"host {peer}, which was to send this value, was lost"
            return [transfer.make_error_array(spec, why) for spec in specs]
        self.pulls += 1
        return connection.pull(uuid, specs)

    def _gather(self, op: PullOp, base: int, env: dict) -> Any:
        """Slot ``op.src``'s value, pieced together from its hosts and placed on ``op.desc``."""
        import jax
        import numpy as np

        home = self._home(op.desc)
        arrays: list = []
        bounds: list = []
        for host, offset, pieces in op.parts:
            if host == self.index:
                mine = env[op.src] if op.key_impl is None else _key_data(env[op.src])
                got = [place(a, home) for a in self._pieces(mine, pieces)]
            else:
                got = self._pull(host, base + offset, pieces, op.dtype, home)
            arrays.extend(got)
            bounds.extend(piece.bounds for piece in pieces)
        whole = tuple((0, n) for n in op.shape)
        if not arrays:  # an empty value: nothing to move
            value = jax.device_put(np.zeros(op.shape, op.dtype), home)
        elif len(arrays) == 1 and bounds[0] == whole:
            value = arrays[0]
        else:
            value = self._assembler(op.shape, op.dtype, tuple(bounds))(*arrays)
        return place(value, self._sharding(op.desc))

    def _assembler(self, shape: tuple[int, ...], dtype: str, bounds: tuple) -> Any:
        """A compiled function writing pieces at ``bounds`` into a ``shape`` array."""
        key = (shape, dtype, bounds)
        fn = self._assemblers.get(key)
        if fn is None:
            import jax
            import jax.numpy as jnp

            def assemble(*pieces: Any) -> Any:
                out = jnp.zeros(shape, dtype)
                for piece, at in zip(pieces, bounds, strict=True):
                    out = jax.lax.dynamic_update_slice(out, piece, tuple(start for start, _ in at))
                return out

            fn = self._assemblers[key] = jax.jit(assemble)
        return fn

    def _abandon(self, ops: list[Op], start: int, base: int, message: str) -> None:
        """A run stopped before ``ops[start:]``: its posts become errors, its pulls are drained."""
        from jax.experimental import transfer

        for op in ops[start:]:
            try:
                if isinstance(op, PostOp):
                    specs = self._specs(op.pieces, op.dtype, self._single(self.devices[0]))
                    self._post(base + op.offset, [transfer.make_error_array(s, message) for s in specs])
                elif isinstance(op, PullOp):
                    for host, offset, pieces in op.parts:
                        if host != self.index:
                            self._pull(host, base + offset, pieces, op.dtype, self._home(op.desc))
            except Exception:  # a server that cannot take it: the peer's loss is handled elsewhere
                continue

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
                lost = [peer for peer in peers if peer in self.lost_peers]
                status = RunFailure(
                    "lost" if lost else "error",
                    lost[0] if lost else None,
                    f"host {self.index}: execution failed: {type(exc).__name__}: {exc}",
                    _trace(exc),
                    peers,
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
                        status = RunDone(device_s, {key: _readable(value, np) for key, value in small})
            self._answer(future, status)


def _mode(x64: bool | None) -> Any:
    """A context running JAX in 64-bit mode ``x64`` on this thread (None: as the process runs)."""
    if x64 is None:
        return contextlib.nullcontext()
    import jax

    return jax.enable_x64(x64)


def _same(value: Any) -> Any:
    return value


def _key_data(value: Any) -> Any:
    import jax

    return jax.random.key_data(value)


def _wrap_key(data: Any, impl: str) -> Any:
    import jax

    return jax.random.wrap_key_data(data, impl=impl)


def _ready(value: Any) -> bool:
    """Whether a value's computation is over (a value that cannot say is taken as not)."""
    try:
        return bool(value.is_ready())
    except Exception:
        return False


def _small(value: Any) -> bool:
    """Whether a kept value comes back with its run's completion: small, and whole on this host."""
    try:
        return value.size * value.dtype.itemsize <= SMALL_BYTES and value.is_fully_addressable
    except Exception:  # typed keys (no itemsize) and the like: fetched when asked for
        return False


def _readable(value: Any, np: Any) -> Any:
    """A kept value for the controller: a numpy array, or this host's distinct shards of it.

    Typed keys go as :class:`KeyData` around their raw data's.
    """
    if not isinstance(value.dtype, np.dtype):  # (an extended dtype is no numpy dtype)
        import jax

        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
            return KeyData(_readable(jax.random.key_data(value), np), str(jax.random.key_impl(value)))
    if value.is_fully_addressable:
        return np.asarray(value)
    return Shards(
        [
            (bounds_of(shard.index, value.shape), np.asarray(shard.data))
            for shard in value.addressable_shards
            if shard.replica_id == 0
        ]
    )


def bounds_of(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's ``index`` (slices) as ``(start, stop)`` per dimension."""
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape, strict=True))


class Shards(NamedTuple):
    """A host's distinct shards of a value spanning hosts: ``(bounds, data)`` each."""

    parts: list


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
    return f"run failed{where}: {type(exc).__name__}: {exc}"


def _trace(exc: BaseException) -> str:
    """``exc``'s traceback on this host, as text: it crosses to the controller with the error."""
    return "".join(traceback.format_exception(exc))
