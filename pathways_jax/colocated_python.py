"""Python on the hosts that own given devices: ``jax.experimental.colocated_python``'s API, run for real.

``import pathways_jax as pw; pw.colocated_python.colocated_python(fn)``, or change
``from jax.experimental import colocated_python`` to
``from pathways_jax import colocated_python``. See ``_src/api/colocated.py`` for
where it runs and how, and :class:`HostIterator` for an input pipeline whose
batches are made on the hosts.
"""

from pathways_jax._src.api.colocated import ColocatedFunction as ColocatedFunction
from pathways_jax._src.api.colocated import colocated_cpu_devices as colocated_cpu_devices
from pathways_jax._src.api.colocated import colocated_python as colocated_python
from pathways_jax._src.api.colocated_class import colocated_python_class as colocated_python_class
from pathways_jax._src.api.host_input import HostIterator as HostIterator
from pathways_jax._src.api.host_input import Shard as Shard

__all__ = [
    "ColocatedFunction",
    "HostIterator",
    "Shard",
    "colocated_cpu_devices",
    "colocated_python",
    "colocated_python_class",
]
