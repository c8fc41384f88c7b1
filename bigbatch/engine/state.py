"""What a `Run` reports (`Run.stats`), saves (`Run.state_dict`) and restores
(`Run.load_state_dict`): optimizer, loss scaler, schedule position, batch plan,
the stateful helpers, and a merge window caught mid-way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bigbatch.config.elastic import BatchState, configured_sizes, resume_plan
from bigbatch.errors import ConfigError
from bigbatch.parallel.world import gather

if TYPE_CHECKING:
    from bigbatch.engine.protocol import RunLike


def stats(run: RunLike) -> dict[str, float]:
    """`Run.stats`."""
    out: dict[str, float] = {
        "step": float(run.step),
        "lr": float(run.last_lr),
        "skipped_steps": float(run.skipped_steps),
        "loss_scale": run.scaler.scale_value if run.scaler is not None else 1.0,
    }
    if run._grad_norm is not None:
        out["grad_norm"] = float(run._grad_norm)
    ratios_of = getattr(run.optimizer, "trust_ratios", None)
    ratios = ratios_of() if callable(ratios_of) else None
    if ratios is not None and ratios.numel():
        r = ratios.detach().float()
        out["trust_ratio_min"] = float(r.min())
        out["trust_ratio_median"] = float(r.median())
        out["trust_ratio_max"] = float(r.max())
    helpers = list(run.state_objects.values())
    if run._comm is not None:
        helpers.append(run._comm.inner_state)
    for obj in helpers:
        stats_of = getattr(obj, "stats", None)
        if callable(stats_of):
            out.update(stats_of())
    return out


def optimizer_state(run: RunLike) -> dict[str, Any] | None:
    """The optimizer's state dict, or None where it is not this rank's to give.

    Sharded or sliced runs (DTensor parameters) leave it to DCP (`bigbatch.train.sharded`),
    which saves each rank's shards. ZeRO stage 1 gathers it to rank 0: a collective,
    so every rank calls this; only rank 0 gets it.
    """
    if run.pipeline is not None:
        run.pipeline.settle()  # PipeDream: no update left in flight
    if run.mesh.degrees.uses_mesh:
        return None
    consolidate = getattr(run.optimizer, "consolidate_state_dict", None)
    if consolidate is not None and run.world.is_distributed:
        consolidate(to=0)
        if not run.world.is_main:
            return None
    return run.optimizer.state_dict()


def state_dict(run: RunLike) -> dict[str, Any]:
    """`Run.state_dict()`."""
    run.synchronize()  # local SGD: what is saved is what every worker holds
    state: dict[str, Any] = {
        "optimizer": optimizer_state(run),
        "scaler": run.scaler.state_dict() if run.scaler is not None else None,
        "step": run.step,
        "micro": run.micro,
        "skipped_steps": run.skipped_steps,
        "progress": run.progress,
        "progress_rate": run.progress_rate,
        "lr_scale": run.lr_scale,
        "k_steps": run.k_steps,
        "batch": BatchState(
            run.plan.global_batch_size, run.plan.micro_batch_size, run.k_steps,
            run.mesh.data_degree, run.unit_batch_size, configured_sizes(run.strategy),
        ).to_dict(),
        "extra": {name: obj.state_dict() for name, obj in run.state_objects.items()},
        "micro_batch_sizes": run.micro_batch_sizes,
    }
    if run._comm is not None and (comm := run._comm.state_dict()) is not None:
        # Per-worker memory (error feedback, residuals): every rank's, by rank.
        state["comm"] = gather(comm, run.world)
    if run.micro:
        state["window"] = {
            "mode": run._mode,
            "count": run._count,
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in run._params],
        }
    return state


def load_state_dict(run: RunLike, state: dict[str, Any]) -> None:
    """`Run.load_state_dict()`: helpers first, then the elastic batch plan, then counters."""
    for name, sub in state.get("extra", {}).items():
        if name in run.state_objects:
            run.state_objects[name].load_state_dict(sub)
    plan, saved = run.plan, state.get("batch")
    if saved is not None:
        saved = BatchState.from_dict(saved)
        run.unit_batch_size = saved.unit_batch_size
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
    run.step = int(state["step"])
    run.skipped_steps = int(state["skipped_steps"])
    run.progress = float(state["progress"])
    run.progress_rate = float(state["progress_rate"])
    run.lr_scale = float(state["lr_scale"])
    run._reset_window()
    if (plan.global_batch_size, plan.micro_batch_size, plan.k_steps) != (
            run.plan.global_batch_size, run.plan.micro_batch_size, run.k_steps):
        run.set_batch(plan.micro_batch_size, plan.k_steps)
    elif saved is not None and (run.adaptive is None or run.adaptive.adascale is None):
        run.progress_rate = plan.global_batch_size / run.unit_batch_size
    comm = state.get("comm")
    if comm is not None and run._comm is not None and len(comm) == run.world.world_size:
        run._comm.load_state_dict(comm[run.world.rank])  # another world size starts afresh
    window = state.get("window")
    if window is not None:
        run.micro = int(state["micro"])
        run._mode = window["mode"]
        run._count = float(window["count"])
        for p, g in zip(run._params, window["grads"], strict=True):
            p.grad = None if g is None else g.to(p.device).clone()
    sizes = state.get("micro_batch_sizes")
    if sizes is not None and len(sizes) == run.mesh.data_degree and (
            sum(sizes) == run.plan.micro_batch_size * run.mesh.data_degree):
        run.micro_batch_sizes = [int(x) for x in sizes]  # else the workers moved: even again
    run.last_lr = run.lr_at(run.progress)
    run._set_lr(run.last_lr)
