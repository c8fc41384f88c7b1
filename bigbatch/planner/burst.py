"""Planning burst parallelism (DeepPool: Park et al., "Efficient Strong Scaling Through
Burst Parallel Training", MLSys 2022): each layer gets its own data-parallel width for
one global batch held fixed (strong scaling), and the GPUs a layer leaves idle run a
background job.

    p = plan_burst(model_fn, example, loss, world=1024, batch=1024, dev=device("h100"),
                   limit=2.0)
    p.step_seconds, p.uniform_seconds, p.freed_gpu_seconds, p.widths

How it chooses, from the same time model as `bigbatch plan` (`bigbatch.planner.cost`):

- each layer of the model's chain (its pipeline layers) is probed on the meta device at
  every width ``w`` (powers of two dividing the world and the batch), forward and
  backward on ``batch / w`` samples: ``t(w) = compute + the all-reduce of its gradients
  over w ranks`` (ring/tree on the links those ranks span). Layers run one after
  another; the all-reduce is counted as exposed (no overlap with backward) in both the
  burst and the uniform layout.
- **amplification** is GPU-time spent over the least it could be: a layout's
  ``sum(w t(w))`` plus its boundaries' GPU-time, over the sum of each layer's GPU-time at
  its most economical width (usually one GPU: no all-reduce). DeepPool bounds how much
  GPU-time strong scaling may waste; here the whole step must stay within `limit`
  (each layer's own ratio is reported too).
- where consecutive layers differ in width, the narrower side's ranks gather the
  activations (forward) and scatter their gradients (backward):
  ``2 x (hops x latency + bytes / link rate)`` on the link the group spans
  (`bigbatch.parallel.burst` runs exactly this).
- a dynamic programme over the layers (the width its state) picks the widths of least
  step time within the limit (`choose_widths`). The **uniform** layout is every layer on all `world` GPUs. A burst step holds
  the world's GPUs for its step time; what its layers do not use,
  ``world x step - sum(w t(w)) - boundaries``, is **freed** for a background job.

Not counted: the optimizer step, memory (a narrow layer holds its batch share's
activations: check it with `bigbatch plan`), tensor and pipeline parallelism inside a
layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bigbatch.errors import ConfigError
from bigbatch.planner.devices import Device
from bigbatch.planner.layout import chain_inputs
from bigbatch.planner.probe import StageRun, probe
from bigbatch.planner.timing import collective_seconds, dim_link

__all__ = ["BurstPlan", "LayerTimes", "choose_widths", "plan_burst"]


@dataclass
class LayerTimes:
    """One layer's predicted seconds per step at each width."""

    name: str
    compute: dict[int, float]
    """Width -> seconds of its forward and backward on ``batch / width`` samples."""
    reduce: dict[int, float]
    """Width -> seconds of the all-reduce of its gradients over that many ranks."""
    out_bytes_per_sample: float
    """What it hands the next layer per sample (a boundary moves this)."""

    def seconds(self, width: int) -> float:
        return self.compute[width] + self.reduce[width]

    def gpu_seconds(self, width: int) -> float:
        return width * self.seconds(width)

    @property
    def base(self) -> float:
        """Its GPU-time at its most economical width."""
        return min(self.gpu_seconds(w) for w in self.compute)


@dataclass
class BurstPlan:
    """The widths chosen per layer and what they give (module docstring)."""

    world: int
    batch: int
    limit: float
    device: str
    layers: list[LayerTimes]
    widths: list[int]
    boundary_seconds: list[float] = field(default_factory=list)
    """Seconds of each boundary between layer i and i+1 (0 where the width stays)."""

    @property
    def step_seconds(self) -> float:
        return sum(t.seconds(w) for t, w in zip(self.layers, self.widths, strict=True)) \
            + sum(self.boundary_seconds)

    @property
    def uniform_seconds(self) -> float:
        return sum(t.seconds(self.world) for t in self.layers)

    @property
    def gpu_seconds(self) -> float:
        """GPU-seconds the burst step's layers and boundaries use."""
        layers = sum(t.gpu_seconds(w) for t, w in zip(self.layers, self.widths, strict=True))
        edges = sum(s * max(a, b) for s, a, b in zip(self.boundary_seconds, self.widths,
                                                     self.widths[1:], strict=False))
        return layers + edges

    @property
    def uniform_gpu_seconds(self) -> float:
        return self.world * self.uniform_seconds

    @property
    def freed_gpu_seconds(self) -> float:
        """GPU-seconds per step the burst layout leaves to a background job."""
        return self.world * self.step_seconds - self.gpu_seconds

    @property
    def base_gpu_seconds(self) -> float:
        return sum(t.base for t in self.layers)

    @property
    def amplification(self) -> float:
        return self.gpu_seconds / self.base_gpu_seconds

    @property
    def uniform_amplification(self) -> float:
        return self.uniform_gpu_seconds / self.base_gpu_seconds

    def runs(self) -> list[tuple[str, int, float]]:
        """(layers, width, seconds) of each run of consecutive layers of one width."""
        out: list[tuple[str, int, float]] = []
        start = 0
        for i in range(1, len(self.widths) + 1):
            if i == len(self.widths) or self.widths[i] != self.widths[start]:
                names = self.layers[start].name if i - start == 1 else \
                    f"{self.layers[start].name} .. {self.layers[i - 1].name}"
                out.append((names, self.widths[start],
                            sum(t.seconds(self.widths[start]) for t in self.layers[start:i])))
                start = i
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"world": self.world, "global_batch": self.batch,
                "amplification_limit": self.limit, "device": self.device,
                "layers": [{"name": t.name, "width": w, "seconds": t.seconds(w),
                            "amplification": t.gpu_seconds(w) / t.base}
                           for t, w in zip(self.layers, self.widths, strict=True)],
                "step_seconds": self.step_seconds, "uniform_step_seconds": self.uniform_seconds,
                "boundary_seconds": sum(self.boundary_seconds),
                "gpu_seconds_per_step": self.gpu_seconds,
                "uniform_gpu_seconds_per_step": self.uniform_gpu_seconds,
                "freed_gpu_seconds_per_step": self.freed_gpu_seconds,
                "amplification": self.amplification,
                "uniform_amplification": self.uniform_amplification}

    def render(self) -> str:
        from bigbatch.planner.report import seconds as _seconds

        lines = [f"burst plan (DeepPool) on {self.world} x {self.device}, global batch "
                 f"{self.batch}, amplification limit {self.limit:g}:",
                 f"  {'layers':34s} {'width':>6s} {'per step':>10s}"]
        for names, width, seconds in self.runs():
            lines.append(f"  {names:34s} {width:6d} {_seconds(seconds):>10s}")
        ratio = self.step_seconds / self.uniform_seconds
        lines += [
            f"  step: burst {_seconds(self.step_seconds)} (boundaries "
            f"{_seconds(sum(self.boundary_seconds))}) vs uniform (every layer on "
            f"{self.world}) {_seconds(self.uniform_seconds)}: {ratio:.2f}x",
            f"  GPU-seconds per step: burst {self.gpu_seconds:.4g} (amplification "
            f"{self.amplification:.2f}), uniform {self.uniform_gpu_seconds:.4g} "
            f"({self.uniform_amplification:.2f})",
            f"  freed for a background job: {self.freed_gpu_seconds:.4g} GPU-seconds per step "
            f"({self.freed_gpu_seconds / (self.world * self.step_seconds):.0%} of the "
            f"{self.world} GPUs' time)"]
        return "\n".join(lines)


def _boundary_seconds(layer: LayerTimes, a: int, b: int, batch: int, dev: Device) -> float:
    """Forward gather and backward scatter (or the reverse) between widths a and b."""
    if a == b:
        return 0.0
    narrow, wide = min(a, b), max(a, b)
    members = wide // narrow
    nbytes = (members - 1) * batch / wide * layer.out_bytes_per_sample
    rate, hop = dim_link(dev, narrow, members)
    return 2 * ((members - 1) * hop + nbytes / rate)


def _path(layers: Sequence[LayerTimes], widths: Sequence[int], batch: int, dev: Device,
          price: float) -> list[int]:
    """The widths of least ``seconds + price x GPU-seconds`` over the chain: a dynamic
    programme over the layers with the width as its state."""
    best: dict[int, tuple[float, list[int]]] = {
        w: ((1 + price * w) * layers[0].seconds(w), [w]) for w in widths}
    for i in range(1, len(layers)):
        nxt: dict[int, tuple[float, list[int]]] = {}
        for w in widths:
            options = []
            for v, (cost, path) in best.items():
                edge = _boundary_seconds(layers[i - 1], v, w, batch, dev)
                options.append((cost + (1 + price * max(v, w)) * edge, path))
            cost, path = min(options, key=lambda o: (o[0], -o[1][-1]))
            nxt[w] = (cost + (1 + price * w) * layers[i].seconds(w), [*path, w])
        best = nxt
    return min(best.values(), key=lambda o: (o[0], -o[1][-1]))[1]


def choose_widths(layers: Sequence[LayerTimes], widths: Sequence[int], limit: float,
                  batch: int, dev: Device) -> tuple[list[int], list[float]]:
    """The widths (one per layer) of least step time whose GPU-time, boundaries included,
    is at most `limit` times the layers' GPU-time at their most economical widths; and the
    boundaries' seconds. The budget is met by pricing GPU-time (a Lagrangian sweep of the
    price from 0, pure speed, up to where only GPU-time counts), each price solved
    exactly by `_path`; the fastest layout within the budget wins (none within it: the
    most economical one found)."""
    base = sum(t.base for t in layers)
    world = max(widths)
    found = []
    for price in [0.0, *(10 ** (k / 4) / world for k in range(-32, 33))]:
        chosen = _path(layers, widths, batch, dev, price)
        edges = [_boundary_seconds(layers[i], chosen[i], chosen[i + 1], batch, dev)
                 for i in range(len(chosen) - 1)]
        plan = BurstPlan(world=world, batch=batch, limit=limit, device=dev.name,
                         layers=list(layers), widths=chosen, boundary_seconds=edges)
        found.append((plan.step_seconds, plan.gpu_seconds, chosen, edges))
    budget = limit * base * (1 + 1e-12)
    within = [f for f in found if f[1] <= budget]
    if not within:
        _, _, chosen, edges = min(found, key=lambda f: (f[1], f[0]))
        return chosen, edges
    _, _, chosen, _ = min(within, key=lambda f: (f[0], f[1]))
    chosen = _widen(layers, widths, chosen, batch, dev, budget)
    edges = [_boundary_seconds(layers[i], chosen[i], chosen[i + 1], batch, dev)
             for i in range(len(chosen) - 1)]
    return chosen, edges


def _measure(layers: Sequence[LayerTimes], chosen: list[int], batch: int,
             dev: Device) -> tuple[float, float]:
    edges = [_boundary_seconds(layers[i], chosen[i], chosen[i + 1], batch, dev)
             for i in range(len(chosen) - 1)]
    plan = BurstPlan(world=max(chosen), batch=batch, limit=0.0, device="", layers=list(layers),
                     widths=chosen, boundary_seconds=edges)
    return plan.step_seconds, plan.gpu_seconds


def _widen(layers: Sequence[LayerTimes], widths: Sequence[int], chosen: list[int],
           batch: int, dev: Device, budget: float) -> list[int]:
    """Spend what the price sweep left of the budget: the sweep finds only the corners
    of the time/GPU-time trade-off (identical layers move together), so widen one run of
    equal-width layers (or one layer) at a time while it saves time within the budget,
    the most time saved per GPU-second first."""
    chosen = list(chosen)
    now, used = _measure(layers, chosen, batch, dev)
    while True:
        best = None
        for i in range(len(chosen)):
            if chosen[i] == widths[-1]:
                continue
            wider = widths[widths.index(chosen[i]) + 1]
            for j in (i + 1, len(chosen)):  # this layer alone, or it and all after it
                trial = chosen[:i] + [wider if k < j and chosen[k] == chosen[i] else chosen[k]
                                      for k in range(i, len(chosen))]
                t, g = _measure(layers, trial, batch, dev)
                if t < now and g <= budget:
                    gain = (now - t) / max(g - used, 1e-30)
                    if best is None or gain > best[0]:
                        best = (gain, trial, t, g)
        if best is None:
            return chosen
        _, chosen, now, used = best


def _signature(model: nn.Module, layer: Any, x: torch.Tensor, first: bool, last: bool):
    params = tuple((type(model.get_submodule(m)).__name__,
                    tuple((n, tuple(p.shape), p.dtype)
                          for n, p in model.get_submodule(m).named_parameters()))
                   for m in layer.modules)
    return params, tuple(x.shape), x.dtype, first, last


def _param_bytes(model: nn.Module, layer: Any) -> int:
    seen: dict[int, int] = {}
    for m in layer.modules:
        for p in model.get_submodule(m).parameters():
            if p.requires_grad:
                seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def plan_burst(model_fn: Callable[[], nn.Module], example: Callable[[int], Any],
               loss: Callable | None, *, world: int, batch: int, dev: Device,
               limit: float = 2.0, amp_dtype: torch.dtype | None = None,
               pipeline_layers: Sequence[Any] | None = None) -> BurstPlan:
    """Choose each layer's width for `batch` samples a step on up to `world` GPUs of
    `dev` (module docstring). `example`, `loss` as in `bigbatch.plan`; the layers are
    the model's pipeline layers (or `pipeline_layers`)."""
    from bigbatch.parallel.pipeline import model_layers

    if limit < 1:
        raise ConfigError(f"--amplification {limit:g}: expected a number >= 1 (the GPU-time "
                          "a layer may spend over its most economical width)")
    if batch % world:
        raise ConfigError(f"--burst: the global batch {batch} does not split over "
                          f"--world {world}; set batch.global_batch_size to a multiple")
    widths = [w for w in (2 ** i for i in range(world.bit_length())) if world % w == 0
              and batch % w == 0]
    if widths[-1] != world:
        raise ConfigError(f"--burst: --world {world} is not a power of two; burst widths "
                          "are powers of two up to the world")
    with torch.device("meta"):
        model = model_fn()
    layers = list(pipeline_layers) if pipeline_layers is not None else model_layers(model)
    params = [_param_bytes(model, layer) for layer in layers]
    times = [LayerTimes(layer.name, {}, {}, 0.0) for layer in layers]
    cache: dict[Any, tuple[float, float]] = {}
    for w in widths:
        b = batch // w
        x, y = (t.to("meta") for t in example(b))
        inputs = chain_inputs(model, layers, x)
        for i, layer in enumerate(layers):
            first, last = i == 0, i == len(layers) - 1
            key = (_signature(model, layer, inputs[i], first, last), b)
            if key not in cache:
                got = probe(model, [StageRun(functools.partial(layer.run, model), inputs[i],
                                             first, last)], {}, loss=loss if last else None,
                            targets=y, amp_dtype=amp_dtype)
                cache[key] = (got.cost.seconds(dev), (got.sent[0] / b) if got.sent else 0.0)
            times[i].compute[w], times[i].out_bytes_per_sample = cache[key]
            times[i].reduce[w] = collective_seconds("all_reduce", params[i], w,
                                                    dim_link(dev, 1, w))
    chosen, edges = choose_widths(times, widths, limit, batch, dev)
    return BurstPlan(world=world, batch=batch, limit=limit, device=dev.name, layers=times,
                     widths=chosen, boundary_seconds=edges)
