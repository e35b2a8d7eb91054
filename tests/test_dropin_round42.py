"""JAX/Flax/Optax code with ``jax.jit`` swapped for ``pw.program``, compared with plain JAX."""

import jax
import jax.numpy as jnp
import numpy as np

import pathways_jax as pw


def _train_step(params):
    return {"w": params["w"] * 2, "layers": [params["layers"][0] + 1], "n": params["n"] + 1}


def test_flax_msgpack_serialize_takes_futures_as_their_arrays():
    # Flax's low-level msgpack_serialize (to_bytes without a state dict) raised
    # "can not serialize 'Future' object" on a tree of futures; jax.Arrays it packs.
    from flax import serialization
    from flax.serialization import msgpack_serialize  # bound before the first program call

    params = {"w": jnp.arange(3.0), "layers": [jnp.ones((2, 2))], "n": jnp.int32(0)}
    ours, theirs = pw.program(_train_step)(params), jax.jit(_train_step)(params)
    want = serialization.msgpack_serialize(theirs)
    assert serialization.msgpack_serialize(ours) == want
    assert msgpack_serialize(ours) == want
    assert serialization.msgpack_serialize({"step": ours["n"]}, in_place=True) == (
        serialization.msgpack_serialize({"step": theirs["n"]})
    )
    np.testing.assert_array_equal(serialization.msgpack_restore(want)["layers"][0], np.full((2, 2), 2.0))
