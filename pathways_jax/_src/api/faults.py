"""``pw.faults``: a Ray host killed or hung on purpose, at the step you choose, to rehearse a failure.

The host does it to itself (``backends/ray_host/faults.py``), so what the
controller sees is what a lost machine or a wedged process looks like: the
same detection, the same ``HostLostError``, the same rebuilt island. Tests
and benchmarks of recovery use it, and so can users.
"""

from __future__ import annotations

import numbers

from pathways_jax._src.backends.base import FaultKind, ServiceView, Strikes
from pathways_jax._src.core import checks, errors, source
from pathways_jax._src.runtime import clusters

_TIMEOUT_S = 30.0


def kill_host(host: int, *, at_run: int = 0, at_save: int = 0, timeout: float = _TIMEOUT_S) -> None:
    """Kills Ray host ``host`` as a lost machine dies: its actor's process sends itself SIGKILL.

    The controller finds it as it finds any dead host: the runs it held fail
    with ``HostLostError`` within seconds, its island is lost, and (with
    ``pw.init(..., replace_lost_hosts=True)``, the default) rebuilt on a new
    host; the next call runs there.

    Args:
      host: the host's number, 0 to ``hosts - 1`` as ``pw.init(backend="ray",
        hosts=...)`` numbers them; island ``i`` of ``islands`` is hosts
        ``i * hosts // islands`` onwards.
      at_run: 0 kills it now, and returns once Ray sees it dead. ``n`` >= 1
        arms it: it dies during the ``n``-th run it starts from now, once that
        run's work is on its devices and before the run is answered (a
        failure in the middle of a step); returns once the host holds it.
      at_save: ``n`` >= 1 arms it to die as the ``n``-th checkpoint save
        from now starts writing on it (an Orbax save of futures, written by
        the hosts: ``pw.checkpoints``); give ``at_run`` or ``at_save``, not both.
      timeout: seconds to wait for the host's answer (and, now, its death).

    Raises:
      ClusterError: this process's cluster has no hosts of its own (the local
        backend, or a client of a controller service), the host is lost
        already, or it did not answer within ``timeout``.
      ResourceError: ``host`` is not a host's number, or ``at_run`` is not an int >= 0.

    Example:
      >>> import pathways_jax as pw
      >>> pw.init(backend="ray", hosts=2, devices_per_host=1)  # doctest: +SKIP
      >>> for step in range(100):  # doctest: +SKIP
      ...     if step == 40:
      ...         pw.faults.kill_host(1, at_run=1)  # dies in the middle of step 40
      ...     state, loss = train_step(state, batch)
    """
    _strike("kill", host, at_run, at_save, timeout, "pw.faults.kill_host")


def hang_host(host: int, *, at_run: int = 0, at_save: int = 0, timeout: float = _TIMEOUT_S) -> None:
    """Hangs Ray host ``host``: its actor's process sends itself SIGSTOP.

    Ray still sees the actor alive; its channel to the controller falls
    silent. After ``HUNG_S`` (10 s) of silence the controller kills it and
    treats it as lost: its runs fail with ``HostLostError`` saying it hung,
    and its island is rebuilt as after :func:`kill_host`.

    Args:
      host: the host's number (see :func:`kill_host`).
      at_run: 0 hangs it now (within about 50 ms of returning); ``n`` >= 1:
        during the ``n``-th run it starts from now, as :func:`kill_host`.
      at_save: as :func:`kill_host`.
      timeout: seconds to wait for the host's answer.

    Raises:
      ClusterError: as :func:`kill_host`.
      ResourceError: as :func:`kill_host`.
    """
    _strike("hang", host, at_run, at_save, timeout, "pw.faults.hang_host")


def _strike(kind: FaultKind, host: int, at_run: int, at_save: int, timeout: float, what: str) -> None:
    backend = clusters.cluster().backend
    if not isinstance(backend, Strikes) or isinstance(backend, ServiceView):
        served = isinstance(backend, ServiceView)
        raise errors.ClusterError(
            f"{what} (at {source.of_caller()}): "
            + (
                "this process is a client of a controller service, whose hosts serve other clients "
                "too, and pw.faults fails only hosts of your own: start them with "
                "pw.init(backend='ray', hosts=...). To rehearse a loss of the service's host h, kill "
                "its process yourself (os.kill(pw.service(name).host_stats()[h]['pid'], signal.SIGKILL))."
                if served
                else f"the {backend.name!r} backend has no hosts to fail: every device is in this "
                "process. Start hosts with pw.init(backend='ray', hosts=..., devices_per_host=...)."
            )
        )
    hosts = backend.hosts
    if not _is_count(host) or not 0 <= host < hosts:
        raise errors.ResourceError(
            f"{what} (at {source.of_caller()}): host must be a host's number, 0 to {hosts - 1} "
            f"(pw.init(hosts={hosts})); got {host!r}."
        )
    if not _is_count(at_run) or at_run < 0:
        raise errors.ResourceError(
            f"{what} (at {source.of_caller()}): at_run must be an int >= 0 (0: now; n: during the "
            f"n-th run the host starts from now); got {at_run!r}."
        )
    if not _is_count(at_save) or at_save < 0 or (at_save and at_run):
        raise errors.ResourceError(
            f"{what} (at {source.of_caller()}): at_save must be an int >= 0 (n: as the n-th checkpoint "
            f"save from now starts writing on the host), and at_run 0 with it; got at_run={at_run!r}, "
            f"at_save={at_save!r}."
        )
    if not checks.is_seconds(timeout) or timeout == 0:
        raise errors.ResourceError(
            f"{what} (at {source.of_caller()}): timeout must be seconds > 0; got {timeout!r}."
        )
    backend.strike(int(host), kind, int(at_run), float(timeout), at_save=int(at_save))


def _is_count(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


__all__ = ["hang_host", "kill_host"]
