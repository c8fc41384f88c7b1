"""The sections that lay a run out over workers: `[data_parallel]` and how gradients
travel (`[dgc]`, `[localsgd]`, `[adaptive_localsgd]`, `[parameter_server]`), and the
large-model layout (`[sharding]`, `[tensor_parallel]`, `[pipeline]`)."""

from dataclasses import dataclass
from typing import ClassVar

from bigbatch.config.limits import MAX_TIMEOUT_S
from bigbatch.config.section_base import _f, _Section
from bigbatch.errors import ConfigError

REDUCES = ("mean", "adasum", "fp16", "bf16", "powersgd", "dgc")


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
    adasum_on: str = _f("auto", choices=("auto", "gradient", "delta"))
    """reduce = "adasum": what is combined. delta: each worker steps its optimizer on its own
    gradient and the weight changes are Adasum-reduced (Horovod's Adasum optimizer); gradient:
    the gradients are (the paper's rule for momentum SGD); auto: delta for optimizer.type =
    "adamw" (AdamW, LAMB), gradient for "momentum" (SGD, LARS)."""
    adasum_lr: str = _f("worker", choices=("worker", "global"))
    """reduce = "adasum": the peak LR. worker: batch.scaling applied to one worker's batch
    (Horovod's documented rule: the best single-worker LR, not scaled by the worker count);
    global: applied to the global batch, as for the mean."""
    powersgd_rank: int = _f(2, ge=1)
    """reduce = "powersgd": rank of the low-rank approximation of each gradient matrix."""
    start_powersgd_iter: int = _f(10, ge=2)
    """reduce = "powersgd": optimizer steps of plain mean before compression starts (torch's
    PowerSGD needs >= 2: its error feedback starts from an uncompressed step)."""
    timeout_s: float = _f(300.0, gt=0, le=MAX_TIMEOUT_S)
    """Collective (and rendezvous) timeout in seconds, at most a week."""
    find_unused_parameters: bool = _f(False)
    """Let a step leave some parameters without a gradient on a worker (a branch one rank
    does not take). Under DDP (no sharding, stage 1) DDP walks each step's graph to find
    them (its find_unused_parameters; slower); under stage 2-3 FSDP2 reduces a zero
    gradient for each parameter of a block that ran but that a rank did not use (torch
    2.13 or newer; refused on an older torch). A block one rank skips whole still ends the
    run (FSDP2 gathers its parameters in forward on every rank). Off: such a step ends the
    run with a line naming them."""


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
    (post-local SGD, Lin et al. 2020; torch's PeriodicModelAverager), all together or
    pairwise on a hypercube (`bigbatch.parallel.pairwise_averaging`)."""

    section: ClassVar[str] = "localsgd"

    enable: bool = _f(True)
    """Switch local SGD on (a present [localsgd] section means true)."""
    k_steps: int = _f(1, ge=1)
    """Local optimizer steps between model averages."""
    begin_step: int = _f(1, ge=1)
    """Steps 1..begin_step are synchronous data parallelism; local steps follow."""
    averaging: str = _f("all", choices=("all", "pairwise"))
    """Who averages at each average: "all" (every worker's mean, an all-reduce) or
    "pairwise" (each worker with one peer, rank XOR 2^(j mod log2 N) at the j-th average:
    point-to-point sends of one model, no all-reduce; KungFu's pairwise averaging in a
    fixed order; N must be a power of two)."""


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
    mode: str = _f("sync", choices=("sync", "async", "geo"))
    """sync: a step waits for every worker's gradient (equals data parallelism); async: each
    gradient is applied as it arrives (Fleet's a_sync); geo: each worker steps its own copy
    with the strategy's optimizer for geo_k_steps steps, then the servers add every worker's
    delta (its weights minus the last pulled, divided by the worker count) and the workers
    pull (Fleet's GEO-SGD, a_sync_configs.k_steps > 0)."""
    servers: int = _f(1, ge=1)
    """Ranks 0..servers-1 hold parameter shards; the other ranks are workers."""
    max_staleness: int = _f(4, ge=0)
    """async: a gradient computed on weights more than this many server updates old is
    dropped and counted."""
    geo_k_steps: int = _f(4, ge=1)
    """geo: local optimizer steps between two exchanges with the servers (Fleet's
    a_sync_configs.k_steps); the last round of a run may be shorter."""


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
    tensor_init_seed: int | None = _f(None, ge=0)
    """Seed of the model's initial weights (Fleet's tensor_init_seed); unset: the run's
    --seed. Every rank builds the whole model from it and then slices it, so the initial
    weights are the same whatever the degree (one process included); the data order and
    the other RNG streams follow --seed."""


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
