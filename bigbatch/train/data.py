"""Small helpers of `bigbatch.train.trainer`: seeding, collectives on Python objects, the output
directory, batches, the non-finite loss guard."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World
from bigbatch.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def barrier(world: World) -> None:
    if world.is_distributed and dist.is_initialized():
        dist.barrier()


def broadcast(obj: Any, world: World) -> Any:
    """Rank 0's `obj` on every worker."""
    if not world.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any, world: World) -> list[Any]:
    """Every worker's `obj`, by rank, on every worker."""
    if not world.is_distributed:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


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


def fetch(dataset, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The samples `idx` as a batch tuple on `device` (one gather per tensor for tensor data)."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is None:  # a generic Dataset: collate samples one by one
        from torch.utils.data import default_collate

        batch = default_collate([dataset[int(i)] for i in idx])
    else:
        batch = tuple(t[idx] for t in tensors)
    return tuple(t.to(device, non_blocking=True) for t in batch)


def shard_batches(dataset, world: World, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """This worker's contiguous shard of `dataset` in batches (evaluation)."""
    n = len(dataset)
    lo, hi = world.rank * n // world.world_size, (world.rank + 1) * n // world.world_size
    for start in range(lo, hi, batch_size):
        yield fetch(dataset, torch.arange(start, min(start + batch_size, hi)), torch.device("cpu"))


def sync_buffers(module: torch.nn.Module, world: World) -> None:
    """Give every worker rank 0's buffers (BatchNorm statistics).

    They drift apart between DDP's per-forward broadcasts; evaluating and saving
    rank 0's is what the next forward would do anyway.
    """
    if world.is_distributed:
        for buf in module.buffers():
            dist.broadcast(buf, src=0)


def summed(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over all workers, in place (an evaluation `reduce`)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


NAN_POLICIES = ("stop", "skip")


class NonFiniteLossError(RuntimeError):
    """Training met a non-finite loss it may not skip (`nan_policy`); the CLI exits 1."""


class NonFiniteGuard:
    """`nan_policy` in fp32/bf16 (fp16 overflow is the loss scaler's): watches the losses.

    The flag is a device tensor summed per micro-step and read (all-reduced, so every
    worker decides alike) once per optimizer step, before the last backward.
    """

    def __init__(self, policy: str, world: World, device: torch.device, max_skips: int,
                 out: str):
        self.policy, self.world, self.max_skips, self.out = policy, world, max_skips, out
        self.flag = torch.zeros((), dtype=torch.float64, device=device)
        self.skipped = 0
        """Optimizer steps skipped for a non-finite loss (all of the run)."""
        self.consecutive = 0

    def should_skip(self, ms: Any, loss: torch.Tensor, step: int) -> bool:
        """Inside a micro-step's block, before `ms.backward`: True to `ms.skip()` the step."""
        self.flag += (~torch.isfinite(loss.detach())).any().double()
        if not ms.is_last:
            return False
        flag = self.flag
        if self.world.is_distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        bad = bool(flag.item() > 0)
        self.flag.zero_()
        if not bad:
            self.consecutive = 0
            return False
        keep = f"no checkpoint was written after it (in {self.out}/checkpoints)"
        if self.policy == "stop":
            raise NonFiniteLossError(
                f"non-finite loss at optimizer step {step} (nan_policy=stop); {keep}")
        self.consecutive += 1
        if self.consecutive >= self.max_skips:
            raise NonFiniteLossError(
                f"non-finite loss at {self.consecutive} consecutive optimizer steps, the last "
                f"at step {step} (nan_policy=skip); {keep}")
        self.skipped += 1
        return True


def resume_batch_line(saved: dict, run: Any, strategy: Any) -> str | None:
    """What a resume did to the batch, one line (None when nothing moved)."""
    plan, W = run.plan, run.world.world_size
    g0, w0 = saved["global_batch_size"], saved["world_size"]
    if (g0, saved["micro_batch_size"], saved["k_steps"], w0) == (
            plan.global_batch_size, plan.micro_batch_size, plan.k_steps, W):
        return None
    how = (f"global batch {g0} -> {plan.global_batch_size}" if g0 != plan.global_batch_size
           else f"global batch {g0} kept")
    why = (f"{W} worker(s), was {w0}; batch.elastic={strategy.batch.elastic}" if w0 != W
           else "the batch configuration changed")
    line = f"{how} ({why}): micro batch {plan.micro_batch_size} x k_steps {plan.k_steps}"
    if g0 != plan.global_batch_size:
        line += (f", peak LR {plan.peak_lr:.6g} ({strategy.batch.scaling} scaling); the "
                 f"schedule still counts steps of {run.unit_batch_size} samples")
    return line

