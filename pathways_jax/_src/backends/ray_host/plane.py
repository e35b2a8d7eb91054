"""The data plane of a host: its values' shardings, and its transfer server, host to host.

Each host starts a transfer server (``jax.experimental.transfer``). A value
another host needs is offered there (a ``PostOp``) under a uuid the
controller handed out with the run, and pulled by that host (a ``PullOp``):
host to host, never through the controller or a Ray call. A run that fails
offers errors in place of its values (:meth:`DataPlane.abandon`), so a pull
never waits for a value that will not come; a lost peer's pulls fail at once
(:meth:`DataPlane.lose`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from pathways_jax._src.backends.ray_host.ops import Op, Piece, PostOp, PullOp, ShardingDesc, sharding_of
from pathways_jax._src.backends.ray_host.values import key_data, place


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


class DataPlane:
    """Where a host's values are placed (shardings over its island's devices) and how they move
    between hosts (its transfer server, and its connections to the other hosts' servers)."""

    def __init__(self, index: int):
        import jax

        self.index = index
        self.devices: list[Any] = []  # this host's devices
        self.island_devices: list[Any] = []  # every device of its island, in rank order
        self.server: Any = None  # the transfer server (jax.experimental.transfer)
        self.addresses: dict[int, str] = {}  # host -> transfer server address
        self._connections: dict[int, Any] = {}
        self._connections_lock = threading.Lock()
        self.lost_peers: set[int] = set()
        self.pulls = 0  # values pulled from other hosts' transfer servers
        self.posts = 0
        self._assemblers: dict[tuple, Any] = {}
        self._shardings: dict[Any, Any] = {}  # descriptor -> sharding on the island's devices
        self._homes: dict[Any, Any] = {}  # descriptor -> where a value moving to it is pulled
        self._spec_cache: dict[tuple, list] = {}  # (pieces, dtype, descriptor) -> pull specs
        self._single = jax.sharding.SingleDeviceSharding

    def start(self, devices: list, island_devices: list, ip: str) -> None:
        """Takes this host's and its island's devices, and starts the transfer server on ``ip``."""
        from jax.experimental import transfer

        self.devices = devices
        self.island_devices = island_devices
        # One transport address per device, as the server copies in parallel.
        self.server = transfer.start_transfer_server(
            self.devices[0].client,
            f"{ip}:0",
            [f"{ip}:0"] * len(self.devices),
            **transfer_options(self.devices[0].platform),
        )

    def connect(self, addresses: dict[int, str]) -> None:
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

    def lose(self, peer: int) -> None:
        """Host ``peer`` was lost: pulls from it fail now, and later ones are not tried."""
        with self._connections_lock:
            self.lost_peers.add(peer)
            connection = self._connections.pop(peer, None)
        if connection is not None:
            # A pull waiting on a peer that died before it posted would wait
            # forever (the pull's timeout is not applied on every platform).
            with contextlib.suppress(Exception):
                connection._poison_connection()

    def post(self, uuid: int, arrays: list) -> None:
        self.server.await_pull(uuid, arrays)
        self.posts += 1

    def pieces(self, value: Any, pieces: tuple[Piece, ...]) -> list:
        """The single-device arrays of ``value`` on the devices ``pieces`` name."""
        if len(pieces) == 1 and len(value.sharding.device_set) == 1:
            return [value]  # a value on one device is its own piece
        by_device = {shard.device: shard.data for shard in value.addressable_shards}
        return [by_device[self.island_devices[piece.position]] for piece in pieces]

    def connection(self, peer: int) -> Any:
        """The connection to ``peer``'s transfer server, or None if the peer was lost."""
        with self._connections_lock:
            if peer in self.lost_peers:
                return None
            connection = self._connections.get(peer)
            if connection is None:
                connection = self.server.connect(self.addresses[peer])
                self._connections[peer] = connection
            return connection

    def sharding(self, desc: ShardingDesc) -> Any:
        """The sharding ``desc`` names on this island's devices (made once per descriptor)."""
        sharding = self._shardings.get(desc)
        if sharding is None:
            sharding = self._shardings[desc] = sharding_of(desc, self.island_devices)
        return sharding

    def home(self, desc: Any) -> Any:
        """Where a moving value is put together: on ``desc``'s sharding itself if that is one device of
        this host's (the pull lands where the value goes: no copy after it), else on this host's first device."""
        home = self._homes.get(desc)
        if home is None:
            target = self.sharding(desc)
            single = target.is_fully_addressable and len(target.device_set) == 1
            home = self._homes[desc] = target if single else self._single(self.devices[0])
        return home

    def specs(self, pieces: tuple[Piece, ...], dtype: str, home: Any) -> list:
        """What a pull (or a post) of ``pieces`` of a ``dtype`` value is, on device sharding ``home``."""
        key = (pieces, dtype, home)
        specs = self._spec_cache.get(key)
        if specs is None:
            import jax

            specs = self._spec_cache[key] = [
                jax.ShapeDtypeStruct(piece.shape, dtype, sharding=home) for piece in pieces
            ]
        return specs

    def pull(
        self,
        peer: int,
        uuid: int,
        pieces: tuple[Piece, ...],
        dtype: str,
        home: Any,
        specs: list | None = None,
    ) -> list:
        """``peer``'s pieces, arriving in the background on ``home`` (or errors if the peer was lost).

        ``specs``: what :meth:`specs` gives for them, when the caller has it already.
        """
        from jax.experimental import transfer

        specs = specs or self.specs(pieces, dtype, home)
        connection = self.connection(peer)
        if connection is None:
            why = f"host {peer}, which was to send this value, was lost"
            return [transfer.make_error_array(spec, why) for spec in specs]
        self.pulls += 1
        return connection.pull(uuid, specs)

    def gather(self, op: PullOp, base: int, env: dict) -> Any:
        """Slot ``op.src``'s value, pieced together from its hosts and placed on ``op.desc``."""
        import jax
        import numpy as np

        home = self.home(op.desc)
        arrays: list = []
        bounds: list = []
        for host, offset, pieces in op.parts:
            if host == self.index:
                mine = env[op.src] if op.key_impl is None else key_data(env[op.src])
                got = [place(a, home) for a in self.pieces(mine, pieces)]
            else:
                got = self.pull(host, base + offset, pieces, op.dtype, home)
            arrays.extend(got)
            bounds.extend(piece.bounds for piece in pieces)
        whole = tuple((0, n) for n in op.shape)
        if not arrays:  # an empty value: nothing to move
            value = jax.device_put(np.zeros(op.shape, op.dtype), home)
        elif len(arrays) == 1 and bounds[0] == whole:
            value = arrays[0]
        else:
            value = self.assembler(op.shape, op.dtype, tuple(bounds))(*arrays)
        return place(value, self.sharding(op.desc))

    def assembler(self, shape: tuple[int, ...], dtype: str, bounds: tuple) -> Any:
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

    def abandon(self, ops: list[Op], start: int, base: int, message: str) -> None:
        """A run stopped before ``ops[start:]``: its posts become errors, its pulls are drained."""
        from jax.experimental import transfer

        for op in ops[start:]:
            try:
                if isinstance(op, PostOp):
                    specs = self.specs(op.pieces, op.dtype, self._single(self.devices[0]))
                    self.post(base + op.offset, [transfer.make_error_array(s, message) for s in specs])
                elif isinstance(op, PullOp):
                    for host, offset, pieces in op.parts:
                        if host != self.index:
                            self.pull(host, base + offset, pieces, op.dtype, self.home(op.desc))
            except Exception:  # a server that cannot take it: the peer's loss is handled elsewhere
                continue
