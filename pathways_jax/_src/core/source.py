"""Finding the user's line: in traced equations and in Python tracebacks."""

from __future__ import annotations

import inspect
import os
import sys
import traceback
import types
from typing import Any

import jax

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))

# JAX's private source_info_util, None where this JAX has none.
source_info_util: types.ModuleType | None
try:  # Keep JAX from reporting frames inside pathways_jax as the user's line.
    from jax._src import source_info_util as _source_info_util

    _source_info_util.register_exclusion(_PACKAGE_DIR)
    source_info_util = _source_info_util
except (ImportError, AttributeError):  # pragma: no cover - older or newer JAX
    source_info_util = None


def _fmt(file_name: str, line: int, function: str) -> str:
    return f"{os.path.basename(file_name)}:{line} ({function})"


# Libraries whose frames are not the user's line, once imported (their layers and
# optimizers run inside the user's step: the label is the user's line that called them).
_LIBRARIES = ("flax", "optax", "chex", "orbax")


def _library_dirs() -> tuple[str, ...]:
    """Directories of the libraries of ``_LIBRARIES`` that are imported."""
    dirs = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        file_name = getattr(module, "__file__", None)
        if file_name:
            dirs.append(os.path.dirname(os.path.abspath(file_name)) + os.sep)
        else:  # a namespace package (orbax): its folders
            dirs.extend(os.path.abspath(path) + os.sep for path in getattr(module, "__path__", ()))
    return tuple(dirs)


def _user_frame(traceback: Any) -> Any:
    # JAX's user_frame skips JAX and pathways_jax; Flax's transforms (nnx.jit,
    # nnx.value_and_grad) and layers, and Optax's updates, are skipped here too, so
    # that the label is the user's line that called them. Frames only in them keep
    # their line.
    if source_info_util is None:
        return None
    frames = source_info_util.user_frames(traceback)
    first = next(frames, None)
    skip = _library_dirs()
    if first is None or not skip or not first.file_name.startswith(skip):
        return first
    return next((f for f in frames if not f.file_name.startswith(skip)), first)


def of_equation(eqn: Any, default: str = "<unknown>") -> str:
    """'file.py:12 (fn)' of the user code that made a jaxpr equation, else ``default``."""
    if source_info_util is None:
        return default
    try:
        frame = _user_frame(eqn.source_info.traceback)
    except Exception:  # best effort: never fail a trace over a location
        return default
    if frame is None:
        return default
    return _fmt(frame.file_name, frame.start_line, frame.function_name)


def of_function(fun: Any) -> str:
    """'file.py:12 (fn)' where a function is defined."""
    try:
        target = inspect.unwrap(fun)
        code = target.__code__
        return _fmt(code.co_filename, code.co_firstlineno, target.__name__)
    except (AttributeError, TypeError):
        return f"<{getattr(fun, '__name__', type(fun).__name__)}>"


def _is_generated(file_name: str) -> bool:
    """A file name Python gives code it generates and runs (``exec``: ``"<string>"``), or a dataclass's."""
    return file_name in ("<string>",) or file_name.startswith("<dataclass")


def _is_user_file(file_name: str) -> bool:
    path = os.path.abspath(file_name)
    return not (path.startswith((_PACKAGE_DIR, _JAX_DIR, *_library_dirs())))


def of_exception(exc: BaseException, fun: Any = None) -> str | None:
    """Where an exception came from in user code.

    Names the line inside ``fun`` (the traced program) that made the failing
    call and, when the failure is deeper, the innermost user frame too.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    users = [f for f in reversed(frames) if _is_user_file(f.filename)]
    # Code Python generates (a dataclass's __init__ or __setattr__, a Flax Linen module's: file
    # "<string>") is no line of the user's: the innermost user line that called it is named.
    innermost = next((f for f in users if not _is_generated(f.filename)), users[0] if users else None)
    code = getattr(inspect.unwrap(fun), "__code__", None) if fun is not None else None
    in_program = None
    if code is not None:
        in_program = next(
            (
                f
                for f in reversed(frames)
                if os.path.abspath(f.filename) == os.path.abspath(code.co_filename) and f.name == code.co_name
            ),
            None,
        )
    parts = []
    if in_program is not None:
        parts.append(_fmt(in_program.filename, in_program.lineno or 0, in_program.name))
    if innermost is not None and innermost is not in_program:
        at = _fmt(innermost.filename, innermost.lineno or 0, innermost.name)
        parts.append(f"inside {at}" if parts else at)  # no line of the program's own: the line itself
    return ", ".join(parts) or None


def of_caller() -> str:
    """The first frame outside pathways_jax and JAX on the current stack."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if _is_user_file(frame.filename):
            return _fmt(frame.filename, frame.lineno or 0, frame.name)
    return "<unknown>"
