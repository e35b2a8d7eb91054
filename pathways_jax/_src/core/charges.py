"""Memory charges: the bytes a value (or a run) holds on each device."""

from __future__ import annotations

from typing import Any

import numpy as np

# Bytes a value (or a run) holds on each device: ((device id, bytes), ...).
Charge = tuple[tuple[int, int], ...]


def charge_of(aval: Any, sharding: Any) -> Charge:
    """The bytes a value of ``aval`` with ``sharding`` holds on each device (``()``: not known)."""
    try:
        itemsize = np.dtype(aval.dtype).itemsize
        shard = sharding.shard_shape(tuple(aval.shape))
        devices = sharding.device_set
    except Exception:  # an extended dtype, or no sharding: nothing known
        return ()
    nbytes = int(np.prod(shard, dtype=np.int64)) * itemsize
    return tuple((d.id, nbytes) for d in sorted(devices, key=lambda d: d.id))


def add(total: dict[int, int], charge: Charge) -> None:
    """Adds ``charge`` into ``total`` (bytes by device id)."""
    for d, b in charge:
        total[d] = total.get(d, 0) + b


__all__ = ["Charge", "add", "charge_of"]
