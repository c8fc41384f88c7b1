"""Pipeline stages: a model as a chain of layers, split into contiguous stages.

A model runs as a pipeline when it can be written as a chain of `Layer`s, each a
function of the previous one's output that uses some of the model's submodules.
Built-in models say so with a `pipeline_layers()` method; an `nn.Sequential` is
its children; any other model can define `pipeline_layers()` or pass the list to
`prepare(..., pipeline_layers=...)`. Stages are contiguous runs of layers: where
`[pipeline] split_points` name them, or balanced by parameter count.

A stage keeps the model object itself, pruned to the submodules its layers use,
with its `forward` replaced by the chain of those layers. Parameter names (FQNs)
are therefore the unsplit model's, so each stage's state dict, its DCP
checkpoint shards and a tensor-parallel plan all speak the same names, and a
checkpoint resumes under another pipeline degree by name.

Weights shared between layers on different stages (a language model's
embedding and LM head) live on both; `tied_groups` finds them so the schedule
can sum their gradients between the ranks that hold them, as Megatron and
DeepSpeed do for tied layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from bigbatch.errors import ConfigError

__all__ = ["Layer", "decoder_layers", "model_layers", "prune_to_stage", "split_layers",
           "tied_parameters"]


@dataclass(frozen=True)
class Layer:
    """One link of a model's chain: ``y = run(model, x)``, using only `modules`."""

    name: str
    """What `split_points` call it (usually its module's name, e.g. ``blocks.3``)."""
    modules: tuple[str, ...]
    """Names (as in `named_modules()`) of the submodules it uses."""
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """``run(model, x)``: this layer's output from its input."""


def _call(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.get_submodule(name)(x)


def module_layer(name: str) -> Layer:
    """The layer that calls submodule `name` on its input."""
    return Layer(name, (name,), functools.partial(_call, name))


def model_layers(model: nn.Module) -> list[Layer]:
    """`model.pipeline_layers()`, or an `nn.Sequential`'s children; else a ConfigError."""
    layers = getattr(model, "pipeline_layers", None)
    if callable(layers):
        return list(layers())
    if isinstance(model, nn.Sequential):
        return [module_layer(name) for name, _ in model.named_children()]
    raise ConfigError(
        f"[pipeline]: {type(model).__name__} is not a chain of layers bigbatch knows; give it "
        "a pipeline_layers() method or pass prepare(..., pipeline_layers=[...]) (for a "
        "decoder: bigbatch.parallel.pipeline.decoder_layers)")


def _embed(names: tuple[str, ...], run: Callable | None, model: nn.Module,
           ids: torch.Tensor) -> torch.Tensor:
    if run is not None:
        return run(model, ids)
    return model.get_submodule(names[0])(ids)


def _block(name: str, args: Callable | None, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    block = model.get_submodule(name)
    extra = () if args is None else args(x)
    out = block(x, **extra) if isinstance(extra, dict) else block(x, *extra)
    # Older Hugging Face blocks return (hidden_states, ...): only hidden states cross stages.
    return out[0] if isinstance(out, tuple) else out


def decoder_layers(model: nn.Module, *, embed: str | Sequence[str], blocks: str,
                   norm: str | None = None, head: str | None = None,
                   block_args: Callable[[torch.Tensor], tuple | dict] | None = None,
                   embed_run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                   shared: Sequence[str] = ()) -> list[Layer]:
    """The chain of a model shaped like Hugging Face's decoders: embeddings -> each block of
    the `nn.ModuleList` `blocks` -> `norm` -> `head` (module names, e.g. ``model.layers``).

    `block_args(x)`: what every block needs besides the hidden states ``x`` (rotary cos/sin,
    an attention mask), computed on the stage that runs the block from ``x`` alone, so
    only hidden states cross stages; a block runs as ``block(x, *block_args(x))``, or
    ``block(x, **block_args(x))`` when it returns a dict (Hugging Face's keyword
    ``position_embeddings=``). A block returning a tuple passes on its first item.
    `embed_run(model, ids)`: the embedding layer's computation when it is more than
    ``model.<embed>(ids)`` (GPT-2 adds position embeddings); `embed` then names every
    module it uses. `shared`: modules every block uses (a rotary module with buffers).
    """
    names = (embed,) if isinstance(embed, str) else tuple(embed)
    container = model.get_submodule(blocks)
    if not isinstance(container, nn.ModuleList):
        raise ConfigError(f"decoder_layers: {blocks!r} is {type(container).__name__}, not the "
                          "nn.ModuleList of the model's blocks")
    layers = [Layer("embed", names, functools.partial(_embed, names, embed_run))]
    layers += [Layer(f"{blocks}.{i}", (f"{blocks}.{i}", *shared),
                     functools.partial(_block, f"{blocks}.{i}", block_args))
               for i in range(len(container))]
    return layers + [module_layer(n) for n in (norm, head) if n is not None]


def _layer_params(model: nn.Module, layer: Layer) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for name in layer.modules:
        for p in model.get_submodule(name).parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def split_layers(model: nn.Module, layers: Sequence[Layer], stages: int,
                 split_points: Sequence[str] = ()) -> list[range]:
    """Layer index ranges of the `stages` stages, in order.

    `split_points`: the names of the layers where stages 2.. begin. Without them, the
    boundaries balance parameter counts (weights shared by several layers count once,
    at their first use).
    """
    names = [layer.name for layer in layers]
    if stages > len(layers):
        raise ConfigError(f"[pipeline]: {stages} stages but the model has only {len(layers)} "
                          f"layers ({', '.join(names)})")
    if split_points:
        starts = []
        for point in split_points:
            if point not in names:
                raise ConfigError(f"pipeline.split_points: no layer named {point!r}; layers: "
                                  f"{', '.join(names)}")
            starts.append(names.index(point))
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(f"pipeline.split_points={list(split_points)}: name layers after "
                              "the first, in model order, each once")
    else:
        starts = _balanced_starts(model, layers, stages)
    bounds = [0, *starts, len(layers)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _balanced_starts(model: nn.Module, layers: Sequence[Layer], stages: int) -> list[int]:
    seen: set[int] = set()
    sizes = []
    for layer in layers:
        new = [p for p in _layer_params(model, layer) if id(p) not in seen]
        seen.update(id(p) for p in new)
        sizes.append(sum(p.numel() for p in new))
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    starts: list[int] = []
    for s in range(1, stages):
        # Stage s+1 starts where the layers before hold closest to s/stages of the
        # parameters, leaving at least one layer for each stage.
        target = s * prefix[-1] / stages
        lo = (starts[-1] if starts else 0) + 1
        hi = len(layers) - (stages - s)
        starts.append(min(range(lo, hi + 1), key=lambda j: abs(prefix[j] - target)))
    return starts


def prune_to_stage(model: nn.Module, layers: Sequence[Layer], owned: Sequence[int]) -> nn.Module:
    """`model`, in place, keeping only the submodules the `owned` layers use; its forward
    runs those layers in order. Names of what is kept are unchanged."""
    keep = {name for i in owned for name in layers[i].modules}
    for name, _ in sorted(model.named_modules(), key=lambda item: -item[0].count(".")):
        if not name or _related(name, keep):
            continue
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        owner._modules.pop(child, None)  # pop, not del: Sequential keeps its other keys
    model.forward = functools.partial(_run_layers, model, [layers[i] for i in owned])
    return model


def _related(name: str, keep: set[str]) -> bool:
    """`name` is kept, or inside or around something kept."""
    return any(name == k or name.startswith(k + ".") or k.startswith(name + ".") for k in keep)


LAYER_ATTR = "bigbatch_layer"
"""Set on an exception raised inside a layer: the layer's name."""


def _run_layers(model: nn.Module, layers: Sequence[Layer], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        try:
            x = layer.run(model, x)
        except Exception as e:
            if not hasattr(e, LAYER_ATTR):  # the innermost layer names it
                setattr(e, LAYER_ATTR, layer.name)
            raise
    return x


class Chunk(nn.Module):
    """One of several stages on a rank (interleaved schedules): runs `layers` of `model`
    without registering it, so parameters keep their names in `model` alone.

    `hold`: also register the submodules its layers use (in `held`), so the chunk's own
    `parameters()` are its stage's, as a wrapper such as DDP needs; names in `model`
    (state dicts, checkpoints) are unchanged."""

    def __init__(self, model: nn.Module, layers: Sequence[Layer], hold: bool = False) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)
        self._layers = list(layers)
        if hold:
            names = dict.fromkeys(name for layer in layers for name in layer.modules)
            self.held = nn.ModuleList(model.get_submodule(name) for name in names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_layers(self._model, self._layers, x)


def tied_parameters(model: nn.Module, layers: Sequence[Layer], stages: Sequence[range]
                    ) -> list[tuple[str, nn.Parameter, tuple[int, ...]]]:
    """Parameters used by layers of more than one stage, before pruning: (its first name,
    the Parameter, those stages), in an order every rank computes alike."""
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), (name, p))
    users: dict[int, set[int]] = {}
    for s, owned in enumerate(stages):
        for i in owned:
            for p in _layer_params(model, layers[i]):
                users.setdefault(id(p), set()).add(s)
    return sorted((*first[pid], tuple(sorted(s))) for pid, s in users.items() if len(s) > 1)
