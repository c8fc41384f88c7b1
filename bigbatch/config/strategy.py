"""Strategy: the one typed config, Fleet-style sections, TOML in and out.

Each TOML section is a frozen dataclass whose attribute names are the TOML
keys, which follow PaddlePaddle Fleet's ``DistributedStrategy`` names
(``lars_coeff``, ``exclude_from_weight_decay``, ``k_steps``, ``avg``,
``init_loss_scaling``, ...)::

    [batch]
    global_batch_size = 4096
    micro_batch_size = 64
    base_lr = 0.1
    warmup_epochs = 5

    [lars]                      # a present section switches the strategy on
    lars_coeff = 0.001
    exclude_from_weight_decay = ["bn", "bias"]

A present section (or ``enable = true``) switches a strategy on,
``enable = false`` switches it off; fields of a disabled section are still
validated. Every user mistake raises :class:`bigbatch.errors.ConfigError` with
one line naming the key, the value and what is allowed.
"""

import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from bigbatch.config.compat import check
from bigbatch.config.fields import (
    parse_literal,
    read_toml_source,
    unknown_key_message,
)
from bigbatch.config.muon_section import MuonConfig
from bigbatch.config.overview import strategy_overview
from bigbatch.config.scaling import scale_factor, scale_lr
from bigbatch.config.schedules import NOISE_SCALE_FRACTIONS, growth_of
from bigbatch.config.sections import (
    KEYS,
    SECTIONS,
    AdaptiveConfig,
    AdaptiveLocalSGDConfig,
    AmpConfig,
    BatchConfig,
    DataParallelConfig,
    DGCConfig,
    GradientMergeConfig,
    KfacConfig,
    LambConfig,
    LarsConfig,
    LocalSGDConfig,
    OptimizerConfig,
    ParameterServerConfig,
    PipelineConfig,
    RecomputeConfig,
    ShardingConfig,
    StragglerConfig,
    SyncSwitchConfig,
    TensorParallelConfig,
    is_optional,
    section_from_dict,
    unknown_section_message,
)
from bigbatch.errors import ConfigError

__all__ = [
    "AdaptiveConfig",
    "AmpConfig",
    "BatchConfig",
    "BatchPlan",
    "DataParallelConfig",
    "GradientMergeConfig",
    "LambConfig",
    "LarsConfig",
    "OptimizerConfig",
    "RecomputeConfig",
    "Strategy",
    "StragglerConfig",
]


WARMUP_KEYS = ("batch.warmup_steps", "batch.warmup_epochs")

FILE_KEYS = {"task": "the built-in task the file was written for, e.g. task = \"charlm\""}
"""Top-level keys a strategy file may hold besides its sections: what `bigbatch train`
reads from the file (`bigbatch.cli.train`); the Strategy itself ignores them."""


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic and peak LR resolved for one world size."""

    global_batch_size: int
    """Samples per optimizer step, all workers and micro-steps together."""
    micro_batch_size: int
    """Samples per worker per micro-step."""
    k_steps: int
    """Micro-steps merged per optimizer step (1 without gradient merge)."""
    world_size: int
    """Number of data-parallel workers."""
    scale: float
    """global_batch_size / base_batch_size."""
    peak_lr: float
    """base_lr scaled by the batch rule: the LR after warmup."""


def _off(cls: type) -> Any:
    return field(default_factory=lambda: cls(enable=False))


@dataclass(frozen=True)
class Strategy:
    """All of a run's large-batch settings; ``Strategy()`` is plain momentum SGD."""

    batch: BatchConfig = field(default_factory=BatchConfig)
    """[batch]: batch sizes, LR scaling rule, warmup and decay."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """[optimizer]: inner optimizer (momentum or adamw)."""
    lars: LarsConfig = _off(LarsConfig)
    """[lars]: LARS on top of momentum (off by default)."""
    lamb: LambConfig = _off(LambConfig)
    """[lamb]: LAMB on top of adamw (off by default)."""
    muon: MuonConfig = _off(MuonConfig)
    """[muon]: Muon for hidden matrices, adamw for the rest (off by default)."""
    gradient_merge: GradientMergeConfig = _off(GradientMergeConfig)
    """[gradient_merge]: k micro-steps per optimizer step (off by default)."""
    amp: AmpConfig = _off(AmpConfig)
    """[amp]: mixed precision (off by default)."""
    recompute: RecomputeConfig = _off(RecomputeConfig)
    """[recompute]: activation checkpointing (off by default)."""
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    """[data_parallel]: DDP settings (used when world_size > 1)."""
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """[adaptive]: AdaScale, goodput batch size, noise scale (all off by default)."""
    sharding: ShardingConfig = _off(ShardingConfig)
    """[sharding]: ZeRO stages 1-3 over the data-parallel ranks (off by default)."""
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    """[tensor_parallel]: Megatron-style tensor parallelism (degree 1: off)."""
    pipeline: PipelineConfig = _off(PipelineConfig)
    """[pipeline]: pipeline parallelism (off by default)."""
    kfac: KfacConfig = _off(KfacConfig)
    """[kfac]: K-FAC preconditioning before momentum SGD or LARS (off by default)."""
    dgc: DGCConfig = _off(DGCConfig)
    """[dgc]: deep gradient compression (off by default; also data_parallel.reduce = "dgc")."""
    localsgd: LocalSGDConfig = _off(LocalSGDConfig)
    """[localsgd]: local SGD with model averaging every k steps (off by default)."""
    adaptive_localsgd: AdaptiveLocalSGDConfig = _off(AdaptiveLocalSGDConfig)
    """[adaptive_localsgd]: local SGD with an adaptive interval (off by default)."""
    parameter_server: ParameterServerConfig = _off(ParameterServerConfig)
    """[parameter_server]: server and worker ranks on torch.distributed.rpc (off by default)."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """[straggler]: straggler detection, used with adaptive.policies = ["straggler"]."""
    sync_switch: SyncSwitchConfig = field(default_factory=SyncSwitchConfig)
    """[sync_switch]: all-reduce <-> local SGD, used with adaptive.policies = ["sync_switch"]."""

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, section_from_dict(cls, value))
            elif not isinstance(value, cls):
                raise ConfigError(f"[{name}] must be a {cls.__name__}, got {type(value).__name__}")
        check(self)  # settings that cannot go together: bigbatch.config.compat

    # -- dict / TOML -----------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Strategy":
        """Build from ``{section: {key: value}}`` as TOML loads it; validates everything."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a strategy must be a table of sections, got {type(d).__name__}")
        sections = {}
        for name, body in d.items():
            if name in FILE_KEYS:
                if not isinstance(body, str):
                    raise ConfigError(f"`{name}` must be a string ({FILE_KEYS[name]}), "
                                      f"got {body!r}")
                continue
            if name not in SECTIONS:
                raise ConfigError(unknown_section_message(name, isinstance(body, Mapping)))
            if not isinstance(body, Mapping):
                fleet = "enable = true, " if "enable" in KEYS[name] else ""
                raise ConfigError(
                    f"`{name}` must be a section: write [{name}] with its keys "
                    f"({fleet}...), got {body!r}"
                )
            sections[name] = section_from_dict(SECTIONS[name], body)
        return cls(**sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}`` with every field; unset (None) fields are left out."""
        out: dict[str, dict[str, Any]] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            out[name] = {
                k: list(v) if isinstance(v, tuple) else v
                for k in KEYS[name]
                if (v := getattr(section, k)) is not None
            }
        return out

    @classmethod
    def from_toml(cls, path_or_text: str | os.PathLike) -> "Strategy":
        """Load from a TOML file path or from TOML text."""
        source, text = read_toml_source(path_or_text)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{source}: invalid TOML: {e}") from None
        return cls.from_dict(data)

    def to_toml(self) -> str:
        """TOML text with every section and field; ``from_toml(s.to_toml()) == s``."""
        return tomli_w.dumps(self.to_dict())

    def with_overrides(self, overrides: Iterable[str]) -> "Strategy":
        """A copy with ``"section.key=value"`` overrides applied (the CLI's ``--set``).

        Values are TOML literals (``4096``, ``0.002``, ``true``, ``["bn", "bias"]``,
        ``"x"``); a bare word is a string (``amp.dtype=bfloat16``) and ``none``
        unsets an optional key. As writing a key in a TOML section would, setting
        a key of a switchable section turns that section on unless the same
        overrides also set its ``enable``. Setting one of ``batch.warmup_steps`` and
        ``batch.warmup_epochs`` unsets the other (unless the same overrides set both).
        """
        d = self.to_dict()
        touched, enables, keys = set(), set(), set()
        for item in overrides:
            key, eq, raw = item.partition("=")
            section, dot, name = key.strip().partition(".")
            if not eq or not dot or not name:
                raise ConfigError(f"override {item!r} must look like section.key=value")
            if section not in SECTIONS:
                raise ConfigError(unknown_section_message(section))
            if name not in KEYS[section]:
                raise ConfigError(unknown_key_message(section, name, KEYS))
            value = parse_literal(raw.strip())
            if value in ("none", "null") and is_optional(section, name):
                d[section].pop(name, None)
            else:
                d[section][name] = value
            touched.add(section)
            keys.add(f"{section}.{name}")
            if name == "enable":
                enables.add(section)
        for one, other in (WARMUP_KEYS, WARMUP_KEYS[::-1]):  # a warmup replaces the other kind
            if one in keys and other not in keys:
                d["batch"][other.partition(".")[2]] = type(getattr(BatchConfig(), other[6:]))(0)
        for section in touched - enables:
            if "enable" in KEYS[section]:
                d[section]["enable"] = True
        return Strategy.from_dict(d)

    # -- derived numbers ---------------------------------------------------------------

    def resolve(self, world_size: int) -> BatchPlan:
        """Batch sizes, merge steps and peak LR for ``world_size`` workers at the start.

        ``global = micro x k_steps x world_size``; any two of global, micro and
        k_steps determine the third (k_steps is 1 without [gradient_merge]).
        With neither batch size set, the global batch is ``base_batch_size``.
        Under a growing ``batch.schedule`` (`growth_of`) the run starts at `start_plan`,
        and this configured plan (`ceiling`) is the largest it grows to.
        """
        ceiling = self.ceiling(world_size)
        return ceiling if growth_of(self) == "fixed" else self.start_plan(ceiling)

    def start_plan(self, ceiling: BatchPlan) -> BatchPlan:
        """The first plan of a growing batch: ``batch.start_batch_size`` (default the
        recipe's ``base_batch_size``, rounded up to a multiple of the workers and at most
        the ceiling) over the ceiling's workers, with a micro batch no
        larger than the ceiling's (memory). On one worker the start batch is two merged
        micro-steps where it can be, so the noise scale compares a micro-step's gradient
        with the step's (unbiased) instead of consecutive steps (biased)."""
        b, w = self.batch, ceiling.world_size
        start = b.start_batch_size
        if start is None:  # the recipe's batch, on every worker, within the ceiling
            start = min(self._base_on_workers(w), ceiling.global_batch_size)
        if start > ceiling.global_batch_size:
            raise ConfigError(f"batch.start_batch_size={start} is larger than the ceiling "
                              f"batch.global_batch_size={ceiling.global_batch_size}")
        if start % w:
            raise ConfigError(f"batch.start_batch_size={start} is not divisible by the "
                              f"{w} data-parallel workers; use a multiple of {w}")
        per_worker = start // w
        micro = min(ceiling.micro_batch_size, per_worker)
        if w == 1 and micro == per_worker and per_worker % 2 == 0 and not self.pipeline.enable:
            micro = per_worker // 2
        if per_worker % micro:
            raise ConfigError(f"batch.start_batch_size={start} is not a multiple of the micro "
                              f"batch {micro} x {w} workers; use a multiple of {micro * w}")
        return self.batch_plan(start, micro, per_worker // micro, w)

    def _base_on_workers(self, world_size: int) -> int:
        """The recipe's base batch rounded up to a multiple of the workers: a growing
        batch's default start (before the ceiling caps it)."""
        return -(-self.batch.base_batch_size // world_size) * world_size

    def ceiling(self, world_size: int) -> BatchPlan:
        """The configured plan for ``world_size`` workers: the plan of a fixed batch, the
        largest a growing one (``batch.schedule``) reaches. See `resolve`."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        b, w = self.batch, world_size
        merge = self.gradient_merge.enable
        g, m = b.global_batch_size, b.micro_batch_size
        k = self.gradient_merge.k_steps if merge else 1
        if self.pipeline.enable:  # micro-batches through the pipeline are the merge
            merge, k = True, self.pipeline.accumulate_steps
            m = self.pipeline.micro_batch_size or m
            if k is None and m is None:
                k = 4 * self.pipeline.pp_degree  # a bubble of (p-1)/(5p-1), under a fifth
        if g is None and m is None:
            g = b.base_batch_size
        if k is None and (g is None or m is None):
            k = 1
        if g is None:
            g = m * k * w
        elif m is None:
            if g % (k * w):
                raise ConfigError(
                    f"batch.global_batch_size={g} is not divisible by k_steps {k} x "
                    f"world_size {w} = {k * w}"
                )
            m = g // (k * w)
        elif k is None:
            if g % (m * w):
                raise ConfigError(
                    f"batch.global_batch_size={g} is not a multiple of micro_batch_size {m} x "
                    f"world_size {w} = {m * w}"
                )
            k = g // (m * w)
        elif g != m * k * w:
            hint = ""
            if not merge and g > m * w and g % (m * w) == 0:
                hint = (f"; to merge {g // (m * w)} micro-steps add --set gradient_merge."
                        f"k_steps={g // (m * w)} (in a file: [gradient_merge] k_steps = "
                        f"{g // (m * w)}), or set batch.global_batch_size={m * k * w}")
            raise ConfigError(
                f"batch.global_batch_size={g} is not micro_batch_size {m} x k_steps {k} x "
                f"world_size {w} = {m * k * w}{hint}"
            )
        return self.batch_plan(g, m, k, w)

    def batch_plan(self, global_batch_size: int, micro_batch_size: int, k_steps: int,
                   world_size: int) -> BatchPlan:
        """The plan of these sizes: scale and peak LR by ``batch.scaling`` (no checks); under
        the adaptive schedule, from its start batch on by ``batch.growth_scaling``.

        Adasum with ``data_parallel.adasum_lr = "worker"`` (Horovod's rule): the LR of one
        worker's batch, since Adasum does not average the workers' contributions."""
        b = self.batch
        scale = global_batch_size / b.base_batch_size
        dp = self.data_parallel
        lr_scale = scale
        if dp.reduce == "adasum" and dp.adasum_lr == "worker":
            lr_scale = scale / world_size
        peak = scale_lr(b.base_lr, lr_scale, b.scaling)
        if b.growth_scaling != b.scaling and growth_of(self) == "adaptive":
            # from the start batch on, each doubling follows growth_scaling (both rules
            # are powers of the batch, so this swaps one rule's factor for the other's)
            start = b.start_batch_size or self._base_on_workers(world_size)
            grown = global_batch_size / start
            peak *= scale_factor(grown, b.growth_scaling) / scale_factor(grown, b.scaling)
        return BatchPlan(int(global_batch_size), int(micro_batch_size), int(k_steps),
                         int(world_size), scale, peak)

    def overview(
        self,
        world_size: int,
        *,
        steps_per_epoch: int | None = None,
        total_steps: int | None = None,
        lr_find: Mapping[str, Any] | None = None,
    ) -> str:
        """Fleet-style "DistributedStrategy Overview" table plus the derived numbers
        (`lr_find`: the range test's record, `bigbatch.train.lr_phase.FoundLR.to_dict()`).

        Plain ASCII, 80 columns: reads the same in a terminal and in a log file.
        """
        return strategy_overview(self, world_size, steps_per_epoch=steps_per_epoch,
                                 total_steps=total_steps, lr_find=lr_find)

    def max_grad_norm(self) -> float | None:
        """The global-norm clip in force: optimizer.max_grad_norm, or its alias
        lamb.max_grad_norm when [lamb] is on."""
        if self.lamb.enable and self.lamb.max_grad_norm is not None:
            return self.lamb.max_grad_norm
        return self.optimizer.max_grad_norm

    @property
    def nesterov(self) -> bool:
        """Nesterov momentum in force: optimizer.nesterov, or when unset, on for LARS
        with momentum > 0 (`OptimizerConfig.nesterov` says why)."""
        o = self.optimizer
        if o.nesterov is not None:
            return o.nesterov
        return self.lars.enable and o.momentum > 0

    @property
    def lr_find_steps(self) -> int:
        """The range test's sweep length in force: batch.lr_find_steps, or when unset, 15
        for momentum SGD and LARS, 30 for AdamW and LAMB (`BatchConfig.lr_find_steps`)."""
        steps = self.batch.lr_find_steps
        return steps if steps is not None else 30 if self.optimizer.type == "adamw" else 15

    @property
    def noise_scale_fraction(self) -> float:
        """The adaptive batch's fraction in force: batch.noise_scale_fraction, or when unset,
        1.25 for momentum SGD and LARS, 0.0075 for AdamW and LAMB
        (`BatchConfig.noise_scale_fraction`)."""
        f = self.batch.noise_scale_fraction
        return f if f is not None else NOISE_SCALE_FRACTIONS[self.optimizer.type]

    def in_force(self) -> dict[str, Any]:
        """The values the unset keys with family defaults take (`nesterov`,
        `lr_find_steps`, `noise_scale_fraction`): what `to_dict()` leaves as None."""
        return {"optimizer.nesterov": self.nesterov, "batch.lr_find_steps": self.lr_find_steps,
                "batch.noise_scale_fraction": self.noise_scale_fraction}

    def optimizer_name(self) -> str:
        """The optimizer the engine builds: ``LARS``, ``LAMB``, ``Muon``, ``momentum`` or ``adamw``
        (``K-FAC + momentum``, ``K-FAC + LARS`` with [kfac])."""
        if self.kfac.enable:
            return "K-FAC + " + ("LARS" if self.lars.enable else self.optimizer.type)
        if self.lars.enable:
            return "LARS"
        if self.lamb.enable:
            return "LAMB"
        if self.muon.enable:
            return "Muon"
        return self.optimizer.type
