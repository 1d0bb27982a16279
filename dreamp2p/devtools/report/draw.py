"""Drawing helpers shared by the report's figures: an Agg figure with no pyplot state, saving, colours.

matplotlib is imported only inside these functions, so importing the report does not load it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

DPI = 110
SIZE = (10.0, 5.0)


@contextmanager
def agg_figure(size: tuple[float, float]) -> Iterator[Figure]:
    """A fresh Agg-backed figure with readable fonts; pyplot and its global figure list are never touched."""
    import sys

    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # switching a live pyplot backend would close the user's figures
        matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(
        {
            "font.size": 10,
            "axes.titlesize": 12,
            "axes.labelsize": 11,
            "legend.fontsize": 9,
            "xtick.labelsize": 9,
            "ytick.labelsize": 9,
            "figure.titlesize": 12,
        }
    ):
        fig = Figure(figsize=size, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        yield fig


def save_png(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white")
    log.info("wrote %s", path)
    return path


def png_path(out: Path, name: str) -> Path:
    """``out`` is the report folder; a path ending in .png names the file itself."""
    out = Path(out)
    return out if out.suffix.lower() == ".png" else out / name


def node_colors(n: int) -> list[Any]:
    import matplotlib

    if n <= 10:
        cmap = matplotlib.colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    cmap = matplotlib.colormaps["tab20"] if n <= 20 else matplotlib.colormaps["turbo"]
    return [cmap(i) if n <= 20 else cmap(i / max(1, n - 1)) for i in range(n)]


def no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", color="grey", fontsize=12)


def utc_label(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
