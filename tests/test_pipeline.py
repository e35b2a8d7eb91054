"""pathways_jax.pipeline: pipelined and multi-island data-parallel training against plain jax.jit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

import pathways_jax as pw
from pathways_jax import pipeline

pytestmark = pytest.mark.timeout(120)

BATCH, DIN, HIDDEN, DOUT = 8, 4, 8, 3


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, seed: int):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class LinenHead(linen.Module):
    features: int

    @linen.compact
    def __call__(self, x):
        return linen.Dense(self.features)(x)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def make_stages(kinds=("nnx", "nnx", "nnx")):
    """A 3-stage MLP whose stages come in the given forms."""
    sizes = [(DIN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, DOUT)]
    stages = []
    for i, (kind, (din, dout)) in enumerate(zip(kinds, sizes, strict=True)):
        if kind == "nnx":
            stages.append(Block(din, dout, seed=i))
        elif kind == "linen":
            module = LinenHead(dout)
            stages.append((module, module.init(jax.random.key(i), jnp.zeros((1, din)))))
        else:
            w = jax.random.normal(jax.random.key(10 + i), (din, dout)) / np.sqrt(din)
            stages.append(({"w": w, "b": jnp.zeros(dout)}, lambda p, x: jnp.sin(x @ p["w"] + p["b"])))
    return stages


def make_data(step=0, batch=BATCH):
    rng = np.random.default_rng(step)
    return rng.normal(size=(batch, DIN)).astype(np.float32), rng.normal(size=(batch, DOUT)).astype(np.float32)


def reference_steps(stages, tx, batches):
    """Plain jax.jit training of the unpipelined model: [(loss, grads, params_after)]."""
    params, apply = pipeline.sequential(stages)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: mse(apply(p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates), opt_state

    out = []
    for x, y in batches:
        loss, grads, params, opt_state = step(params, opt_state, x, y)
        out.append((loss, grads, params))
    return out


def assert_tree_close(got, want, rtol=1e-5, atol=1e-6):
    got_leaves = jax.tree.leaves(got)
    want_leaves = jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves, strict=True):
        value = g.result(timeout=60) if isinstance(g, pw.Future) else g
        assert value.shape == w.shape and value.dtype == w.dtype, (value.shape, w.shape)
        np.testing.assert_allclose(np.asarray(value), np.asarray(w), rtol=rtol, atol=atol)


def island_slices(count, mesh=None):
    pw.init(num_cpu_devices=8, islands=count)
    return [pw.devices(mesh=mesh or {"data": 2}, island=i) for i in range(count)]


@pytest.mark.parametrize(
    ("schedule", "num_microbatches"), [("gpipe", 2), ("gpipe", 4), ("1f1b", 1), ("1f1b", 4)]
)
def test_grads_and_updates_match_plain_jit(schedule, num_microbatches):
    slices = island_slices(4)[:3]  # one stage per island: every hop is a DCN transfer
    tx = optax.adam(1e-2)
    batches = [make_data(0), make_data(1)]
    want = reference_steps(make_stages(), tx, batches)
    pipe = pipeline.Pipeline(
        make_stages(), slices, loss_fn=mse, optimizer=tx, num_microbatches=num_microbatches, schedule=schedule
    )
    loss, grads = pipe.loss_and_grads(*batches[0])
    np.testing.assert_allclose(float(loss.result()), float(want[0][0]), rtol=1e-5)
    assert_tree_close(grads, want[0][1])
    for (x, y), (want_loss, _, want_params) in zip(batches, want, strict=True):
        loss = pipe.train_step(x, y)
        np.testing.assert_allclose(float(loss.result()), float(want_loss), rtol=1e-5)
        assert_tree_close(pipe.params, want_params)
    graph = pipe.graph(*batches[0])
    assert {t.kind for t in graph.transfers} == {"dcn"}
    assert {n.slice.island for n in graph.nodes} == {0, 1, 2}


def test_remat_and_mixed_stage_kinds_match_plain_jit():
    slices = island_slices(2)
    slices = [slices[0], slices[1], pw.devices(mesh={"data": 2}, island=1)]
    kinds = ("function", "nnx", "linen")
    tx = optax.sgd(0.1, momentum=0.9)
    batches = [make_data(0), make_data(1)]
    want = reference_steps(make_stages(kinds), tx, batches)
    pipe = pipeline.Pipeline(
        make_stages(kinds), slices, loss_fn=mse, optimizer=tx, num_microbatches=2, remat=True
    )
    assert [s.kind for s in pipe.stages] == ["function", "nnx", "linen"]
    for (x, y), (want_loss, _, want_params) in zip(batches, want, strict=True):
        np.testing.assert_allclose(float(pipe.train_step(x, y).result()), float(want_loss), rtol=1e-5)
        assert_tree_close(pipe.params, want_params)
    assert {t.kind for t in pipe.graph(*batches[0]).transfers} == {"dcn", "ici"}


def test_stages_sharded_over_their_mesh_match_plain_jit():
    pw.init(num_cpu_devices=8, islands=2)
    slices = [pw.devices(mesh={"data": 2, "model": 2}, island=i) for i in range(2)]
    stages = [Block(DIN, HIDDEN, 0), Block(HIDDEN, DOUT + 1, 1)]

    def specs(path, leaf):  # Megatron-style: the kernel's output features over "model"
        return pw.P(None, "model") if leaf.ndim == 2 and leaf.shape[1] % 2 == 0 else None

    tx = optax.adam(1e-2)
    x, _ = make_data(0)
    y = np.ones((BATCH, DOUT + 1), np.float32)
    want = reference_steps(stages, tx, [(x, y)])
    pipe = pipeline.Pipeline(stages, slices, loss_fn=mse, optimizer=tx, num_microbatches=2, param_specs=specs)
    np.testing.assert_allclose(float(pipe.train_step(x, y).result()), float(want[0][0]), rtol=1e-5)
    assert_tree_close(pipe.params, want[0][2])
    kernel = pipe.params[0]["linear"]["kernel"]
    assert kernel.sharding.spec == pw.P(None, "model")


class PartitionedDense(linen.Module):
    """Flax's docs' Linen layer: parameters declared with nn.with_partitioning on a mesh of theirs."""

    features: int
    mesh: jax.sharding.Mesh | None = None

    @linen.compact
    def __call__(self, x):
        init = linen.with_partitioning(linen.initializers.lecun_normal(), (None, "model"), mesh=self.mesh)
        kernel = self.param("kernel", init, (x.shape[-1], self.features))
        bias = self.param(
            "bias", linen.with_partitioning(linen.initializers.normal(), ("model",)), (self.features,)
        )
        return jnp.tanh(x @ kernel + bias)


def test_flax_partitioning_annotations_shard_and_constrain_on_each_stages_slice():
    """Flax's docs' sharding idioms, each stage on its own island, against plain jax.jit.

    Stage 0 (NNX, nnx.with_partitioning under jax.set_mesh): param_specs=nnx.get_partition_spec
    (was: a PlacementError, "entries ['kernel/value', ...] match no parameter"). Stage 1 (Linen,
    nn.with_partitioning(..., mesh=m), m on island 0's devices): its names constrain on island 1's
    slice instead (was: a PlacementError, "incompatible devices").
    """
    pw.init(num_cpu_devices=8, islands=2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        first = nnx.Linear(DIN, HIDDEN, kernel_init=init, rngs=nnx.Rngs(0))
    module = PartitionedDense(DOUT + 1, mesh)
    stages = [first, (module, module.init(jax.random.key(1), jnp.zeros((1, HIDDEN))))]
    params, apply = pipeline.sequential(stages)
    x, _ = make_data(0)
    slices = [pw.devices(mesh={"data": 2, "model": 2}, island=i) for i in range(2)]
    specs = [
        nnx.get_partition_spec(nnx.state(first, nnx.Param)),
        linen.get_partition_spec(stages[1][1])["params"],
    ]
    pipe = pipeline.Pipeline(stages, slices, param_specs=specs)
    assert pipe.params[0]["kernel"].sharding.spec == pw.P(None, "model")
    assert pipe.params[0]["bias"].sharding.spec == pw.P()
    assert pipe.params[1]["bias"].value.sharding.spec == pw.P("model")
    assert_tree_close(pipe.forward(x), jax.jit(apply)(jax.device_get(params), x))
    # A slice without the axis the names give: a named error before anything runs.
    no_model = [pw.devices(mesh={"data": 4}, island=i) for i in range(2)]
    with pytest.raises(
        pw.errors.PlacementError,
        match=r"stage 1 \(linen PartitionedDense\): parameter bias is declared with nn.with_partitioning "
        r"names \('model',\).*axes \('data',\), not 'model'",
    ):
        pipeline.Pipeline(stages, no_model)


def test_forward_matches_plain_jit():
    slices = island_slices(4)[:3]
    first, _, last = make_stages()
    # The stages as an NNX model holds its layers: nnx.Sequential's .layers, an nnx.List (was:
    # "not a sequence"), with a function among them, a stage without parameters (was: "expected
    # a Flax NNX module ..."), which train=True cannot change (as an apply_fn(params, x) taking
    # nothing more: was "cannot receive it").
    stages = nnx.Sequential(first, nnx.relu, last).layers
    params, apply = pipeline.sequential(stages)
    x, _ = make_data(3)
    pipe = pipeline.Pipeline(stages, slices, num_microbatches=4)  # inference only
    out = pipe.forward(x, train=True)
    assert out.slice is slices[-1]
    assert_tree_close(out, jax.jit(lambda p, x: apply(p, x, train=True))(params, x))
    pipeline.as_stage((None, lambda p, x: jnp.tanh(x))).check_train(True, None, 0, "Pipeline.train_step")
    # Any batch size, as under jax.jit: 7 examples are padded to 8 (4 microbatches over "data"
    # of 2) with a copy of the last, and cut back; the 7 are those of the full batch, bit for bit.
    odd = pipe.forward(x[:7], train=True)
    assert_tree_close(odd, jax.jit(apply)(params, x[:7]))
    np.testing.assert_array_equal(odd.result(timeout=60), np.asarray(out.result(timeout=60))[:7])
    with pytest.raises(pw.errors.ProgramTraceError, match="loss_fn= and optimizer="):
        pipe.train_step(x, x)


def test_one_program_call_per_step_without_retrace_or_recompile():
    slices = island_slices(2)
    pipe = pipeline.Pipeline(
        [Block(DIN, HIDDEN, 0), Block(HIDDEN, DOUT, 5)],
        slices,
        loss_fn=mse,
        optimizer=optax.adam(1e-2),
        num_microbatches=2,
    )
    x, y = make_data(0)
    pipe.train_step(x, y).result()
    after_first = pw.counters()
    losses = [pipe.train_step(*make_data(step)) for step in range(1, 4)]
    [loss.result() for loss in losses]
    final = pw.counters()
    for key in ("traces", "lowerings", "compiles"):
        assert final[key] == after_first[key], (key, after_first, final)
    assert final["runs"] - after_first["runs"] == 3  # one program run per step
    per_step = (final["dispatches"] - after_first["dispatches"]) / 3
    assert per_step == len(pipe.graph(x, y).nodes)


def test_data_parallel_islands_stay_identical_and_match_full_batch_training():
    slices = island_slices(2)
    tx = optax.adam(1e-2)
    batches = [make_data(step) for step in range(3)]
    want = reference_steps(make_stages(), tx, batches)
    dp = pipeline.DataParallel(make_stages(), slices, loss_fn=mse, optimizer=tx)
    graph = dp.graph(*batches[0])
    dcn = [t for t in graph.transfers if t.kind == "dcn"]
    assert len(dcn) == 3  # each island's gradient vector to the other, one loss to island 0
    for step, ((x, y), (want_loss, _, want_params)) in enumerate(zip(batches, want, strict=True)):
        loss = dp.train_step(x, y)
        if step == 0:
            loss.result()
            after_first = pw.counters()
        np.testing.assert_allclose(float(loss.result()), float(want_loss), rtol=1e-5)
        first, second = dp.params_per_island
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
            assert a.slice.island != b.slice.island
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert_tree_close(first, want_params)
    final = pw.counters()
    for key in ("traces", "lowerings", "compiles"):
        assert final[key] == after_first[key], key
    assert final["runs"] - after_first["runs"] == 2
    assert final["transfers_dcn"] - after_first["transfers_dcn"] == 2 * 3


def test_schedules_respect_dependencies_and_1f1b_bounds_live_activations():
    stages, micro = 4, 8
    for schedule in pipeline.SCHEDULES:
        order = pipeline.schedule_order(schedule, stages, micro)
        assert len(order) == len(set(order)) == (stages - 1) * micro * 2 + micro
        seen = set()
        live = [0] * stages
        peak = [0] * stages
        for kind, s, m in order:
            if kind in ("F", "L") and s > 0:
                assert ("F", s - 1, m) in seen
            if kind == "B":
                assert ("F", s, m) in seen
                assert (("L" if s + 1 == stages - 1 else "B"), s + 1, m) in seen
            live[s] += {"F": 1, "B": -1, "L": 0}[kind]
            peak[s] = max(peak[s], live[s])
            seen.add((kind, s, m))
        if schedule == "gpipe":
            assert peak[:-1] == [micro] * (stages - 1)
        else:
            assert peak[:-1] == [stages - s for s in range(stages - 1)]  # warm-up + 1
    assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    # Bad input is named, not a silent 1F1B order, an empty one or a negative bubble.
    with pytest.raises(
        pw.errors.PlacementError, match=r"schedule must be one of \('gpipe', '1f1b'\), got 'zb'"
    ):
        pipeline.schedule_order("zb", 2, 2)
    for stages_, micro_ in ((0, 2), (2, 0), (2, True), (2.0, 2)):
        with pytest.raises(pw.errors.PlacementError, match=r"must be an int >= 1"):
            pipeline.schedule_order("1f1b", stages_, micro_)
        with pytest.raises(pw.errors.PlacementError, match=r"must be an int >= 1"):
            pipeline.bubble_fraction(stages_, micro_)


def test_stage_and_slice_counts_must_match():
    slices = island_slices(2)
    with pytest.raises(pw.errors.PlacementError, match="3 stages but 2 device slices"):
        pipeline.Pipeline(make_stages(), slices, loss_fn=mse, optimizer=optax.sgd(0.1))
    with pytest.raises(pw.errors.ProgramTraceError, match="expected a Flax NNX module"):
        pipeline.Pipeline(["not a model", Block(HIDDEN, DOUT, 0)], slices)
    with pytest.raises(pw.errors.PlacementError, match="schedule must be one of"):
        pipeline.Pipeline(make_stages()[:2], slices, schedule="zigzag")
    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"got Sequential; .*pass them: Pipeline\(model.layers"
    ):
        pipeline.Pipeline(nnx.Sequential(*make_stages()[:2]), slices)
    # DataParallel composes an nnx.List of layers as it composes a list (was: one module with no call).
    layers = nnx.List(make_stages()[:2])
    dp = pipeline.DataParallel(layers, slices, loss_fn=mse, optimizer=optax.sgd(0.1))
    assert (
        dp.stage.description
        == pipeline.DataParallel(
            list(layers), slices, loss_fn=mse, optimizer=optax.sgd(0.1)
        ).stage.description
    )


def test_microbatches_must_divide_the_batch_before_anything_runs():
    slices = island_slices(2)
    pipe = pipeline.Pipeline(
        [Block(DIN, HIDDEN, 0), Block(HIDDEN, DOUT, 1)],
        slices,
        loss_fn=mse,
        optimizer=optax.sgd(0.1),
        num_microbatches=3,
    )
    before = pw.counters()
    with pytest.raises(pw.errors.PlacementError, match=r"batch of 8 examples, which num_microbatches=3"):
        pipe.train_step(*make_data(0))
    # 6 examples: 3 microbatches of 2, but each must also split over "data" (2): fine; 3 of 1: not.
    with pytest.raises(pw.errors.PlacementError, match=r"cannot be split over axis 'data' of size 2"):
        pipe.train_step(*make_data(0, batch=3))
    # No examples: a NaN loss, and an optimizer step on zero gradients (Adam's count goes on).
    x, y = make_data(0)
    with pytest.raises(pw.errors.PlacementError, match=r"x has a batch of 0 examples.*at least one"):
        pipe.train_step(x[:0], y[:0])
    assert pw.counters()["runs"] == before["runs"]
    assert pw.counters()["traces"] == before["traces"]
    # forward pads the batch instead, except under a last-stage output the padding would change.
    mean = pipeline.Pipeline([Block(DIN, HIDDEN, 0), (None, lambda p, h: jnp.mean(h))], slices)
    with pytest.raises(pw.errors.PlacementError, match=r"batch of 5 examples is padded to 6.*multiple of 2"):
        mean.forward(make_data(0, batch=5)[0])


def test_stage_output_must_fit_next_stage_before_anything_runs():
    slices = island_slices(2)
    pipe = pipeline.Pipeline(
        [Block(DIN, HIDDEN, 0), Block(HIDDEN + 1, DOUT, 1)],  # stage 1 takes 9 features, gets 8
        slices,
        loss_fn=mse,
        optimizer=optax.sgd(0.1),
        num_microbatches=2,
    )
    before = pw.counters()
    with pytest.raises(pw.errors.ProgramTraceError) as info:
        pipe.train_step(*make_data(0))
    message = str(info.value)
    assert "stage 1 (nnx Block) cannot take the output of stage 0, float32[4, 8]" in message
    assert re.search(r"must be what the next stage takes", message)
    assert pw.counters()["runs"] == before["runs"]
    assert pw.counters()["traces"] == before["traces"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", ["pipeline_transformer.py", "two_island_data_parallel.py"])
def test_transformer_examples_train_and_match_plain_jit(background_run, example):
    out = background_run[0].output()  # run in the background (conftest.py, BACKGROUND)
    losses = [float(v) for v in re.findall(r"^step\s+\d+\s+loss\s+([0-9.]+)", out, flags=re.MULTILINE)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], out
    assert "no new traces, lowerings or compiles" in out
    assert "match plain jax.jit" in out
