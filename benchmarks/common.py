"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import os
import platform
import sys


def machine() -> dict:
    """CPU count, platform, Python, JAX and its devices: stored with every result."""
    import jax

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "devices": f"{len(jax.devices())} x {jax.devices()[0].platform}",
    }


def pyplot():
    """matplotlib's pyplot drawing to files (the Agg backend), or None when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'pathways-jax[bench]'): no plot written.")
        return None
    return plt


def save_figure(plt, fig, path) -> bool:
    """Lays out ``fig``, writes it to ``path`` (PNG, 120 dpi) and closes it; returns True."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def start_ray(address: str, num_cpus: int) -> None:
    """Joins the Ray cluster at ``address``; ``""``: starts a local one of ``num_cpus`` logical CPUs.

    Joining one that runs (the test suite's, ``--ray_address``) saves the seconds a
    cluster takes to start and stop; what the benchmark puts there it takes away again.
    """
    import warnings

    import ray

    with warnings.catch_warnings():
        # Ray starts its processes with fork + exec; JAX's fork hook warns about it.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if address:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        else:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
