"""Programs others wrote for jax.jit, with only the decorator changed, compared with plain JAX (round 46)."""

import functools
import pickle

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pathways_jax as pw


@pw.program
def _module_step(w, x):
    return w - 0.1 * x


@pw.jit
def _module_jit(w):
    return w * 2


def _make_steps(decorate):
    """A sweep's trainable as Ray Tune and joblib ship it: closures over jitted steps, pickled by value."""

    @functools.partial(decorate, static_argnums=(2,), donate_argnums=(0,))
    def step(w, x, scale):
        return w - scale * x, jnp.sum(w)

    def trial(lr):
        w = jnp.ones(3)
        for _ in range(2):
            w, total = step(w, jnp.arange(3.0) * lr, 2)
        return np.asarray(w), float(total)

    return trial


@pytest.mark.parametrize("decorate", [pw.program, pw.jit], ids=["program", "pw-jit"])
def test_a_closure_over_a_program_pickles_by_value_as_one_over_a_jax_jit_function(decorate):
    # Ray, Ray Tune and joblib ship a trainable with cloudpickle, which pickles the jitted
    # functions it calls by value; a jax.jit function pickles (its function and options) and
    # runs where it is unpickled. A program raised "cannot pickle '_thread.RLock' object".
    want = cloudpickle.loads(cloudpickle.dumps(_make_steps(jax.jit)))(0.5)
    trial = cloudpickle.loads(cloudpickle.dumps(_make_steps(decorate)))
    got = trial(0.5)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]


def test_a_module_level_program_pickles_as_a_reference_to_itself():
    # multiprocessing's spawn workers take functions by reference (pickle): the decorated name.
    assert pickle.loads(pickle.dumps(_module_step)) is _module_step
    assert pickle.loads(pickle.dumps(_module_jit)) is _module_jit
    args = (jnp.float32(1), jnp.float32(1))
    want = jax.jit(_module_step.__wrapped__)(*args)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(_module_step))(*args).result(), want)


@pytest.mark.parametrize(
    "make",
    [lambda s: pw.program(lambda x: x + 1, devices=s), lambda s: pw.jit(lambda x: x + 1, devices=s)],
    ids=["program", "pw-jit"],
)
def test_a_program_placed_on_a_slice_refuses_to_pickle_saying_why(make):
    s = pw.devices(mesh={"x": 1})
    with pytest.raises(TypeError, match=r"slice .* this process") as info:
        cloudpickle.dumps(make(s))
    assert isinstance(info.value, pw.errors.PlacementError)
    assert "pw.devices" in str(info.value)


def _es_step(noise, mean, scale, n):
    fitness = -jnp.sum((mean + scale * noise[:n]) ** 2, axis=1)
    return mean + 0.1 * jnp.mean(fitness[:, None] * noise[:n], axis=0), jnp.max(fitness)


@pytest.mark.parametrize("decorate", [pw.program, pw.jit], ids=["program", "pw-jit"])
def test_cache_size_counts_the_signatures_traced_as_jax_jit_s_does(decorate):
    # Test suites assert that a loop does not retrace with jax.jit's _cache_size() (private but
    # common: `assert es_run._cache_size() == 1` after the first call); a program had none.
    sizes = {}
    for name, wrap in (("jit", jax.jit), ("pw", decorate)):
        run = wrap(_es_step, static_argnums=(3,))
        seen = [run._cache_size()]
        mean, noise = jnp.ones(3), jnp.ones((8, 3))
        for i in range(3):  # a loop fed its own outputs: one signature
            mean, _ = run(noise * i, mean, 0.5, 4)
            seen.append(run._cache_size())
        run(noise, jnp.ones(3, jnp.int32), 0.5, 4)  # another dtype
        seen.append(run._cache_size())
        run(noise, mean, 0.5, 2)  # another static value
        seen.append(run._cache_size())
        run.clear_cache()
        seen.append(run._cache_size())
        sizes[name] = seen
    assert sizes["pw"] == sizes["jit"] == [0, 1, 1, 1, 2, 3, 0]


def test_cache_size_of_a_program_given_nnx_objects_counts_its_trace_as_jax_jit_s_does():
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    sizes = {}
    for name, wrap in (("jit", jax.jit), ("pw", pw.program)):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        run = wrap(step)
        for _ in range(3):
            run(model, optimizer, jnp.ones(2))
        sizes[name] = run._cache_size()
    assert sizes["pw"] == sizes["jit"] == 1


def test_clear_cache_of_a_program_given_nnx_objects_traces_again_as_jax_jit_s_does():
    # A setting read when the step is traced changes, and the step's cache is cleared to take
    # it: jax.jit traces again; a program given NNX objects kept its trace (and the old value).
    scale = [1.0]

    def step(model, x):
        return jnp.sum(model(x)) * scale[0]

    results = {}
    for name, wrap in (("jit", jax.jit), ("pw", pw.program)):
        scale[0] = 1.0
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        run = wrap(step)
        first = float(run(model, jnp.ones(2)))
        scale[0] = 2.0
        run.clear_cache()
        results[name] = (first, run._cache_size(), float(run(model, jnp.ones(2))), run._cache_size())
    assert results["pw"] == results["jit"]
    assert results["jit"][2] == 2 * results["jit"][0]
