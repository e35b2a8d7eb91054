"""The simulator's errors: subclasses of :mod:`pathways_jax.errors` types, so callers catch either."""

from __future__ import annotations

from types import ModuleType

from pathways_jax import errors


class ProfileError(errors.ResourceError):
    """A cost profile that cannot be found or read, or that has a bad figure."""


class SimulatorUnavailable(errors.ClusterError, ImportError):
    """SimPy, which the simulator runs on, is not installed."""


def import_simpy() -> ModuleType:
    """SimPy, imported on first use (``pip install 'pathways-jax[sim]'``).

    Raises:
      SimulatorUnavailable: SimPy is not installed.
    """
    try:
        import simpy
    except ImportError as exc:
        raise SimulatorUnavailable(
            "pw.sim runs on SimPy, which is not installed. Install the optional extra: "
            "pip install 'pathways-jax[sim]' (or pip install simpy)."
        ) from exc
    return simpy
