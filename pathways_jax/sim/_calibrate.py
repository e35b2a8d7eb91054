"""``python -m pathways_jax.sim calibrate``: this machine's costs, measured, as a profile.

Every figure is a median of timed loops of chained calls (each call reads the
previous call's output, as the dispatch benchmark does), the loops interleaved
(their order rotating each repeat, so that the machine's drift hits all alike):

- ``device.computation_s[k]`` / ``launch_s[k]``: on ``k`` devices, ``jax.jit``
  calls of fused chains of 64 and of 256 computations (a computation: a scalar
  all-reduce and an add) give a computation's device time; separate calls of
  one computation (at most 16 in flight), less that, an executable's launch.
- ``jax.call_s``: a separate call of one computation on 1 device.
- ``device.inline[k]``: how much of a longer node's device time its call
  keeps the calling thread (XLA:CPU runs a 1-device executable on the
  caller's thread): the time inside a ``jax.jit`` call of the chain of 64,
  beyond a call of one computation, over the chain's extra device time; on 1
  device the runtime's own: a ``pw.jit`` call of the chain of 64 (``pw-mid``)
  against one of one computation (``pw-run``), over the same (above 1 when the
  run keeps the controller longer than the device time it adds).
- ``device.shared_cpu`` (not measured): 0 for 1 device, 1 from as many
  devices as the machine has cores, whose threads then fill the cores: a
  second of the controller's work while a node runs is a second it loses.
- ``controller.run_s`` / ``node_s``: a ``pw.jit`` call (one run of one node) and
  a ``@pw.program`` of ``L`` unfused nodes on 1 device, where the controller is
  the bottleneck: ``T(1) = run + node``, ``T(L) = run + L node``.
- ``controller.run_at_s[k]`` / ``node_at_s[k]`` (from 2 devices): the same two
  runs on ``k`` devices, by the CPU seconds of this process's Python threads
  (the caller's and the controller's; per-thread clocks, where the OS has
  them), the same two equations; ``device.launch_cpu_s[k]``: those threads'
  CPU seconds per ``jax.jit`` call of one computation on ``k`` devices. On CPU
  devices the XLA threads' work is the devices', and what the controller's
  threads spend beside it (more on more devices: each call hands work to ``k``
  device threads) is what the devices lose, less what ``jax.jit``'s own call
  spends, which ``launch_s`` already holds.
- Ray hosts (without ``--quick``, when Ray is installed): on 2 hosts of 1
  device, one node on host 0 (``A``), one node on each host (``B``), and ``R = 128``
  nodes on host 0 (``C``), each loop's CPU seconds per call in the
  controller's process and in each host's (see :func:`host_costs`):
  ``node_s = (ctrl_C - ctrl_A) / (R - 1)``, ``message_s = ctrl_B - ctrl_A -
  node_s``, ``dispatch_s = ctrl_A - run_s - node_s - message_s``; ``run_s =
  host_A - d`` and ``enqueue_s = (host_C - host_A) / (R - 1) - d``, ``d`` a
  node's device time. The same loops run again with no idle core (a spinning
  process per core but one beside them) give ``hosts_busy``: on a machine the
  hosts share, a process's CPU seconds per unit of work move with the load.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pathways_jax import errors
from pathways_jax._src.runtime.init_args import DEFAULT_IN_FLIGHT
from pathways_jax.sim._profile import ControllerCosts, DeviceCosts, HostCosts, LinkCosts, Profile

_L = 16  # nodes of the chained programs
# Nodes of the chained program on a Ray host: a host's cost per node is a few µs beside about
# a millisecond a run, so a short chain hides it in the run-to-run spread.
_RAY_L = 128
RAY_TARGET_S = 0.5  # the shortest timed loop on Ray hosts
_LONG = 256  # computations of the long fused node
_MID = 64  # computations of the shorter fused node (with _LONG: one computation's device time)
_WINDOW = 16  # in-flight bound of the plain-JAX loop (XLA's CPU runtime needs one, DESIGN §5)

Loop = Callable[[int], float]  # runs ``calls`` chained calls, returns the seconds they took


def _computation(x: Any, mesh: Any, n: int) -> Any:
    import jax
    from jax.sharding import PartitionSpec as P

    total = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P(), out_specs=P())(x)
    return total * (1.0 / n) + 1.0


def _calls(loop: Loop, target_s: float) -> int:
    """How many calls of ``loop`` last about ``target_s`` (after a warm-up)."""
    loop(2)  # compile, warm both argument kinds
    calls = 4
    while True:
        elapsed = loop(calls)
        if elapsed >= target_s / 4 or calls >= 1 << 18:
            break
        calls *= 4
    return max(4, int(calls * target_s / max(elapsed, 1e-9)))


def timer(loop: Loop, target_s: float) -> Callable[[], float]:
    """Sizes ``loop`` to last about ``target_s``; returns a timer of seconds per call."""
    calls = _calls(loop, target_s)
    return lambda: loop(calls) / calls


PYTHON = "/python"  # the suffix of a loop's figure: its Python threads' CPU seconds per call


def python_cpu() -> dict[int, float] | None:
    """Every Python thread of this process: its CPU seconds so far (None where the OS cannot say)."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return None
    out = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        # A thread that ends meanwhile has no clock left: it is left out.
        with contextlib.suppress(OSError, OverflowError):
            out[thread.ident] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return out


def python_cpu_timer(loop: Loop, target_s: float) -> Callable[[], dict[str, float]]:
    """Like :func:`timer`, with the CPU seconds per call of this process's Python threads.

    The timer's figures: ``""`` the seconds per call, ``PYTHON`` the CPU
    seconds the Python threads (the caller's, the controller's, every other)
    spent per call: on CPU devices the XLA threads' work is the devices', and
    beside it what the controller's threads spend decides what the devices
    lose. Without per-thread clocks (not every OS has them) only ``""``.
    """
    calls = _calls(loop, target_s)

    def timed() -> dict[str, float]:
        before = python_cpu()
        wall = loop(calls)
        after = python_cpu()
        if before is None or after is None:
            return {"": wall / calls}
        spent = sum(cpu - before.get(ident, 0.0) for ident, cpu in after.items())
        return {"": wall / calls, PYTHON: spent / calls}

    return timed


def cpu_timer(loop: Loop, target_s: float) -> Callable[[], dict[str, float]]:
    """Like :func:`timer`, on the Ray backend, with the CPU seconds per call of every process.

    The timer's figures: ``""`` the seconds per call, ``"/controller"`` this
    process's CPU seconds per call (every thread: the caller's, the
    controller's, Ray's), ``"/host<i>"`` host ``i``'s (its whole process, from
    its stats, read outside the timed calls).
    """
    import pathways_jax as pw
    from pathways_jax._src.backends.base import HostFleet

    calls = _calls(loop, target_s)
    remote = pw.cluster().backend
    if not isinstance(remote, HostFleet):
        raise errors.ClusterError(
            f"cpu_timer reads the hosts' CPU time: it needs hosts, not the {remote.name!r} backend."
        )

    def timed() -> dict[str, float]:
        hosts = remote.host_stats()
        cpu = time.process_time()
        wall = loop(calls)
        cpu = time.process_time() - cpu
        after = remote.host_stats()
        return {
            "": wall / calls,
            "/controller": cpu / calls,
            **{f"/host{i}": (after[i]["cpu_s"] - hosts[i]["cpu_s"]) / calls for i in sorted(hosts)},
        }

    return timed


BUSY = "-busy"  # the suffix of a loop measured with no idle core (see cores_taken)


@contextlib.contextmanager
def cores_taken(count: int | None = None) -> Iterator[list[subprocess.Popen]]:
    """No core of this machine idle meanwhile: ``count`` spinning processes (default: cores - 1).

    Beside the process that measures and the hosts it drives, one spinning
    process per core but one leaves no core idle, as when hosts outnumber the
    cores they share. A process's CPU seconds per unit of work move with that
    (the profile's ``hosts_busy``). Yields the processes; they are killed and
    reaped on the way out, whatever happens inside.
    """
    n = max(1, (os.cpu_count() or 1) - 1) if count is None else count
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            spinners.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        time.sleep(0.2)  # started and spinning before the loop begins
        yield spinners
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait()


def busy_cpu_timer(loop: Loop, target_s: float) -> Callable[[], dict[str, float]]:
    """:func:`cpu_timer` of ``loop`` sized and run with no idle core (:func:`cores_taken`)."""
    with cores_taken():
        timed = cpu_timer(loop, target_s)

    def busy() -> dict[str, float]:
        with cores_taken():
            return timed()

    return busy


def interleaved(timers: Mapping[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Every timer ``repeats`` times, the order rotating each repeat (drift hits all alike).

    A timer returns a figure, or several as ``{suffix: figure}`` (kept as ``name + suffix``).
    """
    names = list(timers)
    out: dict[str, list[float]] = {}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            value = timers[name]()
            for suffix, figure in value.items() if isinstance(value, Mapping) else [("", value)]:
                out.setdefault(name + suffix, []).append(figure)
    return out


def _chained(fn: Callable, x0: Any) -> Loop:
    """Chained ``pw`` calls (the runtime bounds what is in flight): seconds for ``calls``."""

    def loop(calls: int) -> float:
        start = time.perf_counter()
        x = x0
        for _ in range(calls):
            x = fn(x)
        x.result()
        return time.perf_counter() - start

    return loop


def _jax_chained(fn: Callable, x0: Any, *, inside: bool = False) -> Loop:
    """Chained ``jax.jit`` calls, at most 16 in flight (DESIGN §5: unbounded collectives deadlock).

    Returns the seconds of ``calls``, or with ``inside`` only the seconds spent
    inside the calls (the caller's thread).
    """

    def loop(calls: int) -> float:
        start = time.perf_counter()
        x, window, spent = x0, [], 0.0
        for _ in range(calls):
            before = time.perf_counter()
            x = fn(x)
            spent += time.perf_counter() - before
            window.append(x)
            if len(window) > _WINDOW:
                window.pop(0).block_until_ready()
        x.block_until_ready()
        return spent if inside else time.perf_counter() - start

    return loop


def device_loops(s: Any) -> dict[str, Loop]:
    """The loops that measure device costs on slice ``s`` (``n`` devices), keyed ``name/n``.

    ``jax-one/n``: separate ``jax.jit`` calls of one computation (at most 16 in
    flight); ``jax-mid/n`` / ``jax-long/n``: one ``jax.jit`` call of a fused chain
    of 64 / 256; ``jax-one-in/n`` / ``jax-mid-in/n``: the time the caller's
    thread spends inside a call of one computation / of the chain of 64.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = s.physical_mesh
    n = mesh.devices.size
    x0 = jax.device_put(jnp.zeros((), jnp.float32), NamedSharding(mesh, P()))

    def fused(length: int) -> Callable:
        def many(x):
            for _ in range(length):
                x = _computation(x, mesh, n)
            return x

        return jax.jit(many)

    one = jax.jit(lambda x: _computation(x, mesh, n))
    mid = fused(_MID)
    return {
        f"jax-one/{n}": _jax_chained(one, x0),
        f"jax-mid/{n}": _jax_chained(mid, x0),
        f"jax-long/{n}": _jax_chained(fused(_LONG), x0),
        f"jax-one-in/{n}": _jax_chained(one, x0, inside=True),
        f"jax-mid-in/{n}": _jax_chained(mid, x0, inside=True),
    }


def controller_loops(s: Any, suffix: str = "") -> dict[str, Loop]:
    """The controller's loops on slice ``s`` (1 device, or ``n`` with ``suffix`` ``/n``).

    ``pw-run``: a ``pw.jit`` call (one run of one node of one computation);
    ``pw-chain``: a run of 16 such nodes; ``pw-mid`` (1 device only): a
    ``pw.jit`` call of a fused chain of 64 computations (one node).
    """
    import jax.numpy as jnp

    import pathways_jax as pw

    mesh = s.physical_mesh
    n = mesh.devices.size
    one = pw.jit(lambda x: _computation(x, mesh, n), devices=s)

    def chain(x):
        for _ in range(_L):
            x = one(x)
        return x

    def mid(x):
        for _ in range(_MID):
            x = _computation(x, mesh, 1)
        return x

    prog = pw.program(chain, name="calibrate_chain", fuse=False)
    x0 = jnp.zeros((), jnp.float32)
    loops = {f"pw-run{suffix}": _chained(one, x0), f"pw-chain{suffix}": _chained(prog, x0)}
    if n == 1:
        loops["pw-mid"] = _chained(pw.jit(mid, devices=s), x0)
    return loops


def local_timers(s: Any, single: Any, target_s: float) -> dict[str, Callable[[], Any]]:
    """The timers of the local costs on slice ``s`` (``n`` devices), beside 1-device slice ``single``.

    ``device_loops(s)`` and ``controller_loops(single)`` by their seconds per
    call; from 2 devices also ``controller_loops(s, "/n")`` and ``jax-one/n``
    with their Python threads' CPU seconds (``PYTHON``).
    """
    n = s.physical_mesh.devices.size
    devices = device_loops(s)
    timers: dict[str, Callable[[], Any]] = {k: timer(v, target_s) for k, v in devices.items()}
    timers.update({k: timer(v, target_s) for k, v in controller_loops(single).items()})
    if n > 1:
        timers[f"jax-one/{n}"] = python_cpu_timer(devices[f"jax-one/{n}"], target_s)
        timers.update({k: python_cpu_timer(v, target_s) for k, v in controller_loops(s, f"/{n}").items()})
    return timers


def local_costs(
    per_call: Mapping[str, float], devices: list[int]
) -> tuple[ControllerCosts, DeviceCosts, float]:
    """The controller's and the devices' costs from the loops' seconds per call.

    Calls of fused chains of 64 and 256 computations (device-bound) differ by
    192 computations: a computation's ``c``. An executable's ``launch`` is a
    call of one computation (separate calls, 16 in flight) less ``c``.
    ``pw-run = run + node`` and ``pw-chain = run + 16 node`` give the
    controller's costs. ``device.shared_cpu`` is 0 for one device and 1 from
    as many devices as the machine has cores (their threads fill the cores:
    the controller's work is time they lose).
    """
    t1, tl = per_call["pw-run"], per_call["pw-chain"]
    node = max((tl - t1) / (_L - 1), 0.0)
    run_at, node_at, launch_cpu = {1: max(t1 - node, 0.0)}, {1: node}, {}
    for n in devices:
        if n > 1 and f"pw-run/{n}{PYTHON}" in per_call and f"jax-one/{n}{PYTHON}" in per_call:
            # On n CPU devices: the Python threads' CPU seconds of the same two runs, and of
            # jax.jit's own call (what the devices' figures already hold).
            c1, cl = per_call[f"pw-run/{n}{PYTHON}"], per_call[f"pw-chain/{n}{PYTHON}"]
            node_at[n] = max((cl - c1) / (_L - 1), 0.0)
            run_at[n] = max(c1 - node_at[n], 0.0)
            launch_cpu[n] = per_call[f"jax-one/{n}{PYTHON}"]
    if len(run_at) == 1:  # one device only (or no per-thread clocks): the scalars say it all
        run_at, node_at = {}, {}
    controller = ControllerCosts(
        run_s=max(t1 - node, 0.0), node_s=node, transfer_s=node, run_at_s=run_at, node_at_s=node_at
    )
    computation, launch, inline = {}, {}, {}
    for n in devices:
        mid, long = per_call[f"jax-mid/{n}"], per_call[f"jax-long/{n}"]
        computation[n] = max((long - mid) / (_LONG - _MID), 0.0)
        launch[n] = max(per_call[f"jax-one/{n}"] - computation[n], 0.0)
        # Of the chain's extra 63 computations, the part its call ran on the caller's thread.
        extra = per_call[f"jax-mid/{n}"] - per_call[f"jax-one/{n}"]
        inside = per_call[f"jax-mid-in/{n}"] - per_call[f"jax-one-in/{n}"]
        inline[n] = min(max(inside / extra, 0.0), 1.0) if extra > 0 else 0.0
        if n == 1 and "pw-mid" in per_call and extra > 0:
            # On one device the runtime's own call: how much longer a run of the chain of 64
            # keeps the controller than a run of one computation, per second of the extra
            # device time. It keeps it longer than the device time itself (above 1), where
            # jax.jit's call lets the caller go a little before the end.
            inline[n] = max((per_call["pw-mid"] - per_call["pw-run"]) / extra, 0.0)
    cores = max(2, os.cpu_count() or 2)
    device = DeviceCosts(
        launch_s=launch,
        computation_s=computation,
        shared_cpu={1: 0.0, cores: 1.0},
        inline=inline,
        launch_cpu_s=launch_cpu,
    )
    return controller, device, per_call[f"jax-one/{min(devices)}"]


LOCAL_SOURCES = {
    "device.computation_s": f"measured: a jax.jit call of a fused chain of {_LONG} scalar all-reduce + add "
    f"computations against one of {_MID}, per computation",
    "device.launch_s": "measured: separate jax.jit calls of one computation (16 in flight) less "
    "device.computation_s",
    "device.inline": f"measured: for 1 device, a pw.jit call of a fused chain of {_MID} against a call of "
    "one computation, over the jax.jit calls' difference; from 2 devices, the time a jax.jit call of a fused "
    f"chain of {_MID} keeps the caller's "
    "thread, beyond a call of one computation, over its device time beyond one computation's",
    "device.shared_cpu": "not measured: 0 for 1 device (its thread and the controller's fit the cores), 1 from "
    "as many devices as the machine has cores (their threads fill the cores: a second of the controller's "
    "work while they run is a second they lose)",
    "controller.run_s": "measured: pw.jit call (1-node run) less controller.node_s, 1 device",
    "controller.node_s": f"measured: a {_L}-node unfused @pw.program against a 1-node run, 1 device",
    "controller.transfer_s": "taken equal to controller.node_s (not measured separately)",
    "controller.run_at_s": "measured: from 2 devices, the Python threads' CPU seconds of a pw.jit call of one "
    "computation on that many devices (1-node run) less controller.node_at_s there; 1 device: controller.run_s",
    "controller.node_at_s": f"measured: from 2 devices, the Python threads' CPU seconds of a {_L}-node unfused "
    "@pw.program against a 1-node run on that many devices, per extra node; 1 device: controller.node_s",
    "device.launch_cpu_s": "measured: from 2 devices, the caller's CPU seconds per jax.jit call of one "
    "computation (16 in flight)",
    "jax.call_s": "measured: plain jax.jit calls of one computation on 1 device (16 in flight), per call",
    "ici": "CPU devices share memory: collectives are inside device.computation_s",
    "dcn": "not measured (no DCN on one machine): zero cost",
}


def ray_loops() -> dict[str, Loop]:
    """Loops on the Ray hosts ``pw.init(backend="ray", hosts=2, devices_per_host=1)`` started.

    ``ray-one``: one node on host 0 a run; ``ray-both``: one node on each host
    a run; ``ray-chain``: 128 nodes on host 0 a run.
    """
    import jax.numpy as jnp

    import pathways_jax as pw

    a = pw.devices(mesh={"x": 1}, island=0)
    b = pw.devices(mesh={"x": 1}, island=1)
    on_a = pw.jit(lambda x: x * 0.5 + 1.0, devices=a)
    on_b = pw.jit(lambda x: x * 0.5 + 1.0, devices=b)

    def chain(x):
        for _ in range(_RAY_L):
            x = on_a(x)
        return x

    both = pw.program(lambda xs: (on_a(xs[0]), on_b(xs[1])), name="calibrate_both")
    long = pw.program(chain, name="calibrate_host_chain", fuse=False)
    x0 = jnp.zeros((), jnp.float32)

    def both_loop(calls: int) -> float:
        start = time.perf_counter()
        xs: Any = (x0, x0)
        for _ in range(calls):
            xs = both(xs)
        xs[0].result()
        xs[1].result()
        return time.perf_counter() - start

    return {"ray-one": _chained(on_a, x0), "ray-both": both_loop, "ray-chain": _chained(long, x0)}


def host_costs(
    per_call: Mapping[str, float], controller: ControllerCosts, device: DeviceCosts, suffix: str = ""
) -> HostCosts:
    """Ray hosts' costs from ``ray_loops``' CPU seconds per call (``cpu_timer``'s figures).

    ``suffix``: whose loops (``BUSY``: those measured with no idle core, for
    the profile's ``hosts_busy``).

    CPU time, not elapsed time: on one machine the hosts, the controller and
    Ray take turns on the same cores, so a loop's elapsed time mixes every
    process's work; each process's CPU seconds are its own. The controller's
    process spends ``node_s`` on each further node of a run (``ray-chain``: 128
    nodes on host 0, against ``ray-one``: one), ``message_s`` and a node more
    on one more host (``ray-both``: a node on each host), and beyond those and
    ``controller.run_s`` what a run costs is ``dispatch_s``. A host's process
    spends ``run_s`` plus one node's device time on a run of one node, and
    ``enqueue_s`` plus a node's device time on each further node.
    """
    node_device = device.launch(1) + device.computation(1)
    ctrl_a, ctrl_b, ctrl_c = (per_call[f"ray-{k}{suffix}/controller"] for k in ("one", "both", "chain"))
    host_a, host_c = per_call[f"ray-one{suffix}/host0"], per_call[f"ray-chain{suffix}/host0"]
    node = max((ctrl_c - ctrl_a) / (_RAY_L - 1), 0.0)
    message = max(ctrl_b - ctrl_a - node, 0.0)
    return HostCosts(
        message_s=message,
        latency_s=0.0,
        run_s=max(host_a - node_device, 0.0),
        enqueue_s=max((host_c - host_a) / (_RAY_L - 1) - node_device, 0.0),
        dispatch_s=max(ctrl_a - controller.run_s - node - message, 0.0),
        node_s=node,
    )


HOST_SOURCES = {
    "hosts.message_s": "measured on 2 Ray hosts: the controller process's CPU seconds for one node on each "
    "host against one node on one host, less hosts.node_s",
    "hosts.enqueue_s": f"measured on 2 Ray hosts: the host process's CPU seconds for {_RAY_L} nodes against one "
    "node, per extra node, less a node's device time",
    "hosts.run_s": "measured: the host process's CPU seconds for a 1-node run, less the node's device time",
    "hosts.latency_s": "not separable on one machine (chained runs overlap it): zero",
    "hosts.node_s": f"measured on 2 Ray hosts: the controller process's CPU seconds for {_RAY_L} nodes on one host "
    "against one node, per extra node",
    "hosts.dispatch_s": "measured: the controller process's CPU seconds for a 1-node run on one Ray host, less "
    "controller.run_s, hosts.node_s and hosts.message_s",
    "hosts_busy": "measured as hosts.* from the same loops, each sized and run with no idle core: "
    "one spinning process per CPU core but one beside the controller's process and the hosts' "
    "(a shared machine's hosts pay them in proportion as they and the controller go from as many "
    "processes as its cores to twice as many)",
}


def start_ray(hosts: int) -> Any:
    """A local Ray cluster for ``hosts`` host actors (the caller shuts it down); None without Ray."""
    import warnings

    try:
        import ray
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(
            address="local", num_cpus=max(4, hosts + 2), include_dashboard=False, log_to_driver=False,
            configure_logging=False,
        )  # fmt: skip
    return ray


def _machine() -> dict:
    import jax

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
    }


def calibrate(
    *,
    quick: bool = False,
    devices: list[int] | None = None,
    ray: bool = True,
    name: str = "calibrated",
    log: Callable[[str], None] = print,
) -> Profile:
    """Measures this machine into a :class:`Profile` (see the module docstring for how).

    Must run before JAX's backend starts in this process (it sets the CPU device
    count): ``python -m pathways_jax.sim calibrate`` is the usual way.

    Args:
      quick: a few seconds: 1 and 2 devices, short loops, no Ray.
      devices: device counts to measure (default 1, 2, 4, 8).
      ray: also measure Ray hosts' message cost (skipped when Ray is missing or ``quick``).
      name: the profile's name.
      log: where progress lines go.
    """
    import pathways_jax as pw

    devices = sorted(set(devices or ([1, 2] if quick else [1, 2, 4, 8])))
    target_s, repeats = (0.01, 3) if quick else (0.1, 5)
    started = time.time()
    # One device more than the largest slice: the controller's loops run beside it.
    pw.init(num_cpu_devices=max(devices) + 1)
    log(f"calibrating on {os.cpu_count()} CPU cores, devices {devices}{' (quick)' if quick else ''}")
    single = pw.devices(mesh={"x": 1})
    samples: dict[str, list[float]] = {}
    for n in devices:
        s = pw.devices(mesh={"x": n})
        for k, v in interleaved(local_timers(s, single, target_s), repeats).items():
            samples.setdefault(k, []).extend(v)  # the controller's loops: beside every slice size
        s.release()
        log(
            f"  {n} device(s): one computation {statistics.median(samples[f'jax-one/{n}']) * 1e6:.1f} us "
            f"a call, {_LONG} fused {statistics.median(samples[f'jax-long/{n}']) * 1e6:.1f} us a call"
        )
    per_call = {k: statistics.median(v) for k, v in samples.items()}
    log(f"  pw.jit run {per_call['pw-run'] * 1e6:.1f} us, {_L}-node run {per_call['pw-chain'] * 1e6:.1f} us")
    single.release()
    pw.shutdown()
    controller, device, jax_call = local_costs(per_call, devices)
    log(f"  -> run_s {controller.run_s * 1e6:.1f} us, node_s {controller.node_s * 1e6:.2f} us")
    for n in sorted(set(controller.run_at_s) - {1}):
        log(
            f"  -> on {n} devices: run {controller.run(n) * 1e6:.1f} us, node {controller.node(n) * 1e6:.2f} us "
            f"of the Python threads' CPU, jax.jit's call {device.launch_cpu(n) * 1e6:.1f} us"
        )
    hosts = HostCosts()
    hosts_busy: HostCosts | None = None
    sources = dict(LOCAL_SOURCES)
    if ray and not quick:
        ray_mod = start_ray(2)
        if ray_mod is None:
            log("Ray is not installed (pip install 'pathways-jax[ray]'): no host costs measured.")
        else:
            try:
                pw.init(backend="ray", hosts=2, devices_per_host=1)
                loops = ray_loops()
                # Loops of at least RAY_TARGET_S: a loop's fixed cost (its first run's latency, the
                # fetch at its end: milliseconds on Ray hosts) must stay small beside its runs.
                ray_target = max(target_s, RAY_TARGET_S)
                timers = {
                    **{k: cpu_timer(v, ray_target) for k, v in loops.items()},
                    **{k + BUSY: busy_cpu_timer(v, ray_target) for k, v in loops.items()},
                }
                samples = interleaved(timers, repeats)
                per_call.update({k: statistics.median(v) for k, v in samples.items()})
            finally:
                pw.shutdown()
                ray_mod.shutdown()
            hosts = host_costs(per_call, controller, device)
            hosts_busy = host_costs(per_call, controller, device, BUSY)
            sources.update(HOST_SOURCES)
            log(
                "  Ray, 2 hosts, a call's elapsed / controller CPU / host 0 CPU: "
                + ", ".join(
                    f"{what} {per_call[k] * 1e6:.0f} / {per_call[k + '/controller'] * 1e6:.0f} / "
                    f"{per_call[k + '/host0'] * 1e6:.0f} us"
                    for k, what in (
                        ("ray-one", "1 node on 1 host"),
                        ("ray-both", "1 node on each"),
                        ("ray-chain", f"{_RAY_L} nodes on 1 host"),
                    )
                )
            )
            log(
                f"  -> hosts: message_s {hosts.message_s * 1e6:.1f} us, dispatch_s {hosts.dispatch_s * 1e6:.1f} us, "
                f"node_s {hosts.node_s * 1e6:.2f} us, run_s {hosts.run_s * 1e6:.1f} us, "
                f"enqueue_s {hosts.enqueue_s * 1e6:.2f} us; with no idle core: run_s "
                f"{hosts_busy.run_s * 1e6:.1f} us, enqueue_s {hosts_busy.enqueue_s * 1e6:.2f} us"
            )
    elif ray:
        log("quick mode: Ray hosts not measured")
    return Profile(
        name=name,
        controller=controller,
        hosts=hosts,
        hosts_busy=hosts_busy,
        device=device,
        ici=LinkCosts(),
        dcn=LinkCosts(),
        jax_call_s=jax_call,
        in_flight=DEFAULT_IN_FLIGHT,
        host_in_flight=64,
        devices_per_host=max(devices),
        sources=sources,
        meta={
            "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "seconds": round(time.time() - started, 1),
            "quick": quick,
            "machine": _machine(),
            "per_call_s": per_call,
        },
    )
