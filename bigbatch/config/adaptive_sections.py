"""The sections of adaptive training: `[adaptive]` (noise scale, AdaScale, goodput,
elasticity, policies), `[straggler]` and `[sync_switch]`."""

import re
from dataclasses import dataclass
from typing import ClassVar

from bigbatch.adaptive.straggler import ACTIONS as STRAGGLER_ACTIONS
from bigbatch.config.section_base import _f, _Section
from bigbatch.errors import ConfigError

BUILTIN_POLICIES = ("goodput", "noise_scale_doubling", "straggler", "sync_switch")
_POLICY_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class AdaptiveConfig(_Section):
    """``[adaptive]``: adaptive learning rate / batch size and noise-scale tracking."""

    section: ClassVar[str] = "adaptive"

    lr: str = _f("none", choices=("none", "adascale"))
    """adascale: LR gain from gradient statistics (Johnson et al. 2020); needs batch.scaling = "none"."""
    batch_size: str = _f("fixed", choices=("fixed", "goodput"))
    """goodput: choose the global batch size during training (Pollux/AdaptDL)."""
    min_batch_size: int | None = _f(None, ge=1)
    """Smallest global batch goodput may pick; unset: the configured global batch."""
    max_batch_size: int | None = _f(None, ge=1)
    """Largest global batch goodput may pick; unset: no limit beyond memory."""
    interval_steps: int = _f(100, ge=1)
    """Optimizer steps between adaptive decisions."""
    gain_threshold: float = _f(0.05, ge=0)
    """Relative goodput gain needed to change the batch size."""
    noise_scale: bool = _f(False)
    """Track the gradient noise scale (GNS) and report it."""
    gns_ema: float = _f(0.95, ge=0, lt=1)
    """EMA decay of the gradient-statistics estimators."""
    gns_gradient: str = _f("auto", choices=("auto", "raw", "preconditioned"))
    """Whose noise scale: raw, the gradient itself (McCandlish et al. measured Adam-trained
    models this way); preconditioned, g / (sqrt(v) + eps) as AdamW/LAMB's next update sees
    it (AdaptDL's choice for AdaScale and goodput). auto: preconditioned for AdamW/LAMB,
    except under batch.schedule = "adaptive", whose rule is McCandlish's critical batch
    (on charlm the preconditioned one was 100x the batch AdamW keeps its quality at)."""
    gns_warmup_steps: int | None = _f(None, ge=0)
    """Optimizer steps at the start whose noise estimates are dropped (nothing reads the
    noise scale before the first estimate after them). Unset: 10 for AdamW/LAMB, whose
    preconditioner g / (sqrt(v) + eps) means little while v holds a few gradients; 0
    for momentum SGD and LARS."""
    policies: tuple[str, ...] = _f(())
    """Policies run around the training loop (`bigbatch.Policy`): the built-in "goodput"
    (= batch_size "goodput"), "noise_scale_doubling" (KungFu's: double the batch as the
    noise scale doubles, up to max_batch_size), "straggler" (see [straggler]), "sync_switch"
    (local SGD while communication dominates a step; see [sync_switch]), or your own as
    "package.module:Class"."""

    @property
    def goodput(self) -> bool:
        """Whether goodput chooses the batch (`batch_size` or `policies`)."""
        return self.batch_size == "goodput" or "goodput" in self.policies

    @property
    def active(self) -> bool:
        """Whether the noise scale is tracked (anything that reads it is switched on)."""
        return (self.lr != "none" or self.goodput or self.noise_scale
                or "noise_scale_doubling" in self.policies)

    def _check(self) -> None:
        lo, hi = self.min_batch_size, self.max_batch_size
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(
                f"adaptive.min_batch_size={lo} is larger than adaptive.max_batch_size={hi}"
            )
        seen = set()
        for spec in self.policies:
            if spec not in BUILTIN_POLICIES and not _POLICY_PATH.fullmatch(spec):
                raise ConfigError(
                    f"adaptive.policies: {spec!r} is neither a built-in policy "
                    f"({', '.join(BUILTIN_POLICIES)}) nor \"package.module:Class\"")
            if spec in seen:
                raise ConfigError(f"adaptive.policies names {spec!r} twice")
            seen.add(spec)
        if self.goodput and "noise_scale_doubling" in self.policies:
            raise ConfigError('adaptive.policies: "noise_scale_doubling" and goodput both choose '
                              "the global batch; keep one of them")


@dataclass(frozen=True)
class StragglerConfig(_Section):
    """``[straggler]``: find a rank that computes slower than the others, and act. On with
    ``[adaptive] policies = ["straggler"]`` (`bigbatch.engine.straggler`)."""

    section: ClassVar[str] = "straggler"

    interval_steps: int = _f(20, ge=1)
    """Optimizer steps per window: each window, every rank's compute, data-wait and sync
    times are gathered (scalars only)."""
    threshold: float = _f(1.5, gt=1)
    """A rank is slow in a window when its compute time exceeds this times the median of
    the other ranks'."""
    patience: int = _f(3, ge=1)
    """Consecutive slow windows before a rank is flagged."""
    action: str = _f("warn", choices=STRAGGLER_ACTIONS)
    """warn: log and record it; rebalance: slower ranks get smaller micro batches, faster
    ones larger (the global batch and the step stay exact); stop: checkpoint and exit with
    status 75 so that a scheduler can restart the job without the node."""
    max_micro_factor: float = _f(2.0, ge=1)
    """rebalance: the largest micro batch a rank may get, as a multiple of the even one
    (a faster rank's memory)."""


@dataclass(frozen=True)
class SyncSwitchConfig(_Section):
    """``[sync_switch]``: move between all-reduce and local SGD while the job runs, by the
    measured share of a step that communication takes. On with ``[adaptive] policies =
    ["sync_switch"]`` (`bigbatch.engine.sync_switch`)."""

    section: ClassVar[str] = "sync_switch"

    threshold: float = _f(0.5, gt=0, lt=1)
    """Above this share of a step spent communicating, switch to local SGD; at or below
    it (estimated from the time of one model average), back to all-reduce."""
    window_steps: int = _f(20, ge=1)
    """Optimizer steps per measurement; a switch happens only at a window's end."""
    k_steps: int = _f(4, ge=1)
    """Local SGD: steps between model averages (H)."""
