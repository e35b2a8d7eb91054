"""How a controller reaches its host actors: numbered messages and their answers.

A link sends host ``h`` a message ``(seq, kind, args)`` and gives back a
``concurrent.futures.Future`` of the host's answer. The Ray backend (and the
controller service, which runs one) holds a link by composition and never
touches its transport:

- :class:`RayCallLink`: one Ray actor call per message (about 1 ms and
  350-650 µs of CPU on each side here): the transport before the channel,
  kept as a second implementation of the seam (tests run programs on it).
- ``channel_link.ChannelLink``: ZeroMQ channels with signed, typed frames; the
  default. A run on several hosts of an island goes to them all as one
  broadcast (:meth:`Link.send_group`): one send from the controller, the
  fan-out done by ZeroMQ's I/O thread.

Ray keeps what it is good at either way: it starts, places and supervises
the host actors and reports their deaths; the backend's monitor then calls
:meth:`Link.host_lost`, which fails every answer still owed by that host.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Protocol


class HostGone(Exception):
    """A host's answer that will never come: the host died, or the link closed."""

    def __init__(self, host: int, why: str):
        super().__init__(f"host {host} is gone: {why}")
        self.host = host
        self.why = why


class Link(Protocol):
    """What the Ray backend asks of a transport to its hosts."""

    name: str

    def attach(self, host: int, actor: Any, group: int | None = None) -> Any:
        """Makes ``actor`` host ``host``'s endpoint, a member of ``group`` (its island) for
        :meth:`send_group`; returns what its ``setup`` needs (or None)."""
        ...

    def send(self, host: int, seq: int, kind: str, args: tuple) -> concurrent.futures.Future:
        """Sends host ``host`` its message number ``seq``; the future of its answer."""
        ...

    def send_many(self, host: int, messages: list[tuple[int, str, tuple]]) -> list[concurrent.futures.Future]:
        """Sends host ``host`` several messages ``(seq, kind, args)`` at once; their answers' futures."""
        ...

    def send_group(
        self, group: int, messages: dict[int, list[tuple[int, str, tuple]]]
    ) -> dict[int, list[concurrent.futures.Future]]:
        """Sends hosts of ``group`` their messages ``host -> [(seq, kind, args)]`` at once (a
        broadcast where the transport has one); each host's answers' futures, in order."""
        ...

    def host_lost(self, host: int, why: str) -> None:
        """Fails every answer ``host`` still owes with :class:`HostGone`."""
        ...

    def silent_for(self, host: int) -> float | None:
        """Seconds since ``host`` last sent anything, heartbeats included (None: not known)."""
        ...

    def stats(self) -> dict:
        """Counts of what went through the link (messages, batches, refused frames)."""
        ...

    def close(self) -> None: ...


class RayCallLink:
    """One Ray actor call (``Host.call``) per message; Ray's own future per answer.

    Its fan-out stays a loop: :meth:`send_group` makes one call per message,
    host by host (Ray has no broadcast call).
    """

    name = "ray"

    def __init__(self) -> None:
        self._actors: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._messages = 0

    def attach(self, host: int, actor: Any, group: int | None = None) -> Any:
        self._actors[host] = actor
        return None

    def send(self, host: int, seq: int, kind: str, args: tuple) -> concurrent.futures.Future:
        self._messages += 1
        return self._actors[host].call.remote(seq, kind, *args).future()

    def send_many(self, host: int, messages: list[tuple[int, str, tuple]]) -> list[concurrent.futures.Future]:
        return [self.send(host, seq, kind, args) for seq, kind, args in messages]

    def send_group(
        self, group: int, messages: dict[int, list[tuple[int, str, tuple]]]
    ) -> dict[int, list[concurrent.futures.Future]]:
        return {host: self.send_many(host, batch) for host, batch in messages.items()}

    def host_lost(self, host: int, why: str) -> None:
        pass  # Ray fails the calls of a dead actor by itself

    def silent_for(self, host: int) -> float | None:
        return None  # no heartbeats: only Ray's word on a death

    def stats(self) -> dict:
        return {"transport": self.name, "messages": self._messages}

    def close(self) -> None:
        pass  # nothing of its own to release: Ray owns the calls
