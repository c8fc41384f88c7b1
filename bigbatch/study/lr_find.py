"""The learning-rate range test (`bigbatch.lr_find`) and its plot.

The test itself lives with the trainer, which runs it before training when `[batch]
lr_find = true` (`bigbatch.train.lr_range`, `bigbatch.train.lr_suggest`); it is
re-exported here with `plot_lr_find`, the figure `bigbatch lr-find` writes.
"""

from __future__ import annotations

from typing import Any

from bigbatch.train.lr_range import LRFind, lr_find

__all__ = ["LRFind", "lr_find", "plot_lr_find"]


def plot_lr_find(result: LRFind, path: Any) -> None:
    """Loss (raw and smoothed) against LR on a log axis, the suggestion marked; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(result.lrs, result.losses, alpha=0.3, label="loss")
    ax.plot(result.lrs, result.smoothed, label="smoothed")
    if result.suggested_lr is not None:
        ax.axvline(result.suggested_lr, color="C3", ls="--",
                   label=f"suggested {result.suggested_lr:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(f"LR range test at global batch {result.global_batch_size}")
    if result.smoothed:
        lo = min(result.smoothed)
        ax.set_ylim(lo - 0.1 * abs(lo), max(result.smoothed[0] * 1.5, lo + 1e-3))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
