"""Flax's and orbax's checkpoints take futures: registered with them when a program is traced (``compat.install_checkpoints``).

``flax.serialization`` packs only NumPy and JAX arrays, and orbax picks a type
handler by a leaf's type (and builds restore arguments from a target's), so a
checkpoint of a ``TrainState`` of futures raised. Here a future saves as the
``jax.Array`` it stands for, and in a restore target gives its shape, dtype
and sharding. Flax is imported at the first trace (it is cheap, and a
dependency of the pipelines); orbax only once the user has imported it:
before the first trace, registered then; after it, registered as its import
ends (:class:`_AfterOrbaxImport`), so the order of imports does not matter.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.abc
import logging
import sys
import threading
from typing import Any

import jax
import numpy as np

from pathways_jax._src.core import source
from pathways_jax._src.runtime.futures import Future

_FLAX_TAKES_FUTURES = False


def register() -> None:
    """Lets ``flax.serialization`` (``to_bytes``, ``to_state_dict``, ``msgpack_serialize``) take futures.

    Flax's msgpack packer accepts only ``np.ndarray`` and ``jax.Array``
    leaves: a checkpoint of a ``TrainState`` whose leaves are futures would
    raise. A future's state dict is the array it stands for (it waits for it);
    restoring into a target holding futures gives the restored arrays.
    Called at a program's first trace (once per process): Flax is a dependency,
    and importing ``flax.serialization`` costs about 0.1 s.
    """
    global _FLAX_TAKES_FUTURES
    if not _ORBAX_TAKES_FUTURES:
        if "orbax.checkpoint" in sys.modules:
            _register_with_orbax()
        else:
            _AfterOrbaxImport.install()
    if _FLAX_TAKES_FUTURES:
        return
    _FLAX_TAKES_FUTURES = True
    try:
        with _global_random_state_kept():  # importing Flax draws from Python's `random` (rich's styles)
            from flax import serialization
    except ImportError:  # pragma: no cover - flax is a dependency
        return
    serialization.register_serialization_state(
        Future, lambda future: future.result(), lambda _target, state: state, override=True
    )
    _msgpack_takes_futures(serialization)


def _msgpack_takes_futures(serialization: Any) -> None:
    """``flax.serialization.msgpack_serialize`` packs a future as the array it stands for.

    ``to_bytes`` goes through the state dict (registered above), but
    ``msgpack_serialize`` of a tree of futures raised "can not serialize
    'Future' object": Flax converts and chunks only ``jax.Array`` leaves and
    its packer knows only NumPy and JAX arrays. Its two helpers are looked up
    by name at each call, so wrapping them here also serves a
    ``msgpack_serialize`` imported before this ran.
    """
    pack, convert = (
        getattr(serialization, "_msgpack_ext_pack", None),
        getattr(serialization, "_np_convert_in_place", None),
    )
    if pack is None or convert is None or getattr(pack, "_takes_futures", False):
        return  # pragma: no cover - another Flax; to_bytes still takes futures

    @functools.wraps(pack)
    def msgpack_ext_pack(x: Any) -> Any:
        return pack(_array_of_future(x))

    @functools.wraps(convert)
    def np_convert_in_place(tree: Any) -> Any:
        if isinstance(tree, dict):  # Flax converts a dict's values in place, as here
            for key, value in tree.items():
                if type(value) is Future:
                    tree[key] = value.result()
        return convert(_array_of_future(tree))

    msgpack_ext_pack._takes_futures = True  # type: ignore[attr-defined]
    serialization._msgpack_ext_pack = msgpack_ext_pack
    serialization._np_convert_in_place = np_convert_in_place


class _AfterOrbaxImport(importlib.abc.MetaPathFinder):
    """Registers futures with orbax as soon as ``orbax.checkpoint`` finishes importing.

    Orbax imported after a program's first trace (where :func:`register`
    looks for it) knew no futures: ``StandardCheckpointer().save`` of a state
    of futures raised "Unsupported type". Python has no post-import hook; this
    finder, first on ``sys.meta_path`` until orbax is imported, finds
    ``orbax.checkpoint`` as the other finders do and makes its loader
    register once the module has run. Registering lazily where orbax looks a
    handler up is no alternative: that needs orbax's modules patched, which
    needs them imported. Costs other imports one string comparison; removes
    itself once orbax is in. A failure to register is logged, never raised
    into the user's import.
    """

    _installed: _AfterOrbaxImport | None = None

    @classmethod
    def install(cls) -> None:
        with _HOOK_LOCK:
            if cls._installed is None:
                cls._installed = cls()
                sys.meta_path.insert(0, cls._installed)

    @classmethod
    def remove(cls) -> None:
        with _HOOK_LOCK:
            finder, cls._installed = cls._installed, None
            if finder is not None:
                with contextlib.suppress(ValueError):
                    sys.meta_path.remove(finder)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "orbax.checkpoint":
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:  # pragma: no cover - a loader of the old protocol: the next trace registers
            return spec

        def exec_module(module: Any) -> None:
            run(module)
            _AfterOrbaxImport.remove()
            try:
                _register_with_orbax()
            except Exception as exc:  # the user's import goes on; their saves of futures will say why
                logging.getLogger(__name__).warning(
                    "pathways_jax: registering futures with orbax failed: %r", exc
                )

        try:
            loader.exec_module = exec_module  # this module's own loader (one per module)
        except (AttributeError, TypeError):  # pragma: no cover - a loader that takes no attributes
            return spec
        return spec


_HOOK_LOCK = threading.Lock()


def _register_with_orbax() -> None:
    """Lets orbax-checkpoint's PyTree checkpointers (and Flax's ``checkpoints``) save futures.

    Orbax picks a type handler by the leaf's type and knows none for a future:
    ``PyTreeCheckpointer().save``, ``args.PyTreeSave`` and
    ``flax.training.checkpoints.save_checkpoint`` of a state of futures raised.
    A future is saved as the ``jax.Array`` it stands for (it waits for it) and
    restores as one. Registered at a program's trace once orbax is imported
    (importing it here would cost every process a second).
    """
    global _ORBAX_TAKES_FUTURES
    _ORBAX_TAKES_FUTURES = True
    try:
        from orbax.checkpoint import type_handlers
    except ImportError:  # pragma: no cover - an orbax without its type handlers
        return

    try:  # one handler for jax.Array and futures: the Ray hosts write and read their own shards
        from pathways_jax._src.compat import host_checkpoints

        with _absl_warnings_off():
            host_checkpoints.install(type_handlers)
        hosts_write = True
    except (ImportError, AttributeError) as exc:  # an orbax whose internals differ: saves go through here
        logging.getLogger(__name__).info("pathways_jax: hosts will not write checkpoints: %r", exc)
        hosts_write = False
        _futures_saved_as_arrays(type_handlers)

    # Restore arguments made from a target (flax's restore_checkpoint, orbax_utils.restore_args_from_target)
    # take futures as the arrays they stand for: their shape, dtype and sharding, without waiting.
    try:
        from orbax.checkpoint import checkpoint_utils
    except ImportError:  # pragma: no cover - an orbax without it
        return
    original = checkpoint_utils.construct_restore_args
    if getattr(original, "_takes_futures", False):
        return

    @functools.wraps(original)
    def construct_restore_args(target: Any, *args: Any, **kwargs: Any) -> Any:
        return original(jax.tree_util.tree_map(_abstract_future, target), *args, **kwargs)

    construct_restore_args._takes_futures = True  # type: ignore[attr-defined]
    checkpoint_utils.construct_restore_args = construct_restore_args
    _standard_checkpoints_take_futures(hosts_write)


def _futures_saved_as_arrays(type_handlers: Any) -> None:
    """Registers a handler saving a future as the ``jax.Array`` it stands for (it waits for it, here)."""
    # The handler orbax uses for jax.Array (with its options: the array metadata store),
    # given the arrays the futures stand for.
    arrays_handler = type_handlers.get_type_handler(jax.Array)
    base = type(arrays_handler)

    async def serialize(self: Any, values: Any, infos: Any, args: Any = None) -> Any:
        arrays = [v.result() if isinstance(v, Future) else v for v in values]
        return await base.serialize(self, arrays, infos, args)

    handler = copy.copy(arrays_handler)
    handler.__class__ = type("FutureHandler", (base,), {"serialize": serialize, "__module__": __name__})
    # Orbax warns that the handler's type name is jax.Array's: that is the point (it restores as one).
    with _absl_warnings_off():
        type_handlers.register_type_handler(Future, handler, override=True)


def _standard_checkpoints_take_futures(hosts_write: bool) -> None:
    """``StandardCheckpointer`` saves futures and restores into them.

    Its check of a saved tree turned a future into a NumPy array (through
    ``__array__``, bringing its bytes here), and it refused a future in a
    restore target. Futures now pass its check as they are (``hosts_write``:
    their hosts write them) or as their arrays.
    """
    try:
        from orbax.checkpoint import StandardCheckpointHandler as handler
    except ImportError:  # pragma: no cover - an orbax without it
        return
    validate, restore = getattr(handler, "_validate_save_state", None), getattr(handler, "restore", None)
    if validate is None or restore is None or getattr(restore, "_takes_futures", False):
        return

    @functools.wraps(validate)
    def validate_save_state(self: Any, item: Any, *args: Any, **kwargs: Any) -> Any:
        if not hosts_write:
            return validate(self, jax.tree_util.tree_map(_array_of_future, item), *args, **kwargs)
        # Each future is checked as a one-element array of its dtype and kept as it is.
        checked = validate(self, jax.tree_util.tree_map(_stand_in_of_future, item), *args, **kwargs)
        return jax.tree_util.tree_map(
            lambda leaf, kept: leaf if type(leaf) is Future else kept, item, checked
        )

    @functools.wraps(restore)
    def restore_into(self: Any, directory: Any, item: Any = None, args: Any = None) -> Any:
        if item is not None:
            item = jax.tree_util.tree_map(_abstract_future, item)
        if args is not None and getattr(args, "item", None) is not None:
            args = dataclasses.replace(args, item=jax.tree_util.tree_map(_abstract_future, args.item))
        if hosts_write:  # Orbax reads on a thread of its own: an error there names this line
            from pathways_jax._src.compat import host_checkpoints

            host_checkpoints.RESTORE_CALLER[0] = source.of_caller()
        return restore(self, directory, item, args)

    restore_into._takes_futures = True  # type: ignore[attr-defined]
    handler._validate_save_state = validate_save_state
    handler.restore = restore_into
    if not hosts_write:  # one handler for both types otherwise: nothing races
        _pytree_saves_take_futures()


def _pytree_saves_take_futures() -> None:
    """A PyTree save holds the arrays its futures stand for before orbax sorts leaves by type.

    Orbax serializes each type's leaves with its handler and each handler
    writes the checkpoint's array metadata: a tree holding both futures and
    arrays (a ``TrainState`` whose optimizer state ``optax`` made eagerly) had
    two handlers writing it at once, and about one save in two failed
    ("No ArrayMetadata found", a truncated metadata file).
    """
    try:
        from orbax.checkpoint._src.handlers.base_pytree_checkpoint_handler import (
            BasePyTreeCheckpointHandler as handler,
        )
    except ImportError:  # pragma: no cover - another orbax
        return
    save = handler.async_save
    if getattr(save, "_takes_futures", False):
        return

    @functools.wraps(save)
    async def async_save(self: Any, directory: Any, args: Any) -> Any:
        item = getattr(args, "item", None)
        if item is not None and any(type(leaf) is Future for leaf in jax.tree_util.tree_leaves(item)):
            args = dataclasses.replace(args, item=jax.tree_util.tree_map(_array_of_future, item))
        return await save(self, directory, args)

    async_save._takes_futures = True  # type: ignore[attr-defined]
    handler.async_save = async_save


def _array_of_future(leaf: Any) -> Any:
    return leaf.result() if type(leaf) is Future else leaf


def _stand_in_of_future(leaf: Any) -> Any:
    return (
        np.zeros((), leaf.dtype if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended) else np.uint32)
        if type(leaf) is Future
        else leaf
    )


def _abstract_future(leaf: Any) -> Any:
    if type(leaf) is Future:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


@contextlib.contextmanager
def _global_random_state_kept() -> Any:
    """Python's and NumPy's global random streams as they were, whatever runs inside (an import)."""
    import random

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@contextlib.contextmanager
def _absl_warnings_off() -> Any:
    import logging

    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


_ORBAX_TAKES_FUTURES = False
