"""``pw.stats()``: what the cluster's devices and clients have done, read from the accounting."""

from __future__ import annotations

import time
from typing import Any

from pathways_jax._src.backends.base import ServiceView
from pathways_jax._src.core import errors
from pathways_jax._src.runtime import clusters
from pathways_jax._src.runtime.accounting import CLOSED_CLIENTS


def stats(*, reset: bool = False) -> dict[str, Any]:
    """What the cluster's devices and clients have done since start (or the last reset).

    Args:
      reset: start counting again from now after taking this snapshot.

    Returns:
      A dict with ``elapsed_s``, ``scheduler``, and:

      - ``devices``: per device id, ``island``, ``busy_s`` (time the device
        was running dispatched programs), ``utilisation`` (``busy_s /
        elapsed_s``), ``bytes_in_use`` (reserved under the memory budget, or
        held by live values when there is none) and ``budget`` (bytes or None).
      - ``islands``: per island, ``queued`` (runs waiting that touch it),
        ``in_flight`` (executables dispatched and not finished) and ``lost``
        (why its host was lost, until it is rebuilt; else None).
      - ``clients``: per client name, ``device_time_s`` (device-seconds its
        programs ran), ``programs`` (runs completed), ``failures`` and
        ``queued``. Closed clients (``Client.close()``, or a thread's default
        client once its thread ended) are summed in one row named
        ``"(closed clients)"`` (``CLOSED_CLIENTS``), with the same fields and
        ``clients``, how many closed clients it sums; runs of theirs that
        finish after the close are counted there too.
      - ``service`` (only in a client process of a controller service,
        ``pw.init(service=...)``): the service's stats: every client process
        (``name``, ``pid``, ``alive``, ``programs``, ``runs``, ``failures``,
        ``refused``, ``device_time_s``, ``by_client``, ``bytes_held``,
        ``values``, ``slices``), its ``scheduler``, ``window``, ``bytes_held``
        and ``memory_budget``.

    Raises:
      ClusterError: ``pw.shutdown()`` ended the cluster and ``pw.init`` was not
        called since, or ``reset`` is not a bool.

    Example:
      >>> import jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 2})
      >>> add = pw.jit(lambda v: v + 1, devices=s)
      >>> add(jnp.zeros(4)).result().tolist()
      [1.0, 1.0, 1.0, 1.0]
      >>> st = pw.stats()
      >>> sorted(st)
      ['clients', 'devices', 'elapsed_s', 'islands', 'scheduler']
      >>> 0.0 <= st["devices"][s.devices[0].id]["utilisation"] <= 1.0
      True
      >>> s.release()
    """
    if not isinstance(reset, bool):  # reset="no" would reset
        raise errors.ClusterError(
            f"pw.stats(reset=...) takes True or False, got {reset!r} ({type(reset).__name__})."
        )
    cl = clusters.cluster()
    controller = cl.controller
    # Values whose futures were dropped by now are no longer in use.
    deadline = time.monotonic() + 1.0
    while True:  # let the watcher account (and release) what is already finished (bounded)
        elapsed, busy, usage = controller.accounting.snapshot(reset=False)
        if controller.accounting.idle() or time.monotonic() > deadline:
            break
        time.sleep(1e-3)
    cl.store.collect()
    budget = cl.store.budget
    if budget is not None:
        with budget.lock:
            in_use = dict(budget.used)
    else:
        in_use = cl.store.bytes_in_use()
    if reset:
        controller.accounting.reset()
    devices = {}
    for island in cl.islands:
        for d in island.devices:
            devices[d.id] = {
                "island": island.index,
                "busy_s": busy.get(d.id, 0) / 1e9,
                "utilisation": min(busy.get(d.id, 0) / 1e9 / elapsed, 1.0) if elapsed > 0 else 0.0,
                "bytes_in_use": int(in_use.get(d.id, 0)),
                "budget": None if budget is None else budget.limits.get(d.id),
            }
    queued = controller.queued_by_island()
    in_flight = controller.in_flight_by_island()
    lost = dict(cl.resources.lost)
    islands = {
        island.index: {
            "queued": queued.get(island.index, 0),
            "in_flight": in_flight.get(island.index, 0),
            "lost": lost.get(island.index),
        }
        for island in cl.islands
    }
    clients: dict[str, dict[str, Any]] = {}
    for u in usage:
        entry = clients.setdefault(u.name, {"device_time_s": 0.0, "programs": 0, "failures": 0, "queued": 0})
        entry["device_time_s"] += u.device_ns / 1e9
        entry["programs"] += u.programs
        entry["failures"] += u.failures
        if u.name == CLOSED_CLIENTS:
            entry["clients"] = u.clients
    for name, count in controller.queued_by_client_name().items():
        entry = clients.setdefault(name, {"device_time_s": 0.0, "programs": 0, "failures": 0, "queued": 0})
        entry["queued"] += count
    out = {
        "elapsed_s": elapsed,
        "scheduler": cl.scheduler,
        "devices": devices,
        "islands": islands,
        "clients": clients,
    }
    backend = cl.backend
    if isinstance(backend, ServiceView):  # a client process of a controller service: the service's view too
        out["service"] = backend.service_stats()
    return out


__all__ = ["CLOSED_CLIENTS", "stats"]
