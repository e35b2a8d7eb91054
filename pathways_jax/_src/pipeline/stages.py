"""Model stages in one internal form, and the partition specs of their values."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import linen, nnx

import pathways_jax as pw

Apply = Callable[[Any, Any], Any]
# A stage's parameter specs: None (replicated), one pw.P for every leaf, or
# a function (key path, leaf) -> pw.P | None.
ParamSpecs = pw.P | Callable[[Any, Any], pw.P | None] | None


@dataclasses.dataclass(frozen=True, slots=True)
class Stage:
    """One stage of a model: trainable ``params`` and ``apply(params, x) -> y``.

    Non-trainable state (an NNX module's non-``Param`` variables, a Linen
    module's other collections) is closed over by ``apply`` and held fixed.
    """

    params: Any
    apply: Apply
    kind: str
    description: str


def as_stage(model: Any, index: int = 0) -> Stage:
    """Normalises a stage into :class:`Stage`: trainable ``params`` and ``apply(params, x)``.

    Args:
      model: a Flax NNX module (its ``nnx.Param`` variables are the params),
        a ``(linen_module, variables)`` pair (``variables["params"]``), or a
        ``(params, apply_fn)`` pair.
      index: the stage's position, named in errors.

    Returns:
      A :class:`Stage`.

    Raises:
      ProgramTraceError: ``model`` is none of the above.

    Example:
      >>> from flax import nnx
      >>> from pathways_jax.pipeline import as_stage
      >>> stage = as_stage(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
      >>> stage.kind, stage.params["kernel"].shape
      ('nnx', (2, 3))
    """
    if isinstance(model, Stage):
        return model
    if isinstance(model, nnx.Module):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def apply_nnx(p: Any, x: Any) -> Any:
            return nnx.merge(graphdef, p, rest)(x)

        return Stage(params, apply_nnx, "nnx", f"nnx {type(model).__name__}")
    if isinstance(model, tuple | list) and len(model) == 2:
        first, second = model
        if isinstance(first, linen.Module):
            variables = dict(second) if second is not None else {}
            if "params" not in variables:
                raise pw.errors.ProgramTraceError(
                    f"stage {index} is a Linen module {type(first).__name__} with variables "
                    f"holding {sorted(variables)}, but no 'params' collection; pass "
                    "(module, module.init(rng, x)) so the stage has parameters to train."
                )
            params = variables.pop("params")

            def apply_linen(p: Any, x: Any) -> Any:
                return first.apply({"params": p, **variables}, x)

            return Stage(params, apply_linen, "linen", f"linen {type(first).__name__}")
        if callable(second) and not callable(first):
            return Stage(first, second, "function", f"apply_fn {getattr(second, '__name__', second)!r}")
    raise pw.errors.ProgramTraceError(
        f"stage {index} is {type(model).__name__}: {model!r:.80}; expected a Flax NNX module, a "
        "(linen_module, variables) pair, or a (params, apply_fn) pair with "
        "apply_fn(params, x) -> y."
    )


def as_stages(models: Sequence[Any]) -> list[Stage]:
    if isinstance(models, nnx.Module | linen.Module) or not isinstance(models, Sequence):
        raise pw.errors.ProgramTraceError(
            f"stages must be a sequence (list or tuple) of stages, got {type(models).__name__}; "
            "wrap a single model in a list: Pipeline([model], [slice], ...)."
        )
    return [as_stage(model, i) for i, model in enumerate(models)]


def check_slices(slices: Sequence[Any], count: int, what: str) -> list[pw.VirtualSlice]:
    slices = list(slices) if isinstance(slices, Sequence) else [slices]
    if len(slices) != count:
        raise pw.errors.PlacementError(
            f"{what} has {count} stages but {len(slices)} device slices were given; "
            "give one pw.devices(...) slice per stage (stages may share a slice)."
        )
    for i, slice_ in enumerate(slices):
        if not isinstance(slice_, pw.VirtualSlice):
            raise pw.errors.PlacementError(
                f"{what}: slice {i} is {slice_!r}; expected a slice from pw.devices(...)."
            )
        slice_.check_usable()
    return slices


def check_optimizers(optimizer: Any, count: int, what: str) -> list[optax.GradientTransformation | None]:
    if optimizer is None or isinstance(optimizer, optax.GradientTransformation):
        return [optimizer] * count
    if isinstance(optimizer, Sequence) and len(optimizer) == count:
        for i, tx in enumerate(optimizer):
            if not isinstance(tx, optax.GradientTransformation):
                raise pw.errors.ProgramTraceError(
                    f"{what}: optimizer {i} is {type(tx).__name__}; expected an optax "
                    "GradientTransformation such as optax.adam(1e-3)."
                )
        return list(optimizer)
    raise pw.errors.ProgramTraceError(
        f"{what}: optimizer must be an optax GradientTransformation or a sequence of {count} "
        f"(one per stage), got {type(optimizer).__name__}."
    )


def param_specs(params: Any, specs: ParamSpecs, slice_: pw.VirtualSlice, index: int) -> Any:
    """A pytree of ``pw.P`` matching ``params``."""
    if specs is None:
        return jax.tree.map(lambda _: pw.P(), params)
    if isinstance(specs, pw.P):
        return jax.tree.map(lambda _: specs, params)
    if callable(specs):
        return jax.tree_util.tree_map_with_path(lambda path, leaf: specs(path, leaf) or pw.P(), params)
    raise pw.errors.PlacementError(
        f"param_specs of stage {index} on {slice_!r} is {specs!r}; expected None, one pw.P(...) "
        "for every parameter, or a function (key_path, leaf) -> pw.P | None."
    )


def opt_state_specs(tx: optax.GradientTransformation, params: Any, specs: Any) -> Any:
    """Specs of ``tx.init(params)``: parameter-shaped subtrees follow ``specs``, the rest replicated."""
    abstract = jax.eval_shape(tx.init, params)
    structure = jax.tree_util.tree_structure(params)
    shapes = [leaf.shape for leaf in jax.tree.leaves(params)]

    def like_params(node: Any) -> bool:
        try:
            if jax.tree_util.tree_structure(node) != structure:
                return False
        except Exception:
            return False
        return [leaf.shape for leaf in jax.tree.leaves(node)] == shapes

    return jax.tree.map(lambda node: specs if like_params(node) else pw.P(), abstract, is_leaf=like_params)


def activation_spec(slice_: pw.VirtualSlice, data_axis: str | None) -> pw.P:
    """Batch-leading values are split over ``data_axis`` when the slice has it."""
    if data_axis is not None and data_axis in slice_.axis_names:
        return pw.P(data_axis)
    return pw.P()


def data_parts(slice_: pw.VirtualSlice, data_axis: str | None) -> int:
    if data_axis is not None and data_axis in slice_.axis_names:
        return slice_.shape[slice_.axis_names.index(data_axis)]
    return 1


def split_over(
    array: np.ndarray,
    count: int,
    slices: Any,
    data_axis: str | None,
    *,
    what: str,
    parts: str,
    per: str,
    place: str,
) -> tuple[np.ndarray, ...]:
    """``array`` cut into ``count`` equal pieces along the batch, each divisible over every slice.

    The caller has checked that ``count`` divides the batch. In the error, ``parts`` names the
    pieces ("shards"), ``per`` what the batch is divided by ("slices") and ``place`` a slice.
    """
    batch = array.shape[0]
    size = batch // count
    for index, slice_ in enumerate(slices):
        axis_size = data_parts(slice_, data_axis)
        if size % axis_size:
            raise pw.errors.PlacementError(
                f"{parts} of {size} examples ({what}: batch {batch} / {count} {per}) "
                f"cannot be split over axis {data_axis!r} of size {axis_size} on {place} {index} "
                f"({slice_!r}); use a batch size that is a multiple of {count * axis_size}."
            )
    return tuple(np.split(array, count))


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs of a pytree of arrays or futures."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def describe(tree: Any) -> str:
    leaves = jax.tree.leaves(tree)
    parts = [f"{jax.numpy.dtype(leaf.dtype).name}{list(leaf.shape)}" for leaf in leaves]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def sequential(models: Sequence[Any]) -> tuple[tuple[Any, ...], Apply]:
    """Composes stages into one model: ``(params, apply_fn)``, params a tuple per stage.

    The result is the unpipelined model: train it with plain ``jax.jit``, or
    pass it to :class:`DataParallel`.

    Example:
      >>> import jax.numpy as jnp
      >>> from pathways_jax.pipeline import sequential
      >>> params, apply = sequential([(2.0, lambda p, x: x * p), (1.0, lambda p, x: x + p)])
      >>> apply(params, jnp.ones(2)).tolist()
      [3.0, 3.0]
    """
    stages = as_stages(models)

    def apply(params: Sequence[Any], x: Any) -> Any:
        for stage, p in zip(stages, params, strict=True):
            x = stage.apply(p, x)
        return x

    return tuple(stage.params for stage in stages), apply
