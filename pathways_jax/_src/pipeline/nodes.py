"""The ``pw.jit`` nodes of a pipeline stage: placement and update, and the compute of one mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import pathways_jax as pw
from pathways_jax._src.pipeline import stages as stages_lib
from pathways_jax._src.pipeline.optimizers import OptaxLike, needs_value
from pathways_jax._src.pipeline.rngs import Mode
from pathways_jax._src.pipeline.stages import Stage

LossFn = Callable[[Any, Any], jax.Array]


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


# What flows back between stages: the cotangents of the floating-point leaves of a stage's
# output, as a list in leaf order. Integer leaves (token ids, positions, masks a stage passes
# on) have no cotangent and are not differentiated.
def _is_float(leaf: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact))


def _floats(tree: Any) -> list[Any]:
    return [leaf for leaf in jax.tree.leaves(tree) if _is_float(leaf)]


def _with_floats(tree: Any, floats: Sequence[Any]) -> Any:
    """``tree`` with its floating-point leaves replaced, in order, by ``floats``."""
    leaves, treedef = jax.tree.flatten(tree)
    replacements = iter(floats)
    return jax.tree.unflatten(treedef, [next(replacements) if _is_float(leaf) else leaf for leaf in leaves])


# How a stage's output is laid out: its tree structure, and for each leaf whether it leads with
# the microbatch's examples (then it is split over the slice's data axis; a scalar such as an
# auxiliary loss, or a table of another length, is replicated) and whether it is
# floating-point (then it gets a cotangent). Hashable: nodes are built once per layout.
@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    treedef: Any
    batched: tuple[bool, ...]
    floating: tuple[bool, ...]

    @classmethod
    def of(cls, tree: Any, examples: int) -> Layout:
        """The layout of an abstract stage output for microbatches of ``examples`` examples."""
        leaves, treedef = jax.tree.flatten(tree)
        return cls(
            treedef,
            tuple(len(leaf.shape) >= 1 and leaf.shape[0] == examples for leaf in leaves),
            tuple(_is_float(leaf) for leaf in leaves),
        )

    def specs(self, act: pw.P) -> Any:
        """The value's specs: ``act`` for the batch-leading leaves, replicated for the others."""
        return jax.tree.unflatten(self.treedef, [act if batched else pw.P() for batched in self.batched])

    def cotangent_specs(self, act: pw.P) -> list[pw.P]:
        """The specs of the cotangents that flow back: those of its floating-point leaves, in order."""
        return [
            act if batched else pw.P()
            for batched, floating in zip(self.batched, self.floating, strict=True)
            if floating
        ]


@dataclasses.dataclass(frozen=True, slots=True)
class StateNodes:
    """A stage's parameter placement and Optax update, on the stage's slice."""

    init: pw.JitFunction
    # (params, opt_state) -> the same values placed on the slice as init places them (a restore).
    place: pw.JitFunction
    update: pw.JitFunction | None = None
    # With max_grad_norm: the squared norm of the stage's gradients, and the update that
    # first clips them by the model's global norm (from every stage's squared norm).
    squared_norm: pw.JitFunction | None = None
    clipped_update: pw.JitFunction | None = None
    # The optimizer takes the step's loss as value= (see optimizers.needs_value): update and
    # clipped_update take it right after the gradients.
    needs_value: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Nodes:
    """The ``pw.jit`` functions that run one stage in one :class:`Mode`, on the stage's slice.

    In a keyed mode every function that runs the stage takes the microbatch's raw key
    data (a dict by stream) as its LAST argument; otherwise it takes none.
    """

    infer: pw.JitFunction
    fwd: pw.JitFunction | None = None
    bwd: pw.JitFunction | None = None
    bwd_acc: pw.JitFunction | None = None
    last: pw.JitFunction | None = None
    last_acc: pw.JitFunction | None = None


def build_state_nodes(
    stage: Stage,
    slice_: pw.VirtualSlice,
    tx: OptaxLike | None,
    pspecs: Any,
    max_grad_norm: float | None = None,
) -> StateNodes:
    if tx is None:
        keep = pw.jit(lambda p: p, devices=slice_, out_specs=pspecs)
        return StateNodes(init=keep, place=keep)
    ospecs = stages_lib.opt_state_specs(tx, stage.params, pspecs)
    takes_value = needs_value(tx, stage.params)

    def update(p: Any, o: Any, g: Any, *value: jax.Array) -> tuple[Any, Any]:
        if not jax.tree.leaves(p):
            # A stage without parameters (nnx.relu): nothing to update, as under jax.jit, where
            # it has no part in the model's params. Optax transformations that read the params
            # (optax.adamw's weight decay, optax.lion, optax.adafactor) refuse params=None.
            return p, o
        updates, o = tx.update(g, o, p, **({"value": value[0]} if value else {}))
        return optax.apply_updates(p, updates), o

    def squared_norm(g: Any) -> jax.Array:
        return optax.tree.norm(g, squared=True)

    def clipped_update(p: Any, o: Any, g: Any, *rest: jax.Array) -> tuple[Any, Any]:
        # optax.clip_by_global_norm's formula, with the norm of every stage's gradients.
        assert max_grad_norm is not None
        value, squared = (rest[:1], rest[1:]) if takes_value else ((), rest)
        total = squared[0]
        for part in squared[1:]:  # the same order on every stage
            total = total + part
        norm = jnp.sqrt(total)
        keep = norm < max_grad_norm
        g = jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_grad_norm), g)
        return update(p, o, g, *value)

    clipping = max_grad_norm is not None
    return StateNodes(
        init=pw.jit(lambda p: (p, tx.init(p)), devices=slice_, out_specs=(pspecs, ospecs)),
        place=pw.jit(lambda p, o: (p, o), devices=slice_, out_specs=(pspecs, ospecs)),
        update=pw.jit(update, devices=slice_, out_specs=(pspecs, ospecs)),
        squared_norm=pw.jit(squared_norm, devices=slice_, out_specs=pw.P()) if clipping else None,
        clipped_update=pw.jit(clipped_update, devices=slice_, out_specs=(pspecs, ospecs))
        if clipping
        else None,
        needs_value=takes_value,
    )


def build_nodes(
    stage: Stage,
    slice_: pw.VirtualSlice,
    mode: Mode,
    loss_fn: LossFn | None,
    *,
    first: bool,
    last: bool,
    num_microbatches: int,
    remat: bool,
    data_axis: str | None,
    pspecs: Any,
    in_layout: Layout | None,
    out_layout: Layout,
) -> Nodes:
    """The stage's nodes; ``in_layout`` is the previous stage's output's (``None``: the first stage)."""
    act = stages_lib.activation_spec(slice_, data_axis)
    # The microbatch's leaves all lead with its examples; stage outputs need not (see Layout).
    in_act = act if in_layout is None else in_layout.specs(act)
    out_act = out_layout.specs(act)
    in_cot = None if in_layout is None else in_layout.cotangent_specs(act)
    out_cot = out_layout.cotangent_specs(act)
    kspec: tuple = (None,) if mode.keyed else ()

    def apply(p: Any, h: Any, k: tuple) -> Any:
        # k is () or (raw key data by stream,): the node's optional last argument.
        return stage.run(p, h, mode.wrap(k[0]) if k else None, mode.train, mode.train_kw)

    def jit(fun: Callable[..., Any], **kwargs: Any) -> pw.JitFunction:
        return pw.jit(fun, devices=slice_, **kwargs)

    def infer(p: Any, h: Any, *k: Any) -> Any:
        return apply(p, h, k)

    nodes = Nodes(infer=jit(infer, in_specs=(None, in_act, *kspec), out_specs=out_act))
    if loss_fn is None:
        return nodes

    def forward_vjp(p: Any, h: Any, *k: Any) -> tuple[Any, Any]:
        # The vjp function is a pytree whose leaves are the residual arrays:
        # they become node outputs and stay on the slice until the backward.
        # Only floating-point leaves are differentiated (see _floats).
        structure: list[Any] = []

        def f(p: Any, h_floats: list[Any]) -> tuple[list[Any], list[Any]]:
            leaves, treedef = jax.tree.flatten(apply(p, _with_floats(h, h_floats), k))
            mask = [_is_float(leaf) for leaf in leaves]
            structure.append((treedef, mask))
            floats = [leaf for leaf, m in zip(leaves, mask, strict=True) if m]
            return floats, [leaf for leaf, m in zip(leaves, mask, strict=True) if not m]

        if first:  # the model input needs no cotangent (it may be integer tokens)
            out_floats, vjp, out_rest = jax.vjp(lambda p: f(p, _floats(h)), p, has_aux=True)
        else:
            out_floats, vjp, out_rest = jax.vjp(f, p, _floats(h), has_aux=True)
        treedef, mask = structure[-1]
        floats, rest = iter(out_floats), iter(out_rest)
        return treedef.unflatten([next(floats) if m else next(rest) for m in mask]), vjp

    def cotangents(vjp: Any, dy: Any) -> Any:
        cts = vjp(dy)
        return cts[0] if first else cts

    def add_grads(out: Any, acc: Any) -> Any:
        return _add(acc, out) if first else (_add(acc, out[0]), out[1])

    # Each variant's backward functions are made by its own factory: their
    # signatures differ, and they keep the names "bwd" and "bwd_acc" (node names).
    def remat_backward() -> tuple[Callable[..., Any], Callable[..., Any]]:
        def bwd(p: Any, h: Any, dy: Any, *k: Any) -> Any:
            return cotangents(forward_vjp(p, h, *k)[1], dy)

        def bwd_acc(p: Any, h: Any, dy: Any, acc: Any, *k: Any) -> Any:
            return add_grads(bwd(p, h, dy, *k), acc)

        return bwd, bwd_acc

    def vjp_backward() -> tuple[Callable[..., Any], Callable[..., Any]]:
        def bwd(vjp: Any, dy: Any) -> Any:
            return cotangents(vjp, dy)

        def bwd_acc(vjp: Any, dy: Any, acc: Any) -> Any:
            return add_grads(cotangents(vjp, dy), acc)

        return bwd, bwd_acc

    grads_out = pspecs if first else (pspecs, in_cot)
    if remat:  # keep only the stage input (and keys); recompute the forward in the backward
        fwd = jit(infer, in_specs=(None, in_act, *kspec), out_specs=out_act)
        bwd, bwd_acc = remat_backward()
        bwd_specs: tuple = (None, in_act, out_cot)
    else:
        fwd = jit(forward_vjp, in_specs=(None, in_act, *kspec), out_specs=(out_act, None))
        bwd, bwd_acc = vjp_backward()
        bwd_specs = (None, out_cot)
    kbwd = kspec if remat else ()

    scale = 1.0 / num_microbatches

    def loss_grads(p: Any, h: Any, y: Any, *k: Any) -> tuple:
        # The step's loss is the mean over microbatches of each one's loss.
        def f(p: Any, h_floats: list[Any]) -> jax.Array:
            return loss_fn(apply(p, _with_floats(h, h_floats), k), y) * scale

        if first:
            return jax.value_and_grad(lambda p: f(p, _floats(h)))(p)
        loss, (gp, gh) = jax.value_and_grad(f, argnums=(0, 1))(p, _floats(h))
        return loss, gp, gh

    def loss_grads_acc(p: Any, h: Any, y: Any, loss_acc: Any, acc: Any, *k: Any) -> tuple:
        loss, gp, *rest = loss_grads(p, h, y, *k)
        return (loss_acc + loss, _add(acc, gp), *rest)

    last_specs = (pw.P(), pspecs) if first else (pw.P(), pspecs, in_cot)
    return dataclasses.replace(
        nodes,
        fwd=fwd,
        bwd=jit(bwd, in_specs=(*bwd_specs, *kbwd), out_specs=grads_out),
        bwd_acc=jit(bwd_acc, in_specs=(*bwd_specs, None, *kbwd), out_specs=grads_out),
        last=jit(loss_grads, in_specs=(None, in_act, act, *kspec), out_specs=last_specs) if last else None,
        last_acc=(
            jit(loss_grads_acc, in_specs=(None, in_act, act, None, None, *kspec), out_specs=last_specs)
            if last
            else None
        ),
    )
