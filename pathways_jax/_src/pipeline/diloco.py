"""``DiLoCo``: data parallelism across islands that talk only every ``sync_every`` steps.

For islands joined by a slow network (DCN between data centres): each island
trains its replica on its shard alone, with the inner optimizer, and the
islands meet every ``sync_every`` steps, as in DiLoCo (Douillard et al.,
2023, "DiLoCo: Distributed Low-Communication Training of Language Models").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import pathways_jax as pw
from pathways_jax._src.pipeline import stages as stages_lib
from pathways_jax._src.pipeline.data_parallel import DataParallel, LossFn
from pathways_jax._src.pipeline.optimizers import OptaxLike, as_optimizer
from pathways_jax._src.pipeline.rngs import Mode


def default_outer_optimizer() -> optax.GradientTransformation:
    """The paper's outer optimizer: SGD with Nesterov momentum 0.9, learning rate 0.7."""
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


class DiLoCo(DataParallel):
    """One model on K islands that exchange parameters every ``sync_every`` steps, not gradients every step.

    Semantics, per call of :meth:`train_step` (one ``@pw.program`` call):

    - Every island takes one step of the inner ``optimizer`` on its own shard
      of the batch (its ``1/K``), on its own replica: no traffic between islands.
    - Every ``sync_every``-th step, after that local step, the islands sync:
      each island's pseudo-gradient is ``global - local`` (the global
      parameters of the last sync minus its replica now); they cross to
      every island (``"dcn"``), every island averages them in the same order
      and applies the ``outer_optimizer`` to the global parameters, and every
      replica restarts from the new global parameters. The inner optimizer's
      state stays each island's own.
    - Between syncs the replicas differ; right after one they are
      bit-identical. ``params`` is the first replica's.
    - The loss returned is the mean of the islands' shard losses, each on its
      own replica.
    - The traffic between islands is one exchange of parameters per
      ``sync_every`` steps, where :class:`DataParallel` exchanges gradients
      every step. With ``sync_every=1``, an inner ``optax.sgd(lr)`` and an
      outer ``optax.sgd(1.0)`` it is :class:`DataParallel` with
      ``optax.sgd(lr)``, up to rounding.

    Args:
      model, devices, loss_fn, data_axis, param_specs: as :class:`DataParallel`.
      optimizer: the inner optimizer (each island's, every step).
      sync_every: steps between syncs (>= 1).
      outer_optimizer: applied to the averaged pseudo-gradients at a sync;
        the paper's SGD with Nesterov momentum (lr 0.7, momentum 0.9) by default.

    ``pw.elastic.Manager`` drives it as it drives :class:`DataParallel`: a lost
    island's replica goes, the survivors sync among themselves, and a
    replica that rejoins starts as a copy of the first one (its local
    parameters and its inner, global and outer state).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, pathways_jax as pw
      >>> from pathways_jax.pipeline import DiLoCo
      >>> a, b = pw.devices(mesh={"data": 1}), pw.devices(mesh={"data": 1})
      >>> model = DiLoCo((jnp.ones(2), lambda p, x: x * p), [a, b],
      ...                loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
      ...                optimizer=optax.sgd(0.5), sync_every=2, outer_optimizer=optax.sgd(1.0))
      >>> _ = model.train_step(np.ones((2, 2)), np.zeros((2, 2)))
      >>> _ = model.train_step(np.ones((2, 2)), np.zeros((2, 2)))  # a sync
      >>> [p.result().tolist() for p in model.params_per_island]
      [[0.25, 0.25], [0.25, 0.25]]
    """

    def __init__(
        self,
        model: Any,
        devices: Sequence[pw.VirtualSlice],
        *,
        loss_fn: LossFn,
        optimizer: OptaxLike | Any,
        sync_every: int,
        outer_optimizer: OptaxLike | Any = None,
        data_axis: str | None = "data",
        param_specs: stages_lib.ParamSpecs = None,
    ):
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise pw.errors.ProgramTraceError(f"DiLoCo: sync_every must be an int >= 1; got {sync_every!r}.")
        outer = default_outer_optimizer() if outer_optimizer is None else outer_optimizer
        self._outer: OptaxLike = as_optimizer(outer, "DiLoCo: outer_optimizer")
        self.sync_every = sync_every
        self._local_by_slice: dict[tuple[Mode, int], pw.JitFunction] = {}
        self._sync_by_slice: dict[int, pw.JitFunction] = {}
        super().__init__(
            model, devices, loss_fn=loss_fn, optimizer=optimizer, data_axis=data_axis, param_specs=param_specs
        )

    def _state_specs(self, params: Any, pspecs: Any) -> Any:
        return {
            "inner": stages_lib.opt_state_specs(self._tx, params, pspecs),
            "global": pspecs,
            "outer": stages_lib.opt_state_specs(self._outer, params, pspecs),
        }

    def _init_state(self, params: Any) -> Any:
        return {"inner": self._tx.init(params), "global": params, "outer": self._outer.init(params)}

    def _local_node(self, mode: Mode, slice_: pw.VirtualSlice) -> pw.JitFunction:
        node = self._local_by_slice.get((mode, slice_.id))
        if node is not None:
            return node
        stage, loss_fn, tx = self.stage, self._loss_fn, self._tx

        def local_step(p: Any, state: Any, x: Any, y: Any, *k: Any) -> tuple:
            rngs = mode.wrap(k[0]) if k else None
            loss, grads = jax.value_and_grad(
                lambda p: loss_fn(stage.run(p, x, rngs, mode.train, mode.train_kw), y)
            )(p)
            extra = {"value": loss} if self._needs_value else {}  # its own shard's loss
            updates, inner = tx.update(grads, state["inner"], p, **extra)
            return loss, optax.apply_updates(p, updates), {**state, "inner": inner}

        act = stages_lib.activation_spec(slice_, self.data_axis)
        kspec = (None,) if mode.keyed else ()
        node = self._local_by_slice[(mode, slice_.id)] = pw.jit(
            local_step,
            devices=slice_,
            in_specs=(None, None, act, act, *kspec),
            out_specs=(pw.P(), self._pspecs, self._ospecs),
        )
        return node

    def _sync_node(self, slice_: pw.VirtualSlice) -> pw.JitFunction:
        node = self._sync_by_slice.get(slice_.id)
        if node is None:
            node = self._sync_by_slice[slice_.id] = pw.jit(
                self._sync, devices=slice_, out_specs=(self._pspecs, self._ospecs)
            )
        return node

    def _sync(self, state: Any, *locals_: Any) -> tuple[Any, Any]:
        start = state["global"]
        total = jax.tree.map(jnp.subtract, start, locals_[0])
        for local in locals_[1:]:  # the same order on every island: identical results
            total = jax.tree.map(jnp.add, total, jax.tree.map(jnp.subtract, start, local))
        pseudo = jax.tree.map(lambda g: g / len(locals_), total)
        updates, outer = self._outer.update(pseudo, state["outer"], start)
        new = optax.apply_updates(start, updates)
        return new, {"inner": state["inner"], "global": new, "outer": outer}

    def _program(self, mode: Mode) -> Any:
        """The program of the next step: a sync step every ``sync_every``-th."""
        sync = (self._steps + 1) % self.sync_every == 0
        key = (mode, sync)
        if key not in self._programs:
            local_nodes = [self._local_node(mode, s) for s in self.slices]
            sync_nodes = [self._sync_node(s) for s in self.slices]

            def diloco_train_step(params: tuple, states: tuple, xs: tuple, ys: tuple, *keys: Any) -> tuple:
                results = [
                    node(p, st, x, y, *((keys[0][i],) if keys else ()))
                    for i, (node, p, st, x, y) in enumerate(
                        zip(local_nodes, params, states, xs, ys, strict=True)
                    )
                ]
                new = [(p, st) for _, p, st in results]
                if sync:
                    local = [p for p, _ in new]
                    new = [node(st, *local) for node, (_, st) in zip(sync_nodes, new, strict=True)]
                loss = self._mean(*(loss for loss, _, _ in results))
                return loss, tuple(p for p, _ in new), tuple(st for _, st in new)

            name = "diloco_sync_step" if sync else "diloco_local_step"
            self._programs[key] = pw.program(diloco_train_step, name=name)
        return self._programs[key]

    @property
    def state(self) -> dict[str, Any]:
        """All that training changes, to checkpoint: ``{"params", "opt_states", "step"}``.

        Between syncs the replicas differ, and their inner optimizer states always do: the
        lists hold every replica's parameters and state (inner, global, outer), in slice order,
        and ``step`` the count of steps taken (which steps sync). :meth:`load_state` takes a
        restored one on a model built the same way, with as many replicas.
        """
        return {"params": list(self._params), "opt_states": list(self._opt_states), "step": self._steps}

    def load_state(self, state: Any) -> None:
        """Continues from a saved :attr:`state`: every replica its own parameters and states.

        Raises:
          PlacementError: ``state`` is not the state of a DiLoCo built the same way (another
            replica count, an array missing or extra, or of another shape or dtype).
        """
        step = self._checked_step(state)
        own = {name: value for name, value in self.state.items() if name != "step"}
        given = {name: value for name, value in state.items() if name != "step"}
        checked = stages_lib.checked_state(given, own, "DiLoCo.load_state: state")
        placed = [
            self._place(slice_)(p, o)
            for slice_, p, o in zip(self.slices, checked["params"], checked["opt_states"], strict=True)
        ]
        self._load(step, [p for p, _ in placed], [o for _, o in placed])

    def __repr__(self) -> str:
        return (
            f"DiLoCo({len(self.slices)} slices, islands={[s.island for s in self.slices]}, "
            f"sync_every={self.sync_every})"
        )


__all__ = ["DiLoCo", "default_outer_optimizer"]
