"""A picture of the explored space, like the Slapo paper's tuning figure.

Batch size on the x axis, checkpoint ratio on the y axis; each trial that ran is a dot
coloured by its throughput, a failed trial (out of memory) a hollow circle, a point the
cost model pruned an ``x``, the best trial a star, and points of the space that were never
tried small grey dots. Drawn with matplotlib's Agg
backend (no display needed) into a PNG.

>>> import tempfile, os
>>> from torchloom.tune import TrialRecord
>>> records = [TrialRecord({"batch_size": 8, "ckpt_ratio": 0.0}, "ok", 10.0),
...            TrialRecord({"batch_size": 16, "ckpt_ratio": 0.0}, "pruned"),
...            TrialRecord({"batch_size": 16, "ckpt_ratio": 1.0}, "failed")]
>>> path = os.path.join(tempfile.mkdtemp(), "space.png")
>>> plot_space(records, path, title="demo") == path and os.path.getsize(path) > 0
True
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .database import TrialRecord
from .space import Point, point_key

__all__ = ["plot_space"]


def plot_space(
    records: Sequence[TrialRecord],
    path: str | Path,
    *,
    x: str = "batch_size",
    y: str = "ckpt_ratio",
    title: str | None = None,
    all_points: Sequence[Point] | None = None,
) -> str:
    """Write the figure of ``records`` to ``path`` (PNG) and return the path as a string.

    Args:
        records: the trials, e.g. ``TuneResult.records``.
        path: the output file.
        x, y: the symbols on the axes.
        title: the figure title.
        all_points: every point of the space (``list(space.enumerate())``); those without
            a record are drawn as small grey dots ("not tried").
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def coords(status: str) -> tuple[list[float], list[float], list[float]]:
        xs, ys, cs = [], [], []
        for r in records:
            if r.status == status and x in r.point and y in r.point:
                xs.append(r.point[x])
                ys.append(r.point[y])
                cs.append(r.throughput)
        return xs, ys, cs

    fig = Figure(figsize=(6.4, 4.8), dpi=100)
    FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global state
    ax = fig.subplots()
    tried = {r.key for r in records}
    untried = [p for p in all_points or () if point_key(p) not in tried and x in p and y in p]
    if untried:
        ax.scatter([p[x] for p in untried], [p[y] for p in untried], s=12, c="lightgrey",
                   label="not tried", zorder=1)
    xs, ys, cs = coords("ok")
    if xs:
        dots = ax.scatter(xs, ys, c=cs, cmap="viridis", s=90, edgecolors="black",
                          linewidths=0.5, label="ran", zorder=3)
        fig.colorbar(dots, ax=ax, label="throughput")
    fx, fy, _ = coords("failed")
    if fx:
        ax.scatter(fx, fy, s=90, facecolors="none", edgecolors="red", label="failed (OOM)",
                   zorder=3)
    px, py, _ = coords("pruned")
    if px:
        ax.scatter(px, py, marker="x", s=70, c="grey", label="pruned by cost model",
                   zorder=2)
    ok = [r for r in records if r.status == "ok" and x in r.point and y in r.point]
    if ok:
        best = max(ok, key=lambda r: r.throughput)
        ax.scatter([best.point[x]], [best.point[y]], marker="*", s=320, c="gold",
                   edgecolors="black", label="best", zorder=4)
    values = sorted({r.point[x] for r in records if x in r.point} | {p[x] for p in untried})
    if values and all(isinstance(v, (int, float)) and v > 0 for v in values):
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title or f"explored space: {len(records)} points")
    ax.grid(True, alpha=0.3)
    ys_all = sorted({r.point[y] for r in records if y in r.point} | {p[y] for p in untried})
    if ys_all and all(isinstance(v, (int, float)) for v in ys_all) and len(ys_all) <= 12:
        ax.set_yticks(ys_all, [f"{v:g}" for v in ys_all])
    if records or untried:  # below the axes, so that it hides no point
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=5, fontsize="small",
                  frameon=False)
    fig.savefig(str(path), bbox_inches="tight")
    return str(path)
