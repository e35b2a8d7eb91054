"""The error hierarchy of pathways_jax.

Every error a user can meet derives from :class:`PathwaysError` and from the
fitting built-in exception, so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import contextlib
import types

__all__ = [
    "AccessError",
    "BackPressureTimeout",
    "ClusterError",
    "FutureTimeoutError",
    "HostLostError",
    "PathwaysError",
    "PlacementError",
    "ProgramFailedError",
    "ProgramTraceError",
    "ResourceError",
    "TimelineError",
    "TransferError",
]


class PathwaysError(Exception):
    """Base class of every error raised by pathways_jax."""


class ClusterError(PathwaysError, RuntimeError):
    """The cluster cannot be set up as asked (``pw.init`` / ``pw.shutdown``)."""


class ResourceError(PathwaysError, ValueError):
    """A request for devices that cannot be met (now, or ever)."""


class PlacementError(PathwaysError, ValueError):
    """Code cannot be placed on a slice: no slice given, or the slice is unusable."""


class ProgramTraceError(PathwaysError, TypeError):
    """Tracing a ``@pw.program`` failed; the message names the user's line."""


def also(error: type[PathwaysError], builtin: type[BaseException]) -> type[PathwaysError]:
    """``error`` that is also a ``builtin`` (or any other exception class), so that both catch it.

    Code written for ``jax.jit`` catches what JAX or its own function raised
    (``except ValueError``, ``pytest.raises(TypePromotionError)``): a trace
    failure raised as ``also(ProgramTraceError, type(cause))(message)`` is caught
    there and by ``except pw.errors.ProgramTraceError``. The class is made once
    per pair; where the two cannot be combined (classes of incompatible layouts,
    such as ``OSError``) it is ``error`` itself, the cause still chained.
    """
    if issubclass(error, builtin):
        return error
    if issubclass(builtin, PathwaysError):
        return builtin
    key = (error, builtin)
    made = _COMBINED.get(key)
    if made is None:
        try:
            made = type(
                error.__name__,
                (error, builtin),
                {
                    "__module__": error.__module__,
                    "__qualname__": error.__qualname__,
                    "__doc__": error.__doc__,
                    # The message as given: not the other class's own constructor or text.
                    "__init__": BaseException.__init__,
                    "__str__": BaseException.__str__,
                    # Pickles (to another process) as the plain pathways_jax error.
                    "__reduce__": lambda self: (error, self.args),
                },
            )
        except TypeError:
            made = error
        _COMBINED[key] = made
    return made


_COMBINED: dict[tuple[type, type], type] = {}

# Kept as ours: the message and its chaining, and the notes JAX and the user added to the
# cause (the cause is chained, so they show there once).
_NOT_CARRIED = frozenset(
    ("args", "__traceback__", "__context__", "__cause__", "__suppress_context__", "__notes__", "__dict__")
)


def like(error: type[PathwaysError], cause: BaseException, message: str) -> PathwaysError:
    """``also(error, type(cause))(message)``, carrying the attributes ``except`` code reads of ``cause``.

    Code written for ``jax.jit`` catches its function's own exception and reads
    it: a custom exception's attributes (``e.code``), ``OSError``'s ``errno`` and
    ``filename``, ``StopIteration.value``, an exception group's ``exceptions``
    (whose class cannot be made without them). The message is ``message``.
    """
    kind = also(error, type(cause))
    made: PathwaysError
    if isinstance(cause, BaseExceptionGroup) and issubclass(kind, BaseExceptionGroup):
        made = BaseExceptionGroup.__new__(kind, message, cause.exceptions)
        BaseException.__init__(made, message)
    else:
        made = kind(message)
    if kind is error:  # not combined: the cause's attributes belong to another class
        return made
    for klass in type(cause).__mro__:
        # The builtin classes' own fields (OSError.errno, StopIteration.value, ...).
        if klass.__module__ != "builtins" or klass in (BaseException, object):
            continue
        for name, field in vars(klass).items():
            if name in _NOT_CARRIED or not isinstance(
                field, (types.GetSetDescriptorType, types.MemberDescriptorType)
            ):
                continue
            with contextlib.suppress(AttributeError, TypeError):  # read-only, or unset on the cause
                setattr(made, name, getattr(cause, name))
    carried = getattr(cause, "__dict__", None)
    if carried:
        made.__dict__.update({k: v for k, v in carried.items() if k not in _NOT_CARRIED})
    return made


class TransferError(PathwaysError, RuntimeError):
    """A value could not be moved between slices."""


class ProgramFailedError(PathwaysError, RuntimeError):
    """A program run failed; raised by ``Future.result()`` of every output of the run."""


class HostLostError(ProgramFailedError):
    """A host of the Ray backend died: the values it held and the runs it was part of are lost.

    Raised by ``Future.result()``; the message names the host. Slices that
    lived on it are moved to surviving hosts where they fit, so the next call
    of the program runs there (lowered again, not traced again).
    """


class SpecializationError(PathwaysError, ValueError):
    """A ``colocated_python`` function was specialised twice in one respect, or called with
    arguments its specialisation cannot take; the message is the one JAX's own
    ``jax.experimental.colocated_python`` gives, so ``except ValueError`` catches both."""


class AccessError(PathwaysError, PermissionError):
    """A client process used a value handle that is not its own (nor shared with it), or one freed since.

    Raised by the controller service (``pw.serve``); the run or fetch that
    carried the handle touched nothing. Ask the value's owner to
    ``pw.share`` it with this client, or use a live handle.
    """


class FutureTimeoutError(PathwaysError, TimeoutError):
    """``Future.result(timeout=...)`` expired before the value was ready."""


class BackPressureTimeout(PathwaysError, TimeoutError):
    """A run waited longer than ``backpressure_timeout`` for device memory under its budget.

    Raised by ``Future.result()`` of every output of the run; free values you
    no longer need (drop their futures), or raise ``pw.init(memory_budget=...)``.
    """


class TimelineError(PathwaysError, RuntimeError):
    """A timeline trace was misused: nested ``pw.start_trace``, ``pw.stop_trace`` without
    one, or a trace file that is missing or not trace-event JSON."""
