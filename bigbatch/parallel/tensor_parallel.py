"""Megatron-style tensor parallelism on torch's DTensor: plans, vocabulary padding, loss parallel.

    plan = {"tok_emb": "vocab_embedding", "blocks.*.attn.qkv": "colwise",
            "blocks.*.attn.proj": "rowwise", "head": "vocab_head"}
    apply_tensor_parallel(model, tp_mesh, plan)      # in place; returns the model
    with loss_parallel_if(model):                    # forward + loss + backward
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
        loss.backward()
    state = unpadded_state_dict(model)               # on every rank: full, plain, unpadded

A plan is a dict {module name: style} (a name may hold `*` for one level, as in
`parallelize_module`) or a callable `parallelize(model, mesh) -> model`. A style is a
torch `ParallelStyle` or one of `STYLES`:

- `colwise`, `rowwise`: `ColwiseParallel()` / `RowwiseParallel()` (Megatron's column- and
  row-parallel linear layers: local outputs in between, one all-reduce after the row).
- `vocab_embedding`: an `nn.Embedding` split on the vocabulary (rows), ids replicated in,
  embeddings replicated out (`RowwiseParallel(input_layouts=Replicate())`).
- `vocab_head`: an `nn.Linear` LM head split on the vocabulary; its output stays a DTensor
  sharded on the last dim, for `loss_parallel` (the full logits are never gathered).
- `conv1d_colwise`, `conv1d_rowwise`: the same splits for a layer whose weight is stored
  ``(in, out)``, as Hugging Face's ``Conv1D`` (GPT-2): ``x @ weight + bias``.
- `replicate`: a module's parameters become Replicate DTensors (whole on every rank),
  plain tensors in and out. `replicate_rest=True` gives it to every module the plan leaves
  out, so that all parameters are DTensors (torch's `clip_grad_norm_`, `GradScaler` and
  `_foreach` norms refuse lists that mix DTensors and plain tensors).

The vocabulary modules of a dict plan are padded with zero rows to a multiple of the
tensor degree or of `vocab_multiple` (Megatron's make-vocab-size-divisible-by); padded logits get -inf, so they
have probability 0 and gradient 0 and the padded rows stay exactly 0 under LARS/LAMB.
Parameters tied before (an embedding and its LM head) are one Parameter after.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from bigbatch.errors import ConfigError
from bigbatch.parallel.tp_styles import ReplicateParallel, TransposedColwise, TransposedRowwise

Style = str | ParallelStyle
Plan = Mapping[str, Style] | Callable[[nn.Module, DeviceMesh], nn.Module]


#: Our style names -> (module types they apply to, the torch style they stand for).
STYLES: dict[str, tuple[tuple[type, ...], Callable[[], ParallelStyle]]] = {
    "colwise": ((nn.Linear, nn.Embedding), ColwiseParallel),
    "rowwise": ((nn.Linear, nn.Embedding), RowwiseParallel),
    "vocab_embedding": ((nn.Embedding,), lambda: RowwiseParallel(input_layouts=Replicate())),
    "vocab_head": ((nn.Linear,), lambda: ColwiseParallel(
        input_layouts=Replicate(), use_local_output=False)),
    "replicate": ((nn.Module,), ReplicateParallel),
    "conv1d_colwise": ((nn.Module,), TransposedColwise),
    "conv1d_rowwise": ((nn.Module,), TransposedRowwise),
}
VOCAB_STYLES = ("vocab_embedding", "vocab_head")

UNPADDED = "vocab_size_unpadded"
"""Attribute set on a padded module: its real number of vocabulary rows."""
SHARDED_LOGITS = "vocab_sharded_output"
"""Attribute set on a module whose output is a DTensor sharded on the vocabulary (last dim);
a callable plan that makes one sets it too, or passes `loss_parallel=True`."""


def expand_plan(model: nn.Module, plan: Mapping[str, Style]) -> dict[str, Style]:
    """`plan` with wildcards resolved to module names (plan order, then model order); ConfigError on a name
    that matches no module or a style that is unknown or does not fit the module."""
    modules = dict(model.named_modules())
    out: dict[str, Style] = {}
    for pattern, style in plan.items():
        parts = pattern.split(".")
        names = [n for n in modules if n and _match(n.split("."), parts)]
        if not names:
            raise ConfigError(f"tensor-parallel plan: {pattern!r} names no module of "
                              f"{type(model).__name__}")
        for name in names:
            _check_style(name, modules[name], style)
            out[name] = style
    return out


def present_plan(model: nn.Module, plan: Plan) -> Plan:
    """`plan` without the entries that name no module of `model`: a pipeline stage holds
    only some of the layers the whole model's plan names. Callables pass through."""
    if callable(plan):
        return plan
    names = [n.split(".") for n in dict(model.named_modules()) if n]
    return {p: s for p, s in plan.items() if any(_match(n, p.split(".")) for n in names)}


def _match(atoms: list[str], parts: list[str]) -> bool:
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(a, p)
                                            for a, p in zip(atoms, parts, strict=True))


def _check_style(name: str, module: nn.Module, style: Style) -> None:
    if isinstance(style, ParallelStyle):
        return
    if not isinstance(style, str) or style not in STYLES:
        raise ConfigError(f"tensor-parallel plan: style {style!r} of {name!r} is unknown; "
                          f"valid: {', '.join(STYLES)} or a torch ParallelStyle")
    types, _ = STYLES[style]
    if not isinstance(module, types):
        raise ConfigError(f"tensor-parallel plan: style {style!r} needs "
                          f"{' or '.join(t.__name__ for t in types)}; {name!r} is "
                          f"{type(module).__name__}")


def check_plan(model: nn.Module, plan: Plan, degree: int) -> None:
    """The checks `apply_tensor_parallel` makes, without a mesh (for a launcher's preflight
    on a throwaway model): names and styles exist, and every dimension a named style
    splits is divisible by `degree` (vocabulary dims are padded instead)."""
    if degree < 1:
        raise ConfigError(f"tensor_parallel_degree={degree} is out of range; allowed: >= 1")
    if callable(plan):
        return
    for name, style in expand_plan(model, plan).items():
        module = model.get_submodule(name)
        if style in ("conv1d_colwise", "conv1d_rowwise"):  # weight (in, out)
            dim = 1 if style == "conv1d_colwise" else 0
            if getattr(module, "weight", torch.empty(0, 0)).ndim == 2 and (
                    module.weight.shape[dim] % degree):
                raise ConfigError(f"tensor-parallel plan: {name}.weight dim {dim} "
                                  f"({module.weight.shape[dim]}) is not divisible by "
                                  f"tensor_parallel_degree={degree}")
        elif style in ("colwise", "rowwise") and isinstance(module, nn.Linear):
            features = "out_features" if style == "colwise" else "in_features"
            size = getattr(module, features)
            if size % degree:
                raise ConfigError(f"tensor-parallel plan: {name}.{features}={size} is not "
                                  f"divisible by tensor_parallel_degree={degree}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: Plan, *,
                          vocab_multiple: int | None = None,
                          loss_parallel: bool | None = None,
                          replicate_rest: bool = False) -> nn.Module:
    """Split `model` in place over the 1-D `tp_mesh` by `plan`; return it.

    A dict plan's vocabulary modules are first padded to a multiple of `vocab_multiple`
    (default: the degree; it must be a multiple of the degree). One multiple for every
    degree a job may use (e.g. 8) keeps the padded shapes, hence sharded checkpoints,
    the same across degrees. A callable plan does its own padding
    (`pad_vocab`) and says whether its output is vocab-sharded with `loss_parallel`
    (or the `SHARDED_LOGITS` attribute); a dict plan's `vocab_head` implies it.
    Parameters tied before stay one Parameter; tied ones must get the same placements.
    `replicate_rest`: the parameters no style split become Replicate DTensors (see
    `ReplicateParallel`), so that every parameter is a DTensor.
    """
    degree = tp_mesh.size()
    check_plan(model, plan, degree)
    multiple = degree if vocab_multiple is None else vocab_multiple
    if multiple < 1 or multiple % degree:
        raise ConfigError(f"vocab_multiple={multiple} is not a multiple of "
                          f"tensor_parallel_degree={degree}")
    tied = _tied_parameters(model)
    if callable(plan):
        model = plan(model, tp_mesh)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"tensor-parallel plan: the callable returned "
                              f"{type(model).__name__}, not the nn.Module")
    else:
        styles = expand_plan(model, plan)
        vocab = [n for n, s in styles.items() if s in VOCAB_STYLES]
        pad_vocab(model, vocab, multiple)
        for name, style in styles.items():
            if style == "vocab_head":
                setattr(model.get_submodule(name), SHARDED_LOGITS, True)
        parallelize_module(model, tp_mesh, {n: s if isinstance(s, ParallelStyle)
                                            else STYLES[s][1]() for n, s in styles.items()})
    if replicate_rest:
        for name, module in model.named_modules():
            if all(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
                continue
            if next(module.children(), None) is not None:
                # Its inputs would become DTensors inside the children's forward too.
                raise ConfigError(f"replicate_rest: {name or type(model).__name__!r} has "
                                  f"parameters of its own and submodules; give it a style")
            parallelize_module(module, tp_mesh, ReplicateParallel())
    _retie(model, tied)
    if loss_parallel is not None:
        setattr(model, SHARDED_LOGITS, loss_parallel)
    return model


def _tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that hold one Parameter, for groups of 2+."""
    by_id: dict[int, list[tuple[str, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            by_id.setdefault(id(p), []).append((mname, pname))
    # The same module reached by two paths is not a tie: keep one path per module object.
    groups = []
    for refs in by_id.values():
        seen, unique = set(), []
        for mname, pname in refs:
            key = (id(model.get_submodule(mname)), pname)
            if key not in seen:
                seen.add(key)
                unique.append((mname, pname))
        if len(unique) > 1:
            groups.append(unique)
    return groups


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    # parallelize_module distributes each module's parameters on its own, so a tie becomes
    # two DTensors with equal values; the first one takes the others' places.
    for refs in groups:
        params = [getattr(model.get_submodule(m), p) for m, p in refs]
        first = params[0]
        for (mname, pname), p in zip(refs[1:], params[1:], strict=True):
            if p is first:
                continue
            where = [(type(q).__name__, getattr(q, "placements", None)) for q in (first, p)]
            if where[0] != where[1] or first.shape != p.shape:
                raise ConfigError(
                    f"tensor-parallel plan: {_fqn(*refs[0])} and {_fqn(mname, pname)} are tied "
                    f"but split differently ({where[0]} vs {where[1]}); give both modules "
                    f"styles that shard the same dim")
            setattr(model.get_submodule(mname), pname, first)


def _fqn(module: str, param: str) -> str:
    return f"{module}.{param}" if module else param


def pad_vocab(model: nn.Module, names: list[str], multiple: int) -> None:
    """Pad the vocabulary rows of modules `names` (`nn.Embedding`: rows of `weight`;
    `nn.Linear`: rows of `weight` and `bias`) with zeros to a multiple of `multiple`, in
    place, keeping ties; a padded Linear's padded outputs become -inf (masked out of the
    loss). Each padded module records its real size in the attribute `UNPADDED`."""
    new: dict[int, nn.Parameter] = {}
    for name in names:
        module = model.get_submodule(name)
        rows = module.weight.shape[0]
        real = getattr(module, UNPADDED, rows)
        padded = -(-real // multiple) * multiple
        if padded == rows:
            continue
        if rows != real:
            raise ConfigError(f"{name!r} is already padded to {rows} rows; not to {padded}")
        for pname in ("weight", "bias"):
            p = getattr(module, pname, None)
            if p is None:
                continue
            if id(p) not in new:
                with torch.no_grad():
                    grown = torch.cat([p, p.new_zeros((padded - rows, *p.shape[1:]))])
                new[id(p)] = nn.Parameter(grown, requires_grad=p.requires_grad)
            setattr(module, pname, new[id(p)])
        setattr(module, UNPADDED, real)
        if isinstance(module, nn.Embedding):
            module.num_embeddings = padded
        else:
            module.out_features = padded
            module.register_forward_hook(_mask_padded_logits)


def _mask_padded_logits(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    real = getattr(module, UNPADDED)
    mask = torch.zeros(out.shape[-1], dtype=out.dtype, device=out.device)
    mask[real:] = float("-inf")
    if isinstance(out, DTensor):
        # Replicated on every rank already: no communication, each shard adds its slice.
        mask = DTensor.from_local(mask, out.device_mesh, [Replicate()] * out.device_mesh.ndim,
                                  run_check=False)
    return out + mask


def uses_loss_parallel(model: nn.Module) -> bool:
    """Whether `model`'s output is a DTensor sharded on the vocabulary (see `SHARDED_LOGITS`)."""
    if hasattr(model, SHARDED_LOGITS):
        return bool(getattr(model, SHARDED_LOGITS))
    return any(getattr(m, SHARDED_LOGITS, False) for m in model.modules())


_active = [0]  # depth of loss_parallel_if contexts: torch's loss_parallel does not nest


@contextlib.contextmanager
def loss_parallel_if(flag: bool | nn.Module | torch.Tensor) -> Iterator[None]:
    """torch's `loss_parallel()` when `flag` says so: True, a model for which
    `uses_loss_parallel`, or a DTensor of logits. Enter it around forward, loss and backward
    (cross-entropy and its backward must both run inside). Nests, unlike `loss_parallel()`."""
    if isinstance(flag, nn.Module):
        flag = uses_loss_parallel(flag)
    elif isinstance(flag, torch.Tensor):
        flag = isinstance(flag, DTensor) and any(p.is_shard(flag.ndim - 1) or
                                                 p.is_shard(-1) for p in flag.placements)
    if not flag or _active[0]:
        yield
        return
    _active[0] += 1
    try:
        with loss_parallel():
            yield
    finally:
        _active[0] -= 1


def is_padded(model: nn.Module) -> bool:
    """Whether `pad_vocab` grew any of `model`'s modules."""
    return any(hasattr(m, UNPADDED) for m in model.modules())


def unpadded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model as plain tensors, vocabulary padding sliced off: the keys and shapes of
    the model before `apply_tensor_parallel`. A collective: every rank of the mesh calls it."""
    cut = {}
    for mname, module in model.named_modules():
        if hasattr(module, UNPADDED):
            for pname, _ in module.named_parameters(recurse=False):
                cut[_fqn(mname, pname)] = getattr(module, UNPADDED)
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value[: cut[key]].detach().clone() if key in cut else value.detach()
    return out


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """`loss` as a plain tensor (a DTensor from `loss_parallel` is replicated: no
    communication); gradients flow through unchanged."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
