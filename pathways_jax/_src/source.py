"""Finding the user's line: in traced equations and in Python tracebacks."""

from __future__ import annotations

import inspect
import os
import traceback
from typing import Any

import jax

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))

try:  # Keep JAX from reporting frames inside pathways_jax as the user's line.
    from jax._src import source_info_util

    source_info_util.register_exclusion(_PACKAGE_DIR)
except (ImportError, AttributeError):  # pragma: no cover - older or newer JAX
    source_info_util = None


def _fmt(file_name: str, line: int, function: str) -> str:
    return f"{os.path.basename(file_name)}:{line} ({function})"


def of_equation(eqn: Any) -> str:
    """'file.py:12 (fn)' of the user code that made a jaxpr equation."""
    if source_info_util is None:
        return "<unknown>"
    try:
        frame = source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:
        return "<unknown>"
    if frame is None:
        return "<unknown>"
    return _fmt(frame.file_name, frame.start_line, frame.function_name)


def of_function(fun: Any) -> str:
    """'file.py:12 (fn)' where a function is defined."""
    try:
        target = inspect.unwrap(fun)
        code = target.__code__
        return _fmt(code.co_filename, code.co_firstlineno, target.__name__)
    except (AttributeError, TypeError):
        return f"<{getattr(fun, '__name__', type(fun).__name__)}>"


def _is_user_file(file_name: str) -> bool:
    path = os.path.abspath(file_name)
    return not (path.startswith(_PACKAGE_DIR) or path.startswith(_JAX_DIR))


def of_exception(exc: BaseException) -> str | None:
    """The innermost user frame of an exception's traceback, if any."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if _is_user_file(frame.filename):
            return _fmt(frame.filename, frame.lineno or 0, frame.name)
    return None


def of_caller() -> str:
    """The first frame outside pathways_jax and JAX on the current stack."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if _is_user_file(frame.filename):
            return _fmt(frame.filename, frame.lineno or 0, frame.name)
    return "<unknown>"
