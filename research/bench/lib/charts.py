"""The charts: PNGs of few colours, the reference's and the goal's lines and marks."""

from __future__ import annotations

import io
from pathlib import Path


# Charts: the performance reference's figure and the goal are drawn alike on every chart of
# research/bench/ (the reference grey and dash-dotted, as django_app.py's reference band is grey;
# the goal red and dashed), each labelled "reference: …" / "goal: …" in the legend.
REFERENCE_STYLE = {"colors": "#57606a", "linestyles": "dashdot", "linewidths": 1.4}


GOAL_STYLE = {"colors": "#cf222e", "linestyles": "dashed", "linewidths": 1.2}


def save_png(fig, path: Path, dpi: int) -> None:
    """fig as a PNG of at most 256 colours (a chart has a few dozen: a third of the size of
    matplotlib's RGBA, so that run folders stay small in git)."""
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as im:
        # method 0: median cut, dither 0: none (Image.Quantize / Image.Dither from Pillow 9.1 on)
        im.convert("RGB").quantize(256, method=0, dither=0).save(path, optimize=True)


def reference_line(ax, value: float, label: str, vertical: bool = False) -> None:
    """The reference's figure across the whole axes, labelled `reference: label`."""
    (ax.axvline if vertical else ax.axhline)(value, color=REFERENCE_STYLE["colors"], ls="-.",
                                             lw=REFERENCE_STYLE["linewidths"], label=f"reference: {label}")


def goal_line(ax, value: float, label: str, vertical: bool = False) -> None:
    """The goal across the whole axes, labelled `goal: label`."""
    (ax.axvline if vertical else ax.axhline)(value, color=GOAL_STYLE["colors"], ls="--",
                                             lw=GOAL_STYLE["linewidths"], label=f"goal: {label}")


def marks(ax, xs: list, ys: list, width: float, label: str, style: dict) -> None:
    """A figure per category (a bar group): a short horizontal segment `width` wide over each x
    (None skipped), one legend entry `label`; style REFERENCE_STYLE or GOAL_STYLE."""
    from matplotlib import patheffects

    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pts:
        # A white edge: the segment stays visible over a bar of any colour.
        ax.hlines([y for _, y in pts], [x - width / 2 for x, _ in pts], [x + width / 2 for x, _ in pts],
                  label=label, zorder=3, **style,
                  path_effects=[patheffects.withStroke(linewidth=style["linewidths"] + 2.5, foreground="white")])
