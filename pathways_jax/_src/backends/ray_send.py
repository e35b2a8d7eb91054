"""The Ray backend's messages out: numbered per host, grouped per island, and what each host has.

A host handles its messages strictly in their numbers' order. A batch of
messages goes each host's in one batch and each island's in one send of the
link (one broadcast over the channel). The :class:`Sender` also remembers
which plans and computations each host has registered (each goes once), and
holds what the hosts are to free until the next message to them goes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from pathways_jax._src.backends.host_link import Link
from pathways_jax._src.backends.ray_boot import Layout


class Sender:
    """What the controller sent each host, and what it is to free.

    Used with the backend's lock held, but for ``dropped[host].append`` (a
    handle went) and :meth:`forget` (a plan's finaliser).
    """

    def __init__(self, layout: Layout) -> None:
        hosts = layout.hosts
        self._island_of = layout.island_of
        self.seq = [0] * hosts  # each host's next message number
        self.known: list[set] = [set() for _ in range(hosts)]  # plan keys each host has
        self.fingerprints: list[set] = [set() for _ in range(hosts)]  # computations each host has
        # The computations each host's known plans run, by plan key: a host drops a computation with
        # the Forget of the last plan that runs it, and so does its set here (sent again if needed).
        self.plan_prints: list[dict[int, frozenset[str]]] = [{} for _ in range(hosts)]
        # Values whose handles went, by host: freed with the next message there.
        self.dropped: list[collections.deque] = [collections.deque() for _ in range(hosts)]
        self.forgotten: collections.deque = collections.deque()  # (plan key, hosts) whose plan went
        # A service client's live handles of each received value, by (host, (owner, key)): its
        # free goes once the last is dropped (pw.receive of one handle twice makes two).
        self.received: collections.Counter = collections.Counter()
        self._next_uuid = 0  # transfer uuids, handed out per run

    def send(self, link: Link, host: int, kind: str, args: tuple) -> Any:
        """Sends host ``host`` its next numbered message; its answer's future."""
        seq = self.seq[host]
        self.seq[host] = seq + 1
        return link.send(host, seq, kind, args)

    def send_all(self, link: Link, batch: list[tuple[int, str, tuple]]) -> list:
        """Sends messages (host, kind, args), each host's in one batch and each island's in one
        send of the link (a broadcast over the channel); their answers' futures, in order."""
        by_host: dict[int, list[int]] = {}
        for index, (host, _kind, _args) in enumerate(batch):
            by_host.setdefault(host, []).append(index)
        by_island: dict[int, dict[int, list[tuple[int, str, tuple]]]] = {}
        seq = self.seq
        for host, indices in by_host.items():
            messages = []
            for index in indices:
                _host, kind, args = batch[index]
                messages.append((seq[host], kind, args))
                seq[host] += 1
            by_island.setdefault(self._island_of(host), {})[host] = messages
        answers: list[Any] = [None] * len(batch)
        for island, parts in by_island.items():
            for host, futures in link.send_group(island, parts).items():
                for index, answer in zip(by_host[host], futures, strict=True):
                    answers[index] = answer
        return answers

    def take_uuids(self, count: int) -> int:
        """The first of ``count`` fresh transfer uuids."""
        base = self._next_uuid
        self._next_uuid += count
        return base

    def receive(self, hosts: tuple[int, ...], key: tuple[int, int]) -> None:
        """One more live handle of the received value ``key`` on ``hosts``."""
        for host in hosts:
            self.received[host, key] += 1

    def take_dropped(self, host: int) -> list:
        """The values host ``host`` is to free, taken (they go with the message being made).

        A received value goes once the last of its handles here went.
        """
        dropped = self.dropped[host]
        received = self.received
        keys = []
        while dropped:
            try:
                key = dropped.popleft()
            except IndexError:
                break
            if isinstance(key, tuple) and (host, key) in received:
                received[host, key] -= 1
                if received[host, key] > 0:
                    continue
                del received[host, key]
            keys.append(key)
        return keys

    def forget(self, key: int, hosts: tuple[int, ...]) -> None:
        """A plan went (its finaliser): its hosts forget it with the next flush.

        Only queued here: a finaliser may run inside any allocation, on a
        thread that holds the backend's lock already.
        """
        self.forgotten.append((key, hosts))

    def take_forgotten(self, lost_hosts: dict[int, str]) -> Iterator[tuple[int, int]]:
        """(host, plan key) for each plan that went, on each live host that has it: taken one at
        a time, as the caller tells each host."""
        while self.forgotten:
            key, hosts = self.forgotten.popleft()
            for host in hosts:
                if key in self.known[host] and host not in lost_hosts:
                    self.known[host].discard(key)
                    self._drop_prints(host, key)
                    yield host, key

    def registered(self, host: int, key: int, prints: frozenset[str]) -> None:
        """Host ``host`` is sent plan ``key``, which runs computations ``prints``."""
        self.known[host].add(key)
        self.plan_prints[host][key] = prints

    def _drop_prints(self, host: int, key: int) -> None:
        """Plan ``key`` goes from ``host``: the computations no other of its plans runs go with it there."""
        gone = self.plan_prints[host].pop(key, frozenset())
        if gone:
            still = set().union(*self.plan_prints[host].values())
            self.fingerprints[host].difference_update(gone - still)

    def renew(self, host: int) -> None:
        """Host ``host`` is a new process: numbering starts again, and it has nothing."""
        self.seq[host] = 0
        self.known[host] = set()
        self.fingerprints[host] = set()
        self.plan_prints[host] = {}
        self.dropped[host].clear()
