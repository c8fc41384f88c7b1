"""The engine: ``prepare()`` turns a model and a Strategy into a ``Run`` that owns the
micro-step (gradient merge, AMP and loss scaling, clipping, the optimizer step and
the learning rate), the gradient statistics and the ``[adaptive]`` controller."""

from .run import Run, prepare

__all__ = ["Run", "prepare"]
