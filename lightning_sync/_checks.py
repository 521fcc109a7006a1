"""Argument checks shared across the package: each returns the value or raises a ``ValueError`` naming it
and what is allowed. Imports nothing (``lightning_sync.batch`` must stay free of torch and Lightning)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["check_bool", "check_choice", "check_int"]


def check_int(name: str, value: Any, low: int) -> int:
    """``value`` if it is an int (not a bool) >= ``low``, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is True or False (not 0/1, not a string), else a ValueError naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``choices``, else a ValueError naming it and them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value
