"""The section dataclasses of a Strategy: one per Fleet-style TOML section.

Public through :mod:`bigbatch.config.strategy`; attribute names are the TOML keys and
each field's metadata holds its validation rules.
"""

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from bigbatch.adaptive.straggler import ACTIONS as STRAGGLER_ACTIONS
from bigbatch.config.elastic import ELASTIC_MODES
from bigbatch.config.fields import check_fields, closest, unknown_key_message
from bigbatch.config.limits import MAX_TIMEOUT_S
from bigbatch.config.scaling import RULES
from bigbatch.config.schedules import DECAYS, WARMUP_STARTS
from bigbatch.errors import ConfigError

REDUCES = ("mean", "adasum", "fp16", "bf16", "powersgd", "dgc")
BUILTIN_POLICIES = ("goodput", "noise_scale_doubling", "straggler")
_POLICY_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def _f(default: Any, **rules: Any) -> Any:
    """A dataclass field whose metadata holds its validation rules.

    Rules: ``choices`` (tuple of allowed strings), ``ge``/``gt``/``le``/``lt``
    (numeric bounds); see ``bigbatch.config.fields.check_fields``.
    """
    return field(default=default, metadata=rules)


@dataclass(frozen=True)
class _Section:
    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_fields(self, self.section)
        self._check()

    def _check(self) -> None:
        """Checks across fields of one section (after types and ranges)."""


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
        ms = self.decay_milestones
        if any(not 0 < m < 1 for m in ms) or any(a >= b for a, b in zip(ms, ms[1:], strict=False)):
            raise ConfigError(
                f"batch.decay_milestones must be strictly increasing fractions in (0, 1), "
                f"got {list(ms)}"
            )
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
    nesterov: bool = _f(False)
    """Nesterov momentum (momentum SGD and LARS)."""
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
        if self.type == "momentum" and self.nesterov and self.momentum == 0:
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
    """Parameter-name substrings with no weight decay and no trust ratio (Fleet's rule:
    e.g. ["norm", "bias"]); a pattern that matches nothing is warned about. Unset: every
    tensor with ndim <= 1 (biases, norm gains) is excluded; [] excludes nothing."""
    trust_clip: bool = _f(False)
    """Clip the trust ratio at 1 (LARC-style)."""
    always_adapt: bool = _f(False)
    """Apply the trust ratio also to excluded parameters."""


@dataclass(frozen=True)
class LambConfig(_Section):
    """``[lamb]``: layer-wise adaptive moments on top of AdamW (You et al. 2019)."""

    section: ClassVar[str] = "lamb"

    enable: bool = _f(True)
    """Switch LAMB on (a present [lamb] section means true)."""
    lamb_weight_decay: float = _f(0.01, ge=0)
    """Decoupled weight decay inside the LAMB update (replaces optimizer.weight_decay)."""
    exclude_from_weight_decay: tuple[str, ...] | None = _f(None)
    """Parameter-name substrings with no weight decay and no trust ratio (Fleet's rule:
    e.g. ["norm", "bias"]); a pattern that matches nothing is warned about. Unset: every
    tensor with ndim <= 1 (biases, norm gains) is excluded; [] excludes nothing."""
    max_grad_norm: float | None = _f(None, gt=0)
    """NVIDIA's LAMB pre-normalisation, g / max(1, |g| / max_grad_norm): the same clipping
    as optimizer.max_grad_norm (set one of the two)."""
    trust_clip: bool = _f(False)
    """Clip the trust ratio at 1."""
    always_adapt: bool = _f(False)
    """Apply the trust ratio also to excluded parameters."""


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
class DataParallelConfig(_Section):
    """``[data_parallel]``: DistributedDataParallel over the torchrun environment."""

    section: ClassVar[str] = "data_parallel"

    backend: str = _f("auto", choices=("auto", "gloo", "nccl"))
    """Process-group backend; auto: nccl on GPU, gloo on CPU."""
    bucket_cap_mb: float = _f(25.0, gt=0, le=1e6)
    """DDP gradient bucket size in MiB."""
    sync_batch_norm: bool = _f(False)
    """Convert BatchNorm layers to SyncBatchNorm (statistics over all workers)."""
    reduce: str = _f("mean", choices=REDUCES)
    """How worker gradients combine: mean (all-reduce average), adasum, fp16 or bf16 (the mean
    sent at half precision), powersgd (low-rank with error feedback) or dgc (top-k, see [dgc])."""
    powersgd_rank: int = _f(2, ge=1)
    """reduce = "powersgd": rank of the low-rank approximation of each gradient matrix."""
    start_powersgd_iter: int = _f(10, ge=2)
    """reduce = "powersgd": optimizer steps of plain mean before compression starts (torch's
    PowerSGD needs >= 2: its error feedback starts from an uncompressed step)."""
    timeout_s: float = _f(300.0, gt=0, le=MAX_TIMEOUT_S)
    """Collective (and rendezvous) timeout in seconds, at most a week."""


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
    policies: tuple[str, ...] = _f(())
    """Policies run around the training loop (`bigbatch.Policy`): the built-in "goodput"
    (= batch_size "goodput"), "noise_scale_doubling" (KungFu's: double the batch as the
    noise scale doubles, up to max_batch_size), "straggler" (see [straggler]), or your
    own as "package.module:Class"."""

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
class ShardingConfig(_Section):
    """``[sharding]``: ZeRO-style sharding of the model's state over data-parallel ranks
    (Rajbhandari et al. 2020), on torch's ZeroRedundancyOptimizer and FSDP2."""

    section: ClassVar[str] = "sharding"

    enable: bool = _f(True)
    """Switch sharding on (a present [sharding] section means true)."""
    stage: int = _f(3, ge=1, le=3)
    """1: optimizer state (ZeroRedundancyOptimizer over DDP); 2: + gradients (FSDP2, whole
    parameters kept between forward and backward); 3: + parameters (FSDP2 fully_shard)."""
    sharding_degree: int | None = _f(None, ge=1)
    """Ranks that share one replica's state; the data-parallel degree must be a multiple
    (replicas = data degree / sharding degree, HSDP). Unset: all data-parallel ranks."""
    offload: bool = _f(False)
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
    CPUOffloadPolicy; stages 2 and 3)."""

    def _check(self) -> None:
        if self.enable and self.offload and self.stage == 1:
            raise ConfigError("sharding.offload=true needs sharding.stage 2 or 3 (FSDP2's "
                              "offload policy); stage 1 keeps parameters on the device")


@dataclass(frozen=True)
class TensorParallelConfig(_Section):
    """``[tensor_parallel]``: Megatron-style slicing of layers over ranks (DTensor plans)."""

    section: ClassVar[str] = "tensor_parallel"

    tensor_parallel_degree: int = _f(1, ge=1)
    """Ranks that hold slices of one layer; 1: off. The data-parallel degree is
    world size / tensor_parallel_degree."""


SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "PipeDream")


@dataclass(frozen=True)
class PipelineConfig(_Section):
    """``[pipeline]``: the model split into stages on successive ranks, each micro-batch
    flowing through them (GPipe, 1F1B, interleaved 1F1B on torch.distributed.pipelining;
    PipeDream's asynchronous schedule)."""

    section: ClassVar[str] = "pipeline"

    enable: bool = _f(True)
    """Switch pipelining on (a present [pipeline] section means true)."""
    pp_degree: int = _f(2, ge=1)
    """Pipeline stages (ranks along the pipeline)."""
    schedule_mode: str = _f("1F1B", choices=SCHEDULES)
    """GPipe (all forwards, then all backwards), 1F1B, Interleaved1F1B (virtual_stages
    chunks per rank), or PipeDream (asynchronous, weight stashing; not the big batch)."""
    accumulate_steps: int | None = _f(None, ge=1)
    """Micro-batches per optimizer step (Fleet's name; replaces gradient_merge.k_steps).
    Unset: derived from the batch sizes, or 4 x pp_degree when no micro batch is set."""
    micro_batch_size: int | None = _f(None, ge=1)
    """Samples per micro-batch (as batch.micro_batch_size). Unset: derived."""
    virtual_stages: int = _f(1, ge=1)
    """Stages per rank (Interleaved1F1B only)."""
    split_points: tuple[str, ...] = _f(())
    """Layer names where stages begin (all but the first stage's); empty: balanced by
    parameter count."""
    vertical_sync: bool = _f(False)
    """PipeDream: every stage uses the weight version stage 0 used for a micro-batch."""

    def _check(self) -> None:
        if not self.enable:
            return
        if self.virtual_stages > 1 and self.schedule_mode != "Interleaved1F1B":
            raise ConfigError(
                f"pipeline.virtual_stages={self.virtual_stages} needs schedule_mode = "
                f'"Interleaved1F1B" (schedule_mode "{self.schedule_mode}" has one stage per rank)')
        if self.vertical_sync and self.schedule_mode != "PipeDream":
            raise ConfigError('pipeline.vertical_sync needs schedule_mode = "PipeDream"')
        stages = self.pp_degree * self.virtual_stages
        if self.split_points and len(self.split_points) != stages - 1:
            raise ConfigError(
                f"pipeline.split_points names {len(self.split_points)} layers; "
                f"{stages} stages need {stages - 1} (where stages 2..{stages} begin)")


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
    factor_update_freq: int = _f(1, ge=1)
    """Optimizer steps between factor updates (each collects all the step's micro-steps)."""
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

    def check_with(self, strategy: Any) -> None:
        """What K-FAC does not combine with: an Adam-type inner optimizer, and parallel
        forms that split a layer's gradient or activations (called by Strategy)."""
        if not self.enable:
            return
        if strategy.optimizer.type != "momentum":
            inner = "[lamb]" if strategy.lamb.enable else f'optimizer.type = "{strategy.optimizer.type}"'
            raise ConfigError(f'[kfac] needs momentum SGD or [lars] inside it; {inner} is not '
                              'supported (set optimizer.type = "momentum")')
        split = ("[sharding]" if strategy.sharding.enable else "[pipeline]"
                 if strategy.pipeline.enable else "tensor parallelism"
                 if strategy.tensor_parallel.tensor_parallel_degree > 1 else None)
        if split is not None:
            raise ConfigError(f"[kfac] with {split}: K-FAC needs every layer's whole gradient "
                              "and activations on each rank; use plain data parallelism")


@dataclass(frozen=True)
class DGCConfig(_Section):
    """``[dgc]``: deep gradient compression (Lin et al. 2018): each worker sends only the
    largest entries of its momentum-corrected, locally accumulated gradient (a present
    section switches it on, as does data_parallel.reduce = "dgc")."""

    section: ClassVar[str] = "dgc"

    enable: bool = _f(True)
    """Switch DGC on (a present [dgc] section means true)."""
    rampup_begin_step: int = _f(0, ge=0)
    """Optimizer steps of dense exchange (exactly momentum SGD) before sparsification starts."""
    rampup_step: int = _f(1, ge=1)
    """Steps over which the sparsity walks through `sparsity` (equal shares per entry)."""
    sparsity: tuple[float, ...] = _f((0.999,), ge=0, lt=1)
    """Share of each tensor's entries held back per step, warming up entry by entry; the
    last one stays."""
    min_numel: int = _f(16384, ge=0)
    """Tensors with fewer elements are all-reduced whole with plain momentum (Fleet's rule,
    16384; the paper likewise leaves biases and BatchNorm uncompressed)."""

    def _check(self) -> None:
        if not self.sparsity:
            raise ConfigError("dgc.sparsity is empty; give at least one share in [0, 1), "
                              "e.g. [0.75, 0.9375, 0.999]")


@dataclass(frozen=True)
class LocalSGDConfig(_Section):
    """``[localsgd]``: workers step alone and average their models every k_steps steps
    (post-local SGD, Lin et al. 2020; torch's PeriodicModelAverager)."""

    section: ClassVar[str] = "localsgd"

    enable: bool = _f(True)
    """Switch local SGD on (a present [localsgd] section means true)."""
    k_steps: int = _f(1, ge=1)
    """Local optimizer steps between model averages."""
    begin_step: int = _f(1, ge=1)
    """Steps 1..begin_step are synchronous data parallelism; local steps follow."""


@dataclass(frozen=True)
class AdaptiveLocalSGDConfig(_Section):
    """``[adaptive_localsgd]``: local SGD whose averaging interval follows the loss and LR
    (Fleet's rule: k = ceil(sqrt(lr_0 loss / (lr loss_0) x init_k_steps)), 1 <= k <= 16)."""

    section: ClassVar[str] = "adaptive_localsgd"

    enable: bool = _f(True)
    """Switch adaptive local SGD on (a present section means true)."""
    init_k_steps: int = _f(1, ge=1)
    """Local steps before the first average; later intervals follow the rule."""
    begin_step: int = _f(1, ge=1)
    """Steps 1..begin_step are synchronous data parallelism; local steps follow."""


@dataclass(frozen=True)
class ParameterServerConfig(_Section):
    """``[parameter_server]``: server ranks hold the parameters and apply the optimizer,
    worker ranks pull parameters and push gradients (torch.distributed.rpc)."""

    section: ClassVar[str] = "parameter_server"

    enable: bool = _f(True)
    """Switch the parameter-server mode on (a present section means true)."""
    mode: str = _f("sync", choices=("sync", "async"))
    """sync: a step waits for every worker's gradient (equals data parallelism); async: each
    gradient is applied as it arrives (Fleet's a_sync)."""
    servers: int = _f(1, ge=1)
    """Ranks 0..servers-1 hold parameter shards; the other ranks are workers."""
    max_staleness: int = _f(4, ge=0)
    """async: a gradient computed on weights more than this many server updates old is
    dropped and counted."""


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


SECTIONS: dict[str, type[_Section]] = {
    c.section: c
    for c in (
        BatchConfig,
        OptimizerConfig,
        LarsConfig,
        LambConfig,
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
