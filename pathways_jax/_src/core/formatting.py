"""Text for people: abstract values as ``f32[4,8]`` and text made safe for HTML.

Graph listings, graph pictures, timelines, notebook views and error messages
all show values the same way through these helpers. This module imports
nothing else of pathways_jax.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["aval_text", "escape"]


def aval_text(aval: Any) -> str:
    """An abstract value in JAX's short form, ``str(aval)`` for anything else.

    Args:
      aval: a ``jax.core.ShapedArray`` (or anything with ``str_short``), or any object.

    Returns:
      The dtype's short name and the shape (``f32[4,8]``, ``bf16[]``,
      ``key<fry>[4]``); for an object with no short form, its ``str``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax import core
      >>> aval_text(core.ShapedArray((4, 8), jnp.float32))
      'f32[4,8]'
      >>> aval_text(None)
      'None'
    """
    try:
        return aval.str_short(short_dtypes=True)
    except Exception:
        return str(aval)


def escape(text: Any) -> str:
    """``str(text)`` with ``& < > " '`` escaped, safe inside HTML text and attribute values.

    Example:
      >>> escape("<a & 'b'>")
      '&lt;a &amp; &#x27;b&#x27;&gt;'
    """
    return html.escape(str(text), quote=True)
