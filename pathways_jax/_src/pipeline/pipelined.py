"""``Pipeline``: a model of stages on their own slices, one program call per train step."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import nnx

import pathways_jax as pw
from pathways_jax._src.pipeline import rngs as rngs_lib
from pathways_jax._src.pipeline import stages as stages_lib
from pathways_jax._src.pipeline.flags import StageRefused, named
from pathways_jax._src.pipeline.nodes import Layout, LossFn, Nodes, StateNodes, build_nodes, build_state_nodes
from pathways_jax._src.pipeline.optimizers import OptaxLike
from pathways_jax._src.pipeline.rngs import Mode, Rngs
from pathways_jax._src.pipeline.schedules import SCHEDULES, Schedule, bubble_fraction, schedule_order
from pathways_jax._src.pipeline.stages import Stage

Layouts = tuple[Layout, ...]  # the layout of every stage's output, first stage first


class Pipeline:
    """A model given as stages, each on its own slice, trained by ONE program call per step.

    A train step is one ``@pw.program``: the batch is cut into
    ``num_microbatches`` microbatches that flow forward stage to stage, the
    loss is taken on the last stage, gradients flow back, every stage
    accumulates its gradients and applies its own Optax update on its own
    slice. Values crossing slices move by themselves (``"dcn"`` across
    islands). Parameters and optimizer states stay on their slices as
    :class:`pw.Future` s between steps.

    Within a stage's slice, microbatches (and the activations and targets
    that lead with the batch dimension) are split over the ``data_axis`` mesh
    axis when the slice has one; parameters are replicated unless
    ``param_specs`` shards them.

    Args:
      stages: the model, first stage first. Each is a Flax NNX module (its
        ``nnx.Param`` variables are trained, or those an ``nnx.Optimizer``'s
        ``wrt=`` selects, other variables held fixed), a
        ``(linen_module, variables)`` pair, or a ``(params, apply_fn)`` pair
        with ``apply_fn(params, x) -> y``.
      devices: one slice per stage, from ``pw.devices(...)``; stages may be
        on different islands.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean over the
        microbatch's examples (then the step's loss and gradients are those
        of the whole batch). ``None`` for inference only.
      optimizer: one optimizer for every stage, or one per stage: anything
        with Optax's ``init(params)`` and ``update(grads, state, params) ->
        (updates, state)`` (an ``optax.GradientTransformation`` or an object
        of your own), or a ``flax.nnx.Optimizer``, whose Optax transformation
        ``.tx`` is used with a fresh state per stage (the ``nnx.Optimizer``
        itself is not updated; the pipeline holds parameters and states), and
        whose ``wrt=`` chooses the NNX parameters that train, as its
        ``update`` does (``nnx.LoRAParam``: the LoRA parameters only).
        ``None`` for inference only.
      num_microbatches: microbatches per step; must divide a train step's batch size
        (``forward`` pads a batch it does not divide, see :meth:`forward`).
      schedule: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"``
        (one forward, one backward: fewer activations alive at once).
      data_axis: the mesh axis of each slice that splits the batch (``None``: none); a name
        other than the default ``"data"`` that no slice has is a ``PlacementError``.
      param_specs: ``None`` (replicated), one ``pw.P`` for every parameter,
        a function ``(key_path, leaf) -> pw.P | None``, a pytree prefix of the
        stage's params with ``pw.P`` or ``None`` at its leaves, or a list with
        one of those per stage.
      remat: keep only each stage's input between forward and backward and
        recompute the forward in the backward (less memory, one more forward).
      max_grad_norm: clip the gradients by the global norm of the whole model's
        gradients (all stages together) before every stage's optimizer, as
        ``optax.clip_by_global_norm(max_grad_norm)`` first in the chain of the
        unpipelined model does. Each stage's ``optimizer`` sees only that
        stage's gradients, so an ``optax.clip_by_global_norm`` inside it clips
        by the stage's own norm instead. The updates then wait for the last
        stage's gradients (stage 0's, the schedule's last). ``loss_and_grads``
        returns the gradients unclipped.

    Dropout and other randomness: every call takes keyword-only ``rngs`` (a
    Flax-style mapping, ``{"dropout": key}``) and ``train`` (``True``,
    ``False`` or ``None``: pass nothing). Stage ``s`` on microbatch ``m`` runs
    with ``pipeline.derive_rngs(rngs, s, m)``, i.e. every key folded with
    ``s`` then ``m``, so a step is reproducible and differs across stages and
    microbatches; pass a new key each step (``jax.random.fold_in(key, step)``).
    How a stage takes ``train`` and ``rngs`` is described in :func:`as_stage`:
    its call gets ``train``, ``training`` or ``deterministic`` (``not train``),
    whichever it takes, or the name given as ``train_kw=`` (keyword-only, on
    every call that takes ``train``). ``train=True`` for a stage that cannot
    receive it is a ``ProgramTraceError`` before anything runs.
    ``train=False`` needs no ``rngs``.

    Raises:
      PlacementError: the stage count differs from the slice count, a slice
        is unusable, ``num_microbatches``/``schedule`` is invalid, or
        ``param_specs`` do not match a stage's params or slice.
      ProgramTraceError: a stage, the loss or an optimizer has the wrong type.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, pathways_jax as pw
      >>> from pathways_jax.pipeline import Pipeline
      >>> s0, s1 = pw.devices(mesh={"data": 1}), pw.devices(mesh={"data": 1})
      >>> scale = (jnp.ones(2), lambda p, x: x * p)
      >>> pipe = Pipeline([scale, scale], [s0, s1], num_microbatches=2,
      ...                 loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
      ...                 optimizer=optax.sgd(0.1))
      >>> float(pipe.train_step(np.ones((4, 2)), np.zeros((4, 2))).result())
      1.0
      >>> pipe.forward(np.ones((2, 2))).result().shape
      (2, 2)
    """

    def __init__(
        self,
        stages: Sequence[Any],
        devices: Sequence[pw.VirtualSlice],
        *,
        loss_fn: LossFn | None = None,
        optimizer: OptaxLike | Sequence[OptaxLike] | Any | None = None,
        num_microbatches: int = 1,
        schedule: Schedule = "1f1b",
        data_axis: str | None = "data",
        param_specs: stages_lib.ParamSpecs | Sequence[stages_lib.ParamSpecs] = None,
        remat: bool = False,
        max_grad_norm: float | None = None,
    ):
        # An nnx.Optimizer trains the Variables its wrt= selects (a LoRA layer's, not its base).
        sized = isinstance(stages, Sequence | nnx.List)
        wrt = stages_lib.trained_filters(optimizer, len(stages)) if sized else None
        normalised = stages_lib.as_stages(stages, wrt)
        if not normalised:
            raise pw.errors.PlacementError("Pipeline needs at least one stage and one slice; got none.")
        count = len(normalised)
        self.slices = stages_lib.check_slices(devices, count, "Pipeline")
        stages_lib.check_data_axis(self.slices, data_axis, "Pipeline")
        if (
            not isinstance(num_microbatches, int)
            or isinstance(num_microbatches, bool)
            or num_microbatches < 1
        ):
            raise pw.errors.PlacementError(
                f"num_microbatches must be an int >= 1, got {num_microbatches!r}; e.g. num_microbatches=4."
            )
        if schedule not in SCHEDULES:
            raise pw.errors.PlacementError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
        if loss_fn is not None and not callable(loss_fn):
            raise pw.errors.ProgramTraceError(
                f"loss_fn must be a function (outputs, targets) -> scalar, got {type(loss_fn).__name__}."
            )
        txs = stages_lib.check_optimizers(optimizer, count, "Pipeline")
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, int | float)
            or not max_grad_norm > 0
        ):
            raise pw.errors.ProgramTraceError(
                f"max_grad_norm must be a number > 0 (the largest global norm of the model's "
                f"gradients) or None, got {max_grad_norm!r}; e.g. max_grad_norm=1.0."
            )
        self.max_grad_norm = max_grad_norm
        if isinstance(param_specs, Sequence) and not isinstance(param_specs, pw.P):
            if len(param_specs) != count:
                raise pw.errors.PlacementError(
                    f"param_specs has {len(param_specs)} entries for {count} stages; give one per stage."
                )
            per_stage = list(param_specs)
        else:
            per_stage = [param_specs] * count
        self.stages = normalised
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.data_axis = data_axis
        self._loss_fn = loss_fn
        self._trainable = loss_fn is not None and all(tx is not None for tx in txs)
        self._state_nodes: list[StateNodes] = []
        self._param_specs = []
        for index, (stage, slice_, tx) in enumerate(zip(normalised, self.slices, txs, strict=True)):
            where = f"param_specs of Pipeline stage {index} ({stage.description})"
            stages_lib.check_partitioning(
                stage.params, slice_, f"Pipeline stage {index} ({stage.description})"
            )
            specs = stages_lib.param_specs(stage.params, per_stage[index], slice_, where)
            self._param_specs.append(specs)
            self._state_nodes.append(
                build_state_nodes(stage, slice_, tx if self._trainable else None, specs, max_grad_norm)
            )
        self._remat = remat
        # Place parameters and optimizer states on their slices: futures from here on.
        self._params: list[Any] = []
        self._opt_states: list[Any] = []
        for stage, nodes in zip(normalised, self._state_nodes, strict=True):
            placed = nodes.init(stage.params)
            if self._trainable:
                placed, opt_state = placed
                self._opt_states.append(opt_state)
            self._params.append(placed)
        self._order = schedule_order(schedule, count, num_microbatches)
        # By the checked inputs' signatures and mode: the layouts of the stages' outputs.
        self._checked: dict[Any, Layouts] = {}
        self._outputs: dict[Layouts, Any] = {}  # an abstract last-stage output of each, for errors
        self._nodes_by_mode: dict[tuple[Mode, Layouts], list[Nodes]] = {}
        self._programs: dict[tuple[str, Mode, Layouts, int | None], Any] = {}

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def bubble_fraction(self) -> float:
        """The schedule's idle fraction, ``(S - 1) / (M + S - 1)``."""
        return bubble_fraction(self.num_stages, self.num_microbatches)

    @property
    def params(self) -> list[Any]:
        """The current parameters, one pytree of futures per stage (NNX: an ``nnx.State``)."""
        return list(self._params)

    @property
    def opt_states(self) -> list[Any]:
        """The current optimizer states, one pytree of futures per stage."""
        return list(self._opt_states)

    @property
    def state(self) -> dict[str, list[Any]]:
        """All that training changes, to checkpoint: ``{"params": [...], "opt_states": [...]}``.

        One entry per stage in each list, pytrees of futures (an inference-only pipeline's
        ``opt_states`` is empty). Save it with Orbax (``ocp.args.StandardSave(pipe.state)``)
        and give a restored one to :meth:`load_state` of a pipeline built the same way, in this
        process or a new one: its next steps are those the saved pipeline would have taken.
        """
        return {"params": list(self._params), "opt_states": list(self._opt_states)}

    def load_state(self, state: Any) -> None:
        """Continues from a saved :attr:`state`: every stage's parameters and optimizer state.

        ``state`` is a restored checkpoint of :attr:`state` (arrays or futures; restore it with
        ``jax.tree.map(ocp.utils.to_shape_dtype_struct, pipe.state)`` as the target, or without
        one: matched by names). Each stage's part is placed on its slice with its sharding. A
        pipeline built for inference (no ``loss_fn``/``optimizer``) takes only the parameters
        of a trained one's state.

        Raises:
          PlacementError: ``state`` is not the state of a pipeline built the same way (an array
            missing or extra, or of another shape or dtype), naming the array.
        """
        if not self._trainable and isinstance(state, Mapping) and "params" in state:
            state = {"params": state["params"], "opt_states": []}  # inference: the parameters only
        checked = stages_lib.checked_state(state, self.state, "Pipeline.load_state: state")
        params, opt_states = [], []
        for index, nodes in enumerate(self._state_nodes):
            if self._trainable:
                p, o = nodes.place(checked["params"][index], checked["opt_states"][index])
                opt_states.append(o)
            else:
                p = nodes.place(checked["params"][index])
            params.append(p)
        self._params, self._opt_states = params, opt_states

    # -- nodes and programs, one set per mode ---------------------------------------------------

    def _nodes(self, mode: Mode, layouts: Layouts) -> list[Nodes]:
        if (mode, layouts) not in self._nodes_by_mode:
            count = self.num_stages
            self._nodes_by_mode[(mode, layouts)] = [
                build_nodes(
                    stage,
                    slice_,
                    mode,
                    self._loss_fn if self._trainable else None,
                    first=index == 0,
                    last=index == count - 1,
                    num_microbatches=self.num_microbatches,
                    remat=self._remat,
                    data_axis=self.data_axis,
                    pspecs=self._param_specs[index],
                    in_layout=None if index == 0 else layouts[index - 1],
                    out_layout=layouts[index],
                )
                for index, (stage, slice_) in enumerate(zip(self.stages, self.slices, strict=True))
            ]
        return self._nodes_by_mode[(mode, layouts)]

    def _program(self, kind: str, mode: Mode, layouts: Layouts, keep: int | None = None) -> Any:
        """The ``@pw.program`` of a call kind in a mode; keys, when keyed, come last.

        ``keep``: forward's output is cut back to its first ``keep`` examples (a padded batch).
        """
        if (kind, mode, layouts, keep) in self._programs:
            return self._programs[(kind, mode, layouts, keep)]
        nodes = self._nodes(mode, layouts)

        def pipeline_train_step(params: tuple, opt_states: tuple, xs: tuple, ys: tuple, *keys: Any) -> tuple:
            loss, _, new_params, new_opt_states = self._run_schedule(nodes, params, opt_states, xs, ys, keys)
            return loss, new_params, new_opt_states

        def pipeline_loss_and_grads(params: tuple, xs: tuple, ys: tuple, *keys: Any) -> tuple:
            loss, grads, _, _ = self._run_schedule(nodes, params, None, xs, ys, keys)
            return loss, tuple(grads)

        def pipeline_forward(params: tuple, xs: tuple, *keys: Any) -> Any:
            return self._forward_fn(nodes, params, xs, keys, layouts[-1], keep)

        step_fns: dict[str, Callable[..., Any]] = {
            "train": pipeline_train_step,
            "grads": pipeline_loss_and_grads,
            "forward": pipeline_forward,
        }
        fn = step_fns[kind]
        self._programs[(kind, mode, layouts, keep)] = pw.program(fn, name=fn.__name__)
        return self._programs[(kind, mode, layouts, keep)]

    # -- the traced step functions ------------------------------------------------------------

    def _run_schedule(
        self,
        nodes_per_stage: list[Nodes],
        params: tuple,
        opt_states: tuple | None,
        xs: tuple,
        ys: tuple,
        keys: tuple,
    ) -> tuple:
        count = self.num_stages
        final = {s: max(i for i, op in enumerate(self._order) if op[1] == s) for s in range(count)}
        outs: dict[tuple[int, int], Any] = {}
        saved: dict[tuple[int, int], tuple] = {}
        cots: dict[tuple[int, int], Any] = {}
        grads: list[Any] = [None] * count
        new_params, new_opt_states = list(params), list(opt_states or ())
        loss = None
        for i, (kind, s, m) in enumerate(self._order):
            nodes = nodes_per_stage[s]
            k = (keys[0][s][m],) if keys else ()  # the microbatch's keys: every node's last argument
            if kind in ("F", "L"):
                h = xs[m] if s == 0 else outs.pop((s - 1, m))
            if kind == "F":
                assert nodes.fwd is not None  # a schedule runs only nodes built with a loss_fn
                out = nodes.fwd(params[s], h, *k)
                if self._remat:  # keep the input (and keys), recompute later
                    outs[(s, m)] = out
                    saved[(s, m)] = (params[s], h)
                else:  # (output, vjp residuals); the output may itself be a tuple
                    outs[(s, m)], vjp = out
                    saved[(s, m)] = (vjp,)
            elif kind == "L":
                assert nodes.last is not None and nodes.last_acc is not None  # on the last stage
                if grads[s] is None:
                    res = nodes.last(params[s], h, ys[m], *k)
                else:
                    res = nodes.last_acc(params[s], h, ys[m], loss, grads[s], *k)
                loss, grads[s] = res[0], res[1]
                if s > 0:
                    cots[(s - 1, m)] = res[2]
            else:
                assert nodes.bwd is not None and nodes.bwd_acc is not None
                args = (*saved.pop((s, m)), cots.pop((s, m)))
                extra = k if self._remat else ()
                res = nodes.bwd(*args, *extra) if grads[s] is None else nodes.bwd_acc(*args, grads[s], *extra)
                if s == 0:
                    grads[s] = res
                else:
                    grads[s], cots[(s - 1, m)] = res
            if opt_states is not None and i == final[s] and self.max_grad_norm is None:
                # The stage's gradients are complete: update it now, on its slice.
                update = self._state_nodes[s].update
                assert update is not None  # opt_states: every stage has an optimizer
                # The loss is complete here: the stage's last backward follows the last microbatch's loss.
                value = (loss,) if self._state_nodes[s].needs_value else ()
                new_params[s], new_opt_states[s] = update(params[s], opt_states[s], grads[s], *value)
        if opt_states is not None and self.max_grad_norm is not None:
            # Clipping by the model's global norm needs every stage's gradients: each stage's
            # squared norm (a scalar) goes to every stage, which then clips and updates.
            squared = []
            for s in range(count):
                squared_norm = self._state_nodes[s].squared_norm
                assert squared_norm is not None
                squared.append(squared_norm(grads[s]))
            for s in range(count):
                clipped_update = self._state_nodes[s].clipped_update
                assert clipped_update is not None
                value = (loss,) if self._state_nodes[s].needs_value else ()
                new_params[s], new_opt_states[s] = clipped_update(
                    params[s], opt_states[s], grads[s], *value, *squared
                )
        return loss, grads, tuple(new_params), tuple(new_opt_states)

    def _forward_fn(
        self,
        nodes_per_stage: list[Nodes],
        params: tuple,
        xs: tuple,
        keys: tuple,
        layout: Layout,
        keep: int | None = None,
    ) -> Any:
        count, micro = self.num_stages, len(xs)
        outs: dict[tuple[int, int], Any] = {}
        for t in range(micro + count - 1):  # wavefront: stage s works on microbatch t - s
            for s in reversed(range(count)):
                m = t - s
                if 0 <= m < micro:
                    h = xs[m] if s == 0 else outs.pop((s - 1, m))
                    k = (keys[0][s][m],) if keys else ()
                    outs[(s, m)] = nodes_per_stage[s].infer(params[s], h, *k)
        results = [outs[(count - 1, m)] for m in range(micro)]
        if micro == 1 and keep is None:
            return results[0]
        last = self.slices[-1]
        spec = stages_lib.activation_spec(last, self.data_axis)
        whole = keep is not None and keep % stages_lib.data_parts(last, self.data_axis) != 0
        if whole:
            spec = pw.P()  # the examples kept do not divide over the data axis
        cut = functools.partial(_concatenate, keep=keep, whole=whole)
        concat = pw.jit(cut, devices=last, out_specs=layout.specs(spec))
        return concat(*results)

    # -- checks before anything runs ----------------------------------------------------------

    def _unit(self) -> int:
        """The batch sizes that need no padding are its multiples: microbatches over every slice."""
        return self.num_microbatches * math.lcm(
            *(stages_lib.data_parts(s, self.data_axis) for s in self.slices)
        )

    def _padded(self, x: Any) -> tuple[tuple[Any, ...], int]:
        """``forward``'s batch cut into the microbatches, padded to a size they divide; its size.

        The padding repeats the last example up to the next multiple of ``num_microbatches``
        times every slice's ``data_axis`` size; forward's output is cut back to the batch.
        """
        leaves, treedef, batch = stages_lib.batch_leaves(x, "x")
        pad = -batch % self._unit()
        if pad:
            leaves = [np.concatenate([leaf, np.repeat(leaf[-1:], pad, axis=0)]) for leaf in leaves]
        return self._split_leaves(leaves, treedef, batch + pad, "x"), batch

    def _split(self, x: Any, what: str) -> tuple[Any, ...]:
        """``x`` (an array or a pytree of arrays, e.g. a dict batch) cut into the microbatches."""
        return self._split_leaves(*stages_lib.batch_leaves(x, what), what)

    def _split_leaves(self, leaves: list[np.ndarray], treedef: Any, batch: int, what: str) -> tuple[Any, ...]:
        """:func:`stages_lib.batch_leaves`'s batch cut into the microbatches."""
        micro = self.num_microbatches
        if batch % micro:
            raise pw.errors.PlacementError(
                f"{what} has a batch of {batch} examples, which num_microbatches={micro} does not "
                f"divide; use a batch size that is a multiple of {micro}, or a num_microbatches "
                f"that divides {batch}."
            )
        return stages_lib.split_tree(
            leaves,
            treedef,
            micro,
            self.slices,
            self.data_axis,
            what=what,
            parts="microbatches",
            per="microbatches",
            place="stage",
        )

    def _check_chain(
        self, x: Any, y: Any | None, mode: Mode, rngs: dict[str, jax.Array] | None, what: str
    ) -> Layouts:
        """Checks the stages (and loss) on microbatch ``x`` abstractly; returns their outputs' layouts."""
        key = (stages_lib.signature(x), None if y is None else stages_lib.signature(y), mode)
        if key in self._checked:
            return self._checked[key]
        examples = stages_lib.batch_size(x)
        layouts: list[Layout] = []
        h: Any = stages_lib.abstract(x)
        for index, (stage, params) in enumerate(zip(self.stages, self._params, strict=True)):
            keys = None if rngs is None else rngs_lib.derive_rngs(rngs, index, 0)

            def run(p: Any, h: Any, stage: Stage = stage, keys: Any = keys) -> Any:
                return stage.run(p, h, keys, mode.train, mode.train_kw)

            try:
                with stages_lib.recording_stale_draws() as stale:
                    out = jax.eval_shape(run, stages_lib.abstract(params), h)
            except StageRefused as exc:  # train=True unreached, state it would hold
                raise named(exc, f"Pipeline.{what}") from None
            except Exception as exc:
                raise _stage_error(self.stages[index], index, h, mode, exc) from exc
            if stale:
                where = "Pipeline" if y is None else "Pipeline (train step)"
                raise stages_lib.stale_draws_error(
                    stale, [name for name, _ in mode.streams], where, mode.train
                )
            h = out
            layouts.append(Layout.of(out, examples))
        if y is not None:
            assert self._loss_fn is not None  # targets come only with a trainable pipeline
            try:
                loss = jax.eval_shape(self._loss_fn, h, stages_lib.abstract(y))
            except Exception as exc:
                raise pw.errors.ProgramTraceError(
                    f"loss_fn cannot take the last stage's output {stages_lib.describe(h)} and targets "
                    f"{stages_lib.describe(y)}: {type(exc).__name__}: {exc}"
                ) from exc
            if not (isinstance(loss, jax.ShapeDtypeStruct) and loss.shape == ()) or not jnp.issubdtype(
                loss.dtype, jnp.floating
            ):
                raise pw.errors.ProgramTraceError(
                    f"loss_fn must return a float scalar (the microbatch's mean loss), got "
                    f"{jax.tree.map(lambda a: (a.shape, a.dtype), loss)}."
                )
        self._checked[key] = tuple(layouts)
        self._outputs.setdefault(self._checked[key], h)
        return self._checked[key]

    def _mode(
        self, rngs: Rngs | None, train: bool | None, train_kw: str | None, what: str
    ) -> tuple[Mode, Any, tuple]:
        """The call's mode, its checked typed keys, and the program's trailing key arguments."""
        typed = rngs_lib.check_rngs(rngs, f"Pipeline.{what}")
        mode = rngs_lib.mode_of(typed, train, f"Pipeline.{what}", train_kw)
        stages_lib.check_train(self.stages, train, train_kw, f"Pipeline.{what}")
        grid = rngs_lib.key_grid(typed, self.num_stages, self.num_microbatches)
        return mode, typed, () if grid is None else (grid,)

    def _training_inputs(
        self, x: Any, y: Any, what: str, rngs: Rngs | None, train: bool | None, train_kw: str | None
    ) -> tuple[tuple, tuple, Mode, tuple, Layouts]:
        if not self._trainable:
            raise pw.errors.ProgramTraceError(
                f"Pipeline.{what} needs loss_fn= and optimizer= (this pipeline was built for inference "
                "only); use Pipeline(..., loss_fn=..., optimizer=optax...)."
            )
        xs, ys = self._split(x, "x"), self._split(y, "y")
        x_batch, y_batch = (stages_lib.batch_size(part[0]) * len(part) for part in (xs, ys))
        if x_batch != y_batch:
            raise pw.errors.PlacementError(f"x has a batch of {x_batch} but y of {y_batch}; they must match.")
        mode, typed, keys = self._mode(rngs, train, train_kw, what)
        layouts = self._check_chain(xs[0], ys[0], mode, typed, what)
        return xs, ys, mode, keys, layouts

    # -- public calls -------------------------------------------------------------------------

    def train_step(
        self,
        x: Any,
        y: Any,
        *,
        rngs: Rngs | None = None,
        train: bool | None = None,
        train_kw: str | None = None,
    ) -> pw.Future:
        """Runs one train step (ONE program call) and returns the mean loss as a future.

        Args:
          x: the batch of inputs (first dimension: the batch).
          y: the batch of targets.
          rngs: stream name to key, e.g. ``{"dropout": jax.random.fold_in(key, step)}``;
            stage ``s`` on microbatch ``m`` gets :func:`derive_rngs` ``(rngs, s, m)``. An
            ``nnx.Rngs`` gives the keys its streams draw next (one per stream, advancing it).
          train: passed to every stage, as ``train``, ``training`` or
            ``deterministic`` (``not train``), whichever its call takes (see
            :func:`as_stage`); ``None`` passes nothing.
          train_kw: the keyword the stages take the flag under when it is none
            of those, e.g. ``train_kw="is_training"``; a stage that does not
            take it gets one of the names above.

        Returns:
          The batch's mean loss (before the update), a :class:`pw.Future` on the last
          stage's slice. The new parameters are in :attr:`params`.

        Raises:
          PlacementError: ``num_microbatches`` does not divide the batch, or a
            microbatch cannot be split over a stage's ``data_axis``.
          ProgramTraceError: a stage cannot take the previous stage's output,
            a stage needs an RNG stream that ``rngs`` lacks, ``rngs``/``train``/
            ``train_kw`` are malformed, ``train=True`` and a stage takes no flag
            (nor ``train_kw``), or the loss is not a float scalar.
        """
        xs, ys, mode, keys, layouts = self._training_inputs(x, y, "train_step", rngs, train, train_kw)
        program = self._program("train", mode, layouts)
        loss, params, opt_states = program(tuple(self._params), tuple(self._opt_states), xs, ys, *keys)
        self._params, self._opt_states = list(params), list(opt_states)
        return loss

    def loss_and_grads(
        self,
        x: Any,
        y: Any,
        *,
        rngs: Rngs | None = None,
        train: bool | None = None,
        train_kw: str | None = None,
    ) -> tuple[pw.Future, list[Any]]:
        """The batch's mean loss and every stage's gradients, without an update (one program call).

        ``rngs``, ``train`` and ``train_kw`` are as in :meth:`train_step`.
        """
        xs, ys, mode, keys, layouts = self._training_inputs(x, y, "loss_and_grads", rngs, train, train_kw)
        loss, grads = self._program("grads", mode, layouts)(tuple(self._params), xs, ys, *keys)
        return loss, list(grads)

    def forward(
        self, x: Any, *, rngs: Rngs | None = None, train: bool | None = None, train_kw: str | None = None
    ) -> Any:
        """The model's output for a batch (inference; one program call), on the last stage.

        Pass ``train=False`` to run stages in evaluation mode (no ``rngs`` needed);
        ``rngs``, ``train`` and ``train_kw`` are as in :meth:`train_step`.

        The batch may have any size, as under ``jax.jit``: one that ``num_microbatches`` (times
        the slices' ``data_axis`` size) does not divide is padded with copies of its last
        example, and the output is cut back to the batch's examples.
        """
        xs, batch = self._padded(x)
        mode, typed, keys = self._mode(rngs, train, train_kw, "forward")
        layouts = self._check_chain(xs[0], None, mode, typed, "forward")
        padded = stages_lib.batch_size(xs[0]) * len(xs)
        if padded != batch and not all(layouts[-1].batched):
            raise pw.errors.PlacementError(
                f"Pipeline.forward: a batch of {batch} examples is padded to {padded} (a multiple of "
                f"num_microbatches={self.num_microbatches} times the slices' {self.data_axis!r} axis), "
                f"but the last stage's output {stages_lib.describe(self._outputs[layouts])} has arrays "
                "that do not lead with the examples (a scalar, such as a mean), which the padding "
                f"would change. Use a batch size that is a multiple of {self._unit()}, "
                "or return per-example values from the last stage."
            )
        if len(xs) > 1 and not all(layouts[-1].batched):
            raise pw.errors.PlacementError(
                f"Pipeline.forward: the last stage's output {stages_lib.describe(self._outputs[layouts])} "
                f"has arrays that do not lead with the microbatch's {stages_lib.batch_size(xs[0])} "
                f"examples (a scalar, such as a mean or an auxiliary loss, or another length), and "
                f"forward concatenates the {len(xs)} microbatches' outputs along the batch, which would "
                "not be the whole batch's. Return per-example values from the last stage (reduce them "
                "after forward), or call forward with num_microbatches=1 (a Pipeline built for it)."
            )
        keep = None if padded == batch else batch
        return self._program("forward", mode, layouts, keep)(tuple(self._params), xs, *keys)

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
        xs, ys, mode, keys, layouts = self._training_inputs(x, y, "graph", rngs, train, train_kw)
        return self._program("train", mode, layouts).graph(
            tuple(self._params), tuple(self._opt_states), xs, ys, *keys
        )

    def __repr__(self) -> str:
        return (
            f"Pipeline({self.num_stages} stages, {self.num_microbatches} microbatches, "
            f"schedule={self.schedule!r}, islands={[s.island for s in self.slices]})"
        )


def _stage_error(stage: Stage, index: int, h: Any, mode: Mode, exc: Exception) -> pw.errors.ProgramTraceError:
    """A stage failed on abstract inputs: say what it was fed and, if it wanted a key, what to pass."""
    fed = (
        f"a microbatch {stages_lib.describe(h)}"
        if index == 0
        else f"the output of stage {index - 1}, {stages_lib.describe(h)}"
    )
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    given = [name for name, _ in mode.streams]
    if isinstance(exc, flax_errors.InvalidRngError) or "rng" in detail.lower():
        return pw.errors.ProgramTraceError(
            f"Pipeline stage {index} ({stage.description}) needs an RNG stream with train={mode.train} "
            f"but the call gave rngs for {given or 'no streams'}: {type(exc).__name__}: {detail[:300]}. "
            "Pass rngs={'dropout': key} (one key per stream the stage uses) to train_step/forward, "
            "or train=False to run it without randomness."
        )
    if mode.train is None and any(flag in detail for flag in ("deterministic", "use_running_average")):
        # A layer told neither train nor eval (nnx.MultiHeadAttention with a dropout_rate, built
        # without deterministic=): in plain NNX, model.train() or model.eval() first.
        return pw.errors.ProgramTraceError(
            f"Pipeline stage {index} ({stage.description}) has a layer that needs to be told train or "
            f"eval mode: {type(exc).__name__}: {detail[:300]}. Pass train=True (with rngs=...) or "
            "train=False to the call: the stages are switched as model.train() / model.eval() switch them."
        )
    return pw.errors.ProgramTraceError(
        f"Pipeline stage {index} ({stage.description}) cannot take {fed}: "
        f"{type(exc).__name__}: {detail[:300]}. Each stage's output must be what the next "
        "stage takes (e.g. its in_features); fix the stage sizes or the input shape."
    )


def _concatenate(*parts: Any, keep: int | None = None, whole: bool = False) -> Any:
    """The microbatches' outputs as one batch; its first ``keep`` examples (a padded batch's).

    ``whole``: the batch is gathered onto every device before the cut (the examples kept do not
    divide over the data axis; cutting the split batch fails to compile once fused with the
    stage's node).
    """

    def one(*arrays: Any) -> Any:
        joined = jnp.concatenate(arrays)
        if whole:
            joined = jax.lax.with_sharding_constraint(joined, jax.sharding.PartitionSpec())
        return joined[:keep]

    return jax.tree.map(one, *parts)
