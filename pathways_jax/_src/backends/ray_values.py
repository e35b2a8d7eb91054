"""The Ray backend's values: a handle on the controller's side of a value that lives on hosts.

A future of a run on Ray hosts holds a :class:`RemoteArray`: the hosts and
key of the value, its abstract value and sharding, and the hosts' answers
that say when it is computed; ``fetch`` brings the value here.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any, Protocol

import jax

from pathways_jax._src.backends.ray_host import KeyData, RunDone
from pathways_jax._src.core import arrays, counts, errors

if TYPE_CHECKING:
    from pathways_jax._src.backends.ray_plan import Islands


class Holder(Protocol):
    """What a value on hosts asks of what holds it (``ray_dispatch.Dispatcher``, of either Ray backend)."""

    @property
    def layout(self) -> Islands: ...
    @property
    def generations(self) -> list[int]: ...
    @property
    def lost(self) -> dict[int, str]: ...
    @property
    def closed(self) -> bool: ...

    def outcome(self, host: int, done: Any, generation: int) -> BaseException | None:
        """A host's answer to the run that makes a value: None if it went well, else the error."""
        ...

    def fetch(self, hosts: tuple[int, ...], key: int | tuple[int, int], generation: int) -> Any:
        """The value under ``key`` on ``hosts``, brought here."""
        ...

    def fetch_sent(self, hosts: tuple[int, ...], key: int | tuple[int, int], generation: int) -> list:
        """Asks ``hosts`` for the value under ``key``: the futures of their answers."""
        ...

    def fetched_value(
        self, hosts: tuple[int, ...], answers: list, generation: int, deadline: float | None
    ) -> Any:
        """The value ``answers`` bring, brought here; ``FutureTimeoutError`` if not come by ``deadline``."""
        ...

    def drop(self, host: int, key: int | tuple[int, int]) -> None:
        """A handle went: its value is freed on its host."""
        ...


_UNSETTLED = object()


class RemoteArray:
    """A value living on one host or several: a handle the object store keeps instead of a ``jax.Array``.

    ``sharding`` names the controller's stand-in devices; the hosts hold the
    real buffers (each host of a value spanning hosts its own shards, under
    the same key). Readiness is that of the hosts' parts of the run that made
    it. Dropping the handle frees the value on its hosts. A handle with no key
    is a run's completion marker on one host.
    """

    __slots__ = (
        "__weakref__",
        "_fetching",
        "_outcome",
        "_ready",
        "_value",
        "aval",
        "backend",
        "dones",
        "generation",
        "hosts",
        "key",
        "sharding",
    )

    def __init__(
        self,
        backend: Holder,
        hosts: tuple[int, ...],
        key: int | tuple[int, int] | None,  # (owner, key): a value another client process shared
        aval: Any,
        sharding: Any,
        dones: tuple,
        generation: int,
    ):
        self.backend = backend
        self.hosts = hosts
        self.generation = generation  # of its island's hosts (a rebuilt island has new ones)
        self.key = key
        self.aval = aval
        self.sharding = sharding
        # The futures of the hosts' answers to the run that made it (the link's):
        # asking one costs under a microsecond.
        self.dones = dones
        self._outcome: Any = _UNSETTLED
        self._ready = False
        self._value: jax.Array | None = None
        # The hosts' answers to a fetch cut short by its deadline: the next fetch reads them (the
        # value is not asked for again, and what came is not left unread).
        self._fetching: list | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self) -> Any:
        return self.aval.dtype

    def is_deleted(self) -> bool:
        return False

    def is_ready(self) -> bool:
        if self._ready or self.backend.closed or not self.dones:  # no dones: made before this process had it
            return True
        self._ready = all(f.done() for f in self.dones)
        return self._ready

    def wait_ready(self, timeout: float) -> None:
        """Returns once the value is ready or after ``timeout`` seconds."""
        if not self._ready and not self.backend.closed and self.dones:
            _, pending = concurrent.futures.wait(self.dones, timeout=timeout)
            self._ready = not pending

    def _settle(self) -> Any:
        if self._outcome is _UNSETTLED:
            # No dones: a value another client process made (pw.receive); the service says if it may be read.
            outcomes = (
                [
                    self.backend.outcome(host, done, self.generation)
                    for host, done in zip(self.hosts, self.dones, strict=True)
                ]
                if self.dones
                else []
            )
            failed = [o for o in outcomes if o is not None]
            # A lost host explains its peers' failures: say that one.
            lost = [o for o in failed if isinstance(o, errors.HostLostError)]
            self._outcome = (lost or failed or [None])[0]
        return self._outcome

    def block_until_ready(self) -> RemoteArray:
        outcome = self._settle()
        if outcome is not None:
            raise outcome
        return self

    def fetch(self, deadline: float | None = None) -> jax.Array:
        """Brings the value to the controller as a ``jax.Array`` (on the stand-in devices).

        ``deadline`` (``time.monotonic()``; None: none): ``FutureTimeoutError`` if the hosts' parts
        have not all come by then, however large the value (past it, only this process's own
        piecing together of what came, and its copy onto the stand-ins). The fetch goes on: the
        next call reads what it brings, without asking the hosts again.
        """
        if self._value is None:
            self.block_until_ready()
            if self.key is None:  # a completion marker: no value of its own
                raise errors.PathwaysError(f"{self!r} holds no value to fetch.")
            data = self._small()
            if data is None:
                data = self._fetched(self.key, deadline)
            counts.bump("fetches")
            # Host data nothing else changes: through JAX's own call for it (``jax.device_put``'s
            # Python path around that call was two thirds of this fetch).
            value = arrays.put(data, self.sharding)
            if getattr(self.aval, "weak_type", False):  # as the host's array was: weakly typed
                value = arrays.remade(value, aval=value.aval.update(weak_type=True))
            self._value = value
        return self._value

    def _fetched(self, key: int | tuple[int, int], deadline: float | None) -> Any:
        """The value under ``key`` from its hosts (by ``deadline``, if one is given: see :meth:`fetch`)."""
        backend = self.backend
        if deadline is None and self._fetching is None:
            return backend.fetch(self.hosts, key, self.generation)
        if self._fetching is None:
            self._fetching = backend.fetch_sent(self.hosts, key, self.generation)
        try:
            data = backend.fetched_value(self.hosts, self._fetching, self.generation, deadline)
        except errors.FutureTimeoutError:
            raise  # still on its way: kept for the next call
        except Exception:
            self._fetching = None  # failed: a next call asks again
            raise
        self._fetching = None
        return data

    def _small(self) -> Any:
        """The value if it came back with its run's completion (small, on one host), else None.

        A value of a host since lost is read as any other is (it raises HostLostError): values
        live on their hosts, and the copy that came along only saves the round trip.
        """
        if len(self.dones) != 1 or not isinstance(self.key, int):
            return None
        backend = self.backend
        island = backend.layout.island_of(self.hosts[0])
        if island in backend.lost or backend.generations[island] != self.generation:
            return None
        answer = self.dones[0].result()
        if isinstance(answer, RunDone):
            data = answer.values.get(self.key)
            if data is not None:
                return (
                    data
                    if not isinstance(data, KeyData)
                    else jax.random.wrap_key_data(data.data, impl=data.impl)
                )
        return None

    def __del__(self) -> None:
        try:
            if self.key is not None:
                for host in self.hosts:
                    self.backend.drop(host, self.key)
        except Exception:
            pass

    def __repr__(self) -> str:
        where = f"host={self.hosts[0]}" if len(self.hosts) == 1 else f"hosts={list(self.hosts)}"
        return f"RemoteArray({where}, key={self.key}, shape={self.shape}, dtype={self.dtype})"
