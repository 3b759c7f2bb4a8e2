"""FlexAttention partial kernel driven by row vectors (the default kernel on CUDA).

`flex_attention_partial(q, k, v, mask: PartialMask, softmax_scale) -> (out, lse)`: the kernel
interface of `attention/kernels/registry.py` (out in q's dtype; a row with no allowed key gets
output 0 and lse MASKED_SCORE). No dense mask anywhere; the `BlockMask` comes from the mask's
tile table, shapes are padded to buckets, caches live on the `PartialMask`. Design and sizes:
docs/attention-kernels.md#flex-attentionflexpy-default-on-cuda.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron_csbp.attention.kernels.tiled import MASKED_SCORE
from megatron_csbp.layout.rows import KeyRows, PartialMask, QueryRows, pair_allowed
from megatron_csbp.utils.precision import compute_dtype

FLEX_BLOCK = 128  # flex's default sparse block: tiles of 128 queries x 128 keys
# Distinct (b, sq-bucket, sk-bucket, heads, dtype) combinations one run may compile. A training
# run meets a handful (noisy block-diagonal, gathered or ring clean keys, window keys per layer
# kind); generation adds a few canvas sizes, which the buckets fold together.
RECOMPILE_LIMIT = 32


def bucket(n: int, block: int = FLEX_BLOCK) -> int:
    """Padded length for n rows: a multiple of `block` up to 8 blocks, then the next of
    {1, 1.25, 1.5, 1.75} x 2^k rounded up to `block` (at most 25 % padding, 4 sizes an octave:
    48 sizes from 128 to 1M rows)."""
    if n <= 8 * block:
        return max(block, -(-n // block) * block)
    octave = 1 << (n - 1).bit_length() - 1  # largest power of two < n
    for f in (5, 6, 7, 8):
        size = -(-(octave * f // 4) // block) * block
        if size >= n:
            return size
    raise AssertionError("unreachable")


def no_pairs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The partial of a mask with no allowed pair: output 0 (tied to k and v, so their gradient
    is a zero, not None) and lse MASKED_SCORE in the kernels' lse dtype (fp32, fp64 for fp64)."""
    sq, b, H, _ = q.shape
    out = q.new_zeros(sq, b, H, v.shape[-1]) + 0.0 * (k.sum() + v.sum())
    return out, torch.full((b, H, sq), MASKED_SCORE, dtype=compute_dtype(q.dtype), device=q.device)


def padded_mask(mask: PartialMask, q_len: int, k_len: int) -> PartialMask:
    """The mask with q rows padded to q_len and keys to k_len: padded queries are clean with an
    empty interval (see nothing), padded keys are noisy in block -2 (seen by nobody)."""
    q, k = mask.q, mask.k
    eq, ek = q_len - len(q), k_len - len(k)
    if eq < 0 or ek < 0:
        raise ValueError(f"cannot pad a {mask.shape} mask to ({q_len}, {k_len})")

    def ext(x, n, value):
        return torch.cat([x, x.new_full((n,), value)]) if n else x

    qp = QueryRows(ext(q.block, eq, -1), ext(q.is_clean, eq, True), ext(q.lo, eq, 0), ext(q.hi, eq, 0))
    kp = KeyRows(ext(k.position, ek, 0), ext(k.block, ek, -2), ext(k.is_clean, ek, False))
    return PartialMask(qp, kp)


def mask_mod_of(mask: PartialMask):
    """FlexAttention mask_mod reading the row vectors: pair_allowed at (q_idx, kv_idx)."""
    q, k = mask.q, mask.k
    q_block, q_clean, q_lo, q_hi = q.block, q.is_clean, q.lo, q.hi
    k_pos, k_block, k_clean = k.position, k.block, k.is_clean

    def mask_mod(batch, head, q_idx, kv_idx):
        return pair_allowed(q_block[q_idx], q_clean[q_idx], q_lo[q_idx], q_hi[q_idx],
                            k_pos[kv_idx], k_block[kv_idx], k_clean[kv_idx])

    return mask_mod


def _ordered(tiles: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[qt, kt] bool -> (num_blocks [1, 1, qt], indices [1, 1, qt, kt]) int32, the layout flex
    uses: each row's tiles first, in increasing order, then the others (a stable sort)."""
    t = tiles.to(torch.int32)
    num = t.sum(-1).to(torch.int32)
    idx = torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None].contiguous(), idx[None, None].contiguous()


def flex_block_tables(mask: PartialMask, block: int = FLEX_BLOCK):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of `mask` with
    `block` x `block` tiles, from its exact tile table (a short last tile is padded with
    disallowed pairs, as create_block_mask pads). Partial tiles run mask_mod, full ones do not."""
    nq, nk = mask.shape
    qt, kt = max(1, -(-nq // block)), max(1, -(-nk // block))
    exact = mask if (qt * block, kt * block) == (nq, nk) else padded_mask(mask, qt * block, kt * block)
    table = exact.tiles(block, block)
    return (*_ordered(table.partial), *_ordered(table.full))


@dataclass(frozen=True)
class FlexMask:
    """What flex needs for one mask on one device: padded lengths and the block mask."""

    q_len: int
    k_len: int
    block_mask: object  # torch.nn.attention.flex_attention.BlockMask
    row_bytes: int = 0  # the padded row vectors the mask_mod reads

    @property
    def nbytes(self) -> int:
        """Bytes kept: block tables (kv and q, partial and full) and the padded row vectors."""
        bm = self.block_mask
        tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
                  bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
        return self.row_bytes + sum(t.numel() * t.element_size() for t in tables if t is not None)


def flex_mask(mask: PartialMask, device: torch.device, block: int = FLEX_BLOCK) -> FlexMask:
    """The padded BlockMask of `mask` on `device`, built once and cached on the mask."""
    from torch.nn.attention.flex_attention import BlockMask

    def build():
        q_len, k_len = bucket(mask.shape[0], block), bucket(mask.shape[1], block)
        padded = padded_mask(mask.to(device), q_len, k_len)
        tables = flex_block_tables(padded, block)
        block_mask = BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=block, mask_mod=mask_mod_of(padded),
                                              seq_lengths=(q_len, k_len))
        return FlexMask(q_len, k_len, block_mask, padded.q.nbytes + padded.k.nbytes)

    return mask.derived(("flex", str(device), block), build)


@functools.lru_cache(maxsize=None)
def compiled_flex(backend: str = "inductor"):
    """`flex_attention` compiled once per backend (static shapes: the buckets bound them)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, backend=backend, dynamic=False)


def _flex_fn(device: torch.device, compile: Optional[str]):
    from torch.nn.attention.flex_attention import flex_attention

    if callable(compile):
        return compile
    if compile == "auto":
        compile = "inductor" if device.type == "cuda" else None
    return flex_attention if compile is None else compiled_flex(compile)


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """[s, b, h, d] -> contiguous [b, h, n, d] with zero rows appended. Always contiguous: compiled
    flex also specialises on strides, and Megatron's q/k/v are often strided views."""
    x = x.permute(1, 2, 0, 3)
    return torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[2])) if n > x.shape[2] else x.contiguous()


def flex_attention_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: PartialMask,
                           softmax_scale: float, *, compile: Optional[str] = "auto"):
    """One partial with FlexAttention. `compile`: 'auto' (inductor on CUDA, eager elsewhere), a
    torch.compile backend name, None for eager flex, or a compiled flex_attention callable."""
    sq, b, H, d = q.shape
    sk, G = k.shape[0], k.shape[2]
    if mask.shape != (sq, sk):
        raise ValueError(f"mask is {mask.shape}, q/k have ({sq}, {sk}) rows")
    if sq == 0 or sk == 0:
        return no_pairs(q, k, v)
    fm = flex_mask(mask, q.device)
    qt, kt, vt = _pad_rows(q, fm.q_len), _pad_rows(k, fm.k_len), _pad_rows(v, fm.k_len)
    flex = _flex_fn(q.device, compile)
    from torch.nn.attention.flex_attention import AuxRequest

    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
        out, aux = flex(qt, kt, vt, block_mask=fm.block_mask, scale=softmax_scale, enable_gqa=G != H,
                        return_aux=AuxRequest(lse=True))
    # Rows with no allowed key come back with lse = -inf and output 0: clamp the lse so the
    # merge weights them by exactly 0, like the math kernel.
    lse = aux.lse[..., :sq].to(compute_dtype(q.dtype)).clamp_min(MASKED_SCORE)
    return out[:, :, :sq].permute(2, 0, 1, 3), lse
