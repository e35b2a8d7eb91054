"""``DataParallel``: one model on several islands, one program call per train step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import pathways_jax as pw
from pathways_jax._src.pipeline import stages as stages_lib

LossFn = Callable[[Any, Any], jax.Array]


class DataParallel:
    """The same train step on K slices (islands), each on its own shard of the batch.

    A train step is ONE ``@pw.program``: every slice computes the loss and
    gradients of its shard (within a slice the shard is split further over
    ``data_axis``, so XLA reduces over ICI); each slice's gradients, packed
    into one flat vector, move to every other slice (``"dcn"`` across
    islands), every slice averages them in the same order and applies the
    same Optax update. Parameters therefore stay bit-identical across slices,
    and equal to training on the whole batch at once.

    Args:
      model: a Flax NNX module, a ``(linen_module, variables)`` pair, a
        ``(params, apply_fn)`` pair, or a list of those (composed in order,
        see :func:`sequential`).
      devices: the slices, one per replica; usually one per island.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean over examples.
      optimizer: an optax ``GradientTransformation``.
      data_axis: the mesh axis of each slice that splits its shard.

    Raises:
      PlacementError: no slices, or a slice is unusable.
      ProgramTraceError: the model, loss or optimizer has the wrong type.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, pathways_jax as pw
      >>> from pathways_jax.pipeline import DataParallel
      >>> a, b = pw.devices(mesh={"data": 1}), pw.devices(mesh={"data": 1})
      >>> dp = DataParallel((jnp.ones(2), lambda p, x: x * p), [a, b],
      ...                   loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
      ...                   optimizer=optax.sgd(0.5))
      >>> _ = dp.train_step(np.ones((2, 2)), np.zeros((2, 2)))
      >>> [p.result().tolist() for p in dp.params_per_island]
      [[0.5, 0.5], [0.5, 0.5]]
    """

    def __init__(
        self,
        model: Any,
        devices: Sequence[pw.VirtualSlice],
        *,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        data_axis: str | None = "data",
    ):
        if isinstance(model, list):  # stages composed in order; a tuple is a pair
            model = stages_lib.sequential(model)
        stage = stages_lib.as_stage(model, 0)
        slices = list(devices) if isinstance(devices, Sequence) else [devices]
        if not slices:
            raise pw.errors.PlacementError("DataParallel needs at least one slice; got none.")
        self.slices = stages_lib.check_slices(slices, len(slices), "DataParallel")
        if not callable(loss_fn):
            raise pw.errors.ProgramTraceError(
                f"loss_fn must be a function (outputs, targets) -> scalar, got {type(loss_fn).__name__}."
            )
        (tx,) = stages_lib.check_optimizers(optimizer, 1, "DataParallel")
        if tx is None:
            raise pw.errors.ProgramTraceError("DataParallel needs optimizer=, e.g. optax.adam(1e-3).")
        self.stage = stage
        self.data_axis = data_axis
        self._loss_fn = loss_fn
        count = len(self.slices)
        _, unravel = ravel_pytree(stage.params)
        pspecs = jax.tree.map(lambda _: pw.P(), stage.params)
        ospecs = stages_lib.opt_state_specs(tx, stage.params, pspecs)

        def loss_and_flat_grads(p: Any, x: Any, y: Any) -> tuple[jax.Array, jax.Array]:
            loss, grads = jax.value_and_grad(lambda p: loss_fn(stage.apply(p, x), y))(p)
            return loss, ravel_pytree(grads)[0]  # one vector: one transfer per island pair

        def average_and_update(p: Any, o: Any, *flat_grads: jax.Array) -> tuple[Any, Any]:
            total = flat_grads[0]
            for g in flat_grads[1:]:  # the same order on every island: identical results
                total = total + g
            updates, o = tx.update(unravel(total / count), o, p)
            return optax.apply_updates(p, updates), o

        def mean(*losses: jax.Array) -> jax.Array:
            return sum(losses[1:], losses[0]) / count

        self._grad_nodes, self._update_nodes = [], []
        self._params: list[Any] = []
        self._opt_states: list[Any] = []
        for slice_ in self.slices:
            act = stages_lib.activation_spec(slice_, data_axis)
            self._grad_nodes.append(
                pw.jit(loss_and_flat_grads, devices=slice_, in_specs=(None, act, act), out_specs=pw.P())
            )
            self._update_nodes.append(pw.jit(average_and_update, devices=slice_, out_specs=(pspecs, ospecs)))
            init = pw.jit(lambda p: (p, tx.init(p)), devices=slice_, out_specs=(pspecs, ospecs))
            params, opt_state = init(stage.params)
            self._params.append(params)
            self._opt_states.append(opt_state)
        self._mean = pw.jit(mean, devices=self.slices[0], out_specs=pw.P())
        self._checked: set[Any] = set()
        self._train = pw.program(self._train_step_fn, name="data_parallel_train_step")

    def _train_step_fn(self, params: tuple, opt_states: tuple, xs: tuple, ys: tuple) -> tuple:
        results = [node(p, x, y) for node, p, x, y in zip(self._grad_nodes, params, xs, ys, strict=True)]
        flat_grads = [g for _, g in results]
        new = [
            node(p, o, *flat_grads)  # grads made on other islands arrive over DCN
            for node, p, o in zip(self._update_nodes, params, opt_states, strict=True)
        ]
        loss = self._mean(*(loss for loss, _ in results))
        return loss, tuple(p for p, _ in new), tuple(o for _, o in new)

    def _split(self, x: Any, what: str) -> tuple[np.ndarray, ...]:
        array = np.asarray(x)
        count = len(self.slices)
        if array.ndim == 0 or array.shape[0] % count:
            raise pw.errors.PlacementError(
                f"{what} has shape {array.shape}; its first (batch) dimension must be a multiple of "
                f"the {count} slices so each gets an equal shard."
            )
        return stages_lib.split_over(
            array, count, self.slices, self.data_axis, what=what, parts="shards", per="slices", place="slice"
        )

    def _check(self, x: np.ndarray, y: np.ndarray) -> None:
        key = (x.shape, x.dtype, y.shape, y.dtype)
        if key in self._checked:
            return
        try:
            out = jax.eval_shape(self.stage.apply, stages_lib.abstract(self._params[0]), x)
            loss = jax.eval_shape(self._loss_fn, out, y)
        except Exception as exc:
            raise pw.errors.ProgramTraceError(
                f"DataParallel: the model and loss_fn cannot take a shard x {stages_lib.describe(x)}, "
                f"y {stages_lib.describe(y)}: {type(exc).__name__}: {exc}"
            ) from exc
        if not (isinstance(loss, jax.ShapeDtypeStruct) and loss.shape == ()):
            raise pw.errors.ProgramTraceError(f"loss_fn must return a float scalar, got {loss}.")
        self._checked.add(key)

    def train_step(self, x: Any, y: Any) -> pw.Future:
        """Runs one train step (ONE program call); returns the batch's mean loss as a future.

        Raises:
          PlacementError: the batch does not split evenly over the slices (and
            their ``data_axis``).
          ProgramTraceError: the model or loss cannot take the inputs.
        """
        xs, ys = self._split(x, "x"), self._split(y, "y")
        self._check(xs[0], ys[0])
        loss, params, opt_states = self._train(tuple(self._params), tuple(self._opt_states), xs, ys)
        self._params, self._opt_states = list(params), list(opt_states)
        return loss

    def graph(self, x: Any, y: Any) -> pw.Graph:
        """The dataflow graph of one train step for these inputs."""
        xs, ys = self._split(x, "x"), self._split(y, "y")
        return self._train.graph(tuple(self._params), tuple(self._opt_states), xs, ys)

    @property
    def params(self) -> Any:
        """The parameters (those of the first slice; every slice holds the same)."""
        return self._params[0]

    @property
    def params_per_island(self) -> list[Any]:
        """The parameters held by each slice, in slice order."""
        return list(self._params)

    @property
    def opt_states_per_island(self) -> list[Any]:
        return list(self._opt_states)

    def __repr__(self) -> str:
        return f"DataParallel({len(self.slices)} slices, islands={[s.island for s in self.slices]})"
