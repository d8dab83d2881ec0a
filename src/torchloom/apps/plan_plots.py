"""The PNGs ``torchloom plan --plot`` writes: the searched layouts by peak memory and
throughput (:func:`plot_search`), or one layout's memory by kind per pipeline stage
(:func:`plot_roles`). matplotlib is imported when a plot is asked for.

>>> import os, tempfile
>>> from torchloom.plan import Layout, predict
>>> p = predict("llama", Layout(micro_batch=2, seq_len=32), "h100-80gb")
>>> path = os.path.join(tempfile.mkdtemp(), "roles.png")
>>> plot_roles(p, path) == path and os.path.getsize(path) > 0
True
"""

from __future__ import annotations

from ..plan.predict import Prediction
from ..plan.search import SearchResult

__all__ = ["plot_search", "plot_roles"]

GIB = 2**30


def plot_search(result: SearchResult, path: str, title: str, budget: int) -> str:
    """A PNG of the searched layouts: peak memory against throughput (fitting ones
    filled), the memory budget as a line, the best one starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fits, marker in ((True, "o"), (False, "x")):
        pts = [p for p in result.ranked if p.fits == fits]
        if pts:
            ax.scatter([p.peak / GIB for p in pts], [p.tokens_per_s for p in pts],
                       marker=marker, c=[p.layout.tp for p in pts], cmap="viridis",
                       label="fits" if fits else "does not fit", alpha=0.8)
    ax.axvline(budget / GIB, color="red", linestyle="--", label="usable memory")
    if result.best is not None:
        b = result.best
        ax.scatter([b.peak / GIB], [b.tokens_per_s], marker="*", s=250, color="gold",
                   edgecolor="black", label=b.layout.describe(), zorder=5)
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_roles(p: Prediction, path: str) -> str:
    """A PNG of one layout: memory by kind, stacked, per pipeline stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("parameters", "gradients", "optimizer", "buffers", "inputs", "activations")
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(p.roles)
    stages = [str(r.stage) for r in p.roles]
    for kind in kinds:
        vals = [getattr(r.memory, kind) / GIB for r in p.roles]
        ax.bar(stages, vals, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(p.profile.budget / GIB, color="red", linestyle="--", label="usable memory")
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(p.layout.describe(), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
