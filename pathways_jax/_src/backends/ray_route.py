"""The Ray backend's route to its hosts: its own host actors, each host's messages numbered here.

:class:`DirectRoute` is the ``ray_dispatch.Route`` of a backend that owns
its hosts (``ray.RayBackend``, and so the controller service's): messages
are numbered per host by its ``Sender`` and go over its ``Link``; a wait on
a host that raised Ray's word for a dead actor marks the host lost (the
backend's ``mark_lost``), and a health check pings the hosts.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from pathways_jax._src.backends.host_link import Link
from pathways_jax._src.backends.ray_failures import is_lost_error
from pathways_jax._src.backends.ray_fleet import HostActors, Watcher
from pathways_jax._src.backends.ray_losses import Losses
from pathways_jax._src.backends.ray_send import Sender
from pathways_jax._src.core import errors


class DirectRoute:
    """Messages numbered by ``sender`` over ``link`` to ``fleet``'s actors; ``watcher`` marks hosts lost."""

    def __init__(
        self, sender: Sender, link: Link, losses: Losses, fleet: HostActors, watcher: Watcher
    ) -> None:
        self.sender = sender
        self.link = link
        self.losses = losses
        self.fleet = fleet
        self.watcher = watcher

    def message(self, host: int, kind: str, args: tuple) -> concurrent.futures.Future:
        return self.sender.send(self.link, host, kind, args)

    def send_run(self, batch: list[tuple[int, str, tuple]], run: Any, remote: Any) -> list:
        return self.send_all(batch)

    def send_all(self, batch: list[tuple[int, str, tuple]]) -> list:
        """Messages ``(host, kind, args)``, each island's in one broadcast; their answers' futures."""
        return self.sender.send_all(self.link, batch)

    def take_uuids(self, count: int) -> int:
        return self.sender.take_uuids(count)

    def fetched(self, host: int, answer: Any) -> Any:
        return answer  # the host's own answer

    def loss(self, host: int, exc: BaseException, generation: int, what: str) -> BaseException | None:
        """HostLostError if ``exc`` says the host died (it is marked lost), else None."""
        if not is_lost_error(exc):
            return None
        self.watcher.mark_lost(host, str(exc), generation)
        return errors.HostLostError(self.losses.message(self.losses.layout.island_of(host), what))

    def health_check(self, hosts: set[int]) -> int | None:
        """The island of the first of ``hosts`` found dead (marked lost), or None if all answer or are busy."""
        losses = self.losses
        island_of = losses.layout.island_of
        for host in sorted(hosts):
            if island_of(host) in losses.lost:
                return island_of(host)
        live = sorted(h for h in hosts if h not in losses.lost_hosts)
        if not live:
            return None
        dead = self.fleet.first_dead(live)
        if dead is None:
            return None
        host, exc = dead
        self.watcher.mark_lost(host, str(exc))
        return island_of(host)
