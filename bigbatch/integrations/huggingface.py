"""bigbatch in a Hugging Face ``transformers.Trainer``: the noise scale as a callback, and
the LR range test on the Trainer's model, optimizer and data.

    from bigbatch.integrations.huggingface import NoiseScaleCallback, lr_find

    trainer = Trainer(model, args, train_dataset=data, optimizers=(optimizer, scheduler),
                      callbacks=[NoiseScaleCallback()])

What the Trainer leaves in ``.grad`` (transformers 5): after the first micro-batch's
backward, that micro-batch's mean gradient times a weight; before the optimizer step the
merged mean gradient, all ranks', already clipped when ``max_grad_norm > 0``. The weight
is ``1 / k`` for ``k`` micro-batches when the loss is a mean divided by ``k``; when the
model takes ``num_items_in_batch`` (causal LMs with ``labels``) the loss is a sum over
the micro-batch's ``n_1`` label tokens over the window's count ``N`` (all ranks' with
``average_tokens_across_devices``, the loss then multiplied by the world size ``W``), so
the weight is ``n_1 W / N``. The callback reads ``labels`` and ``num_items_in_batch``
from the model's forward call and counts ``n_1`` as the Trainer does (``labels[..., 1:]``
for a loss that shifts them). A causal LM whose ``loss_type`` is None (GPT-2) has its
labels counted unshifted, one token a row more than its loss uses: the callback warns
and names the fix (``model.loss_type = "ForCausalLM"``). Batch sizes are in examples (rows); with varying token
counts per row the estimate is in average rows.

What it cannot do: change the batch. ``gradient_accumulation_steps`` and
``per_device_train_batch_size`` are fixed for a Trainer run (its data loader and step
count are built from them), so the automatic batch schedule (``batch.schedule``) is
refused here; ``gns/b_simple`` says which batch to resume at. Nor measure a step whose
gradient the Trainer clipped (its norm before clipping is not handed to callbacks):
those steps are left out and counted (``probe.clipped``); ``max_grad_norm=0`` measures
every step. A ``compute_loss_func`` normalises in ways the callback cannot see: refused.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import TrainerCallback

from bigbatch.adaptive.gns import GradientNoiseScale
from bigbatch.errors import ConfigError
from bigbatch.integrations.probe import NoiseProbe, merged_loss, sweep_at_peak

__all__ = ["NoiseScaleCallback", "lr_find"]


def _shifts_labels(model: torch.nn.Module) -> bool:
    """The Trainer's rule: a causal-LM loss predicts ``labels[..., 1:]``."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    config = getattr(model, "config", None)
    return (LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
            and not getattr(config, "is_encoder_decoder", False))


def _miscounts(model: torch.nn.Module) -> bool:
    """The loss shifts the labels but the Trainer counts all of them (a model whose
    ``loss_type`` is None, GPT-2's: its loss falls back to the causal-LM loss)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    config = getattr(model, "config", None)
    return (not _shifts_labels(model) and getattr(model, "loss_function", None) is ForCausalLMLoss
            and not getattr(config, "is_encoder_decoder", False))


def _rows(inputs: dict[str, Any]) -> int:
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ConfigError("NoiseScaleCallback: the model's forward got no tensor argument to "
                      "count the micro-batch's rows from")


class NoiseScaleCallback(TrainerCallback):
    """Logs the gradient noise scale (``gns/b_simple``, the critical-batch estimate in
    examples) of a ``transformers.Trainer`` run.

    Args:
        gns: the estimator to fold the steps into (default a new `GradientNoiseScale`).
        batch_schedule: only None or "fixed": the Trainer cannot change its batch in a
            run (see the module).

    Needs ``gradient_accumulation_steps >= 2``: the first micro-batch and the merged
    batch are the two batch sizes (with one micro-batch per step there is one size, and
    under DDP the local gradient is gone at the backward). The values go into the
    Trainer's logs (``trainer.state.log_history``, and the ``logs`` of callbacks after
    this one) and `history` (one dict per measured step).
    """

    def __init__(self, gns: GradientNoiseScale | None = None, *,
                 batch_schedule: str | None = None) -> None:
        if batch_schedule not in (None, "fixed"):
            raise ConfigError(
                f"batch_schedule={batch_schedule!r}: a transformers.Trainer run keeps "
                "gradient_accumulation_steps and per_device_train_batch_size fixed, so the "
                "batch cannot grow inside it; log gns/b_simple here and resume at the batch "
                "it reaches, or use bigbatch.integrations.lightning / bigbatch train")
        self.probe = NoiseProbe(gns)
        self.history: list[dict[str, float]] = []
        self._params: list[torch.nn.Parameter] = []
        self._hook: Any = None
        self._shift = False
        self._capture = False
        self._first: dict[str, Any] | None = None
        self._micro = 0
        self._warned = False

    @property
    def gns(self) -> GradientNoiseScale:
        return self.probe.gns

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._shift = _shifts_labels(model)
        if _miscounts(model):
            warnings.warn(
                f"NoiseScaleCallback: {type(model).__name__} has loss_type=None, so the Trainer "
                "divides its causal-LM loss by every label token, position 0 of each row "
                "included, which the shifted loss never predicts: its gradient is (tokens "
                "used / tokens counted) times the mean. For the exact big-batch gradient set "
                "model.loss_type = 'ForCausalLM' before building the Trainer (or labels[:, 0] "
                "= -100)", UserWarning, stacklevel=2)
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_pre_hook(self._record, with_kwargs=True)
        if args.gradient_accumulation_steps < 2:
            warnings.warn("NoiseScaleCallback: gradient_accumulation_steps=1 gives one batch "
                          "size a step; the noise scale needs >= 2 (nothing is logged)",
                          UserWarning, stacklevel=2)

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """The first training forward of a step: its rows, label tokens and the window's
        count (``num_items_in_batch``), when the Trainer passed one."""
        if not (self._capture and module.training):
            return
        self._capture = False
        labels, n_items = kwargs.get("labels"), kwargs.get("num_items_in_batch")
        tokens = None
        if n_items is not None and isinstance(labels, torch.Tensor):
            counted = kwargs.get("shift_labels")
            if counted is None:
                counted = labels[..., 1:] if self._shift else labels
            tokens = float(counted.ne(-100).sum())
            n_items = float(n_items.sum() if isinstance(n_items, torch.Tensor) else n_items)
        rows = _rows(kwargs) if kwargs else int(args[0].shape[0])
        self._first = {"rows": rows, "tokens": tokens, "items": n_items}

    def on_step_begin(self, args, state, control, **kwargs):
        self._micro = 0
        self._first = None
        self._capture = True
        self.probe.forget()

    def on_substep_end(self, args, state, control, **kwargs):
        if self._micro == 0 and self._first is not None:
            self.probe.first_micro(self._params, self._first["rows"])
        self._micro += 1

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        k = self._micro + 1
        first = self._first
        if k < 2 or first is None:
            return
        if first["tokens"] is not None:  # sum over tokens / the window's count (x W)
            world = args.world_size if args.average_tokens_across_devices else 1
            if not first["tokens"] > 0:
                self.probe.forget()
                return
            weight = first["tokens"] * world / first["items"]
        else:
            weight = 1.0 / k
        est = self.probe.merged(self._params, first["rows"] * k * args.world_size, weight,
                                clip=float(args.max_grad_norm or 0.0))
        if est is None:
            if self.probe.clipped and not self._warned:
                self._warned = True
                warnings.warn("NoiseScaleCallback: the Trainer clipped this step's gradient "
                              f"(max_grad_norm={args.max_grad_norm}) before callbacks see "
                              "it; clipped steps are left out of the noise scale "
                              "(max_grad_norm=0 measures every step)", UserWarning,
                              stacklevel=2)
            return
        self.history.append({"step": state.global_step + 1, **self.probe.stats()})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self.probe.gns.steps == 0:
            return
        stats = self.probe.stats()
        logs.update(stats)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(stats)

    def state_dict(self) -> dict[str, Any]:
        """The estimator's state (save it beside the Trainer's checkpoint)."""
        return {"gns": self.probe.gns.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.probe.gns.load_state_dict(state["gns"])


def lr_find(trainer: Any, *, lr_min: float = 1e-5, lr_max: float = 10.0, steps: int = 100,
            **kwargs: Any) -> Any:
    """`bigbatch.lr_find` on a Trainer's model, optimizer and training data, before
    ``trainer.train()``: each step merges ``gradient_accumulation_steps`` micro-batches
    of the Trainer's loader (the loss ``trainer.compute_loss`` gives, a mean per
    micro-batch). The optimizer is the one passed in ``optimizers=`` or the one the
    Trainer builds; model and optimizer are put back afterwards. One process: the model
    is not yet wrapped for data parallelism before ``train()``."""
    from bigbatch.train.lr_range import lr_find as _lr_find

    args = trainer.args
    if args.world_size > 1:
        raise ConfigError(f"lr_find(trainer): {args.world_size} processes; the Trainer wraps "
                          "the model for data parallelism only inside train(), so run the "
                          "range test on one process")
    if trainer.optimizer is None:
        trainer.create_optimizer()
    k = max(1, int(args.gradient_accumulation_steps))
    loader = trainer.get_train_dataloader()

    def windows():
        window: list[Any] = []
        for batch in loader:
            window.append(batch)
            if len(window) == k:
                yield window
                window = []

    def loss_fn(model: torch.nn.Module, window: list[dict[str, Any]]) -> torch.Tensor:
        losses = []
        for i, inputs in enumerate(window):
            inputs = {key: v.to(args.device) if isinstance(v, torch.Tensor) else v
                      for key, v in inputs.items()}
            loss = trainer.compute_loss(model, inputs)
            losses.append(loss)
            if i < len(window) - 1:
                (loss / len(window)).backward()
        return merged_loss(losses)

    trainer.model.train()
    return sweep_at_peak(trainer.optimizer, lambda: _lr_find(
        trainer.model, loss_fn, windows(), trainer.optimizer, lr_min=lr_min, lr_max=lr_max,
        steps=steps, **kwargs), getattr(trainer, "lr_scheduler", None))
