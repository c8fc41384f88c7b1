"""Tensor messages between neighbouring pipeline stages on torch.distributed's P2P ops.

A `StageLink` sends and receives one tensor at a time to the stage before or after
this one, ranks of `group` ordered by stage. A message is a fixed 12-integer header
(micro-batch id, weight version, dtype, rank, shape) followed by the payload, so the
receiver needs no shape agreed in advance and the version travels with the activation
(PipeDream's vertical sync). Gradients flowing back need no header: the receiver
already knows the shape of the activation it sent.

Sends are `isend`s that stay pending: gloo completes a send only once the peer has
posted the matching receive, which in a 1F1B pipeline may be a whole schedule later,
so waiting on it at once would deadlock. Their tensors are held until they complete;
`flush()` waits for all of them. Every wait is bounded by the group's timeout.

Messages carry tags of their own (activations and gradients apart), so other
point-to-point traffic with tag 0 on the same group, such as torch.distributed.pipelining's,
cannot take a message left pending between two schedules (gloo matches tags; NCCL
ignores them, so on NCCL give the pipeline a group of its own).

`exchange` is the symmetric case: two ranks swap tensors of one shape in one
`batch_isend_irecv` (pairwise model averaging, `bigbatch.parallel.pairwise_averaging`).
"""

from __future__ import annotations

import datetime
from collections import deque

import torch
import torch.distributed as dist

from bigbatch.errors import ConfigError

__all__ = ["StageLink", "exchange", "group_timeout"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_DIMS = 8
_HEADER = 4 + _MAX_DIMS  # micro-batch id, version, dtype code, ndim, shape
TAG_ACTIVATION, TAG_GRAD, TAG_EXCHANGE = 0x5044_0001, 0x5044_0002, 0x5044_0003


def group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> datetime.timedelta:
    """The timeout `group` was created with (torch keeps it on the backend's options)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def exchange(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None,
             timeout: datetime.timedelta | None = None) -> torch.Tensor:
    """Send `tensor` to rank `peer` of `group` and return what `peer` sends back: a tensor
    of the same shape and dtype (both ranks call this, each naming the other). The send
    and the receive go out together (`batch_isend_irecv`), so neither rank waits on the
    other's order; each wait is bounded by `timeout` (default: the group's)."""
    if timeout is None:
        timeout = group_timeout(group, tensor.device)
    dst = dist.get_global_rank(group, peer) if group is not None else peer
    theirs = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), dst, group, TAG_EXCHANGE),
           dist.P2POp(dist.irecv, theirs, dst, group, TAG_EXCHANGE)]
    for work in dist.batch_isend_irecv(ops):
        work.wait(timeout)
    return theirs


class StageLink:
    """Point-to-point messages between stage `stage_index` and its neighbours."""

    def __init__(self, stage_index: int, group: dist.ProcessGroup | None, device: torch.device,
                 timeout: datetime.timedelta | None = None):
        self.stage_index = stage_index
        self.group = group
        self.device = torch.device(device)
        self.timeout = timeout if timeout is not None else group_timeout(group, self.device)
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def _rank(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage) if self.group is not None else stage

    def _isend(self, tensor: torch.Tensor, stage: int, tag: int) -> None:
        self._reap()
        work = dist.isend(tensor, dst=self._rank(stage), group=self.group, tag=tag)
        self._pending.append((work, tensor))

    def _recv(self, tensor: torch.Tensor, stage: int, tag: int) -> torch.Tensor:
        work = dist.irecv(tensor, src=self._rank(stage), group=self.group, tag=tag)
        work.wait(self.timeout)
        return tensor

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].is_completed():
            work, _ = self._pending.popleft()
            work.wait(self.timeout)  # re-raises a send that failed

    def send_activation(self, tensor: torch.Tensor, microbatch: int, version: int) -> None:
        """Send a forward activation, tagged with its micro-batch and weight version."""
        if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
            raise ConfigError(f"stage {self.stage_index} output {tensor.dtype} with {tensor.dim()} "
                              f"dims: expected a floating tensor of at most {_MAX_DIMS} dims")
        header = [microbatch, version, _DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        header += [0] * (_HEADER - len(header))
        self._isend(torch.tensor(header, dtype=torch.int64, device=self.device),
                    self.stage_index + 1, TAG_ACTIVATION)
        self._isend(tensor.detach().contiguous(), self.stage_index + 1, TAG_ACTIVATION)

    def recv_activation(self) -> tuple[torch.Tensor, int, int]:
        """The next activation from the previous stage: (tensor, micro-batch id, version)."""
        prev = self.stage_index - 1
        header = self._recv(torch.empty(_HEADER, dtype=torch.int64, device=self.device), prev,
                            TAG_ACTIVATION)
        mb, version, code, ndim, *shape = header.tolist()
        tensor = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=self.device)
        return self._recv(tensor, prev, TAG_ACTIVATION), mb, version

    def send_grad(self, grad: torch.Tensor) -> None:
        """Send the gradient of the loss with respect to the activation the previous stage sent."""
        self._isend(grad.detach().contiguous(), self.stage_index - 1, TAG_GRAD)

    def recv_grad(self, like: torch.Tensor) -> torch.Tensor:
        """The next gradient from the following stage, for the activation `like` we sent."""
        return self._recv(torch.empty_like(like, memory_format=torch.contiguous_format),
                          self.stage_index + 1, TAG_GRAD)

    def flush(self) -> None:
        """Wait for every pending send (each wait bounded by the timeout)."""
        while self._pending:
            work, _ = self._pending.popleft()
            work.wait(self.timeout)
