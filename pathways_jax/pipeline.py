"""Pipelined models and multi-island data parallelism for Flax + Optax training loops.

Built only on the public API (``pw.devices``, ``pw.jit``, ``@pw.program``):

- :class:`Pipeline`: a model given as stages (Flax NNX modules, Linen modules
  with their variables, or ``(params, apply_fn)`` pairs), each on its own
  slice, possibly on different islands. A train step is ONE program call:
  microbatches flow forward, the loss is taken on the last stage, gradients
  flow back and each stage applies its own Optax update on its slice.
  Schedules ``"gpipe"`` and ``"1f1b"``; ``forward`` for inference.
- :class:`DataParallel`: one model on K slices (typically K islands), each
  on its own shard of the batch; gradients cross islands over DCN, are
  averaged, and every island applies the same update. One call per step.
  ``param_specs`` shards the parameters over each slice's mesh.
- :class:`DiLoCo`: the same islands exchanging parameters every ``sync_every``
  steps instead of gradients every step (for slow links between islands).

Every call takes keyword-only ``rngs={"dropout": key}`` (or an ``nnx.Rngs``, from which each
call draws its keys) and ``train=True/False``
(Flax style: a Linen stage gets ``train`` and ``rngs`` as in ``module.apply``);
a stage's call gets ``train`` as ``train``, ``training`` or ``deterministic``
(``not train``), whichever it takes, or under the name given as ``train_kw=``;
``train=True`` that a stage cannot receive is a ``ProgramTraceError``.
Stage ``s`` on microbatch ``m`` runs with :func:`derive_rngs` ``(rngs, s, m)``.
Each model's ``.state`` (parameters, optimizer states, DataParallel's step) is what to
checkpoint with Orbax; ``load_state(restored)`` on a model built the same way continues
from it, as the saved model would have.
The optimizer is anything with Optax's ``init``/``update`` or an
``nnx.Optimizer`` (its ``.tx`` is used).

Example:
  >>> import jax.numpy as jnp, numpy as np, optax, pathways_jax as pw
  >>> from pathways_jax import pipeline
  >>> a, b = pw.devices(mesh={"data": 1}), pw.devices(mesh={"data": 1})
  >>> dp = pipeline.DataParallel((jnp.ones(2), lambda p, x: x * p), [a, b],
  ...                            loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
  ...                            optimizer=optax.sgd(0.1))
  >>> float(dp.train_step(np.ones((4, 2)), np.zeros((4, 2))).result())
  1.0
"""

try:
    import flax  # noqa: F401
    import optax  # noqa: F401
except ImportError as _missing:  # pragma: no cover - the suite installs the extra
    raise ImportError(
        f"pathways_jax.pipeline is built on Flax and Optax, and {_missing.name!r} is not installed. "
        "Install them with: pip install 'pathways-jax[pipeline]'."
    ) from _missing

from pathways_jax._src.pipeline.data_parallel import DataParallel as DataParallel
from pathways_jax._src.pipeline.diloco import DiLoCo as DiLoCo
from pathways_jax._src.pipeline.pipelined import Pipeline as Pipeline
from pathways_jax._src.pipeline.rngs import derive_rngs as derive_rngs
from pathways_jax._src.pipeline.schedules import SCHEDULES as SCHEDULES
from pathways_jax._src.pipeline.schedules import Schedule as Schedule
from pathways_jax._src.pipeline.schedules import bubble_fraction as bubble_fraction
from pathways_jax._src.pipeline.schedules import schedule_order as schedule_order
from pathways_jax._src.pipeline.stages import Stage as Stage
from pathways_jax._src.pipeline.stages import as_stage as as_stage
from pathways_jax._src.pipeline.stages import sequential as sequential

__all__ = [
    "SCHEDULES",
    "DataParallel",
    "DiLoCo",
    "Pipeline",
    "Schedule",
    "Stage",
    "as_stage",
    "bubble_fraction",
    "derive_rngs",
    "schedule_order",
    "sequential",
]
