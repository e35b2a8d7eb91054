"""``pw.colocated_python.HostIterator``: an input pipeline whose batches are made on the hosts.

The pattern (MaxText's ``RemoteIterator`` on Pathways, with this module's
names): an object of a ``colocated_python_class`` lives on each host of the
batch's devices and holds that host's data iterator. Each call of
``next(iterator)`` is one colocated call: every host takes its next local
batch (its own shard of the global batch: rows ``index * n / count`` to
``(index + 1) * n / count`` of each leaf) and puts it on its own devices as
its part of one global array; the futures that come back are values on the
hosts, which a ``pw.program`` or ``pw.jit`` on those devices takes as input
with no hop through this process. Only the call (a few hundred bytes) goes
from here; no input data does.

The iterator's position is :meth:`HostIterator.get_state`: each host's
iterator's own ``get_state()`` where it has one (Grain's ``DatasetIterator``
does), else the number of batches it gave (restored by making the iterator
anew and skipping as many). It is small and picklable: save it with the
training state, and give it back with :meth:`HostIterator.set_state` (after
a host was lost and its island rebuilt, say: the new host makes its iterator
anew, then takes the saved position).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from pathways_jax._src.api.colocated import _device_list
from pathways_jax._src.api.colocated_class import colocated_python_class
from pathways_jax._src.core import errors


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """Which part of each global batch a host makes: part ``index`` of ``count`` (its rows)."""

    index: int
    count: int


class _Feeder:
    """The object on each host: its iterator, and what it gave (made there from the constructor's arguments)."""

    def __init__(self, make_iterator: Callable[[Shard], Iterator], batch: Any) -> None:
        self.make_iterator = make_iterator
        self.batch = batch  # the global batch's ShapeDtypeStructs (shardings over this host's devices)
        self.shard = _shard_of(jax.tree_util.tree_leaves(batch))
        self.iterator = make_iterator(self.shard)
        self.taken = 0

    def next(self) -> Any:
        local = next(self.iterator)
        self.taken += 1
        specs, tree = jax.tree_util.tree_flatten(self.batch)
        leaves, got = jax.tree_util.tree_flatten(local)
        if got != tree:  # type: ignore[operator]  # jaxlib has no PyTreeDef stubs
            raise ValueError(
                f"the iterator on host {jax.process_index()} gave a batch of structure {got}; the "
                f"HostIterator's batch is {tree}. Yield this host's part of each leaf of batch."
            )
        arrays = [
            jax.make_array_from_process_local_data(spec.sharding, np.asarray(leaf, spec.dtype), spec.shape)
            for spec, leaf in zip(specs, leaves, strict=True)
        ]
        return jax.tree_util.tree_unflatten(tree, arrays)

    def state(self) -> Any:
        get_state = getattr(self.iterator, "get_state", None)
        if callable(get_state):
            return {"iterator": get_state()}
        return {"taken": self.taken}

    def restore(self, saved: jax.Array) -> None:
        states = pickle.loads(np.asarray(saved.addressable_data(0)).tobytes())
        state = states[self.shard.index]
        self.iterator = self.make_iterator(self.shard)
        if "iterator" in state:
            self.iterator.set_state(state["iterator"])  # type: ignore[attr-defined]
            return
        for _ in range(state["taken"]):
            next(self.iterator)
        self.taken = state["taken"]


def _shard_of(specs: list) -> Shard:
    """This process's part of the batch: its rank among the processes owning the batch's devices."""
    processes = sorted({d.process_index for spec in specs for d in spec.sharding.device_set})
    return Shard(processes.index(jax.process_index()), len(processes))


_HostFeeder = colocated_python_class(_Feeder)


class HostIterator:
    """Batches made on the hosts of their devices, by one data iterator per host.

    Args:
      make_iterator: called on each host (it travels pickled) with the
        host's :class:`Shard`; returns an iterator of that host's part of each
        batch: a pytree like ``batch`` of arrays whose first dimension is the
        global one divided by ``shard.count``. A Grain ``DatasetIterator``, a
        generator, any Python iterator.
      batch: the global batch: a pytree of ``jax.ShapeDtypeStruct`` with
        shardings over the devices the batches are for (a slice's
        ``s.sharding("x")``), all on one island.

    Example:
      >>> import jax, numpy as np, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> spec = jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))
      >>> def rows(shard):
      ...     n = 4 // shard.count
      ...     for step in range(100):
      ...         yield np.full((n, 2), step, np.float32)
      >>> batches = pw.colocated_python.HostIterator(rows, spec)
      >>> float(next(batches).sum()), float(next(batches).sum())
      (0.0, 8.0)
      >>> state = batches.get_state()
      >>> float(next(batches).sum())
      16.0
      >>> batches.set_state(state)
      >>> float(next(batches).sum())
      16.0
      >>> s.release()
    """

    def __init__(self, make_iterator: Callable[[Shard], Iterator], batch: Any) -> None:
        if not callable(make_iterator):
            raise TypeError(
                f"HostIterator takes a function making each host's iterator, got {type(make_iterator).__name__}."
            )
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
        self._feeder = _HostFeeder(make_iterator, batch)
        specialized = {"devices": tuple(devices)}
        self._next = self._feeder.next.specialize(out_specs_fn=lambda: batch, **specialized)
        self._state = self._feeder.state.specialize(**specialized)
        self._restore = self._feeder.restore.specialize(**specialized)

    def __iter__(self) -> HostIterator:
        return self

    def __next__(self) -> Any:
        """The next global batch: futures of values on the hosts (at once)."""
        return self._next()

    def get_state(self) -> list:
        """Each host's iterator position, in host order (small, picklable); waits for the calls before it."""
        return self._state.reply()

    def set_state(self, state: list) -> None:
        """Puts each host's iterator where :meth:`get_state` found it; later batches continue from there."""
        if not isinstance(state, list):
            raise errors.SpecializationError(
                f"HostIterator.set_state takes what get_state returned (a list, one entry per host), "
                f"got {type(state).__name__}."
            )
        saved = np.frombuffer(pickle.dumps(state), np.uint8)  # to every host, with the call
        self._restore.reply(jax.device_put(saved, self._replicated))


__all__ = ["HostIterator", "Shard"]
