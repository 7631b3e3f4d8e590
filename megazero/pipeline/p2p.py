"""Point-to-point transfer of activations (forward) and their gradients (backward) between pipeline stages.

Shapes are known up front ([micro-batch, sequence or its TP shard under SP, hidden]), so a receiver allocates
its buffer without a handshake. Sends are non-blocking (batched ``isend``); their handles are kept until
:meth:`PipelineP2P.wait_sends`. Every message carries a tag made of its direction, micro-batch and model
chunk, so on gloo the two streams between a pair of ranks (activations one way, gradients the other, and
both ways at the interleaved schedule's wrap-around from the last rank to the first) never mix.
"""

from __future__ import annotations

import torch

from megazero.distributed import Group

__all__ = ["PipelineP2P"]


class PipelineP2P:
    """Sends to the next pipeline rank and receives from the previous one (and the reverse for gradients)."""

    def __init__(self, pp_group: Group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 virtual_stages: int = 1) -> None:
        self.group = pp_group
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.virtual_stages = virtual_stages
        self.next = (pp_group.rank + 1) % pp_group.size
        self.prev = (pp_group.rank - 1) % pp_group.size
        self._pending: list[tuple[object, torch.Tensor]] = []

    def _tag(self, backward: bool, micro_batch: int, chunk: int) -> int:
        return (micro_batch * self.virtual_stages + chunk) * 2 + int(backward)

    def send_forward(self, act: torch.Tensor, micro_batch: int, dst_chunk: int) -> None:
        """Send an activation to the next stage (its model chunk ``dst_chunk``)."""
        t = act.detach().contiguous()
        self._pending.append((self.group.isend(t, self.next, self._tag(False, micro_batch, dst_chunk)), t))

    def recv_forward(self, micro_batch: int, chunk: int) -> torch.Tensor:
        """Receive this chunk's input activation from the previous stage."""
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.group.recv(t, self.prev, self._tag(False, micro_batch, chunk))
        return t

    def send_backward(self, grad: torch.Tensor, micro_batch: int, dst_chunk: int) -> None:
        """Send the gradient of this stage's input back to the previous stage (its chunk ``dst_chunk``)."""
        t = grad.contiguous()
        self._pending.append((self.group.isend(t, self.prev, self._tag(True, micro_batch, dst_chunk)), t))

    def recv_backward(self, micro_batch: int, chunk: int) -> torch.Tensor:
        """Receive the gradient of this chunk's output from the next stage."""
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.group.recv(t, self.next, self._tag(True, micro_batch, chunk))
        return t

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
