"""pw.colocated_python: JAX's API, run on the Ray hosts that own the devices, and in-process locally."""

import gc
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, wait_for
from jax.experimental import colocated_python as jax_colocated

import pathways_jax as pw
from pathways_jax import colocated_python as colocated

pytestmark = pytest.mark.timeout(120)

DETECTION_BOUND_S = 10.0


def _scale_and_count(x, y):
    return {"sum": x * 2 + y, "n": jnp.full((2,), x.size, jnp.int32)}


def _host_stats(cluster, host):
    return cluster.backend.host_stats()[host]


# --- the Ray backend --------------------------------------------------------------------------


@pytest.mark.timeout(240)  # several checks of the module's in one: see below
def test_two_hosts_run_functions_and_class_instances_and_give_their_failures_remote_tracebacks(ray_cluster):
    # Four checks on one pair of hosts (starting hosts costs seconds each), in this order: the
    # hosts' counts of colocated functions and objects start from none.
    cluster = pw.init(backend="ray", hosts=2, devices_per_host=1)
    _results_equal_the_in_process_run_and_stay_on_the_host(cluster)
    _a_class_instance_keeps_its_state_on_its_host_until_deleted(cluster)
    _a_function_that_raises_gives_its_remote_traceback()
    _a_call_with_no_outputs_raises_its_failure_at_the_next_call()


def _results_equal_the_in_process_run_and_stay_on_the_host(cluster):
    s = pw.devices(mesh={"x": 1}, island=1)
    x = pw.jit(lambda v: v + 1, devices=s, out_specs=pw.P())(jnp.arange(6.0).reshape(2, 3))
    y = jax.device_put(jnp.ones((2, 3)), s.sharding(None))  # an array of this process: goes with the call

    @colocated.colocated_python
    def on_host(a, b):
        return _scale_and_count(a, b), jnp.full((1,), os.getpid(), jnp.int32)

    out, pid = on_host(x, b=y)
    # JAX's own colocated_python on the same values: on plain PJRT it runs in this process.
    from jax.experimental import colocated_python as jax_colocated

    want = jax_colocated.colocated_python(_scale_and_count)(x.result(), y)
    assert_matches(out, want)
    assert_matches(out, _scale_and_count(x.result(), y))
    assert int(pid.result()[0]) == cluster.backend.info[1]["pid"]  # it ran on host 1, not here

    # A second call goes at once (the function is on the host already); a program reads its
    # output where it is: no value comes here, none goes back.
    before = pw.counters()
    fed = _host_stats(cluster, 1)["fed"]
    again, _ = on_host(x, b=y)
    total = pw.jit(lambda d: d["sum"].sum() + d["n"].sum(), devices=s)(again)
    np.testing.assert_allclose(float(total.result()), float(want["sum"].sum() + want["n"].sum()))
    assert pw.counters()["fetches"] - before["fetches"] == 1  # the total only
    host = _host_stats(cluster, 1)
    assert host["fed"] == fed  # the program's input was the kept value, not data from here
    assert host["colocated"]["functions"] == 1


def test_out_specs_fn_makes_every_call_return_at_once_and_a_captured_mesh_names_host_devices(ray_cluster):
    pw.init(backend="ray", hosts=2, devices_per_host=2)
    s = pw.devices(mesh={"x": 2}, island=0)
    mesh = s.physical_mesh
    x = pw.jit(lambda v: v * 3, devices=s, out_specs=pw.P("x"))(jnp.arange(8.0))

    def shard_sums(v):
        # Captured: the controller's mesh, which names the host's own two devices there.
        sharding = jax.sharding.NamedSharding(mesh, jax.P("x"))
        return jax.device_put(v.reshape(2, 4).sum(axis=1), sharding)

    f = colocated.colocated_python(shard_sums).specialize(
        out_specs_fn=lambda v: jax.ShapeDtypeStruct((2,), v.dtype, sharding=v.sharding)
    )
    out = f(x)
    assert out.sharding == x.sharding
    assert_matches(out, (jnp.arange(8.0) * 3).reshape(2, 4).sum(axis=1))
    doubled = pw.jit(lambda v: v * 2, devices=s, out_specs=pw.P("x"))(f(x))
    assert_matches(doubled, (jnp.arange(8.0) * 3).reshape(2, 4).sum(axis=1) * 2)


def _a_class_instance_keeps_its_state_on_its_host_until_deleted(cluster):
    s = pw.devices(mesh={"x": 1}, island=1)

    @colocated.colocated_python_class
    class Accumulator:
        def __init__(self, start):
            self.total = start
            self.pid = os.getpid()

        def add(self, v):
            self.total = self.total + np.asarray(v)
            return jax.device_put(self.total, v.sharding)

        def where(self, v):
            return jnp.full(v.shape, self.pid, jnp.int32)

    one = jax.device_put(jnp.ones(3, jnp.int32), s.sharding(None))
    first, second = Accumulator(10), Accumulator(100)
    outs = [first.add(one) for _ in range(3)] + [second.add(one)]
    assert [o.result().tolist() for o in outs] == [[11] * 3, [12] * 3, [13] * 3, [101] * 3]
    assert int(first.where(one).result()[0]) == cluster.backend.info[1]["pid"]
    assert _host_stats(cluster, 1)["colocated"]["objects"] == 2
    del first, outs
    gc.collect()
    assert wait_for(lambda: _host_stats(cluster, 1)["colocated"]["objects"] == 1, timeout=10)
    assert second.add(one).result().tolist() == [102] * 3


def _a_function_that_raises_gives_its_remote_traceback():
    s = pw.devices(mesh={"x": 1}, island=1)
    x = jax.device_put(jnp.ones(2), s.sharding(None))

    def broken(v):
        raise ValueError("no batch left")

    f = colocated.colocated_python(broken).specialize(
        out_specs_fn=lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
    )
    with pytest.raises(
        pw.errors.ProgramFailedError, match="'broken' raised ValueError: no batch left"
    ) as caught:
        f(x).result(timeout=30)
    notes = []
    exc = caught.value
    while exc is not None:
        notes += getattr(exc, "__notes__", [])
        exc = exc.__cause__
    (note,) = [n for n in notes if n.startswith("remote traceback (host 1):")]
    assert "test_colocated.py" in note and 'raise ValueError("no batch left")' in note
    # Unspecialised, the first call waits to learn the outputs: it raises there.
    with pytest.raises(pw.errors.ProgramFailedError, match="no batch left"):
        colocated.colocated_python(broken)(x)


def _a_call_with_no_outputs_raises_its_failure_at_the_next_call():
    s = pw.devices(mesh={"x": 1})
    x = jax.device_put(jnp.ones(2), s.sharding(None))

    @colocated.colocated_python_class
    class Sink:
        def __init__(self):
            self.seen = 0

        def put(self, v):
            self.seen += 1
            if self.seen == 2:
                raise RuntimeError("sink full")

        def count(self, v):
            return jnp.full((1,), self.seen)

    sink = Sink()
    assert sink.put(x) is None  # learns it has no outputs (waits once)
    assert sink.put(x) is None  # returns at once; fails on the host
    assert int(sink.count(x).result()[0]) == 2  # in order, after both puts
    with pytest.raises(pw.errors.ProgramFailedError, match="sink full"):
        sink.put(x)


def test_a_host_lost_while_a_colocated_call_runs_is_a_named_error_not_a_hang(ray_cluster):
    cluster = pw.init(backend="ray", hosts=2, devices_per_host=1, replace_lost_hosts=False)
    s = pw.devices(mesh={"x": 1}, island=1)
    x = jax.device_put(jnp.ones(2), s.sharding(None))

    def dies(v):
        os.kill(os.getpid(), signal.SIGKILL)  # the host process dies in the call
        return v

    f = colocated.colocated_python(dies).specialize(
        out_specs_fn=lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
    )
    out = f(x)
    start = time.monotonic()
    with pytest.raises(pw.errors.HostLostError, match="host 1"):
        out.result(timeout=30)
    assert time.monotonic() - start <= DETECTION_BOUND_S
    assert 1 in cluster.backend.lost
    with pytest.raises(pw.errors.HostLostError, match="host 1"):
        colocated.colocated_python(dies)(x)  # a call on the lost island: refused at once


def _rows(shard):
    """Each host's rows of step ``i``'s global (4, 2) batch: row r holds 10 * i + r."""
    n = 4 // shard.count
    for step in range(1000):
        rows = np.arange(shard.index * n, (shard.index + 1) * n, dtype=np.float32)
        yield {"x": np.stack([rows + 10 * step, -rows], axis=1)}


def _grain_rows(shard):
    """``_rows`` as a Grain pipeline: its iterator's own ``get_state``/``set_state`` are the position."""
    import grain

    n = 4 // shard.count
    rows = np.arange(shard.index * n, (shard.index + 1) * n, dtype=np.float32)
    steps = grain.MapDataset.range(1000).map(lambda step: {"x": np.stack([rows + 10 * step, -rows], axis=1)})
    return iter(steps.to_iter_dataset())


def _global_batch(step):
    rows = np.arange(4, dtype=np.float32)
    return np.stack([rows + 10 * step, -rows], axis=1)


@pytest.mark.timeout(240)  # several checks of the module's in one: see below
def test_host_iterators_feed_a_program_and_their_state_survives_a_host_restart(ray_cluster, tmp_path):
    """Grain iterators on the hosts feed a program; their positions (Grain's own iterator state) are
    checkpointed with the training state by Orbax (the state written by the hosts), and both are
    restored onto the rebuilt island's new hosts."""
    import orbax.checkpoint as ocp

    cluster = pw.init(backend="ray", hosts=2, devices_per_host=1, islands=1)
    # First, on the same hosts (starting hosts costs seconds each): iterators that end or raise.
    _a_finite_host_iterator_ends_the_loop_and_one_that_raises_raises_at_next()
    s = pw.devices(mesh={"x": 2})  # one device on each host of the island
    batch = {"x": jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))}
    batches = colocated.HostIterator(_grain_rows, batch)
    step = pw.jit(lambda b: (b["x"] * 2).sum(axis=1), devices=s, out_specs=pw.P("x"))
    fed = {h: _host_stats(cluster, h)["fed"] for h in (0, 1)}
    for i in range(3):
        assert_matches(step(next(batches)), (_global_batch(i) * 2).sum(axis=1))
    assert {h: _host_stats(cluster, h)["fed"] for h in (0, 1)} == fed  # no batch went from here

    state = step(next(batches))  # the training state, as far as this test goes
    assert batches.get_state() == [{"iterator": {"next_index": 4}}] * 2
    manager = ocp.CheckpointManager(tmp_path)
    manager.save(
        4,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"y": state}), data=ocp.args.JsonSave(batches.get_state())
        ),
    )
    manager.wait_until_finished()
    abstract = {"y": ocp.utils.to_shape_dtype_struct(state)}
    assert_matches(next(batches)["x"], _global_batch(4))
    counter, zeros = (
        _Counter(),
        jax.device_put(jnp.zeros(2, jnp.int32), pw.devices(mesh={"x": 1}).sharding(None)),
    )
    assert [counter.bump(zeros).result().tolist() for _ in range(2)] == [[1, 1], [2, 2]]
    generation = cluster.backend.generations[0]
    pw.faults.kill_host(1)  # the island is lost, then rebuilt on new hosts
    assert wait_for(lambda: cluster.backend.generations[0] > generation and not cluster.backend.lost, 60)
    # An object's state went with its hosts (README): made again from its constructor's arguments.
    assert counter.bump(zeros).result().tolist() == [1, 1]
    restored = manager.restore(
        4, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore())
    )
    manager.close()
    assert_matches(restored.state["y"], (_global_batch(3) * 2).sum(axis=1))  # read by the new hosts
    assert restored.data == [{"iterator": {"next_index": 4}}] * 2
    batches.set_state(restored.data)  # the new hosts made their iterators anew: put them back at step 4
    assert_matches(next(batches)["x"], _global_batch(4))
    assert_matches(step(next(batches)), (_global_batch(5) * 2).sum(axis=1))


@colocated.colocated_python_class
class _Counter:
    """A colocated object with state: how many times ``bump`` ran on its host."""

    def __init__(self):
        self.calls = 0

    def bump(self, v):
        self.calls += 1
        return v + self.calls


def _three_rows(shard):
    """``_rows``' first three batches, then the end (a finite dataset)."""
    rows = _rows(shard)
    for _ in range(3):
        yield next(rows)


def _rows_then_fail(shard):
    rows = _rows(shard)
    yield next(rows)
    yield next(rows)
    raise OSError("shard file unreadable")


def _keyed_rows(shard):
    """``_rows``' first two batches, each with a typed PRNG key (the same on every host)."""
    rows = _rows(shard)
    for i in range(2):
        yield {**next(rows), "k": jax.random.key(i)}


def _draw(b):
    return b["x"].sum() + jax.random.uniform(b["k"])


def _check_keyed(batch, s):
    """A HostIterator whose batches hold typed keys: the program draws what jax.jit draws."""
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=s.sharding())
    keyed = colocated.HostIterator(_keyed_rows, {**batch, "k": key})
    got = [pw.jit(_draw, devices=s)(b) for b in keyed]
    want = [jax.jit(_draw)({"x": _global_batch(i), "k": jax.random.key(i)}) for i in range(2)]
    assert_matches(got, want, rtol=0, atol=0)


def _sum_loop(batches, s):
    """A training loop over ``batches`` that ends when they do: the running sum of every batch."""
    step = pw.jit(lambda acc, b: acc + b["x"].sum(), devices=s, out_specs=pw.P())
    acc = np.float32(0)
    taken = 0
    for batch in batches:
        acc = step(acc, batch)
        taken += 1
        if taken > 10:  # an iterator that does not end: the caller's count says so
            break
    return acc, taken


def _a_finite_host_iterator_ends_the_loop_and_one_that_raises_raises_at_next():
    """Batches are made ahead (prefetch) on the hosts, yet the loop ends after exactly the batches the
    hosts' iterators gave, no program sees a batch that was not made, and the position is the loop's."""
    s = pw.devices(mesh={"x": 2})
    batch = {"x": jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))}
    batches = colocated.HostIterator(_three_rows, batch, prefetch=2)
    first = next(batches)
    assert batches.get_state() == [{"taken": 1}] * 2  # not the batches made ahead
    acc, taken = _sum_loop(batches, s)
    assert taken == 2
    want = jax.jit(lambda: sum(jnp.asarray(_global_batch(i)).sum() for i in (1, 2)))()
    assert_matches(acc, want)  # the state trained on: no batch of the end reached it
    assert_matches(first["x"], _global_batch(0))
    with pytest.raises(StopIteration):
        next(batches)  # and again
    assert batches.get_state() == [{"taken": 3}] * 2
    _check_keyed(batch, s)

    failing = colocated.HostIterator(_rows_then_fail, batch)
    assert_matches(next(failing)["x"], _global_batch(0))
    assert_matches(next(failing)["x"], _global_batch(1))
    with pytest.raises(pw.errors.ProgramFailedError, match="OSError: shard file unreadable") as caught:
        next(failing)
    notes = []
    exc = caught.value
    while exc is not None:
        notes += getattr(exc, "__notes__", [])
        exc = exc.__cause__
    assert any("_rows_then_fail" in n and 'raise OSError("shard file unreadable")' in n for n in notes)


# --- the local backend ------------------------------------------------------------------------


def test_locally_it_runs_in_process_as_jax_does():
    s = pw.devices(mesh={"x": 2})
    x = jax.device_put(jnp.arange(4.0), s.sharding("x"))
    y = pw.jit(lambda v: v + 1, devices=s, out_specs=pw.P("x"))(jnp.arange(4.0))  # a future is taken too
    ours = colocated.colocated_python(_scale_and_count)(x, y)
    theirs = _scale_and_count(x, y.result())
    assert_matches(ours, theirs)
    assert isinstance(ours["sum"], jax.Array)

    @colocated.colocated_python_class
    class Counter:
        def __init__(self):
            self.n = 0

        def tick(self, v):
            self.n += 1
            return v * self.n

    counter = Counter()
    assert [float(counter.tick(x)[1]) for _ in range(3)] == [1.0, 2.0, 3.0]

    batches = colocated.HostIterator(
        _rows, {"x": jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))}
    )
    assert_matches(next(batches)["x"], _global_batch(0))
    state = batches.get_state()
    assert state == [{"taken": 1}]
    assert_matches(next(batches)["x"], _global_batch(1))
    batches.set_state(state)
    assert_matches(next(batches)["x"], _global_batch(1))
    assert _sum_loop(colocated.HostIterator(_three_rows, batches.batch), s)[1] == 3  # a loop ends
    _check_keyed(batches.batch, s)
    failing = colocated.HostIterator(_rows_then_fail, batches.batch)
    for i in range(2):  # the batches made before the error
        assert_matches(next(failing)["x"], _global_batch(i))
    with pytest.raises(OSError, match="shard file unreadable"):
        next(failing)
    with pytest.raises(TypeError, match="prefetch is a number of batches"):
        colocated.HostIterator(_rows, batches.batch, prefetch=-1)


def _small_ints(shard):
    yield {"x": np.arange(8, dtype=np.uint8).reshape(4, 2)}  # widens to float32: the same values
    yield {"x": np.full((4, 2), 0.5)}  # float data for an int leaf: the cast would change it


def test_a_host_iterator_widens_within_a_kind_and_refuses_a_cast_that_changes_values():
    s = pw.devices(mesh={"x": 1})
    floats = colocated.HostIterator(
        _small_ints, {"x": jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s.sharding("x"))}
    )
    assert_matches(next(floats)["x"], np.arange(8, dtype=np.float32).reshape(4, 2), rtol=0, atol=0)
    ints = colocated.HostIterator(
        _small_ints, {"x": jax.ShapeDtypeStruct((4, 2), np.int32, sharding=s.sharding())}
    )
    assert next(ints)["x"].dtype == np.int32
    with pytest.raises(pw.errors.PathwaysError, match="float64 data for a leaf of type int32") as caught:
        next(ints)
    assert isinstance(caught.value, TypeError)


# --- specialisation: the same errors as JAX's -------------------------------------------------


def _errors_of(module, make_call):
    try:
        make_call(module)
    except Exception as exc:
        return exc
    return None


def _twice(what):
    sds = jax.ShapeDtypeStruct((2,), jnp.float32)
    given = {
        "in_specs": {"in_specs": ((sds,), {})},
        "out_specs_fn": {"out_specs_fn": lambda x: x},
        "devices": {"devices": jax.devices()[:1]},
    }[what]
    return lambda m: m.colocated_python(lambda x: x).specialize(**given).specialize(**given)


@pytest.mark.parametrize(
    "case",
    [
        _twice("in_specs"),
        _twice("out_specs_fn"),
        _twice("devices"),
        lambda m: m.colocated_python(lambda: jnp.ones(2))(),
        lambda m: m.colocated_python(lambda x: x)(
            jax.ShapeDtypeStruct(
                (2,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
            )
        ),
        lambda m: m.colocated_python(lambda x, y: x)(
            jax.device_put(jnp.ones(2), jax.devices()[0]), jax.device_put(jnp.ones(2), jax.devices()[1])
        ),
    ],
    ids=[
        "in_specs twice",
        "out_specs_fn twice",
        "devices twice",
        "no inputs, no devices",
        "not an array",
        "two device lists",
    ],
)
def test_specialisation_errors_are_jax_s(case):
    theirs = _errors_of(jax_colocated, case)
    ours = _errors_of(colocated, case)
    assert isinstance(theirs, ValueError), theirs
    assert isinstance(ours, pw.errors.SpecializationError) and isinstance(ours, ValueError), ours
    if "device lists" in str(theirs):  # the sets' element order is the sets' own
        assert str(ours).startswith(
            "All arguments must use the same device list, but got multiple device lists"
        )
    else:
        assert str(ours) == str(theirs)


def test_cpu_devices_are_their_own_colocated_devices():
    s = pw.devices(mesh={"x": 2})
    assert colocated.colocated_cpu_devices(s.devices) == tuple(jax_colocated.colocated_cpu_devices(s.devices))
    assert colocated.colocated_cpu_devices(s.physical_mesh) == s.physical_mesh


def test_a_numpy_argument_is_refused_with_jax_s_message():
    # (JAX's own check stumbles first here: AttributeError, 'numpy.ndarray' has no 'sharding'.)
    with pytest.raises(
        pw.errors.SpecializationError,
        match=r"^colocated_python only supports jax.Array as input and output, but got <class 'numpy.ndarray'>.$",
    ):
        colocated.colocated_python(lambda x: x)(np.ones(2))


def test_the_ray_call_link_carries_colocated_calls_too(ray_cluster, monkeypatch):
    from pathways_jax._src.backends import host_link
    from pathways_jax._src.backends import ray as ray_backend

    monkeypatch.setattr(ray_backend, "make_link", lambda transport: host_link.RayCallLink())
    cluster = pw.init(backend="ray", hosts=1, devices_per_host=1)
    assert cluster.backend.link.stats()["transport"] == "ray"
    s = pw.devices(mesh={"x": 1})
    x = pw.jit(lambda v: v * 2, devices=s)(jnp.arange(3.0))
    out = colocated.colocated_python(lambda v: {"y": v + 1})(x)
    assert_matches(out, {"y": jnp.arange(3.0) * 2 + 1})
