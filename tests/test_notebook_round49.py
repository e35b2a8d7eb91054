"""A notebook's cells run again, interrupted, or ended: what a kernel keeps and what it is told.

Cells re-run redefine their functions; Ctrl-C lands at any moment (made to land
deterministically, as in tests/test_notebook_round48.py); a kernel's exit must
not wait for ever on a run that never ends; a program's view says what its last
trace did.
"""

import gc
import html
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_matches

import pathways_jax as pw
from pathways_jax._src.api import arguments

_OUTPUTS = 4


def _many(v):
    return [v * i for i in range(_OUTPUTS)]


@pytest.mark.timeout(120)
def test_placed_jit_redefined_in_a_cell_again_and_again_keeps_nothing_of_the_old_ones():
    # A cell run again and again: f = pw.jit(lambda ..., devices=s); f(x). Each dropped
    # function's plan left the array key of each of its outputs in a table of the argument
    # layer, for good (about 1.2 MB a hundred redefinitions of a dozen outputs, up to 65536 entries).
    pw.init(num_cpu_devices=8)
    s = pw.devices(mesh={"x": 2})
    x = jnp.arange(8.0)
    want = jax.jit(_many)(x)

    def cell():
        f = pw.jit(lambda v: _many(v), devices=s)  # a new function each time, as a cell makes
        assert_matches(f(x), want)

    cell()
    gc.collect()
    cell()
    before = len(arguments._ARRAY_KEYS)
    for _ in range(8):
        cell()
    gc.collect()
    cell()  # what went since is forgotten as the next plan is made
    assert len(arguments._ARRAY_KEYS) - before <= 2 * _OUTPUTS, (before, len(arguments._ARRAY_KEYS))
    s.release()


def _text(html):
    return re.sub(r"<[^>]+>", " ", html)


@pytest.mark.timeout(60)
def test_program_view_after_a_failed_trace_says_it_failed_and_why():
    # A cell calls a program whose trace fails (a shape error); the next cell shows the program
    # to see why, and its view said "not traced yet: call it", as if it had never been called.
    pw.init(num_cpu_devices=8)

    @pw.program
    def step(x):
        return x @ jnp.ones((3, 3))

    with pytest.raises(pw.errors.ProgramTraceError) as info:
        step(jnp.ones(8))
    text = _text(step._repr_html_())
    assert "not traced yet" not in text, text
    first = str(info.value).splitlines()[0]
    assert "its trace failed: " in text and "contracting dimensions" in first, text
    assert html.escape(first) in step._repr_html_(), (first, text)
    step(jnp.ones(3))  # fixed: the view shows its graph, and no failure
    text = _text(step._repr_html_())
    assert "trace failed" not in text and "1 traced signatures" in text, text
    with pytest.raises(pw.errors.ProgramTraceError):
        step(jnp.ones(5))  # another signature fails: said beside the graph traced before
    assert "its last trace failed: " in _text(step._repr_html_())
