"""A plan as text: the layout, the batch, per-rank memory, traffic per step, the bubble."""

from __future__ import annotations

from typing import Any

from bigbatch.planner.counting import ACTIVATION_METHOD, GIB, KINDS, wire_bytes

__all__ = ["count", "human", "render", "render_suggestions", "render_time", "seconds"]


def human(nbytes: float | None) -> str:
    """Bytes in binary units: ``1.50 GiB``, ``12.0 MiB``, ``8 B``."""
    if nbytes is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def count(n: int) -> str:
    """A parameter count: ``38.7 B``, ``302 M``, ``25.3 K``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _fraction(p: Any) -> str:
    d = p.degrees
    if not d.pp_enabled:
        return "0 (no pipeline)"
    n = d.pipeline - 1
    return f"{n}/{p.virtual * p.batch.k_steps + n} = {p.bubble:.3f} ({p.schedule})"


def render(p: Any) -> str:
    """The text `bigbatch plan` prints (see `LayoutPlan.summary`)."""
    d, b, worst, busy = p.degrees, p.batch, p.worst, p.busiest
    lines = [
        f"{count(p.parameters)} parameters, {p.optimizer_name}, world {p.world}",
        f"layout    {d.describe()}  (mesh pp {d.pipeline} x dp_replicate {d.replicate} x "
        f"dp_shard {d.shard} x tp {d.tensor})",
        f"batch     global {b.global_batch_size} = micro {b.micro_batch_size} x accumulation "
        f"{b.k_steps} x data {b.world_size}",
        f"bubble    {_fraction(p)}",
        "",
    ]
    if len(p.ranks) > 1:
        lines.append("per pipeline stage (its first rank)")
        lines.append(f"  {'stage':>5} {'params':>11} {'grads':>11} {'optimizer':>11} "
                     f"{'act x live':>17} {'peak':>11}")
        for r in p.ranks:
            act = f"{human(r.activations)} x{r.in_flight:g}"
            lines.append(f"  {','.join(map(str, r.stages)):>5} {human(r.params):>11} "
                         f"{human(r.grads):>11} {human(r.optimizer):>11} {act:>17} "
                         f"{human(r.peak):>11}")
        lines.append("")
    lines.append(f"per rank (rank {worst.rank}, the fullest)")
    rows = [("parameters", worst.params), ("gradients", worst.grads),
            ("optimizer state", worst.optimizer),
            ("activations / micro-batch (est.)", worst.activations)]
    if worst.accumulated_grads:
        rows.append(("unsharded grads between micro-batches", worst.accumulated_grads))
    if worst.buffers:
        rows.append(("gathered params, buckets (est.)", worst.buffers))
    for label, value in rows:
        lines.append(f"  {label:<38} {human(value):>12}")
    lines.append(f"  {'micro-batches in flight':<38} {worst.in_flight:>12g}")
    peak = f"  {'peak (estimate)':<38} {human(worst.peak):>12}"
    if p.gpu_memory is not None:
        room = p.gpu_memory * GIB - worst.peak
        peak += (f"   fits {p.gpu_memory:g} GiB: " +
                 (f"yes, {human(room)} free" if room >= 0 else f"NO, {human(-room)} over"))
    lines += [peak, "", "traffic per optimizer step (rank "
              f"{busy.rank}; bytes handed to each collective)"]
    comm = busy.comm
    if not comm.bytes:
        lines.append("  none")
    for kind in KINDS:
        for dim, nbytes in sorted(comm.bytes.get(kind, {}).items()):
            lines.append(f"  {kind:<16} {dim:<13} {human(nbytes):>12} "
                         f"{comm.calls[kind][dim]:>7} calls  over {comm.sizes[dim]} ranks")
    lines.append(f"  {'sent by this rank (ring algorithms)':<30} {human(wire_bytes(comm)):>12}")
    lines += ["", "activations: " + ACTIVATION_METHOD + "."]
    lines += [f"note: {n}" for n in dict.fromkeys(p.notes + [n for r in p.ranks
                                                            for n in r.notes])]
    lines.append(f"planned in {p.seconds:.1f} s on the meta device")
    return "\n".join(_wrap(line) for line in lines)


def _wrap(line: str, width: int = 80) -> str:
    if len(line) <= width or line.startswith("  "):
        return line
    import textwrap

    return "\n".join(textwrap.wrap(line, width, subsequent_indent="  "))


def seconds(t: float) -> str:
    """A duration: ``1.23 s``, ``45.6 ms``, ``789 us``."""
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def render_time(t: Any) -> str:
    """The predicted step (`bigbatch.planner.timing.StepTime`) as text."""
    lines = [f"predicted step on {t.device} ({t.dtype}): {seconds(t.seconds)}"]
    for part, value in t.breakdown().items():
        share = value / t.seconds if t.seconds else 0.0
        lines.append(f"  {part:<30} {seconds(value):>10}  {share:>6.1%}")
    lines.append(f"  {t.unit + '/s per device':<30} {t.per_device_rate:>10.4g}")
    lines.append(f"  {'TFLOP/s per device (all run)':<30} {t.tflops_per_device:>10.4g}")
    lines.append(f"  {'MFU (model FLOPs / peak)':<30} {t.mfu:>10.1%}")
    return "\n".join(lines)


def render_suggestions(rows: list[Any], gpu_memory: float | None, tried: int,
                       times: list[Any] | None = None) -> str:
    """The `--suggest` table: layouts that fit, fastest first (with `times`, each row's
    `StepTime`), else least traffic first."""
    order = "fastest first" if times is not None else "least traffic first"
    head = (f"layouts that fit {gpu_memory:g} GiB" if gpu_memory is not None
            else "layouts") + f", {order} ({len(rows)} of {tried} tried)"
    extra = f" {'step':>9} {'per dev/s':>9} {'MFU':>6}" if times is not None else ""
    lines = [head, f"  {'tp':>3} {'pp':>3} {'zero':>4} {'data':>5} {'micro x accum':>13} "
             f"{'peak':>11} {'sent/step':>11} {'bubble':>7}" + extra]
    for i, (plan_, _sets) in enumerate(rows):
        d, b = plan_.degrees, plan_.batch
        row = (f"  {d.tensor:>3} {d.pipeline:>3} {d.stage:>4} {d.data:>5} "
               f"{f'{b.micro_batch_size} x {b.k_steps}':>13} {human(plan_.worst.peak):>11} "
               f"{human(wire_bytes(plan_.busiest.comm)):>11} {plan_.bubble:>7.3f}")
        if times is not None:
            t = times[i]
            row += f" {seconds(t.seconds):>9} {t.per_device_rate:>9.4g} {t.mfu:>6.1%}"
        lines.append(row)
    if not rows:
        lines.append("  none")
    else:
        lines.append("  (--json lists the --set overrides of each)")
    return "\n".join(lines)
