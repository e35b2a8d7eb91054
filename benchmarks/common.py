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
