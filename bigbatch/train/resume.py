"""What a resume may change: the requested run against the checkpoint's.

A resume continues the run the checkpoint belongs to, so its settings must be that
run's, except for these (`ALLOWED`):

- the training length (`steps` / `epochs`), only extended: never below the step
  the checkpoint was taken at;
- checkpoint, log and evaluation cadence (`checkpoint_every`, `keep_checkpoints`,
  `log_every`, `eval_every`, `eval_batch_size`), what a non-finite loss does
  (`nan_policy`), the progress bar and TensorBoard, and where the run lives (`out`);
- `data_parallel.timeout_s`;
- the number of workers, as `batch.elastic` says (`keep` the global batch, or
  `scale` it), and `batch.elastic` itself;
- how the model is laid out over the workers: the `[sharding]` stage, degree and
  offload, and the pipeline's degree, split and schedule (sharded checkpoints are
  DCP's, keyed by parameter name, and reshard on load; the tensor-parallel degree is
  checked on its own, as the padded vocabulary follows it).

- how gradients and weights travel and what adapts (`SWITCHABLE`): the reduce between
  mean, fp16, bf16, adasum and powersgd and their keys, local SGD (its averaging all
  or pairwise included) and adaptive local SGD (a checkpoint is taken after `synchronize()`: every worker holds the same
  weights and moments, so either side of the switch starts from one state), and the
  `[adaptive]` keys that only measure or decide later (the noise scale, goodput's batch
  bounds and interval, the policies).

PowerSGD's checkpoint keeps only its step count and random state: its error feedback is
kept per DDP bucket and restarts from zero on any resume (`hook_state_dict`), so entering
it from a checkpoint starts it as a new run would (``start_powersgd_iter`` plain steps
first) and leaving it drops nothing a resume in PowerSGD keeps. A policy makes such a
switch with `Policies.request_relaunch` (`bigbatch.cli.relaunch`).

Still refused, and why: a reduce to or from ``dgc`` (DGC owns momentum and weight decay in
its hook, `DGC_OPTIMIZER`, and keeps each worker's velocity: the optimizer state of the
other mode has no place to go); ``adaptive.lr`` (AdaScale counts the schedule in steps of the base batch and scales
the LR by its gain: the checkpoint's progress would mean something else);
``adaptive.gns_gradient`` (the saved estimates are of another gradient).

Anything else (the seed, the task and its data, the model, any other strategy key)
is refused with one line listing the keys that differ, before anything is written.

A new training length keeps the schedule's shape over the new total: the decay is
re-stretched to end at the new last step (an extended run does not sit at the old
decay's end LR, which for cosine or poly to 0 would train at LR 0). The LR therefore
changes at the first step after the checkpoint, and `schedule_change_line` says so once,
at resume: ``the schedule now decays over 40 steps (was 36): the LR jumps from 0.0024 to
0.0151 at step 21``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bigbatch.config.strategy import Strategy
from bigbatch.errors import ConfigError
from bigbatch.train.checkpoint import CheckpointError

__all__ = ["ALLOWED", "SWITCHABLE", "check_resume", "schedule_change_line"]

ALLOWED_CONFIG = ("epochs", "steps", "checkpoint_every", "keep_checkpoints", "log_every",
                  "eval_every", "eval_batch_size", "nan_policy", "progress", "tensorboard",
                  "out", "resume", "overwrite", "fit_warmup", "trust_checkpoint")
ALLOWED_STRATEGY = ("data_parallel.timeout_s", "batch.elastic", "sharding.enable",
                    "sharding.stage", "sharding.sharding_degree", "sharding.offload",
                    "pipeline.pp_degree", "pipeline.virtual_stages", "pipeline.split_points",
                    "pipeline.schedule_mode", "tensor_parallel.tensor_parallel_degree")
SWITCHABLE = ("data_parallel.reduce", "data_parallel.adasum_on", "data_parallel.adasum_lr",
              "data_parallel.powersgd_rank", "data_parallel.start_powersgd_iter",
              "data_parallel.bucket_cap_mb", "data_parallel.find_unused_parameters",
              *(f"localsgd.{k}" for k in ("enable", "k_steps", "begin_step", "averaging")),
              *(f"adaptive_localsgd.{k}" for k in ("enable", "init_k_steps", "begin_step")),
              *(f"sync_switch.{k}" for k in ("threshold", "window_steps", "k_steps")),
              *(f"adaptive.{k}" for k in ("batch_size", "min_batch_size", "max_batch_size",
                                          "interval_steps", "gain_threshold", "noise_scale",
                                          "gns_ema", "gns_warmup_steps", "policies")))
"""Communication and adaptive keys a resume may change (issue 40); see the docstring."""
STATEFUL_REDUCES = ("dgc",)
ALLOWED_STRATEGY = ALLOWED_STRATEGY + SWITCHABLE
ALLOWED = ALLOWED_CONFIG + ALLOWED_STRATEGY
_SHOWN = 4  # differing keys named in the message; the rest are counted


def _flat(strategy: Strategy) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, body in strategy.to_dict().items()
            for key, value in body.items()}


def _text(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 30 else text[:27] + "..."


def differences(config: Any, strategy: Strategy, ckpt: dict, default_model: str
                ) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, requested value) of every setting that differs and may not."""
    saved = ckpt.get("config") or {}
    diffs = []
    for key, value in config.to_dict().items():
        if key in ALLOWED_CONFIG or key not in saved:
            continue
        old = saved[key]
        if key == "model":
            old, value = old or default_model, value or default_model
        if old != value:
            diffs.append((key, old, value))
    if isinstance(ckpt.get("strategy"), dict):
        try:
            before = _flat(Strategy.from_dict(ckpt["strategy"]))
        except ConfigError as e:
            raise CheckpointError(f"the checkpoint's strategy is not one this version reads: "
                                  f"{e}") from None
        now = _flat(strategy)
        for key in sorted(set(before) | set(now), key=list({**before, **now}).index):
            if key not in ALLOWED_STRATEGY and before.get(key) != now.get(key):
                diffs.append((key, before.get(key), now.get(key)))
        old_r, new_r = before.get("data_parallel.reduce"), now.get("data_parallel.reduce")
        if old_r != new_r and (old_r in STATEFUL_REDUCES or new_r in STATEFUL_REDUCES):
            diffs.append(("data_parallel.reduce", old_r, new_r))
    return diffs


def check_resume(config: Any, strategy: Strategy, ckpt: dict, name: str, default_model: str,
                 total_steps: int | None = None) -> None:
    """ConfigError (one line) when the requested run is not a continuation of checkpoint
    `ckpt` (file `name`): a setting outside `ALLOWED` differs, or the training length
    `total_steps` (schedule steps) ends before the checkpoint."""
    diffs = differences(config, strategy, ckpt, default_model)
    if diffs:
        shown = ", ".join(f"{k} {_text(a)} -> {_text(b)}" for k, a, b in diffs[:_SHOWN])
        more = f" and {len(diffs) - _SHOWN} more" if len(diffs) > _SHOWN else ""
        raise ConfigError(
            f"--resume: these settings differ from checkpoint {name}: {shown}{more}; a resume "
            "may change only the training length, checkpoint/log/eval cadence, nan_policy, "
            "data_parallel.timeout_s, (with batch.elastic) the number of workers, the reduce "
            "between mean/fp16/bf16/adasum/powersgd, local SGD and the measuring [adaptive] "
            "keys; start a new run for the rest (another --out, or --overwrite)")
    done = ckpt.get("engine", {}).get("progress", ckpt.get("step", 0))
    if total_steps is not None and total_steps < done:
        what = (f"--steps {config.steps}" if config.steps is not None else
                f"--epochs {config.epochs:g} ({total_steps} steps)" if config.epochs is not None
                else f"the recipe's length ({total_steps} steps)")
        raise ConfigError(f"--resume: {what} ends before checkpoint {name}, taken at step "
                          f"{ckpt.get('step', done)}; a resume can only extend training")


def _lr(value: float) -> str:
    return f"{value:.4g}"


def schedule_change_line(clock: Any, ckpt: dict) -> str | None:
    """The one line a resume prints when its training length differs from the
    checkpoint's run: the decay now spans the new total, and the LR of the first step
    after the checkpoint moves from the old schedule's value to the new one's. None when
    the length is the same (or the checkpoint does not record it)."""
    old = ckpt.get("total_steps")
    if old is None:  # a checkpoint from before total_steps was saved: its --steps, if given
        old = (ckpt.get("config") or {}).get("steps")
    new = int(clock.total_steps)
    if old is None or int(old) == new:
        return None
    old = int(old)
    step = int(ckpt.get("step", 0)) + 1
    head = f"the schedule now decays over {new} steps (was {old})"
    try:
        before = dataclasses.replace(clock.schedule, total_steps=old).lr(clock.progress)
    except (ConfigError, TypeError):  # warmup longer than the old length: no old LR to show
        return f"{head}; the LR at step {step} is {_lr(clock.last_lr)}"
    before *= clock.lr_scale
    after = clock.lr_at(clock.progress)
    if _lr(before) == _lr(after):
        return f"{head}; the LR at step {step} stays {_lr(after)}"
    return f"{head}: the LR jumps from {_lr(before)} to {_lr(after)} at step {step}"
