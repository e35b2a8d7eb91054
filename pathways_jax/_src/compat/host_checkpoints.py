"""Orbax checkpoints whose bytes the Ray hosts write and read themselves; the controller holds none.

Orbax picks a ``TypeHandler`` per leaf type. :func:`install` gives it one
handler, for ``jax.Array`` and for futures alike (one handler, so that a tree
mixing both writes its metadata once), made from the ``jax.Array`` handler
Orbax had (its options kept):

- **Save.** Futures whose values live on Ray hosts are written by those
  hosts, each its own shards (replica 0), in Orbax's own layout: the
  controller computes each array's TensorStore spec (with a per-host OCDBT
  subdirectory, ``ocdbt.process_pwhost<h>``, which Orbax merges when it
  finalizes the checkpoint, as it merges its processes' in multi-host JAX)
  and sends it in a small message. ``StandardSave`` returns once each host
  has copied its values on its devices, in its order of messages (a later
  step may then donate them); the writes go on while training does, and
  Orbax's commit waits for them. Other leaves (arrays here, futures of the
  local backend) are written from this process with the same code.
- **Restore.** An array whose target sharding lies on a Ray cluster's
  devices (``pw.devices``' stand-ins) is read by the hosts of that sharding,
  each reading the parts of the checkpoint its devices hold under the
  target sharding, whatever sharding it was saved with: another mesh, fewer
  islands. It comes back as a future at once; the first program that takes
  it waits for the read on its hosts, not here. Other targets restore as
  Orbax restores them.

Without a Ray cluster (or with a client of a controller service, whose
hosts are the service's), nothing changes: the handler is Orbax's.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections import defaultdict
from typing import Any, NamedTuple

import jax
import numpy as np

from pathways_jax._src.backends.base import HostWrites
from pathways_jax._src.backends.ray_host import checkpoint as host_checkpoint
from pathways_jax._src.core import errors, source
from pathways_jax._src.runtime import clients, clusters, futures
from pathways_jax._src.runtime.futures import Future
from pathways_jax._src.runtime.object_store import Owner

# Where the user's restore was called (set by compat.checkpoints' patch of StandardCheckpointHandler.restore,
# on the caller's thread): Orbax reads on a thread of its own, whose stack holds no line of the user's.
RESTORE_CALLER = ["<unknown>"]
_DISPATCH_TIMEOUT_S = 600.0  # a saved future's run is sent to its hosts within this
_restored = itertools.count()


def install(type_handlers: Any) -> None:
    """Registers the handler for ``jax.Array`` and futures with Orbax (replacing the ``jax.Array`` one's class)."""
    # What a save and a restore use of Orbax's internals: an Orbax without them keeps its own handler.
    from orbax.checkpoint._src.futures import future  # noqa: F401
    from orbax.checkpoint._src.metadata import array_metadata  # noqa: F401
    from orbax.checkpoint._src.serialization import jax_array_handlers, ocdbt_utils, tensorstore_utils

    _ = (  # AttributeError where one is missing
        jax_array_handlers._async_serialize_shardings,
        ocdbt_utils.get_process_index_for_subdir,
        tensorstore_utils.build_array_write_spec,
        tensorstore_utils.build_array_read_spec,
    )
    arrays_handler = type_handlers.get_type_handler(jax.Array)
    if getattr(arrays_handler, "_pathways_hosts", False):
        return
    handler = copy.copy(arrays_handler)
    handler.__class__ = _handler_class(type(arrays_handler))
    type_handlers.register_type_handler(jax.Array, handler, override=True)
    type_handlers.register_type_handler(Future, handler, override=True)


def _handler_class(base: Any) -> type:
    """Orbax's ``ArrayHandler`` class ``base``, with saves and restores on Ray hosts."""

    async def serialize(self: Any, values: Any, infos: Any, args: Any = None) -> Any:
        backend = _host_backend()
        held = [_held(value, backend) for value in values] if backend is not None else []
        if backend is None or not any(array is not None for array in held):
            return await base.serialize(self, [_here(value) for value in values], infos, args)
        return _save_on_hosts(self, backend, values, held, infos, args)

    async def deserialize(self: Any, infos: Any, args: Any = None) -> Any:
        backend = _host_backend()
        if backend is None or args is None:
            return await base.deserialize(self, infos, args)
        placed = [backend.where(_target_sharding(arg)) for arg in args]
        on_hosts = [i for i, where in enumerate(placed) if where is not None]
        if not on_hosts:
            return await base.deserialize(self, infos, args)
        here = [i for i, where in enumerate(placed) if where is None]
        results: list[Any] = [None] * len(infos)
        if here:
            for i, value in zip(
                here,
                await base.deserialize(self, [infos[i] for i in here], [args[i] for i in here]),
                strict=True,
            ):
                results[i] = value
        restored = await _restore_on_hosts(
            self,
            backend,
            [infos[i] for i in on_hosts],
            [args[i] for i in on_hosts],
            [placed[i] for i in on_hosts],
        )
        for i, value in zip(on_hosts, restored, strict=True):
            results[i] = value
        return results

    return type(
        "HostArrayHandler",
        (base,),
        {"serialize": serialize, "deserialize": deserialize, "_pathways_hosts": True, "__module__": __name__},
    )


def _host_backend() -> HostWrites | None:
    """The current cluster's backend if its hosts write checkpoints themselves, else None."""
    cluster = clusters.running()
    backend = getattr(cluster, "backend", None)
    return backend if isinstance(backend, HostWrites) else None


def _held(value: Any, backend: HostWrites) -> Any:
    """The handle of a future's value on ``backend``'s hosts (once its run was sent), else None."""
    if type(value) is not Future:
        return None
    array = futures.sent(value, _DISPATCH_TIMEOUT_S, "saving a checkpoint")
    return array if backend.holds(array) else None


def _here(value: Any) -> Any:
    return value.result() if type(value) is Future else value


def _physical(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], Any, str | None]:
    """The shape and dtype a value is stored with, and its key implementation if it is typed keys."""
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return shape, dtype, None
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
    return tuple(data.shape), data.dtype, _impl_name(dtype)


def _impl_name(dtype: Any) -> str:
    return str(jax.random.key_impl(jax.random.key(0, impl=dtype._impl)))


def _save_on_hosts(self: Any, backend: HostWrites, values: Any, held: list, infos: Any, args: Any) -> list:
    """Sends each host its part of the save (they copy the values), writes the leaves that are here,
    and returns Orbax's commit future, which has the hosts write and the metadata written."""
    from orbax.checkpoint._src.futures import future
    from orbax.checkpoint._src.serialization import jax_array_handlers, types

    args = args or [types.SaveArgs()] * len(values)
    ocdbt = bool(infos[0].is_ocdbt_checkpoint)
    writes: dict[int, list[host_checkpoint.Write]] = defaultdict(list)
    generations: dict[int, int] = {}
    local_writes: list[host_checkpoint.Write] = []
    local_values: dict[int, Any] = {}
    metadatas, shardings = [], []
    for index, (value, array, info, arg) in enumerate(zip(values, held, infos, args, strict=True)):
        if array is None:
            value = _here(value)
            if not isinstance(value, jax.Array):
                value = jax.numpy.asarray(value)
            sharding, shape, dtype = value.sharding, tuple(value.shape), value.dtype
        else:
            sharding, shape, dtype = array.sharding, tuple(array.aval.shape), array.aval.dtype
        shape, dtype, impl = _physical(shape, dtype)
        layout = _Layout(
            info, arg, shape, tuple(sharding.shard_shape(shape)), dtype, impl, ocdbt, self._metadata_key
        )
        shardings.append(sharding)
        if array is None:
            write_spec = layout.spec("pwcontroller")
            local_values[index] = value
            local_writes.append(host_checkpoint.Write(index, write_spec.json, True, impl is not None))
        else:
            for position, host in enumerate(array.hosts):
                write_spec = layout.spec(f"pwhost{host}")
                writes[host].append(
                    host_checkpoint.Write(array.key, write_spec.json, position == 0, impl is not None)
                )
                generations[host] = array.generation
        metadatas.append(write_spec.metadata)

    stash = backend.checkpoints.stash(dict(writes), generations, ocdbt)
    local = host_checkpoint.stash(local_values.__getitem__, local_writes, ocdbt) if local_writes else None

    async def commit() -> None:
        storing = False  # once the hosts are told to write, each drops its copies itself
        try:
            for info in infos:
                await info.await_path_creation()
            storing = True
            pending: list[Any] = [asyncio.to_thread(backend.checkpoints.store, stash)]
            if local is not None:
                pending.append(asyncio.wrap_future(_LOCAL_WRITER.store(local)))
            if self._enable_write_sharding_file:
                pending.append(
                    jax_array_handlers._async_serialize_shardings(
                        shardings=shardings, infos=infos, primary_host=self._primary_host
                    )
                )
            if self._array_metadata_store is not None:
                pending.append(
                    self._array_metadata_store.write(
                        checkpoint_dir=infos[0].parent_dir, array_metadatas=metadatas, process_index=0
                    )
                )
            await asyncio.gather(*pending)
        except BaseException:
            if not storing:
                backend.checkpoints.drop(stash)
            raise

    return [future.CommitFutureAwaitingContractedSignals(commit(), name="pathways_host_checkpoint")]


_LOCAL_WRITER = host_checkpoint.Worker("pathways-ckpt-write")


class _Layout(NamedTuple):
    """How one array is stored: what Orbax's TensorStore write spec of each writer is made of."""

    info: Any  # orbax ParamInfo
    arg: Any  # orbax SaveArgs
    shape: tuple[int, ...]  # stored (a typed key's raw data's)
    chunk: tuple[int, ...]  # one shard's
    dtype: Any
    key_impl: str | None
    ocdbt: bool
    metadata_key: str | None

    def spec(self, writer: str) -> Any:
        """Orbax's write spec (``.json``, ``.metadata``) for ``writer``'s shards (its own OCDBT subdirectory)."""
        from orbax.checkpoint._src.metadata import array_metadata
        from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils

        return tensorstore_utils.build_array_write_spec(
            info=self.info,
            arg=self.arg,
            global_shape=self.shape,
            local_shape=self.chunk,
            dtype=self.dtype,
            use_ocdbt=self.ocdbt,
            process_index=ocdbt_utils.get_process_index_for_subdir(
                self.ocdbt, override_ocdbt_process_id=writer
            ),
            metadata_key=self.metadata_key,
            ext_metadata=None if self.key_impl is None else {array_metadata.RANDOM_KEY_IMPL: self.key_impl},
        )


def _target_sharding(arg: Any) -> Any:
    sharding = getattr(arg, "sharding", None)
    if (
        sharding is None
        and getattr(arg, "mesh", None) is not None
        and getattr(arg, "mesh_axes", None) is not None
    ):
        return jax.sharding.NamedSharding(arg.mesh, arg.mesh_axes)
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        to_jax = getattr(sharding, "to_jax_sharding", None)  # Orbax's ShardingMetadata
        return to_jax() if to_jax is not None else None
    return sharding


async def _restore_on_hosts(self: Any, backend: HostWrites, infos: list, args: list, placed: list) -> list:
    """Futures of the values ``infos`` names, each read by the hosts of its target sharding."""
    from orbax.checkpoint._src.metadata import array_metadata as array_metadata_lib
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    await asyncio.gather(*[info.await_path_creation() for info in infos])
    stored_impls: dict[str, str] = {}
    if self._array_metadata_store is not None:
        found = await self._array_metadata_store.read(checkpoint_dir=infos[0].parent_dir)
        if found:
            for meta in found if isinstance(found, list) else [m for ms in found.values() for m in ms]:
                impl = (meta.ext_metadata or {}).get(array_metadata_lib.RANDOM_KEY_IMPL)
                if impl:
                    stored_impls[meta.param_name] = impl
    metadatas = await self.metadata(infos)  # small files: each array's stored shape and dtype
    groups: dict[tuple, list] = defaultdict(list)
    for index, (info, arg, where, meta) in enumerate(zip(infos, args, placed, metadatas, strict=True)):
        sharding = _target_sharding(arg)
        given = getattr(arg, "global_shape", None)
        shape = tuple(given) if given is not None else tuple(meta.shape)  # the metadata's: the stored shape
        dtype = arg.dtype if getattr(arg, "dtype", None) is not None else meta.dtype
        logical_shape, logical_dtype = _logical(shape, dtype, given is not None, stored_impls.get(info.name))
        shape, dtype, impl = _physical(logical_shape, logical_dtype)
        if tuple(meta.shape) != shape:
            raise errors.PlacementError(
                f"restoring {info.name!r} (at {_caller()}): the checkpoint holds shape "
                f"{tuple(meta.shape)}, the target asks for {shape}"
                + (" (a typed key's raw data)" if impl is not None else "")
                + ". Give the target the saved shape (ocp.utils.to_shape_dtype_struct of the saved state)."
            )
        read_spec = ts_utils.build_array_read_spec(
            info,
            use_ocdbt=bool(info.is_ocdbt_checkpoint),
            metadata_key=self._metadata_key,
            raise_array_data_missing_error=info.raise_array_data_missing_error,
            target_dtype=None if impl is not None else dtype,
        )
        read = host_checkpoint.Read(0, read_spec.json, shape, np.dtype(dtype).name, where.desc, impl)
        aval = jax.core.ShapedArray(logical_shape, logical_dtype)
        groups[(where.island, where.hosts)].append((index, (read, aval, sharding)))
    results: list[Any] = [None] * len(infos)
    for (island, hosts), members in groups.items():
        arrays = backend.checkpoints.load(island, hosts, [item for _, item in members])
        for (index, _), array in zip(members, arrays, strict=True):
            results[index] = _future_of(array, infos[index].name)
    return results


def _logical(shape: tuple, dtype: Any, shape_given: bool, stored_impl: str | None) -> tuple[tuple, Any]:
    """The shape and dtype a restored value has: typed keys where the target asks for them, or where
    they were saved as keys and the target names their raw data (whose trailing dimensions go)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        logical_dtype = dtype
        if shape_given:  # the target's own (logical) shape
            return shape, dtype
    elif stored_impl is not None:
        logical_dtype = jax.random.key(0, impl=stored_impl).dtype
    else:
        return shape, dtype
    trailing = len(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), logical_dtype)).shape)
    return shape[: len(shape) - trailing], logical_dtype


def _caller() -> str:
    here = source.of_caller()
    return RESTORE_CALLER[0] if here.startswith(("<unknown>", "events.py", "threading.py")) else here


def _future_of(array: Any, name: str) -> Future:
    """A future of this process for a value a restore put on the hosts."""
    client = clients.current()
    owner = Owner(client.name, -1 - next(_restored), client.key)
    return futures.adopted(clusters.cluster().store, owner, array, f"{name!r} restored from a checkpoint")
