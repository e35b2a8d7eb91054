"""``Pipeline``: a model of stages on their own slices, one program call per train step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pathways_jax as pw
from pathways_jax._src.pipeline import stages as stages_lib
from pathways_jax._src.pipeline.schedules import SCHEDULES, Schedule, bubble_fraction, schedule_order
from pathways_jax._src.pipeline.stages import Stage

LossFn = Callable[[Any, Any], jax.Array]


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


@dataclasses.dataclass(frozen=True, slots=True)
class _Nodes:
    """The ``pw.jit`` functions of one stage, all placed on the stage's slice."""

    init: pw.JitFunction
    infer: pw.JitFunction
    fwd: pw.JitFunction | None = None
    bwd: pw.JitFunction | None = None
    bwd_acc: pw.JitFunction | None = None
    last: pw.JitFunction | None = None
    last_acc: pw.JitFunction | None = None
    update: pw.JitFunction | None = None


def _build_nodes(
    stage: Stage,
    slice_: pw.VirtualSlice,
    tx: optax.GradientTransformation | None,
    loss_fn: LossFn | None,
    *,
    first: bool,
    last: bool,
    num_microbatches: int,
    remat: bool,
    data_axis: str | None,
    pspecs: Any,
) -> _Nodes:
    apply = stage.apply
    act = stages_lib.activation_spec(slice_, data_axis)

    def jit(fun: Callable[..., Any], **kwargs: Any) -> pw.JitFunction:
        return pw.jit(fun, devices=slice_, **kwargs)

    def infer(p: Any, h: Any) -> Any:
        return apply(p, h)

    if tx is None:
        init = jit(lambda p: p, out_specs=pspecs)
    else:
        ospecs = stages_lib.opt_state_specs(tx, stage.params, pspecs)
        init = jit(lambda p: (p, tx.init(p)), out_specs=(pspecs, ospecs))
    nodes = _Nodes(init=init, infer=jit(infer, in_specs=(None, act), out_specs=act))
    if tx is None or loss_fn is None:
        return nodes

    def forward_vjp(p: Any, h: Any) -> tuple[Any, Any]:
        # The vjp function is a pytree whose leaves are the residual arrays:
        # they become node outputs and stay on the slice until the backward.
        if first:  # the model input may be integer tokens: no cotangent for it
            return jax.vjp(lambda p: apply(p, h), p)
        return jax.vjp(apply, p, h)

    def cotangents(vjp: Any, dy: Any) -> Any:
        cts = vjp(dy)
        return cts[0] if first else cts

    def add_grads(out: Any, acc: Any) -> Any:
        return _add(acc, out) if first else (_add(acc, out[0]), out[1])

    grads_out = pspecs if first else (pspecs, act)
    if remat:  # keep only the stage input; recompute the forward in the backward
        fwd = jit(infer, in_specs=(None, act), out_specs=act)

        def bwd(p: Any, h: Any, dy: Any) -> Any:
            return cotangents(forward_vjp(p, h)[1], dy)

        def bwd_acc(p: Any, h: Any, dy: Any, acc: Any) -> Any:
            return add_grads(bwd(p, h, dy), acc)

        bwd_specs = (None, act, act)
    else:
        fwd = jit(forward_vjp, in_specs=(None, act), out_specs=(act, None))

        def bwd(vjp: Any, dy: Any) -> Any:
            return cotangents(vjp, dy)

        def bwd_acc(vjp: Any, dy: Any, acc: Any) -> Any:
            return add_grads(cotangents(vjp, dy), acc)

        bwd_specs = (None, act)

    scale = 1.0 / num_microbatches

    def loss_grads(p: Any, h: Any, y: Any) -> tuple:
        # The step's loss is the mean over microbatches of each one's loss.
        def f(p: Any, h: Any) -> jax.Array:
            return loss_fn(apply(p, h), y) * scale

        if first:
            return jax.value_and_grad(lambda p: f(p, h))(p)
        loss, (gp, gh) = jax.value_and_grad(f, argnums=(0, 1))(p, h)
        return loss, gp, gh

    def loss_grads_acc(p: Any, h: Any, y: Any, loss_acc: Any, acc: Any) -> tuple:
        loss, gp, *rest = loss_grads(p, h, y)
        return (loss_acc + loss, _add(acc, gp), *rest)

    def update(p: Any, o: Any, g: Any) -> tuple[Any, Any]:
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o

    last_specs = (pw.P(), pspecs) if first else (pw.P(), pspecs, act)
    return dataclasses.replace(
        nodes,
        fwd=fwd,
        bwd=jit(bwd, in_specs=bwd_specs, out_specs=grads_out),
        bwd_acc=jit(bwd_acc, in_specs=(*bwd_specs, None), out_specs=grads_out),
        last=jit(loss_grads, in_specs=(None, act, act), out_specs=last_specs) if last else None,
        last_acc=(
            jit(loss_grads_acc, in_specs=(None, act, act, None, None), out_specs=last_specs) if last else None
        ),
        update=jit(update, out_specs=(pspecs, ospecs)),
    )


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
        ``nnx.Param`` variables are trained, other variables held fixed), a
        ``(linen_module, variables)`` pair, or a ``(params, apply_fn)`` pair
        with ``apply_fn(params, x) -> y``.
      devices: one slice per stage, from ``pw.devices(...)``; stages may be
        on different islands.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean over the
        microbatch's examples (then the step's loss and gradients are those
        of the whole batch). ``None`` for inference only.
      optimizer: an optax ``GradientTransformation`` for every stage, or one
        per stage. ``None`` for inference only.
      num_microbatches: microbatches per step; must divide the batch size.
      schedule: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"``
        (one forward, one backward: fewer activations alive at once).
      data_axis: the mesh axis of each slice that splits the batch.
      param_specs: ``None`` (replicated), one ``pw.P`` for every parameter,
        a function ``(key_path, leaf) -> pw.P | None``, or a sequence with one
        of those per stage.
      remat: keep only each stage's input between forward and backward and
        recompute the forward in the backward (less memory, one more forward).

    Raises:
      PlacementError: the stage count differs from the slice count, a slice
        is unusable, or ``num_microbatches``/``schedule`` is invalid.
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
        optimizer: optax.GradientTransformation | Sequence[optax.GradientTransformation] | None = None,
        num_microbatches: int = 1,
        schedule: Schedule = "1f1b",
        data_axis: str | None = "data",
        param_specs: stages_lib.ParamSpecs | Sequence[stages_lib.ParamSpecs] = None,
        remat: bool = False,
    ):
        normalised = stages_lib.as_stages(stages)
        if not normalised:
            raise pw.errors.PlacementError("Pipeline needs at least one stage and one slice; got none.")
        count = len(normalised)
        self.slices = stages_lib.check_slices(devices, count, "Pipeline")
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
        self._nodes = []
        self._param_specs = []
        for index, (stage, slice_, tx) in enumerate(zip(normalised, self.slices, txs, strict=True)):
            specs = stages_lib.param_specs(stage.params, per_stage[index], slice_, index)
            self._param_specs.append(specs)
            self._nodes.append(
                _build_nodes(
                    stage,
                    slice_,
                    tx if self._trainable else None,
                    loss_fn if self._trainable else None,
                    first=index == 0,
                    last=index == count - 1,
                    num_microbatches=num_microbatches,
                    remat=remat,
                    data_axis=data_axis,
                    pspecs=specs,
                )
            )
        # Place parameters and optimizer states on their slices: futures from here on.
        self._params: list[Any] = []
        self._opt_states: list[Any] = []
        for stage, nodes in zip(normalised, self._nodes, strict=True):
            placed = nodes.init(stage.params)
            if self._trainable:
                placed, opt_state = placed
                self._opt_states.append(opt_state)
            self._params.append(placed)
        self._order = schedule_order(schedule, count, num_microbatches)
        self._checked: set[Any] = set()
        self._train = pw.program(self._train_step_fn, name="pipeline_train_step")
        self._grads = pw.program(self._grads_fn, name="pipeline_loss_and_grads")
        self._forward = pw.program(self._forward_fn, name="pipeline_forward")

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

    # -- the traced step functions ------------------------------------------------------------

    def _run_schedule(self, params: tuple, opt_states: tuple | None, xs: tuple, ys: tuple) -> tuple:
        count = self.num_stages
        final = {s: max(i for i, op in enumerate(self._order) if op[1] == s) for s in range(count)}
        outs: dict[tuple[int, int], Any] = {}
        saved: dict[tuple[int, int], tuple] = {}
        cots: dict[tuple[int, int], Any] = {}
        grads: list[Any] = [None] * count
        new_params, new_opt_states = list(params), list(opt_states or ())
        loss = None
        for i, (kind, s, m) in enumerate(self._order):
            nodes = self._nodes[s]
            if kind in ("F", "L"):
                h = xs[m] if s == 0 else outs.pop((s - 1, m))
            if kind == "F":
                out = nodes.fwd(params[s], h)
                if isinstance(out, tuple):  # (output, vjp residuals)
                    outs[(s, m)], vjp = out
                    saved[(s, m)] = (vjp,)
                else:  # remat: keep the input, recompute later
                    outs[(s, m)] = out
                    saved[(s, m)] = (params[s], h)
            elif kind == "L":
                if grads[s] is None:
                    res = nodes.last(params[s], h, ys[m])
                else:
                    res = nodes.last_acc(params[s], h, ys[m], loss, grads[s])
                loss, grads[s] = res[0], res[1]
                if s > 0:
                    cots[(s - 1, m)] = res[2]
            else:
                args = (*saved.pop((s, m)), cots.pop((s, m)))
                res = nodes.bwd(*args) if grads[s] is None else nodes.bwd_acc(*args, grads[s])
                if s == 0:
                    grads[s] = res
                else:
                    grads[s], cots[(s - 1, m)] = res
            if opt_states is not None and i == final[s]:
                # The stage's gradients are complete: update it now, on its slice.
                new_params[s], new_opt_states[s] = nodes.update(params[s], opt_states[s], grads[s])
        return loss, grads, tuple(new_params), tuple(new_opt_states)

    def _train_step_fn(self, params: tuple, opt_states: tuple, xs: tuple, ys: tuple) -> tuple:
        loss, _, new_params, new_opt_states = self._run_schedule(params, opt_states, xs, ys)
        return loss, new_params, new_opt_states

    def _grads_fn(self, params: tuple, xs: tuple, ys: tuple) -> tuple:
        loss, grads, _, _ = self._run_schedule(params, None, xs, ys)
        return loss, tuple(grads)

    def _forward_fn(self, params: tuple, xs: tuple) -> Any:
        count, micro = self.num_stages, len(xs)
        outs: dict[tuple[int, int], Any] = {}
        for t in range(micro + count - 1):  # wavefront: stage s works on microbatch t - s
            for s in reversed(range(count)):
                m = t - s
                if 0 <= m < micro:
                    h = xs[m] if s == 0 else outs.pop((s - 1, m))
                    outs[(s, m)] = self._nodes[s].infer(params[s], h)
        results = [outs[(count - 1, m)] for m in range(micro)]
        if micro == 1:
            return results[0]
        last = self.slices[-1]
        act = stages_lib.activation_spec(last, self.data_axis)
        concat = pw.jit(_concatenate, devices=last, out_specs=act)
        return concat(*results)

    # -- checks before anything runs ----------------------------------------------------------

    def _split(self, x: Any, what: str) -> tuple[np.ndarray, ...]:
        array = np.asarray(x)
        micro = self.num_microbatches
        if array.ndim == 0:
            raise pw.errors.PlacementError(
                f"{what} is a scalar; expected an array whose first dimension is the batch."
            )
        batch = array.shape[0]
        if batch % micro:
            raise pw.errors.PlacementError(
                f"{what} has a batch of {batch} examples, which num_microbatches={micro} does not "
                f"divide; use a batch size that is a multiple of {micro}, or a num_microbatches "
                f"that divides {batch}."
            )
        return stages_lib.split_over(
            array,
            micro,
            self.slices,
            self.data_axis,
            what=what,
            parts="microbatches",
            per="microbatches",
            place="stage",
        )

    def _check_chain(self, x: np.ndarray, y: np.ndarray | None) -> None:
        key = (x.shape, x.dtype, None if y is None else (y.shape, y.dtype))
        if key in self._checked:
            return
        h: Any = jax.ShapeDtypeStruct(x.shape, x.dtype)
        for index, (stage, params) in enumerate(zip(self.stages, self._params, strict=True)):
            try:
                out = jax.eval_shape(stage.apply, stages_lib.abstract(params), h)
            except Exception as exc:
                fed = (
                    f"a microbatch {stages_lib.describe(h)}"
                    if index == 0
                    else f"the output of stage {index - 1}, {stages_lib.describe(h)}"
                )
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise pw.errors.ProgramTraceError(
                    f"Pipeline stage {index} ({self.stages[index].description}) cannot take {fed}: "
                    f"{type(exc).__name__}: {detail[:300]}. Each stage's output must be what the next "
                    "stage takes (e.g. its in_features); fix the stage sizes or the input shape."
                ) from exc
            h = out
        if y is not None:
            try:
                loss = jax.eval_shape(self._loss_fn, h, jax.ShapeDtypeStruct(y.shape, y.dtype))
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
        self._checked.add(key)

    def _training_inputs(self, x: Any, y: Any, what: str) -> tuple[tuple, tuple]:
        if not self._trainable:
            raise pw.errors.ProgramTraceError(
                f"Pipeline.{what} needs loss_fn= and optimizer= (this pipeline was built for inference "
                "only); use Pipeline(..., loss_fn=..., optimizer=optax...)."
            )
        xs, ys = self._split(x, "x"), self._split(y, "y")
        if xs[0].shape[0] * len(xs) != ys[0].shape[0] * len(ys):
            raise pw.errors.PlacementError(
                f"x has a batch of {np.shape(x)[0]} but y of {np.shape(y)[0]}; they must match."
            )
        self._check_chain(xs[0], ys[0])
        return xs, ys

    # -- public calls -------------------------------------------------------------------------

    def train_step(self, x: Any, y: Any) -> pw.Future:
        """Runs one train step (ONE program call) and returns the mean loss as a future.

        Args:
          x: the batch of inputs (first dimension: the batch).
          y: the batch of targets.

        Returns:
          The batch's mean loss (before the update), a :class:`pw.Future` on the last
          stage's slice. The new parameters are in :attr:`params`.

        Raises:
          PlacementError: ``num_microbatches`` does not divide the batch, or a
            microbatch cannot be split over a stage's ``data_axis``.
          ProgramTraceError: a stage cannot take the previous stage's output,
            or the loss is not a float scalar.
        """
        xs, ys = self._training_inputs(x, y, "train_step")
        loss, params, opt_states = self._train(tuple(self._params), tuple(self._opt_states), xs, ys)
        self._params, self._opt_states = list(params), list(opt_states)
        return loss

    def loss_and_grads(self, x: Any, y: Any) -> tuple[pw.Future, list[Any]]:
        """The batch's mean loss and every stage's gradients, without an update (one program call)."""
        xs, ys = self._training_inputs(x, y, "loss_and_grads")
        loss, grads = self._grads(tuple(self._params), xs, ys)
        return loss, list(grads)

    def forward(self, x: Any) -> Any:
        """The model's output for a batch (inference; one program call), on the last stage."""
        xs = self._split(x, "x")
        self._check_chain(xs[0], None)
        return self._forward(tuple(self._params), xs)

    def graph(self, x: Any, y: Any) -> pw.Graph:
        """The dataflow graph of one train step for these inputs."""
        xs, ys = self._training_inputs(x, y, "graph")
        return self._train.graph(tuple(self._params), tuple(self._opt_states), xs, ys)

    def __repr__(self) -> str:
        return (
            f"Pipeline({self.num_stages} stages, {self.num_microbatches} microbatches, "
            f"schedule={self.schedule!r}, islands={[s.island for s in self.slices]})"
        )


def _concatenate(*parts: Any) -> Any:
    return jax.tree.map(lambda *arrays: jnp.concatenate(arrays), *parts)
