"""Pickling ``pw.program`` and ``pw.jit`` functions as ``jax.jit`` functions pickle.

Ray, Ray Tune and joblib ship a function with cloudpickle, which pickles by
value the jitted functions it calls: a ``jax.jit`` function pickles as its
function and options, and is made again where it is unpickled. A program or
``pw.jit`` function does the same (its caches, plans and lock are this
process's and stay here); one defined at a module's top level pickles as a
reference to its name, as the function it replaces would. One placed on a
slice cannot go: the slice is this process's cluster's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from pathways_jax._src.core import errors


def reduced(
    obj: Any, what: str, slice_: Any, remake: Callable[..., Any], made_with: tuple[Any, ...]
) -> str | tuple[Any, ...]:
    """``obj.__reduce__()``: its name if it is reachable by it, else ``(remake, made_with)``.

    Raises:
      PlacementError: (also a ``TypeError``, as pickle's own refusals are) for
        ``obj`` placed on ``slice_``.
    """
    if slice_ is not None:
        raise errors.also(errors.PlacementError, TypeError)(
            f"{what} is placed on slice {slice_!r} of this process's cluster and cannot be pickled "
            "(a slice's devices are this process's). Pickle the function itself and make it where "
            "it is unpickled, with a slice from pw.devices(...) there, or leave devices= out to "
            "run it where jax.jit would."
        )
    name = _reachable_name(obj)
    return name if name is not None else (remake, made_with)


def _reachable_name(obj: Any) -> str | None:
    """``obj``'s qualified name where its module's attribute of that name is ``obj`` itself.

    None in ``__main__``, which another process does not share (cloudpickle
    pickles its functions by value for that reason).
    """
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return None
    if module_name == "__main__" or "<" in qualname:
        return None
    target: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return qualname if target is obj else None


def remade(kind: type, fun: Callable[..., Any], options: dict[str, Any]) -> Any:
    """``kind(fun, **options)``: an unpickled program or ``pw.jit`` function, made anew."""
    return kind(fun, **options)


__all__ = ["reduced", "remade"]
