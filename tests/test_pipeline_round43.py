"""Pipelines, checkpoints, host input pipelines and notebooks as their users write them.

Each test is something the README promises for code nobody here wrote (Grain's own loaders
behind a ``HostIterator``, ...), checked against what plain JAX and the library itself give.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pathways_jax as pw
from pathways_jax import colocated_python, pipeline

pytestmark = pytest.mark.timeout(120)


class _Records:
    """A Grain data source with a stable ``repr`` (Grain's DataLoader checks it at ``set_state``)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": np.full((2,), i, np.float32)}

    def __repr__(self):
        return "_Records(64)"


def _grain_loader(shard):
    """A Grain DataLoader over this host's records: its iterator's state is bytes (JSON text)."""
    import grain

    sampler = grain.samplers.IndexSampler(
        num_records=64,
        shard_options=grain.sharding.ShardOptions(shard.index, shard.count),
        shuffle=True,
        seed=3,
        num_epochs=1,
    )
    loader = grain.DataLoader(
        data_source=_Records(),
        sampler=sampler,
        operations=[grain.transforms.Batch(4 // shard.count, drop_remainder=True)],
        worker_count=0,
    )
    return iter(loader)


def test_a_grain_data_loader_position_saves_as_json_and_resumes_where_it_was():
    """README: the positions save as JSON (``ocp.args.JsonSave(batches.get_state())``). A Grain
    DataLoader's iterator states are bytes, which JSON refuses: they are kept as text there, and
    ``set_state`` of the loaded JSON resumes at the same batch in a new iterator."""
    s = pw.devices(mesh={"x": 2})
    spec = {"x": jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))}
    batches = colocated_python.HostIterator(_grain_loader, spec)
    for _ in range(2):
        next(batches)
    saved = json.loads(json.dumps(batches.get_state()))
    want = [np.asarray(next(batches)["x"]) for _ in range(2)]

    resumed = colocated_python.HostIterator(_grain_loader, spec)
    resumed.set_state(saved)
    got = [np.asarray(next(resumed)["x"]) for _ in range(2)]
    np.testing.assert_array_equal(got, want)
    first = np.asarray(next(colocated_python.HostIterator(_grain_loader, spec))["x"])
    assert not np.array_equal(first, want[0])  # the position mattered
    with pytest.raises(pw.errors.PathwaysError, match="stays where it was"):
        resumed.set_state([{"iterator_text": 5}])  # text it cannot be
    np.testing.assert_array_equal(next(resumed)["x"], np.asarray(next(batches)["x"]))


class _InterruptedOnce:
    """Rows 0, 1, 2, ... of a batch; Ctrl-C lands in the second ``next`` (a notebook's interrupted cell)."""

    def __init__(self, shard):
        self.step = 0
        self.interrupted = False

    def __iter__(self):
        return self

    def __next__(self):
        if self.step == 1 and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        self.step += 1
        return np.full((2,), self.step - 1, np.float32)


def test_ctrl_c_while_next_waits_interrupts_that_wait_only():
    """With ``prefetch=0`` the local backend makes each batch on the caller's thread: Ctrl-C there
    interrupted the cell and was kept as the iterator's failure, so every later ``next`` raised
    KeyboardInterrupt again. Now it interrupts that wait only, as in a plain loop over the same
    iterator: the next ``next`` gives the batch that was being made."""
    s = pw.devices(mesh={"x": 1})
    spec = jax.ShapeDtypeStruct((2,), np.float32, sharding=s.sharding())
    batches = colocated_python.HostIterator(_InterruptedOnce, spec, prefetch=0)
    assert float(next(batches)[0]) == 0.0
    with pytest.raises(KeyboardInterrupt):
        next(batches)
    try:
        after = [float(next(batches)[0]) for _ in range(2)]
    except KeyboardInterrupt:  # (not let through: it would stop the whole test session)
        pytest.fail("next() raised the interrupt of an earlier call again")
    assert after == [1.0, 2.0]
    assert batches.get_state() == [{"taken": 3}]


class _Numbered:
    """Rows 0, 1, 2, ... of a batch (a class, as Grain's iterators are: Ctrl-C leaves it usable)."""

    def __init__(self, shard):
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.step += 1
        return np.full((2,), self.step - 1, np.float32)


def test_ctrl_c_while_next_waits_for_the_hosts_loses_no_batch(ray_cluster, monkeypatch):
    """On the Ray backend ``next`` waits for the hosts' answer. Ctrl-C in that wait took the batch
    off the queue: the next ``next`` gave the batch after it, and ``get_state`` counted one batch
    fewer than the hosts had made, so a resumed run repeated one. Now the interrupted batch is the
    next one given, as after Ctrl-C in a plain loop over the same iterator."""
    pw.init(backend="ray", hosts=1, devices_per_host=1)
    s = pw.devices(mesh={"x": 1})
    spec = jax.ShapeDtypeStruct((2,), np.float32, sharding=s.sharding())
    batches = colocated_python.HostIterator(_Numbered, spec, prefetch=0)
    assert float(next(batches)[0]) == 0.0

    def interrupted(self, *args, **kwargs):  # Ctrl-C, as it lands in the wait
        monkeypatch.undo()
        raise KeyboardInterrupt

    monkeypatch.setattr(pw.Future, "block_until_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(batches)
    assert [float(next(batches)[0]) for _ in range(2)] == [1.0, 2.0]
    assert batches.get_state() == [{"taken": 3}]


def _unreadable(x):
    raise OSError("shard file unreadable")


def test_a_batch_whose_run_failed_raises_that_runs_error_not_a_placement_error():
    """A batch made by a program that failed (a preprocessing step, or values on a lost host) is read
    as any future is: ``train_step``/``forward`` raised a ``PlacementError`` "x is Future ..., not an
    array", which ``except ProgramFailedError`` (or ``HostLostError``, as ``elastic_retry`` waits
    for) does not catch. Now it is the run's own error, and the models train on afterwards."""
    pw.init(islands=2)
    slices = [pw.devices(mesh={"data": 1}, island=i) for i in range(2)]

    @pw.program
    def preprocess(x):
        return jax.pure_callback(_unreadable, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2

    x, y = np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)
    failed = preprocess(x)

    def mse(out, target):
        return jnp.mean((out - target) ** 2)

    def linear(seed):
        return nnx.Linear(3, 2, rngs=nnx.Rngs(seed))

    pipe = pipeline.Pipeline(
        [linear(0), nnx.Linear(2, 2, rngs=nnx.Rngs(1))], slices, loss_fn=mse, optimizer=optax.sgd(0.1)
    )
    dp = pipeline.DataParallel(linear(0), slices, loss_fn=mse, optimizer=optax.sgd(0.1))
    manager = pw.elastic.Manager(
        pipeline.DataParallel(linear(0), slices, loss_fn=mse, optimizer=optax.sgd(0.1))
    )
    for call in (pipe.train_step, lambda x, y: pipe.forward(x), dp.train_step, manager.train_step):
        with pytest.raises(pw.errors.ProgramFailedError, match="shard file unreadable"):
            call(failed, y)
    assert float(dp.train_step(x, y)) == float(manager.train_step(x, y))
    assert np.isfinite(float(pipe.train_step(x, y)))


class _DroppedLinear(nnx.Module):
    """A layer with its own Dropout, whose ``__call__`` takes no ``rngs`` (as most user blocks)."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.linear(x))


def test_a_sequential_stage_of_blocks_with_their_own_dropout_draws_fresh_masks():
    """``nnx.Sequential`` takes ``rngs`` but hands them only to layers whose ``__call__`` takes them;
    a block holding its own Dropout draws from its own stream. Such a stage was refused for
    ``rngs={"dropout": key}`` with "draws from its stream 'dropout' ..., which the call's rngs
    (streams ['dropout']) do not reseed". Now those streams are reseeded from the call's keys:
    every microbatch and every key gets its own masks, and one key gives the same ones again."""
    pw.init(islands=2)
    slices = [pw.devices(mesh={"data": 1}, island=i) for i in range(2)]
    rngs = nnx.Rngs(0, dropout=1)
    stages = [nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), _DroppedLinear(rngs)), nnx.Linear(4, 4, rngs=rngs)]
    pipe = pipeline.Pipeline(
        stages,
        slices,
        loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
        optimizer=optax.sgd(0.1),
        num_microbatches=2,
    )
    x = np.tile(np.linspace(1.0, 2.0, 4, dtype=np.float32), (4, 1))  # both microbatches the same rows

    def forward(seed):
        return np.asarray(pipe.forward(x, rngs={"dropout": jax.random.key(seed)}, train=True))

    first = forward(0)
    np.testing.assert_array_equal(forward(0), first)
    assert not np.array_equal(first[:2], first[2:])  # each microbatch its own masks
    assert not np.array_equal(forward(1), first)
    assert not np.array_equal(np.asarray(pipe.forward(x, train=False)), first)
    assert np.isfinite(float(pipe.train_step(x, x, rngs={"dropout": jax.random.key(2)}, train=True)))


def test_a_stage_that_needs_train_or_eval_mode_says_to_pass_train():
    """``nnx.MultiHeadAttention(..., dropout_rate=0.1)`` must be told train or eval mode (plain NNX:
    ``model.train()`` first). With no ``train=``, the pipeline said to "fix the stage sizes or the
    input shape"; now it says to pass ``train=``, and either flag runs."""
    pw.init(islands=2)
    slices = [pw.devices(mesh={"data": 1}, island=i) for i in range(2)]
    rngs = nnx.Rngs(0, dropout=1)
    stages = [
        nnx.MultiHeadAttention(2, 4, decode=False, dropout_rate=0.1, rngs=rngs),
        nnx.Linear(4, 4, rngs=rngs),
    ]
    pipe = pipeline.Pipeline(
        stages, slices, loss_fn=lambda out, y: jnp.mean((out - y) ** 2), optimizer=optax.sgd(0.1)
    )
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(pw.errors.ProgramTraceError, match="Pass train=True") as caught:
        pipe.forward(x)
    assert "stage sizes" not in str(caught.value)
    assert np.asarray(pipe.forward(x, train=False)).shape == (2, 3, 4)
    assert np.isfinite(float(pipe.train_step(x, x, rngs={"dropout": jax.random.key(0)}, train=True)))


def test_an_elastic_manager_goes_on_from_a_state_its_model_loaded():
    """A rollback to a checkpoint (a loss spike) with the manager in place: ``dp.load_state(saved)``
    put the model at the saved step, but ``manager.step`` went on counting from the steps before
    (a loop over ``range(manager.step, total)`` skipped steps), and a lost island would have run
    the steps before the load again. Now the manager goes on from the loaded step."""
    pw.init(islands=2)
    slices = [pw.devices(mesh={"data": 1}, island=i) for i in range(2)]

    def mse(out, y):
        return jnp.mean((out - y) ** 2)

    def make():
        return pipeline.DataParallel(
            ({"w": jnp.zeros((3, 2))}, lambda p, x: x @ p["w"]),
            slices,
            loss_fn=mse,
            optimizer=optax.adam(0.1),
        )

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(6, 4, 3)).astype(np.float32)
    ys = rng.normal(size=(6, 4, 2)).astype(np.float32)
    dp = make()
    manager = pw.elastic.Manager(dp, window=2)
    for step in range(2):
        manager.train_step(xs[step], ys[step])
    saved = pw.results(dp.state)
    spiked = [manager.train_step(xs[step], ys[step]) for step in range(2, 5)]

    dp.load_state(saved)
    assert manager.step == 2
    resumed = [float(manager.train_step(xs[step], ys[step])) for step in range(manager.step, 6)]
    manager.wait(timeout=60)
    assert manager.step == 6 and int(np.asarray(pw.results(dp.state)["step"])) == 6
    reference = make()
    reference.load_state(saved)
    assert resumed == [float(reference.train_step(xs[step], ys[step])) for step in range(2, 6)]
    assert resumed[:3] == [float(loss) for loss in spiked]  # the steps before the load stay readable


def _three_rows(shard):
    while True:
        yield np.ones((3, 2), np.float32)


def test_rows_of_the_wrong_shape_are_named_as_the_iterators_not_jaxs():
    """A host's iterator yielding 3 rows for a batch of 4 raised JAX's "When calling
    `make_array_from_process_local_data` on a single process, global_shape should be ...", a
    function the user never called. Now the error names the iterator, what it gave and the shape
    this host's part must have."""
    s = pw.devices(mesh={"x": 2})
    spec = jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))
    batches = colocated_python.HostIterator(_three_rows, spec)
    with pytest.raises(
        pw.errors.PathwaysError, match=r"gave data of shape \(3, 2\).*on this host is \(4, 2\)"
    ) as caught:
        next(batches)
    assert isinstance(caught.value, ValueError)
    assert "make_array_from_process_local_data" not in str(caught.value)
