"""Constants stay constants: results bit-identical to ``jax.jit``'s.

Under ``jax.jit`` a literal an inner jitted function receives (``jnp.std``'s
``ddof=0``) and an array made inside the function from Python data are
constants of the computation, which XLA folds. Passed to a node as runtime
inputs they gave results that differed from ``jax.jit``'s in the last bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)

X = np.random.RandomState(0).rand(100, 10).astype(np.float32)
TABLE = np.linspace(0.5, 2.0, 10, dtype=np.float32)


def _layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-6)


CASES = {
    "std": lambda x: x.std(0),
    "var with ddof": lambda x: jnp.var(x, 0, ddof=1),
    "divided by an array made inside": lambda x: x.sum(0) / jnp.array([100.0] * 10, jnp.float32),
    "scaled by a closed-over numpy table": lambda x: x * TABLE + 1,
    "layer norm": _layer_norm,
    "percentile": lambda x: jnp.percentile(x, 90, axis=0),
    "quantile": lambda x: jnp.quantile(x, 0.3, axis=0),
    "std then an inner jit with a literal": lambda x: jax.jit(lambda a, b: a * b)(x.std(0), 3.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_results_are_bit_identical_to_jax_jit(name):
    f = CASES[name]
    want = jax.jit(f)(jnp.asarray(X))
    got = pw.program(f)(jnp.asarray(X))
    assert_matches(got, want, rtol=0, atol=0)


# Functions that are one node even unfused (one inner jit, or glue alone): compiled as jax.jit
# compiles them. (Unfused programs of several nodes are several executables, which XLA cannot
# fuse across: they match jax.jit to rounding, not bit for bit.)
@pytest.mark.parametrize("name", ["std", "var with ddof", "divided by an array made inside", "percentile"])
def test_unfused_single_node_programs_are_bit_identical_too(name):
    f = CASES[name]
    program = pw.program(f, fuse=False)
    assert len(program.graph(jnp.asarray(X)).nodes) == 1
    assert_matches(program(jnp.asarray(X)), jax.jit(f)(jnp.asarray(X)), rtol=0, atol=0)


def test_a_literal_passed_to_an_inner_jit_is_not_an_input_of_its_node():
    graph = pw.program(lambda x: x.std(0), fuse=False).graph(jnp.asarray(X))
    (node,) = graph.nodes
    assert node.name == "_std"
    assert len(node.inputs) == 1  # only x; the ddof literal is bound into the node
    assert not graph.consts


def test_a_constant_the_program_returns_as_it_is_is_still_an_output():
    def f(x):
        return x + 1, TABLE, jnp.arange(3)

    got = pw.program(f)(jnp.ones(2))
    want = jax.jit(f)(jnp.ones(2))
    for g, w in zip(got, want, strict=True):
        assert_matches(g, w, rtol=0, atol=0)


def test_a_constant_read_on_two_slices_is_bound_into_both_nodes():
    a = pw.devices(mesh={"x": 2})
    b = pw.devices(mesh={"x": 2})

    @pw.jit(devices=a)
    def left(v):
        return v * TABLE

    @pw.jit(devices=b)
    def right(v):
        return (v / TABLE).std()

    @pw.program(fuse=False)
    def both(v):
        return right(left(v) + TABLE)

    graph = both.graph(jnp.asarray(X))
    assert not graph.consts  # TABLE is a constant of each node that reads it, not a value moved
    assert [len(n.inputs) for n in graph.nodes] == [1, 1, 1]
    want = jax.jit(lambda v: ((v * TABLE + TABLE) / TABLE).std())(jnp.asarray(X))
    # Three executables on two slices: equal to rounding (XLA fuses across none of them).
    assert_matches(both(jnp.asarray(X)), want, rtol=1e-6, atol=0)
