"""The `[adaptive]` section on the engine: noise-scale tracking, AdaScale, goodput batch size.

`attach(run)` builds one `Adaptive` controller from the Strategy and plugs it
into the `Run`: a grad hook (each taken step, after unscale, before the
optimizer), a step hook (after the step, between steps: batch-size changes)
and `run.state_objects["adaptive"]` (state_dict and stats). The estimators
themselves are the pure modules `bigbatch.adaptive.gns`, `bigbatch.adaptive.adascale` and
`bigbatch.adaptive.goodput`; this file only feeds them.

Where the two squared norms of a step come from (only scalars cross the network):

- several workers: each worker's gradient before the all-reduce (measured in
  the engine's DDP comm hook, one scalar all-reduce) vs the reduced gradient;
- one worker with gradient merge: the first micro-step vs the merged gradient;
- a pipeline: the first micro-batch vs the step, each summed over the stages
  (`bigbatch.engine.pipeline_gns`; one scalar all-reduce over the pipeline);
- one worker, no merge: two consecutive steps (`ConsecutiveSteps`), marked biased.

With ``optimizer.type = "adamw"`` (AdamW, LAMB) every norm is of the
preconditioned gradient ``g / (sqrt(v_hat) + eps)`` and AdaScale's LR gain is
taken to the power 0.5 (AdamScale).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from bigbatch.adaptive.adascale import AdaScale
from bigbatch.adaptive.gns import ConsecutiveSteps, GradientNoiseScale, sq_norm
from bigbatch.adaptive.goodput import GoodputTuner, Suggestion
from bigbatch.config.schedules import growth_of
from bigbatch.engine.local_norms import install_local_norms, preconditioned_grads
from bigbatch.errors import ConfigError

if TYPE_CHECKING:
    from bigbatch.engine.batch import BatchControl
    from bigbatch.engine.clock import ScheduleClock
    from bigbatch.engine.grad_info import GradInfo
    from bigbatch.engine.merge import MergeWindow

__all__ = ["Adaptive", "attach", "check", "schedule_steps"]

log = logging.getLogger("bigbatch.adaptive")

MAX_BATCH_FACTOR = 32
"""Without `adaptive.max_batch_size`, goodput may grow the global batch this many times."""
DEFAULT_WARMUP = {False: 0, True: 10}
"""`adaptive.gns_warmup_steps` unset, for raw and for Adam/LAMB-preconditioned gradients:
the preconditioner's second moments hold a few gradients only after some steps."""
_FLUSH_EVERY = 64  # pending per-step norms kept on the device before one host transfer


def _switched_on(a: Any) -> list[str]:
    on = []
    if a.noise_scale:
        on.append("adaptive.noise_scale=true")
    if a.lr == "adascale":
        on.append('adaptive.lr="adascale"')
    if a.goodput:
        on.append('adaptive.batch_size="goodput"')
    if "noise_scale_doubling" in a.policies:
        on.append('adaptive.policies=["noise_scale_doubling"]')
    return on


def check(strategy: Any, plan: Any = None) -> bool:
    """Validate `[adaptive]` against the rest of the strategy; True when it is active."""
    a = getattr(strategy, "adaptive", None)
    on = _switched_on(a) if a is not None else []
    if growth_of(strategy) == "adaptive":
        on.append(f'batch.schedule="{strategy.batch.schedule}"')  # it follows the noise scale
    if not on:
        return False
    if getattr(strategy.data_parallel, "reduce", "mean") == "adasum":
        raise ConfigError(
            f"data_parallel.reduce='adasum' cannot be combined with {on[0]}: the noise scale "
            "needs the mean of the workers' gradients; use reduce='mean'"
        )
    if a.goodput and plan is not None:
        _goodput_limits(a, plan)
    return True


def _goodput_limits(a: Any, plan: Any) -> tuple[int, int]:
    hi = a.max_batch_size or max(plan.global_batch_size, a.min_batch_size or 0) * MAX_BATCH_FACTOR
    lo = a.min_batch_size or min(plan.global_batch_size, hi)
    if lo > hi:
        raise ConfigError(f"adaptive.min_batch_size={lo} is larger than adaptive.max_batch_size={hi}")
    return lo, hi


def schedule_steps(strategy: Any, world_size: int, samples_per_epoch: int,
                   epochs: float, unit_batch_size: int | None = None) -> tuple[int, int]:
    """`(total_steps, steps_per_epoch)` to pass to `prepare()` for `epochs` epochs.

    Steps of `unit_batch_size` samples (default: the configured global batch; on
    resume, the checkpoint's `run.unit_batch_size`); with AdaScale, scale-1 steps
    (steps of `batch.base_batch_size`), which is what its progress counts.
    """
    unit = unit_batch_size or unit_of(strategy, strategy.resolve(world_size))
    spe = max(1, samples_per_epoch // unit)
    return max(1, round(epochs * spe)), spe


def unit_of(strategy: Any, plan: Any) -> int:
    """Samples of one schedule step: the global batch, or the base batch under AdaScale."""
    adascale = getattr(strategy, "adaptive", None) is not None and strategy.adaptive.lr == "adascale"
    return strategy.batch.base_batch_size if adascale else plan.global_batch_size


def preconditioned(strategy: Any) -> bool:
    """Whether the noise scale is of ``g / (sqrt(v_hat) + eps)`` (`adaptive.gns_gradient`)."""
    choice = strategy.adaptive.gns_gradient
    if choice != "auto":
        return choice == "preconditioned"
    grows = growth_of(strategy) == "adaptive"
    return strategy.optimizer.type == "adamw" and not grows


class _Consecutive(ConsecutiveSteps):
    """`ConsecutiveSteps` whose stored gradient is part of the checkpoint (exact resume)."""

    def state_dict(self) -> dict[str, Any]:
        prev = None if self._prev is None else [t.clone() for t in self._prev]
        prev_sq = None if self._prev_sq is None else self._prev_sq.clone()
        return {"prev": prev, "prev_sq": prev_sq}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        prev = state["prev"]
        self._prev = None if prev is None else [t.to(device).clone() for t in prev]
        sq = state["prev_sq"]
        self._prev_sq = None if sq is None else sq.to(device).clone()


class Adaptive:
    """Per-step glue between a `Run` and the noise-scale tracker, AdaScale and the tuner.

    Public: `tracker` (`GradientNoiseScale`), `adascale` (`AdaScale` or None),
    `tuner` (`GoodputTuner` or None), `last_suggestion`, `estimate_log` (set to
    a list to receive every step's estimate), `measure_step_time` (False: feed
    `tuner` yourself), `limit_batch_size()`, `decide()`, `stats()`.
    """

    def __init__(self, strategy: Any, optimizer: torch.optim.Optimizer, world: Any,
                 clock: ScheduleClock, window: MergeWindow, batch: BatchControl) -> None:
        a = strategy.adaptive
        self.config = a
        self._optimizer = optimizer
        self._world = world
        self._clock = clock
        self._window = window
        self._batch = batch
        self.preconditioned = preconditioned(strategy)
        """Norms of ``g / (sqrt(v) + eps)`` (AdamW, LAMB) instead of ``g``."""
        self._batch_grows = growth_of(strategy) != "fixed"
        self.tracker = GradientNoiseScale(a.gns_ema)
        self.warmup_steps = (a.gns_warmup_steps if a.gns_warmup_steps is not None
                             else DEFAULT_WARMUP[self.preconditioned])
        """Optimizer steps whose estimates the tracker never sees (`adaptive.gns_warmup_steps`)."""
        self.adascale: AdaScale | None = None
        if a.lr == "adascale":
            power = 0.5 if strategy.optimizer.type == "adamw" else 1.0  # AdamScale
            self.adascale = AdaScale(strategy.batch.base_batch_size, batch.plan.global_batch_size,
                                     power=power)
        self.tuner: GoodputTuner | None = None
        if a.goodput:
            # Limits from the configured batch, not from one a resume restored (`prepare(plan=)`).
            try:
                configured = strategy.resolve(world.world_size)
            except ConfigError:
                configured = batch.plan
            lo, hi = _goodput_limits(a, configured)
            self.tuner = GoodputTuner(strategy.batch.base_batch_size, min_batch_size=lo,
                                      max_batch_size=hi,
                                      max_micro_batch_size=configured.micro_batch_size,
                                      threshold=a.gain_threshold)
        self.last_suggestion: Suggestion | None = None
        self.estimate_log: list[dict[str, float]] | None = None
        """When a list: each step's (step, sq_norm, trace, small_batch, big_batch) is appended."""
        self.measure_step_time = True
        """Record the engine's step times in `tuner` (tests feed synthetic ones instead)."""
        self._consecutive = _Consecutive()
        self._pending: list[tuple[int, Any, Any, float, float, float]] = []
        self._warm = 1  # steps whose time is not recorded (first step, after a change)
        self.batch_limit = 2**62
        """The largest global batch any policy may choose (`limit_batch_size`)."""

    # ------------------------------------------------------------- per step

    def on_grads(self, info: GradInfo) -> None:
        """Grad hook: this step's norm pair; with AdaScale, the gain for this step's LR."""
        self._measure(info)
        if self.adascale is not None:
            self.flush()
            t = self.tracker
            scale = self.adascale.update(t.sq_norm, t.trace)
            self._clock.set_gain(scale, self.adascale.last_gain)

    def _measure(self, info: GradInfo) -> None:
        optimizer, window = self._optimizer, self._window
        if self.preconditioned and not optimizer.state:
            return  # no second moments before the first step: nothing to precondition with
        opt_factor = 1.0 if window.avg else float(window.k_steps)  # avg=false: k x the mean
        if info.has_local_sq_norm:
            self._source(biased=False)
            if info.big_sq_norm is not None:  # a pipeline's: summed over its stages
                big = info.big_sq_norm
            elif self.preconditioned:
                big = sq_norm(preconditioned_grads(optimizer, info.params,
                                                   [p.grad for p in info.params]))
            else:
                big = info.global_sq_norm()
            # Item counts of count= losses stay on the device (read at flush, with the norms).
            small_b, big_b = info.local_batch, info.global_batch
            if isinstance(small_b, torch.Tensor) or isinstance(big_b, torch.Tensor) or (
                    0 < small_b < big_b):
                # The GradInfo itself: its local norm's all-reduce is waited for at flush.
                self._pending.append((info.step, info, big, small_b, big_b, opt_factor**2))
        else:
            self._source(biased=True)
            if self.preconditioned:
                grads = preconditioned_grads(optimizer, info.params,
                                             [p.grad for p in info.params])
            else:
                grads = info.grads()
            pair = self._consecutive(grads, float(info.global_batch))
            if pair is not None:
                self._pending.append((info.step, *pair, opt_factor**2))
        if len(self._pending) >= _FLUSH_EVERY:
            self.flush()

    def _source(self, biased: bool) -> None:
        if self.tracker.biased == biased:
            return
        if self.tracker.steps:
            self.flush()
            log.info("noise scale: source changed to %s; the estimates restart",
                     "consecutive steps (biased)" if biased else "local vs global gradients")
            self.tracker = GradientNoiseScale(self.config.gns_ema, biased=biased,
                                              window=self.tracker.window)
        self.tracker.biased = biased

    def flush(self) -> None:
        """Fold the pending per-step norms into the tracker (one host transfer)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        pending = [(row[0], row[1].local_sq_norm, *row[2:]) if hasattr(row[1], "local_sq_norm")
                   else row for row in pending]
        tensors = [x for row in pending for x in row[1:5] if isinstance(x, torch.Tensor)]
        values = iter(torch.stack([t.detach().to(torch.float64).reshape(())
                                   for t in tensors]).tolist() if tensors else [])
        for step, *row, factor in pending:
            small, big, small_b, big_b = (next(values) if isinstance(x, torch.Tensor) else x
                                          for x in row)
            if not 0 < small_b < big_b or step < self.warmup_steps:
                continue  # no smaller batch to compare, or the estimator is warming up
            est = self.tracker.update(small / factor, big / factor, small_b, big_b)
            if self.estimate_log is not None:
                self.estimate_log.append({"step": step, "sq_norm": est.sq_norm,
                                          "trace": est.trace, "small_batch": small_b,
                                          "big_batch": big_b})

    def on_step(self, run: Any) -> None:
        """Goodput's step (the ``goodput`` policy's `after_step`): record the step time;
        every `interval_steps`, decide."""
        if self.measure_step_time:
            if self._warm > 0:
                self._warm -= 1
            else:
                self.tuner.record(run.plan.micro_batch_size, run.k_steps, run.world.world_size,
                                  run.last_step_seconds)
        if run.step % self.config.interval_steps == 0:
            self.decide()

    # ------------------------------------------------------------- batch size

    def decide(self) -> Suggestion:
        """Ask the tuner now; apply a change. Every worker applies rank 0's decision."""
        self.flush()
        batch, world, step = self._batch, self._world, self._clock.step
        s = self.tuner.suggest(batch.plan.micro_batch_size, self._window.k_steps,
                               world.world_size, self.tracker.b_simple)
        if world.is_distributed and dist.is_initialized():
            box = [s]
            dist.broadcast_object_list(box, src=0)
            s = box[0]
        self.last_suggestion = s
        if s.changed:
            old = batch.plan
            batch.set(s.micro_batch_size, s.k_steps)
            entry = {"step": step, "old": old.global_batch_size,
                     "new": batch.plan.global_batch_size, "micro_batch_size": s.micro_batch_size,
                     "k_steps": s.k_steps, "reason": s.reason}
            batch.changes.append(entry)
            if world.is_main:
                log.info("step %d: %s", step, s.reason)
        else:
            log.debug("step %d: %s", step, s.reason)
        return s

    def on_batch_change(self) -> None:
        """A `BatchControl` listener (goodput's decisions, policies, an elastic resume)."""
        if self.adascale is not None:  # batch.scaling is "none": its gain scales the LR
            self.adascale.set_batch_size(self._batch.plan.global_batch_size)
        self._consecutive.reset()
        self._warm = 1

    def limit_batch_size(self, max_global: int) -> None:
        """Cap the global batch goodput (or another policy) may choose (e.g. at the
        training-set size)."""
        self.batch_limit = max(1, min(self.batch_limit, int(max_global)))
        if self.tuner is not None:
            self.tuner.max_batch_size = max(1, min(self.tuner.max_batch_size, int(max_global)))
            self.tuner.min_batch_size = min(self.tuner.min_batch_size, self.tuner.max_batch_size)

    # ------------------------------------------------------------- reporting, resume

    def stats(self) -> dict[str, float]:
        """Numbers for `run.stats` (finite ones only; none before the first estimate)."""
        self.flush()
        t, plan, out = self.tracker, self._batch.plan, {}
        if t.steps:
            for key, value in (("gns", t.b_simple), ("gns_stderr", t.b_simple_stderr),
                               ("gns_sq_norm", t.sq_norm), ("gns_trace", t.trace)):
                if math.isfinite(value):
                    out[key] = float(value)
            out["gns_biased"] = float(t.biased)
        if self.adascale is not None:
            out["adascale_gain"] = float(self.adascale.last_gain)
        if self.adascale is not None or self.tuner is not None:
            out["progress"] = float(self._clock.progress)
        if (self.tuner is not None or "noise_scale_doubling" in self.config.policies
                or self._batch_grows):
            out["global_batch_size"] = float(plan.global_batch_size)
            out["micro_batch_size"] = float(plan.micro_batch_size)
            out["k_steps"] = float(self._window.k_steps)
        return out

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {
            "tracker": self.tracker.state_dict(),
            "adascale": None if self.adascale is None else self.adascale.state_dict(),
            "tuner": None if self.tuner is None else self.tuner.state_dict(),
            "batch_size_changes": [dict(c) for c in self._batch.changes],
            "consecutive": self._consecutive.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        batch = self._batch
        self._pending = []
        self.tracker.load_state_dict(state["tracker"])
        if self.adascale is not None and state.get("adascale") is not None:
            self.adascale.load_state_dict(state["adascale"])
            self.adascale.set_batch_size(batch.plan.global_batch_size)
        if self.tuner is not None and state.get("tuner") is not None:
            self.tuner.load_state_dict(state["tuner"])
        batch.changes[:] = [dict(c) for c in state.get("batch_size_changes", [])]
        self._consecutive.load_state_dict(state["consecutive"], self._world.device)
        self._warm = 1


def attach(run: Any) -> Adaptive:
    """Build the controller for `run.strategy.adaptive` and register its hooks on `run`
    (goodput's step runs as the ``goodput`` policy, `bigbatch.engine.policies`)."""
    ctl = Adaptive(run.strategy, run.optimizer, run.world, run.clock, run.window, run.batch)
    if run.pipeline is not None:  # micro-batch 0 against the step, summed over the stages
        from bigbatch.engine.pipeline_gns import PipelineNorms

        run.pipeline_norms = PipelineNorms(run, ctl.preconditioned)
    else:
        install_local_norms(run.window, run.comm, run.optimizer, run.params,
                            run.world.device, ctl.preconditioned)
    run.batch.listeners.append(ctl.on_batch_change)
    run.grad_hooks.insert(0, ctl.on_grads)  # first: AdaScale sets this step's LR scale
    if ctl.tuner is not None:
        run.sync_timing = True
    run.state_objects["adaptive"] = ctl
    run.adaptive = ctl
    return ctl
