"""Checkpoints the Ray hosts write and read themselves: the controller's messages (``ray_host/checkpoint.py``).

The controller sends each host where its shards go (``ray_host.checkpoint.Write``)
or which parts of a checkpoint to read into which sharding (``Read``); what
it gets back is an answer per host, never the bytes. Orbax's side of it, the
specs and the file layout, is ``compat/host_checkpoints.py``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from typing import NamedTuple

from absl import logging

from pathways_jax._src.backends.ray_dispatch import Dispatcher
from pathways_jax._src.backends.ray_host.checkpoint import Read, Write
from pathways_jax._src.backends.ray_values import RemoteArray
from pathways_jax._src.core import counts, errors


class Stash(NamedTuple):
    """A save's copies, made on its hosts: ``answers`` to the stash, by host, and their islands' generations."""

    ticket: int
    answers: dict[int, concurrent.futures.Future]
    generations: dict[int, int]


class HostCheckpoints:
    """Saves and restores on ``dispatcher``'s hosts, each host its own shards."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self._tickets = itertools.count(1)

    def stash(self, writes: dict[int, list[Write]], generations: dict[int, int], ocdbt: bool) -> Stash:
        """Has each host copy the values it is to write, in its order of messages (after the runs
        that made them, before any that could free them); the copies wait for :meth:`store`.

        ``generations``: of each value's island when the value was made (by host); a host
        rebuilt since holds none of them: HostLostError.
        """
        d = self.dispatcher
        ticket = next(self._tickets)
        with d.lock:
            for host, generation in generations.items():
                island = d.layout.island_of(host)
                if island in d.lost or d.generations[island] != generation:
                    raise errors.HostLostError(d.losses.message(island, "a value to save"))
            answers = {
                host: d.route.message(host, "stash", (ticket, items, ocdbt)) for host, items in writes.items()
            }
        return Stash(ticket, answers, generations)

    def store(self, stash: Stash) -> None:
        """Has each host write its stashed shards; returns once all are on storage.

        Raises what a host's failure means: HostLostError for a host lost on
        the way, ProgramFailedError with the host's traceback for a failed
        write. The copies of hosts that did not write are dropped.
        """
        d = self.dispatcher
        try:
            try:
                self._check(stash, stash.answers)
            except Exception:  # a host could not copy its values: the others' copies go
                self.drop(stash)
                raise
            with d.lock:
                answers = {
                    host: d.route.message(host, "store", (stash.ticket, True)) for host in stash.answers
                }
            self._check(stash, answers)
        except Exception as exc:
            counts.bump("host_save_failures")
            logging.warning(
                "pathways_jax: a checkpoint save on hosts %s failed: %s", sorted(stash.answers), exc
            )
            raise
        counts.bump("host_saves")

    def drop(self, stash: Stash) -> None:
        """Frees a stash that will not be written (its save failed elsewhere)."""
        d = self.dispatcher
        with d.lock:
            for host in stash.answers:
                if host not in d.losses.lost_hosts:
                    d.route.message(host, "store", (stash.ticket, False))

    def _check(self, stash: Stash, answers: dict[int, concurrent.futures.Future]) -> None:
        outcomes = [
            self.dispatcher.outcome(host, answer, stash.generations[host]) for host, answer in answers.items()
        ]
        failed = [outcome for outcome in outcomes if outcome is not None]
        if failed:
            lost = [outcome for outcome in failed if isinstance(outcome, errors.HostLostError)]
            raise (lost or failed)[0]

    def load(
        self, island: int, hosts: tuple[int, ...], reads: list[tuple[Read, object, object]]
    ) -> list[RemoteArray]:
        """Reads values into ``hosts`` (of ``island``): each read with its abstract value and stand-in
        sharding. Returns their handles at once; each is ready when its hosts have read it."""
        d = self.dispatcher
        keys = d.fresh_keys(len(reads))
        items = [read._replace(key=key) for key, (read, _, _) in zip(keys, reads, strict=True)]
        with d.lock:
            if island in d.lost:
                raise errors.HostLostError(d.losses.message(island, "a restore"))
            generation = d.generations[island]
            answers = tuple(d.route.message(host, "load", (items,)) for host in hosts)
        counts.bump("host_restores", len(items))
        return [
            RemoteArray(d, hosts, key, aval, sharding, answers, generation)
            for key, (_, aval, sharding) in zip(keys, reads, strict=True)
        ]
