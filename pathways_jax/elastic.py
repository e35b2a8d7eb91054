"""Data-parallel training that goes on when an island is lost: ``pw.elastic.Manager(dp)``.

Needs the ``pipeline`` extra (Flax, Optax): ``pip install 'pathways-jax[pipeline]'``.
See :mod:`pathways_jax._src.pipeline.elastic` for the semantics.
"""

from pathways_jax._src.pipeline.elastic import Event as Event
from pathways_jax._src.pipeline.elastic import Loss as Loss
from pathways_jax._src.pipeline.elastic import Manager as Manager

__all__ = ["Event", "Loss", "Manager"]
