"""The resource manager: islands of devices and the virtual-to-physical map."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import threading
import time
import weakref

import jax

from pathways_jax._src.core import errors

_LOOK_AGAIN_S = 0.05  # how often a request waiting for devices looks whether a dropped slice gave some back


@dataclasses.dataclass(frozen=True, slots=True)
class Island:
    """A group of devices joined by a fast interconnect ("ici"); islands talk over "dcn"."""

    index: int
    devices: tuple[jax.Device, ...]

    def __repr__(self) -> str:
        ids = ",".join(str(d.id) for d in self.devices)
        return f"Island({self.index}, devices=[{ids}])"


class Hold:
    """A slice's claim on its devices: they are the slice's while this lives (the slice keeps it).

    Dropped with its slice, it gives the devices back with no Python code run:
    the manager's table entry, keyed by a weak reference to it, goes in that
    reference's callback, a C method (``dict.pop``). A ``weakref.finalize``
    callback was Python code, where a Ctrl-C landing was only reported, never
    raised to the user, and could stop the release half-way.
    """

    __slots__ = ("__weakref__", "ref")

    def __init__(self, table: dict) -> None:
        self.ref = weakref.ref(self, table.pop)


class ResourceManager:
    """Maps virtual slices onto physical devices.

    Shared slices go to the least-loaded devices of a fitting island and are
    time-multiplexed by the controller. Exclusive slices reserve their devices:
    nothing else is mapped there until they are released.
    """

    def __init__(
        self,
        islands: tuple[tuple[jax.Device, ...], ...],
        reclaim: collections.abc.Callable[[], None] | None = None,
        holders: collections.abc.Callable[[set[int], bool], str] | None = None,
    ):
        self.islands = tuple(Island(i, devs) for i, devs in enumerate(islands))
        # Called (no lock held) when a request finds no devices free: frees what nothing holds.
        self._reclaim = reclaim
        # Says which slices hold these device ids (all of them, or only exclusive ones), for an
        # error: the slices a user did not ask for (those of programs placed nowhere) included.
        self._holders = holders
        # Taken as the bare lock (``with self._lock``), which is the condition's own: a
        # Condition's __enter__ is a Python frame, where a Ctrl-C landing as the lock is taken
        # leaves it held by the main thread (every other thread asking for devices then waits).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # The devices of each live slice (ids, and whether exclusively), by a weak reference to
        # its Hold: an entry goes when the Hold does (Hold), or is emptied by release().
        self._holds: dict[weakref.ref[Hold], tuple[tuple[int, ...], bool]] = {}
        # Made from _holds (_count) where read, under the lock: never updated in place, so a
        # Ctrl-C cannot leave them half-counted.
        self._shared_load: collections.Counter[int] = collections.Counter()
        self._reserved: set[int] = set()
        # Islands whose host was lost (Ray backend), with why: nothing is placed there.
        self.lost: dict[int, str] = {}

    def lose(self, island: int, why: str) -> None:
        """Takes an island out of placement (its host died) until it is restored."""
        with self._lock:
            self.lost[island] = why
            self._cond.notify_all()

    def restore(self, island: int) -> None:
        """Places on a lost island again (the Ray backend rebuilt it on new hosts)."""
        with self._lock:
            self.lost.pop(island, None)
            self._cond.notify_all()

    def describe(self) -> str:
        return ", ".join(f"island {isl.index}: {len(isl.devices)} devices" for isl in self.islands)

    def _candidates(self, size: int, island: int | None) -> tuple[Island, ...]:
        if island is not None:
            if not isinstance(island, int) or isinstance(island, bool) or not 0 <= island < len(self.islands):
                raise errors.ResourceError(
                    f"asked for island {island!r}, but the cluster has islands "
                    f"0..{len(self.islands) - 1} ({self.describe()}). Pass one of "
                    "those, or island=None to let the resource manager choose."
                )
            if island in self.lost:
                raise errors.ResourceError(
                    f"asked for island {island}, but its host was lost ({self.lost[island]}). "
                    "Pass island=None to let the resource manager pick a surviving island."
                )
            pool: tuple[Island, ...] = (self.islands[island],)
        else:
            pool = tuple(isl for isl in self.islands if isl.index not in self.lost)
            if not pool:
                raise errors.ResourceError("every island's host was lost; there are no devices left.")
        fitting = tuple(isl for isl in pool if len(isl.devices) >= size)
        if not fitting:
            where = f"island {island}" if island is not None else "any island"
            raise errors.ResourceError(
                f"asked for a slice of {size} devices on {where}, but the largest "
                f"fitting island has {max(len(isl.devices) for isl in pool)} "
                f"({self.describe()}). Ask for fewer devices, or pw.init() with "
                "larger islands."
            )
        return fitting

    def _try_place(
        self, size: int, fitting: tuple[Island, ...], exclusive: bool
    ) -> tuple[int, tuple[jax.Device, ...]] | None:
        best = None
        for isl in fitting:
            free = [d for d in isl.devices if d.id not in self._reserved]
            if exclusive:
                free = [d for d in free if self._shared_load[d.id] == 0]
            if len(free) < size:
                continue
            chosen = sorted(free, key=lambda d: (self._shared_load[d.id], d.id))[:size]
            # Least-loaded devices first, then the emptier island, then the lower index.
            rank = (
                sum(self._shared_load[d.id] for d in chosen),
                sum(self._shared_load[d.id] for d in isl.devices),
                isl.index,
            )
            if best is None or rank < best[0]:
                best = (rank, isl.index, tuple(sorted(chosen, key=lambda d: d.id)))
        return None if best is None else (best[1], best[2])

    def _named(self, size: int, island: int | None, device_ids: object) -> tuple[int, tuple[jax.Device, ...]]:
        """Checks ``pw.devices(device_ids=...)``: ``size`` distinct known ids, all on one island."""
        if isinstance(device_ids, str | bytes) or not isinstance(device_ids, collections.abc.Sequence):
            raise errors.ResourceError(
                f"device_ids must be a list of device ids in mesh order, got {device_ids!r}."
            )
        where = {d.id: (isl.index, d) for isl in self.islands for d in isl.devices}
        for device_id in device_ids:
            if not isinstance(device_id, int) or isinstance(device_id, bool) or device_id not in where:
                raise errors.ResourceError(
                    f"device_ids={list(device_ids)!r} names {device_id!r}, which is not a device id of "
                    f"this cluster; its ids are {sorted(where)} ({self.describe()})."
                )
        if len(device_ids) != size:
            raise errors.ResourceError(
                f"device_ids={list(device_ids)!r} names {len(device_ids)} devices, but the mesh has "
                f"{size}; name one device per mesh position, in row-major mesh order."
            )
        if len(set(device_ids)) != size:
            raise errors.ResourceError(
                f"device_ids={list(device_ids)!r} names a device more than once; a slice's devices are distinct."
            )
        owners = sorted({where[i][0] for i in device_ids})
        if len(owners) > 1:
            raise errors.ResourceError(
                f"device_ids={list(device_ids)!r} spans islands {owners} ({self.describe()}); a slice "
                "lives on one island. Name devices of one island (a value moves between islands "
                "as a transfer between slices)."
            )
        (home,) = owners
        if island is not None and island != home:
            raise errors.ResourceError(
                f"device_ids={list(device_ids)!r} are on island {home}, but island={island!r} was asked "
                "for; drop one of the two arguments or make them agree."
            )
        if home in self.lost:
            raise errors.ResourceError(
                f"device_ids={list(device_ids)!r} are on island {home}, whose host was lost "
                f"({self.lost[home]}). Name devices of a surviving island."
            )
        return home, tuple(where[i][1] for i in device_ids)

    def _count(self) -> None:
        """Counts the devices the live slices hold (lock held): shared use per device, and the reserved."""
        shared: collections.Counter[int] = collections.Counter()
        reserved: set[int] = set()
        for ids, exclusive in list(self._holds.values()):  # a copy: a Hold may go meanwhile
            if exclusive:
                reserved.update(ids)
            else:
                shared.update(ids)
        self._shared_load, self._reserved = shared, reserved

    def _busy(self, devices: tuple[jax.Device, ...], exclusive: bool) -> list[int]:
        """The ids of these named devices that cannot be taken now (shared, or exclusively)."""
        return [d.id for d in devices if d.id in self._reserved or (exclusive and self._shared_load[d.id])]

    def acquire(
        self,
        size: int,
        island: int | None,
        exclusive: bool,
        timeout: float | None,
        device_ids: object = None,
    ) -> tuple[int, tuple[jax.Device, ...], Hold]:
        """Picks devices for a new slice, waiting up to ``timeout`` if they are busy.

        ``device_ids``: the devices to use, in mesh order, instead of letting
        the manager choose (they must all be on one island). Returns the
        island, the devices, and the :class:`Hold` that keeps them the slice's.
        """
        if device_ids is not None:
            named = self._named(size, island, device_ids)

            def place() -> tuple[int, tuple[jax.Device, ...]] | None:
                self._count()
                return None if self._busy(named[1], exclusive) else named
        else:
            fitting = self._candidates(size, island)

            def place() -> tuple[int, tuple[jax.Device, ...]] | None:
                self._count()
                return self._try_place(size, fitting, exclusive)

        deadline = None if timeout is None else time.monotonic() + timeout
        if self._reclaim is not None:
            with self._lock:
                free = place() is not None
            if not free:
                # Slices held only by dropped values and programs: released before waiting.
                self._reclaim()
        with self._lock:
            while (placed := place()) is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    kind = "exclusive" if exclusive else "shared"
                    if device_ids is not None:
                        raise errors.ResourceError(
                            f"devices {sorted(self._busy(named[1], exclusive))} of device_ids={[d.id for d in named[1]]!r} were not free for {'an' if exclusive else 'a'} {kind} "
                            f"slice within timeout={timeout}s (held by "
                            f"{'other slices' if exclusive else 'exclusive slices'}). Release those slices, "
                            "wait longer, or let the resource manager choose (no device_ids)."
                        )
                    asked = [d.id for isl in fitting for d in isl.devices]
                    reserved = sum(1 for d in asked if d in self._reserved)
                    held = f"{reserved} of their {len(asked)} devices reserved by exclusive slices"
                    if exclusive:  # an exclusive slice needs devices no shared slice uses either
                        shared = sum(1 for d in asked if d not in self._reserved and self._shared_load[d])
                        held += f", {shared} used by shared slices"
                    where = f"island {island}" if island is not None else "any island that fits"
                    holding = ""
                    if self._holders is not None:
                        holding = self._holders(
                            {d for d in asked if d in self._reserved or exclusive}, exclusive
                        )
                    raise errors.ResourceError(
                        f"{size} devices did not come free on {where} for {'an' if exclusive else 'a'} "
                        f"{kind} slice within timeout={timeout}s ({held}). Release slices you no "
                        f"longer need, or wait longer.{holding}"
                    )
                # A dropped slice's devices come back with no notify (Hold): looked at again soon.
                self._cond.wait(_LOOK_AGAIN_S if remaining is None else min(remaining, _LOOK_AGAIN_S))
            island_index, devices = placed
            hold = Hold(self._holds)
            self._holds[hold.ref] = (tuple(d.id for d in devices), exclusive)  # one step: taken
            return island_index, devices, hold

    def release(self, hold: Hold) -> None:
        """Gives back the devices of ``hold`` (its slice's ``release()``); its entry goes with it."""
        with self._lock:
            exclusive = self._holds[hold.ref][1]
            self._holds[hold.ref] = ((), exclusive)
            self._cond.notify_all()

    def load(self) -> dict[int, int]:
        """Slices mapped on each device id (an exclusive reservation counts as one)."""
        with self._lock:
            self._count()
            out = {d.id: 0 for isl in self.islands for d in isl.devices}
            out.update(self._shared_load)
            for device_id in self._reserved:
                out[device_id] += 1
            return out
