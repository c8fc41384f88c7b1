"""The section dataclasses of a Strategy: one per Fleet-style TOML section.

Public through :mod:`bigbatch.config.strategy`; attribute names are the TOML keys and
each field's metadata holds its validation rules. This module holds the training
recipe (batch, optimizer, LARS, LAMB, K-FAC, merge, AMP, recompute) and the registry of
every section; the layout over workers is in `parallel_sections`, adaptive training in
`adaptive_sections`.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from bigbatch.config.adaptive_sections import (
    BUILTIN_POLICIES,
    AdaptiveConfig,
    StragglerConfig,
    SyncSwitchConfig,
)
from bigbatch.config.elastic import ELASTIC_MODES
from bigbatch.config.fields import closest, unknown_key_message
from bigbatch.config.muon_section import MuonConfig
from bigbatch.config.parallel_sections import (
    REDUCES,
    SCHEDULES,
    AdaptiveLocalSGDConfig,
    DataParallelConfig,
    DGCConfig,
    LocalSGDConfig,
    ParameterServerConfig,
    PipelineConfig,
    ShardingConfig,
    TensorParallelConfig,
)
from bigbatch.config.scaling import RULES
from bigbatch.config.schedules import BATCH_SCHEDULES, DECAYS, WARMUP_STARTS
from bigbatch.config.section_base import _f, _Section
from bigbatch.errors import ConfigError

MATCHES = ("substring", "suffix")

__all__ = [
    "BUILTIN_POLICIES", "KEYS", "REDUCES", "SCHEDULES", "SECTIONS",
    "AdaptiveConfig", "AdaptiveLocalSGDConfig", "AmpConfig", "BatchConfig",
    "DataParallelConfig", "DGCConfig", "GradientMergeConfig", "KfacConfig", "LambConfig",
    "LarsConfig", "LocalSGDConfig", "OptimizerConfig", "ParameterServerConfig",
    "SyncSwitchConfig",
    "PipelineConfig", "RecomputeConfig", "ShardingConfig", "StragglerConfig",
    "TensorParallelConfig", "is_optional", "section_from_dict", "unknown_section_message",
]


@dataclass(frozen=True)
class BatchConfig(_Section):
    """``[batch]``: batch sizes and the small-batch recipe being scaled."""

    section: ClassVar[str] = "batch"

    global_batch_size: int | None = _f(None, ge=1)
    """Samples per optimizer step over all workers and merged micro-steps.
    Unset: derived as micro_batch_size x k_steps x world_size."""
    micro_batch_size: int | None = _f(None, ge=1)
    """Samples per worker per forward/backward (one micro-step).
    Unset: derived as global_batch_size / (k_steps x world_size)."""
    base_batch_size: int = _f(256, ge=1)
    """Batch size of the small-batch recipe; scale = global_batch_size / base_batch_size.
    When neither batch size is set, the global batch is this one (scale 1)."""
    base_lr: float = _f(0.1, gt=0)
    """Learning rate of the small-batch recipe at base_batch_size."""
    scaling: str = _f("linear", choices=RULES)
    """Batch -> LR rule: linear (x scale, Goyal et al.), sqrt (x sqrt(scale)), none."""
    warmup_steps: int = _f(0, ge=0)
    """Optimizer steps of gradual warmup from base_lr to the scaled peak LR."""
    warmup_epochs: float = _f(0.0, ge=0)
    """Warmup in epochs instead of steps (needs steps_per_epoch at run time)."""
    warmup_start: str = _f("base", choices=WARMUP_STARTS)
    """Where warmup starts: base (base_lr, Goyal et al.'s gradual warmup) or zero
    (lr = peak x (t+1) / (warmup+1), as nanoGPT and most recipes)."""
    decay: str = _f("cosine", choices=DECAYS)
    """Decay after warmup: cosine, poly, step or none."""
    decay_power: float = _f(1.0, gt=0)
    """poly decay: exponent of (1 - progress)."""
    decay_milestones: tuple[float, ...] = _f(())
    """step decay: strictly increasing fractions of training in (0, 1)."""
    decay_gamma: float = _f(0.1, gt=0, le=1)
    """step decay: LR factor applied at each milestone."""
    final_lr_ratio: float = _f(0.0, ge=0, le=1)
    """cosine/poly decay: final LR as a fraction of the peak LR."""
    warmup_scaling: str = _f("none", choices=RULES)
    """How warmup grows with the batch (MLPerf's LARS recipes warm up longer at 64k than at
    3k): warmup_epochs / warmup_steps as written hold at warmup_batch_size and are
    multiplied by the rule's factor of global / warmup_batch_size (linear, sqrt, none),
    at most half the run. Default none: sqrt showed no clear gain for LARS on MNIST-1D at
    8192 (one seed, docs/lr-find-study.md)."""
    warmup_batch_size: int | None = _f(None, ge=1)
    """The global batch the written warmup is for (warmup_scaling); unset: base_batch_size."""
    lr_find: bool = _f(False)
    """Before training, run the LR range test at the global batch on a copy of the initial
    weights (the run's own workers; optimizer state and RNG of the real run untouched),
    then train from the original weights with the suggested peak LR in place of the
    scaled base LR. The suggestion is the LR of the smoothed loss's minimum before it
    diverges, divided by lr_find_safety; with no clear descent the scaled base LR is
    kept with a one-line warning (`bigbatch.train.lr_suggest`). Warmup, decay and
    final_lr_ratio apply to the found peak. The found LR, the curve (lr_find.json in the
    run directory) and the test's time are in the overview, summary.json and the
    checkpoint: a resume never runs the test again. The sweep costs up to lr_find_steps
    steps of the global batch: a fixed cost, under 15% of a run of 150 steps or more, a
    third of a run of 50 (docs/lr-find-study.md)."""
    lr_find_steps: int | None = _f(None, ge=5, le=100_000)
    """lr_find: optimizer steps of the sweep at most (it stops once the loss diverges).
    Unset: 15 for momentum SGD and LARS, 30 for AdamW and LAMB. A shorter sweep finds a
    larger LR: at 15 steps LARS and SGD did as well as at 30 or better (half the cost),
    AdamW and LAMB found LRs 2-4x larger and trained worse, LAMB at 32x diverged
    (docs/lr-find-study.md, benchmarks/NOTES-lr-find.md)."""
    lr_find_range: tuple[float, ...] = _f((0.01, 100.0), gt=0)
    """lr_find: the first and last LR of the sweep as multiples of the scaled base LR."""
    lr_find_safety: float = _f(2.0, ge=1)
    """lr_find: the suggested peak is the smoothed minimum's LR divided by this. 2 beat 1,
    1.5, 3 and 4 for LARS at 32x (benchmarks/NOTES-lr-find.md); per task and batch,
    docs/lr-find-study.md."""
    schedule: str = _f("fixed", choices=BATCH_SCHEDULES)
    """How the global batch moves during the run (docs/auto-batch.md). fixed: the global
    batch throughout. adaptive: start at start_batch_size and double the batch whenever it
    is at most noise_scale_fraction of the measured gradient noise scale (McCandlish et al.
    2018), up to global_batch_size, which becomes the ceiling. seesaw: double it wherever
    the decay halves the LR (Meterez et al. 2025). auto (--auto-batch): adaptive; seesaw
    under [sharding] or tensor parallelism (no worker has the whole gradient to measure the
    noise scale); fixed under a pipeline or the parameter server. On each doubling the peak LR follows
    `growth_scaling` (adaptive) or `scaling` (seesaw); the schedule counts samples, so the
    decay ends with the sample budget."""
    start_batch_size: int | None = _f(None, ge=1)
    """A growing batch's global batch at the start; unset: base_batch_size (the recipe's)
    rounded up to a multiple of the data-parallel degree, at most global_batch_size. Set,
    it must divide by the data-parallel degree."""
    noise_scale_fraction: float | None = _f(None, gt=0, le=16)
    """adaptive: the batch doubles while twice it is at most this times the measured noise
    scale. Unset: 1.25 for momentum SGD and LARS, 0.0075 for AdamW and LAMB. Near 1 the
    batch stays about the critical batch, where a step takes about twice the fewest samples
    (McCandlish et al. 2018): on MNIST-1D (LARS from 512, 2 seeds) 1 took 10.5% of the
    recipe's steps, 1.25 took 9.6% at -0.2 points, 1.5 diverged on one seed. AdamW and LAMB keep their quality only far below the raw
    gradient's noise scale: on charlm 0.05 lost 4.7% in bits per character where 0.0075 kept
    it within 1% on both corpora, in 43-53% fewer steps on the large one
    (benchmarks/NOTES-auto-batch.md)."""
    growth_scaling: str = _f("linear", choices=RULES)
    """adaptive: how the peak LR follows each doubling of the batch, from the start batch's
    peak (a rule of `scaling`'s names). linear: AdamW on charlm's large corpus ended 0.2%
    above the fixed small batch where sqrt ended 1.2% and none 3.0% above it, in the same
    ~44% fewer steps; LARS on MNIST-1D kept its accuracy under either
    (benchmarks/NOTES-auto-batch.md). seesaw follows `scaling` (its rule is defined by it)."""
    schedule_interval_steps: int = _f(10, ge=1)
    """A growing batch: optimizer steps between two decisions on it."""
    elastic: str = _f("keep", choices=ELASTIC_MODES)
    """Resuming on another number of workers: keep the global batch (micro batch or k_steps
    adjust), or scale it with the world size (each worker's micro batch and k_steps kept,
    the peak LR follows `scaling`). See `bigbatch.config.elastic`."""

    def _check(self) -> None:
        if self.warmup_steps and self.warmup_epochs:
            raise ConfigError(
                f"batch.warmup_steps={self.warmup_steps} and batch.warmup_epochs="
                f"{self.warmup_epochs} are both set; set one of them"
            )
        lo_hi = self.lr_find_range
        if len(lo_hi) != 2 or lo_hi[0] >= lo_hi[1]:
            raise ConfigError(
                f"batch.lr_find_range must be two increasing multiples of the scaled LR, "
                f"e.g. [0.01, 100], got {list(lo_hi)}"
            )
        ms = self.decay_milestones
        if any(not 0 < m < 1 for m in ms) or any(a >= b for a, b in zip(ms, ms[1:], strict=False)):
            raise ConfigError(
                f"batch.decay_milestones must be strictly increasing fractions in (0, 1), "
                f"got {list(ms)}"
            )
        start = self.start_batch_size
        if start is not None and self.schedule == "fixed":
            raise ConfigError(f"batch.start_batch_size={start} needs batch.schedule = "
                              '"adaptive", "seesaw" or "auto" (a fixed batch starts at its '
                              "global size)")
        if self.decay == "step" and not ms:
            raise ConfigError(
                'batch.decay_milestones is empty but batch.decay = "step"; '
                "give fractions of training, e.g. [0.5, 0.75]"
            )


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """``[optimizer]``: the inner optimizer that [lars] / [lamb] wrap (Fleet's inner optimizer)."""

    section: ClassVar[str] = "optimizer"

    type: str = _f("momentum", choices=("momentum", "adamw"))
    """momentum (SGD with momentum; LARS wraps it) or adamw (LAMB wraps it)."""
    momentum: float = _f(0.9, ge=0, lt=1)
    """Momentum coefficient (mu) for momentum SGD and LARS."""
    nesterov: bool | None = _f(None)
    """Nesterov momentum (momentum SGD and LARS). Unset: on under [lars] with momentum > 0
    (it kept accuracy at 32-64x the base batch where heavy-ball LARS lost 1-4 points:
    docs/lr-find-study.md), off otherwise (torch's SGD). Fleet's lars_momentum is
    heavy-ball: set false to match it."""
    weight_decay: float = _f(0.0, ge=0)
    """Weight decay of the plain optimizer; must be 0 with [lars]/[lamb], which carry their own."""
    beta1: float = _f(0.9, ge=0, lt=1)
    """Adam first-moment decay (adamw and LAMB)."""
    beta2: float = _f(0.999, ge=0, lt=1)
    """Adam second-moment decay (adamw and LAMB)."""
    epsilon: float = _f(1e-8, ge=0)
    """Adam denominator epsilon (adamw and LAMB)."""
    exclude_from_weight_decay: tuple[str, ...] | None = _f(None)
    """momentum / adamw with weight_decay > 0: parameter-name substrings left undecayed.
    Unset: every tensor with ndim <= 1 (biases, norm gains); [] decays everything."""
    max_grad_norm: float | None = _f(None, gt=0)
    """Clip the global norm of the merged, unscaled gradient to this before any optimizer
    step (momentum, adamw, LARS, LAMB); the pre-clip norm is logged as grad_norm. Unset:
    no clipping. (`lamb.max_grad_norm`, NVIDIA's LAMB pre-normalisation, is the same
    operation and an alias of this key.)"""

    def _check(self) -> None:
        if self.type == "momentum" and self.nesterov is True and self.momentum == 0:
            raise ConfigError("optimizer.nesterov = true needs optimizer.momentum > 0, got 0.0")


@dataclass(frozen=True)
class LarsConfig(_Section):
    """``[lars]``: layer-wise adaptive rate scaling on top of momentum SGD (You et al. 2017)."""

    section: ClassVar[str] = "lars"

    enable: bool = _f(True)
    """Switch LARS on (a present [lars] section means true)."""
    lars_coeff: float = _f(0.001, gt=0)
    """Trust coefficient eta: local_lr = lr * lars_coeff * ||w|| / (||g|| + wd * ||w||)."""
    lars_weight_decay: float = _f(5e-4, ge=0)
    """Weight decay inside the LARS update (replaces optimizer.weight_decay)."""
    epsilon: float = _f(0.0, ge=0)
    """Added to the trust-ratio denominator for numerical safety."""
    exclude_from_weight_decay: tuple[str, ...] | None = _f(None)
    """Parameter-name patterns with no weight decay and no trust ratio (Fleet's rule:
    e.g. ["norm", "bias"]), matched as `exclude_match` says; a pattern that matches
    nothing is warned about. Unset: every tensor with ndim <= 1 (biases, norm gains) is
    excluded; [] excludes nothing."""
    exclude_match: str = _f("substring", choices=MATCHES)
    """How exclude_from_weight_decay patterns match parameter names: substring (Fleet's
    LARS: `pattern in name`) or suffix (`name.endswith(pattern)`)."""
    trust_clip: bool = _f(False)
    """Clip the trust ratio at 1 (LARC-style)."""
    always_adapt: bool = _f(False)
    """Apply the trust ratio also to excluded parameters."""
    adapt_without_weight_decay: bool = _f(True)
    """Apply the trust ratio to tensors whose LARS weight decay is 0. false: Fleet's
    lars_momentum rule, where a tensor with no weight decay (lars_weight_decay = 0, or
    excluded) takes a plain momentum step at the global LR."""

    def _check(self) -> None:
        if self.always_adapt and not self.adapt_without_weight_decay:
            raise ConfigError("lars.always_adapt = true gives excluded tensors a trust ratio, "
                              "lars.adapt_without_weight_decay = false takes it away from "
                              "every tensor without weight decay; set one of them")


@dataclass(frozen=True)
class LambConfig(_Section):
    """``[lamb]``: layer-wise adaptive moments on top of AdamW (You et al. 2019)."""

    section: ClassVar[str] = "lamb"

    enable: bool = _f(True)
    """Switch LAMB on (a present [lamb] section means true)."""
    lamb_weight_decay: float = _f(0.01, ge=0)
    """Decoupled weight decay inside the LAMB update (replaces optimizer.weight_decay)."""
    exclude_from_weight_decay: tuple[str, ...] | None = _f(None)
    """Parameter-name patterns with no weight decay and, unless always_adapt, no trust
    ratio (e.g. ["norm", "bias"]), matched as `exclude_match` says; a pattern that matches
    nothing is warned about. Unset: every tensor with ndim <= 1 (biases, norm gains) is
    excluded; [] excludes nothing. Fleet's lamb keeps the trust ratio of excluded tensors
    and matches names by suffix: always_adapt = true, exclude_match = "suffix"."""
    exclude_match: str = _f("substring", choices=MATCHES)
    """How exclude_from_weight_decay patterns match parameter names: substring
    (`pattern in name`) or suffix (`name.endswith(pattern)`, Fleet's lamb)."""
    bias_correction: bool = _f(True)
    """Divide Adam's moments by 1 - beta^t. false: the moments as they are, as in the
    LAMB equations of Fleet's large-batch guide (r = m / (sqrt(v) + eps))."""
    max_grad_norm: float | None = _f(None, gt=0)
    """NVIDIA's LAMB pre-normalisation, g / max(1, |g| / max_grad_norm): the same clipping
    as optimizer.max_grad_norm (set one of the two)."""
    trust_clip: bool = _f(False)
    """Clip the trust ratio at 1."""
    always_adapt: bool = _f(False)
    """Apply the trust ratio also to excluded parameters (Fleet's lamb does)."""


@dataclass(frozen=True)
class GradientMergeConfig(_Section):
    """``[gradient_merge]``: k micro-steps of gradients per optimizer step."""

    section: ClassVar[str] = "gradient_merge"

    enable: bool = _f(True)
    """Switch gradient merge on (a present section means true); off means k_steps = 1."""
    k_steps: int | None = _f(None, ge=1)
    """Micro-steps merged per optimizer step; unset: derived from the batch sizes."""
    avg: bool = _f(True)
    """true: the merged gradient is the mean over micro-steps; false: the sum."""
    bn_momentum: str = _f("per_micro_step", choices=("per_micro_step", "merged"))
    """BatchNorm running statistics under a merge: per_micro_step (each micro-step's
    update at the layer's momentum m: k updates per optimizer step) or merged (momentum
    1 - (1 - m)^(1/k) per micro-step, so the k updates of one step decay the running
    statistics as one update of the big batch at m would)."""


@dataclass(frozen=True)
class AmpConfig(_Section):
    """``[amp]``: mixed precision via torch.amp autocast (+ GradScaler for float16)."""

    section: ClassVar[str] = "amp"

    enable: bool = _f(True)
    """Switch mixed precision on (a present section means true)."""
    dtype: str = _f("float16", choices=("float16", "bfloat16"))
    """Autocast dtype; bfloat16 runs without loss scaling."""
    init_loss_scaling: float = _f(32768.0, gt=0, le=1e30)  # the scale is a float32
    """Initial loss scale (float16)."""
    incr_every_n_steps: int = _f(1000, ge=1)
    """Grow the scale after this many consecutive finite steps."""
    decr_every_n_nan_or_inf: int = _f(2, ge=1)
    """Shrink the scale after this many steps with inf/nan gradients."""
    incr_ratio: float = _f(2.0, gt=1, le=1e6)
    """Factor by which the scale grows."""
    decr_ratio: float = _f(0.5, gt=0, lt=1)
    """Factor by which the scale shrinks."""
    use_dynamic_loss_scaling: bool = _f(True)
    """false: keep init_loss_scaling fixed (overflow steps are still skipped)."""
    custom_white_list: tuple[str, ...] = _f(())
    """Ops run in the low dtype whatever autocast's own lists say (Fleet's name), e.g.
    ["softmax", "layer_norm"]: torch function names (F.softmax -> "softmax"; Paddle's
    op names matmul_v2, elementwise_add, lookup_table_v2, ... are accepted too)."""
    custom_black_list: tuple[str, ...] = _f(())
    """Ops run in float32 whatever autocast's own lists say (Fleet's name), e.g.
    ["linear", "matmul"]; names as in custom_white_list."""

    def _check(self) -> None:
        both = set(self.custom_white_list) & set(self.custom_black_list)
        if both:
            raise ConfigError(f"amp: {sorted(both)[0]!r} is in both custom_white_list and "
                              "custom_black_list; keep it in one")


@dataclass(frozen=True)
class RecomputeConfig(_Section):
    """``[recompute]``: activation checkpointing of named modules."""

    section: ClassVar[str] = "recompute"

    enable: bool = _f(True)
    """Switch recompute on (a present section means true)."""
    checkpoints: tuple[str, ...] = _f(())
    """Module names (as in model.named_modules()) whose forward is recomputed in backward."""

    def _check(self) -> None:
        if self.enable and not self.checkpoints:
            raise ConfigError(
                "recompute.checkpoints is empty; name the modules to recompute "
                '(as in model.named_modules(), e.g. ["blocks.0", "blocks.1"])'
            )


@dataclass(frozen=True)
class KfacConfig(_Section):
    """``[kfac]``: K-FAC preconditioning (Martens & Grosse 2015; Osawa et al. 2019) of the
    gradients of Linear and convolution layers, before the inner optimizer (momentum SGD or
    LARS). See `bigbatch.optim.kfac` for the maths."""

    section: ClassVar[str] = "kfac"

    enable: bool = _f(True)
    """Switch K-FAC on (a present [kfac] section means true)."""
    damping: float = _f(0.001, gt=0)
    """Tikhonov damping λ, split over both factors as π√λ and √λ/π."""
    factor_decay: float = _f(0.95, ge=0, lt=1)
    """Running average of the factors: new = decay x old + (1 - decay) x this step's."""
    factor_update_freq: int = _f(10, ge=1)
    """Optimizer steps between factor updates (each collects all the step's micro-steps).
    10, as in Pauloski et al.'s examples: on MNIST-1D at 4096, 42 steps to target against
    38 with fresh factors every step and the same accuracy, at 1.15-1.5x an SGD step
    instead of 2.3x (the factor products outweigh a small CNN's forward and backward)."""
    inv_update_freq: int = _f(10, ge=1)
    """Optimizer steps between eigendecompositions of the factors."""
    kl_clip: float = _f(0.001, ge=0)
    """Scale the preconditioned step so that lr^2 g^T F^-1 g <= kl_clip; 0: no clipping."""
    layers: tuple[str, ...] = _f(("Linear", "Conv1d", "Conv2d"))
    """Module types to precondition (Linear, Conv1d, Conv2d); other modules pass through."""
    exclude: tuple[str, ...] = _f(())
    """Module names (as in named_modules()) left unpreconditioned."""

    def _check(self) -> None:
        known = ("Linear", "Conv1d", "Conv2d")
        for name in self.layers:
            if name not in known:
                guess = closest(name, list(known))
                hint = f"; did you mean `{guess}`?" if guess else ""
                raise ConfigError(f"kfac.layers: unknown layer type {name!r}; allowed: "
                                  f"{', '.join(known)}{hint}")


SECTIONS: dict[str, type[_Section]] = {
    c.section: c
    for c in (
        BatchConfig,
        OptimizerConfig,
        LarsConfig,
        LambConfig,
        MuonConfig,
        GradientMergeConfig,
        AmpConfig,
        RecomputeConfig,
        DataParallelConfig,
        AdaptiveConfig,
        ShardingConfig,
        TensorParallelConfig,
        PipelineConfig,
        KfacConfig,
        DGCConfig,
        LocalSGDConfig,
        AdaptiveLocalSGDConfig,
        ParameterServerConfig,
        StragglerConfig,
        SyncSwitchConfig,
    )
}
KEYS = {name: [f.name for f in dataclasses.fields(c)] for name, c in SECTIONS.items()}


def section_from_dict(cls: type[_Section], body: Mapping[str, Any]) -> _Section:
    for key in body:
        if key not in KEYS[cls.section]:
            raise ConfigError(unknown_key_message(cls.section, key, KEYS))
    return cls(**body)


def is_optional(section: str, key: str) -> bool:
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == key)
    return f.default is None


def unknown_section_message(name: str, table: bool = True) -> str:
    """One line for a top-level name that is no section; ``table``: it was written as one."""
    owners = [s for s, keys in KEYS.items() if name in keys]
    if not table:
        where = f"; it belongs in [{owners[0]}]" if owners else ""
        return f"unknown top-level key `{name}`{where} (keys go inside [section] tables)"
    msg = f"unknown section [{name}]"
    base = name.removesuffix("_configs")
    if base != name and base in SECTIONS:
        return f"{msg}; did you mean `[{base}]`? (Fleet's {name} keys go under [{base}])"
    if guess := closest(name, list(SECTIONS)):
        return f"{msg}; did you mean `[{guess}]`?"
    if owners:
        return f"{msg}; `{name}` is a key of [{owners[0]}]"
    return f"{msg}; valid sections: {', '.join(SECTIONS)}"
