"""Batch-size -> learning-rate rules.

A recipe tuned at a small *base* batch B (learning rate ``base_lr``) is moved to
a global batch of ``S * B`` samples by multiplying the learning rate with a
function of the scale ``S = global_batch_size / base_batch_size``:

- ``"linear"``: ``lr = base_lr * S``. One step on ``S*B`` samples should move the
  weights about as far as ``S`` steps on ``B`` samples, which is only true while
  the weights change slowly; hence gradual warmup early in training.
  Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
  arXiv:1706.02677.
- ``"sqrt"``: ``lr = base_lr * sqrt(S)``. Averaging ``S`` times more samples
  divides the gradient variance by ``S``; growing the step by ``sqrt(S)`` keeps the
  variance of the update what it was at the base batch.
  Krizhevsky 2014, "One weird trick for parallelizing convolutional neural
  networks", arXiv:1404.5997; Hoffer et al. 2017, "Train longer, generalize
  better", arXiv:1705.08741. Common with Adam/LAMB-style optimizers.
- ``"none"``: ``lr = base_lr``. Layer-wise adaptive optimizers (LARS, LAMB) are
  often tuned directly at the large batch, and AdaScale supplies its own gain.

Pure functions: no torch state, no config objects. The per-step schedule
(warmup, decay) lives in :mod:`bigbatch.config.schedules`.
"""

import math

RULES = ("linear", "sqrt", "none")
"""Names accepted by :func:`scale_factor` and :func:`scale_lr`."""


def scale_factor(scale: float, rule: str) -> float:
    """Multiplier applied to the base learning rate at batch scale ``scale``.

    ``scale`` is ``global_batch_size / base_batch_size`` and must be > 0; a scale
    below 1 (a batch smaller than the base) shrinks the learning rate by the same
    rule.
    """
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"batch scale must be a finite number > 0, got {scale!r}")
    if rule == "linear":
        return float(scale)
    if rule == "sqrt":
        return math.sqrt(scale)
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown scaling rule {rule!r}; expected one of {', '.join(RULES)}")


def scale_lr(base_lr: float, scale: float, rule: str) -> float:
    """Learning rate for a batch ``scale`` times the base batch, by ``rule``.

    >>> scale_lr(0.1, 32, "linear")
    3.2
    >>> scale_lr(0.1, 4, "sqrt")
    0.2
    """
    return base_lr * scale_factor(scale, rule)
