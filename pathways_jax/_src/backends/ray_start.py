"""Starting the Ray backend (``pw.init(backend="ray")``, ``registry``): host actors, or a controller service.

The hosts' devices are seen in this process through stand-in CPU devices:
lowering and placement run against them, and each host runs its part.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax

from pathways_jax._src.backends import local
from pathways_jax._src.backends.base import StartOptions
from pathways_jax._src.core import errors


def start(args: StartOptions) -> Any:
    """The Ray backend: joins ``args.service`` if given, else starts ``args.hosts`` host actors."""
    if args.service is not None and (not isinstance(args.service, str) or not args.service):
        raise errors.ClusterError(
            f"service={args.service!r}: a controller service is joined with pw.init(backend='ray', "
            "address=..., service='<name>'), its name a non-empty string."
        )
    if (args.service is None or args.hosts is not None) and (
        isinstance(args.hosts, bool) or not isinstance(args.hosts, numbers.Integral) or args.hosts < 1
    ):
        raise errors.ClusterError(
            f"pw.init(backend='ray') needs hosts=N, a positive int (one host actor per island); "
            f"got {args.hosts!r}."
        )
    if args.service is not None:
        return _join_service(args)
    return _start_hosts(args)


def _join_service(args: StartOptions) -> Any:
    """Joins the controller service ``args.service``: its hosts, seen through stand-in devices here."""
    from pathways_jax._src.backends import service_client as service_lib

    actor, token, joined = service_lib.join(args.service or "", args.address, args.client_name)
    hosts, per_host = joined["hosts"], joined["devices_per_host"]
    wrong = service_lib.mismatches(args, joined)
    try:
        if wrong:
            raise errors.ClusterError(
                f"pw.init(service={args.service!r}): {', '.join(wrong)}. Leave them out to take the service's."
            )
        standins = _standins(
            hosts * per_host,
            args.num_cpu_devices,
            f"joining service {args.service!r} ({hosts} hosts x {per_host} devices)",
        )
        return service_lib.ServiceBackend(
            actor=actor, token=token, joined=joined, standins=standins, on_lost=None
        )
    except BaseException:
        import ray

        ray.get(actor.leave.remote(joined["client"]), timeout=10)
        ray.kill(token)
        raise


def _standins(total: int, num_cpu_devices: int | None, what: str, *, start: bool = True) -> list:
    """``total`` CPU devices of this process standing in for the hosts' devices.

    ``start=False`` only checks that they can be had, starting nothing: JAX's
    backend, once started, keeps its device count for the process's life.
    """
    if num_cpu_devices is not None and num_cpu_devices < total:
        raise errors.ClusterError(
            f"num_cpu_devices={num_cpu_devices} is fewer than the {total} stand-in devices that {what} "
            "needs in this process."
        )
    if not local._backend_started():
        if not start:
            return []
        # Never fewer CPU devices than the process already asked JAX for.
        configured = getattr(jax.config, "jax_num_cpu_devices", -1) or -1
        local.set_cpu_device_count(num_cpu_devices or max(total, configured))
    standins = sorted(jax.devices("cpu"), key=lambda d: d.id)
    if len(standins) < total:
        raise errors.ClusterError(
            f"{what} needs {total} CPU devices in this process to stand in for the hosts' devices, but JAX started with "
            f"{len(standins)}. Call pw.init before any JAX computation, or set "
            f"jax.config.update('jax_num_cpu_devices', {total}) first."
        )
    return standins[:total]


def _start_hosts(args: StartOptions) -> Any:
    """Checks the Ray backend's arguments, sets up the stand-in devices and starts the hosts."""
    devices_per_host, islands, num_cpu_devices = (
        int(args.devices_per_host),
        args.islands,
        args.num_cpu_devices,
    )
    hosts = args.hosts or 0  # an int >= 1 (checked)
    if islands is not None and (not isinstance(islands, int) or islands < 1 or hosts % islands):
        raise errors.ClusterError(
            f"on the Ray backend islands= is None (each host is an island) or a number of islands "
            f"that divides hosts={hosts} (islands of hosts/islands hosts each); got islands={islands!r}."
        )
    # The stand-ins start JAX's backend with their count, for good: the Ray cluster and its room
    # for the hosts are checked first (a pw.init refused there, as GPU hosts on a cluster without
    # GPUs are, had fixed the count, and a retry asking for more hosts was told "JAX started with N").
    what = f"hosts={hosts} x devices_per_host={devices_per_host}"
    _standins(hosts * devices_per_host, num_cpu_devices, what, start=False)
    from pathways_jax._src.backends.ray_boot import check_cpus, check_gpus, import_ray, join_ray

    ray = import_ray()
    join_ray(ray, args.address, hosts)
    check_cpus(ray, hosts)
    if args.platform != "cpu":
        check_gpus(ray, hosts, devices_per_host)
    standins = _standins(hosts * devices_per_host, num_cpu_devices, what)
    from pathways_jax._src.backends import ray as ray_backend

    return ray_backend.RayBackend(
        address=args.address,
        hosts=hosts,
        devices_per_host=devices_per_host,
        standins=standins,
        window_size=args.max_in_flight,
        on_lost=None,
        islands=islands,
        platform=str(args.platform),  # a plain str (a default is a DefaultStr): it goes to the hosts
        replace_lost=bool(args.replace_lost_hosts),
    )
