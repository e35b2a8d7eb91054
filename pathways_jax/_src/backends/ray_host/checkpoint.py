"""Checkpoint shards a host writes and reads itself, in Orbax's format, through TensorStore.

The controller computes where each shard goes (Orbax's TensorStore spec of
every array, with this host's own OCDBT subdirectory) and sends that in small
messages; the bytes go between this host's devices and the storage, never
through the controller (``compat/host_checkpoints.py`` is the controller's
side). A save has two steps, so that training never waits for the storage:

- ``stash`` (in the host's one order of messages, right after the runs that
  made the values): each value is copied on its devices, which is enqueued
  and does not wait for the value. A later run may then donate or free the
  value: the copy stays.
- ``store`` (once the checkpoint's directory exists): a writer thread waits
  for the copies, writes this host's shards (those of replica 0) and answers
  when they are on storage. The copies are freed then.

A ``load`` reads, for each value, the part of every device of this host
under the target sharding (any sharding: the reshard is the read's own
index domain), places it, and keeps the global array under the key the
controller gave. The reads run on a thread of their own: the host goes on
with its next messages (the first step's compilation, most often) and keeps
a :class:`Pending` value, which the first run or fetch that needs it waits
for. JAX, NumPy, TensorStore and Orbax are imported where used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, NamedTuple


class Write(NamedTuple):
    """A value's part of a save on this host.

    ``key``: the kept value; ``spec``: Orbax's TensorStore write spec for it
    (this host's OCDBT subdirectory); ``primary``: this host creates the
    array's metadata (one host per value); ``key_data``: the value is typed
    PRNG keys, written as their raw data.
    """

    key: int
    spec: dict
    primary: bool
    key_data: bool = False


class Read(NamedTuple):
    """A value to read from a checkpoint into this host's devices, kept under ``key``.

    ``spec``: Orbax's TensorStore read spec; ``shape``, ``dtype``: of the data
    stored (a typed key's raw data); ``desc``: the target sharding over the
    island's devices (``ops.ShardingDesc``); ``key_impl``: set for typed keys,
    wrapped again after the read.
    """

    key: int
    spec: dict
    shape: tuple[int, ...]
    dtype: str
    desc: Any
    key_impl: str | None = None


class Stashed(NamedTuple):
    """A save's copies on this host, waiting for ``store``."""

    writes: list[Write]
    copies: list[Any]
    ocdbt: bool


def stash(kept: Any, writes: list[Write], ocdbt: bool) -> Stashed:
    """Copies each written value (``kept(key)`` gives it) on its devices (enqueued, not waited for)."""
    import jax

    copies = []
    for write in writes:
        value = kept(write.key)
        if write.key_data:
            value = jax.random.key_data(value)
        copies.append(jax.device_put(value, value.sharding, may_alias=False))
    return Stashed(writes, copies, ocdbt)


class Worker:
    """One thread doing a checkpoint's input and output in the background, started when first used."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _submit(self, work: Any) -> concurrent.futures.Future:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self._name)
        return self._pool.submit(work)

    def store(self, stashed: Stashed) -> concurrent.futures.Future:
        """Writes ``stashed``; the future completes when it is on storage."""
        return self._submit(lambda: asyncio.run(_write(stashed)))

    def load(self, reads: list[Read], devices: list, sharding_of: Any) -> concurrent.futures.Future:
        """Reads ``reads``; the future's result maps each read's key to its global array."""
        return self._submit(lambda: asyncio.run(_load(reads, devices, sharding_of)))


def finished(work: concurrent.futures.Future) -> concurrent.futures.Future:
    """A future completing with None when ``work`` completes (with its exception, if it raised)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def settle(work: concurrent.futures.Future) -> None:
        exc = work.exception()
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    work.add_done_callback(settle)
    return done


class Pending:
    """A value a load is still reading: :meth:`value` waits for it (and raises what the read raised)."""

    __slots__ = ("key", "reading")

    def __init__(self, reading: concurrent.futures.Future, key: int) -> None:
        self.reading = reading
        self.key = key

    def value(self) -> Any:
        return self.reading.result()[self.key]


async def _write(stashed: Stashed) -> None:
    import tensorstore as ts

    context = _context(stashed.ocdbt)
    transaction = ts.Transaction(atomic=True) if stashed.ocdbt else None
    await asyncio.gather(
        *[
            _write_one(write, copy, context, transaction)
            for write, copy in zip(stashed.writes, stashed.copies, strict=True)
        ]
    )
    if transaction is not None:
        await transaction.commit_async()


async def _write_one(write: Write, array: Any, context: Any, transaction: Any) -> None:
    import numpy as np
    import tensorstore as ts

    spec = ts.Spec(write.spec)
    if write.primary:  # creates the array's metadata (the others assume it)
        await ts.open(spec, create=True, open=True, context=context, transaction=transaction)
    store = await ts.open(spec, open=True, assume_metadata=True, context=context, transaction=transaction)
    pending = [
        store[shard.index].write(np.asarray(shard.data))
        for shard in array.addressable_shards
        if shard.replica_id == 0
    ]
    await asyncio.gather(*pending)


async def _load(reads: list[Read], devices: list, sharding_of: Any) -> dict[int, Any]:
    ocdbt = any(_is_ocdbt(read.spec) for read in reads)
    context = _context(ocdbt)
    arrays = await asyncio.gather(*[_read_one(read, devices, sharding_of, context) for read in reads])
    return {read.key: array for read, array in zip(reads, arrays, strict=True)}


async def _read_one(read: Read, devices: list, sharding_of: Any, context: Any) -> Any:
    import jax
    import numpy as np
    import tensorstore as ts

    store = await ts.open(ts.Spec(read.spec), open=True, context=context)
    sharding = sharding_of(read.desc, devices)
    shape = tuple(read.shape)
    if tuple(store.shape) != shape:
        raise ValueError(f"the checkpoint holds shape {tuple(store.shape)}, the restore asked for {shape}")
    places = sharding.addressable_devices_indices_map(shape)
    parts = await asyncio.gather(*[store[index].read() for index in places.values()])
    dtype = np.dtype(read.dtype)
    shards = [
        jax.device_put(np.asarray(part, dtype=dtype), device)
        for device, part in zip(places, parts, strict=True)
    ]
    array = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    if read.key_impl is not None:
        array = jax.random.wrap_key_data(array, impl=read.key_impl)
    return array


def _is_ocdbt(spec: dict) -> bool:
    """Whether a TensorStore spec reads an OCDBT store (under a cast's ``base``, if any)."""
    while "kvstore" not in spec and isinstance(spec.get("base"), dict):
        spec = spec["base"]
    kvstore = spec.get("kvstore")
    return isinstance(kvstore, dict) and kvstore.get("driver") == "ocdbt"


def _context(ocdbt: bool) -> Any:
    """The TensorStore context Orbax itself reads and writes with."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    return tensorstore_utils.get_ts_context(use_ocdbt=ocdbt)
