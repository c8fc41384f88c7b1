"""A distributed batch sampler whose global batches do not depend on the world size.

Each epoch draws one permutation of the data set from `(seed, epoch)`; optimizer
step `s` consumes `perm[p : p + G]` (`p` the sample position, `G` the global
batch). That global batch is cut into `k_steps x world_size` micro-batches of
`micro_batch_size`; worker `r` takes, at micro-step `j`, chunk `j * world_size + r`.
So 1 worker with gradient merge and N workers without it see the same samples
per step, and the position (epoch, samples consumed) resumes a run mid-epoch,
even on another world size.

With per-worker shares (`set_shares`, straggler rebalancing) each micro-step's
``micro_batch_size x world_size`` samples are cut into the workers' shares in
rank order instead of equal chunks: the same samples per step, split differently.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bigbatch.errors import ConfigError


class GlobalBatchSampler:
    """Per-worker micro-batch indices, reshuffled each epoch, reproducible by seed, resumable."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ):
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        """Current epoch (0-based)."""
        self.position = 0
        """Samples of the current epoch already handed out (whole global batches)."""
        self.set_batch(global_batch_size, micro_batch_size)

    def set_batch(self, global_batch_size: int, micro_batch_size: int) -> None:
        """Batch sizes from the next step on (an adaptive batch size changes them mid-epoch)."""
        k, rem = divmod(global_batch_size, micro_batch_size * self.world_size)
        if rem or k < 1:
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size "
                f"{micro_batch_size} x world_size {self.world_size}"
            )
        if global_batch_size > self.num_samples:
            raise ConfigError(
                f"batch.global_batch_size={global_batch_size} is larger than the training set "
                f"({self.num_samples} samples); allowed: <= {self.num_samples}"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.k_steps = k
        self.shares: list[int] | None = None
        """Per-worker micro batches when they differ (`set_shares`), else None."""

    def set_shares(self, sizes: list[int] | None) -> None:
        """Per-worker micro batches from the next step on (None: equal); they must sum to
        ``micro_batch_size x world_size`` so the global batch stays."""
        if sizes is not None:
            sizes = [int(x) for x in sizes]
            if (len(sizes) != self.world_size or min(sizes) < 1
                    or sum(sizes) != self.micro_batch_size * self.world_size):
                raise ConfigError(
                    f"micro batches per worker {sizes}: expected {self.world_size} sizes >= 1 "
                    f"summing to {self.micro_batch_size * self.world_size}")
            if len(set(sizes)) == 1:
                sizes = None
        self.shares = sizes

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a full epoch (the last partial global batch is dropped)."""
        return self.num_samples // self.global_batch_size

    @property
    def epoch_done(self) -> bool:
        """No full global batch is left in this epoch."""
        return self.position + self.global_batch_size > self.num_samples

    def permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        # A fresh generator per epoch: the order is a pure function of (seed, epoch).
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        """The rest of the current epoch: per optimizer step, this worker's k micro-batches.

        The position advances *before* a step is handed out, so state taken after
        the step (a checkpoint) already counts it.
        """
        perm = self.permutation(self.epoch)
        w = self.world_size
        while not self.epoch_done:  # sizes read per step: `set_batch` may change them
            m = self.micro_batch_size
            batch = perm[self.position : self.position + self.global_batch_size]
            self.position += self.global_batch_size
            if self.shares is None:
                yield [batch[(j * w + self.rank) * m : (j * w + self.rank + 1) * m]
                       for j in range(self.k_steps)]
            else:
                start, size = sum(self.shares[:self.rank]), self.shares[self.rank]
                yield [batch[j * w * m + start : j * w * m + start + size]
                       for j in range(self.k_steps)]

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ConfigError(
                f"checkpoint's data set has {state['num_samples']} training samples, "
                f"this run has {self.num_samples}"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
