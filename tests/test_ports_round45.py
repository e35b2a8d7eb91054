"""Programs others wrote for jax.jit, with only the decorator changed, compared with plain JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import pathways_jax as pw

_LEARNING_RATE = [0.1]  # a module-level setting, read when the step is traced


def _train_step(state, x):
    grads = jax.tree.map(lambda p: p * x.sum() * _LEARNING_RATE[0], state.params)
    return state.apply_gradients(grads=grads)


@pytest.mark.parametrize(
    "first",
    [
        lambda: train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1)),
        lambda: (0, np.ones(3, np.float32), 1.5),
    ],
    ids=["train-state-step-0", "python-and-numpy"],
)
def test_a_loop_first_given_host_values_then_its_futures_is_traced_once_as_under_jax_jit(first):
    # Flax's TrainState.create starts at step=0, a Python int; parameters may come from numpy.
    # jax.jit traces a loop fed its own outputs once (its trace is keyed by abstract values);
    # a program ran the function again for the futures of the first call, so Python state
    # read at trace time was read again there (results differed from jax.jit's) and the trace
    # cost twice.
    def generic_step(state, x):
        if isinstance(state, train_state.TrainState):
            return _train_step(state, x)
        count, w, scale = state
        return count + 1, w - _LEARNING_RATE[0] * x.sum() * scale, scale * 0.5

    runs = {"jit": 0, "pw": 0}

    def counted(name):
        def step(state, x):
            runs[name] += 1
            return generic_step(state, x)

        return step

    results = {}
    for name, decorate in (("jit", jax.jit), ("pw", pw.program)):
        _LEARNING_RATE[0] = 0.1
        step = decorate(counted(name))
        state = first()
        for i in range(3):
            state = step(state, jnp.ones(2))
            _LEARNING_RATE[0] = 0.1 / (i + 2)  # read by a trace only, as under jax.jit
        results[name] = [np.asarray(leaf) for leaf in jax.tree.leaves(state)]
    assert runs["pw"] == runs["jit"] == 1
    for got, want in zip(results["pw"], results["jit"], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_step_given_numpy_after_the_futures_it_returned_is_traced_once_as_under_jax_jit():
    # Flax's legacy checkpoints.restore_checkpoint gives numpy arrays: a loop that restores its
    # state after some steps calls the step with host values of the futures' types.
    runs = {"jit": 0, "pw": 0}
    results = {}
    for name, decorate in (("jit", jax.jit), ("pw", pw.program)):

        def step(w, x, name=name):
            runs[name] += 1
            return w - 0.1 * x.sum(), jnp.sum(w)

        program = decorate(step)
        w = jnp.ones(3)
        for _ in range(2):
            w, _ = program(w, jnp.ones(2))
        w, total = program(np.asarray(w), np.ones(2, np.float32))  # restored as numpy
        results[name] = (np.asarray(w), np.asarray(total))
    assert runs["pw"] == runs["jit"] == 1
    for got, want in zip(results["pw"], results["jit"], strict=True):
        np.testing.assert_array_equal(got, want)
