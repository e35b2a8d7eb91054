"""The controller service's CPU per program: what a client does with a value it fetches."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_jax._src.backends.ray_values import RemoteArray


class _Holder:
    """What a RemoteArray asks of its backend: here, a value every host has computed."""

    layout = None
    closed = False

    def __init__(self, value: np.ndarray) -> None:
        self.generations = [0]
        self.lost: dict = {}
        self.value = value
        self.fetched = 0

    def outcome(self, host, done, generation):
        return None

    def fetch(self, hosts, key, generation):
        self.fetched += 1
        return self.value

    def drop(self, host, key):
        pass


@pytest.mark.parametrize(
    "value, weak",
    [(np.arange(8, dtype=np.float32).reshape(2, 4), False), (np.asarray(2.5, np.float32), True)],
    ids=["array", "weak-scalar"],
)
def test_a_fetched_value_is_made_on_the_stand_ins_without_jax_device_put(monkeypatch, value, weak):
    """A fetched value becomes the client's jax.Array through JAX's own call for host data: the
    Python path of jax.device_put around that call was two thirds of a fetch's CPU."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    sharding = NamedSharding(mesh, P())
    aval = jax.core.ShapedArray(value.shape, value.dtype, weak_type=weak)
    holder = _Holder(value)
    remote = RemoteArray(holder, (0,), 7, aval, sharding, (), 0)
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or real(*a, **k))
    got = remote.fetch()
    assert calls == []
    assert got.shape == value.shape and got.dtype == value.dtype
    assert got.sharding == sharding
    assert got.aval.weak_type == weak  # as the host's array was (jax.jit(lambda v: v * 1.0)(2.5) is weak)
    np.testing.assert_array_equal(np.asarray(got), value)
    # The same as jax.device_put would have made.
    assert got.sharding == real(value, sharding).sharding
    assert remote.fetch() is got and holder.fetched == 1  # read once
