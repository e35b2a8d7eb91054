"""``pw.colocated_python.HostIterator``: an input pipeline whose batches are made on the hosts.

The pattern (MaxText's ``RemoteIterator`` on Pathways, with this module's
names): an object of a ``colocated_python_class`` lives on each host of the
batch's devices and holds that host's data iterator. Each batch is one
colocated call: every host takes its next local batch (its own shard of the
global batch: rows ``index * n / count`` to ``(index + 1) * n / count`` of
each leaf) and puts it on its own devices as its part of one global array;
the futures that come back are values on the hosts, which a ``pw.program``
or ``pw.jit`` on those devices takes as input with no hop through this
process. Only the call (a few hundred bytes) goes from here; no input data
does.

**Ahead of the program.** On each host the iterator runs on a thread of its
own, ``prefetch`` batches ahead of the calls (as Grain's thread prefetch
does), so making the next batch overlaps the host's programs; and this side
keeps ``prefetch`` calls in flight beyond the batch it returns. ``next``
returns a batch once its hosts have answered its call (they made it): a host
whose iterator ran out answers that it did (``StopIteration``, carried as
such), so a finite iterator ends the loop with ``StopIteration``, and an
iterator that raises raises at the ``next`` that asked for its batch. A batch
that was not made never reaches a program.

The iterator's position is :meth:`HostIterator.get_state`: for each host, its
iterator's own ``get_state()`` (Grain's ``DatasetIterator`` has one; a
``DataLoader`` iterator's bytes are kept as their text, so a position saves as
JSON) after the last batch ``next`` returned, else the number of batches taken (restored by
making the iterator anew and skipping as many). Batches made ahead are not
counted: the position is the program's. It is small and picklable: save it
with the training state, and give it back with :meth:`HostIterator.set_state`
(after a host was lost and its island rebuilt, say: the new host makes its
iterator anew, then takes the saved position).
"""

from __future__ import annotations

import base64
import collections
import copy
import dataclasses
import pickle
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from pathways_jax._src.api.colocated import _device_list
from pathways_jax._src.api.colocated_class import colocated_python_class
from pathways_jax._src.backends import ray_failures
from pathways_jax._src.core import errors

_KEPT_POSITIONS = 64  # positions a host keeps, by batch number: far more than the calls in flight


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """Which part of each global batch a host makes: part ``index`` of ``count`` (its rows)."""

    index: int
    count: int


# What a host's iterator gave: a batch, its end, or the exception it raised.
_BATCH, _END, _FAILED = "batch", "end", "failed"


def _position(iterator: Iterator, taken: int) -> dict:
    """Where ``iterator`` is, having given ``taken`` batches since it was made.

    An iterator whose state is bytes (Grain's ``DataLoader`` iterator: JSON text, encoded) keeps
    it as text, so that a position saves as JSON (Orbax's ``JsonSave``) as a dict's does;
    :func:`_iterator_state` gives the bytes back.
    """
    get_state = getattr(iterator, "get_state", None)
    if not callable(get_state):
        return {"taken": taken}
    state = get_state()
    if isinstance(state, bytes | bytearray):
        try:
            return {"iterator_text": bytes(state).decode("utf-8")}
        except UnicodeDecodeError:
            return {"iterator_base64": base64.b64encode(state).decode("ascii")}
    return {"iterator": copy.deepcopy(state)}


_ITERATOR_KEYS = ("iterator", "iterator_text", "iterator_base64")


def _iterator_state(position: dict) -> Any:
    """The state to give the iterator's own ``set_state`` for ``position`` (bytes where it gave bytes)."""
    if "iterator_text" in position:
        return position["iterator_text"].encode("utf-8")
    if "iterator_base64" in position:
        return base64.b64decode(position["iterator_base64"])
    return position["iterator"]


class _Ahead:
    """A host's iterator run ``size`` batches ahead on a thread of its own (0: made when taken).

    Each item is ``(kind, batch or exception, position after a batch)``; once the
    iterator ended or raised, that last item is given again at every take.
    """

    def __init__(self, iterator: Iterator, taken: int, size: int) -> None:
        self._iterator = iterator
        self._taken = taken
        self._size = size
        self.start = _position(iterator, taken)
        self._last: tuple | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(size, 1))
        if size:
            threading.Thread(target=self._loop, name="pathways-host-iterator", daemon=True).start()

    def _make(self) -> tuple:
        try:
            local = next(self._iterator)
        except StopIteration:
            return (_END, None, None)
        except KeyboardInterrupt as exc:
            if self._size:  # raised by the iterator itself, on its thread: its failure, as any other
                return (_FAILED, exc, None)
            # Ctrl-C while the caller waits for a batch made on its own thread (prefetch=0, the local
            # backend): it interrupts that wait, as in a plain loop, and fails nothing.
            raise
        except BaseException as exc:  # given to the call that takes it: the user's error, on that line
            return (_FAILED, exc, None)
        self._taken += 1
        return (_BATCH, local, _position(self._iterator, self._taken))

    def _loop(self) -> None:
        while not self._stop.is_set():
            item = self._make()
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] != _BATCH:
                return

    def take(self) -> tuple:
        if self._last is not None:
            return self._last
        item = self._queue.get() if self._size else self._make()
        if item[0] != _BATCH:
            self._last = item
        return item

    def stop(self) -> None:
        self._stop.set()


class _Feeder:
    """The object on each host: its iterator (run ahead), and the positions after the batches it gave."""

    def __init__(self, make_iterator: Callable[[Shard], Iterator], batch: Any, prefetch: int) -> None:
        self.make_iterator = make_iterator
        self.specs, self.tree = jax.tree_util.tree_flatten(batch)  # shardings over this host's devices
        self.prefetch = prefetch
        self.shard = _shard_of(self.specs)
        self.rank = _hosts_of(self.specs).index(jax.process_index())  # its entry in get_state's list
        self._start(make_iterator(self.shard), 0)

    def _start(self, iterator: Iterator, taken: int) -> None:
        self.ahead = _Ahead(iterator, taken, self.prefetch)
        self.given = 0  # batches given since the iterator was (re)started
        self.positions = {-1: self.ahead.start}  # batch number -> the position after it

    def __del__(self) -> None:
        ahead = getattr(self, "ahead", None)
        if ahead is not None:
            ahead.stop()

    def next(self) -> Any:
        kind, local, position = self.ahead.take()
        if kind == _FAILED:
            raise local
        if kind == _END:
            raise StopIteration  # the call's answer says so (at every call from now on)
        number, self.given = self.given, self.given + 1
        self.positions[number] = position
        self.positions.pop(number - _KEPT_POSITIONS, None)
        leaves, got = jax.tree_util.tree_flatten(local)
        if got != self.tree:  # type: ignore[operator]  # jaxlib has no PyTreeDef stubs
            raise ValueError(
                f"the iterator on host {jax.process_index()} gave a batch of structure {got}; the "
                f"HostIterator's batch is {self.tree}. Yield this host's part of each leaf of batch."
            )
        arrays = [_global(spec, leaf) for spec, leaf in zip(self.specs, leaves, strict=True)]
        return jax.tree_util.tree_unflatten(self.tree, arrays)

    def state(self, consumed: jax.Array) -> Any:
        number = int(np.asarray(consumed.addressable_data(0))) - 1
        if number not in self.positions:
            raise ValueError(
                f"the position after batch {number} is not known on host {jax.process_index()}: it has "
                f"given {self.given} batches since its iterator was made (a host rebuilt since takes "
                "its position from set_state first)."
            )
        return self.positions[number]

    def restore(self, saved: jax.Array) -> None:
        """Puts this host's iterator where ``saved`` (every host's position) says. The new iterator is
        made and positioned first: if that fails, the one running goes on where it was."""
        states = pickle.loads(np.asarray(saved.addressable_data(0)).tobytes())
        state = _checked_position(states, self.rank, self.shard.count)
        iterator = self.make_iterator(self.shard)
        taken = 0
        if any(key in state for key in _ITERATOR_KEYS):
            iterator.set_state(_iterator_state(state))  # type: ignore[attr-defined]
        else:
            taken = state["taken"]
            for _ in range(taken):
                next(iterator)
        self.ahead.stop()
        self._start(iterator, taken)


def _checked_position(states: Any, rank: int, count: int) -> dict:
    """This host's entry (``rank``, in host order) of ``set_state``'s list, if the list is what ``get_state`` returns."""
    if not isinstance(states, list) or len(states) != count:
        given = f"a list of {len(states)}" if isinstance(states, list) else f"a {type(states).__name__}"
        raise errors.also(errors.PathwaysError, ValueError)(
            f"HostIterator.set_state takes what get_state returned: a list of one position per host of "
            f"the batch's devices ({count}), got {given}. The iterator stays where it was."
        )
    state = states[rank]
    taken = state.get("taken") if isinstance(state, dict) else None
    if not isinstance(state, dict) or not (
        "iterator" in state
        or any(isinstance(state.get(key), str) for key in _ITERATOR_KEYS[1:])
        or (isinstance(taken, int) and not isinstance(taken, bool) and taken >= 0)
    ):
        raise errors.also(errors.PathwaysError, ValueError)(
            f"HostIterator.set_state: host {rank}'s position must be what get_state gave for it "
            f"({{'iterator': <its iterator's state>}}, {{'iterator_text': <its state's bytes, as text>}} or "
            f"{{'taken': <batches, an int >= 0>}}), got "
            f"{state!r}. The iterator stays where it was."
        )
    return state


def _global(spec: jax.ShapeDtypeStruct, leaf: Any) -> jax.Array:
    """The global array of ``spec`` from this host's part of it (``leaf``).

    A typed PRNG key leaf (``jax.random.key``) travels as its key data and is
    wrapped again, with its own implementation (NumPy holds no key types).
    """
    if not jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
        data = np.asarray(leaf)
        if data.dtype != spec.dtype and not np.can_cast(data.dtype, spec.dtype, casting="same_kind"):
            # A cast across kinds (float to int, int to bool) would change the values, not just their width.
            raise errors.also(errors.PathwaysError, TypeError)(
                f"the iterator on host {jax.process_index()} gave {data.dtype} data for a leaf of type "
                f"{spec.dtype}: casting it would change its values. Yield {spec.dtype} (or a narrower or "
                "wider type of the same kind) there, or declare the leaf's dtype as the iterator's."
            )
        try:
            return jax.make_array_from_process_local_data(
                spec.sharding, data.astype(spec.dtype, copy=False), spec.shape
            )
        except ValueError as exc:  # JAX's words name its own function, not the iterator
            raise errors.also(errors.PathwaysError, ValueError)(
                f"the iterator on host {jax.process_index()} gave data of shape {data.shape} for a leaf "
                f"of the batch of shape {spec.shape}, whose part on this host is {_local_shape(spec)}. "
                "Yield this host's part of each leaf (its rows: the batch's first dimension divided by "
                "shard.count, where the leaf is split over the hosts)."
            ) from exc
    if not (isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)):
        raise errors.also(errors.PathwaysError, TypeError)(
            f"the iterator on host {jax.process_index()} gave a {type(leaf).__name__} for a leaf of type "
            f"{spec.dtype}; yield typed keys there (jax.random.key(...)), as the batch says."
        )
    data = np.asarray(jax.random.key_data(leaf))
    trailing = data.shape[leaf.ndim :]  # the key's own words
    global_data = jax.make_array_from_process_local_data(spec.sharding, data, (*spec.shape, *trailing))
    return jax.random.wrap_key_data(global_data, impl=jax.random.key_impl(leaf))


def _local_shape(spec: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    """The shape of this process's part of a leaf: what its devices' shards of it span."""
    indices = spec.sharding.addressable_devices_indices_map(spec.shape).values()
    shape = []
    for dim, size in enumerate(spec.shape):
        spans = [index[dim].indices(size) for index in indices]
        shape.append(max(stop for _, stop, _ in spans) - min(start for start, _, _ in spans))
    return tuple(shape)


def _hosts_of(specs: list) -> list[int]:
    """The processes owning the batch's devices, in host order."""
    return sorted({d.process_index for spec in specs for d in spec.sharding.device_set})


def _shard_of(specs: list) -> Shard:
    """This process's part of the batch: the rank of its rows among the processes owning its devices.

    The rows a process's devices hold follow the mesh's device order, not the
    processes' (a slice mapped with ``device_ids=[2, 3, 0, 1]`` puts the first
    rows on the second host): the first leaf whose rows the hosts split decides
    it. Where none is split, the processes' own order.
    """
    processes = _hosts_of(specs)
    first: dict[int, int] = {}
    for spec in specs:
        if not spec.shape:
            continue
        starts: dict[int, int] = {}
        for device, index in spec.sharding.devices_indices_map(tuple(spec.shape)).items():
            start = index[0].indices(spec.shape[0])[0]
            starts[device.process_index] = min(start, starts.get(device.process_index, start))
        if len(starts) == len(processes) and len(set(starts.values())) == len(processes):
            first = starts
            break
    ordered = sorted(processes, key=lambda p: (first.get(p, 0), p))
    return Shard(ordered.index(jax.process_index()), len(processes))


_HostFeeder = colocated_python_class(_Feeder)


class HostIterator:
    """Batches made on the hosts of their devices, by one data iterator per host.

    Args:
      make_iterator: called on each host (it travels pickled) with the
        host's :class:`Shard`; returns an iterator of that host's part of each
        batch: a pytree like ``batch`` of arrays whose first dimension is the
        global one divided by ``shard.count``. A Grain ``DatasetIterator``, a
        generator, any Python iterator. When it ends, so does this iterator.
      batch: the global batch: a pytree of ``jax.ShapeDtypeStruct`` with
        shardings over the devices the batches are for (a slice's
        ``s.sharding("x")``), all on one island.
      prefetch: batches each host makes ahead of the calls, on a thread of its
        own, and calls kept in flight beyond the batch ``next`` returns
        (0: each batch is made when called for, and ``next`` waits for it).

    Raises (at ``next``):
      StopIteration: a host's iterator ended (every later ``next`` too).
      ProgramFailedError: a host's iterator raised (with its traceback).
      HostLostError: a host was lost; after its island is rebuilt, ``set_state``
        puts the new host's iterator back where a checkpoint had it.

    Example:
      >>> import jax, numpy as np, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> spec = jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))
      >>> def rows(shard):
      ...     n = 4 // shard.count
      ...     for step in range(4):
      ...         yield np.full((n, 2), step, np.float32)
      >>> batches = pw.colocated_python.HostIterator(rows, spec)
      >>> float(next(batches).sum()), float(next(batches).sum())
      (0.0, 8.0)
      >>> state = batches.get_state()
      >>> float(next(batches).sum())
      16.0
      >>> batches.set_state(state)
      >>> [float(b.sum()) for b in batches]
      [16.0, 24.0]
      >>> s.release()
    """

    def __init__(self, make_iterator: Callable[[Shard], Iterator], batch: Any, *, prefetch: int = 2) -> None:
        if not callable(make_iterator):
            raise TypeError(
                f"HostIterator takes a function making each host's iterator, got {type(make_iterator).__name__}."
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise TypeError(f"HostIterator's prefetch is a number of batches (0 or more), got {prefetch!r}.")
        leaves = jax.tree_util.tree_leaves(batch)
        if not leaves or any(getattr(x, "sharding", None) is None for x in leaves):
            raise errors.SpecializationError(
                f"HostIterator's batch must be a pytree of jax.ShapeDtypeStruct(shape, dtype, sharding=...) "
                f"with a sharding each, got {batch!r}. Give each leaf the sharding the program reads it with."
            )
        devices: list = []
        for leaf in leaves:
            devices += [d for d in _device_list(leaf.sharding._device_assignment) if d not in devices]
        self.batch = batch
        self._replicated = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices), ("d",)), jax.sharding.PartitionSpec()
        )
        self._feeder = _HostFeeder(make_iterator, batch, prefetch)
        specialized = {"devices": tuple(devices)}
        self._next = self._feeder.next.specialize(out_specs_fn=lambda: batch, **specialized)
        self._state = self._feeder.state.specialize(**specialized)
        self._restore = self._feeder.restore.specialize(**specialized)
        self._depth = prefetch
        self._calls: collections.deque = collections.deque()  # the batches of calls sent, oldest first
        self._returned = 0  # batches next() returned since the iterators were (re)started
        self._ended = False  # an iterator ran out: no more calls
        # What a call raised as it was made (the local backend runs it at once): raised (or the
        # end, for StopIteration) once the batches of the calls before it are taken.
        self._stopped: Exception | None = None

    def __iter__(self) -> HostIterator:
        return self

    def __next__(self) -> Any:
        """The next global batch, futures of values on the hosts, once the hosts made it."""
        if self._ended:
            raise StopIteration
        while len(self._calls) <= self._depth and self._stopped is None:
            try:
                self._calls.append(self._next())
            except Exception as exc:  # the batches of the calls before it stand
                self._stopped = exc
        if not self._calls:
            stopped, self._stopped = self._stopped, None
            if isinstance(stopped, StopIteration):
                self._ended = True
                raise StopIteration
            raise stopped  # type: ignore[misc]  # (not None: no call was kept, so one raised)
        # Taken off the queue once made: a wait that Ctrl-C interrupts leaves it the next batch.
        batch = self._calls[0]
        try:
            for leaf in jax.tree_util.tree_leaves(batch):
                leaf.block_until_ready()  # the hosts' answers: made, ran out, or failed
        except errors.PathwaysError as exc:
            self._calls.clear()  # calls after a failure: a later next() calls anew
            if not ray_failures.ended(exc):
                raise
            self._ended = True
            raise StopIteration from None
        self._calls.popleft()
        self._returned += 1
        return batch

    def get_state(self) -> list:
        """Each host's iterator position after the last batch returned, in host order (small, picklable)."""
        returned = jax.device_put(np.int32(self._returned), self._replicated)
        return self._state.reply(returned)

    def set_state(self, state: list) -> None:
        """Puts each host's iterator where :meth:`get_state` found it; later batches continue from there."""
        if not isinstance(state, list):
            raise errors.SpecializationError(
                f"HostIterator.set_state takes what get_state returned (a list, one entry per host), "
                f"got {type(state).__name__}."
            )
        saved = np.frombuffer(pickle.dumps(state), np.uint8)  # to every host, with the call
        # A position a host cannot take (or whose iterator fails to get there) leaves it where it was:
        # the calls in flight stand until the restore is done.
        self._restore.reply(jax.device_put(saved, self._replicated))
        self._calls.clear()  # batches of the old position
        self._returned = 0
        self._ended = False
        self._stopped = None


__all__ = ["HostIterator", "Shard"]
