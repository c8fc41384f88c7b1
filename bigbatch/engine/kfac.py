"""`[kfac]` on the engine: K-FAC preconditioning between the reduced gradients and the
inner optimizer (Osawa et al. 2019; distributed as in Pauloski et al. 2020). The maths
is `bigbatch.optim.kfac`; this file collects its inputs and applies it.

`attach_kfac(run)` builds a `KFAC` for the run's model and plugs it into the `Run`:

- A forward hook on each preconditioned layer (a `kfac.layers` type not named in
  `kfac.exclude`) computes the call's input-factor sum on factor-update steps, and hooks
  the output's gradient, which adds that sum and the output-factor sum when the backward
  reaches it. Every micro-step of a merge window adds to one pair of sums; a forward
  that never gets a backward (evaluation with grad on, a forward recomputed under
  activation checkpointing) adds nothing.
- A grad hook (each taken step: gradients unscaled and all-reduced, before the inner
  optimizer and its trust ratio): the sums of all data ranks are added in one
  all-reduce (upper triangles, one bucket), normalised and averaged into the running
  factors; on eigendecomposition steps each rank decomposes its share of the factors
  (largest first, to the least-loaded rank) and one all-reduce of zero-filled buffers
  hands everyone all of them (a broadcast from each owner in one collective); then
  each layer's gradient becomes its preconditioned, KL-clipped version (ν uses the
  scheduled LR; under LARS the trust ratio then rescales each layer's step).
- `run.state_objects["kfac"]`: factors, eigenbases, sums of a window caught mid-way
  and counters, in `run.state_dict()`; `run.stats` gains ``kfac_kl_scale``.

Units. The backward sees each micro-step's output gradients times the engine's loss
multiplier and the loss scale ``S``. A mean loss over the micro batch ``m`` gives
per-sample gradients ``ℓ' = g m / mean_mult / S``, a summed loss (``count=``) per-item
ones ``ℓ' = g / count_mult / S = g m / S``; at the step ``G = Σ ℓ'ℓ'^T / N`` with ``N``
the step's global sample (item) count, and ``A = Σ ā ā^T / rows``. So the factors are
those of the gathered global batch whatever the merge, world size or loss scale.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bigbatch.errors import ConfigError
from bigbatch.optim import kfac as K
from bigbatch.parallel.world import all_reduce_sum

if TYPE_CHECKING:
    from bigbatch.engine.clock import ScheduleClock
    from bigbatch.engine.grad_info import GradInfo
    from bigbatch.engine.merge import MergeWindow

__all__ = ["KFAC", "attach_kfac"]

_SAVED = ("A", "G", "QA", "dA", "QG", "dG", "sum_A", "sum_G")


@dataclass(eq=False)
class _Layer:
    """One preconditioned layer: its factor sums for the current step, running factors
    and damped eigenbases."""

    name: str
    module: nn.Module
    dtype: torch.dtype
    sum_A: torch.Tensor | None = None
    sum_G: torch.Tensor | None = None
    rows: float = 0.0
    A: torch.Tensor | None = None
    G: torch.Tensor | None = None
    QA: torch.Tensor | None = None
    dA: torch.Tensor | None = None
    QG: torch.Tensor | None = None
    dG: torch.Tensor | None = None

    @property
    def dims(self) -> tuple[int, int]:
        w = self.module.weight
        return w[0].numel() + (self.module.bias is not None), w.shape[0]


def select_layers(module: nn.Module, layers: tuple[str, ...],
                  exclude: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The `(name, module)` pairs K-FAC preconditions; a ConfigError when `exclude`
    names no module or nothing is left."""
    named = dict(module.named_modules())
    for name in exclude:
        if name not in named:
            raise ConfigError(f"kfac.exclude: no module named {name!r} in the model "
                              "(names as in model.named_modules())")
    types = tuple(K.LAYER_TYPES[t] for t in layers)
    out = [(n, m) for n, m in named.items()
           if isinstance(m, types) and n not in exclude and m.weight.requires_grad
           and K.unsupported_reason(m) is None]
    if not out:
        raise ConfigError(f"[kfac]: the model has no trainable layer of kfac.layers = "
                          f"{list(layers)} left to precondition")
    return out


class KFAC:
    """K-FAC for a `Run`: hooks, factors, eigenbases and the preconditioning step.

    Build with `attach_kfac(run)`; `layers` lists the preconditioned modules.
    """

    def __init__(self, module: nn.Module, config: Any, *, clock: ScheduleClock,
                 window: MergeWindow, scaler: Any, world: Any, mesh: Any,
                 track_grad_norm: bool = False) -> None:
        self.config = config
        self._clock = clock
        self._window = window
        self._scaler = scaler
        self._world = world
        self._mesh = mesh
        self._track_grad_norm = track_grad_norm
        self.layers = [
            _Layer(name, m, torch.promote_types(m.weight.dtype, torch.float32))
            for name, m in select_layers(module, tuple(config.layers), tuple(config.exclude))]
        self.factor_updates = 0
        """Factor updates taken (the first one starts the running average)."""
        self.kl_scale: torch.Tensor | None = None
        """The last step's KL-clip factor ν (None before the first, or with kl_clip = 0)."""
        self._has_sums = False
        self._handles = [layer.module.register_forward_hook(functools.partial(self._forward, layer))
                         for layer in self.layers]

    def remove(self) -> None:
        """Take the hooks off the model (the run stops preconditioning only if the grad hook
        goes too)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ collecting

    def _collecting(self) -> bool:
        return self._clock.step % self.config.factor_update_freq == 0

    def _forward(self, layer: _Layer, module: nn.Module, inputs: tuple[Any, ...],
                 output: Any) -> None:
        if not (isinstance(output, torch.Tensor) and output.requires_grad and self._collecting()):
            return
        if torch._C._current_graph_task_id() != -1:  # recomputed in backward: no new sample
            return
        window = self._window
        if self._has_sums and window.micro == 0 and window.mode is None:
            self._clear_sums()  # a window that ended without a step (overflow, skip)
        x = inputs[0].detach()
        # Factors in the layer's factor dtype even inside autocast (fp16 products overflow).
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            rows = K.layer_inputs(module, x.to(layer.dtype))
            a_sum = K.factor_sum(rows)
        output.register_hook(functools.partial(self._output_grad, layer, a_sum, rows.shape[0]))

    def _output_grad(self, layer: _Layer, a_sum: torch.Tensor, rows: int,
                     grad: torch.Tensor) -> None:
        window = self._window
        m = window.micro_batch_size
        per_sample = m / window.mean_mult if window.mode != "count" else float(m)
        with torch.no_grad():
            g = K.layer_output_grads(layer.module, grad.detach().to(layer.dtype))
            if layer.sum_A is None:
                layer.sum_A = a_sum
                layer.sum_G = K.factor_sum(g, alpha=per_sample * per_sample)
            else:
                layer.sum_A.add_(a_sum)
                K.factor_sum(g, out=layer.sum_G, alpha=per_sample * per_sample)
        layer.rows += rows
        self._has_sums = True

    def _clear_sums(self) -> None:
        for layer in self.layers:
            layer.sum_A = layer.sum_G = None
            layer.rows = 0.0
        self._has_sums = False

    # ------------------------------------------------------------------ the step

    def on_grads(self, info: GradInfo) -> None:
        """The grad hook: update factors and eigenbases when due, then precondition."""
        c, world, mesh, clock = self.config, self._world, self._mesh, self._clock
        if self._track_grad_norm:
            info.global_sq_norm()  # the logged grad norm is the gradient's, not K-FAC's step
        distributed = world.is_distributed and mesh.data_degree > 1
        # Every rank joins the factor all-reduce, whatever its own layers ran.
        if self._collecting() and (self._has_sums or distributed):
            self._update_factors(float(info.global_batch))
        self._clear_sums()
        if clock.step % c.inv_update_freq == 0 or any(
                layer.A is not None and layer.QA is None for layer in self.layers):
            self._update_eigen()
        self._precondition(clock.lr_at(clock.progress))

    def _update_factors(self, samples: float) -> None:
        world, mesh = self._world, self._mesh
        scale = self._scaler.scale_value if self._scaler is not None else 1.0
        sums = []
        for layer in self.layers:
            da, dg = layer.dims
            w = layer.module.weight
            sa = layer.sum_A if layer.sum_A is not None else w.new_zeros(da, da, dtype=layer.dtype)
            sg = layer.sum_G if layer.sum_G is not None else w.new_zeros(dg, dg, dtype=layer.dtype)
            sums.append([sa, sg, torch.tensor([layer.rows], dtype=layer.dtype, device=w.device)])
        if world.is_distributed and mesh.data_degree > 1:
            _all_reduce_symmetric(sums, mesh.dp_group)
        decay = self.config.factor_decay if self.factor_updates else 0.0
        # One host read per factor update: a layer no rank ran this step keeps its factors.
        counts = torch.cat([rows for _, _, rows in sums]).tolist()
        for layer, (sa, sg, _), rows in zip(self.layers, sums, counts, strict=True):
            if rows == 0:
                continue
            A = sa / rows
            G = sg / (samples * scale * scale)
            layer.A = K.running_average(layer.A if decay else None, A, decay)
            layer.G = K.running_average(layer.G if decay else None, G, decay)
        if any(counts):
            self.factor_updates += 1

    def _update_eigen(self) -> None:
        world, mesh = self._world, self._mesh
        jobs = [(layer, which) for layer in self.layers if layer.A is not None
                for which in ("A", "G")]
        W = mesh.data_degree if world.is_distributed else 1
        owner = _assign(jobs, W)
        rank = mesh.data_rank if W > 1 else 0
        found: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (layer, which), r in zip(jobs, owner, strict=True):
            factor = getattr(layer, which)
            if r == rank:
                found.append(K.eigen(factor))
            else:
                n = factor.shape[0]
                found.append((factor.new_zeros(n, n), factor.new_zeros(n)))
        if W > 1:
            _all_reduce_grouped([[q, d] for q, d in found], mesh.dp_group)
        damping = self.config.damping
        for i in range(0, len(jobs), 2):
            layer = jobs[i][0]
            (QA, dA), (QG, dG) = found[i], found[i + 1]
            pi = K.pi_correction(layer.A, layer.G)
            layer.dA, layer.dG = K.damped_eigen(dA, dG, damping, pi)
            layer.QA, layer.QG = QA, QG

    def _precondition(self, lr: float) -> None:
        done, pre, grads = [], [], []
        for layer in self.layers:
            w, b = layer.module.weight, layer.module.bias
            if layer.QA is None or w.grad is None:
                continue
            bias_grad = None
            if b is not None:
                bias_grad = b.grad if b.grad is not None else torch.zeros_like(b)
            g = K.grad_matrix(w.grad, bias_grad).to(layer.dtype)
            pre.append(K.precondition(g, layer.QA, layer.dA, layer.QG, layer.dG))
            grads.append(g)
            done.append(layer)
        kl = self.config.kl_clip
        nu = K.kl_clip_scale(pre, grads, lr, kl) if kl > 0 and pre else None
        for layer, p in zip(done, pre, strict=True):
            if nu is not None:
                p = p * nu.to(p.device)
            b = layer.module.bias
            K.set_grad_matrix(p, layer.module.weight.grad,
                              b.grad if b is not None else None)
        self.kl_scale = nu

    # ------------------------------------------------------------------ reporting, state

    def stats(self) -> dict[str, float]:
        return {} if self.kl_scale is None else {"kfac_kl_scale": float(self.kl_scale)}

    def state_dict(self) -> dict[str, Any]:
        layers = {}
        for layer in self.layers:
            entry: dict[str, Any] = {k: None if (t := getattr(layer, k)) is None else t.clone()
                                     for k in _SAVED}
            entry["rows"] = layer.rows
            layers[layer.name] = entry
        return {"factor_updates": self.factor_updates, "layers": layers,
                "kl_scale": None if self.kl_scale is None else self.kl_scale.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["layers"]
        names = [layer.name for layer in self.layers]
        if sorted(saved) != sorted(names):
            raise ConfigError(f"kfac: the checkpoint preconditions layers {sorted(saved)}, this "
                              f"run {sorted(names)}; resume with the same model and kfac.layers")
        for layer in self.layers:
            entry, device = saved[layer.name], layer.module.weight.device
            for k in _SAVED:
                t = entry[k]
                setattr(layer, k, None if t is None else t.to(device).clone())
            layer.rows = float(entry["rows"])
        self._has_sums = any(layer.sum_A is not None for layer in self.layers)
        self.factor_updates = int(state["factor_updates"])
        nu = state.get("kl_scale")
        self.kl_scale = None if nu is None else nu.clone()


def _assign(jobs: list[tuple[_Layer, str]], world: int) -> list[int]:
    """Owner rank of each decomposition: largest first to the least-loaded rank (cost n³);
    the same answer on every rank."""
    sizes = [getattr(layer, which).shape[0] for layer, which in jobs]
    load, owner = [0] * world, [0] * len(jobs)
    for i in sorted(range(len(jobs)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i] ** 3
    return owner


def _all_reduce_grouped(groups: list[list[torch.Tensor]], group: Any) -> None:
    """Sum every tensor over `group` in place: one flat all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for ts in groups:
        for t in ts:
            by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        all_reduce_sum(flat, group=group)
        torch._foreach_copy_(ts, [v.view_as(t) for v, t in
                                  zip(flat.split([t.numel() for t in ts]), ts, strict=True)])


def _all_reduce_symmetric(sums: list[list[torch.Tensor]], group: Any) -> None:
    """`_all_reduce_grouped` for [symmetric, symmetric, count] triples, sending only the
    upper triangles of the symmetric matrices."""
    packed, iu = [], []
    for sa, sg, rows in sums:
        ia = torch.triu_indices(*sa.shape, device=sa.device)
        ig = torch.triu_indices(*sg.shape, device=sg.device)
        packed.append([sa[ia[0], ia[1]], sg[ig[0], ig[1]], rows])
        iu.append((ia, ig))
    _all_reduce_grouped(packed, group)
    for (sa, sg, rows), (pa, pg, prow), (ia, ig) in zip(sums, packed, iu, strict=True):
        for mat, vals, idx in ((sa, pa, ia), (sg, pg, ig)):
            mat[idx[0], idx[1]] = vals
            mat[idx[1], idx[0]] = vals
        rows.copy_(prow)


def attach_kfac(run: Any) -> KFAC:
    """Build the `KFAC` of `run.strategy.kfac` and register it on `run` (a grad hook after
    the `[adaptive]` one, so gradient statistics see the gradients K-FAC started from)."""
    kfac = KFAC(run.module, run.strategy.kfac, clock=run.clock, window=run.window,
                scaler=run.scaler, world=run.world, mesh=run.mesh,
                track_grad_norm=run.track_grad_norm)
    run.grad_hooks.append(kfac.on_grads)
    run.state_objects["kfac"] = kfac
    return kfac
