"""Compat: every patch of JAX, Flax or Orbax, in one place, installed explicitly.

Futures stand where ``jax.Array`` s do, and JAX, Flax and Orbax ask for
arrays in private places: ``jax_futures`` hooks JAX's registries of array-like
types and wraps three of its private checks, and ``jax_effects`` makes
``jax.effects_barrier`` wait for queued programs, and ``jax_caches`` has
``jax.clear_caches()`` clear programs' graphs, plans and executables (all three
:func:`install`, when ``pathways_jax._src.api`` is imported: before any program); ``checkpoints`` registers futures with Flax's
serialization and Orbax's type handlers (:func:`install_checkpoints`, at a
program's first trace, or as Orbax finishes importing); ``flax_keys`` lets Flax
take a future of a key, and ``nnx_variables`` a Flax Variable holding a future
take an indexed write (:func:`install_flax`, at each trace, for the parts of
Flax imported by then). Each was written for
the versions in ``WRITTEN_FOR``; ``tests/test_compat.py`` checks that those
are the ones installed and that every patch is in place, so an upgrade is
reviewed, not discovered. May import: ``runtime`` and the layers below.

Modules: ``jax_futures`` (JAX takes futures); ``jax_effects`` (``jax.effects_barrier``);
``jax_caches`` (``jax.clear_caches``);
``checkpoints`` (Flax and Orbax take futures); ``flax_keys`` (Flax takes futures of keys); ``nnx_variables`` (NNX Variables holding futures);
``host_checkpoints`` (Orbax's handler for arrays and futures: Ray hosts write and read their own shards).
"""

from __future__ import annotations

# The (major, minor) versions the patches were written and tested against.
WRITTEN_FOR = {"jax": (0, 10), "flax": (0, 12), "orbax-checkpoint": (0, 12)}


def install() -> bool:
    """Lets ``jax.jit``, ``jnp`` and JAX's checks take futures, JAX's barrier wait for programs and its cache clearing clear them (once).

    True if JAX has the hooks futures need.
    """
    from pathways_jax._src.compat import jax_caches, jax_effects, jax_futures

    if not jax_futures.HOOKS:
        jax_futures.install()
    jax_effects.install()
    jax_caches.install()
    return bool(jax_futures.HOOKS)


def install_checkpoints() -> None:
    """Lets Flax's serialization and Orbax's checkpointers take futures (once; Orbax when it is imported)."""
    from pathways_jax._src.compat import checkpoints

    checkpoints.register()


def install_flax() -> None:
    """Lets Flax take futures of keys and NNX Variables holding futures take writes (the parts imported)."""
    from pathways_jax._src.compat import flax_keys, nnx_variables

    flax_keys.install()
    nnx_variables.install()


__all__ = ["WRITTEN_FOR", "install", "install_checkpoints", "install_flax"]
