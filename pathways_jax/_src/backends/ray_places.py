"""Where the hosts' devices are, as this process sees them: stand-in devices by island and host.

The controller process lowers against CPU devices of its own that stand in
for the hosts' devices (host ``h`` owns stand-ins ``h*D .. h*D+D-1``).
:class:`Places` says which island, host and position a stand-in is, and
where a stand-in sharding lives; the Ray backend and a controller service's
client each hold one.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from pathways_jax._src.backends.ray_boot import Layout
from pathways_jax._src.backends.ray_host import (
    Blocks,
    KeyData,
    NamedDesc,
    ShardingDesc,
    SingleDesc,
    bounds_of,
    sharding_of,
)
from pathways_jax._src.backends.ray_plan import Placed
from pathways_jax._src.core import errors

# An argument over several hosts smaller than this goes whole to each: the hosts' equal messages
# go as one broadcast (channel_link), cheaper than a message each; a larger one, each host's blocks.
SPLIT_BYTES = 64 * 1024


@functools.cache
def _key_words_ndim(impl: str) -> int:
    """The trailing dimensions a typed key of implementation ``impl`` adds to its raw data (its words)."""
    return len(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)


class Places:
    """The stand-in devices of ``layout``'s hosts, by island; implements ``ray_plan.Fleet``.

    Attributes:
      layout: which hosts make which island.
      standins: this process's devices standing in for the hosts' devices, by host.
      islands: the stand-ins, one group per island (``Backend.islands``).
      export_platforms: the platforms computations are exported for (the hosts').
    """

    def __init__(self, layout: Layout, standins: list[jax.Device], platform: str) -> None:
        self.layout = layout
        self.standins = standins
        # Computations are exported for the hosts' platform (the controller lowers on CPU).
        self.export_platforms = ("cpu",) if platform == "cpu" else ("cpu", "cuda")
        per, devices_per_host = layout.per_island, layout.devices_per_host
        n = per * devices_per_host
        self.islands = tuple(tuple(standins[i * n : (i + 1) * n]) for i in range(layout.islands))
        # stand-in id -> (island, position among the island's devices, host)
        self._where = {d.id: (i // n, i % n, i // devices_per_host) for i, d in enumerate(standins)}
        # (descriptor, shape, host) -> the blocks a host's devices hold of a value over several hosts
        # (None: the whole value, one host's or replicated on each); a plan's arguments repeat these.
        self._blocks: dict[tuple, tuple | None] = {}

    def place_of(self, device: Any) -> tuple[int, int, int]:
        """A stand-in device's island, position among the island's devices, and host."""
        return self._where[device.id]

    def owns(self, device: Any) -> bool:
        """Whether ``device`` is one of the stand-ins."""
        return device.id in self._where and device.platform == self.standins[0].platform

    def host_devices(self, host: int) -> list[jax.Device]:
        """The stand-ins of host ``host``'s devices."""
        d = self.layout.devices_per_host
        return self.standins[host * d : (host + 1) * d]

    def fed(self, data: Any, desc: ShardingDesc, host: int) -> Any:
        """What host ``host`` is sent of argument ``data`` (numpy, or typed keys' wire form) placed by
        ``desc``: only the blocks its own devices hold, where the value spans several hosts (and has
        ``SPLIT_BYTES`` at least); else all. Typed keys' raw data is cut as the keys are (each key's
        own words whole)."""
        if isinstance(data, KeyData):
            raw = data.data
            if not isinstance(raw, np.ndarray):
                return data
            blocks = self._split(raw, raw.shape[: raw.ndim - _key_words_ndim(data.impl)], desc, host)
            return data if blocks is raw else KeyData(blocks, data.impl)
        if not isinstance(data, np.ndarray):
            return data
        return self._split(data, data.shape, desc, host)

    def _split(self, data: np.ndarray, shape: tuple[int, ...], desc: ShardingDesc, host: int) -> Any:
        """``data`` (of a value of ``shape``: its leading dimensions) as host ``host``'s blocks of it, or
        ``data`` itself where it goes whole."""
        if isinstance(desc, SingleDesc) or not shape or data.nbytes < SPLIT_BYTES:
            return data
        key = (desc, shape, host)
        if key not in self._blocks:
            if len(self._blocks) >= 4096:  # bounded: shapes and placements a process feeds are few
                self._blocks.clear()
            self._blocks[key] = self._blocks_of(desc, shape, host)
        blocks = self._blocks[key]
        if blocks is None:
            return data
        return Blocks(
            shape,
            [(bounds, np.ascontiguousarray(data[tuple(slice(*b) for b in bounds)])) for bounds in blocks],
        )

    def _blocks_of(self, desc: ShardingDesc, shape: tuple[int, ...], host: int) -> tuple | None:
        island = self.layout.island_of(host)
        sharding = sharding_of(desc, list(self.islands[island]))
        held: dict[int, set] = {}
        for device, index in sharding.devices_indices_map(shape).items():
            held.setdefault(self._where[device.id][2], set()).add(bounds_of(index, shape))
        mine = held.get(host, set())
        whole = tuple((0, n) for n in shape)
        if len(held) == 1 or whole in mine:
            return None
        return tuple(sorted(mine))

    def where(self, sharding: Any, what: str) -> Placed:
        """The island, hosts and island-local descriptor of a stand-in sharding."""
        if isinstance(sharding, jax.sharding.SingleDeviceSharding):
            device: Any  # a jax.Device; its stub type does not resolve here
            (device,) = sharding.device_set
            island, position, host = self._where[device.id]
            return Placed(island, (host,), SingleDesc(position))
        if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
            places = [self._where[d.id] for d in sharding.mesh.devices.flat]
            islands = sorted({island for island, _, _ in places})
            if len(islands) != 1:
                raise errors.PlacementError(
                    f"{what} is sharded over devices of islands {islands}; a value lives on one island. "
                    "Give each island's part its own slice and move values between them."
                )
            return Placed(
                islands[0],
                tuple(sorted({host for _, _, host in places})),
                NamedDesc(
                    tuple(position for _, position, _ in places),
                    sharding.mesh.devices.shape,
                    sharding.mesh.axis_names,
                    sharding.spec,
                ),
            )
        raise errors.PlacementError(
            f"{what} has sharding {sharding!r}; the Ray backend ships NamedSharding and "
            "SingleDeviceSharding values only. Give the value a pw.P(...) spec on its slice."
        )
