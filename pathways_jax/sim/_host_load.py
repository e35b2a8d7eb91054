"""The hosts' costs on a machine they share with the controller: between ``hosts`` and ``hosts_busy``."""

from __future__ import annotations

import dataclasses

from pathways_jax.sim._cluster import SimCluster
from pathways_jax.sim._profile import HostCosts, Profile


def host_costs(profile: Profile, cluster: SimCluster) -> HostCosts:
    """The hosts' costs on ``cluster``: ``hosts``, or towards ``hosts_busy`` on a crowded machine.

    A process's CPU seconds per unit of work move with the load: calibration
    measures them with cores to spare (``hosts``) and with none idle
    (``hosts_busy``). Hosts sharing ``cores`` with the controller pay
    ``hosts`` while the processes fit the cores and ``hosts_busy`` from twice
    as many processes as cores, in proportion in between. The linear form and
    its ends are a choice, not a measurement: on the 2-core machine of
    ``cpu_2core`` it puts 2 hosts (3 processes) halfway, and 2-host chains fall
    between the two measured states there (``benchmarks/README.md``, Simulator).
    """
    busy = profile.hosts_busy
    if cluster.cores is None or busy is None:
        return profile.hosts
    share = min(max((cluster.hosts + 1 - cluster.cores) / cluster.cores, 0.0), 1.0)
    idle = profile.hosts
    return HostCosts(
        **{
            f.name: (1 - share) * getattr(idle, f.name) + share * getattr(busy, f.name)
            for f in dataclasses.fields(HostCosts)
        }
    )
