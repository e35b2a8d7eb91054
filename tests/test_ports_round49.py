"""Programs written for jax.jit / nnx.jit, with only the decorator changed, compared with the original (round 49)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

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


@pytest.mark.parametrize("decorate", [pw.program, pw.jit], ids=_IDS)
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


@pytest.mark.parametrize("decorate", [pw.program, pw.jit], ids=_IDS)
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


def _on_explicit_mesh():
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    return jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))


def _mesh_scaled(x):
    # Code that adapts to a context mesh (as Flax's sharding helpers do): with none, unchanged.
    return x * (1.0 if jax.sharding.get_abstract_mesh().empty else 2.0)


@pytest.mark.parametrize("decorate", _DECORATORS, ids=_IDS)
def test_with_no_mesh_set_a_program_on_arguments_of_an_explicit_mesh_sees_no_context_mesh(decorate):
    # jax.jit does not make its arguments' mesh the context mesh; a program with no slice did, so
    # this step doubled its input where jax.jit's returns it as it is.
    x = _on_explicit_mesh()
    got, want = pw.results(decorate(_mesh_scaled)(x)), jax.jit(_mesh_scaled)(x)
    assert jax.typeof(got) == jax.typeof(want)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _constrained(x):
    return jax.lax.with_sharding_constraint(x, P("y"))  # a bare spec of an axis no mesh here has


@pytest.mark.parametrize("decorate", _DECORATORS, ids=_IDS)
def test_a_step_failing_with_no_mesh_set_raises_jax_jits_error(decorate):
    # jax.jit raises RuntimeError ("requires a non-empty mesh in context"); a program raised the
    # error of its trace on its arguments' mesh, which it had set as the context mesh itself.
    x = _on_explicit_mesh()
    with pytest.raises(RuntimeError, match="non-empty mesh in context"):
        jax.jit(_constrained)(x)
    with pytest.raises(pw.errors.ProgramTraceError, match="non-empty mesh in context") as caught:
        pw.results(decorate(_constrained)(x))
    assert isinstance(caught.value, RuntimeError)


def test_a_kept_unused_argument_on_an_explicit_mesh_places_the_constants_made_as_jax_jit_does():
    x = _on_explicit_mesh()

    def made(v):
        return jnp.arange(8.0)  # a fresh function: jax.jit's trace cache ignores keep_unused

    want = jax.jit(made, keep_unused=True)(x)
    got = pw.results(pw.program(made, keep_unused=True)(x))
    assert got.committed == want.committed and jax.typeof(got) == jax.typeof(want)
    assert got.sharding.is_equivalent_to(want.sharding, 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jax.jit(_pair, donate_argnums=-1),
        lambda: pw.program(_pair, donate_argnums=-1),
        lambda: pw.jit(_pair, donate_argnums=-1),
        lambda: pw.program(jax.jit(_pair, donate_argnums=-1)),
    ],
    ids=["jax-jit", "program", "pw-jit", "program-of-jax-jit"],
)
def test_a_negative_donated_position_donates_nothing_as_under_jax_jit(make):
    # jax.jit accepts donate_argnums=-1 and donates no argument (its donation vector matches
    # positions as given); a program counted it from the end and deleted `y`, which the caller
    # still reads after a call that jax.jit leaves it intact.
    x, y = jnp.ones(3), jnp.ones(3)
    pw.results(make()(x, y))
    assert not x.is_deleted() and not y.is_deleted()
    np.testing.assert_array_equal(np.asarray(y), np.ones(3))
