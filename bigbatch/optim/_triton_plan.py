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
from ._norms import is_dtensor, local

# Elements per program: enough work to hide a program's start, small enough that
# BERT-large's 335 M parameters make ~20 K programs and ResNet-50's ~1.7 K.
CHUNK = 1 << 14
# Elements per vector operation inside a program (8 per thread at 4 warps).
BLOCK = 1024
NUM_WARPS = 4
# Chunks a reduction program adds per vector operation.
REDUCE_BLOCK = 256
# Tables kept per workspace (gradients may alternate between a few blocks).
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
    layout: Layout
    buckets: list[Bucket]
    owners: list[torch.Tensor]          # the parameters, in the step's order
    # (original, staged copy) of every staged tensor, held until the launches are queued
    staged: list[tuple[torch.Tensor, torch.Tensor, bool]]

    @property
    def sharded(self) -> bool:
        return any(is_dtensor(w) for w in self.owners)

    def copy_back(self) -> None:
        """Written staged tensors back to their originals (after the last launch)."""
        for original, staged, written in self.staged:
            if written:
                original.copy_(staged)


def _layout(workspace: dict, numels: list[int], positions: list[int], device) -> Layout:
    key = (device, CHUNK, tuple(numels), tuple(positions))
    found = workspace.get("layout")
    if found is None or found[0] != key:  # a model's sizes do not change: keep one
        found = workspace["layout"] = (key, Layout.build(numels, positions, device))
    return found[1]


def _table(workspace: dict, addresses: list[int], device) -> torch.Tensor:
    tables = workspace.setdefault("tables", {})
    key = (device, tuple(addresses))
    found = tables.get(key)
    if found is None:
        if len(tables) >= TABLES_KEPT:
            tables.pop(next(iter(tables)))
        found = tables[key] = _device_table(addresses, device)
    return found[0]


def prepare(workspace: dict | None, runs, streamed: int, written: tuple[int, ...]) -> Step:
    """The ``Step`` for ``runs``: ``(opts, params, grads, states)`` per group, where
    a parameter's rows are ``(w, g, *state)``; the first ``streamed`` rows are walked
    elementwise (the rest are 0-d), and rows ``written`` are copied back if staged.

    Within a group, tensors are ordered by (weight dtype, state dtype) so that each
    bucket is one launch; ``Layout.positions`` maps them back to the callers' order.
    ``workspace``: a dict the caller keeps between steps, where the layout and the
    address tables stay while the tensors do.
    """
    workspace = {} if workspace is None else workspace
    entries = []
    position = 0
    for r, (_, params, grads, states) in enumerate(runs):
        for w, g, state in zip(params, grads, states, strict=True):
            entries.append((r, position, w, [local(w), local(g), *state]))
            position += 1
    if len({(e[0], e[3][0].dtype, e[3][2].dtype) for e in entries}) > len(runs):
        entries.sort(key=lambda e: (e[0], str(e[3][0].dtype), str(e[3][2].dtype)))
    device = entries[0][3][0].device
    staged = []
    for _, _, _, rows in entries:
        if not fusable(*rows[:streamed]):
            _stage(rows, streamed, written, staged)
    buckets: list[Bucket] = []
    for t, (r, _, _, rows) in enumerate(entries):
        kind = (rows[0].dtype, rows[2].dtype)
        last = buckets[-1] if buckets else None
        if last is None or last.opts is not runs[r][0] or \
                (last.weight_dtype, last.state_dtype) != kind:
            buckets.append(Bucket(runs[r][0], *kind, first=t, count=0))
        buckets[-1].count += 1
    layout = _layout(workspace, [e[3][0].numel() for e in entries], [e[1] for e in entries],
                              device)
    for b in buckets:
        b.chunk0 = layout.starts[b.first]
        b.chunks = layout.starts[b.first + b.count] - b.chunk0
    n_rows = len(entries[0][3])
    addresses = [e[3][k].data_ptr() for k in range(n_rows) for e in entries]
    for b in buckets:
        b.align = _alignment(b, entries, addresses, streamed, len(entries))
    return Step(device, len(entries), _table(workspace, addresses, device), layout, buckets,
                [e[2] for e in entries], staged)


def _alignment(b: Bucket, entries, addresses: list[int], streamed: int, n: int) -> int:
    """``Bucket.align`` for ``b``: 16 bytes' worth of its narrower dtype, if all its
    streamed addresses are 16-byte aligned and all its sizes a multiple of that."""
    itemsize = min(b.weight_dtype.itemsize, b.state_dtype.itemsize)
    align = 16 // itemsize
    tensors = range(b.first, b.first + b.count)
    if any(entries[t][3][0].numel() % align for t in tensors):
        return 1
    if any(addresses[k * n + t] % 16 for k in range(streamed) for t in tensors):
        return 1
    return align


def _stage(rows: list[torch.Tensor], streamed: int, written: tuple[int, ...], staged) -> None:
    """Replace the streamed rows that are not laid out like a dense weight by dense
    copies (the weight's strides, or contiguous when the weight itself is not dense)."""
    w = rows[0]
    like = w if fusable(w) else torch.empty_like(w, memory_format=torch.contiguous_format)
    for k in range(streamed):
        x = rows[k]
        if x is like or fusable(like, x):
            continue
        rows[k] = torch.empty_like(like).copy_(x)
        staged.append((x, rows[k], k in written))
