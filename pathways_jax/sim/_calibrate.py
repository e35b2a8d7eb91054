"""``python -m pathways_jax.sim calibrate``: this machine's costs, measured, as a profile.

Every figure is a median of timed loops of chained calls (each call reads the
previous call's output, as the dispatch benchmark does):

- ``jax.call_s``: a plain ``jax.jit`` call of the dispatch computation (a
  scalar all-reduce and an add) on 1 device.
- ``device.computation_s[k]``: one such computation inside a fused node on
  ``k`` devices (a jitted chain of them, divided by its length).
- ``device.launch_s[k]``: one executable on ``k`` devices, beyond its
  computation: the time per call of a loop of separate jitted calls (at most 16
  in flight), less ``computation_s[k]``.
- ``controller.run_s`` / ``node_s``: a ``pw.jit`` call (one run of one node) and
  a ``@pw.program`` of ``L`` unfused nodes on 1 device, where the controller is
  the bottleneck: ``T(1) = run + node``, ``T(L) = run + L node``.
- Ray hosts (without ``--quick``, when Ray is installed): on 2 hosts of 1
  device, one node on host 0 (``T_A``), one node on each host (``T_B``), and
  ``L`` nodes on host 0 (``T_C``): ``message_s = T_B - T_A - node_s``,
  ``enqueue_s = (T_C - T_A) / (L - 1) - node_s``, and what a one-host run costs
  beyond the controller's part is the host's ``run_s``.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from pathways_jax.sim._profile import ControllerCosts, DeviceCosts, HostCosts, LinkCosts, Profile

_L = 16  # nodes of the chained programs
_WINDOW = 16  # in-flight bound of the plain-JAX loop (XLA's CPU runtime needs one, DESIGN §5)


def _computation(x: Any, mesh: Any, n: int) -> Any:
    import jax
    from jax.sharding import PartitionSpec as P

    total = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P(), out_specs=P())(x)
    return total * (1.0 / n) + 1.0


def _per_call(loop: Callable[[int], float], target_s: float, repeats: int) -> float:
    """Median seconds per call of ``loop(calls)`` (which returns its elapsed seconds)."""
    loop(2)
    calls = 4
    while True:
        elapsed = loop(calls)
        if elapsed >= target_s / 4 or calls >= 1 << 18:
            break
        calls *= 4
    calls = max(4, int(calls * target_s / max(elapsed, 1e-9)))
    return statistics.median(loop(calls) / calls for _ in range(repeats))


def _chained(fn: Callable, x0: Any) -> Callable[[int], float]:
    def loop(calls: int) -> float:
        start = time.perf_counter()
        x = x0
        for _ in range(calls):
            x = fn(x)
        x.result()
        return time.perf_counter() - start

    return loop


def _device_costs(devices: list[int], target_s: float, repeats: int, log: Callable[[str], None]) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    out: dict[str, dict[int, float]] = {"computation_s": {}, "launch_s": {}}
    for n in devices:
        mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
        x0 = jax.device_put(jnp.zeros((), jnp.float32), NamedSharding(mesh, P()))
        one = jax.jit(lambda x, mesh=mesh, n=n: _computation(x, mesh, n))

        def many(x, mesh=mesh, n=n):
            for _ in range(64):
                x = _computation(x, mesh, n)
            return x

        fused = jax.jit(many)

        def separate(calls: int, one=one, x0=x0) -> float:
            start = time.perf_counter()
            x, window = x0, []
            for _ in range(calls):
                x = one(x)
                window.append(x)
                if len(window) > _WINDOW:
                    window.pop(0).block_until_ready()
            x.block_until_ready()
            return time.perf_counter() - start

        def together(calls: int, fused=fused, x0=x0) -> float:
            start = time.perf_counter()
            x = x0
            for _ in range(calls):
                x = fused(x)
            x.block_until_ready()
            return time.perf_counter() - start

        per_executable = _per_call(separate, target_s, repeats)
        computation = _per_call(together, target_s, repeats) / 64
        out["computation_s"][n] = computation
        out["launch_s"][n] = max(per_executable - computation, 0.0)
        log(
            f"  {n} device(s): one executable {per_executable * 1e6:.1f} us, "
            f"one computation inside a fused node {computation * 1e6:.2f} us"
        )
    return out


def _controller_costs(target_s: float, repeats: int, log: Callable[[str], None]) -> ControllerCosts:
    import jax.numpy as jnp

    import pathways_jax as pw

    s = pw.devices(mesh={"x": 1})
    mesh = s.physical_mesh
    one = pw.jit(lambda x: _computation(x, mesh, 1), devices=s)

    def chain(x):
        for _ in range(_L):
            x = one(x)
        return x

    prog = pw.program(chain, name="calibrate_chain", fuse=False)
    x0 = jnp.zeros((), jnp.float32)
    t1 = _per_call(_chained(one, x0), target_s, repeats)
    tl = _per_call(_chained(prog, x0), target_s, repeats)
    node = max((tl - t1) / (_L - 1), 0.0)
    run = max(t1 - node, 0.0)
    s.release()
    log(f"  controller: a 1-node run {t1 * 1e6:.1f} us, a {_L}-node run {tl * 1e6:.1f} us")
    log(f"  -> run_s {run * 1e6:.1f} us, node_s {node * 1e6:.2f} us")
    return ControllerCosts(run_s=run, node_s=node, transfer_s=node)


def _ray_costs(
    node_s: float, target_s: float, repeats: int, log: Callable[[str], None]
) -> tuple[HostCosts, float] | None:
    import warnings

    try:
        import ray
    except ImportError:
        log("Ray is not installed (pip install 'pathways-jax[ray]'): no host costs measured.")
        return None
    import jax.numpy as jnp

    import pathways_jax as pw

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(
            address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    try:
        pw.init(backend="ray", hosts=2, devices_per_host=1)
        a = pw.devices(mesh={"x": 1}, island=0)
        b = pw.devices(mesh={"x": 1}, island=1)
        on_a = pw.jit(lambda x: x * 0.5 + 1.0, devices=a)
        on_b = pw.jit(lambda x: x * 0.5 + 1.0, devices=b)

        def chain(x):
            for _ in range(_L):
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

        t_a = _per_call(_chained(on_a, x0), target_s, repeats)
        t_b = _per_call(both_loop, target_s, repeats)
        t_c = _per_call(_chained(long, x0), target_s, repeats)
    finally:
        pw.shutdown()
        ray.shutdown()
    message = max(t_b - t_a - node_s, 0.0)
    enqueue = max((t_c - t_a) / (_L - 1) - node_s, 0.0)
    log(
        f"  Ray, 2 hosts: 1 node on 1 host {t_a * 1e6:.1f} us, 1 node on each {t_b * 1e6:.1f} us, "
        f"{_L} nodes on 1 host {t_c * 1e6:.1f} us"
    )
    log(f"  -> message_s {message * 1e6:.1f} us, enqueue_s {enqueue * 1e6:.2f} us")
    return HostCosts(message_s=message, latency_s=0.0, run_s=0.0, enqueue_s=enqueue), t_a


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

    devices = devices or ([1, 2] if quick else [1, 2, 4, 8])
    target_s, repeats = (0.01, 3) if quick else (0.2, 5)
    started = time.time()
    pw.init(num_cpu_devices=max(8, *devices))
    log(f"calibrating on {os.cpu_count()} CPU cores, devices {devices}{' (quick)' if quick else ''}")
    dev = _device_costs(devices, target_s, repeats, log)
    controller = _controller_costs(target_s, repeats, log)
    pw.shutdown()
    jax_call = dev["launch_s"][1] + dev["computation_s"][1]
    hosts = HostCosts()
    sources = {
        "device.computation_s": "measured: a jitted chain of 64 scalar all-reduce + add computations, per computation",
        "device.launch_s": "measured: separate jitted calls (16 in flight) per call, less device.computation_s",
        "controller.run_s": "measured: pw.jit call (1-node run) less controller.node_s, 1 device",
        "controller.node_s": f"measured: a {_L}-node unfused @pw.program against a 1-node run, 1 device",
        "controller.transfer_s": "taken equal to controller.node_s (not measured separately)",
        "jax.call_s": "measured: a plain jax.jit call of the computation on 1 device",
        "ici": "CPU devices share memory: collectives are inside device.computation_s",
        "dcn": "not measured (no DCN on one machine): zero cost",
    }
    if ray and not quick:
        got = _ray_costs(controller.node_s, target_s, repeats, log)
        if got is not None:
            hosts, t_a = got
            sources["hosts.message_s"] = (
                "measured on 2 Ray hosts: one node on each host against one node on one host"
            )
            sources["hosts.enqueue_s"] = f"measured on 2 Ray hosts: {_L} nodes on one host against one node"
            # What a one-node run on one Ray host costs beyond the controller's part: the host's.
            rest = t_a - (controller.run_s + controller.node_s + hosts.message_s)
            hosts = HostCosts(message_s=hosts.message_s, enqueue_s=hosts.enqueue_s, run_s=max(rest, 0.0))
            sources["hosts.run_s"] = (
                "measured: a 1-node run on one Ray host less the controller's and message costs"
            )
    elif ray:
        log("quick mode: Ray hosts not measured")
    return Profile(
        name=name,
        controller=controller,
        hosts=hosts,
        device=DeviceCosts(launch_s=dev["launch_s"], computation_s=dev["computation_s"]),
        ici=LinkCosts(),
        dcn=LinkCosts(),
        jax_call_s=jax_call,
        in_flight=8,
        host_in_flight=64,
        devices_per_host=max(devices),
        sources=sources,
        meta={
            "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "seconds": round(time.time() - started, 1),
            "quick": quick,
            "machine": _machine(),
        },
    )
