"""The Strategy's overview: a boxed key/value table in the style of Fleet's
`DistributedStrategy` printout: the sections in force, then the derived numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bigbatch.config.parallelism import Degrees, degrees
from bigbatch.config.schedules import grown_warmup, growth_of, warmup_start_lr, warmup_steps_of
from bigbatch.config.sections import KEYS, SECTIONS

__all__ = ["render_overview", "strategy_overview"]

WIDTH = 80
_KEY_COL = 36  # keys right-aligned in this many columns, then a gap, then the value
_GAP = 4


def _text(value: Any) -> list[str]:
    """Display lines of one value: TOML-like scalars, one line per list item."""
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if value is None:
        return ["-"]
    if isinstance(value, tuple | list):
        return [str(v) for v in value] or ["[]"]
    return [str(value)]


def _line(text: str, align: str = "^") -> str:
    inner = WIDTH - 2
    if len(text) > inner:
        text = text[: inner - 3] + "..."
    return f"|{text:{align}{inner}}|"


def render_overview(title: str, blocks: list[tuple[str, list[tuple[str, Any]]]]) -> str:
    """A Fleet-style boxed table: a title, then one titled block of key/value rows each."""
    heavy, light = "+" + "=" * (WIDTH - 2) + "+", "+" + "-" * (WIDTH - 2) + "+"
    out = [heavy, _line(""), _line(title), _line(""), heavy]
    value_width = WIDTH - 2 - _KEY_COL - _GAP
    for block_title, rows in blocks:
        out += [_line(block_title), light]
        for key, value in rows:
            for i, item in enumerate(_text(value)):
                if len(item) > value_width:
                    item = item[: value_width - 3] + "..."
                label = key if i == 0 else ""
                out.append(_line(f"{label:>{_KEY_COL}}{'':{_GAP}}{item}", "<"))
        out.append(heavy)
    return "\n".join(out)


# Optimizer fields the chosen type ignores; the overview leaves them out.
_UNUSED = {"momentum": ("beta1", "beta2", "epsilon"), "adamw": ("momentum", "nesterov")}


def _shown(strategy: Any, key: str, value: Any) -> Any:
    """A field's value as the overview prints it: an unset key whose value follows other
    keys, as the run will use it."""
    if value is not None:
        return value
    if key == "exclude_from_weight_decay":
        return "ndim <= 1 (default)"
    if key == "nesterov":
        return f"{str(strategy.nesterov).lower()} (unset: on with LARS)"
    if key == "lr_find_steps":
        return f"{strategy.lr_find_steps} (unset: 15, adamw 30)"
    if key == "noise_scale_fraction":
        return f"{strategy.noise_scale_fraction:g} (unset: 1, adamw 0.0075)"
    return value


def _decay_text(b: Any) -> str:
    if b.decay == "step":
        return f"step: x{b.decay_gamma:g} at {', '.join(f'{m:g}' for m in b.decay_milestones)}"
    if b.decay == "poly":
        return f"poly power {b.decay_power:g} to {b.final_lr_ratio:g} x peak"
    if b.decay == "cosine":
        return f"cosine to {b.final_lr_ratio:g} x peak"
    return "none"


def strategy_overview(
    strategy: Any,
    world_size: int,
    *,
    steps_per_epoch: int | None = None,
    total_steps: int | None = None,
    lr_find: Mapping[str, Any] | None = None,
) -> str:
    """`Strategy.overview`: the Fleet-style "DistributedStrategy Overview" table plus the
    derived numbers; `lr_find`: what the range test found (`batch.lr_find`), shown as the
    peak LR.

    Plain ASCII, 80 columns: reads the same in a terminal and in a log file.
    """
    deg = degrees(strategy, world_size)
    plan = strategy.resolve(deg.data)
    blocks: list[tuple[str, list[tuple[str, Any]]]] = []
    for name in SECTIONS:
        section = getattr(strategy, name)
        enable = getattr(section, "enable", None)
        if enable is False or (name == "adaptive" and not section.active
                               and not section.policies) or (
                name == "tensor_parallel" and section.tensor_parallel_degree == 1) or (
                name in ("straggler", "sync_switch") and name not in strategy.adaptive.policies):
            continue
        title = f"[{name}]" if enable is None else f"{name}=True <-> [{name}]"
        hidden = _UNUSED.get(section.type, ()) if name == "optimizer" else ()
        rows = [(k, _shown(strategy, k, getattr(section, k))) for k in KEYS[name]
                if k not in ("enable", *hidden)]
        blocks.append((title, rows))
    blocks.append(
        (
            f"derived (world_size={world_size})",
            _derived_rows(strategy, plan, steps_per_epoch, total_steps, deg, lr_find),
        )
    )
    return render_overview("bigbatch DistributedStrategy Overview", blocks)


def _derived_rows(
    strategy: Any, plan: Any, steps_per_epoch: int | None, total_steps: int | None,
    deg: Degrees, lr_find: Mapping[str, Any] | None = None,
) -> list[tuple[str, Any]]:
    b = strategy.batch
    peak = f"{plan.peak_lr:.6g} = {b.base_lr:g} x {b.scaling}({plan.scale:g})"
    if lr_find is not None and not lr_find["fallback"]:
        peak = (f"{lr_find['peak_lr']:.4g} (lr_find, {lr_find['time_s']:.0f} s; scaled "
                f"{plan.peak_lr:.4g})")
    elif lr_find is not None:
        peak = f"{plan.peak_lr:.6g} (lr_find fell back to it)"
    elif b.lr_find:
        peak = f"found by lr_find (scaled: {plan.peak_lr:.4g})"
    if b.warmup_epochs:
        warmup = f"{b.warmup_epochs:g} epochs"
        if steps_per_epoch:
            warmup += f" = {round(b.warmup_epochs * steps_per_epoch)} steps"
    else:
        warmup = f"{b.warmup_steps} steps"
    if (b.warmup_steps or b.warmup_epochs) and b.warmup_scaling != "none":
        at = f"{warmup.split(' = ')[0]} at batch {b.warmup_batch_size or b.base_batch_size}"
        warmup = f"{b.warmup_scaling}-scaled from {at}"
        if total_steps is not None and (steps_per_epoch or not b.warmup_epochs):
            grown = grown_warmup(warmup_steps_of(b.warmup_steps, b.warmup_epochs,
                                                 steps_per_epoch), b.warmup_scaling,
                                 plan.global_batch_size,
                                 b.warmup_batch_size or b.base_batch_size, total_steps)
            warmup = f"{grown} steps, {warmup}"
    if b.warmup_steps or b.warmup_epochs:
        warmup += (" from 0" if b.warmup_start == "zero" else
                   f" from {warmup_start_lr(b.base_lr, plan.peak_lr):.6g}")
    rows: list[tuple[str, Any]] = [
        ("global_batch_size", plan.global_batch_size),
        ("micro_batch_size", f"{plan.micro_batch_size} per worker per micro-step"),
        ("k_steps", plan.k_steps),
        ("world_size", deg.world) if deg.world == deg.data else ("mesh", deg.describe()),
        (
            "global = micro x k x data" if deg.world != deg.data else
            "global = micro x k x world",
            f"{plan.micro_batch_size} x {plan.k_steps} x {plan.world_size}",
        ),
        ("scale", f"{plan.scale:g} = {plan.global_batch_size} / {b.base_batch_size}"),
        ("peak_lr", peak),
        ("warmup", warmup),
        ("decay", _decay_text(b)),
        ("optimizer", _optimizer_text(strategy)),
    ]
    if growth_of(strategy) != "fixed":
        rows[1:1] = _growth_rows(strategy, plan, deg)
    elif b.schedule == "auto":
        rows.insert(1, ("batch schedule", "auto = fixed in this layout"))
    if total_steps is not None:
        rows.append(("total_steps", total_steps if growth_of(strategy) == "fixed" else
                     f"{total_steps} of the start batch"))
    return rows


def _growth_rows(strategy: Any, plan: Any, deg: Degrees) -> list[tuple[str, Any]]:
    b, ceiling = strategy.batch, strategy.ceiling(deg.data).global_batch_size
    rule = growth_of(strategy)
    when = (f"2 x batch <= {strategy.noise_scale_fraction:g} x noise scale"
            if rule == "adaptive" else "the decay halves the LR")
    name = rule if rule == b.schedule else f"{b.schedule} = {rule}"
    return [("batch schedule", f"{name}: {plan.global_batch_size} -> at most {ceiling}"),
            ("doubles when", when), ("peak LR on doubling", "follows "
                                     f"{b.growth_scaling if rule == 'adaptive' else b.scaling}"
                                     " scaling")]


def _optimizer_text(strategy: Any) -> str:
    o = strategy.optimizer
    if o.type == "momentum":
        inner = f"momentum {o.momentum:g}" + (", nesterov" if strategy.nesterov else "")
    else:
        inner = f"betas ({o.beta1:g}, {o.beta2:g}), eps {o.epsilon:g}"
    return f"{strategy.optimizer_name()} ({inner})"
