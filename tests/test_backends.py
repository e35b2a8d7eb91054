"""The backend-agnostic suite: the same tests on the local backend and on Ray hosts.

Every backend gets the same topology: two islands of four devices. On Ray
it is made twice: two host actors of four CPU devices each (``"ray"``), and
four hosts of two devices grouped in islands of two hosts (``"ray-2host"``:
each island is one ``jax.distributed`` system, its slices span both hosts
and values cross hosts through the transfer servers), and once more as a
client process of a controller service with that topology (``"service"``:
``pw.serve``, started once for the module). Each backend's cluster (its hosts,
or this process joined to the service) is started once and serves every test
of the module, backend after backend: starting hosts costs seconds, and the
tests here are about what programs compute, not about a cluster's start and
end (test_ray_hosts.py, test_faults_*.py and test_service.py own those).
Between two tests every value the first made must be freed, on the hosts too.
Every result is compared with plain ``jax.jit`` on the same inputs.
"""

import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches, wait_for

import pathways_jax as pw
from pathways_jax._src.backends.base import HostFleet
from pathways_jax._src.runtime import clusters as cluster_lib

pytestmark = pytest.mark.timeout(180)
# One logical CPU a host: the 4 hosts of ray-2host, then (after they stopped) the service's 4.
# The suite's default size: the next module takes this Ray cluster over.
RAY_CPUS = 4


@pytest.fixture(scope="module")
def shared_service(ray_cluster):
    """A controller service with the same topology, for the whole module."""
    svc = pw.serve("backend-suite", hosts=4, devices_per_host=2, islands=2)
    try:
        yield svc
    finally:
        svc.stop()


def _end_cluster() -> None:
    pw.shutdown()
    cluster_lib._forget_shutdown()


@pytest.fixture(scope="module", params=["local", "ray", "ray-2host", "service"])
def backend(request):
    """One backend's cluster, started once for every test of the module (pytest groups them by backend)."""
    # Started (or taken over) before this cluster, so that it ends no cluster of ours.
    svc = request.getfixturevalue("shared_service") if request.param == "service" else None
    if request.param in ("ray", "ray-2host"):
        request.getfixturevalue("ray_cluster")
    _end_cluster()
    if request.param == "local":
        pw.init(num_cpu_devices=8, islands=2)
    elif request.param == "ray":
        pw.init(backend="ray", hosts=2, devices_per_host=4)
    elif svc is not None:
        pw.init(backend="ray", address=svc.address, service=svc.name)
    else:
        pw.init(backend="ray", hosts=4, devices_per_host=2, islands=2)
    assert [len(isl.devices) for isl in pw.cluster().islands] == [4, 4]
    try:
        yield request.param
    finally:
        _end_cluster()


@pytest.fixture(autouse=True)
def _fresh_cluster(backend):
    """Replaces the suite's cluster per test (conftest.py) by the module's, with nothing left behind.

    After each test, every value it made is freed (the store's and the
    hosts'): the next test starts from the same count, and a leak fails the
    test that left it.
    """
    before = _BASELINE.get(backend)
    if before is None:  # the backend's first test: its count, once every earlier value went
        gc.collect()
        before = _BASELINE[backend] = _live_values(backend)
    yield
    # Most values go with their last reference; a collection (a tenth of a second here) only
    # for those in reference cycles, when some are left. The hosts free theirs as told.
    if _live_values(backend) != before:
        gc.collect()
    assert wait_for(lambda: _live_values(backend) == before, timeout=30), (
        f"values left alive by this test: {_live_values(backend) - before}"
    )


# Each backend's count of live values between two tests: every test leaves it as it found it.
_BASELINE: dict[str, int] = {}


def _live_values(backend: str) -> int:
    """Values alive on the devices: in the controller's store, and on every host."""
    cluster = pw.cluster()
    count = cluster.store.live_count()
    if backend != "local":
        count += sum(s["values"] for s in cluster.backend.host_stats().values())
    return count


# --- programs -------------------------------------------------------------------------------


def test_sharded_node_equals_jit(backend):
    a = pw.devices(mesh={"x": 4})

    @pw.jit(devices=a, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    def f(x):
        return jnp.tanh(x) * 3 + x.sum()

    x = jnp.linspace(-2, 2, 32, dtype=jnp.float32)
    out = f(x)
    assert out.sharding.spec == pw.P("x")
    assert_matches(out, jax.jit(lambda v: jnp.tanh(v) * 3 + v.sum())(x), rtol=1e-5, atol=1e-5)


def test_slices_on_the_same_devices_in_two_orders_equal_jit(backend):
    forward = pw.devices(mesh={"x": 4}, device_ids=[4, 5, 6, 7])
    reverse = pw.devices(mesh={"x": 4}, device_ids=[7, 6, 5, 4])
    assert forward.island == reverse.island == 1
    assert [d.id for d in reverse.devices] == [7, 6, 5, 4]

    @pw.jit(devices=reverse, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    def scale(x):
        return x * 2 + x.sum()  # the sum over the sharded vector is an all-reduce

    @pw.jit(devices=forward, in_specs=(pw.P("x"),), out_specs=pw.P("x"))
    def shift(h):
        return jnp.tanh(h) - h.mean()

    @pw.program
    def both(x):
        return shift(scale(x))

    x = jnp.linspace(-1, 1, 16, dtype=jnp.float32)
    before = pw.counters()
    out = both(x)
    out.result(timeout=60)  # dispatched (and counted) by now
    after = pw.counters()
    # One reshard between the two orders, within the island.
    assert after["transfers_ici"] - before["transfers_ici"] == 1
    assert after["transfers_dcn"] == before["transfers_dcn"]
    assert_matches(
        out, jax.jit(lambda v: jnp.tanh(v * 2 + v.sum()) - (v * 2 + v.sum()).mean())(x), rtol=1e-5, atol=1e-5
    )


def test_two_island_program_moves_values_and_equals_jit(backend):
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)

    @pw.jit(devices=a, out_specs=pw.P("x"))
    def first(x, w):
        return jnp.sin(x @ w)

    @pw.jit(devices=b, in_specs=(pw.P("x"),))
    def second(h):
        return (h * 2).sum(axis=0), h.mean()

    @pw.program
    def step(x, w):
        h = first(x, w)
        s, m = second(h)
        return {"sum": s + 1.0, "mean": m, "h": h}

    x = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 16))

    def plain(x, w):
        h = jnp.sin(x @ w)
        return {"sum": (h * 2).sum(axis=0) + 1.0, "mean": h.mean(), "h": h}

    before = pw.counters()
    out = step(x, w)
    assert_matches(out, jax.jit(plain)(x, w), rtol=1e-5, atol=1e-5)
    assert pw.counters()["transfers_dcn"] - before["transfers_dcn"] == 1
    graph = step.graph(x, w)
    assert [t.kind for t in graph.transfers] == ["dcn"]


def test_numpy_arguments_and_constants_reach_the_hosts(backend):
    a = pw.devices(mesh={"x": 2}, island=1)
    table = jnp.arange(6.0).reshape(2, 3)  # closed over: a constant of the program

    @pw.program(devices=a)
    def step(x, scale):
        return (x @ table) * scale, jnp.float32(7.0)

    x = np.ones((4, 2), np.float32)
    got, seven = step(x, 2.0)
    x[:] = 5  # the call took its own copy of the argument
    assert_matches(
        (got, seven), (jax.jit(lambda v: (v @ table) * 2.0)(np.ones((4, 2), np.float32)), jnp.float32(7.0))
    )


# --- futures --------------------------------------------------------------------------------


def test_futures_feed_later_programs_and_stay_on_their_hosts(backend):
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    produce = pw.jit(lambda x: jnp.cos(x) * 2, devices=a, out_specs=pw.P("x"))
    grow = pw.jit(lambda y: y * y + 1, devices=a, in_specs=(pw.P("x"),))
    reduce = pw.jit(lambda y: jnp.cumsum(y), devices=b)

    x = jnp.arange(16.0)
    before = pw.counters()
    y = produce(x)
    chain = y
    for _ in range(5):
        chain = grow(chain)
    total = reduce(chain)  # island 0 -> island 1, never through the caller
    # Nothing has been brought back to the controller yet.
    assert pw.counters()["fetches"] == before["fetches"]
    want = jnp.cos(x) * 2
    for _ in range(5):
        want = want * want + 1
    assert_matches(total, jnp.cumsum(want), rtol=1e-5)
    assert_matches(y, jnp.cos(x) * 2)

    @pw.program(devices=b)
    def mix(scale, values, offset):  # host data around a future, in any argument position
        return values * scale + offset

    assert_matches(mix(np.float32(3), total, jnp.ones(16)), jnp.cumsum(want) * 3 + 1, rtol=1e-5)
    if backend != "local":
        assert pw.counters()["fetches"] - before["fetches"] == 3  # the three results asked for


def test_result_timeout_and_done(backend):
    a = pw.devices(mesh={"x": 1}, island=0)

    @pw.jit(devices=a)
    def slow(m):
        # A few tenths of a second of matmuls on one CPU device: far longer than the 1 ms waited.
        return jax.lax.fori_loop(0, 100, lambda i, v: jnp.tanh(v @ m) + 0.5, m)

    m = jax.random.normal(jax.random.key(2), (384, 384)) / 20
    slow(m).result(timeout=120)  # compiled (and warm) before timing
    out = slow(m)
    with pytest.raises(pw.errors.FutureTimeoutError, match=r"timeout=0\.001"):
        out.result(timeout=0.001)
    assert not out.done()
    assert_matches(
        out,
        jax.jit(lambda v: jax.lax.fori_loop(0, 100, lambda i, u: jnp.tanh(u @ v) + 0.5, v))(m),
        rtol=1e-4,
        atol=1e-4,
    )
    assert out.done()


def test_dropping_futures_frees_values_everywhere(backend):
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)
    f = pw.jit(lambda x: x * 2, devices=a, out_specs=pw.P("x"))
    g = pw.jit(lambda x: x + 1, devices=b, out_specs=pw.P("x"))
    baseline = _live_values(backend)
    outs = [g(f(jnp.full(8, float(i)))) for i in range(10)]
    outs[-1].result(timeout=60)
    assert _live_values(backend) > baseline
    del outs
    assert wait_for(lambda: _live_values(backend) == baseline), _live_values(backend)


def test_closing_a_client_frees_its_values_on_every_host(backend):
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)
    f = pw.jit(lambda x: jnp.sin(x), devices=a, out_specs=pw.P("x"))
    g = pw.jit(lambda x: x * 3, devices=b, out_specs=pw.P("x"))
    baseline = _live_values(backend)
    client = pw.client("tenant")
    with client:
        kept = [g(f(jnp.arange(8.0) + i)) for i in range(4)] + [f(jnp.ones(8))]
    kept[-1].result(timeout=60)
    assert _live_values(backend) > baseline
    client.close()
    assert wait_for(lambda: _live_values(backend) == baseline), _live_values(backend)
    with pytest.raises(pw.errors.PathwaysError, match="freed"):
        kept[0].result(timeout=10)
    # The controller keeps serving other clients.
    assert_matches(g(f(jnp.arange(8.0))), jnp.sin(jnp.arange(8.0)) * 3)


# --- counters, errors, concurrency ------------------------------------------------------------


def test_cached_calls_trace_lower_and_compile_nothing(backend):
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)

    @pw.program
    def step(x):
        with a:
            y = jnp.exp(x) - 1
        with b:
            return y.sum() * 2

    x = jnp.linspace(0, 1, 8)
    step(x).result(timeout=60)
    before = pw.counters()
    for i in range(5):
        out = step(x + i)
    assert_matches(out, jax.jit(lambda v: (jnp.exp(v) - 1).sum() * 2)(x + 4), rtol=1e-5)
    after = pw.counters()
    assert after["traces"] == before["traces"]
    assert after["lowerings"] == before["lowerings"]
    assert after["compiles"] == before["compiles"]
    assert after["runs"] - before["runs"] == 5


def test_bad_input_is_a_clear_error_before_anything_runs(backend):
    a = pw.devices(mesh={"x": 4}, island=0)

    @pw.program
    def unplaced(x):
        return x * 2  # no slice: it runs where jax.jit would (the argument's device)

    out = unplaced(jnp.ones(4))
    assert_matches(out, jnp.ones(4) * 2)
    assert len(out.sharding.device_set) == 1

    @pw.jit(devices=a, in_specs=(pw.P("x"),))
    def split(x):
        return x + 1

    with pytest.raises(pw.errors.PathwaysError):
        split(jnp.ones(6)).result(timeout=30)  # 6 rows do not split over 4 devices
    assert_matches(split(jnp.ones(8)), jnp.ones(8) + 1)


def test_host_callbacks_run_locally_and_are_refused_remotely(backend):
    a = pw.devices(mesh={"x": 1}, island=0)

    def host_double(v):
        return np.asarray(v) * 2

    @pw.jit(devices=a)
    def calls_back(x):
        return jax.pure_callback(host_double, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    if backend == "local":
        assert_matches(calls_back(jnp.arange(3.0)), jnp.arange(3.0) * 2)
    else:
        with pytest.raises(
            pw.errors.PlacementError, match=r"test_backends\.py:[0-9]+.*calls back into Python"
        ):
            calls_back(jnp.arange(3.0))
    # Either way the cluster keeps serving.
    assert_matches(pw.jit(lambda v: v - 1, devices=a)(jnp.arange(3.0)), jnp.arange(3.0) - 1)


def test_threads_with_collectives_on_both_islands_finish_and_match(backend):
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)

    @pw.program
    def step(x):
        with a:
            y = jax.lax.with_sharding_constraint(x * 2, a.sharding("x"))
            s = y.sum()  # an all-reduce over island 0
        with b:
            return jnp.tanh(y) + s  # a DCN move, then island 1's devices

    def plain(x):
        y = x * 2
        return jnp.tanh(y) + y.sum()

    results: dict[int, list] = {}
    failures: list[BaseException] = []

    def client_thread(index: int) -> None:
        try:
            with pw.client(f"t{index}"):
                outs = [step(jnp.arange(8.0) + index * 100 + j) for j in range(15)]
                results[index] = [o.result(timeout=120) for o in outs]
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert not failures, failures
    reference = jax.jit(plain)
    for index in range(4):
        for j, got in enumerate(results[index]):
            assert_matches(got, reference(jnp.arange(8.0) + index * 100 + j), rtol=1e-5)


def test_stats_account_each_client_s_programs(backend):
    a = pw.devices(mesh={"x": 4}, island=0)
    b = pw.devices(mesh={"x": 4}, island=1)
    f = pw.jit(lambda x: jnp.tanh(x) * 2, devices=a, out_specs=pw.P("x"))
    g = pw.jit(lambda x: x.sum(), devices=b)
    with pw.client("stats-tenant"):
        outs = [g(f(jnp.arange(32.0) + i)) for i in range(6)]
    assert_matches(outs[-1], jax.jit(lambda x: (jnp.tanh(x) * 2).sum())(jnp.arange(32.0) + 5), rtol=1e-5)

    def settled() -> bool:
        usage = pw.stats()["clients"].get("stats-tenant", {})
        return usage.get("programs") == 12

    assert wait_for(settled), pw.stats()["clients"]
    stats = pw.stats()
    usage = stats["clients"]["stats-tenant"]
    assert usage["failures"] == 0 and usage["device_time_s"] > 0
    used = {d.id for d in a.devices} | {d.id for d in b.devices}
    assert all(stats["devices"][d]["busy_s"] > 0 for d in used)


def test_trace_shows_each_island_s_work(backend, tmp_path):
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)

    @pw.program
    def step(x):
        with a:
            y = jnp.cos(x) * 2
        with b:
            return y.sum()

    step(jnp.arange(4.0)).result(timeout=60)
    started = time.monotonic()
    with pw.trace(tmp_path / "trace.json", drain_timeout=30) as recorder:
        outs = [step(jnp.arange(4.0) + i) for i in range(3)]
    assert time.monotonic() - started < 20, "the trace waited for work that had finished"
    assert_matches(outs[-1], jax.jit(lambda v: (jnp.cos(v) * 2).sum())(jnp.arange(4.0) + 2))
    executions = [e for e in recorder.events if e.get("cat") == "execution"]
    assert {e["args"]["island"] for e in executions} == {0, 1}
    assert not [e for e in executions if e["args"].get("unfinished") or e["args"].get("error")]
    assert len({e["args"]["run"] for e in executions}) == 3
    # Each device's track names the host that owns it: on hosts, the one the backend placed it on.
    cluster = pw.cluster()
    fleet = cluster.backend
    want = {
        d.id: fleet.place_of(d)[2] if isinstance(fleet, HostFleet) else d.process_index
        for island in cluster.islands
        for d in island.devices
    }
    drawn = {d["id"]: d["host"] for d in recorder.to_json()["otherData"]["devices"]}
    assert drawn and all(drawn[i] == want[i] for i in drawn)
    if backend != "local":
        assert len(set(drawn.values())) > 1  # the two islands' devices live on different hosts


# --- helpers built on the public API: pipelines and multi-island data parallel -----------------


def test_pipeline_and_data_parallel_train_like_plain_jit(backend):
    import optax
    from test_pipeline import assert_tree_close, make_data, make_stages, mse, reference_steps

    from pathways_jax import pipeline

    slices = [pw.devices(mesh={"data": 2}, island=i) for i in (0, 1, 1)]
    tx = optax.adam(1e-2)
    batches = [make_data(0), make_data(1)]
    want = reference_steps(make_stages(), tx, batches)
    pipe = pipeline.Pipeline(
        make_stages(), slices, loss_fn=mse, optimizer=tx, num_microbatches=2, schedule="1f1b"
    )
    for (x, y), (want_loss, _, want_params) in zip(batches, want, strict=True):
        np.testing.assert_allclose(
            float(pipe.train_step(x, y).result(timeout=120)), float(want_loss), rtol=1e-5
        )
        assert_tree_close(pipe.params, want_params)

    dp = pipeline.DataParallel(make_stages(), slices[:2], loss_fn=mse, optimizer=tx)
    for (x, y), (want_loss, _, want_params) in zip(batches, want, strict=True):
        np.testing.assert_allclose(
            float(dp.train_step(x, y).result(timeout=120)), float(want_loss), rtol=1e-5
        )
        first, second = dp.params_per_island
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert_tree_close(first, want_params)


def test_programs_that_place_nothing_return_their_arguments_and_literals(backend):
    # No node: the plan is prepared by no backend and no host takes part.
    assert_matches(pw.program(lambda: 3.0)(), jax.jit(lambda: 3.0)())
    s = pw.devices(mesh={"x": 1})
    values = [jnp.ones(2), jnp.asarray(True), jnp.arange(4, dtype=jnp.bfloat16)]
    ident = pw.program(lambda *v: v, devices=s)
    for got, want in zip(ident(*values), jax.jit(lambda *v: v)(*values), strict=True):
        assert_matches(got, want)
    step = pw.jit(lambda v: v * 2 + 1, devices=s)  # and the next program runs as usual
    assert_matches(step(jnp.arange(3.0)), jnp.arange(3.0) * 2 + 1)


def test_typed_prng_keys_go_in_come_out_and_feed_later_programs(backend):
    s = pw.devices(mesh={"x": 4})
    split = pw.jit(lambda k: jax.random.split(k, 4), devices=s)
    draw = pw.jit(lambda ks, v: jax.vmap(lambda k: jax.random.normal(k, (2,)))(ks) + v, devices=s)
    key, rbg = jax.random.key(7), jax.random.key(3, impl="rbg")
    want_keys = jax.jit(lambda k: jax.random.split(k, 4))(key)
    keys = split(key)  # a typed key in, typed keys out (kept where they were made)
    got_keys = keys.result(timeout=120)
    assert got_keys.dtype == want_keys.dtype
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(got_keys)), np.asarray(jax.random.key_data(want_keys))
    )
    want = jax.jit(lambda ks, v: jax.vmap(lambda k: jax.random.normal(k, (2,)))(ks) + v)(
        want_keys, jnp.ones((4, 2))
    )
    assert_matches(draw(keys, jnp.ones((4, 2))), want, rtol=1e-6)  # the future feeds the next program
    noise = pw.jit(lambda k, v: jax.random.uniform(k, v.shape) + v, devices=s)
    assert_matches(
        noise(rbg, jnp.zeros(8)), jax.jit(lambda k, v: jax.random.uniform(k, v.shape) + v)(rbg, jnp.zeros(8))
    )


def test_an_argument_returned_as_it_is_feeds_the_next_call(backend):
    # Frozen weights carried through a loop: on Ray the returned argument's future held the
    # controller's array, which a later run refused as "a future of another cluster".
    def step(frozen, w, x):
        return frozen, w - 0.1 * (x @ frozen).mean()

    frozen, w, x = np.ones((4, 4), np.float32), np.float32(1.0), np.ones((2, 4), np.float32)
    want, got = (frozen, w), (frozen, w)
    program = pw.program(step)
    for _ in range(3):
        want, got = jax.jit(step)(*want, x), program(*got, x)
    assert_matches(got, want)


def test_weakly_typed_outputs_stay_weak_as_jax_jit_s(backend):
    def lr(step):
        return 0.1 * 0.5**step

    want, got = jax.jit(lr)(2), pw.program(lr)(2)
    assert got.result().weak_type == want.weak_type is True  # Ray's fetch made it strong
    w = jnp.ones(3, jnp.bfloat16)
    assert (w * got).dtype == (w * want).dtype == jnp.bfloat16
    assert_matches(w * got, w * want)


def test_an_argument_only_dead_code_reads_is_taken_as_jax_jit_takes_it(backend):
    # Flax's model.init(key, dummy): the dummy feeds only shape inference, its computation is dead.
    # XLA's executable has no sharding for it, which the Ray backend refused.
    from flax import linen as nn

    model, dummy = nn.Dense(5), np.ones((4, 3), np.float32)
    assert_matches(
        pw.program(model.init)(jax.random.key(0), dummy), jax.jit(model.init)(jax.random.key(0), dummy)
    )
    dead = pw.program(lambda a, b: (jnp.sin(b), a * 2)[1])
    assert_matches(dead(jnp.ones(3), jnp.ones(2)), jnp.full(3, 2.0))


def test_eager_variable_writes_between_steps_after_the_documented_update(backend):
    # metrics.reset() and variable[...] = v between steps, as NNX training loops do. On Ray
    # hosts and a service the Variables hold futures; the README's nnx.update(model, pw.results(...)) makes them arrays.
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 1, rngs=rngs)
            self.calls = nnx.Variable(jnp.zeros(()))

        def __call__(self, x):
            self.calls[...] += 1
            return self.linear(x)

    def train(step, model, metrics, xs):
        seen = []
        for x in xs:
            step(model, metrics, x)
            nnx.update(model, pw.results(nnx.state(model)))
            nnx.update(metrics, pw.results(nnx.state(metrics)))
            seen.append((float(metrics.compute()), float(model.calls[...])))
            metrics.reset()
            model.calls[...] = 10.0
        return seen

    def body(model, metrics, x):
        loss = model(x).sum()
        metrics.update(values=loss)
        return loss

    xs = [np.full((4, 8), i, np.float32) for i in range(3)]
    mine = train(pw.program(body), Model(nnx.Rngs(0)), nnx.metrics.Average(), xs)
    theirs = train(nnx.jit(body), Model(nnx.Rngs(0)), nnx.metrics.Average(), xs)
    np.testing.assert_allclose(mine, theirs, rtol=1e-6)
    assert [calls for _, calls in mine] == [1.0, 11.0, 11.0]


def test_typed_keys_cross_hosts_as_their_key_data(backend):
    # An NNX Rngs key the runtime moves between hosts (Dropout on a slice of island 1 here,
    # or one spanning the hosts of an island): the transfer servers carry its raw key data.
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 1, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.linear(self.dropout(x))

    s = pw.devices(mesh={"data": 4}, island=1)
    mine, theirs = Model(nnx.Rngs(0, dropout=5)), Model(nnx.Rngs(0, dropout=5))
    step = pw.program(lambda m, x: m(x).sum(), devices=s)
    reference = nnx.jit(lambda m, x: m(x).sum())
    x = np.ones((4, 8), np.float32)
    for _ in range(3):
        np.testing.assert_allclose(float(step(mine, x)), float(reference(theirs, x)), rtol=1e-6)
    # A key made on one island and drawn from on the other.
    a, b = pw.devices(mesh={"x": 4}, island=0), pw.devices(mesh={"x": 4}, island=1)
    split = pw.jit(lambda k: jax.random.split(k, 4), devices=a)
    draw = pw.jit(lambda ks: jax.vmap(lambda k: jax.random.normal(k, (2,)))(ks), devices=b)
    key = jax.random.key(11)
    want = jax.jit(lambda k: jax.vmap(lambda k: jax.random.normal(k, (2,)))(jax.random.split(k, 4)))(key)
    assert_matches(pw.program(lambda k: draw(split(k)))(key), want, rtol=1e-6)
