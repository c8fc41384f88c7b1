"""The output directory of a run: made ready for a fresh run, or read for a resume."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World, broadcast
from bigbatch.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint

__all__ = ["prepare_out"]


def prepare_out(config: Any, world: World, outputs: tuple[str, ...]) -> Path | None:
    """Make the output directory ready; returns the checkpoint to resume from (or None).

    A fresh run deletes the previous run's `outputs` there and nothing else.
    """
    out = Path(config.out)
    ckpt = None
    if world.rank == 0:
        if config.resume:
            ckpt = latest_checkpoint(out)
            if ckpt is None:
                raise ConfigError(f"--resume: no checkpoint in {out / CHECKPOINT_DIR}")
        else:
            for name in outputs:
                p = out / name
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
            out.mkdir(parents=True, exist_ok=True)
    ckpt = broadcast(str(ckpt) if ckpt else None, world)
    return Path(ckpt) if ckpt else None
