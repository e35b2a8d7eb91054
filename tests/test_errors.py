"""Bad input and failures: each error has the right type and says what was asked,
what exists and what to do (STYLE §7-8)."""

import functools
import inspect
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches

import pathways_jax as pw


def _line_of(fun, marker: str) -> int:
    """The file line number of the first line of ``fun``'s source containing ``marker``."""
    lines, start = inspect.getsourcelines(fun)
    for offset, text in enumerate(lines):
        if marker in text:
            return start + offset
    raise AssertionError(f"{marker!r} not in the source of {fun.__name__}")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception reachable through ``__cause__`` / ``__context__``."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


# --- pw.devices: requests that can never be met -------------------------------------------


def test_mesh_larger_than_any_island_names_request_and_islands():
    pw.init(num_cpu_devices=8, islands=2)
    with pytest.raises(pw.errors.ResourceError, match=r"slice of 8 devices on any island") as info:
        pw.devices(mesh={"x": 8})
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "island 0: 4 devices, island 1: 4 devices" in message
    assert "Ask for fewer devices" in message

    with pytest.raises(pw.errors.ResourceError, match=r"slice of 6 devices on island 1") as info:
        pw.devices(mesh=(3, 2), island=1)
    assert "island 0: 4 devices, island 1: 4 devices" in str(info.value)

    # The failed requests reserved nothing: a whole island is still free for an exclusive slice.
    whole = pw.devices(mesh={"x": 4}, island=0, exclusive=True, timeout=0)
    assert [d.id for d in whole.devices] == [0, 1, 2, 3]
    whole.release()


@pytest.mark.parametrize("island", [2, 7, -1, "0", True])
def test_unknown_island_lists_the_islands_that_exist(island):
    pw.init(num_cpu_devices=8, islands=2)
    with pytest.raises(pw.errors.ResourceError, match=rf"asked for island {island!r}") as info:
        pw.devices(mesh={"x": 2}, island=island)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "islands 0..1" in message
    assert "island=None" in message


@pytest.mark.parametrize(
    ("mesh", "fragment"),
    [
        ({"x": 0}, "mesh sizes must be positive ints"),
        ({"x": -2}, "mesh sizes must be positive ints"),
        ({"x": 2.0}, "mesh sizes must be positive ints"),
        ({"x": True}, "mesh sizes must be positive ints"),
        ({"x": 2, "y": 0}, "mesh sizes must be positive ints"),
        ({}, "at least one axis"),
        ((), "at least one axis"),
        ({"": 2}, "mesh axis names must be non-empty strings"),
        ({1: 2}, "mesh axis names must be non-empty strings"),
        ("x", "mesh must be a dict"),
        (4, "mesh must be a dict"),
        (None, "mesh must be a dict"),
    ],
)
def test_malformed_mesh(mesh, fragment):
    pw.init(num_cpu_devices=8)
    with pytest.raises(pw.errors.ResourceError, match=fragment) as info:
        pw.devices(mesh=mesh)
    assert isinstance(info.value, ValueError)
    # The message shows what arrived (the mesh, or its bad axis names).
    shown = repr(list(mesh)) if fragment.startswith("mesh axis names") else repr(mesh)
    assert shown in str(info.value)


@pytest.mark.parametrize(
    ("device_ids", "island", "fragment"),
    [
        (
            [0, 9],
            None,
            r"names 9, which is not a device id of this cluster; its ids are \[0, 1, 2, 3, 4, 5, 6, 7\]",
        ),
        ([0, "1"], None, r"names '1', which is not a device id"),
        ([0, 1, 2], None, r"names 3 devices, but the mesh has 2; name one device per mesh position"),
        ([1, 1], None, r"names a device more than once"),
        (
            [3, 4],
            None,
            r"spans islands \[0, 1\] \(island 0: 4 devices, island 1: 4 devices\); a slice lives on one",
        ),
        ([0, 1], 1, r"are on island 0, but island=1 was asked for"),
        ("01", None, r"device_ids must be a list of device ids in mesh order, got '01'"),
        (3, None, r"device_ids must be a list of device ids in mesh order, got 3"),
    ],
)
def test_device_ids_that_cannot_be_placed(device_ids, island, fragment):
    pw.init(num_cpu_devices=8, islands=2)
    with pytest.raises(pw.errors.ResourceError, match=fragment) as info:
        pw.devices(mesh={"x": 2}, device_ids=device_ids, island=island)
    assert isinstance(info.value, ValueError)
    assert set(pw.cluster().resources.load().values()) == {0}  # nothing was taken


def test_malformed_timeout():
    pw.init(num_cpu_devices=8)
    with pytest.raises(pw.errors.ResourceError, match=r"timeout must be None or a number >= 0, got -1"):
        pw.devices(mesh={"x": 2}, timeout=-1)


# --- pw.jit with nowhere to run -----------------------------------------------------------


def test_jit_with_specs_but_no_devices_called_directly():
    pw.init(num_cpu_devices=8)

    def add_one(x):
        return x + 1

    placed = pw.jit(add_one, out_specs=pw.P("x"))  # specs name a slice's axes: it needs one
    with pytest.raises(
        pw.errors.PlacementError, match=r"pw\.jit function 'add_one'.*with in_specs/out_specs but no devices"
    ) as info:
        line = inspect.currentframe().f_lineno + 1
        placed(jnp.ones(4))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert f"test_errors.py:{line}" in message  # where it was called
    assert "pw.jit(..., devices=slice)" in message  # what to do
    assert "with slice:" in message
    assert "leave the specs out" in message
    # Inside the slice its axes name, the same function runs.
    with pw.devices(mesh={"x": 4}):
        assert_matches(placed(jnp.ones(4)), jnp.ones(4) + 1)


def test_shard_map_over_a_mesh_other_than_the_slices_says_what_to_pass():
    # jax.make_mesh makes Explicit axes; a slice's are Auto unless asked: JAX refuses a shard_map
    # over that mesh inside the slice, and the error says what to do.
    pw.init(num_cpu_devices=8)
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    slice_ = pw.devices(mesh={"x": 2})

    def total(mesh):
        return lambda x: jax.shard_map(
            lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P(), out_specs=P()
        )(x)

    explicit = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
    with pytest.raises(pw.errors.ProgramTraceError, match="should match the mesh") as info:
        pw.jit(total(explicit), devices=slice_)(jnp.ones(()))
    assert isinstance(info.value, ValueError)  # JAX's class, as jax.jit raises it
    message = str(info.value)
    assert "mesh=slice.mesh" in message and "axis_types=" in message
    # What it says to do works, with jax.jit's result, on slices of either axis type.
    want = jax.jit(total(explicit))(jnp.ones(()))
    assert_matches(pw.jit(total(slice_.mesh), devices=slice_)(jnp.ones(())), want)
    typed = pw.devices(mesh={"x": 2}, axis_types=AxisType.Explicit)
    assert_matches(pw.jit(total(typed.mesh), devices=typed)(jnp.ones(())), want)
    # Errors of other kinds get no such hint.
    with pytest.raises(pw.errors.ProgramTraceError) as info:
        pw.jit(lambda x: x.reshape(3), devices=slice_)(jnp.ones(4))
    assert "mesh=slice.mesh" not in str(info.value) and "device_ids" not in str(info.value)


def test_a_sharding_over_other_devices_inside_a_slice_says_what_to_do():
    # A with_sharding_constraint naming a mesh of the user's over devices 0-1, inside a slice
    # the resource manager put on devices 2-3: JAX refuses it when lowering, and the error says
    # what to do; each way works, with jax.jit's result.
    pw.init(num_cpu_devices=8)
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    taken = pw.devices(mesh={"x": 2}, device_ids=[0, 1], exclusive=True)
    elsewhere = pw.devices(mesh={"x": 2})
    assert {d.id for d in elsewhere.devices}.isdisjoint({0, 1})

    def doubled(where):
        return lambda x: jax.lax.with_sharding_constraint(x * 2, where)

    with pytest.raises(pw.errors.PlacementError, match="incompatible devices") as info:
        pw.jit(doubled(NamedSharding(mesh, P("x"))), devices=elsewhere)(jnp.ones(4))
    assert isinstance(info.value, ValueError)
    assert "slice.mesh" in str(info.value) and "device_ids=" in str(info.value)
    want = jax.jit(doubled(NamedSharding(mesh, P("x"))))(jnp.ones(4))
    assert_matches(pw.jit(doubled(P("x")), devices=elsewhere)(jnp.ones(4)), want)
    taken.release()
    pinned = pw.devices(mesh={"x": 2}, device_ids=[0, 1])
    assert_matches(pw.jit(doubled(NamedSharding(mesh, P("x"))), devices=pinned)(jnp.ones(4)), want)


def test_jit_with_specs_but_no_devices_inside_program_without_devices():
    pw.init(num_cpu_devices=8)

    @functools.partial(pw.jit, in_specs=pw.P("x"))
    def add_one(x):
        return x + 1

    def unplaced_step(x):
        return add_one(x) * 2  # call without devices

    step = pw.program(unplaced_step)
    line = _line_of(unplaced_step, "# call without devices")
    with pytest.raises(pw.errors.PlacementError, match=r"'add_one'.*but no devices") as info:
        step(jnp.ones(4))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert f"test_errors.py:{line} (unplaced_step)" in message
    assert "@pw.program(devices=slice)" in message


# --- tracing errors name the program and the user's line ----------------------------------


def test_shape_mismatch_between_jitted_functions_names_program_and_line():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 4})

    @pw.jit(devices=s)
    def make(x):
        return x * 2  # shape (4,)

    @pw.jit(devices=s)
    def project(x):
        return x @ jnp.ones((3, 3))

    def mismatched_step(x):
        y = make(x)
        return project(y)  # the failing call

    step = pw.program(mismatched_step)
    line = _line_of(mismatched_step, "# the failing call")
    with pytest.raises(pw.errors.ProgramTraceError, match=r"program 'mismatched_step'") as info:
        step(jnp.ones(4))
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert f"test_errors.py:{line}" in message, message
    assert "(4,)" in message and "(3,)" in message  # what arrived vs what was expected
    assert isinstance(info.value.__cause__, TypeError)


# --- released slices ----------------------------------------------------------------------


def test_released_slice_is_unusable_everywhere():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})

    @pw.jit(devices=s)
    def inc(x):
        return x + 1

    @pw.program(devices=s)
    def step(x):
        return inc(x) * 2

    # Works while the slice is held (so a cached plan exists for the call below).
    np.testing.assert_allclose(np.asarray(step(jnp.ones(2)).result(timeout=60)), [4.0, 4.0])
    s.release()
    s.release()  # idempotent
    assert s.released

    with pytest.raises(pw.errors.PlacementError, match="was released") as info:
        inc(jnp.ones(2))
    assert isinstance(info.value, ValueError)
    assert "pw.devices(" in str(info.value)

    with pytest.raises(pw.errors.PlacementError, match="was released"):
        step(jnp.ones(2))  # same signature: cached graph and plan

    @pw.program(devices=s)
    def fresh(x):
        return x * 3

    with pytest.raises(pw.errors.PlacementError, match="was released"):
        fresh(jnp.ones(2))

    late = pw.jit(lambda x: x - 1, devices=s)
    with pytest.raises(pw.errors.PlacementError, match="was released"):
        late(jnp.ones(2))

    with pytest.raises(pw.errors.PlacementError, match="was released"):
        s.sharding("x")
    with pytest.raises(pw.errors.PlacementError, match="was released"):
        s.devices  # noqa: B018
    with pytest.raises(pw.errors.PlacementError, match="was released"), s:
        pass


# --- a node failing at run time -----------------------------------------------------------


def _explode(x):
    raise ValueError("boom: negative input")


@pytest.mark.timeout(60)
def test_runtime_failure_names_program_and_node_and_controller_keeps_serving():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 4})

    @pw.jit(devices=s)
    def checked(x):
        return jax.pure_callback(_explode, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    @pw.jit(devices=s)
    def double(x):
        return x * 2

    @pw.program(static_argnums=1)
    def risky_step(x, fail):
        return checked(x) if fail else double(x)

    x = jnp.arange(4.0)
    bad = risky_step(x, True)
    with pytest.raises(pw.errors.ProgramFailedError, match=r"program 'risky_step'") as info:
        bad.result(timeout=30)
    assert isinstance(info.value, RuntimeError)
    assert "'checked'" in str(info.value)  # the node
    chained = _chain(info.value)[1:]
    assert chained, "the original error is not chained"
    # JAX turns the callback's ValueError into a runtime error carrying its text.
    assert any(
        (isinstance(e, ValueError) and "boom: negative input" in str(e))
        or "ValueError: boom: negative input" in str(e)
        for e in chained
    ), [type(e) for e in chained]
    assert bad.done()
    with pytest.raises(pw.errors.ProgramFailedError):
        bad.result(timeout=30)  # stays failed

    # The controller keeps serving: the same program with good input, then another program.
    assert pw.cluster().controller.alive
    good = risky_step(x, False)
    want = jax.jit(lambda v: v * 2)(x)
    got = good.result(timeout=30)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want))

    @pw.program
    def next_program(v):
        return double(double(v))

    got = next_program(x).result(timeout=30)
    want = jax.jit(lambda v: v * 4)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want))
    assert pw.cluster().controller.alive


# --- pw.init ------------------------------------------------------------------------------


def test_init_twice():
    first = pw.init(num_cpu_devices=8, islands=2)
    assert pw.init(num_cpu_devices=8, islands=2) is first
    with pytest.raises(pw.errors.ClusterError, match=r"pw\.shutdown\(\) first") as info:
        pw.init(num_cpu_devices=8, islands=4)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "islands=4" in message and "islands=2" in message  # what was asked, what runs
    assert pw.cluster() is first
    assert len(first.islands) == 2


def test_init_with_other_device_count_after_jax_started():
    assert len(jax.devices()) == 8  # JAX's backend is running with 8 CPU devices
    with pytest.raises(pw.errors.ClusterError, match=r"num_cpu_devices=4.*8 CPU devices") as info:
        pw.init(num_cpu_devices=4)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "before any JAX" in message  # what to do
    assert "xla_force_host_platform_device_count=4" in message
    # Nothing half-started: a valid init still works and sees all 8 devices.
    assert len(pw.init(num_cpu_devices=8).devices) == 8


@pytest.mark.parametrize(
    ("islands", "says"),
    [
        (3, "must evenly divide the 8"),
        (5, "must evenly divide the 8"),
        (0, "at least 1 island"),
        (-2, "at least 1"),
    ],
)
def test_islands_must_divide_device_count(islands, says):
    with pytest.raises(pw.errors.ClusterError, match=rf"islands={islands}\b.*{says}") as info:
        pw.init(num_cpu_devices=8, islands=islands)
    assert isinstance(info.value, RuntimeError)
    assert "divisor" in str(info.value)


@pytest.mark.parametrize("reset", ["yes", "no", 1, None])
def test_stats_reset_must_be_a_bool(reset):
    # reset="no" was taken as true and reset the counts.
    pw.program(lambda v: v + 1)(jnp.ones(2)).result()
    before = pw.stats()
    with pytest.raises(pw.errors.ClusterError, match=r"reset=\.\.\.\) takes True or False, got"):
        pw.stats(reset=reset)
    assert pw.stats()["elapsed_s"] >= before["elapsed_s"]  # nothing was reset


def test_islands_with_unknown_device_id():
    with pytest.raises(pw.errors.ClusterError, match=r"names device id 42") as info:
        pw.init(num_cpu_devices=8, islands=[[0, 1, 2, 3], [4, 5, 6, 42]])
    assert isinstance(info.value, RuntimeError)
    assert "[0, 1, 2, 3, 4, 5, 6, 7]" in str(info.value)  # the ids that exist


def test_islands_with_duplicate_device_id():
    with pytest.raises(pw.errors.ClusterError, match=r"device id 3 appears in more than one island") as info:
        pw.init(num_cpu_devices=8, islands=[[0, 1, 2, 3], [3, 4, 5, 6]])
    assert isinstance(info.value, RuntimeError)
    assert "disjoint" in str(info.value)
    # The failed init left no cluster behind: a good one starts.
    cl = pw.init(num_cpu_devices=8, islands=[[0, 1], [2, 3, 4, 5, 6, 7]])
    assert [len(isl.devices) for isl in cl.islands] == [2, 6]


# --- exclusive slices ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_exclusive_request_times_out_then_succeeds_after_release():
    pw.init(num_cpu_devices=8, islands=2)
    held = pw.devices(mesh={"x": 4}, island=0, exclusive=True)

    start = time.monotonic()
    with pytest.raises(pw.errors.ResourceError, match=r"exclusive slice within timeout=0\.2s") as info:
        pw.devices(mesh={"x": 4}, island=0, exclusive=True, timeout=0.2)
    waited = time.monotonic() - start
    assert isinstance(info.value, ValueError)
    assert 0.2 <= waited < 5, waited
    assert "Release slices" in str(info.value)

    # No silent overcommit: a shared slice cannot land on reserved devices either.
    with pytest.raises(pw.errors.ResourceError, match="within timeout"):
        pw.devices(mesh={"x": 1}, island=0, timeout=0.2)
    # The other island is untouched.
    other = pw.devices(mesh={"x": 4}, island=1, exclusive=True, timeout=0.2)
    assert [d.id for d in other.devices] == [4, 5, 6, 7]
    other.release()

    # What holds the island asked for: here a shared slice, where the message counted the
    # whole cluster's exclusive devices only (4, all on island 0) and never named the shared one.
    shared = pw.devices(mesh={"x": 4}, island=1)
    with pytest.raises(pw.errors.ResourceError) as info:
        pw.devices(mesh={"x": 4}, island=1, exclusive=True, timeout=0.1)
    assert "4 devices did not come free on island 1 for an exclusive slice" in str(info.value)
    assert "0 of their 4 devices reserved by exclusive slices, 4 used by shared slices" in str(info.value)
    shared.release()
    other = pw.devices(mesh={"x": 4}, island=1, exclusive=True, timeout=0.2)

    held.release()
    again = pw.devices(mesh={"x": 4}, island=0, exclusive=True, timeout=0.2)
    assert [d.id for d in again.devices] == [0, 1, 2, 3]
    again.release()
    other.release()


@pytest.mark.timeout(60)
def test_waiting_exclusive_request_is_woken_by_release():
    pw.init(num_cpu_devices=8, islands=2)
    held = pw.devices(mesh={"x": 4}, island=0, exclusive=True)
    got: dict = {}

    def wait_for_island():
        try:
            got["slice"] = pw.devices(mesh={"x": 4}, island=0, exclusive=True, timeout=10)
            got["at"] = time.monotonic()
        except BaseException as exc:  # reported by the asserts below
            got["error"] = exc

    waiter = threading.Thread(target=wait_for_island, daemon=True)
    waiter.start()
    try:
        time.sleep(0.3)
        assert waiter.is_alive() and not got, "the request did not wait for the reserved island"
        released_at = time.monotonic()
        held.release()
        waiter.join(10)
    finally:
        held.release()
        waiter.join(15)
    assert "error" not in got, got.get("error")
    assert [d.id for d in got["slice"].devices] == [0, 1, 2, 3]
    assert got["at"] - released_at < 5  # woken by the release, not by its timeout
    got["slice"].release()


# --- bad program arguments ----------------------------------------------------------------


def test_string_argument_leaf():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})

    @pw.program(devices=s)
    def needs_array(x, y):
        return x + 1

    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"program 'needs_array' got argument leaf 1 of type str"
    ) as info:
        needs_array(jnp.ones(2), "hello")
    assert isinstance(info.value, TypeError)
    assert "static_argnums" in str(info.value)  # what to do


def test_unhashable_static_argument():
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})

    @pw.program(devices=s, static_argnums=1)
    def scaled(x, factors):
        return x * sum(factors)

    with pytest.raises(
        pw.errors.ProgramTraceError, match=r"static argument 1 of program 'scaled' must be hashable, got list"
    ) as info:
        scaled(jnp.ones(2), [1, 2])
    assert isinstance(info.value, TypeError)
    # A hashable value is fine.
    np.testing.assert_allclose(np.asarray(scaled(jnp.ones(2), (1, 2)).result(timeout=60)), [3.0, 3.0])

    power = pw.jit(lambda x, k: x ** len(k), devices=s, static_argnums=1)
    with pytest.raises(pw.errors.ProgramTraceError, match=r"must be hashable, got dict"):
        power(jnp.ones(2), {"k": 1})


# --- bad specs ----------------------------------------------------------------------------


def test_spec_naming_unknown_axis():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 4})

    with pytest.raises(pw.errors.PlacementError, match=r"in_specs P\('y',\) names axis 'y'") as info:
        pw.jit(lambda v: v, devices=s, in_specs=pw.P("y"))
    assert isinstance(info.value, ValueError)
    assert "has axes ('x',)" in str(info.value)

    with pytest.raises(pw.errors.PlacementError, match=r"names axis 'y'.*has axes \('x',\)"):
        pw.jit(lambda v: v, devices=s, in_specs=[pw.P("x"), pw.P(None, "y")])

    out_bad = pw.jit(lambda v: v * 2, devices=s, out_specs=pw.P("y"))
    with pytest.raises(pw.errors.PlacementError, match=r"out_specs .* names axis 'y'"):
        out_bad(jnp.ones(8))

    with pytest.raises(pw.errors.PlacementError, match=r"names axis 'y'"):
        s.sharding("y")


def test_spec_that_does_not_divide_a_dimension():
    pw.init(num_cpu_devices=8, islands=2)
    s = pw.devices(mesh={"x": 4})

    split_in = pw.jit(lambda v: v + 1, devices=s, in_specs=pw.P("x"))
    with pytest.raises(
        pw.errors.PlacementError, match=r"splits a dimension of size 6 into 4 parts for shape \(6,\)"
    ) as info:
        split_in(jnp.ones(6))
    assert isinstance(info.value, ValueError)
    assert "must divide evenly" in str(info.value)

    split_out = pw.jit(lambda v: v + 1, devices=s, out_specs=pw.P("x"))
    with pytest.raises(pw.errors.PlacementError, match=r"size 6 into 4 parts"):
        split_out(jnp.ones(6))

    too_long = pw.jit(lambda v: v + 1, devices=s, in_specs=pw.P("x", None))
    with pytest.raises(pw.errors.PlacementError, match=r"has 2 entries but the value has shape \(8,\)"):
        too_long(jnp.ones(8))

    @pw.program
    def step(v):
        return split_in(v)

    with pytest.raises(pw.errors.PlacementError, match=r"size 6 into 4 parts"):
        step(jnp.ones(6))
    # A dimension that divides evenly is fine.
    np.testing.assert_allclose(np.asarray(split_in(jnp.ones(8)).result(timeout=60)), np.full(8, 2.0))


def test_a_failed_transfer_fails_its_run_with_transfer_error():
    pw.init(num_cpu_devices=8, islands=2)
    a = pw.devices(mesh={"x": 2}, island=0)
    b = pw.devices(mesh={"x": 2}, island=1)
    make = pw.jit(lambda v: v + 1.0, devices=a)
    use = pw.jit(lambda v: v * 2.0, devices=b)
    fut = make(jnp.arange(4.0))
    fut.result(timeout=30).delete()  # the buffer is gone: moving it to island 1 must fail
    out = use(fut)
    with pytest.raises(pw.errors.ProgramFailedError, match="moving a value") as info:
        out.result(timeout=30)
    assert isinstance(info.value.__cause__, pw.errors.TransferError)
    assert "dcn" in str(info.value.__cause__)
    # The controller carries on.
    np.testing.assert_allclose(np.asarray(use(jnp.ones(2)).result(timeout=30)), [2.0, 2.0])


def test_a_tracer_leaked_from_an_earlier_trace_raises_unexpected_tracer_error_as_under_jax_jit():
    # make_jaxpr kept the leaked tracer as a constant: the run failed later, with
    # "Computation compiled for 2 inputs but called with 1".
    x = jnp.ones(3)
    for wrap in (jax.jit, pw.program):
        leaked = []

        def leak(a, leaked=leaked):
            leaked.append(a)
            return a * 2

        def use(a, leaked=leaked):
            return a + leaked[-1]

        wrap(leak)(x)
        with pytest.raises(jax.errors.UnexpectedTracerError) as caught:
            wrap(use)(x)
    assert isinstance(caught.value, pw.errors.ProgramTraceError)
    for part in ("program 'use'", "float32[3]", "escaped", "Return the value"):
        assert part in str(caught.value), (part, str(caught.value))
    # The program still runs once it is given the value.
    np.testing.assert_array_equal(
        pw.program(lambda a, b: a + b)(x, x * 2), jax.jit(lambda a, b: a + b)(x, x * 2)
    )


@pytest.mark.parametrize(
    ("timeout", "kind"),
    [
        (float("nan"), ValueError),
        (-1, ValueError),
        (float("-inf"), ValueError),
        ("1", TypeError),
        (True, TypeError),
    ],
)
def test_a_future_s_result_timeout_is_checked(timeout, kind):
    # NaN raised a bare ValueError from deep inside the store, inf an OverflowError, "1" a TypeError
    # about adding a str, True waited one second.
    future = pw.program(lambda v: v + 1)(jnp.ones(3))
    with pytest.raises(kind, match=r"takes None or a number of seconds >= 0, got") as caught:
        future.result(timeout=timeout)
    assert isinstance(caught.value, pw.errors.PathwaysError)
    assert "program '<lambda>'" in str(caught.value)
    np.testing.assert_array_equal(future.result(timeout=float("inf")), jax.jit(lambda v: v + 1)(jnp.ones(3)))


def test_a_program_called_with_arguments_its_function_does_not_take_names_the_call_line():
    # No line of the function failed: the message said "failed at an unknown line".
    def takes_one(v):
        return v + 1

    with pytest.raises(TypeError, match="takes 1 positional argument but 2 were given"):
        jax.jit(takes_one)(jnp.ones(2), jnp.ones(2))
    with pytest.raises(pw.errors.ProgramTraceError) as caught:
        pw.program(takes_one)(jnp.ones(2), jnp.ones(2))  # the call
    assert isinstance(caught.value, TypeError)
    line = _line_of(
        test_a_program_called_with_arguments_its_function_does_not_take_names_the_call_line, "# the call"
    )
    assert f"failed at the call (test_errors.py:{line} " in str(caught.value), str(caught.value)
