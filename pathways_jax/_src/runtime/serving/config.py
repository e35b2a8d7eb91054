"""A controller service's settings, and how its hosts know a client's values and plans."""

from __future__ import annotations

import dataclasses

DEFAULT_WINDOW = 4  # runs in flight per island on the service's hosts
_KEY_SPACE = 2**40  # host key = client * _KEY_SPACE + the client's key


def host_key(client: int, key: int) -> int:
    """The key the hosts know a client's value or plan by."""
    return client * _KEY_SPACE + key


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """A controller service's settings (``pw.serve``'s arguments, and the 64-bit mode it runs in)."""

    name: str
    hosts: int
    devices_per_host: int
    islands: int | None
    platform: str
    replace_lost_hosts: bool
    scheduler: str
    window: int
    max_clients: int | None
    memory_budget: int | None
    backpressure_timeout: float | None
    starvation_limit: int
    max_in_flight: int
    x64: bool
    stalled_client_timeout: float = 30.0
    silent_client_timeout: float | None = 30.0
    # Seconds its hosts' placement may find the Ray cluster without room before the start (or a
    # lost island's rebuilding) is refused: the starter's PATHWAYS_JAX_ROOM_GRACE_S, or 10.
    room_grace_s: float = 10.0
    # Seconds of silence after which its hosts' monitor takes a host for hung: the starter's
    # PATHWAYS_JAX_HUNG_S, or 10.
    hung_s: float = 10.0
