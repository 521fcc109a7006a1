"""Benchmarks: strategies side by side in one run, A/B alternated, medians and ratios, report + plots.

The names below load on first use (PEP 562): a runner imports Lightning, and ``lightning-sync bench`` must be
able to check its optional dependencies (matplotlib) before paying for that import.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name and the module it lives in.
_LAZY = {"run_bench": "app", "CostParams": "model", "load_params": "model", "Report": "report", "Trial": "runner"}
_LAZY |= {"Measurement": "rows", "Row": "rows", "schedule": "rows", "stats_of": "runner"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
