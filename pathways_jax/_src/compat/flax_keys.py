"""Flax takes a future of a PRNG key wherever it takes a key.

JAX's ``jax.random`` functions take a future of a key (``jax_futures``), but
Flax checks a key with ``isinstance(key, jax.Array)`` before it uses one, so a
key a program returned (a ``TrainState``'s key, ``key, sub = split(key)``)
was refused where its array is taken: ``nnx.Rngs(key)`` and
``nnx.Rngs(dropout=key)`` raised "Invalid rng value", ``nnx.Dropout`` called
with ``rngs=key`` a ``TypeError``, and Linen's ``init(key, x)`` /
``apply(..., rngs={"dropout": key})`` "The ``rngs`` argument ... should be a
``jax.PRNGKey``". NNX now takes the array the future stands for (it stores
the key in a Variable); Linen checks that array and uses the future as the key.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from pathways_jax._src.runtime.futures import Future


def install() -> None:
    """Wraps Flax's key checks (once each), for the parts of Flax imported by now."""
    _linen_takes_futures()
    _nnx_takes_futures()


def _array_of(value: Any) -> Any:
    return value.result() if type(value) is Future else value


def _linen_takes_futures() -> None:
    scope = sys.modules.get("flax.core.scope")
    is_valid_rng = getattr(scope, "_is_valid_rng", None)
    if is_valid_rng is None or getattr(is_valid_rng, "_takes_futures", False):
        return

    @functools.wraps(is_valid_rng)
    def is_valid_rng_or_future(rng: Any) -> bool:
        return bool(is_valid_rng(_array_of(rng)))

    is_valid_rng_or_future._takes_futures = True  # type: ignore[attr-defined]
    scope._is_valid_rng = is_valid_rng_or_future  # type: ignore[union-attr]


def _nnx_takes_futures() -> None:
    def stream_of_a_future(init: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(init)
        def wrapped(self: Any, key: Any, *args: Any, **kwargs: Any) -> None:
            init(self, _array_of(key), *args, **kwargs)

        return wrapped

    def dropout_with_a_future(call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if "rngs" in kwargs:
                kwargs["rngs"] = _array_of(kwargs["rngs"])
            return call(self, *args, **kwargs)

        return wrapped

    _wrap("flax.nnx.rnglib", "RngStream", "__init__", stream_of_a_future)
    _wrap("flax.nnx.nn.stochastic", "Dropout", "__call__", dropout_with_a_future)


def _wrap(module: str, cls_name: str, method: str, wrapper: Callable[[Any], Any]) -> None:
    """Replaces ``method`` of class ``cls_name`` of ``module`` (if imported) by ``wrapper(method)``, once."""
    cls = getattr(sys.modules.get(module), cls_name, None)
    original: Any = None if cls is None else vars(cls).get(method)
    if original is None or getattr(original, "_takes_futures", False):
        return
    wrapped = wrapper(original)
    wrapped._takes_futures = True
    setattr(cls, method, wrapped)
