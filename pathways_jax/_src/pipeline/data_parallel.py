"""``DataParallel``: one model on several islands, one program call per train step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

import pathways_jax as pw
from pathways_jax._src.pipeline import rngs as rngs_lib
from pathways_jax._src.pipeline import stages as stages_lib
from pathways_jax._src.pipeline.flags import StageRefused, named
from pathways_jax._src.pipeline.optimizers import OptaxLike, needs_value
from pathways_jax._src.pipeline.rngs import Mode, Rngs

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

    With ``param_specs``, each parameter is sharded over every slice's mesh as
    asked; its gradients and optimizer state keep that sharding and move
    between slices leaf by leaf (without ``param_specs`` they are replicated
    and move as one flat vector).

    Args:
      model: a Flax NNX module, a ``(linen_module, variables)`` pair, a
        ``(params, apply_fn)`` pair, or a list of those (composed in order,
        see :func:`sequential`).
      devices: the slices, one per replica; usually one per island.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean over examples.
      optimizer: anything with Optax's ``init(params)`` and ``update(grads,
        state, params) -> (updates, state)`` (an ``optax.GradientTransformation``
        or an object of your own), or a ``flax.nnx.Optimizer``, whose ``.tx``
        is used with a fresh state and whose ``wrt=`` chooses the NNX
        parameters that train (``nnx.LoRAParam``: the LoRA parameters only).
      data_axis: the mesh axis of each slice that splits its shard (``None``: none); a name
        other than the default ``"data"`` that no slice has is a ``PlacementError``.
      param_specs: how each parameter is sharded over every slice: ``None``
        (replicated), one ``pw.P`` for all, a pytree prefix of the params with
        ``pw.P`` or ``None`` at its leaves (``{"w": pw.P(None, "model"), "b":
        None}``), or a function ``(key_path, leaf) -> pw.P | None``.

    ``train_step`` takes keyword-only ``rngs``, ``train`` and ``train_kw`` as
    :meth:`Pipeline.train_step` does; shard ``i`` runs with
    ``derive_rngs(rngs, 0, i)``.

    Raises:
      PlacementError: no slices, a slice is unusable, or ``param_specs`` do
        not match the params or a slice's mesh.
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
        optimizer: OptaxLike | Any,
        data_axis: str | None = "data",
        param_specs: stages_lib.ParamSpecs = None,
    ):
        # An nnx.Optimizer trains the Variables its wrt= selects (a LoRA layer's, not its base).
        (wrt,) = stages_lib.trained_filters(optimizer, 1)
        if isinstance(model, list | nnx.List):  # stages composed in order; a tuple is a pair
            parts = stages_lib.as_stages(model, [wrt] * len(model))
            stage = stages_lib.as_stage(stages_lib.sequential(parts), 0)
        else:
            stage = stages_lib.as_stage(model, 0, wrt=wrt)
            parts = [stage]
        slices = list(devices) if isinstance(devices, Sequence) else [devices]
        if not slices:
            raise pw.errors.PlacementError("DataParallel needs at least one slice; got none.")
        self.slices = stages_lib.check_slices(slices, len(slices), "DataParallel")
        stages_lib.check_data_axis(self.slices, data_axis, type(self).__name__)
        if not callable(loss_fn):
            raise pw.errors.ProgramTraceError(
                f"loss_fn must be a function (outputs, targets) -> scalar, got {type(loss_fn).__name__}."
            )
        if optimizer is None:
            raise pw.errors.ProgramTraceError("DataParallel needs optimizer=, e.g. optax.adam(1e-3).")
        one = callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
        if not one and not isinstance(optimizer, nnx.Optimizer | str) and isinstance(optimizer, Sequence):
            raise pw.errors.ProgramTraceError(
                f"{type(self).__name__}: optimizer is a sequence of {len(optimizer)}; a data-parallel "
                "model (of one module or of a list of stages) trains all its parameters with ONE "
                "optimizer, e.g. optimizer=optax.adam(1e-3). For one optimizer per part, use "
                "optax.multi_transform; one per stage is Pipeline's."
            )
        (tx,) = stages_lib.check_optimizers(optimizer, 1, "DataParallel")
        assert tx is not None  # optimizer is not None, so check_optimizers made one
        self.stage = stage
        self._parts = parts  # the stages the flag must reach (the composed ones, for a list)
        self.data_axis = data_axis
        self._loss_fn = loss_fn
        self._tx = tx
        # The optimizer takes the step's loss as value= (optax.contrib.reduce_on_plateau).
        self._needs_value = needs_value(tx, stage.params)
        for i, slice_ in enumerate(self.slices):
            stages_lib.check_partitioning(stage.params, slice_, f"DataParallel on slice {i}")
        specs = [
            stages_lib.param_specs(
                stage.params, param_specs, slice_, f"DataParallel param_specs on slice {i}"
            )
            for i, slice_ in enumerate(self.slices)
        ]
        self._pspecs = pspecs = specs[0]
        # Replicated parameters: the gradients travel as one flat vector (one transfer per
        # island pair). Sharded ones: leaf by leaf, each keeping its parameter's sharding.
        self._flat = all(
            spec == pw.P() for spec in jax.tree.leaves(pspecs, is_leaf=lambda s: isinstance(s, pw.P))
        )
        self._ospecs = ospecs = self._state_specs(stage.params, pspecs)
        self._steps = 0  # train steps taken (pw.elastic sets it back when it runs steps again)
        self._loads = 0  # states load_state put in: a pw.elastic.Manager goes on from the last one
        self._update_by_slice: dict[int, pw.JitFunction] = {}
        self._grad_by_slice: dict[tuple[Mode, int], pw.JitFunction] = {}
        params, opt_states = [], []
        for slice_ in self.slices:
            init = pw.jit(lambda p: (p, self._init_state(p)), devices=slice_, out_specs=(pspecs, ospecs))
            p, o = init(stage.params)
            params.append(p)
            opt_states.append(o)
        self._set_replicas(self.slices, params, opt_states)

    def _set_replicas(
        self, slices: Sequence[pw.VirtualSlice], params: Sequence[Any], opt_states: Sequence[Any]
    ) -> None:
        """The replicas from now on: their slices, parameters and optimizer states, in order.

        ``pw.elastic.Manager`` drops the replicas of a lost island and adds
        one back when the island returns; the step's program is traced again
        for the new count (a slice's own nodes are kept).
        """
        self.slices = list(slices)
        self._params = list(params)
        self._opt_states = list(opt_states)
        self._update_nodes = [self._update_node(slice_) for slice_ in self.slices]
        count = len(self.slices)

        def mean(*losses: jax.Array) -> jax.Array:
            return sum(losses[1:], losses[0]) / count

        self._mean = pw.jit(mean, devices=self.slices[0], out_specs=pw.P())
        self._checked: set[Any] = set()
        self._grad_nodes_by_mode: dict[Mode, list[pw.JitFunction]] = {}
        self._programs: dict[Any, Any] = {}  # by mode (and, for DiLoCo, whether it syncs)

    def _state_specs(self, params: Any, pspecs: Any) -> Any:
        """The specs of a replica's optimizer state (``_init_state``'s)."""
        return stages_lib.opt_state_specs(self._tx, params, pspecs)

    def _init_state(self, params: Any) -> Any:
        """A replica's optimizer state for ``params`` (traced on its slice)."""
        return self._tx.init(params)

    def _update_node(self, slice_: pw.VirtualSlice) -> pw.JitFunction:
        node = self._update_by_slice.get(slice_.id)
        if node is None:
            node = self._update_by_slice[slice_.id] = pw.jit(
                self._average_and_update, devices=slice_, out_specs=(self._pspecs, self._ospecs)
            )
        return node

    def _average_and_update(self, p: Any, o: Any, *grads: Any) -> tuple[Any, Any]:
        extra = {}
        if self._needs_value:  # every island's gradients, then every island's loss
            count = len(grads) // 2
            grads, losses = grads[:count], grads[count:]
            extra["value"] = sum(losses[1:], losses[0]) / count  # the step's loss, as reported
        total = grads[0]
        for g in grads[1:]:  # the same order on every island: identical results
            total = jax.tree.map(jnp.add, total, g)
        mean = jax.tree.map(lambda g: g / len(grads), total)
        if self._flat:
            mean = ravel_pytree(self.stage.params)[1](mean)
        updates, o = self._tx.update(mean, o, p, **extra)
        return optax.apply_updates(p, updates), o

    def _grad_nodes(self, mode: Mode) -> list[pw.JitFunction]:
        if mode in self._grad_nodes_by_mode:
            return self._grad_nodes_by_mode[mode]
        stage, loss_fn, flat = self.stage, self._loss_fn, self._flat

        def loss_and_grads(p: Any, x: Any, y: Any, *k: Any) -> tuple[jax.Array, Any]:
            rngs = mode.wrap(k[0]) if k else None
            loss, grads = jax.value_and_grad(
                lambda p: loss_fn(stage.run(p, x, rngs, mode.train, mode.train_kw), y)
            )(p)
            return loss, ravel_pytree(grads)[0] if flat else grads  # flat: one transfer per island pair

        nodes = []
        for slice_ in self.slices:
            node = self._grad_by_slice.get((mode, slice_.id))
            if node is None:
                act = stages_lib.activation_spec(slice_, self.data_axis)
                kspec = (None,) if mode.keyed else ()
                out = pw.P() if flat else (pw.P(), self._pspecs)
                node = self._grad_by_slice[(mode, slice_.id)] = pw.jit(
                    loss_and_grads, devices=slice_, in_specs=(None, act, act, *kspec), out_specs=out
                )
            nodes.append(node)
        self._grad_nodes_by_mode[mode] = nodes
        return nodes

    def _program(self, mode: Mode) -> Any:
        if mode not in self._programs:
            grad_nodes = self._grad_nodes(mode)

            def data_parallel_train_step(
                params: tuple, opt_states: tuple, xs: tuple, ys: tuple, *keys: Any
            ) -> tuple:
                results = [
                    node(p, x, y, *((keys[0][i],) if keys else ()))
                    for i, (node, p, x, y) in enumerate(zip(grad_nodes, params, xs, ys, strict=True))
                ]
                grads = [g for _, g in results]
                if self._needs_value:  # and the losses, for the optimizer's value=
                    grads += [loss for loss, _ in results]
                new = [
                    node(p, o, *grads)  # grads made on other islands arrive over DCN
                    for node, p, o in zip(self._update_nodes, params, opt_states, strict=True)
                ]
                loss = self._mean(*(loss for loss, _ in results))
                return loss, tuple(p for p, _ in new), tuple(o for _, o in new)

            self._programs[mode] = pw.program(data_parallel_train_step, name="data_parallel_train_step")
        return self._programs[mode]

    def _split(self, x: Any, what: str) -> tuple[Any, ...]:
        """``x`` (an array or a pytree of arrays, e.g. a dict batch) cut into one shard per slice."""
        leaves, treedef, batch = stages_lib.batch_leaves(x, what)
        count = len(self.slices)
        if batch % count:
            raise pw.errors.PlacementError(
                f"{what} has a batch of {batch} examples; its first (batch) dimension must be a "
                f"multiple of the {count} slices so each gets an equal shard."
            )
        return stages_lib.split_tree(
            leaves,
            treedef,
            count,
            self.slices,
            self.data_axis,
            what=what,
            parts="shards",
            per="slices",
            place="slice",
        )

    def _check(self, x: Any, y: Any, mode: Mode, rngs: dict[str, jax.Array] | None) -> None:
        key = (stages_lib.signature(x), stages_lib.signature(y), mode)
        if key in self._checked:
            return
        keys = None if rngs is None else rngs_lib.derive_rngs(rngs, 0, 0)
        try:
            with stages_lib.recording_stale_draws() as stale:
                out = jax.eval_shape(
                    lambda p, x: self.stage.run(p, x, keys, mode.train, mode.train_kw),
                    stages_lib.abstract(self._params[0]),
                    x,
                )
            loss = jax.eval_shape(self._loss_fn, out, y)
        except StageRefused as exc:  # train=True unreached, state it would hold
            raise named(exc, f"{type(self).__name__}.train_step") from None
        except Exception as exc:
            given = [name for name, _ in mode.streams] or "no streams"
            raise pw.errors.ProgramTraceError(
                f"DataParallel: the model and loss_fn cannot take a shard x {stages_lib.describe(x)}, "
                f"y {stages_lib.describe(y)} with train={mode.train} and rngs for {given}: "
                f"{type(exc).__name__}: {exc}. If the model needs an RNG stream, pass "
                "rngs={'dropout': key} to train_step (or train=False)."
            ) from exc
        if stale:
            given = [name for name, _ in mode.streams]
            raise stages_lib.stale_draws_error(stale, given, f"{type(self).__name__}.train_step", mode.train)
        if not (isinstance(loss, jax.ShapeDtypeStruct) and loss.shape == ()):
            raise pw.errors.ProgramTraceError(f"loss_fn must return a float scalar, got {loss}.")
        self._checked.add(key)

    def _inputs(self, x: Any, y: Any, rngs: Rngs | None, train: bool | None, train_kw: str | None) -> tuple:
        xs, ys = self._split(x, "x"), self._split(y, "y")
        x_batch, y_batch = (stages_lib.batch_size(part[0]) * len(part) for part in (xs, ys))
        if x_batch != y_batch:
            raise pw.errors.PlacementError(
                f"{type(self).__name__}.train_step: x has a batch of {x_batch} but y of {y_batch}; "
                "they must match (one target per example)."
            )
        typed = rngs_lib.check_rngs(rngs, "DataParallel.train_step")
        mode = rngs_lib.mode_of(typed, train, "DataParallel.train_step", train_kw)
        stages_lib.check_train(self._parts, train, train_kw, "DataParallel.train_step")
        self._check(xs[0], ys[0], mode, typed)
        grid = rngs_lib.key_grid(typed, 1, len(self.slices))
        return xs, ys, mode, () if grid is None else (grid[0],)

    def train_step(
        self,
        x: Any,
        y: Any,
        *,
        rngs: Rngs | None = None,
        train: bool | None = None,
        train_kw: str | None = None,
    ) -> pw.Future:
        """Runs one train step (ONE program call); returns the batch's mean loss as a future.

        Args:
          x: the batch of inputs; slice ``i`` gets the ``i``-th equal shard.
          y: the batch of targets.
          rngs: stream name to key; shard ``i`` runs with ``derive_rngs(rngs, 0, i)``.
          train: passed to the model (each of its stages, for a list) as
            ``train``, ``training`` or ``deterministic`` (``not train``),
            whichever its call takes (see :func:`as_stage`).
          train_kw: the keyword the model takes the flag under when it is
            none of those, e.g. ``train_kw="is_training"``.

        Raises:
          PlacementError: the batch does not split evenly over the slices (and
            their ``data_axis``).
          ProgramTraceError: the model or loss cannot take the inputs, the
            model needs an RNG stream that ``rngs`` lacks, or ``train=True``
            and the model takes no flag (nor ``train_kw``).
        """
        xs, ys, mode, keys = self._inputs(x, y, rngs, train, train_kw)
        loss, params, opt_states = self._program(mode)(
            tuple(self._params), tuple(self._opt_states), xs, ys, *keys
        )
        self._params, self._opt_states = list(params), list(opt_states)
        self._steps += 1
        return loss

    def graph(
        self,
        x: Any,
        y: Any,
        *,
        rngs: Rngs | None = None,
        train: bool | None = None,
        train_kw: str | None = None,
    ) -> pw.Graph:
        """The dataflow graph of one train step for these inputs (arguments as in :meth:`train_step`)."""
        xs, ys, mode, keys = self._inputs(x, y, rngs, train, train_kw)
        return self._program(mode).graph(tuple(self._params), tuple(self._opt_states), xs, ys, *keys)

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

    @property
    def state(self) -> dict[str, Any]:
        """All that training changes, to checkpoint: ``{"params", "opt_state", "step"}``.

        The replicas are identical, so this is the first one's parameters and optimizer state
        (pytrees of futures) and the count of steps taken. Save it with Orbax
        (``ocp.args.StandardSave(dp.state)``) and give a restored one to :meth:`load_state`
        of a model built the same way, on as many islands or fewer or more.
        """
        return {"params": self._params[0], "opt_state": self._opt_states[0], "step": self._steps}

    def load_state(self, state: Any) -> None:
        """Continues from a saved :attr:`state`: every replica gets its parameters and optimizer state.

        ``state`` is a restored checkpoint of :attr:`state` (arrays or futures), restored with
        ``jax.tree.map(ocp.utils.to_shape_dtype_struct, dp.state)`` as the target or without
        one (matched by names). A ``pw.elastic.Manager`` made after it starts at its step.

        Raises:
          PlacementError: ``state`` is not the state of a model built the same way (an array
            missing or extra, or of another shape or dtype), naming the array.
        """
        step = self._checked_step(state)
        own = {name: value for name, value in self.state.items() if name != "step"}
        given = {name: value for name, value in state.items() if name != "step"}
        checked = stages_lib.checked_state(given, own, f"{type(self).__name__}.load_state: state")
        placed = [self._place(slice_)(checked["params"], checked["opt_state"]) for slice_ in self.slices]
        self._load(step, [p for p, _ in placed], [o for _, o in placed])

    def _checked_step(self, state: Any) -> int:
        what = f"{type(self).__name__}.load_state: state"
        if not isinstance(state, Mapping) or "step" not in state:
            raise pw.errors.PlacementError(
                f"{what} is {type(state).__name__} {state!r:.80}; expected a restored checkpoint of "
                f"{type(self).__name__}.state, a dict with the keys {sorted(self.state)}."
            )
        step = np.asarray(state["step"])
        if step.shape != () or not np.issubdtype(step.dtype, np.integer) or int(step) < 0:
            raise pw.errors.PlacementError(
                f"{what}['step'] is {state['step']!r:.60}; expected the count of steps taken, an int >= 0."
            )
        return int(step)

    def _load(self, step: int, params: list[Any], opt_states: list[Any]) -> None:
        self._params, self._opt_states = params, opt_states
        self._steps = step
        self._loads += 1

    def _place(self, slice_: pw.VirtualSlice) -> pw.JitFunction:
        """Puts a replica's parameters and optimizer state on ``slice_`` with their shardings."""
        return pw.jit(lambda p, o: (p, o), devices=slice_, out_specs=(self._pspecs, self._ospecs))

    def __repr__(self) -> str:
        return f"DataParallel({len(self.slices)} slices, islands={[s.island for s in self.slices]})"
