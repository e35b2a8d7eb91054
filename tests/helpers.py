"""Shared test helpers: comparing program results with plain jax.jit."""

import jax
import numpy as np


def assert_matches(got, want, rtol=1e-6, atol=1e-6):
    """Compares a pytree of futures/arrays with a pytree of reference arrays."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"structure {got_tree} != {want_tree}"
    for g, w in zip(got_leaves, want_leaves, strict=True):
        value = g.result(timeout=120) if hasattr(g, "result") else g
        assert value.shape == w.shape, f"shape {value.shape} != {w.shape}"
        assert value.dtype == w.dtype, f"dtype {value.dtype} != {w.dtype}"
        np.testing.assert_allclose(np.asarray(value), np.asarray(w), rtol=rtol, atol=atol)
