"""Flax NNX takes futures as it takes arrays: as data of a module, and in Variables that are written.

A future assigned to a module's attribute (``self.table = table``, a table a
program computed) was static to NNX, which recognises ``jax.Array`` s as data
by type: ``nnx.split`` left it out of the state and ``nnx.jit`` held it in the
graph definition. Futures are now registered as NNX data
(``nnx.register_data_type``), as arrays are.

After a program that updates NNX objects in place, a Variable holds a
``pw.Future`` where an array cannot be had at dispatch (values on Ray hosts
or a controller service, runs under a ``memory_budget``). Flax writes an
indexed value into a ``jax.Array`` with ``.at[index].set`` (or replaces it),
but into anything else in place, which a future refuses as an array does:
eager code between steps (``metrics.reset()``, ``variable[...] = v``,
``variable[...] += 1``) raised a ``TypeError``. Such a write now first takes
the array the future stands for (waiting for it, as every eager use of a
future does), then writes as into that array.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from pathways_jax._src.runtime.futures import Future

_NO_INDEX = object()


def install() -> None:
    """Registers futures as NNX data and wraps ``nnx.Variable.set_value`` (once), if Flax NNX is imported."""
    pytreelib = sys.modules.get("flax.nnx.pytreelib")
    register = getattr(pytreelib, "register_data_type", None)
    if register is not None and Future not in getattr(pytreelib, "DATA_REGISTRY", ()):
        register(Future)
    variablelib = sys.modules.get("flax.nnx.variablelib")
    variable = getattr(variablelib, "Variable", None)
    set_value = getattr(variable, "set_value", None)
    if set_value is None or getattr(set_value, "_takes_futures", False):
        return

    @functools.wraps(set_value)
    def set_value_of_future(self: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("index", _NO_INDEX) is not _NO_INDEX:  # a write into the value held
            try:
                held = object.__getattribute__(self, "_raw_value")  # a slot of Flax's Variable
            except AttributeError:  # pragma: no cover - a Variable not yet made
                held = None
            if type(held) is Future:
                self._raw_value = held.result()
        return set_value(self, value, *args, **kwargs)

    set_value_of_future._takes_futures = True  # type: ignore[attr-defined]
    variable.set_value = set_value_of_future  # type: ignore[union-attr]
