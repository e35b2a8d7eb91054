"""The values a controller service's hosts keep: whose, where, how big, and who else may read them.

A client's keys are namespaced on the hosts (:func:`~.config.host_key`). A
value is freed on its hosts once its owner dropped its handle and no client
it was shared with (``pw.share``) still holds it; its bytes count against
the service's one memory budget until then. A client it was shared with may
read it while it lives, also after dropping what it received (``pw.receive``
again).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from pathways_jax._src.runtime import admission
from pathways_jax._src.runtime.serving.config import host_key

_POOL = 0  # the service's memory budget is one pool of bytes for all its hosts


class Refuse(Exception):
    """A batch names a value its client may not use: it is refused whole."""


@dataclasses.dataclass(eq=False)
class Kept:
    """A value kept on the hosts: whose, where, how big, and who else may read it."""

    owner: int
    hosts: tuple
    nbytes: int
    readers: set = dataclasses.field(default_factory=set)  # the clients it was shared with
    holders: set = dataclasses.field(default_factory=set)  # those of them that may still hold it
    owner_holds: bool = True


class Ledger:
    """Every value the service's hosts keep (by host key), and their bytes under the budget."""

    def __init__(self, memory_budget: int | None):
        self.values: dict[int, Kept] = {}
        self.budget = admission.Budget({_POOL: memory_budget or sys.maxsize})

    @property
    def held(self) -> int:
        """Bytes of values on the hosts."""
        return self.budget.used[_POOL]

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the budget now."""
        return self.budget.fits(((_POOL, nbytes),))

    def exceeds(self, nbytes: int) -> bool:
        """Whether ``nbytes`` would never fit, even with nothing held."""
        return self.budget.exceeds(((_POOL, nbytes),))

    def keep(self, client_id: int, key: int, host: int, nbytes: int) -> None:
        """Host ``host`` keeps the value of host key ``key`` for its owner ``client_id``."""
        value = self.values.get(key)
        if value is None:
            self.values[key] = Kept(client_id, (host,), nbytes)
            self.budget.hold(((_POOL, nbytes),))
        elif host not in value.hosts:
            value.hosts = (*value.hosts, host)

    def unmade(self, keys: Any) -> None:
        """The values under host keys ``keys`` were never made (their run failed, or their hosts were
        lost): they hold no bytes on the hosts, so they leave the budget now, as a failed run's outputs
        do in-process. They stay on the ledger, for their owner (and whoever they were shared with) to
        read and be told why, until it drops them."""
        for key in keys:
            value = self.values.get(key)
            if value is not None and value.nbytes:
                self.budget.release(((_POOL, value.nbytes),), locked=True)
                value.nbytes = 0

    def readable(self, client_id: int, key: Any) -> int:
        """The host key of a value a client names (its own, or ``(owner, key)``), if it may read it.

        Raises:
          Refuse: the value is gone, or neither the client's nor shared with it.
        """
        owner, local = (client_id, key) if isinstance(key, int) else key
        hk = host_key(owner, local)
        value = self.values.get(hk)
        if value is None:
            raise Refuse(
                f"the value handle (client {owner}, key {local}) names no value on the hosts: freed (its "
                "owner's future and every receiver's went), or never made. A value lives while a future "
                "of it does: keep one (the owner's, or one pw.receive gave) while others read it"
            )
        if owner == client_id and value.owner_holds:
            return hk
        if client_id in value.readers:
            return hk
        if owner == client_id:
            raise Refuse(
                f"value {local} of this client was freed (a stale handle: its future went, or was "
                "deleted or donated); pass a future that is still live"
            )
        raise Refuse(
            f"the value handle (client {owner}, key {local}) belongs to another client process and was not "
            "shared with this one (pw.share(future, client=...) in its owner)"
        )

    def read(self, client_id: int, key: Any) -> int:
        """:meth:`readable`'s host key; a client the value was shared with holds it again (its
        handle that reads it is freed later)."""
        hk = self.readable(client_id, key)
        value = self.values[hk]
        if client_id != value.owner:
            value.holders.add(client_id)
        return hk

    def share(self, key: int, readers: set[int]) -> None:
        """Value ``key`` may be read by ``readers``, who hold it until they drop it."""
        value = self.values[key]
        value.readers |= readers
        value.holders |= readers

    def drop(self, client_id: int, keys: list, frees: dict[int, list[int]]) -> None:
        """A client dropped its handles ``keys``: values nobody holds any more go to ``frees``."""
        for key in keys:
            if isinstance(key, int):
                owner, local, owned = client_id, key, True
            else:  # a received handle (pw.receive), of another process or of this one
                (owner, local), owned = key, False
                if owner == client_id:
                    continue  # the owner's own future frees it
            hk = host_key(owner, local)
            value = self.values.get(hk)
            if value is None:
                continue
            if owned:
                value.owner_holds = False
            else:
                value.holders.discard(client_id)
            if not value.owner_holds and not value.holders:
                self.release(hk, frees)

    def forget_client(self, client_id: int, frees: dict[int, list[int]]) -> None:
        """A client went: it holds and reads nothing now; values nobody holds go to ``frees``."""
        for key, value in list(self.values.items()):
            value.readers.discard(client_id)
            value.holders.discard(client_id)
            if value.owner == client_id:
                value.owner_holds = False
            if not value.owner_holds and not value.holders:
                self.release(key, frees)

    def release(self, key: int, frees: dict[int, list[int]]) -> None:
        """Takes value ``key`` off the ledger: its hosts free it (``frees``: host -> keys)."""
        value = self.values.pop(key)
        self.budget.release(((_POOL, value.nbytes),), locked=True)
        for host in value.hosts:
            frees[host].append(key)
