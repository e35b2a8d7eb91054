"""JAX takes futures where it takes a ``jax.Array``: hooks into JAX's private registries and checks.

Written against jax 0.10 (``compat.WRITTEN_FOR``); each hook is looked up where
it is installed, and a JAX without one keeps working (there the user calls
``future.result()``). ``tests/test_compat.py`` checks every hook is in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pathways_jax._src.runtime.array_like import index_values
from pathways_jax._src.runtime.futures import Future

HOOKS: dict[str, bool] = {}  # what install() put in place, by name (read by tests and pw.counters users)


def install() -> bool:
    """Lets ``jax.jit`` and ``jnp`` functions take a future where they take a ``jax.Array``.

    JAX 0.10 no longer calls ``__jax_array__`` when it abstracts an argument
    ("Triggering __jax_array__() during abstractification is no longer
    supported"), so ``jax.jit(g)(future)`` and ``jnp.mean(future)`` need the
    hooks JAX's own array-like types (``PRNGKeyArray``, ``EArray``) use. All
    three are private to JAX:

    - ``jax._src.core.pytype_aval_mappings``: the abstract value tracing sees
      (a future's own ``aval``, known without waiting and equal to its array's,
      weak type and sharding included; for other stand-ins, that of the value);
    - ``jax._src.dtypes.canonicalize_value_handlers``: the concrete value a
      compiled call receives, the ``jax.Array`` itself;
    - ``jax._src.interpreters.pxla.shard_arg_handlers``: for calls that skip
      canonicalization, the same array moved to the argument's sharding.

    The last two wait through :meth:`Future.result` (:func:`take_as_array`). Called once, by
    :func:`compat.install`. A JAX without these hooks keeps working, but then ``jax.jit`` and
    ``jnp`` need ``future.result()``.

    Returns:
      True if the hooks were registered.
    """
    if not take_as_array(Future):
        return False
    HOOKS.update(
        dict.fromkeys(("pytype_aval_mappings", "canonicalize_value_handlers", "shard_arg_handlers"), True)
    )
    _let_jax_checks_take_futures()
    return True


def take_as_array(cls: type) -> bool:
    """Lets ``jax.jit`` and ``jnp`` take an object of ``cls`` where they take its ``result()``'s array.

    For :class:`Future` (:func:`install`) and other stand-ins of a value
    (``pw.elastic.Loss``, whose ``result()`` is the value of whichever run
    completed its step), through the three private registries :func:`install`
    names.

    Returns:
      True if the hooks were registered (False on a JAX without them).
    """
    try:
        from jax._src import core, dtypes
        from jax._src.interpreters import pxla

        avals = core.pytype_aval_mappings
        canonical = dtypes.canonicalize_value_handlers
        shard_args = pxla.shard_args
        handlers = pxla.shard_arg_handlers
    except (ImportError, AttributeError):  # pragma: no cover - another JAX
        return False

    def shard_values(
        values: Sequence[Any], shardings: Sequence[Any], layouts: Sequence[Any], copy_semantics: Sequence[Any]
    ) -> Sequence[Any]:
        return shard_args(shardings, layouts, copy_semantics, [v.result() for v in values])

    try:
        canonical[cls] = cls.result  # type: ignore[attr-defined]  # first: the one that calls into jaxlib
    except TypeError:  # pragma: no cover - another JAX
        return False
    if cls is Future:
        # A future knows its abstract value when the call returns (that of its array, weak type and
        # sharding included): tracing against it (jax.eval_shape, jit's lower and eval_shape,
        # jax.make_jaxpr) waits for nothing, as for a jax.Array still computing.
        avals[cls] = lambda value: value.aval
    else:
        avals[cls] = lambda value: jax.typeof(value.result())
    handlers[cls] = shard_values
    return True


def _let_jax_checks_take_futures() -> None:
    """``jax.random.split(key)``, ``jax.device_get(state)``, ``array[future]`` and ``jnp.split(x, future)`` take futures.

    Each asks ``isinstance(value, jax.Array)`` (a C++ type no other class can
    join) in a private function: every ``jax.random`` function checks its key
    with ``jax._src.random.core._check_prng_key``, which otherwise reads the key
    as raw ``uint32`` key data (a future of ``jax.random.key(0)`` that a program
    returned fails with "invalid PRNG key data"); ``jax.device_get`` asks in
    ``jax._src.api._device_get`` before it copies a key's data, and otherwise
    calls ``__array__``, which a key refuses; ``x[...]`` and ``x.at[...]`` read
    their indices with ``NDIndexer.from_raw_indices``, which refuses other
    array indices; ``jnp.split`` (``array_split``, ``hsplit``, ...) reads its
    indices with ``lax_numpy._split``, which took a future of them for a
    number of sections. Each is wrapped so that it sees the future's array. Another
    JAX without them keeps working; there these need ``future.result()``.
    """
    try:
        from jax._src import api
        from jax._src.numpy import indexing
        from jax._src.random import core as random_core
    except ImportError:  # pragma: no cover - another JAX
        return
    _see_futures(random_core, "_check_prng_key", 1, _value_of)
    _see_futures(api, "_device_get", 0, _value_of)
    _see_futures(getattr(indexing, "NDIndexer", None), "from_raw_indices", 1, index_values)  # after cls
    try:
        from jax._src.numpy import lax_numpy
    except ImportError:  # pragma: no cover - another JAX
        return
    _see_futures(lax_numpy, "_split", 2, _value_of)


def _value_of(value: Any) -> Any:
    return value.result() if type(value) is Future else value


def _see_futures(owner: Any, name: str, position: int, convert: Callable[[Any], Any]) -> None:
    """Wraps function (or classmethod) ``owner.name`` so that its argument ``position`` passes through ``convert``."""
    raw: Any = vars(owner).get(name) if owner is not None else None
    method = isinstance(raw, classmethod)
    original = raw.__func__ if method else raw
    if not callable(original) or getattr(original, "_takes_futures", False):
        HOOKS.setdefault(name, callable(original))
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if len(args) > position:
            args = (*args[:position], convert(args[position]), *args[position + 1 :])
        return original(*args, **kwargs)

    wrapper._takes_futures = True  # type: ignore[attr-defined]
    setattr(owner, name, classmethod(wrapper) if method else wrapper)
    HOOKS[name] = True
