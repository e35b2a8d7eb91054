"""Values, shardings and wrappers as ``jax.jit`` gives them, with only the decorator changed.

Each test calls ``jax.jit`` and pathways_jax on the same inputs and compares
results: values, dtypes, types (shardings on Explicit axes) and placements.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)


def _double(v):
    return v * 2


def _assert_same_array(have, want):
    assert (have.shape, have.dtype, have.weak_type) == (want.shape, want.dtype, want.weak_type)
    assert jax.typeof(have) == jax.typeof(want)
    assert have.sharding.is_equivalent_to(want.sharding, want.ndim)
    assert have.committed == want.committed
    np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize(
    "how", ["pw.jit(jax.jit(out_shardings=NamedSharding))", "pw.jit(jax.jit(out_shardings=P))", "program(P)"]
)
def test_out_shardings_on_a_set_explicit_mesh_type_the_outputs_as_jax_jit_does(how):
    # The outputs came back replicated (float32[8], not float32[8@x]): pw.jit did not take a
    # wrapped jax.jit's out_shardings on Explicit axes, and a bare P named no mesh to retype on.
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    x = jnp.arange(8.0)
    # A NamedSharding names its mesh: no mesh need be set.
    with contextlib.nullcontext() if "NamedSharding" in how else jax.set_mesh(mesh):
        if how == "program(P)":
            want = jax.jit(_double, out_shardings=P("x"))(x)
            have = pw.program(_double, out_shardings=P("x"))(x).result()
        else:
            shardings = NamedSharding(mesh, P("x")) if "NamedSharding" in how else P("x")
            want = jax.jit(_double, out_shardings=shardings)(x)
            have = pw.jit(jax.jit(_double, out_shardings=shardings))(x).result()
    assert str(jax.typeof(want)) == "float32[8@x]"
    _assert_same_array(have, want)

