"""How every bench figure looks, decided once so the figures read alike and fit a README.

- A strategy has one colour in every figure and run (:data:`PALETTE`, else a spare one by a stable hash).
- A figure has at most :data:`MAX_PANELS` panels and is at most :data:`MAX_WIDTH_PX` pixels wide: more panels
  than a reader can compare at a glance go to a second page (:func:`paged`).
- A repeated measurement is drawn as its median with whiskers (or a band) from its smallest to its largest
  repeat (:func:`whisker`); a figure that is not repeated says so in its label instead.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from lightning_sync.bench.rows import pyplot

__all__ = ["DPI", "HATCHES", "MARKERS", "MAX_PANELS", "MAX_WIDTH_PX", "PALETTE", "WHISKER", "colour", "figure", "grid"]
__all__ += ["label", "legend_below", "log_axis", "look", "paged", "repeats_note", "save_fig", "whisker"]

T = TypeVar("T")

#: Strategy name (a row of ``strategies`` or ``tradeoff.rows`` in ``conf/bench.yaml``) -> colour. Families share
#: a hue: the DDPs blue, the ZeRO stages orange to brown, periodic averaging green and purple, torch's own rows grey.
PALETTE: dict[str, str] = {
    "lightning_ddp": "#4d4d4d",
    "bucketed_ddp": "#1f77b4",
    "bucketed_ddp_fp16": "#6baed6",
    "bucketed_ddp_bf16": "#08306b",
    "bucketed_ddp_powersgd": "#17becf",
    "fsdp2": "#8c564b",
    "zero1": "#fdae6b",
    "zero2": "#f16913",
    "zero3": "#a63603",
    "local_sgd": "#2ca02c",
    "diloco": "#9467bd",
    # Streaming DiLoCo, DiLoCo's purple family: lighter with more fragments, pinker in int4
    "streaming_f2_fp32": "#6a51a3",
    "streaming_f4_fp32": "#bcbddc",
    "streaming_f2_int4": "#ae017e",
    "streaming_f4_int4": "#f768a1",
    "async_ps": "#e377c2",
    "hogwild": "#d62728",
}
#: Colours for names :data:`PALETTE` lacks, none of them in it.
_SPARE = ("#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354", "#756bb1")
#: One hatch per world size in a group of bars, one marker per world size among points (the colour already names
#: the strategy).
HATCHES, MARKERS = ("", "//", "xx", "..", "\\\\", "oo"), "os^Dv<>p"
MAX_PANELS = 6
MAX_WIDTH_PX = 1600
DPI = 110
#: How every whisker is drawn (``errorbar`` keywords).
WHISKER = {"elinewidth": 0.8, "capsize": 2}


def colour(name: str) -> str:
    """The strategy's colour, the same in every figure."""
    return PALETTE.get(name) or _SPARE[zlib.crc32(name.encode()) % len(_SPARE)]


def look(name: str) -> dict[str, str]:
    """Keywords that colour an artist for strategy ``name`` and tag it (``gid``): a figure is searchable by it."""
    return {"color": colour(name), "gid": name}


def paged(path: Path, items: Iterable[T], per_page: int) -> Iterator[tuple[Path, list[T]]]:
    """Each page of at most ``per_page`` of ``items`` with the file it goes to: ``path`` for the first page,
    ``<stem>_<n><suffix>`` beside it for the n-th; none for no items."""
    if per_page < 1:
        raise ValueError(f"per_page must be >= 1, got {per_page!r}")
    seq = list(items)
    for n, i in enumerate(range(0, len(seq), per_page), 1):
        yield (path if n == 1 else path.with_name(f"{path.stem}_{n}{path.suffix}")), seq[i : i + per_page]


def figure(nrows: int, ncols: int, width: float, height: float) -> tuple[Any, Any]:
    """``(fig, axes)``: a grid of panels of ``width`` x ``height`` inches each; ``axes`` is always 2-D. More than
    :data:`MAX_PANELS` panels raise ``ValueError``: page them (:func:`paged`)."""
    if nrows * ncols > MAX_PANELS or nrows < 1 or ncols < 1:
        raise ValueError(f"a bench figure has 1 to {MAX_PANELS} panels, got {nrows} x {ncols}")
    return pyplot().subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)


def grid(n: int, width: float, height: float, columns: int = 3) -> tuple[Any, list[Any]]:
    """``(fig, axes)``: ``n`` panels (:func:`figure`), ``columns`` to a row, no empty cells."""
    cols = min(n, columns)
    fig, axes = figure(-(-n // cols), cols, width, height)
    cells = list(axes.flat)
    for ax in cells[n:]:
        fig.delaxes(ax)
    return fig, cells[:n]


def label(ax: Any, xlabel: str, ylabel: str, title: str, size: float = 9, legend: float | None = 7) -> None:
    """Axis labels, a title of font ``size`` and (unless ``legend`` is None) a legend of that font size."""
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=size)
    ax.tick_params(labelsize=7)
    if legend is not None and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend)


def legend_below(fig: Any, handles: Sequence[Any] = (), ncol: int = 5, names: Sequence[str] = ()) -> tuple[float, ...]:
    """One legend below the panels (each strategy's colour for ``names``, then ``handles``) in the columns that fit
    its width; the ``rect`` for :func:`save_fig` that leaves it room."""
    handles = [*(pyplot().Rectangle((0, 0), 1, 1, color=colour(n), label=n) for n in names), *handles]
    ncol = max(1, min(len(handles), ncol, int(fig.get_figwidth() / 1.6)))  # a column: a 7-point name, ~1.5 in
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    return (0, min(0.45, 0.2 * -(-len(handles) // ncol) / fig.get_figheight()), 1, 1)


def log_axis(ax: Any, which: str = "x") -> None:
    """Make ``ax``'s ``which`` axes logarithmic with plain-number labels at 1, 2 and 5 times the powers of ten (at
    the powers alone over more than two decades): the default labels a short range in overlapping ``2 x 10^2``."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for name in which:
        getattr(ax, f"set_{name}scale")("log")
        lo, hi = getattr(ax, f"get_{name}lim")()
        axis = getattr(ax, f"{name}axis")
        wide = lo > 0 and hi / lo > 100
        axis.set_major_locator(LogLocator(subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def whisker(median: float, values: Iterable[float]) -> list[list[float]] | None:
    """``yerr`` (or ``xerr``) for ``errorbar`` from ``median`` down to the smallest and up to the largest of
    ``values``; None when fewer than two finite values were measured (nothing to show)."""
    finite = [v for v in values if not math.isnan(v)]
    if len(finite) < 2 or math.isnan(median):
        return None
    return [[max(0.0, median - min(finite))], [max(0.0, max(finite) - median)]]


def repeats_note(counts: Iterable[int]) -> str:
    """What the whiskers span, for an axis label (``... of 5 rounds``, ``3-5``), or that one round has no spread."""
    counts = sorted(set(counts))
    if not counts or counts[-1] < 2:
        return "1 round: no spread"
    n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"median, whiskers min-max of {n} rounds"


def save_fig(fig: Any, path: Path, rect: tuple[float, ...] | None = None) -> Any:
    """Lay out, write at :data:`DPI` (less for a figure wider than :data:`MAX_WIDTH_PX` at that resolution) and
    close ``fig``; return it, closed, for a caller that inspects what was drawn."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=min(DPI, math.floor(MAX_WIDTH_PX / fig.get_figwidth())))
    pyplot().close(fig)
    return fig
