"""Workers and their process groups on torch.distributed: the World, group set-up
and teardown, and data parallelism (DDP with the engine's comm hook)."""

from .world import World, init_distributed, teardown

__all__ = ["World", "init_distributed", "teardown"]
