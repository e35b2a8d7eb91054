"""The local backend: in-process JAX devices, islands carved from ``jax.devices()``."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pathways_jax._src import errors


def _backend_started() -> bool:
    # JAX exposes no public query for this; fall back to "started" so that a
    # mismatched device count is reported instead of silently ignored.
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def set_cpu_device_count(count: int) -> None:
    """Makes JAX's CPU backend expose ``count`` devices, if it has not started yet."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise errors.ClusterError(f"num_cpu_devices must be a positive int, got {count!r}.")
    if not _backend_started():
        jax.config.update("jax_num_cpu_devices", count)
        return
    have = len(jax.devices("cpu"))
    if have != count:
        raise errors.ClusterError(
            f"pw.init(num_cpu_devices={count}) came after JAX's backend started "
            f"with {have} CPU devices; the count cannot change in a running "
            "process. Call pw.init(num_cpu_devices=...) before any JAX "
            "computation, or set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{count} (or jax.config.update('jax_num_cpu_devices', {count})) "
            "before JAX starts."
        )


def local_devices() -> list[jax.Device]:
    """The devices of JAX's default backend in this process, ordered by id."""
    return sorted(jax.devices(), key=lambda d: d.id)


def carve_islands(
    devices: Sequence[jax.Device], islands: int | Sequence[Sequence[int]] | None
) -> tuple[tuple[jax.Device, ...], ...]:
    """Splits ``devices`` into islands as ``pw.init(islands=...)`` describes."""
    if islands is None:
        return (tuple(devices),)
    if isinstance(islands, int) and not isinstance(islands, bool):
        if islands < 1 or len(devices) % islands:
            raise errors.ClusterError(
                f"islands={islands} must evenly divide the {len(devices)} local "
                "devices; pass a divisor of the device count, or a list of "
                "lists of device ids."
            )
        per = len(devices) // islands
        return tuple(tuple(devices[i * per : (i + 1) * per]) for i in range(islands))
    if not isinstance(islands, Sequence) or not all(
        isinstance(group, Sequence) and not isinstance(group, str) for group in islands
    ):
        raise errors.ClusterError(
            f"islands must be None, an int, or a list of lists of device ids; got {islands!r}."
        )
    by_id = {d.id: d for d in devices}
    seen: set[int] = set()
    carved = []
    for number, group in enumerate(islands):
        if not group:
            raise errors.ClusterError(f"island {number} in islands={islands!r} is empty.")
        members = []
        for device_id in group:
            if device_id not in by_id:
                raise errors.ClusterError(
                    f"island {number} names device id {device_id!r}, but the local "
                    f"devices have ids {sorted(by_id)}."
                )
            if device_id in seen:
                raise errors.ClusterError(
                    f"device id {device_id} appears in more than one island of "
                    f"islands={islands!r}; islands must be disjoint."
                )
            seen.add(device_id)
            members.append(by_id[device_id])
        carved.append(tuple(members))
    return tuple(carved)
