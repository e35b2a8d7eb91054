"""``pw.program`` and ``pw.jit`` take what ``jax.jit`` takes, and futures answer what arrays answer.

Each test calls ``jax.jit`` and pathways_jax with the same options on the same
inputs and compares results (and where they live).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, jax_config
from jax.sharding import PartitionSpec as P

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)


def _add(x, unused):
    return x + 1


@pytest.mark.parametrize(
    "options",
    [
        {"keep_unused": True},
        {"inline": True},
        {"static_argnums": None},
        {"static_argnames": None},
        {"donate_argnums": None},
        {"donate_argnames": None},
    ],
    ids=lambda o: next(iter(o)),
)
def test_jax_jit_options_with_no_effect_on_results_are_accepted(options):
    x, unused = jnp.ones(2), jnp.ones(3)
    want = jax.jit(_add, **options)(x, unused)
    assert_matches(pw.program(_add, **options)(x, unused), want, rtol=0, atol=0)


def test_compiler_options_reach_xla():
    x = jnp.ones(4)
    want = jax.jit(_add, compiler_options={"xla_cpu_enable_fast_math": False})(x, x)
    prog = pw.program(_add, compiler_options={"xla_cpu_enable_fast_math": False})
    assert_matches(prog(x, x), want, rtol=0, atol=0)
    # An option XLA does not know fails as it fails under jax.jit, at the call.
    with pytest.raises(Exception, match="no_such_option"):
        jax.jit(_add, compiler_options={"no_such_option": True})(x, x)
    with pytest.raises(pw.errors.PathwaysError, match="no_such_option"):
        pw.program(_add, compiler_options={"no_such_option": True})(x, x)


def test_device_and_backend_place_a_program_with_no_slice():
    target = jax.devices()[5]
    host = np.ones(3, np.float32)
    with pytest.warns(DeprecationWarning):
        want = jax.jit(_add, device=target)(host, host)
    got = pw.program(_add, device=target)(host, host).result(timeout=60)
    assert got.devices() == want.devices() == {target}
    assert_matches(got, want, rtol=0, atol=0)
    on_cpu = pw.program(_add, backend="cpu")(host, host).result(timeout=60)
    assert next(iter(on_cpu.devices())).platform == "cpu"
    with pytest.raises(pw.errors.PlacementError, match="no such platform"):
        pw.program(_add, backend="tpu")


def _scale(x, n, shift=0.0):
    return x * n + shift


@pytest.mark.parametrize(
    ("nums", "args"),
    [(-1, (jnp.ones(2), 3)), ((-2,), (2.0, jnp.ones(2))), ((1, -1), (jnp.ones(2), 3))],
    ids=["-1", "-2", "1 and -1"],
)
def test_negative_static_argnums_count_from_the_end_as_in_jax_jit(nums, args):
    def scale(x, n):
        return x * n

    want = jax.jit(scale, static_argnums=nums)(*args)
    assert_matches(pw.program(scale, static_argnums=nums)(*args), want, rtol=0, atol=0)


def _last_times_first(*xs):
    return xs[0] * xs[-1]


@pytest.mark.parametrize("make", [pw.program, pw.jit], ids=["program", "pw.jit"])
def test_negative_static_argnums_count_from_the_end_of_each_call_as_in_jax_jit(make):
    # They counted from the end of the parameters when the program was made: on *args
    # that was refused, and a call leaving a default out traced its last argument.
    x = jnp.arange(3.0)
    for fun, args in [(_last_times_first, (x, 3)), (_last_times_first, (x, x, 4)), (_scale, (x, 2))]:
        want = jax.jit(fun, static_argnums=-1)(*args)
        assert_matches(make(fun, static_argnums=-1)(*args), want, rtol=0, atol=0)
    traced = []
    make(lambda v, n, shift=0.0: traced.append(n) or v * n, static_argnums=-1)(x, 2)
    assert traced == [2]  # static (a Python int), as under jax.jit, not a tracer
    with pytest.raises(ValueError, match="Positional argument indices"):
        jax.jit(_last_times_first, static_argnums=-3)(x, 3)
    with pytest.raises(pw.errors.ProgramTraceError, match="reaches before the first") as caught:
        make(_last_times_first, static_argnums=-3)(x, 3)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(pw.errors.ProgramTraceError, match="only accepts 3 positional") as caught:
        make(_scale, static_argnums=-4)
    assert isinstance(caught.value, ValueError)


def _scale_positional(x, n=2.0, /):
    return x * n


def test_static_argnums_past_the_calls_arguments_are_none_as_in_jax_jit():
    # A program raised "has static_argnums (2,), but was called with 1 positional arguments"
    # for an *args entry or a positional-only default the call did not give; jax.jit takes it.
    x = jnp.arange(3.0)
    for fun, nums, args in [(_last_times_first, (1, 4), (x,)), (_scale_positional, 1, (x,))]:
        want = jax.jit(fun, static_argnums=nums)(*args)
        assert_matches(pw.program(fun, static_argnums=nums)(*args), want, rtol=0, atol=0)


def test_pw_jit_takes_a_partial_static_argnames_and_statics_by_keyword():
    s = pw.devices(mesh={"x": 1})

    def f(x, neg):
        return -x if neg else x

    partial = functools.partial(f, neg=True)
    by_partial = pw.jit(partial, devices=s)
    assert by_partial.__name__ == "f"
    assert_matches(by_partial(jnp.ones(2)), jax.jit(partial)(jnp.ones(2)))
    by_name = pw.jit(f, devices=s, static_argnames="neg")
    assert_matches(by_name(jnp.ones(2), neg=True), -jnp.ones(2))
    assert_matches(by_name(jnp.ones(2), True), -jnp.ones(2))  # the name completes the position
    by_position = pw.jit(f, devices=s, static_argnums=1)
    assert_matches(by_position(jnp.ones(2), neg=True), -jnp.ones(2))
    assert_matches(by_position(jnp.ones(2), neg=False), jnp.ones(2))
    # Inside a program too.
    prog = pw.program(lambda v: by_name(v, neg=True) + by_position(v, neg=False))
    assert_matches(prog(jnp.ones(2)), jnp.zeros(2))
    donating = pw.jit(lambda x, y: x + y, devices=s, donate_argnames="x")
    x = jax.device_put(jnp.ones(2), s.sharding())
    assert_matches(donating(x=x, y=jnp.ones(2)), jnp.full(2, 2.0))
    assert x.is_deleted()


def test_a_programs_name_from_a_partial_is_its_functions():
    assert pw.program(functools.partial(_scale, n=2)).name == "_scale"


def test_future_device_and_addressability_answer_without_waiting():
    single = pw.program(lambda v: v * 2)(jnp.arange(3.0))
    plain = jax.jit(lambda v: v * 2)(jnp.arange(3.0))
    assert single.device == plain.device
    assert single.is_fully_addressable is plain.is_fully_addressable is True
    moved = jax.device_put(jnp.ones(2), single.device)
    assert moved.devices() == plain.devices()
    s = pw.devices(mesh={"x": 4})
    sharded = pw.jit(lambda v: v + 1, devices=s, out_specs=pw.P("x"))(jnp.arange(8.0))
    want = jax.device_put(jnp.arange(8.0) + 1, sharded.sharding)
    assert sharded.device == want.device == sharded.sharding


@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")
@pytest.mark.filterwarnings("ignore:.*[Cc]ouldn't find sharding info")
def test_orbax_pytree_checkpointers_save_futures_as_the_arrays_they_stand_for(tmp_path):
    import orbax.checkpoint as ocp
    from flax.training import checkpoints

    def step(p):
        return {"w": p["w"] * 2, "step": p["step"] + 1}

    p0 = {"w": jnp.arange(12.0).reshape(4, 3), "step": jnp.int32(0)}
    want = jax.jit(step)(p0)
    state = pw.program(step)(p0)  # traced after orbax's import: orbax takes the futures
    assert isinstance(state["w"], pw.Future)
    ocp.PyTreeCheckpointer().save(tmp_path / "a", state)
    restored = ocp.PyTreeCheckpointer().restore(tmp_path / "a")
    with ocp.CheckpointManager(tmp_path / "b") as manager:
        manager.save(1, args=ocp.args.PyTreeSave(state))
        manager.wait_until_finished()
        by_manager = manager.restore(1, args=ocp.args.PyTreeRestore())
    checkpoints.save_checkpoint(tmp_path / "c", state, step=1)
    legacy = checkpoints.restore_checkpoint(tmp_path / "c", target=None)
    for got in (restored, by_manager, legacy):
        assert isinstance(got["w"], jax.Array)
        assert_matches(got["w"], want["w"], rtol=0, atol=0)
        assert int(got["step"]) == int(want["step"]) == 1


@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")
@pytest.mark.filterwarnings("ignore:.*[Cc]ouldn't find sharding info")
@pytest.mark.filterwarnings("ignore:.*transformations API")
def test_checkpoints_restore_into_a_target_of_futures_as_into_one_of_arrays(tmp_path):
    """Resuming training: the target is the state a program just made (Flax's PPO example)."""
    import optax
    import orbax.checkpoint as ocp
    from flax.training import checkpoints, orbax_utils, train_state

    def init(key):
        return {"w": jax.random.normal(key, (4, 4)), "b": jnp.zeros(4)}

    results = {}
    for name, decorator in (("jit", jax.jit), ("pw", pw.program)):
        params = decorator(init)(jax.random.key(0))
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
        legacy = tmp_path / name / "legacy"
        checkpoints.save_checkpoint(legacy, state, step=1)
        restored = checkpoints.restore_checkpoint(legacy, state)
        args = orbax_utils.restore_args_from_target(state)  # futures: their shape, dtype, sharding
        standard = ocp.StandardCheckpointer()
        standard.save(tmp_path / name / "standard", params)
        standard.wait_until_finished()
        from_standard = standard.restore(tmp_path / name / "standard", params)
        without_target = standard.restore(tmp_path / name / "standard")
        results[name] = (restored.params, args.params["w"].sharding, from_standard, without_target)
    for want, got in zip(results["jit"], results["pw"], strict=True):
        if isinstance(want, jax.sharding.Sharding):
            assert got == want
            continue
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            assert type(g) is type(w)  # jax.Array, not NumPy (the standard handler made futures NumPy)
            np.testing.assert_array_equal(g, w)


@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")
@pytest.mark.filterwarnings("ignore:.*[Cc]ouldn't find sharding info")
def test_a_state_of_futures_and_arrays_saves_every_time(tmp_path):
    # A TrainState of futures (params) and arrays (optax's state): two orbax handlers wrote the
    # checkpoint's array metadata at once and about one save in two failed.
    import optax
    from flax.training import checkpoints, train_state

    params = pw.program(lambda k: {"w": jax.random.normal(k, (4, 4)), "b": jnp.zeros(4)})(jax.random.key(0))
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    assert isinstance(state.params["w"], pw.Future) and isinstance(state.opt_state[0].mu["w"], jax.Array)
    for i in range(8):
        checkpoints.save_checkpoint(tmp_path / str(i), state, step=1)
        restored = checkpoints.restore_checkpoint(tmp_path / str(i), target=None)
        np.testing.assert_array_equal(restored["params"]["w"], params["w"].result())


def test_the_first_trace_leaves_python_s_and_numpy_s_random_streams_alone():
    import random
    import subprocess
    import sys

    # In a fresh process: the first program's trace imports Flax, whose import draws from `random`.
    code = (
        "import random, numpy as np, jax.numpy as jnp, pathways_jax as pw\n"
        "random.seed(0); np.random.seed(0)\n"
        "pw.program(lambda x: x * 2)(jnp.ones(3)).result()\n"
        "print(random.random(), np.random.random())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    random.seed(0)
    np.random.seed(0)
    assert out.stdout.split() == [repr(random.random()), repr(np.random.random())]


def test_an_outputs_weak_type_follows_its_call_not_a_cached_executable():
    want = jax.jit(lambda x: x * 2)(1.0)
    strong = pw.program(lambda x: x * 2)
    assert not strong(np.float32(1.0)).result(timeout=60).weak_type  # compiles x * 2 for a strong x
    for prog in (strong, pw.program(lambda x: x * 2)):  # the same computation, weak this time
        got = prog(1.0).result(timeout=60)
        assert got.weak_type == want.weak_type is True
        assert (got + jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
    # A weakly typed output passed back (as a future) stays weak, as jax.jit's array does.
    again = strong(strong(1.0)).result(timeout=60)
    assert again.weak_type == jax.jit(lambda x: x * 2)(want).weak_type is True


def test_placement_follows_committed_arguments_then_the_default_device_as_in_jax_jit():
    loose = jnp.arange(4.0)  # a jnp result: on device 0, uncommitted
    placed = jax.device_put(jnp.ones(4), jax.devices()[3])
    add = pw.program(lambda a, b: a + b)
    got, want = add(loose, placed).result(timeout=60), jax.jit(lambda a, b: a + b)(loose, placed)
    assert got.devices() == want.devices() == {jax.devices()[3]}
    assert_matches(got, want)
    double = pw.program(lambda x: x * 2)
    with jax.default_device(jax.devices()[5]):
        got, want = double(loose).result(timeout=60), jax.jit(lambda x: x * 2)(loose)
    assert got.devices() == want.devices() == {jax.devices()[5]}
    assert double(loose).result(timeout=60).devices() == {jax.devices()[0]}


def test_pw_jit_with_no_devices_runs_where_jax_jit_would():
    """``s/jax.jit/pw.jit/`` works: with no slice anywhere, it is placed as ``jax.jit`` places."""

    def scale(x, y, n):
        return x * n + y

    ours, reference = pw.jit(scale, static_argnums=2), jax.jit(scale, static_argnums=2)
    loose = jnp.arange(4.0)
    placed = jax.device_put(jnp.ones(4), jax.devices()[3])
    for args in ((loose, loose, 3), (loose, placed, 2)):
        got, want = ours(*args), reference(*args)
        assert isinstance(got, pw.Future)
        assert_matches(got, want, rtol=0, atol=0)
        assert got.result(timeout=60).devices() == want.devices()
    with jax.default_device(jax.devices()[5]):
        assert ours(loose, loose, 1).result(timeout=60).devices() == {jax.devices()[5]}
    # Arguments on a mesh of yours: it runs there, its output sharded as jax.jit's.
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    sharded = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, P("d")))
    got, want = ours(sharded, sharded, 2).result(timeout=60), reference(sharded, sharded, 2)
    assert got.sharding == want.sharding
    assert_matches(got, want, rtol=0, atol=0)

    # Inside a program with no slice: one node, as a jax.jit call there is.
    @pw.program
    def step(x):
        return ours(x, x, 2) - 1

    assert_matches(step(loose), jax.jit(lambda x: reference(x, x, 2) - 1)(loose), rtol=0, atol=0)
    assert len(step.graph(loose).nodes) == 1
    # Inside your own transformations: as jax.jit.
    assert_matches(jax.jit(lambda x: ours(x, x, 2))(loose), reference(loose, loose, 2))
    want_grad = jax.grad(lambda x: reference(x, x, 3).sum())(loose)
    assert_matches(jax.grad(lambda x: ours(x, x, 3).sum())(loose), want_grad)
    assert_matches(jax.vmap(lambda x: ours(x, x, 3))(loose), jax.vmap(lambda x: reference(x, x, 3))(loose))
    # A second call with the same signature neither traces nor compiles again.
    before = pw.counters()
    ours(loose, loose, 3).result(timeout=60)
    after = pw.counters()
    assert (after["traces"], after["compiles"]) == (before["traces"], before["compiles"])
    assert after["runs"] == before["runs"] + 1


def test_pw_jit_with_no_devices_updates_an_nnx_model_as_nnx_jit_does():
    nnx = pytest.importorskip("flax.nnx")

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(jnp.zeros(()))

    def bump(model, by):
        model.count[...] = model.count[...] + by
        return model.count[...] * 2

    ours, reference = Counter(), Counter()
    for by in (1.0, 2.5):
        got = pw.jit(bump)(ours, jnp.float32(by))
        want = nnx.jit(bump)(reference, jnp.float32(by))
        assert_matches(got, want, rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(ours.count[...]), np.asarray(reference.count[...]))


@pytest.mark.parametrize("wrap", [pw.program, pw.jit], ids=["program", "pw_jit"])
def test_a_jax_jit_function_keeps_its_static_arguments_when_wrapped(wrap):
    """``pw.program(existing_jitted_step)``: its static arguments stay static, as calling it."""

    def scale(x, n, *, mode):
        return x * n if mode == "mul" else x + n

    jitted = jax.jit(scale, static_argnums=1, static_argnames="mode")
    ours = wrap(jitted)
    x = jnp.arange(3.0)
    for n, mode in ((2, "mul"), (2, "mul"), (3, "add")):
        assert_matches(ours(x, n, mode=mode), jitted(x, n, mode=mode), rtol=0, atol=0)
    before = pw.counters()["traces"]
    assert_matches(ours(x, 2, mode="mul"), jitted(x, 2, mode="mul"), rtol=0, atol=0)
    assert pw.counters()["traces"] == before  # a static value seen before: no trace


def test_float0_outputs_come_back_as_jax_jit_returns_them():
    grad = jax.grad(lambda x, n: x * n, argnums=(0, 1), allow_int=True)
    want = jax.jit(grad)(2.0, 3)
    got = pw.program(grad)(2.0, 3)
    assert_matches(got[0], want[0], rtol=0, atol=0)
    assert got[1].dtype == want[1].dtype == jax.dtypes.float0
    assert type(got[1]) is type(want[1])
    for _ in range(3):  # nothing is kept per call for it
        pw.program(grad)(2.0, 3)
    # A computed float0 (not a literal): the gradient of an integer array an op reads.
    grad = jax.grad(lambda x, i: (x * i).sum(), argnums=(0, 1), allow_int=True)
    x, i = jnp.ones(3), jnp.arange(3)
    want = jax.jit(grad)(x, i)
    got = pw.program(grad)(x, i)
    assert_matches(got[0], want[0], rtol=0, atol=0)
    assert type(got[1]) is type(want[1]) and got[1].dtype == jax.dtypes.float0
    assert got[1].shape == want[1].shape == (3,)


def test_labels_and_donation_errors_name_the_users_line_not_optaxs():
    import optax

    tx = optax.adam(1e-2)

    def step(p, o):
        g = jax.grad(lambda p: jnp.sum(p**2))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    prog = pw.program(step, donate_argnums=(0, 1))
    p, o = jnp.ones(3), tx.init(jnp.ones(3))
    labels = [node.source_info for node in prog.graph(p, o).nodes]
    assert labels and all("test_dropin_api.py" in label for label in labels), labels
    p, o = prog(p, o)
    old = p
    p, o = prog(p, o)
    with pytest.raises(
        pw.errors.ProgramFailedError, match=r"this value \(made by .*test_dropin_api.py:\d+.*donated"
    ):
        old.result(timeout=60)
    assert_matches(p, jax.jit(step)(*jax.jit(step)(jnp.ones(3), tx.init(jnp.ones(3))))[0])


def test_pw_jit_takes_jax_jits_other_options():
    s = pw.devices(mesh={"x": 1})
    x = jnp.ones(3)
    for options in ({"keep_unused": True}, {"inline": True}, {"compiler_options": {}}):
        assert_matches(pw.jit(_add, devices=s, **options)(x, x), x + 1)
    with pytest.raises(pw.errors.PathwaysError, match="no_such_option"):
        pw.jit(_add, devices=s, compiler_options={"no_such_option": True})(x, x)


def test_a_single_device_sharding_pins_a_program_as_it_pins_jax_jit():
    target = jax.devices()[5]
    sharding = jax.sharding.SingleDeviceSharding(target)
    x = jnp.arange(3.0)
    for options in ({"out_shardings": sharding}, {"in_shardings": sharding}):
        want = jax.jit(lambda v: v * 2, **options)(x)
        got = pw.program(lambda v: v * 2, **options)(x).result(timeout=60)
        assert got.devices() == want.devices() == {target}
        assert_matches(got, want)


def test_bare_partition_specs_as_shardings_under_set_mesh():
    mesh = jax.make_mesh((2, 4), ("X", "Y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jnp.arange(32.0).reshape(8, 4)
    for options in ({"out_shardings": P("X")}, {"in_shardings": P("X")}):
        with jax.set_mesh(mesh):
            want = jax.jit(lambda v: v * 2, **options)(x)
            got = pw.program(lambda v: v * 2, **options)(x).result(timeout=60)
        assert got.sharding.is_equivalent_to(want.sharding, 2)
        assert_matches(got, want, rtol=0, atol=0)


def test_lower_takes_abstract_arguments_as_jax_jit_does():
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    lowered = pw.program(lambda v: v.sum()).lower(spec)
    assert lowered.as_text() == jax.jit(lambda v: v.sum()).lower(spec).as_text()
    assert float(lowered.compile()(jnp.ones(4))) == 4.0


def test_a_random_stream_follows_jax_threefry_partitionable_as_under_jax_jit():
    def draw(key):
        return jax.random.bits(key, (2, 2))

    key = jax.random.key(0)
    prog = pw.program(draw)
    for value in (True, False, True):
        with jax_config("jax_threefry_partitionable", value):
            want = jax.jit(draw)(key)
            assert_matches(prog(key), want, rtol=0, atol=0)
            assert_matches(pw.program(draw)(key), want, rtol=0, atol=0)  # the executable cache too


def test_flax_s_sharded_init_recipe_with_a_train_state_made_anew_in_each_call():
    """Flax's partitioning guide: out_shardings from a jax.eval_shape of an init that makes its module anew.

    Each trace of ``init`` makes another ``apply_fn`` (a bound method of a new
    module); jax.jit reuses its trace of the ``jax.eval_shape``, so its outputs
    carry the shardings' metadata and the same shardings then match them as
    the train step's ``in_shardings``. Under a program's mesh JAX matched the
    shardings strictly and refused both.
    """
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    from flax.training.train_state import TrainState
    from jax.sharding import NamedSharding

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            return nn.Dense(8, kernel_init=init, use_bias=False)(x)

    tx = optax.adam(1e-2)

    def init(key, x):
        return TrainState.create(apply_fn=MLP().apply, params=MLP().init(key, x)["params"], tx=tx)

    def train_step(state, x):
        grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    x = jnp.ones((8, 4))
    abstract = jax.eval_shape(init, jax.random.key(0), x)
    specs = nn.get_partition_spec(abstract)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    batch = NamedSharding(mesh, P("data"))
    results = []
    for decorator in (jax.jit, pw.program):
        state = decorator(init, out_shardings=shardings)(jax.random.key(0), x)
        step = decorator(train_step, in_shardings=(shardings, batch), out_shardings=shardings)
        for _ in range(3):
            state = step(state, x)
        kernel = state.params["Dense_0"]["kernel"].value
        results.append((np.asarray(kernel), kernel.sharding.spec))
    (expected, expected_spec), (got, got_spec) = results
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got_spec == expected_spec == P(None, "model")


def _explicit_mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)


@pytest.mark.parametrize("wrapped", [False, True], ids=["program-option", "wrapped-jax-jit"])
def test_out_shardings_on_explicit_axes_shard_the_outputs_as_jax_jit_does(wrapped):
    # On Explicit axes (jax.make_mesh's default) the outputs kept their computation's type:
    # out_shardings=P("model") came back P("data", "model").
    from jax.sharding import NamedSharding

    mesh = _explicit_mesh()
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
    out_shardings = (NamedSharding(mesh, P("model")), NamedSharding(mesh, P(None, "model")))

    def f(v):
        return v * 2, v.sum(axis=0, keepdims=True)

    expected = jax.jit(f, out_shardings=out_shardings)(x)
    program = (
        pw.program(jax.jit(f, out_shardings=out_shardings))
        if wrapped
        else pw.program(f, out_shardings=out_shardings)
    )
    got = pw.results(program(x))
    for want, have in zip(expected, got, strict=True):
        assert jax.typeof(have) == jax.typeof(want)
        assert have.sharding.is_equivalent_to(want.sharding, want.ndim)
        if not wrapped:  # the very spec, not P("model", None)
            assert have.sharding == want.sharding
        np.testing.assert_array_equal(have, want)


def test_out_shardings_on_explicit_axes_from_an_eval_shape_of_an_init_made_anew():
    # A TrainState whose apply_fn differs at each trace takes its out_shardings loosely, as
    # constraints: on Explicit axes a constraint is an assertion, which failed the trace.
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    from flax.training.train_state import TrainState
    from jax.sharding import NamedSharding

    mesh = _explicit_mesh()

    def init(key, x):
        dense = nn.Dense(8)
        return TrainState.create(
            apply_fn=dense.apply, params=dense.init(key, x)["params"], tx=optax.adam(1e-2)
        )

    x = jnp.ones((8, 4))
    abstract = jax.eval_shape(init, jax.random.key(0), x)
    shardings = jax.tree.map(
        lambda a: NamedSharding(mesh, P(*[None] * (a.ndim - 1), "model") if a.ndim else P()), abstract
    )
    expected = jax.jit(init, out_shardings=shardings)(jax.random.key(0), x).params["kernel"]
    got = pw.program(init, out_shardings=shardings)(jax.random.key(0), x).params["kernel"].result()
    assert jax.typeof(got) == jax.typeof(expected)
    assert got.sharding == expected.sharding
    np.testing.assert_array_equal(got, expected)


def test_out_shardings_that_do_not_fit_the_outputs_are_refused_as_by_jax_jit():
    sharding = jax.sharding.NamedSharding(jax.make_mesh((2,), ("x",)), P())
    wrong = {"a": sharding, "b": sharding}  # the outputs are a tuple
    with pytest.raises(ValueError, match="out_shardings") as expected:
        jax.jit(lambda v: (v, v), out_shardings=wrong)(jnp.ones(2))
    with pytest.raises(ValueError, match="out_shardings") as got:
        pw.program(lambda v: (v, v), out_shardings=wrong)(jnp.ones(2))
    assert type(expected.value).__name__ in str(type(got.value).__mro__)


@pytest.mark.parametrize(
    "options",
    [
        {"static_argnames": "q"},
        {"static_argnums": 3},
        {"donate_argnums": 5},
        {"static_argnums": 0, "donate_argnums": 0},
        {"static_argnames": "a", "donate_argnames": "a"},
    ],
    ids=repr,
)
def test_argument_positions_and_names_jax_jit_refuses_are_refused_when_the_program_is_made(options):
    def f(a):
        return a * 2

    with pytest.raises(ValueError) as expected:
        jax.jit(f, **options)
    with pytest.raises(pw.errors.ProgramTraceError) as got:
        pw.program(f, **options)  # not at the first call: when the program is made, as jax.jit
    assert isinstance(got.value, ValueError)
    assert str(expected.value) in str(got.value)
    assert "test_dropin_api.py" in str(got.value)  # the user's function, by its line


def test_clear_cache_traces_again_as_jax_jit_s_does():
    def f(x):
        return x * 2

    jitted, program = jax.jit(f), pw.program(f)
    x = jnp.arange(3.0)
    for _ in range(2):
        assert_matches(program(x), jitted(x))
    traces = pw.counters()["traces"]
    program(x).result()
    assert pw.counters()["traces"] == traces  # cached
    jitted.clear_cache()
    program.clear_cache()
    assert_matches(program(x), jitted(x))
    assert pw.counters()["traces"] == traces + 1
