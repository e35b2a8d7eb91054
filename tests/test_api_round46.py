"""The API's promises kept: lower/trace/eval_shape, specs and slices as plain ``jax.jit`` gives them."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import assert_matches
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_jax as pw


def _layer(params, x):
    return {"y": jnp.tanh(x @ params["w"]) + params["b"], "norm": (x * x).sum()}, x * 2


def test_lower_of_a_pw_jit_with_specs_compiles_with_its_specs_as_a_call_runs():
    # pw.jit(..., in_specs=, out_specs=).lower(...) compiled the function without its specs
    # (inputs and outputs replicated), so what lower showed was not what a call ran.
    s = pw.devices(mesh={"x": 4})
    mesh = s.physical_mesh
    in_specs = ({"w": P(None, "x"), "b": None}, P("x"))
    out_specs = ({"y": P("x", None), "norm": P()}, P("x"))
    ours = pw.jit(_layer, devices=s, in_specs=in_specs, out_specs=out_specs)
    named = lambda tree: jax.tree.map(lambda p: NamedSharding(mesh, p), tree)  # noqa: E731
    want = jax.jit(_layer, in_shardings=named(in_specs), out_shardings=named(out_specs))
    params = {"w": jnp.full((8, 8), 0.1), "b": jnp.ones(8)}
    x = jnp.arange(64.0).reshape(8, 8) / 64
    want_lowered = want.lower(params, x)
    lowered = ours.lower(params, x)
    assert lowered.as_text() == want_lowered.as_text()
    compiled, want_compiled = lowered.compile(), want_lowered.compile()
    assert compiled.input_shardings == want_compiled.input_shardings
    assert compiled.output_shardings == want_compiled.output_shardings
    assert compiled.cost_analysis() == want_compiled.cost_analysis()
    # The call runs what lower showed: the same values, sharded as the compiled object's.
    called = pw.results(ours(params, x))
    assert_matches(called, want(params, x))
    for got, ahead in zip(jax.tree.leaves(called), jax.tree.leaves(compiled(params, x)), strict=True):
        assert got.sharding.is_equivalent_to(ahead.sharding, got.ndim)
    # trace and eval_shape answer for the same specs; keyword arguments are taken as by a call.
    assert ours.trace(params, x).lower().as_text() == want_lowered.as_text()
    assert ours.eval_shape(params, x) == want.eval_shape(params, x)
    by_keyword = pw.jit(lambda x, scale: x * scale, devices=s, in_specs=P("x"), out_specs=P("x"))
    assert by_keyword.lower(x, scale=2.0).compile().input_shardings[0] == (NamedSharding(mesh, P("x")),)
    s.release()


def _explicit_loss(w, x):
    h = jnp.tanh(x @ jax.sharding.reshard(w, P(None, "x")))
    return jnp.sum(h**2), h


def test_a_program_on_an_explicit_slice_under_the_callers_eager_grad_differentiates_as_under_set_mesh():
    # A program (or pw.jit) on an Explicit-axes slice runs under the caller's grad as jax.jit under
    # jax.set_mesh of the slice's mesh; its outputs came back typed on that mesh, and jax.grad's
    # cotangent seed, made outside it, failed ("Length of device assignment 1 is not equal to the
    # size of the mesh 4").
    s = pw.devices(mesh={"x": 4}, axis_types=jax.sharding.AxisType.Explicit)
    w, x = jnp.full((8, 8), 0.1), jnp.arange(32.0).reshape(4, 8) / 32
    cotangents = (jnp.ones(()), jnp.ones((4, 8)))
    with jax.set_mesh(s.physical_mesh):
        want = jax.value_and_grad(jax.jit(_explicit_loss), has_aux=True)(w, x)
        want_grad = jax.grad(lambda v: jax.jit(_explicit_loss)(v, x)[0])(w)
        want_vjp = jax.vjp(jax.jit(_explicit_loss), w, x)[1](cotangents)
    for ours in (pw.program(_explicit_loss, devices=s), pw.jit(_explicit_loss, devices=s)):
        assert_matches(jax.value_and_grad(ours, has_aux=True)(w, x), want)
        assert_matches(jax.grad(lambda v, f=ours: f(v, x)[0])(w), want_grad)
        assert_matches(jax.vjp(ours, w, x)[1](cotangents), want_vjp)
    s.release()


class _Config:  # a value that is no array, passed among the arrays by mistake
    pass


def _scaled(steps, state, batch, *, scale, mode):
    return state["w"] * batch * scale * steps


def test_a_refused_argument_leaf_is_named_by_its_place_in_the_call_with_static_arguments_too():
    # With static_argnums/static_argnames the leaf was a number alone ("argument leaf 0"); without
    # them it was named (args[0]['config']). Positions count the static ones, as the call wrote them.
    state = {"w": jnp.ones(2), "config": _Config()}
    for step in (
        pw.program(_scaled, static_argnums=0, static_argnames="mode"),
        pw.program(_scaled, static_argnames=("steps", "mode")),
        pw.jit(_scaled, static_argnums=-3, static_argnames="mode"),
    ):
        with pytest.raises(pw.errors.ProgramTraceError, match=r"leaf 0 is args\[1\]\['config'\] in the call"):
            step(3, state, jnp.ones(2), scale=1.0, mode="a")
        with pytest.raises(pw.errors.ProgramTraceError, match=r"leaf 2 is kwargs\['scale'\] in the call"):
            step(3, {"w": jnp.ones(2)}, jnp.ones(2), scale=_Config(), mode="a")
    with pytest.raises(TypeError, match=r"at path state\['config'\]"):  # as jax.jit names it
        jax.jit(_scaled, static_argnums=0, static_argnames="mode")(3, state, jnp.ones(2), scale=1.0, mode="a")


class _Counting(nnx.Module):
    def __init__(self):
        self.calls = nnx.BatchStat(jnp.array(0))
        self.linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        self.calls[...] += 1
        return self.linear(x)


def _hijax_model():
    with nnx.var_defaults(hijax=True):
        return _Counting()


def _hijax_sgd(model, x):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        return jnp.mean(nnx.merge(graphdef, params, rest)(x) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(nnx.with_vars(params, hijax=False))
    jax.tree.map(lambda p, g: p.set_value(p.get_value() - 0.1 * g.get_value()), params, grads)
    return loss


def test_a_pw_jit_function_trains_a_flax_hijax_model_in_place_as_jax_jit_does():
    # A model of Flax's hijax mode went to nnx.jit, which fails on its Variables ("DynamicJaxprTracer
    # has no attribute _can_update"); jax.jit updates them in place. pw.jit (on a slice or not) now
    # does too, and returning the Variables is refused clearly, as jax.jit cannot return them.
    x = jnp.arange(8.0).reshape(4, 2)
    want_model = _hijax_model()
    want = [jax.jit(_hijax_sgd)(want_model, x) for _ in range(3)]
    s = pw.devices(mesh={"x": 2})
    model = _hijax_model()
    assert_matches([pw.jit(_hijax_sgd)(model, x) for _ in range(3)], want)
    assert_matches(model.linear.kernel[...], want_model.linear.kernel[...])
    assert int(model.calls[...]) == int(want_model.calls[...]) == 3
    # Inside a program too, as a node of their arrays on its slice.
    inner = pw.jit(_hijax_sgd, devices=s)
    model = _hijax_model()
    outer = pw.program(lambda m, v: inner(m, v) * 2)
    assert_matches([outer(model, x) for _ in range(3)], [2 * w for w in want])
    assert_matches(model.linear.kernel[...], want_model.linear.kernel[...])
    assert [node.slice for node in outer.graph(_hijax_model(), x).nodes] == [s]
    with pytest.raises(pw.errors.ProgramTraceError, match="returns Flax hijax Variables"):
        pw.program(lambda m, v: (m.linear.kernel, m(v)))(_hijax_model(), x)
    s.release()


def _doubled(x, unused):
    return (x + 1) * 2


def test_lower_compiles_with_the_options_a_call_compiles_with_as_jax_jit_does():
    # program.lower / pw.jit.lower gave jax.jit's Lowered without the function's compiler_options
    # (both), keep_unused and device= (a program's): lower(...).compile() was not the call's executable.
    x = jnp.arange(8.0)
    options = {"xla_disable_all_hlo_passes": True}
    want = jax.jit(_doubled, compiler_options=options).lower(x, x).compile().as_text()
    assert want != jax.jit(_doubled).lower(x, x).compile().as_text()  # the option shows in the executable
    s = pw.devices(mesh={"x": 2})
    for ours in (pw.program(_doubled, compiler_options=options), pw.jit(_doubled, compiler_options=options)):
        compiled = ours.lower(x, x).compile()
        assert compiled.as_text() == want
        assert_matches(compiled(x, x), _doubled(x, x))
        assert_matches(ours(x, x), _doubled(x, x))
    placed = pw.jit(_doubled, devices=s, compiler_options=options).lower(x, x).compile()
    with jax.set_mesh(s.physical_mesh):
        assert placed.as_text() == jax.jit(_doubled, compiler_options=options).lower(x, x).compile().as_text()
    kept = jax.jit(_doubled, keep_unused=True).lower(x, x).as_text()
    assert kept != jax.jit(_doubled).lower(x, x).as_text()
    for ours in (pw.program(_doubled, keep_unused=True), pw.jit(_doubled, keep_unused=True)):
        assert ours.lower(x, x).as_text() == kept
    device = jax.devices()[3]
    program = pw.program(_doubled, device=device)
    assert program.lower(x, x).compile().output_shardings.device_set == {device}
    assert program(x, x).result().devices() == {device}
    s.release()


def _scaled_by(x, n):
    return jnp.sin(x) * n


def test_a_wrapped_jax_jit_function_lowers_as_that_jax_jit_does():
    # pw.program(jax.jit(step, ...)) and pw.jit(jax.jit(...)) lowered one jax.jit inside another:
    # its text was not jax.jit's, and with in_shardings the compiled inputs' shardings were the
    # outer jit's (GSPMDSharding, no .spec), not the NamedSharding given.
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    x = jnp.arange(8.0)
    for given in (
        jax.jit(_scaled_by, static_argnames="n"),
        jax.jit(_scaled_by, static_argnums=1, in_shardings=NamedSharding(mesh, P("x"))),
    ):
        want = given.lower(x, 3)
        for ours in (pw.program(given), pw.jit(given)):
            lowered = ours.lower(x, 3)
            assert lowered.as_text() == want.as_text()
            assert lowered.compile().input_shardings == want.compile().input_shardings
            assert_matches(ours(x, 3), given(x, 3))


def test_lower_of_a_program_keeps_its_pw_jit_functions_specs_as_its_plan_does():
    # program.lower gave the whole function as one jax.jit, its pw.jit functions run replicated
    # (their specs dropped), where the program's plan runs them sharded: the quickstart's step
    # lowered to four times the flops per device of what its call runs.
    s = pw.devices(mesh={"x": 4})
    sharded = pw.jit(lambda v: jnp.sin(v) * 2, devices=s, in_specs=P("x"), out_specs=P("x"))
    total = pw.jit(lambda v: v.sum(), devices=s)
    step = pw.program(lambda v: total(sharded(v)))
    mesh = s.physical_mesh

    def reference(v):
        v = jax.device_put(v, NamedSharding(mesh, P("x")))
        out = jax.lax.with_sharding_constraint(
            jax.jit(lambda u: jnp.sin(u) * 2)(v), NamedSharding(mesh, P("x"))
        )
        return jax.jit(lambda u: u.sum())(out)

    x = jnp.arange(16.0)
    with jax.set_mesh(mesh):
        want = jax.jit(reference).lower(x).compile()
    compiled = step.lower(x).compile()
    assert compiled.cost_analysis()["flops"] == want.cost_analysis()["flops"]
    assert step.graph(x).ir.nodes[0].in_specs == (P("x"),)  # what the plan runs
    assert_matches(compiled(x), want(x))
    assert_matches(step(x), want(x))
    # Under the caller's vmap the specs do not apply (they would not see the batch dimension).
    batched = pw.program(lambda v: jax.vmap(sharded)(v).sum())
    assert_matches(batched.lower(jnp.ones((3, 16))).compile()(jnp.ones((3, 16))), jnp.sin(1.0) * 2 * 48)
    s.release()


class _Dropping(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.dropout(self.linear(x)).sum()


def test_a_flax_hijax_model_drawing_random_numbers_runs_as_under_jax_jit():
    # Dropout draws with jax.random (a jax.jit function of its own): the program's graph cut its
    # trace there, and the hijax Variables crossed from one part to the next ("'AbstractVariable'
    # object has no attribute 'shape'"). They are lowered to their values, as jax.jit lowers them.
    x = jnp.arange(32.0).reshape(8, 4)
    with nnx.var_defaults(hijax=True):
        want_model, model = _Dropping(), _Dropping()
    want = [jax.jit(lambda m, v: m(v))(want_model, x) for _ in range(3)]
    assert_matches([pw.program(lambda m, v: m(v))(model, x) for _ in range(3)], want)
    assert int(model.dropout.rngs.count[...]) == int(want_model.dropout.rngs.count[...]) == 3


def test_lower_takes_arrays_of_other_devices_as_a_call_moves_them_onto_the_slice():
    # A call moves an array sharded on other devices onto its slice; lower (jax.jit under the
    # slice's mesh) refused it: "Received incompatible devices for jitted computation".
    s = pw.devices(mesh={"x": 4}, device_ids=[0, 1, 2, 3])
    other = jax.make_mesh((4,), ("x",), devices=jax.devices()[4:], axis_types=(jax.sharding.AxisType.Auto,))
    y = jax.device_put(jnp.arange(16.0), NamedSharding(other, P("x")))
    for ours in (pw.jit(lambda v: v * 2, devices=s), pw.program(lambda v: v * 2, devices=s)):
        compiled = ours.lower(y).compile()
        assert compiled.input_shardings[0] == (s.sharding(P("x")),)  # as the call puts it there
        compiles = pw.counters()["compiles"]
        assert_matches(ours(y), y * 2)
        assert pw.counters()["compiles"] == compiles  # lower prepared the call's plan
        assert_matches(compiled(jax.device_put(y, s.sharding(P("x")))), y * 2)
        assert ours.eval_shape(y).shape == (16,)
    # A future of another slice's devices too, and uncommitted arrays are left to jax.jit.
    elsewhere = pw.devices(mesh={"x": 4}, device_ids=[4, 5, 6, 7])
    future = pw.jit(lambda v: v + 1, devices=elsewhere, out_specs=P("x"))(jnp.arange(16.0))
    ours = pw.program(lambda v: v * 2, devices=s)
    assert ours.lower(future).compile().input_shardings[0] == (s.sharding(P("x")),)
    assert_matches(ours(future), (jnp.arange(16.0) + 1) * 2)
    uncommitted = jnp.arange(16.0)
    with jax.set_mesh(s.physical_mesh):
        want = jax.jit(lambda v: v * 2).lower(uncommitted).as_text()
    assert pw.jit(lambda v: v * 2, devices=s).lower(uncommitted).as_text() == want
    s.release()
    elsewhere.release()
