"""RNG streams of a step: checked once on the host, one derived key per stage and microbatch.

A step's ``rngs`` is a Flax-style mapping from stream name to key (``{"dropout": key}``), or
an ``nnx.Rngs``, from whose every stream one key is drawn per call (as a module holding it
would draw, advancing its count, so the same ``nnx.Rngs`` gives every step new keys).
Stage ``s`` on microbatch ``m`` gets, for every stream, ``fold_in(fold_in(key, s), m)``
(see :func:`derive_rngs`). The keys travel into the stage nodes as raw ``uint32`` key data
and are wrapped back into typed keys inside the node, on the stage's slice.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pathways_jax as pw

Rngs = Mapping[str, Any] | nnx.Rngs  # a call's rngs: stream name to key, or an nnx.Rngs


@dataclasses.dataclass(frozen=True, slots=True)
class Mode:
    """What a step's stage nodes are built for: the ``train`` flag (and ``train_kw``) and the RNG streams.

    ``streams`` holds ``(name, key implementation)`` pairs in name order; empty when the
    step has no ``rngs`` (then the nodes take no key argument at all).
    """

    train: bool | None = None
    streams: tuple[tuple[str, str], ...] = ()
    train_kw: str | None = None  # the keyword the user named for the flag (see as_stage)

    @property
    def keyed(self) -> bool:
        return bool(self.streams)

    def wrap(self, data: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Raw key data (inside a node) back to typed keys, one per stream."""
        return {name: jax.random.wrap_key_data(data[name], impl=impl) for name, impl in self.streams}


def derive_rngs(rngs: Rngs, stage: int, microbatch: int) -> dict[str, jax.Array]:
    """The keys stage ``stage`` gets on microbatch ``microbatch``: ``fold_in(fold_in(key, stage), microbatch)``.

    A pipelined step with ``rngs={"dropout": key}`` runs stage ``s`` on microbatch ``m``
    with ``derive_rngs(rngs, s, m)``; use it to compute the same step without the pipeline.
    :class:`DataParallel` gives shard ``i`` the keys ``derive_rngs(rngs, 0, i)``.

    Args:
      rngs: stream name to key (a typed key from ``jax.random.key`` or a raw
        ``jax.random.PRNGKey``), or an ``nnx.Rngs``: then the keys a call given it draws
        next (``fold_in(stream.key, stream.count)``, as ``rngs.dropout()`` would), without
        drawing them, so call it before the step.
      stage: the stage's index, first stage 0.
      microbatch: the microbatch's index within the step.

    Returns:
      Stream name to derived key, of the same kind (typed or raw) as given.

    Example:
      >>> import jax
      >>> from pathways_jax.pipeline import derive_rngs
      >>> keys = derive_rngs({"dropout": jax.random.key(0)}, 1, 2)
      >>> bool((jax.random.key_data(keys["dropout"]) == jax.random.key_data(
      ...     jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 1), 2))).all())
      True
    """
    if isinstance(rngs, nnx.Rngs):  # the keys drawn next, left undrawn
        rngs = {name: jax.random.fold_in(stream.key[...], stream.count[...]) for name, stream in rngs.items()}
    return {
        name: jax.random.fold_in(jax.random.fold_in(key, stage), microbatch) for name, key in rngs.items()
    }


def drawn(rngs: Any) -> Any:
    """An ``nnx.Rngs`` (or ``nnx.RngStream`` values) as stream name to key: one key drawn from each.

    Drawing advances the stream's count as ``rngs.dropout()`` does in a module, so passing the
    same ``nnx.Rngs`` to every step gives every step new keys; stage ``s`` on microbatch ``m``
    then gets :func:`derive_rngs` of the drawn keys.
    """
    if isinstance(rngs, nnx.Rngs):
        return {name: stream() for name, stream in rngs.items()}
    if isinstance(rngs, Mapping) and any(isinstance(key, nnx.RngStream) for key in rngs.values()):
        return {name: key() if isinstance(key, nnx.RngStream) else key for name, key in rngs.items()}
    return rngs


def check_rngs(rngs: Any, what: str) -> dict[str, jax.Array] | None:
    """``rngs`` as typed keys by stream name (sorted), or ``None``; raises on anything else.

    An ``nnx.Rngs`` gives one key drawn from each of its streams (see :func:`drawn`).
    """
    if rngs is None:
        return None
    rngs = drawn(rngs)
    if not isinstance(rngs, Mapping) or not rngs:
        raise pw.errors.ProgramTraceError(
            f"{what}: rngs must be a non-empty mapping from stream name to key, such as "
            f"rngs={{'dropout': jax.random.key(0)}}, or an nnx.Rngs (rngs=nnx.Rngs(dropout=0)), got {type(rngs).__name__}: {rngs!r:.80}."
        )
    typed = {}
    for name in sorted(rngs):
        key = rngs[name]
        if not isinstance(name, str):
            raise pw.errors.ProgramTraceError(
                f"{what}: rngs stream names must be strings (like 'dropout'), got {name!r}."
            )
        dtype = getattr(key, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            if getattr(key, "shape", None) != ():
                raise pw.errors.ProgramTraceError(
                    f"{what}: rngs[{name!r}] holds {key.shape} keys; expected one key, "
                    "e.g. jax.random.key(0)."
                )
            typed[name] = key
            continue
        try:
            typed[name] = jax.random.wrap_key_data(jnp.asarray(key, dtype=jnp.uint32))
        except Exception as exc:
            raise pw.errors.ProgramTraceError(
                f"{what}: rngs[{name!r}] is {type(key).__name__} {getattr(key, 'shape', '')}; expected "
                "a key from jax.random.key(seed) or jax.random.PRNGKey(seed)."
            ) from exc
    return typed


def mode_of(
    rngs: Mapping[str, jax.Array] | None, train: bool | None, what: str, train_kw: str | None = None
) -> Mode:
    if train is not None and not isinstance(train, bool):
        raise pw.errors.ProgramTraceError(
            f"{what}: train must be True, False or None, got {type(train).__name__} {train!r}."
        )
    streams = (
        () if rngs is None else tuple((name, str(jax.random.key_impl(key))) for name, key in rngs.items())
    )
    return Mode(train=train, streams=streams, train_kw=train_kw)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _grid(key: jax.Array, stages: int, microbatches: int) -> jax.Array:
    def one(s: jax.Array, m: jax.Array) -> jax.Array:
        return jax.random.key_data(jax.random.fold_in(jax.random.fold_in(key, s), m))

    return jax.vmap(lambda s: jax.vmap(lambda m: one(s, m))(jnp.arange(microbatches)))(jnp.arange(stages))


def key_grid(rngs: Mapping[str, jax.Array] | None, stages: int, microbatches: int) -> tuple | None:
    """Raw key data of :func:`derive_rngs` for every stage and microbatch: ``[s][m][stream]``."""
    if rngs is None:
        return None
    data = {name: np.asarray(_grid(key, stages, microbatches)) for name, key in rngs.items()}
    return tuple(
        tuple({name: grid[s, m] for name, grid in data.items()} for m in range(microbatches))
        for s in range(stages)
    )
