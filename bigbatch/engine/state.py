"""What a `Run` reports (`Run.stats`), saves (`Run.state_dict`) and restores
(`Run.load_state_dict`): optimizer, loss scaler, schedule position, batch plan,
the stateful helpers, and a merge window caught mid-way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bigbatch.config.elastic import BatchState, configured_sizes, resume_plan
from bigbatch.errors import ConfigError
from bigbatch.parallel.world import gather

if TYPE_CHECKING:
    from bigbatch.engine.clock import ScheduleClock


def stats(clock: ScheduleClock, scaler: Any, grad_norm: torch.Tensor | None,
          optimizer: torch.optim.Optimizer, helpers: list[Any]) -> dict[str, float]:
    """`Run.stats`: the clock's counters, the loss scale, the grad norm, trust ratios and
    each helper's `stats()`."""
    out: dict[str, float] = {
        "step": float(clock.step),
        "lr": float(clock.last_lr),
        "skipped_steps": float(clock.skipped_steps),
        "loss_scale": scaler.scale_value if scaler is not None else 1.0,
    }
    if grad_norm is not None:
        out["grad_norm"] = float(grad_norm)
    ratios_of = getattr(optimizer, "trust_ratios", None)
    ratios = ratios_of() if callable(ratios_of) else None
    if ratios is not None and ratios.numel():
        r = ratios.detach().float()
        out["trust_ratio_min"] = float(r.min())
        out["trust_ratio_median"] = float(r.median())
        out["trust_ratio_max"] = float(r.max())
    for obj in helpers:
        stats_of = getattr(obj, "stats", None)
        if callable(stats_of):
            out.update(stats_of())
    return out


def optimizer_state(optimizer: torch.optim.Optimizer, world: Any,
                    sharded: bool) -> dict[str, Any] | None:
    """The optimizer's state dict, or None where it is not this rank's to give.

    Sharded or sliced runs (DTensor parameters, `sharded`) leave it to DCP
    (`bigbatch.train.sharded`), which saves each rank's shards. ZeRO stage 1 gathers
    it to rank 0: a collective, so every rank calls this; only rank 0 gets it.
    """
    if sharded:
        return None
    consolidate = getattr(optimizer, "consolidate_state_dict", None)
    if consolidate is not None and world.is_distributed:
        consolidate(to=0)
        if not world.is_main:
            return None
    return optimizer.state_dict()


def state_dict(run: Any, comm: Any) -> dict[str, Any]:
    """`Run.state_dict()`: each part's state, in the checkpoint's flat layout."""
    window = run.window.state_dict()
    state: dict[str, Any] = {
        "optimizer": optimizer_state(run.optimizer, run.world, run.mesh.degrees.sharded_state),
        "scaler": run.scaler.state_dict() if run.scaler is not None else None,
        **run.clock.state_dict(),
        "micro": window.pop("micro"),
        "k_steps": window.pop("k_steps"),
        "batch": BatchState(
            run.plan.global_batch_size, run.plan.micro_batch_size, run.k_steps,
            run.mesh.data_degree, run.unit_batch_size, configured_sizes(run.strategy),
        ).to_dict(),
        "extra": {name: obj.state_dict() for name, obj in run.state_objects.items()},
        **window,
    }
    if comm is not None and (saved := comm.state_dict()) is not None:
        # Per-worker memory (error feedback, residuals): every rank's, by rank.
        state["comm"] = gather(saved, run.world)
    return state


def load_state_dict(run: Any, state: dict[str, Any], comm: Any) -> None:
    """`Run.load_state_dict()`: helpers first, then the elastic batch plan, then counters."""
    for name, sub in state.get("extra", {}).items():
        if name in run.state_objects:
            run.state_objects[name].load_state_dict(sub)
    plan, saved = run.plan, state.get("batch")
    if saved is not None:
        saved = BatchState.from_dict(saved)
        run.clock.unit_batch_size = saved.unit_batch_size
        plan = resume_plan(run.strategy, run.mesh.data_degree, saved)
    moved = saved is not None and saved.world_size != plan.world_size
    if state["micro"] and (int(state["k_steps"]) != plan.k_steps or moved):
        raise ConfigError(
            f"checkpoint taken mid-merge-window with k_steps={state['k_steps']}; it resumes "
            f"only with the same k_steps and world size (this run: k_steps={plan.k_steps}, "
            f"world_size={plan.world_size})"
        )
    if state["optimizer"] is not None:  # else loaded from the sharded checkpoint
        run.optimizer.load_state_dict(state["optimizer"])
    if run.scaler is not None and state.get("scaler") is not None:
        run.scaler.load_state_dict(state["scaler"])
    run.clock.load_state_dict(state, run.strategy)
    run.window.reset()
    if (plan.global_batch_size, plan.micro_batch_size, plan.k_steps) != (
            run.plan.global_batch_size, run.plan.micro_batch_size, run.k_steps):
        run.set_batch(plan.micro_batch_size, plan.k_steps)
    elif saved is not None and (run.adaptive is None or run.adaptive.adascale is None):
        run.clock.progress_rate = plan.global_batch_size / run.unit_batch_size
    saved_comm = state.get("comm")
    if saved_comm is not None and comm is not None and len(saved_comm) == run.world.world_size:
        comm.load_state_dict(saved_comm[run.world.rank])  # another world size starts afresh
    run.window.load_window(state)
    run.window.load_micro_batch_sizes(state.get("micro_batch_sizes"), run.mesh.data_degree)
    run.clock.apply()
