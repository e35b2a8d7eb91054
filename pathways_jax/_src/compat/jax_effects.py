"""``jax.effects_barrier()`` waits for the programs submitted so far, then for what JAX dispatched.

JAX's barrier knows the computations JAX dispatched, not the runs still
queued for the controller (whose host callbacks have not run yet) nor those
the controller dispatched: ``jax.effects_barrier`` is wrapped to wait for
them first (``clusters.wait_for_programs``). Written against jax 0.10.
"""

from __future__ import annotations

import functools

import jax

from pathways_jax._src.runtime import clusters


def install() -> bool:
    """Wraps ``jax.effects_barrier`` (once); True once it is wrapped."""
    original = jax.effects_barrier
    if getattr(original, "_waits_for_programs", False):
        return True

    @functools.wraps(original)
    def effects_barrier() -> None:
        clusters.wait_for_programs()
        original()

    effects_barrier._waits_for_programs = True  # type: ignore[attr-defined]
    jax.effects_barrier = effects_barrier
    return True
