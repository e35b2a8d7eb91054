"""The Backend protocol: the controller dispatches through it alone, so a backend plugs in."""

import ast
import collections
import pathlib
import threading

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_matches

import pathways_jax as pw
from pathways_jax._src.backends import base, local, registry
from pathways_jax._src.backends.local import LocalBackend
from pathways_jax._src.backends.ray import RayBackend

SRC = pathlib.Path(pw.__file__).parent / "_src"


def test_the_built_in_backends_implement_the_protocol():
    assert isinstance(LocalBackend(), base.Backend)
    members = ["name", "islands", "window_size", "donates", "exports", "calls_back", "stages_inputs"]
    members += ["prepare", "execute", "settle", "close"]
    missing = [m for m in members if not hasattr(RayBackend, m)]
    assert missing == []


@pytest.mark.parametrize(
    "module", ["runtime/controller.py", "compile/lowering.py", "api/recording.py", "runtime/futures.py"]
)
def test_the_runtime_names_no_backend_implementation(module):
    """Only the cluster (which picks the backend) may know which backends exist."""
    tree = ast.parse((SRC / module).read_text())
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert not {n for n in named if n.endswith(("backends.local", "backends.ray"))}
    assert "RayBackend" not in (SRC / module).read_text()


class CountingBackend:
    """A third backend, by composition: local devices, a window of its own, every call counted."""

    name = "counting"
    window_size = 2
    donates = True
    exports = False
    calls_back = True
    stages_inputs = True

    def __init__(self, options):
        self.inner = local.start(options)
        self.islands = self.inner.islands
        self.lost: dict[int, str] = {}
        self.on_lost = None
        self.calls = collections.Counter()
        self.most_in_flight = 0
        self.lock = threading.Lock()

    def prepare(self, plan):
        self.calls["prepare"] += 1
        prepared = self.inner.prepare(plan)
        self.calls[type(prepared).__name__] += 1
        return prepared

    def execute(self, run, windows):
        self.calls["execute"] += 1
        backend = self

        class Watched:
            def make_room(self, key):
                windows.make_room(key)

            def in_flight(self, key, marker, run):
                windows.in_flight(key, marker, run)
                with backend.lock:
                    count = len(pw.cluster().controller.windows.entries[key])
                    backend.most_in_flight = max(backend.most_in_flight, count)

        dispatched = self.inner.execute(run, Watched())
        self.calls[type(dispatched).__name__] += 1
        return dispatched

    def settle(self, in_flight):
        self.calls["settle"] += 1
        self.inner.settle(in_flight)

    def close(self, timeout):
        self.calls["close"] += 1


@pytest.fixture
def counting_backend():
    """A third backend registered under "counting"; the instance the cluster started, once it did."""
    started = []

    def start(options):
        started.append(CountingBackend(options))
        return started[-1]

    registry.register("counting", start)
    yield started
    registry.unregister("counting")
    pw.shutdown()


@pytest.mark.timeout(120)
def test_a_third_backend_plugs_in_through_the_registry_alone(counting_backend):
    cluster = pw.init(backend="counting", num_cpu_devices=8, islands=2)
    (counting,) = counting_backend
    assert isinstance(counting, base.Backend)
    assert cluster.backend is counting and cluster.backend.name == "counting"
    assert [len(island.devices) for island in cluster.islands] == [4, 4]  # carved as pw.init asked
    s = pw.devices(mesh={"x": 2}, island=0)
    f = pw.jit(lambda v: jnp.tanh(v) + v.sum(), devices=s, in_specs=pw.P("x"))
    g = pw.jit(lambda v: v * 3 - 1, devices=s)

    @pw.program(fuse=False)
    def step(v):
        return g(f(v))

    want = jax.jit(lambda v: (jnp.tanh(v) + v.sum()) * 3 - 1)
    x = jnp.arange(8.0) / 8
    outs = []
    for _ in range(40):
        outs.append(step(x))
        x = outs[-1]
    expected = jnp.arange(8.0) / 8
    for out in outs:
        expected = want(expected)
        assert_matches(out, expected, rtol=1e-5, atol=1e-5)
    assert counting.calls["prepare"] == counting.calls["Prepared"] == 2  # for arrays, then for futures
    assert counting.calls["execute"] == counting.calls["Dispatched"] == 40  # typed records, not tuples
    assert counting.calls["settle"] >= 1  # the controller asked it which executables settled
    assert 1 <= counting.most_in_flight <= counting.window_size  # its own window, not max_in_flight
    s.release()
    pw.shutdown()
    assert counting.calls["close"] == 1


def test_a_backend_whose_prepare_returns_no_prepared_record_is_named_in_a_clear_error(counting_backend):
    pw.init(backend="counting", num_cpu_devices=8)
    (counting,) = counting_backend
    counting.prepare = lambda plan: None  # an old-style backend that changed the plan in place
    f = pw.jit(lambda v: v + 1, devices=pw.devices(mesh={"x": 2}))
    with pytest.raises(
        pw.errors.ClusterError, match=r"backend 'counting'.*prepare returned NoneType.*Prepared"
    ):
        f(jnp.ones(4))
    counting.prepare = lambda plan: CountingBackend.prepare(counting, plan)
    assert_matches(f(jnp.ones(4)), jnp.full(4, 2.0))  # the program is not left half compiled


def test_the_registry_refuses_what_is_not_a_backend():
    with pytest.raises(
        pw.errors.ClusterError, match=r"backend='nowhere' is not a backend; use one of \['local', 'ray'"
    ):
        pw.init(backend="nowhere")
    with pytest.raises(ValueError, match="registered already"):
        registry.register("local", local.start)
    with pytest.raises(ValueError, match="callable"):
        registry.register("broken", "not a function")
    closed = []

    class Half:  # a start function's result without the protocol: refused, and closed
        def close(self, timeout):
            closed.append(timeout)

    registry.register("half", lambda options: Half())
    try:
        with pytest.raises(pw.errors.ClusterError, match=r"returned Half, which lacks \['name', 'islands'"):
            pw.init(backend="half")
    finally:
        registry.unregister("half")
    assert closed == [0.0]
    assert pw.init().backend.name == "local"  # nothing of the refused starts is left behind
    pw.shutdown()


def test_optional_capabilities_are_protocols_not_classes():
    """Callers look for a capability (isinstance of a protocol), never for a backend's class."""
    from pathways_jax._src.backends.service_client import ServiceBackend

    assert not isinstance(LocalBackend(), (base.HostFleet, base.Shares, base.ServiceView))
    for name in ("place_of", "host_stats", "mark_lost"):
        assert callable(getattr(RayBackend, name)), name
    for name in ("share", "handle_of", "array_of", "service_stats"):
        assert callable(getattr(ServiceBackend, name)), name
    for module in ("api/sharing.py", "api/stats.py", "runtime/clusters.py"):
        text = (SRC / module).read_text()
        assert "ServiceBackend" not in text and "RayBackend" not in text, module
        assert 'backend == "ray"' not in text and "backends import local" not in text, module


def test_a_value_held_on_hosts_is_a_typed_capability():
    """The runtime waits for and fetches a value a backend holds elsewhere through a protocol
    (core.readiness.RemoteValue), never through attributes looked up by name."""
    import jax.numpy as jnp

    from pathways_jax._src.backends.ray_values import RemoteArray
    from pathways_jax._src.core import readiness

    assert issubclass(RemoteArray, readiness.RemoteValue)
    assert not isinstance(jnp.ones(2), readiness.RemoteValue)
    assert 'getattr(waiting, "wait_ready"' not in (SRC / "core/readiness.py").read_text()


def test_the_ray_backend_and_the_service_client_share_parts_by_composition():
    """Neither Ray-side backend subclasses the other: each holds a ray_dispatch.Dispatcher, given a
    route of its own, and no private hook of one is there for the other to override."""
    from pathways_jax._src.backends.service_client import ServiceBackend

    for backend in (RayBackend, ServiceBackend):
        assert backend.__mro__ == (backend, object), backend.__mro__  # no base class of behaviour
        assert isinstance(backend.__dict__.get("closed"), property) and callable(backend.__dict__["execute"])

    def private(cls):
        return {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}

    assert private(RayBackend) & private(ServiceBackend) == set()
    # The hooks the service's client used to override are gone from the Ray backend.
    hooks = ("_submit", "_message", "_send_run", "_take_uuids", "_fetched", "_value_lost", "_loss")
    hooks += ("_health_check", "_mark", "_apply", "_common")
    assert [h for h in hooks if hasattr(RayBackend, h)] == []
    # The dispatcher reaches the hosts only through its Route, which both routes implement.
    from pathways_jax._src.backends import ray_dispatch, ray_route, service_route

    route = {n for n in vars(ray_dispatch.Route) if not n.startswith("_")}
    tree = ast.parse((SRC / "backends/ray_dispatch.py").read_text())
    called = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "route"
    }
    assert called and called <= route, called - route
    for implementation in (ray_route.DirectRoute, service_route.ServiceRoute):
        assert [n for n in route if not callable(getattr(implementation, n, None))] == [], implementation
