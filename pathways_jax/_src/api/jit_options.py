"""``jax.jit``'s options as a program takes them: static and donated positions and names, checked as ``jax.jit`` does."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pathways_jax._src.core import errors, source


def argnums(fun: Callable[..., Any], nums: Any, what: str = "static_argnums") -> tuple[int, ...]:
    """Argument positions as ``jax.jit`` reads them: None is none, a negative static one counts from the end.

    A negative static position stays negative: ``jax.jit`` counts it from the end
    of each call's positional arguments (a function's ``*args``, or parameters
    left to their defaults, make that call's count), so the call resolves it
    (``ProgramInfo.static_positions``). A negative donated position donates
    nothing, as under ``jax.jit`` (which accepts it and matches no argument).
    """
    if nums is None:
        return ()
    try:  # as jax.jit reads them (operator.index): a bool is 0 or 1, a NumPy integer an int
        given: tuple[int, ...] = (operator.index(nums),)
    except TypeError:
        try:
            given = tuple(map(operator.index, nums))
        except TypeError as exc:
            raise errors.ProgramTraceError(
                f"{what} must be ints (an int or a sequence of them, as jax.jit reads them), got {nums!r} ({exc}); "
                "give argument positions, or their names through the matching *_argnames option."
            ) from exc
    if what != "static_argnums":
        # jax.jit donates an argument whose position is in donate_argnums as given (its
        # donation_vector); a negative one matches none, so it donates nothing: nor does a program.
        given = tuple(n for n in given if n >= 0)
    return tuple(sorted(set(given)))


def from_end(positions: tuple[int, ...], count: int, where: str) -> tuple[int, ...]:
    """``positions`` (sorted) with the negative ones counted from the end of a call's ``count`` positional arguments.

    As ``jax.jit`` resolves its ``static_argnums`` at each call.

    Raises:
      ProgramTraceError: also a ``ValueError``, as ``jax.jit``'s, for a position
        before the call's first argument.
    """
    if not positions or positions[0] >= 0:
        return positions
    if positions[0] + count < 0:
        raise errors.also(errors.ProgramTraceError, ValueError)(
            f"{where} has static_argnums {positions}, counted from the end of the call's "
            f"{count} positional arguments; {positions[0]} reaches before the first. Pass at "
            f"least {-positions[0]} positional arguments, or give static_argnums as non-negative positions."
        )
    return tuple(sorted({n + count if n < 0 else n for n in positions}))


def argnames(names: str | Sequence[str] | None, what: str = "static_argnames") -> tuple[str, ...]:
    """Argument names as ``jax.jit`` reads them: one string, several, or None (none)."""
    if names is None:
        return ()
    try:
        given = (names,) if isinstance(names, str) else tuple(names)
    except TypeError:
        given = (names,)  # type: ignore[assignment]  # refused below, as jax.jit refuses it
    if not all(isinstance(n, str) for n in given):
        raise errors.ProgramTraceError(
            f"{what} must be strings (a string or a sequence of them, as jax.jit reads them), got {names!r}; "
            "give parameter names, or their positions through the matching *_argnums option."
        )
    return given


def complete_argnums(
    fun: Callable[..., Any], nums: Any, names: Any, what: str = "static"
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``{what}_argnums`` and ``{what}_argnames`` as given by the user, completed as ``jax.jit`` completes them.

    As ``jax.jit``'s ``infer_argnums_and_argnames``: None is "not given"; one
    given alone is completed from the other; given both, even one of them
    empty (``static_argnames=()``), each is taken as it is.
    """
    positions = argnums(fun, nums, f"{what}_argnums")
    given_names = argnames(names, f"{what}_argnames")
    return _resolve_statics(fun, positions, given_names, given_both=nums is not None and names is not None)


def _check_argnums_as_jax_jit(
    fun: Callable[..., Any],
    static_argnums: Any,
    static_argnames: Any,
    donate_argnums: Any,
    donate_argnames: Any,
    maker: str = "pw.program",
    empty_is_unset: bool = True,
) -> None:
    """Refuses, when the program (or ``maker``'s function) is made, the argument positions and names ``jax.jit`` refuses then.

    Positions past the function's positional parameters, names it does not
    take, an argument both static and donated: ``jax.jit`` checks them against
    the function's signature itself, so its own check is used.

    Raises:
      ProgramTraceError: also a ``ValueError``, as ``jax.jit``'s.

    ``empty_is_unset``: names given empty are read as not given (None to
    ``jax.jit``), for a maker whose defaults are ``()``.
    """
    if empty_is_unset:  # then jax.jit infers the names from the positions
        static_argnames, donate_argnames = static_argnames or None, donate_argnames or None
    try:
        jax.jit(
            fun,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
        )
    except (ValueError, TypeError) as exc:
        raise errors.also(errors.ProgramTraceError, type(exc))(
            f"{maker}({name_of(fun)!r}) ({source.of_function(fun)}): {exc}"
        ) from exc


def name_of(fun: Any) -> str:
    """A function's name for graphs and errors; a ``functools.partial``'s is its function's."""
    while isinstance(fun, functools.partial):
        fun = fun.func
    return getattr(fun, "__name__", None) or type(fun).__name__


def _parameters(fun: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return []


def _positions_of(fun: Callable[..., Any], names: Sequence[str]) -> list[int]:
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [i for i, p in enumerate(_parameters(fun)) if p.kind in positional and p.name in names]


def _resolve_statics(
    fun: Callable[..., Any], nums: tuple[int, ...], names: tuple[str, ...], *, given_both: bool = False
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Static positions and names, each completed from the other as ``jax.jit`` does.

    As ``jax.jit``'s: only one given is completed from the other; given both,
    each is taken as it is (``static_argnums=1, static_argnames="m"`` leaves the
    argument at position 1 traced when it comes by keyword). ``()`` reads as
    "not given" unless ``given_both`` (both given by the user, or completed
    already: see :func:`complete_argnums`).
    """
    if given_both or (nums and names):
        return tuple(sorted(set(nums))), names
    params = _parameters(fun)
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    # A negative position names no parameter: jax.jit infers names from non-negative ones only.
    more_names = [params[n].name for n in nums if 0 <= n < len(params) and params[n].kind in by_keyword]
    all_names = tuple(dict.fromkeys((*names, *more_names)))
    return tuple(sorted({*nums, *_positions_of(fun, names)})), all_names


def with_jits_statics(
    fun: Any, statics: tuple[int, ...], names: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``statics`` and ``names``, and those of ``fun`` itself if it is a ``jax.jit`` function.

    ``pw.program(jax.jit(step, static_argnames="train"))`` then takes ``train``
    as ``jax.jit(step, ...)`` does: a static argument of the inner function
    cannot arrive traced. (Its donations: :func:`with_jits_donations`.)
    """
    info = getattr(fun, "_jit_info", None)  # jax.jit's own record of its options (private)
    inner = tuple(getattr(info, "static_argnums", ()) or ())
    inner_names = tuple(getattr(info, "static_argnames", ()) or ())
    if not inner and not inner_names:
        return statics, names
    return (
        tuple(sorted({*statics, *inner})),
        tuple(dict.fromkeys((*names, *inner_names))),
    )


def with_jits_donations(
    fun: Any, nums: tuple[int, ...], names: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``nums`` and ``names``, and the donations of ``fun`` itself if it is a ``jax.jit`` function.

    ``pw.jit(jax.jit(step, donate_argnums=0))`` and ``pw.program(jax.jit(step,
    donate_argnums=0))`` then consume their first argument as ``jax.jit(step,
    donate_argnums=0)`` does: the caller's array reads as deleted after the
    call. (A ``jax.jit`` function called inside a program donates only values
    made inside it, as under ``jax.jit``.)
    """
    info = getattr(fun, "_jit_info", None)  # jax.jit's own record of its options (private)
    inner = tuple(getattr(info, "donate_argnums", ()) or ())
    inner_names = tuple(getattr(info, "donate_argnames", ()) or ())
    if not inner and not inner_names:
        return nums, names
    return tuple(sorted({*nums, *inner})), tuple(dict.fromkeys((*names, *inner_names)))


def refuse_traced_statics(statics: list[tuple[int | str, Any]], what: str, name: str, where: str) -> None:
    """Refuses a static argument a transformation around the call made abstract (a JAX tracer).

    ``jax.eval_shape`` traces every argument of a function that is not a
    ``jax.jit`` function itself, so a static one arrives as a tracer; ``jax.jit``
    would fail hashing it ("Non-hashable static arguments"), naming neither the
    argument nor what to do. ``statics``: (position or name, value) of each;
    ``what``: the function as the message names it; ``name``: what to call
    ``eval_shape`` on; ``where``: its source.

    Raises:
      ProgramTraceError: also a ``ValueError``, as ``jax.jit``'s.
    """
    for arg, value in statics:
        if isinstance(value, jax.core.Tracer):
            raise errors.also(errors.ProgramTraceError, ValueError)(
                f"static argument {arg!r} of {what} ({where}) is a JAX tracer (called at "
                f"{source.of_caller()}): the transformation around the call (jax.eval_shape traces "
                "every argument) made it abstract, and a static argument must be a value. Ask the "
                f"function itself: {name}.eval_shape(...), or close over the value (functools.partial) "
                "before transforming."
            )
