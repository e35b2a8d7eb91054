"""``jax.clear_caches()`` clears what programs traced and compiled too, as it clears ``jax.jit``'s.

A user calls ``jax.clear_caches()`` to free compiled executables, or to have
functions traced again after changing a global they read; under ``jax.jit``
the next call traces and compiles anew. Programs keep their own graphs and
plans, and clusters their shared executables, so :func:`install` registers
them with JAX's cache registry (``jax._src.util.register_cache``), which
``jax.clear_caches`` clears. Written against jax 0.10.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

from pathways_jax._src.runtime import clusters, context


class _Clearable(Protocol):
    def clear_cache(self) -> None: ...


class ProgramCaches:
    """Every live program's caches, as one entry of JAX's cache registry (``cache_clear`` clears them all)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: weakref.WeakSet[_Clearable] = weakref.WeakSet()

    def add(self, holder: _Clearable) -> None:
        """Clears ``holder.clear_cache()`` at each ``jax.clear_caches()`` while it lives."""
        with self._lock:
            self._holders.add(holder)

    def cache_clear(self) -> None:
        if context.exiting:  # JAX's own exit hook clears its caches: the process ends, nothing to free
            return
        with self._lock:
            holders = list(self._holders)
        for holder in holders:
            holder.clear_cache()
        cluster = clusters.running()
        if cluster is not None:
            cluster.executables.clear()

    def cache_info(self) -> str:
        with self._lock:
            return f"pathways_jax: {len(self._holders)} live programs"

    def cache_keys(self) -> list[Any]:
        return []


PROGRAMS = ProgramCaches()


def install() -> bool:
    """Registers :data:`PROGRAMS` with JAX's caches (once); True if JAX has the registry."""
    try:
        from jax._src import util
    except ImportError:  # pragma: no cover - another JAX: jax.clear_caches() leaves programs alone
        return False
    register = getattr(util, "register_cache", None)
    caches = getattr(util, "_caches", None)
    if register is None:  # pragma: no cover - another JAX
        return False
    if caches is None or PROGRAMS not in caches:
        register(PROGRAMS, "pathways_jax programs (graphs, plans, executables)")
    return True


__all__ = ["PROGRAMS", "ProgramCaches", "install"]
