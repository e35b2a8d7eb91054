"""The cluster, islands and the resource manager's placement of virtual slices."""

import threading
import time

import jax
import pytest
from jax.sharding import AbstractMesh, NamedSharding

import pathways_jax as pw


def test_default_cluster_is_one_island_of_all_devices():
    cl = pw.cluster()
    assert cl is pw.cluster()
    assert len(cl.islands) == 1
    assert [d.id for d in cl.islands[0].devices] == [d.id for d in jax.devices()]
    assert pw.init() is cl  # same arguments: a no-op


@pytest.mark.parametrize(
    ("islands", "expected"),
    [
        (2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ([[7, 6], [0, 1, 2]], [[7, 6], [0, 1, 2]]),
    ],
)
def test_islands_are_carved_as_asked(islands, expected):
    cl = pw.init(num_cpu_devices=8, islands=islands)
    assert [[d.id for d in isl.devices] for isl in cl.islands] == expected
    assert [isl.index for isl in cl.islands] == list(range(len(expected)))


def test_slice_exposes_mesh_shape_and_devices():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"data": 2, "model": 2}, island=1)
    assert s.shape == (2, 2) and s.axis_names == ("data", "model")
    assert isinstance(s.mesh, AbstractMesh)
    assert dict(s.mesh.shape) == {"data": 2, "model": 2}
    assert s.island == 1
    assert {d.id for d in s.devices} <= {4, 5, 6, 7} and len(s.devices) == 4
    sharding = s.sharding("data", None)
    assert isinstance(sharding, NamedSharding)
    assert sharding.spec == pw.P("data", None)
    assert set(sharding.device_set) == set(s.devices)
    t = pw.devices(mesh=(2, 2))
    assert t.axis_names == ("x", "y")


def test_shared_slices_go_to_the_least_loaded_devices_and_island():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2})
    b = pw.devices(mesh={"x": 2})
    c = pw.devices(mesh={"x": 4})
    ids = [{d.id for d in s.devices} for s in (a, b, c)]
    assert ids[0].isdisjoint(ids[1])
    assert a.island != b.island  # each went to the emptier island
    load = pw.cluster().resources.load()
    assert sum(load.values()) == 8
    # c filled the two idle devices of its island before sharing the busy ones.
    assert sorted(load[d.id] for d in c.devices) == [1, 1, 2, 2]
    for s in (a, b, c):
        s.release()
    assert set(pw.cluster().resources.load().values()) == {0}


def test_exclusive_slices_reserve_devices_and_release_wakes_waiters():
    pw.init(num_cpu_devices=8, islands=2)
    held = pw.devices(mesh={"x": 4}, island=0, exclusive=True)
    shared = pw.devices(mesh={"x": 4})
    assert shared.island == 1  # reserved devices are not shared out
    got = []

    def waiter():
        got.append(pw.devices(mesh={"x": 2}, island=0, exclusive=True, timeout=20))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    assert not got
    held.release()
    thread.join(20)
    assert got and got[0].island == 0 and got[0].exclusive


def test_slice_context_manager_places_pw_jit_and_nests():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    double = pw.jit(lambda v: v * 2)
    with a:
        out_a = double(jax.numpy.ones(2))
        with b:
            out_b = double(jax.numpy.ones(2))
    assert out_a.slice is a and out_b.slice is b
    assert set(out_b.sharding.device_set) == set(b.devices)


def test_release_is_idempotent_and_dropping_a_slice_gives_devices_back():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 8}, exclusive=True)
    s.release()
    s.release()
    t = pw.devices(mesh={"x": 8}, exclusive=True)
    del t
    import gc

    gc.collect()
    u = pw.devices(mesh={"x": 8}, exclusive=True, timeout=0)
    assert u.exclusive


def test_device_ids_map_a_slice_onto_named_devices_in_mesh_order():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2, "y": 2}, device_ids=[7, 5, 6, 4])
    assert a.island == 1
    assert [d.id for d in a.devices] == [7, 5, 6, 4]
    assert [[d.id for d in row] for row in a.physical_mesh.devices] == [[7, 5], [6, 4]]
    # A shared slice may name devices another slice holds, in another order.
    b = pw.devices(mesh={"x": 4}, device_ids=[4, 5, 6, 7], island=1)
    assert [d.id for d in b.devices] == [4, 5, 6, 7]
    assert pw.cluster().resources.load() == {0: 0, 1: 0, 2: 0, 3: 0, 4: 2, 5: 2, 6: 2, 7: 2}
    # Values follow the order: shard i of a P("x") value lives on the slice's i-th device.
    put = pw.jit(lambda v: v + 1, devices=a, in_specs=pw.P(("x", "y")), out_specs=pw.P(("x", "y")))
    out = put(jax.numpy.arange(4.0)).result()
    assert {s.device.id: float(s.data[0]) for s in out.addressable_shards} == {7: 1.0, 5: 2.0, 6: 3.0, 4: 4.0}
    np_ref = jax.jit(lambda v: v + 1)(jax.numpy.arange(4.0))
    assert out.tolist() == np_ref.tolist()
    a.release()
    b.release()
    assert set(pw.cluster().resources.load().values()) == {0}


@pytest.mark.timeout(60)
def test_named_devices_wait_for_exclusive_holders_like_any_request():
    pw.init(num_cpu_devices=8, islands=2)
    held = pw.devices(mesh={"x": 2}, device_ids=[2, 3], exclusive=True)
    # Devices a shared slice holds cannot be reserved; devices reserved cannot be shared.
    shared = pw.devices(mesh={"x": 2}, device_ids=[1, 0])
    with pytest.raises(pw.errors.ResourceError, match=r"devices \[0, 3\] of device_ids=\[0, 3\]") as info:
        pw.devices(mesh={"x": 2}, device_ids=[0, 3], exclusive=True, timeout=0.1)
    assert "were not free for an exclusive slice within timeout=0.1s" in str(info.value)
    with pytest.raises(pw.errors.ResourceError, match=r"devices \[3\] of device_ids=\[3, 1\]"):
        pw.devices(mesh={"x": 2}, device_ids=[3, 1], timeout=0.1)
    got = []

    def waiter():
        got.append(pw.devices(mesh={"x": 2}, device_ids=[3, 2], exclusive=True, timeout=20))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    assert not got
    held.release()
    thread.join(20)
    assert got and [d.id for d in got[0].devices] == [3, 2] and got[0].exclusive
    shared.release()


@pytest.mark.timeout(60)
def test_slices_only_dropped_values_and_programs_hold_do_not_block_an_exclusive_request():
    import gc

    import jax.numpy as jnp

    x = jnp.arange(16.0)
    s = pw.devices(mesh={"x": 4})
    f = pw.jit(lambda v: v * 2, devices=s)
    assert f(x).result(timeout=60).shape == (16,)
    # A program with no slice (where @jax.jit stood) runs on a slice of its own, shared.
    assert pw.program(lambda v: v + 1)(x).result(timeout=60).shape == (16,)
    del s, f
    gc.collect()  # the futures are gone; their values are freed lazily, at the next store use
    whole = pw.devices(mesh={"x": 8}, exclusive=True, timeout=5)
    assert len(whole.devices) == 8
    whole.release()
    # A program kept alive keeps its slice (and its plan) for its next call.
    keep = pw.program(lambda v: v * 3)
    assert_out = keep(x).result(timeout=60)
    with pytest.raises(pw.errors.ResourceError, match="exclusive"):
        pw.devices(mesh={"x": 8}, exclusive=True, timeout=0.5)
    assert (keep(x).result(timeout=60) == assert_out).all()
