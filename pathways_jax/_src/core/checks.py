"""Checks of user arguments shared by the API's entry points."""

from __future__ import annotations

import math
import numbers
from typing import TypeGuard


def is_seconds(value: object) -> TypeGuard[float]:
    """True for a finite real number >= 0 that is not a bool (NaN, inf and True are not seconds)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and math.isfinite(float(value))
        and float(value) >= 0
    )


__all__ = ["is_seconds"]
