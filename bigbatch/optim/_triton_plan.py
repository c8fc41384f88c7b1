"""Host side of the Triton kernels: a step's tensors as device tables, and where to get the kernels.

A step hands the kernels (``_triton_kernels``) every tensor at once: their
addresses in one int64 table (a row per role: weight, gradient, each state),
and the chunks each program takes. Building the tables costs a host-to-device
copy, so the caller's workspace keeps them while the tensors stay where they are (the
usual case: parameters and state never move, and the caching allocator hands
gradients the same blocks every step); a CUDA graph replays a step only with
the tensors it was captured with, so its step always finds its tables.

Layouts. A kernel walks each tensor's memory in order, so all tensors of one
parameter must be dense with the parameter's strides (transposed and
``channels_last`` weights are; their state is made with ``zeros_like``). A
tensor that is not (a non-dense view, a gradient laid out unlike its
parameter) is staged: copied into a dense buffer for the step, and copied
back after it when the kernels write it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._base import fusable
from ._norms import any_dtensor, local

# Elements per program, elements per vector operation inside it (16 per thread at 8
# warps), warps per program. On an H200 (benchmarks/NOTES-gpu.md) this beat 16 K / 1024 /
# 4 and 16 K / 2048 / 4 on both BERT-large and ResNet-50 shapes, by 2-11 %: fewer, longer
# programs (BERT-large: ~5.3 K of them; ResNet-50: ~550) and fewer partial norms to add.
CHUNK = 1 << 16
BLOCK = 4096
NUM_WARPS = 8
# Chunks a reduction program adds per vector operation.
REDUCE_BLOCK = 256
# Steps (address tables) kept per workspace: gradients may alternate between a few blocks.
TABLES_KEPT = 4

_KERNELS = Path(__file__).with_name("_triton_kernels.py")


def kernels(device: torch.device):
    """The kernels module for tensors on ``device``: compiled for CUDA; for CPU
    tensors, run by Triton's interpreter, only under ``TRITON_INTERPRET=1``.

    Each mode is its own module instance (Triton picks the mode when a kernel
    is defined), so interpreted tests and compiled CUDA tests share a process.
    """
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("kernel='triton' needs CUDA tensors; on CPU it runs only through "
                               "Triton's interpreter (TRITON_INTERPRET=1, for tests)")
        interpret = True
    elif device.type == "cuda":
        interpret = False
    else:
        raise RuntimeError(f"kernel='triton' needs CUDA tensors, got {device.type}")
    name = __package__ + "._triton_kernels" + ("_interpreted" if interpret else "")
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, _KERNELS)
        module = importlib.util.module_from_spec(spec)
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            spec.loader.exec_module(module)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
        sys.modules[name] = module
    return module


def launch(kernel, grid: int, *args, **meta) -> None:
    """One kernel launch over ``grid`` programs (the tests count these calls)."""
    kernel[(grid,)](*args, num_warps=NUM_WARPS, **meta)


def _device_table(values: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(device tensor, host tensor) of int64 ``values``; the copy is asynchronous
    (from pinned memory on CUDA), and the host tensor is kept with the device
    one so that a graph which captured the copy still finds it."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True), host


@dataclass
class Layout:
    """Chunks of a list of tensor sizes, as device arrays, and the step's scratch."""

    chunk_tensor: torch.Tensor   # [C] tensor of each chunk
    chunk_start: torch.Tensor    # [C] its first element
    numel: torch.Tensor          # [T]
    first_chunk: torch.Tensor    # [T + 1] chunk range of each tensor
    positions: torch.Tensor      # [T] each tensor's place in the caller's order
    starts: list[int]            # first chunk of each tensor, on the host
    partials: torch.Tensor       # [2C] per-chunk sums of squares
    squares: torch.Tensor        # [2T] per-tensor sums of squares
    scalars: torch.Tensor        # [T] a float64 per tensor, from the first pass to the second
    ratios: torch.Tensor         # [T] trust ratios nobody asked for
    host: list[torch.Tensor] = field(default_factory=list)
    _grad_partials: torch.Tensor | None = None
    _grad_squares: torch.Tensor | None = None

    @classmethod
    def build(cls, numels: list[int], positions: list[int], device) -> Layout:
        chunks = [max(1, math.ceil(n / CHUNK)) for n in numels]
        starts = [0]
        for k in chunks:
            starts.append(starts[-1] + k)
        tensor_of = [t for t, k in enumerate(chunks) for _ in range(k)]
        start_of = [j * CHUNK for k in chunks for j in range(k)]
        arrays, host = zip(*(_device_table(v, device) for v in
                             (tensor_of, start_of, numels, starts, positions)), strict=True)
        f64 = dict(dtype=torch.float64, device=device)
        return cls(*arrays, starts, torch.zeros(2 * starts[-1], **f64),
                   torch.zeros(2 * len(numels), **f64), torch.zeros(len(numels), **f64),
                   torch.zeros(len(numels), **f64), list(host))

    def grad_partials(self) -> torch.Tensor:
        """[C] per-chunk sums of squares of the gradients (for clipping)."""
        if self._grad_partials is None:
            self._grad_partials = torch.zeros_like(self.partials[: len(self.chunk_tensor)])
        return self._grad_partials

    def grad_squares(self) -> torch.Tensor:
        """[T] per-tensor sums of squares of the gradients (for clipping)."""
        if self._grad_squares is None:
            self._grad_squares = torch.zeros_like(self.scalars)
        return self._grad_squares


@dataclass
class Bucket:
    """Consecutive tensors (in the step's order) of one group and one pair of dtypes."""

    opts: dict
    weight_dtype: torch.dtype
    state_dtype: torch.dtype
    first: int          # first tensor
    count: int
    run: int = 0        # index of its group in the step's runs
    chunk0: int = 0     # first chunk
    chunks: int = 0
    # Elements per 16 bytes of the narrower dtype when every address is 16-byte
    # aligned and every size a multiple of it (the kernels then load 16 bytes at a
    # time); else 1.
    align: int = 1


@dataclass
class Step:
    """What the launches of one step need: tables, layout, buckets, copies to undo staging."""

    device: torch.device
    n: int
    ptrs: torch.Tensor
    ptrs_host: torch.Tensor             # kept: a graph that captured its copy reads it
    layout: Layout
    buckets: list[Bucket]
    owners: list[torch.Tensor]          # DTensor parameters, in the step's order
    # (original, staged copy) of every staged tensor, held until the launches are queued
    staged: list[tuple[torch.Tensor, torch.Tensor, bool]]
    sharded: bool = False

    def copy_back(self) -> None:
        """Written staged tensors back to their originals (after the last launch)."""
        for original, staged, written in self.staged:
            if written:
                original.copy_(staged)


def _layout(workspace: dict, numels: list[int], positions: list[int], device) -> Layout:
    """The chunk layout for these sizes, kept while they stay (a model's do not change)."""
    key = (device, CHUNK, tuple(numels), tuple(positions))
    found = workspace.get("layout")
    if found is None or found[0] != key:
        found = workspace["layout"] = (key, Layout.build(numels, positions, device))
    return found[1]


def prepare(workspace: dict | None, runs, streamed: tuple[int, ...], state_row: int,
            written: tuple[int, ...]) -> Step:
    """The ``Step`` for ``runs``: ``(opts, params, grads, states)`` per group, where
    a parameter's rows are ``(w, g, *state)``; rows ``streamed`` are walked
    elementwise (the others are 0-d), row ``state_row`` has the state's dtype, and
    rows ``written`` are copied back if staged.

    ``workspace``: a dict the caller keeps between steps. A step whose tensors all
    sit where a previous step's did (the usual case) reuses that step's tables and
    layout: the host work per step is then reading each tensor's address.
    """
    workspace = {} if workspace is None else workspace
    sharded = any_dtensor(w for _, ps, _, _ in runs for w in ps)
    if sharded:
        flat = [t for _, ps, gs, ss in runs for w, g, st in zip(ps, gs, ss, strict=True)
                for t in (local(w), local(g), *st)]
    else:
        flat = [t for _, ps, gs, ss in runs for w, g, st in zip(ps, gs, ss, strict=True)
                for t in (w, g, *st)]
    key = (tuple(map(torch.Tensor.data_ptr, flat)), tuple(len(r[1]) for r in runs), streamed)
    steps = workspace.setdefault("steps", {})
    step = steps.get(key)
    if step is None:
        width = len(flat) // sum(len(r[1]) for r in runs)
        rows = [flat[i:i + width] for i in range(0, len(flat), width)]
        step = _build(workspace, runs, rows, streamed, state_row, written, sharded)
        if not step.staged:  # staged copies are new tensors every step
            if len(steps) >= TABLES_KEPT:
                steps.pop(next(iter(steps)))
            steps[key] = step
    for b in step.buckets:
        b.opts = runs[b.run][0]
    step.owners = [w for _, ps, _, _ in runs for w in ps] if sharded else []
    return step


def _build(workspace: dict, runs, rows: list[list[torch.Tensor]], streamed: tuple[int, ...],
           state_row: int, written: tuple[int, ...], sharded: bool) -> Step:
    """A new ``Step``: checks, staging, order, buckets, layout and address table.

    Within a group, tensors are ordered by (weight dtype, state dtype) so that each
    bucket is one launch; ``Layout.positions`` maps them back to the callers' order.
    """
    run_of = [r for r, (_, ps, _, _) in enumerate(runs) for _ in ps]
    order = list(range(len(rows)))
    kinds = [(rows[t][0].dtype, rows[t][state_row].dtype) for t in order]
    if len({(run_of[t], kinds[t]) for t in order}) > len(runs):
        order.sort(key=lambda t: (run_of[t], str(kinds[t])))
    device = rows[0][0].device
    wrong = [t.device for row in rows for t in row if t.device != device]
    if wrong:
        raise RuntimeError(f"kernel='triton': all tensors of a step must be on {device}; "
                           f"found a gradient or state tensor on {wrong[0]}")
    staged: list = []
    for t in order:
        if not fusable(*(rows[t][k] for k in streamed)):
            _stage(rows[t], streamed, written, staged)
    buckets: list[Bucket] = []
    for i, t in enumerate(order):
        last = buckets[-1] if buckets else None
        if last is None or last.run != run_of[t] or (last.weight_dtype,
                                                     last.state_dtype) != kinds[t]:
            buckets.append(Bucket(runs[run_of[t]][0], *kinds[t], first=i, count=0,
                                  run=run_of[t]))
        buckets[-1].count += 1
    numels = [rows[t][0].numel() for t in order]
    layout = _layout(workspace, numels, order, device)
    table = [rows[t][k].data_ptr() for k in range(len(rows[0])) for t in order]
    for b in buckets:
        b.chunk0 = layout.starts[b.first]
        b.chunks = layout.starts[b.first + b.count] - b.chunk0
        b.align = _alignment(b, numels, table, streamed, len(order))
    return Step(device, len(order), *_device_table(table, device), layout, buckets, [], staged,
                sharded)


def _alignment(b: Bucket, numels: list[int], addresses: list[int], streamed: tuple[int, ...],
               n: int) -> int:
    """``Bucket.align`` for ``b``: 16 bytes' worth of its narrower dtype, if all its
    streamed addresses are 16-byte aligned and all its sizes a multiple of that."""
    itemsize = min(b.weight_dtype.itemsize, b.state_dtype.itemsize)
    align = 16 // itemsize
    tensors = range(b.first, b.first + b.count)
    if any(numels[t] % align for t in tensors):
        return 1
    if any(addresses[k * n + t] % 16 for k in streamed for t in tensors):
        return 1
    return align


def _stage(rows: list[torch.Tensor], streamed: tuple[int, ...], written: tuple[int, ...],
           staged) -> None:
    """Replace the streamed rows that are not laid out like a dense weight by dense
    copies (the weight's strides, or contiguous when the weight itself is not dense)."""
    w = rows[0]
    like = w if fusable(w) else torch.empty_like(w, memory_format=torch.contiguous_format)
    for k in streamed:
        x = rows[k]
        if x is like or fusable(like, x):
            continue
        rows[k] = torch.empty_like(like).copy_(x)
        staged.append((x, rows[k], k in written))
