"""Programs written for jax.jit / nnx.jit, with only the decorator changed, compared with the original (round 49)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pathways_jax as pw

pytestmark = pytest.mark.timeout(120)

_DECORATORS = [pw.program, pw.jit]
_IDS = ["program", "pw-jit"]


def _outcome(make, call):
    """What making the function and calling it did, comparable across decorators: a value or an error type."""
    try:
        f = make()
    except TypeError:
        return "made", TypeError
    try:
        return "ok", np.asarray(pw.results(call(f))).tolist()
    except TypeError:
        return "raised", TypeError


def _sized(x, n):
    return x + jnp.zeros(n).sum()  # n must be a Python int: static


@pytest.mark.parametrize("decorate", _DECORATORS, ids=_IDS)
@pytest.mark.parametrize("nums", [True, (True,), np.int64(1), "n"], ids=["bool", "bools", "numpy-int", "str"])
def test_static_argnums_are_read_as_jax_jit_reads_them(decorate, nums):
    # jax.jit reads its positions with operator.index: True is 1, a NumPy integer an int. Both
    # decorators refused them ("static_argnums must be ints"; a NumPy int: "not iterable").
    x = jnp.ones(2)
    got = _outcome(lambda: decorate(_sized, static_argnums=nums), lambda f: f(x, 3))
    assert got == _outcome(lambda: jax.jit(_sized, static_argnums=nums), lambda f: f(x, 3))
    if got[0] == "made":  # refused as jax.jit refuses it (a TypeError), as a pw error
        with pytest.raises(pw.errors.ProgramTraceError, match="static_argnums must be ints"):
            decorate(_sized, static_argnums=nums)


_PROGRAM_EMPTY = pytest.mark.xfail(
    strict=True,
    reason="pw.program's options default to () (decorator.py, the lead's), so an explicit () reads as "
    "not given and the other option completes it",
)


@pytest.mark.parametrize("decorate", [pytest.param(pw.program, marks=_PROGRAM_EMPTY), pw.jit], ids=_IDS)
@pytest.mark.parametrize(
    "options",
    [{"static_argnums": 1, "static_argnames": ()}, {"static_argnums": (), "static_argnames": "n"}],
    ids=["empty-names", "empty-nums"],
)
def test_an_option_given_empty_is_given_as_jax_jit_reads_it(decorate, options):
    # jax.jit completes static_argnames from static_argnums only when static_argnames is None:
    # given (), n passed by keyword is traced and jnp.zeros(n) raises. pw.jit read () as None.
    x = jnp.ones(2)
    for call in (lambda f: f(x, 3), lambda f: f(x, n=3)):
        assert _outcome(lambda: decorate(_sized, **options), call) == _outcome(
            lambda: jax.jit(_sized, **options), call
        )


def _pair(x, y):
    return x + y, y * 2


@pytest.mark.parametrize("decorate", [pytest.param(pw.program, marks=_PROGRAM_EMPTY), pw.jit], ids=_IDS)
def test_donations_given_empty_are_given_as_jax_jit_reads_them(decorate):
    # donate_argnums=1, donate_argnames=(): jax.jit keeps `y` passed by keyword; pw.jit deleted it.
    # donate_argnames="y", donate_argnums=(): jax.jit keeps `y` passed by position.
    for options, by_keyword in (
        ({"donate_argnums": 1, "donate_argnames": ()}, True),
        ({"donate_argnums": (), "donate_argnames": "y"}, False),
    ):
        deleted = []
        for make in (jax.jit, decorate):
            x, y = jnp.ones(3), jnp.ones(3)
            f = make(_pair, **options)
            pw.results(f(x, y=y) if by_keyword else f(x, y))
            deleted.append(y.is_deleted())
        assert deleted[1] == deleted[0] is False, options
