"""Built-in tasks (data + models + loss + evaluation) for `bigbatch train` and `bigbatch study`.

    task = get_task("mnist1d", num_samples=50_000)
    model = task.build_model("cnn")
    loss_sum, count = task.loss(model(x), (x, y))
    task.evaluate(model, test_loader)  # {"loss": ..., "accuracy": ...}
"""

from __future__ import annotations

import inspect

from bigbatch.errors import ConfigError
from bigbatch.tasks._base import Recipe, Task, cache_dir

__all__ = ["TASKS", "Recipe", "Task", "cache_dir", "get_task", "task_class"]

#: Task name -> "module:Class"; imported lazily so `bigbatch --help` stays fast.
TASKS = {
    "mnist1d": "bigbatch.tasks.mnist1d:MNIST1D",
    "charlm": "bigbatch.tasks.charlm:CharLM",
}


def task_class(name: str) -> type[Task]:
    """The class of task `name`, or a ConfigError listing the valid names."""
    if name not in TASKS:
        raise ConfigError(f"task={name!r} is not a built-in task; valid: {', '.join(TASKS)}")
    import importlib

    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_task(name: str, **options) -> Task:
    """Build task `name` with constructor `options` (ConfigError on unknown names or options)."""
    cls = task_class(name)
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ConfigError(
            f"task option {unknown[0]!r} is not an option of task {name!r}; "
            f"valid: {', '.join(params)}"
        )
    task = cls(**options)
    # Measured baselines hold for the default data and model sizes only.
    task.default_options = all(params[k].default == v for k, v in options.items())
    return task
