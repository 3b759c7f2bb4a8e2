"""Differentiable K/V transports over the sequence ring (all-gather, ring), with byte accounting.

Every transfer is timed into the traffic counter (in flight and exposed). Design:
docs/architecture.md#one-ranks-attention-attention.
"""
from __future__ import annotations

import time
from typing import List

import torch
import torch.distributed as dist

from megatron_csbp.attention.accounting import traffic_counter


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _stamp(group):
    """Now, on the timeline a wait on `group` blocks: a CUDA event recorded on the current
    stream for a group whose tensors live on CUDA (NCCL), `time.perf_counter()` otherwise."""
    from megatron_csbp.parallel.state import collective_device

    if collective_device(group).type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def reduce_scatter_rows(full: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, keep this rank's equal share of rows (dim 0)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    rows = full.shape[0] // P
    out = torch.empty((rows,) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device)
    try:
        dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
        return out
    except (RuntimeError, NotImplementedError):
        if dist.get_backend(group) != "gloo":
            raise
    # gloo of torch releases without reduce-scatter (the pinned CPU torch has it): all-reduce +
    # slice, still counted as the reduce-scatter it stands for.
    full = full.contiguous().clone()
    dist.all_reduce(full, group=group)
    return full[r * rows : (r + 1) * rows].contiguous()


class PendingGather:
    """An all-gather in flight; `result()` waits and returns the gathered rows, differentiably."""

    def __init__(self, local: torch.Tensor, group, layer: int):
        self.local, self.group, self.layer = local, group, layer
        P = dist.get_world_size(group)
        self.posted = _stamp(group)
        self.buffer = local.new_empty((P * local.shape[0],) + tuple(local.shape[1:]))
        self.requests = [dist.all_gather_into_tensor(self.buffer, local.detach().contiguous(), group=group,
                                                     async_op=True)]
        traffic_counter().record(layer, "forward", (P - 1) * _nbytes(local), (P - 1) * _nbytes(local))

    def result(self) -> torch.Tensor:
        return _FinishGather.apply(self.local, self)


def _arrived(ctx, pending) -> torch.Tensor:
    """Wait for `pending`'s requests (timed into the traffic counter) and return its buffer; its
    group and layer stay on `ctx` for the backward."""
    t0 = _stamp(pending.group)
    for req in pending.requests:
        req.wait()
    traffic_counter().record_transfer(pending.layer, "forward", pending.posted, t0, _stamp(pending.group))
    ctx.group, ctx.layer = pending.group, pending.layer
    return pending.buffer


class _FinishGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, pending: PendingGather):
        return _arrived(ctx, pending)

    @staticmethod
    def backward(ctx, grad_full):
        t0 = _stamp(ctx.group)
        grad_local = reduce_scatter_rows(grad_full, ctx.group)
        traffic_counter().record_transfer(ctx.layer, "backward", t0, t0, _stamp(ctx.group))
        P = dist.get_world_size(ctx.group)
        traffic_counter().record(ctx.layer, "backward", (P - 1) * _nbytes(grad_local), (P - 1) * _nbytes(grad_local))
        return grad_local, None


def _start_exchange(tensor: torch.Tensor, send_to: int, recv_from: int, group):
    """Post a send to `send_to` and a receive from `recv_from`; (requests, receive buffer)."""
    tensor = tensor.contiguous()  # a view (e.g. raw k out of the fused projection) or its gradient
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, send_to), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, recv_from), group)]
    return dist.batch_isend_irecv(ops), received


class PendingShift:
    """A ring shift in flight (send to the next member, receive from the previous); `result()`
    waits and returns the received chunk, differentiably."""

    def __init__(self, chunk: torch.Tensor, group, layer: int):
        P, r = dist.get_world_size(group), dist.get_rank(group)
        self.chunk, self.group, self.layer = chunk, group, layer
        traffic_counter().record(layer, "forward", _nbytes(chunk), _nbytes(chunk))
        self.posted = _stamp(group)
        self.requests, self.buffer = _start_exchange(chunk.detach(), (r + 1) % P, (r - 1) % P, group)

    def result(self) -> torch.Tensor:
        return _FinishShift.apply(self.chunk, self)


class _FinishShift(torch.autograd.Function):
    """Waits for the shift; backward sends the gradient back the other way (blocking: the
    gradient of this chunk is complete only once every use of it has run)."""

    @staticmethod
    def forward(ctx, chunk, pending: PendingShift):
        return _arrived(ctx, pending)

    @staticmethod
    def backward(ctx, grad):
        P, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        traffic_counter().record(ctx.layer, "backward", _nbytes(grad), _nbytes(grad))
        t0 = _stamp(ctx.group)
        requests, received = _start_exchange(grad, (r - 1) % P, (r + 1) % P, ctx.group)
        for req in requests:
            req.wait()
        traffic_counter().record_transfer(ctx.layer, "backward", t0, t0, _stamp(ctx.group))
        return received, None


def ring_chunks(local: torch.Tensor, group, layer: int):
    """Yield (source ring index, chunk) for every member's chunk, the local one first. The shift
    that brings the next chunk is started before a chunk is yielded (attended) and waited for
    after: communication overlaps the previous chunk's compute."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    chunk = local
    for step in range(P):
        pending = PendingShift(chunk, group, layer) if step < P - 1 else None
        yield (r - step) % P, chunk
        if pending is not None:
            chunk = pending.result()


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k, v], dim=2)


def unpack_kv(kv: torch.Tensor):
    G = kv.shape[2] // 2
    return kv[:, :, :G], kv[:, :, G:]


TRANSPORTS = ("allgather", "ring")


class PendingAllToAll:
    """A variable-split all-to-all in flight (windowed clean exchange); `result()` waits and
    returns the received rows, differentiably: backward sends the gradients back the same way."""

    def __init__(self, local: torch.Tensor, send_index: List[torch.Tensor], recv_counts: List[int], group, layer: int):
        self.local, self.group, self.layer = local, group, layer
        self.send_index = torch.cat(send_index).to(local.device)
        self.send_counts, self.recv_counts = [len(ix) for ix in send_index], list(recv_counts)
        send = local.detach()[self.send_index].contiguous()
        self.buffer = local.new_empty((sum(self.recv_counts),) + tuple(local.shape[1:]))
        self.work = dist.all_to_all_single(self.buffer, send, self.recv_counts, self.send_counts, group=group,
                                           async_op=True)
        traffic_counter().record(layer, "forward", _nbytes(send), _nbytes(self.buffer))

    def result(self) -> torch.Tensor:
        return _FinishAllToAll.apply(self.local, self)


class _FinishAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, pending: PendingAllToAll):
        pending.work.wait()
        ctx.pending = pending
        return pending.buffer

    @staticmethod
    def backward(ctx, grad_received):
        p = ctx.pending
        grad_sent = grad_received.new_empty((sum(p.send_counts),) + tuple(grad_received.shape[1:]))
        dist.all_to_all_single(grad_sent, grad_received.contiguous(), p.send_counts, p.recv_counts, group=p.group)
        traffic_counter().record(p.layer, "backward", _nbytes(grad_received), _nbytes(grad_sent))
        grad_local = torch.zeros_like(p.local).index_add_(0, p.send_index, grad_sent)
        ctx.pending = None
        return grad_local, None
