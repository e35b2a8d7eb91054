"""Per-thread context: the stack of ``with slice:`` blocks and the active program trace."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathways_jax._src.runtime.slices import VirtualSlice


class _State(threading.local):
    def __init__(self) -> None:
        self.slices: list[VirtualSlice] = []
        # The trace state of the @pw.program being traced on this thread, if any.
        self.trace: Any = None


state = _State()

# Set by pathways_jax's exit hook: an exit hook that runs after it (registered
# before pathways_jax was imported) and calls a program gets it run as jax.jit, in
# the caller, instead of starting a cluster nothing would stop.
exiting = False


def current_slice() -> VirtualSlice | None:
    """The innermost slice entered with ``with slice:`` on this thread, if any."""
    return state.slices[-1] if state.slices else None
