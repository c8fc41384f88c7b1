"""What one worker saves: checkpoints during a run, and the final weights at its end.

A training checkpoint holds the model (or, for sharded state, its DCP shards beside the
payload), the engine's state (optimizer, schedule position, loss scaler, adaptive state,
batch plan), the sampler's position, every worker's RNG states and the counters the
trainer passes; resuming from it gives the weights an uninterrupted run would have.
`Checkpointer` owns the record of the last checkpoint: its path, and the step and sample
count it holds (a stop saves only what is new).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigbatch.engine.saving import set_rng_state
from bigbatch.parallel.world import World, broadcast
from bigbatch.train import data
from bigbatch.train.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointSaveError,
    WriteError,
    atomic_save,
    checkpoint_path,
    failure_reason,
    kept_line,
    manifest_path,
    save_checkpoint,
    save_failure,
)
from bigbatch.train.sharded import (
    ShardedStateError,
    remove_sharded,
    save_sharded,
    sharded_dir,
    whole_model_state,
)

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves one worker's run under `out` (rank 0 writes; every rank takes part)."""

    def __init__(self, out: Path, world: World, files: Any, *, keep: int, sharded: bool,
                 last: Path | None = None) -> None:
        self.out, self.world, self.files, self.keep = out, world, files, keep
        self.sharded = sharded
        """The model and optimizer state are saved per rank through DCP
        (`Degrees.sharded_state`)."""
        self.last = last
        """The last checkpoint's path (the one resumed from, until the first save)."""
        self.saved: tuple[int, int] | None = None
        """(step, samples) that the last checkpoint holds; None before one exists."""

    def holds(self, step: int, samples: int) -> bool:
        """Whether the last checkpoint already holds this step and sample count."""
        return self.saved == (step, samples)

    def save(self, run: Any, sampler: Any, samples: int, rngs: list[dict],
             counters: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint `run` at its step (every rank); `rngs`: every worker's RNG states
        (`rng_state()` gathered); `counters()` (the trainer's, taken last) follow the
        engine's and the sampler's state in the payload.

        A failed save raises `CheckpointSaveError` on every rank (rank 0's says what
        failed, where and how much space is left; the others' are `everywhere`), after
        what it wrote is removed: the earlier checkpoints are untouched."""
        engine = run.state_dict()  # every rank: ZeRO gathers its optimizer state here
        main = self.world.is_main
        path = checkpoint_path(self.out, run.step)
        shards: dict[str, dict] = {}
        if self.sharded:
            try:
                shards = save_sharded(path, run.module, run.optimizer, main,
                                      files=self.files if main else None)
            except ShardedStateError as e:
                self._fail(f"saving checkpoint {sharded_dir(path).name}/ failed "
                           f"({save_failure(e.reason, e.where)}); {kept_line(self.out, path)}",
                           e)
        error = None
        if main:
            state = {"model": run.module.state_dict()} if not self.sharded else {"sharded": True}
            try:
                self.last = save_checkpoint(self.out, run.step, {
                    "format": CHECKPOINT_FORMAT,
                    "step": run.step,
                    **state,
                    "engine": engine,
                    "sampler": sampler.state_dict(),
                    "samples": samples,
                    "rng": rngs,
                    "world_size": self.world.world_size,
                    **counters(),
                }, keep=self.keep, files=self.files, shards=shards)
            except CheckpointSaveError as e:
                if self.sharded and not manifest_path(path).exists():
                    # Never committed: the step goes whole (an earlier payload of this
                    # step does not belong with the new shards).
                    path.unlink(missing_ok=True)
                    remove_sharded(path, self.files)
                    self.files.discard(path)
                error = e
        else:
            self.last = path
        self._agree(error)
        self.saved = (run.step, samples)

    def _agree(self, error: WriteError | None) -> None:
        """Collective: rank 0's write `error` (or None) raised on every rank."""
        message = broadcast(str(error) if error is not None else None, self.world)
        if error is not None:
            raise error
        if message is not None:
            self._fail(message)

    @staticmethod
    def _fail(message: str, cause: BaseException | None = None) -> None:
        error = CheckpointSaveError(message)
        error.everywhere = True
        raise error from cause

    def restore(self, ckpt: dict, run: Any, sampler: Any, seed: int) -> None:
        """Put the engine's state, the sampler's position and this worker's RNG streams
        back from `ckpt` (the model's weights are loaded before `prepare()`)."""
        run.load_state_dict(ckpt["engine"])
        sampler.load_state_dict(ckpt["sampler"])
        rngs, w = ckpt["rng"], self.world
        if len(rngs) == w.world_size:
            set_rng_state(rngs[w.rank])
        else:  # another world size: fresh but deterministic streams, one per worker
            data.seed_everything(seed * 1000 + w.world_size * 100 + w.rank + run.step)
        self.saved = (run.step, int(ckpt.get("samples", 0)))

    def save_final(self, run: Any) -> None:
        """The whole model's weights as `final.pt` (every rank gathers sharded state;
        rank 0 writes)."""
        weights = (whole_model_state(run.module, run.mesh, run.pipeline) if self.sharded
                   else run.module.state_dict())
        error = None
        if self.world.is_main:
            final = self.out / "final.pt"
            self.files.add(final)
            try:
                atomic_save(weights, final)
            except (OSError, RuntimeError) as e:  # torch reports a full disk as RuntimeError
                error = WriteError(f"writing {final} failed "
                                   f"({save_failure(failure_reason(e), self.out)}); the last "
                                   f"checkpoint {self.last.name} is kept")
                error.__cause__ = e
        self._agree(error)
