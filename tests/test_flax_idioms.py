"""Flax (Linen and NNX), Optax and Orbax training idioms with ``@pw.program`` where ``nnx.jit``/``jax.jit`` stood.

Each test runs the same few steps under the reference transformation and under
``pw.program`` and compares parameters and losses bit for bit.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)

_AUTO = jax.sharding.AxisType.Auto


def _host(tree):
    """Every leaf as a NumPy array (typed PRNG keys as their key data)."""

    def host(leaf):
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf)

    return [host(leaf) for leaf in jax.tree.leaves(pw.results(tree))]


def _assert_identical(got, want) -> None:
    got, want = _host(got), _host(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(a, b)


class _DotReluDot(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.a = nnx.Linear(4, 8, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
        self.b = nnx.Linear(8, 4, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.b(nnx.relu(self.a(x)))


def _scale_up_guide_run(jit):
    """Flax's scale-up guide: a sharded model and its optimizer made inside one step, then trained."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(_AUTO, _AUTO))
    rng = np.random.default_rng(0)
    x, y = (rng.normal(size=(4, 4)).astype(np.float32) for _ in range(2))
    with jax.set_mesh(mesh):

        @jit
        def create():
            model = _DotReluDot(nnx.Rngs(0))
            state = nnx.state(model)
            nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
            return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @jit
        def step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        model, optimizer = create()
        step_counter = optimizer.step[...]  # a constant of create(): replicated over the mesh
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        losses = [step(model, optimizer, x, y)]
    return (step_counter.sharding, step_counter.committed), nnx.state((model, optimizer)), losses


def test_a_sharded_model_and_optimizer_made_under_set_mesh_train_as_under_nnx_jit():
    # The optimizer's step counter is a constant of create(): under jax.set_mesh it came back
    # claiming one device while its array was replicated over the mesh's devices, and reading it
    # (or the first step) failed with XLA's "Number of addressable output shards" error.
    want_placement, *want = _scale_up_guide_run(nnx.jit)
    got_placement, *got = _scale_up_guide_run(pw.program)
    assert got_placement == want_placement
    _assert_identical(got, want)


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.linear(x))


def _tree_mode_run(jit, *, context: bool = True):
    """A train step in Flax's tree mode: the modules are pytrees, the gradients taken functionally.

    ``context``: tree mode set with ``nnx.set_graph_mode``, else by ``jit``'s own options.
    """
    x, y = (np.random.default_rng(seed).normal(size=(4, 4)).astype(np.float32) for seed in (1, 2))
    with contextlib.ExitStack() as stack:
        if context:
            stack.enter_context(nnx.set_graph_mode(False))
            stack.enter_context(nnx.set_graph_updates(False))
        model = _Net(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @jit
        def step(model, optimizer, x, y):
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)

            def loss_fn(params):
                merged = nnx.merge(graphdef, params, rest, copy=True)
                return jnp.mean((merged(x) - y) ** 2), nnx.state(merged, nnx.Not(nnx.Param))

            (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            nnx.update(model, rest)
            optimizer.update(model, grads)
            return loss

        losses = [step(model, optimizer, x, y) for _ in range(2)]
        return nnx.state((model, optimizer)), losses


def test_a_train_step_in_flax_tree_mode_runs_as_under_nnx_jit():
    # Under nnx.set_graph_mode(False) the inner program is handed the modules themselves
    # (pytrees) and routed them back to the NNX path: RecursionError.
    _assert_identical(_tree_mode_run(pw.program), _tree_mode_run(nnx.jit))


def test_a_module_that_is_no_pytree_in_tree_mode_is_a_named_error():
    class Plain(nnx.Module, pytree=False):
        def __init__(self):
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    with nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        model = Plain()
        with pytest.raises(TypeError):  # nnx.jit's class
            nnx.jit(lambda m: m.linear(jnp.ones(2)))(model)
        # It recursed as the train step did; then naming the module failed inside Flax
        # (iter_graph in tree mode) with a ValueError.
        with pytest.raises(pw.errors.ProgramTraceError, match="not a pytree") as caught:
            pw.program(lambda m: m.linear(jnp.ones(2)))(model)
        assert isinstance(caught.value, TypeError)


def test_nnx_jits_graph_options_are_program_options():
    # @nnx.jit(graph=False, graph_updates=False) became @pw.program(...) with a TypeError:
    # pw.program took no such options.
    options = {"graph": False, "graph_updates": False}
    want = _tree_mode_run(functools.partial(nnx.jit, **options), context=False)
    _assert_identical(_tree_mode_run(functools.partial(pw.program, **options), context=False), want)
    # As under nnx.jit(graph=False), a Variable reached twice is refused (tree mode has no sharing).
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    for jit in (nnx.jit, pw.program):
        with pytest.raises(ValueError, match="Duplicate"):
            jit(lambda a, b: a(jnp.ones(2)), graph=False)(layer, layer)
    with pytest.raises(pw.errors.ProgramTraceError, match="expects True, False or None"):
        pw.program(lambda m: m, graph="tree")


class _Layers(nnx.Module):
    """Flax's stacked-layers idiom: layers made with nnx.vmap, run with nnx.scan."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(rngs: nnx.Rngs) -> nnx.Linear:
            return nnx.Linear(4, 4, rngs=rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def forward(layer: nnx.Linear, x: jax.Array) -> jax.Array:
            return nnx.relu(layer(x))

        return forward(self.layers, x)


def _scanned_layers_run(jit):
    x, y = (np.random.default_rng(seed).normal(size=(2, 4)).astype(np.float32) for seed in (1, 2))
    model = _Layers(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [step(model, optimizer, x, y) for _ in range(2)]
    return nnx.state((model, optimizer)), losses


def test_layers_scanned_with_nnx_scan_train_on_a_slice_as_under_nnx_jit():
    # The gradient of a scan whose body calls a jitted function (relu) holds a `jit` that
    # computes nothing, made by JAX outside the program's scope: on a slice it had nothing
    # to be placed by, and the step failed with PlacementError.
    on_slice = pw.devices(mesh={"x": 1})
    _assert_identical(
        _scanned_layers_run(lambda f: pw.program(f, devices=on_slice)), _scanned_layers_run(nnx.jit)
    )


def test_variables_with_no_module_beside_them_are_pytrees_as_under_jax_jit():
    # Documented in README "Differences from jax.jit": no module, optimizer or Rngs among
    # the arguments, Variables and states are taken as jax.jit takes them.
    def double(variable, x):
        variable[...] = variable[...] * 2
        return variable, x * variable[...]

    results = {}
    for name, jit in (("jax", jax.jit), ("pw", pw.program)):
        variable = nnx.Param(jnp.ones(2))
        returned, out = jit(double)(variable, jnp.ones(2))
        results[name] = (returned is variable, _host((variable[...], returned[...], out)))
    assert results["pw"][0] is results["jax"][0] is False
    for got, want in zip(results["pw"][1], results["jax"][1], strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(results["pw"][1][0], np.ones(2))  # the caller's: unchanged

    # Beside the module it belongs to, the same Variable is written in place, as nnx.jit does.
    for jit in (nnx.jit, pw.program):
        layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        scale = nnx.Param(jnp.ones(2))
        jit(lambda layer, scale: double(scale, layer(jnp.ones(2))))(layer, scale)
        np.testing.assert_array_equal(np.asarray(scale[...]), 2 * np.ones(2))


def test_pw_jit_on_a_slice_inside_nnx_jit_updates_the_modules_it_is_given():
    # Inside the caller's nnx.jit, pw.jit moved its arguments to the slice with
    # jax.device_put, which copies a module: the BatchNorm statistics and the Dropout key
    # it advanced went to the copy, and the caller's model kept the old ones.
    on_slice = pw.devices(mesh={"x": 1})
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)

    def run(inner):
        model = nnx.Sequential(nnx.BatchNorm(3, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)))
        step = nnx.jit(lambda model, x: inner(model, x))
        return nnx.state(model), [step(model, x) for _ in range(2)]

    want = run(nnx.jit(lambda m, x: m(x)))
    _assert_identical(run(pw.jit(lambda m, x: m(x), devices=on_slice)), want)


def test_a_program_inside_the_callers_nnx_jit_updates_the_objects_it_is_given():
    # Traced into the caller's nnx.jit, a program ran as jax.jit: the model and optimizer
    # were flattened as pytrees, so their updates were lost (the same loss every step, the
    # parameters, BatchNorm statistics and optimizer step as they were).
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def run(inner):
        model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(1)))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        run_step = nnx.jit(inner(step))  # or a function of the caller's calling it: the same
        return nnx.state((model, optimizer)), [run_step(model, optimizer, x) for _ in range(2)]

    _assert_identical(run(pw.program), run(nnx.jit))


def _linen_partitioned_run(jit):
    """Flax Linen's partitioning guide on jax.make_mesh's mesh (Explicit axes), no mesh set.

    ``nn.with_partitioning`` constrains a parameter only under a context mesh;
    ``jax.jit`` sets none from ``out_shardings``, so the initialiser runs as written.
    """
    import flax.linen as nn
    from flax.training import train_state

    mesh = jax.make_mesh((1, 2), ("data", "model"))  # Explicit axes, jax.make_mesh's default
    model = nn.Dense(4, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")))
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)

    def init(key, x):
        params = model.init(key, x)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    shardings = nn.get_sharding(jax.eval_shape(init, jax.random.key(0), x), mesh)
    state = jit(init, out_shardings=shardings)(jax.random.key(0), x)
    kernel = pw.results(state.params["kernel"].value)
    return kernel.sharding.spec, state


def test_linen_with_partitioning_on_an_explicit_mesh_of_out_shardings_initialises_as_under_jax_jit():
    # The program was traced with out_shardings' mesh as the context mesh, which jax.jit does
    # not set: Linen then constrained the kernel there, an assertion on Explicit axes
    # (ProgramTraceError), where jax.jit initialises. Traced as jax.jit traces it, it runs.
    want_spec, want = _linen_partitioned_run(jax.jit)
    got_spec, got = _linen_partitioned_run(pw.program)
    assert got_spec == want_spec == P(None, "model")
    _assert_identical(got, want)
