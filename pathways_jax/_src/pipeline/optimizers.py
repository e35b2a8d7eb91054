"""What the pipeline accepts as an optimizer: anything with Optax's ``init``/``update``.

The pipeline trains functional parameters, so it needs an optimizer in Optax's form:
``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``. Any
object with those two methods works (``optax.GradientTransformation`` or a class of the
user's own). A ``flax.nnx.Optimizer`` is accepted too: its Optax transformation
``optimizer.tx`` is used, with a fresh state made from the stage's parameters, and its
``wrt=`` filter chooses which of an NNX stage's parameters train (``trained_filters``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

import pathways_jax as pw


class OptaxLike(Protocol):
    """An optimizer with Optax's interface (``optax.GradientTransformation`` has it)."""

    def init(self, params: Any) -> Any: ...

    def update(self, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]: ...


_EXPECTED = (
    "an optimizer with Optax's interface, init(params) -> state and "
    "update(grads, state, params) -> (updates, state), such as optax.adam(1e-3), or a "
    "flax.nnx.Optimizer (its .tx is used)"
)


def _is_optax_like(obj: Any) -> bool:
    return callable(getattr(obj, "init", None)) and callable(getattr(obj, "update", None))


def as_optimizer(obj: Any, what: str) -> OptaxLike:
    """``obj`` as an Optax-like optimizer; ``what`` names it in the error."""
    if isinstance(obj, nnx.Optimizer):
        tx: Any = getattr(obj, "tx", None)
        if _is_optax_like(tx):
            return tx
        raise pw.errors.ProgramTraceError(
            f"{what} is an nnx.Optimizer whose .tx is {type(tx).__name__}, not an Optax "
            "transformation; pass the Optax transformation itself, e.g. optimizer=optax.adam(1e-3)."
        )
    if _is_optax_like(obj):
        return obj
    missing = [name for name in ("init", "update") if not callable(getattr(obj, name, None))]
    raise pw.errors.ProgramTraceError(
        f"{what} is {type(obj).__name__}: {obj!r:.80}, which has no callable "
        f"{' or '.join(repr(m) for m in missing)}; expected {_EXPECTED}. Wrap other optimizers in an "
        "object with those two methods."
    )


def check_optimizers(optimizer: Any, count: int, what: str) -> list[OptaxLike | None]:
    """One Optax-like optimizer (or ``None``) per stage, from one optimizer or a sequence of ``count``."""
    if optimizer is None:
        return [None] * count
    if _is_optax_like(optimizer) or isinstance(optimizer, nnx.Optimizer):
        return [as_optimizer(optimizer, f"{what}: optimizer")] * count
    if isinstance(optimizer, Sequence) and not isinstance(optimizer, str):
        if len(optimizer) != count:
            raise pw.errors.ProgramTraceError(
                f"{what}: optimizer is a sequence of {len(optimizer)}, but there are {count} stages; "
                f"give one optimizer for every stage, or {_EXPECTED}."
            )
        return [as_optimizer(tx, f"{what}: optimizer {i}") for i, tx in enumerate(optimizer)]
    return [as_optimizer(optimizer, f"{what}: optimizer")] * count


def trained_filters(optimizer: Any, count: int) -> list[Any]:
    """Per stage, the NNX Variables an NNX stage trains: its ``nnx.Param`` s, or those an ``nnx.Optimizer``'s ``wrt=`` selects.

    ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam).update(model, grads)`` updates
    only the Variables ``wrt`` selects; the others (a LoRA layer's base kernel, a
    frozen backbone) stay as they are. A stage trained with that optimizer trains
    the same ones: ``nnx.All(nnx.Param, wrt)``. Any other optimizer trains every
    ``nnx.Param``. ``optimizer`` is one for every stage or a sequence of ``count``
    (anything else is left to :func:`check_optimizers` to refuse).
    """

    def trained(obj: Any) -> Any:
        wrt = obj.wrt if isinstance(obj, nnx.Optimizer) else nnx.Param
        return nnx.Param if wrt is nnx.Param else nnx.All(nnx.Param, wrt)

    if (
        isinstance(optimizer, Sequence)
        and not isinstance(optimizer, str)
        and not _is_optax_like(optimizer)
        and len(optimizer) == count
    ):
        return [trained(obj) for obj in optimizer]
    return [trained(optimizer)] * count


def needs_value(tx: OptaxLike | None, params: Any) -> bool:
    """Whether ``tx.update`` needs the step's loss as ``value=`` (``optax.contrib.reduce_on_plateau``).

    Optax's transformations that take extra arguments (``GradientTransformationExtraArgs``,
    ``optax.MultiSteps``) get the loss as ``value`` under ``jax.jit`` (``tx.update(grads, state,
    params, value=loss)``); those that need it fail without it. Traced abstractly, once per stage.
    """
    if tx is None:
        return False

    def update(p: Any, **extra: Any) -> Any:
        return tx.update(p, tx.init(p), p, **extra)

    try:
        jax.eval_shape(update, params)
        return False
    except TypeError:
        try:
            jax.eval_shape(lambda p: update(p, value=jnp.zeros((), jnp.float32)), params)
        except Exception:
            return False
        return True
    except Exception:  # anything else shows in the step itself, as before
        return False
