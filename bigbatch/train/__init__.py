"""The main job (``bigbatch train``): the trainer loop, atomic checkpoints and resume,
progress and metrics."""

from .trainer import TrainConfig, train

__all__ = ["TrainConfig", "train"]
