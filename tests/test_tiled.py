"""The tiled block-sparse kernel against the math kernel and dense fp64 attention: outputs, lse and
q/k/v gradients (through the lse too) on random row sets, windows, GQA and queries with no key;
its work follows the allowed pairs, and no tensor of [rows x keys] is ever made."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout
from megatron_csbp.attention.kernels.registry import MASKED_SCORE, get_kernel, math_partial_attention
from megatron_csbp.attention.kernels.tiled import MAX_RUN_KEYS, tile_schedule, tiled_partial_attention
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, RowMeta, allowed, dense_reference_mask, logical_rows
from megatron_csbp.layout.rows import PartialMask


def dense_fp64(q, k, v, mask, scale):
    """Softmax over a materialised mask in float64 (the oracle); rows with no key: output 0."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 2), v.double().repeat_interleave(rep, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    has = mask.any(1)
    probs = torch.exp(scores - torch.where(has, lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.einsum("bhqk,kbhd->qbhd", probs, v), lse


def _random_rows(gen, n, L, low=0):
    return RowMeta(torch.rand(n, generator=gen) < 0.5, torch.randint(low, L, (n,), generator=gen))


def _inputs(nq, nk, b, H, G, d, dtype, seed):
    """q [nq, b, H, d], k and v [nk, b, G, d], leaves requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, b, H, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(nk, b, G, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(nk, b, G, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def _grads(out, lse, has, inputs, seed):
    """Gradients of a loss on the output and on the lse of rows that have a key (the lse of an
    empty row is the constant MASKED_SCORE in the kernels and -inf in the oracle)."""
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    gl = torch.randn(lse.shape, generator=g, dtype=torch.float64) * has.double()
    loss = (out.double() * go).sum() + (torch.where(has, lse.double(), torch.zeros_like(lse.double())) * gl).sum()
    return torch.autograd.grad(loss, inputs)


CASES = [
    # L, B, variant, window, nq, nk, H, G, tiles
    (64, 8, "block_causal", None, 96, 80, 4, 2, (16, 8)),
    (64, 8, "token_causal", None, 70, 128, 2, 2, (8, 16)),
    (96, 16, "block_causal", 20, 120, 90, 6, 2, (32, 32)),
    (96, 4, "token_causal", 7, 50, 130, 4, 1, (7, 5)),
    (128, 16, "block_causal", None, 256, 256, 2, 1, (None, None)),  # default tiles: one chunk
]


@pytest.mark.parametrize("L,B,variant,window,nq,nk,H,G,tiles", CASES)
def test_tiled_equals_math_and_dense_fp64_on_random_rows(L, B, variant, window, nq, nk, H, G, tiles):
    geometry = BlockGeometry(L, B, variant, window)
    gen = torch.Generator().manual_seed(L + nq + nk)
    # Keys from the last 3/4 of the sequence only: queries early on have no allowed key at all.
    qm, km = _random_rows(gen, nq, L), _random_rows(gen, nk, L, low=L // 4)
    mask = PartialMask.of(qm, km, geometry)
    dense = allowed(qm, km, geometry)
    assert (~dense.any(1)).any() and dense.any(1).sum() > nq // 2
    has = dense.any(1)[None, None, :].expand(2, H, -1)
    scale = 0.4
    q, k, v = _inputs(nq, nk, 2, H, G, 8, torch.float64, seed=nq)
    out_t, lse_t = tiled_partial_attention(q, k, v, mask, scale, *tiles)
    out_m, lse_m = math_partial_attention(q, k, v, mask, scale)
    out_d, lse_d = dense_fp64(q, k, v, dense, scale)
    assert out_t.dtype == torch.float64 and lse_t.dtype == torch.float64

    # fp64 throughout: the three agree to rounding (1e-12 for O(1) values and a few hundred keys).
    tol = dict(atol=1e-12, rtol=0)
    torch.testing.assert_close(out_t, out_m, **tol)
    torch.testing.assert_close(out_t, out_d, **tol)
    torch.testing.assert_close(lse_t[has], lse_d[has], **tol)
    torch.testing.assert_close(lse_t, lse_m, **tol)
    # Queries with no allowed key: output 0, lse MASKED_SCORE (the merge weighs them by 0).
    assert torch.equal(lse_t[~has], torch.full_like(lse_t[~has], MASKED_SCORE))
    assert (out_t.permute(1, 2, 0, 3)[~has] == 0).all()

    gt = _grads(out_t, lse_t, has, (q, k, v), seed=1)
    gm = _grads(out_m, lse_m, has, (q, k, v), seed=1)
    gd = _grads(out_d, lse_d, has, (q, k, v), seed=1)
    for name, a, m_, d_ in zip("qkv", gt, gm, gd):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, m_, **tol, msg=lambda s: f"d{name} vs math: {s}")
        torch.testing.assert_close(a, d_, **tol, msg=lambda s: f"d{name} vs dense: {s}")


def test_tiles_of_every_kind_occur():
    # Skipped, full and partial tiles all occur in a layout's mask (the kernel's three paths).
    rows = logical_rows(64)
    table = PartialMask.of(rows, rows, BlockGeometry(64, 8, window=5)).tiles(8, 8)
    assert table.full.any() and table.partial.any() and (~table.occupied).any()


@pytest.mark.parametrize("H,G", [(4, 4), (4, 2)])
def test_tiled_fp32_matches_dense_fp64(H, G):
    # Error model: fp32 scores and exp carry ~1e-7 relative error per term; with N(0, 1) inputs,
    # d = 16, scale 1/4, |scores| < 10 and at most 512 keys, the softmax-weighted sums and the
    # online rescaling keep errors below 100 * eps32 * O(1) ~ 1e-5 on outputs, lse and gradients.
    L, B = 256, 16
    geometry = BlockGeometry(L, B, "block_causal", 40)
    rows = logical_rows(L)
    mask = PartialMask.of(rows, rows, geometry)
    dense = allowed(rows, rows, geometry)
    q, k, v = _inputs(2 * L, 2 * L, 1, H, G, 16, torch.float32, seed=3)
    out, lse = tiled_partial_attention(q, k, v, mask, 0.25, 64, 32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref, rlse = dense_fp64(q, k, v, dense, 0.25)
    has = dense.any(1)[None, None].expand(1, H, -1)
    assert has.all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), rlse, atol=1e-5, rtol=0)
    for a, r in zip(_grads(out, lse, has, (q, k, v), 2), _grads(ref, rlse, has, (q, k, v), 2)):
        torch.testing.assert_close(a.double(), r.double(), atol=1e-4, rtol=0)


def test_work_follows_allowed_pairs():
    # Block-causal attention of a whole sequence: the chunks cover the allowed pairs plus the
    # partial tiles' slack, far less than the rectangle; a window shrinks the work further.
    L, B = 4096, 64
    rows = logical_rows(L)
    # Slack: tiles a window's edge cuts (window 256 = one tile width: about 2x the allowed pairs).
    for window, ratio, share in ((None, 1.15, 0.5), (256, 2.5, 0.1)):
        mask = PartialMask.of(rows, rows, BlockGeometry(L, B, window=window))
        sched = tile_schedule(mask)
        allowed_pairs, rect = mask.allowed_pairs(), (2 * L) ** 2
        assert allowed_pairs <= sched.computed_pairs <= ratio * allowed_pairs, (window, sched.computed_pairs)
        assert sched.computed_pairs < share * rect
        # No chunk is wider than MAX_RUN_KEYS, none is computed for an empty tile.
        table = mask.tiles(sched.q_tile, sched.k_tile)
        for i, runs in enumerate(sched.runs):
            for k0, k1, masked in runs:
                assert k1 - k0 <= MAX_RUN_KEYS
                tiles = table.occupied[i, k0 // sched.k_tile:-(-k1 // sched.k_tile)]
                assert tiles.all()
                assert bool(masked) == bool(table.partial[i, k0 // sched.k_tile])


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_rows_by_keys_tensor_in_forward_or_backward():
    L, B, H, G, d = 4096, 64, 2, 1, 8
    rows = logical_rows(L)
    mask = PartialMask.of(rows, rows.select(torch.arange(L, 2 * L)), BlockGeometry(L, B))
    q, k, v = _inputs(2 * L, L, 1, H, G, d, torch.float32, seed=4)
    with _LargestTensor() as probe:
        out, lse = tiled_partial_attention(q, k, v, mask, 0.3)
        (out.sum() + lse.sum()).backward()
    rows_x_keys = 2 * L * L
    linear = 2 * L * H * d  # q itself
    chunk = H * 256 * MAX_RUN_KEYS  # one score chunk
    assert probe.largest <= max(linear, chunk) < rows_x_keys // 16, probe.largest


@pytest.mark.parametrize("L,B,variant,window", [(32, 8, "block_causal", None), (24, 6, "token_causal", 4)])
def test_tiled_through_block_attention_matches_dense_reference(L, B, variant, window):
    kernel = get_kernel("tiled", torch.device("cpu"))  # the CPU default is cpu_flash (test_cpu_flash.py)
    assert kernel is tiled_partial_attention
    plan = plan_for_layout(SequenceLayout(BlockGeometry(L, B, variant)), 0)
    q, k, v = _inputs(2 * L, 2 * L, 2, 4, 2, 8, torch.float64, seed=L)
    out = block_diffusion_attention(q, k, v, plan, softmax_scale=1 / math.sqrt(8), kernel=kernel, window=window)
    ref, _ = dense_fp64(q, k, v, dense_reference_mask(L, B, variant, window), 1 / math.sqrt(8))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    go = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for a, r in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)


def test_plan_keeps_row_vectors_not_dense_masks():
    # After a forward and backward, what the plan caches (masks, tile tables, schedules) is linear
    # in the rows: at most 64 bytes a row, where one dense mask alone would be rows x keys bytes.
    L, B = 2048, 64
    plan = plan_for_layout(SequenceLayout(BlockGeometry(L, B)), 0)
    q, k, v = _inputs(2 * L, 2 * L, 1, 2, 1, 8, torch.float32, seed=5)
    block_diffusion_attention(q, k, v, plan, softmax_scale=0.3, kernel=tiled_partial_attention).sum().backward()
    rows = len(plan.local)
    masks = [v[0] if isinstance(v, tuple) else v for v in plan._cache.values()]
    masks = [m for m in masks if isinstance(m, PartialMask)]
    assert masks and all(m._derived for m in masks)  # the kernel's tables live on the masks
    assert 0 < plan.nbytes() <= 64 * rows < rows * L // 8
