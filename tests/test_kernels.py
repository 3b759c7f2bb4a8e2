"""Single-device block-diffusion attention against dense masked attention (float64 oracle), the
log-sum-exp merge, and the FlexAttention kernel's forward on CPU."""
import math

import pytest
import torch

from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout
from megatron_csbp.attention.kernels.registry import flex_partial_attention, math_partial_attention, merge_partials
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, allowed, dense_reference_mask, logical_rows
from megatron_csbp.layout.rows import PartialMask

# fp32 kernels against the float64 oracle. Error model: the outputs and dQ/dK/dV are sums over
# <= 64 keys (and d = 8 dims) of O(1) terms (N(0, 1) inputs, scores |s| <~ 4), each rounded at
# u32 = 6e-8: <~ 64 * 4 * u32 = 1.5e-5 in the worst case, ~sqrt of that in practice. Measured max
# |got - ref| over this file: 8.4e-7 (ATEN_CPU_CAPABILITY = avx512, avx2), 9.0e-7 (default);
# TOL = 1e-5 is 11x that. The same kernels given float64 compute in float64: TOL64 (10^3 over
# 64 u64).
TOL = 1e-5
TOL64 = 1e-11


def dense_attention_fp64(q, k, v, mask, scale):
    """Explicit softmax over a materialised mask, float64; GQA by repeating each KV head."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(rep, dim=2), v.double().repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v), lse


def _qkv(rows, b, H, G, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, b, H, d, generator=g)
    k = torch.randn(rows, b, G, d, generator=g)
    v = torch.randn(rows, b, G, d, generator=g)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


CASES = [
    # L, B, H, G, d, variant, window
    (16, 4, 4, 4, 8, "block_causal", None),
    (16, 4, 4, 2, 8, "block_causal", None),  # GQA
    (24, 8, 6, 2, 4, "block_causal", None),  # GQA 3:1
    (32, 8, 4, 1, 8, "block_causal", 5),  # MQA + sliding window
    (24, 4, 4, 2, 8, "block_causal", 9),
    (24, 6, 4, 2, 8, "token_causal", None),
    (24, 6, 2, 2, 8, "token_causal", 4),
    (8, 8, 2, 1, 8, "block_causal", None),  # one block: no clean prefix at all
]


@pytest.mark.exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("L,B,H,G,d,variant,window", CASES)
def test_single_layout_matches_dense_reference(L, B, H, G, d, variant, window, dtype):
    tol = TOL if dtype == torch.float32 else TOL64
    torch.manual_seed(0)
    b = 2
    scale = 1.0 / math.sqrt(d)
    layout = SequenceLayout(BlockGeometry(L, B, variant))
    plan = plan_for_layout(layout, 0)
    assert plan.exchange == "none" and len(plan.local) == 2 * L
    q, k, v = _qkv(2 * L, b, H, G, d, seed=L + B + H, dtype=dtype)
    out = block_diffusion_attention(q, k, v, plan, softmax_scale=scale, kernel=math_partial_attention,
                                    window=window)
    assert out.shape == (2 * L, b, H, d) and out.dtype == dtype

    mask = dense_reference_mask(L, B, variant, window)
    q64, k64, v64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, _ = dense_attention_fp64(q64, k64, v64, mask, scale)
    torch.testing.assert_close(out.double(), ref.detach(), atol=tol, rtol=0)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad_out)
    ref.backward(grad_out.double())
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0, msg=lambda m: f"{name}: {m}")


def test_window_changes_the_answer():
    # Guard against a window being silently ignored: with and without it the outputs differ.
    L, B, d = 32, 4, 8
    plan = plan_for_layout(SequenceLayout(BlockGeometry(L, B)), 0)
    q, k, v = _qkv(2 * L, 1, 2, 2, d, seed=3)
    full = block_diffusion_attention(q, k, v, plan, softmax_scale=0.3, kernel=math_partial_attention)
    windowed = block_diffusion_attention(q, k, v, plan, softmax_scale=0.3, kernel=math_partial_attention, window=4)
    assert (full - windowed).abs().max() > 1e-3


def _split_keys(L, B, parts, seed):
    gen = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, parts, (2 * L,), generator=gen)
    owner[:parts] = torch.arange(parts)  # every part non-empty
    return [torch.nonzero(owner == p).flatten() for p in range(parts)]


@pytest.mark.parametrize("H,G", [(4, 4), (4, 2)])
def test_merge_is_order_invariant_and_equals_one_shot(H, G):
    L, B, d, b = 24, 4, 8, 2
    g = BlockGeometry(L, B)
    rows = logical_rows(L)
    q, k, v = _qkv(2 * L, b, H, G, d, seed=11)
    scale = 0.4
    full_out, full_lse = math_partial_attention(q, k, v, PartialMask.of(rows, rows, g), scale)
    ref_out, ref_lse = dense_attention_fp64(q, k, v, dense_reference_mask(L, B), scale)
    torch.testing.assert_close(full_out.double(), ref_out, atol=TOL, rtol=0)
    torch.testing.assert_close(full_lse.double(), ref_lse, atol=TOL, rtol=0)

    # Disjoint random key sets; some queries have no allowed key in some part (finite lse, weight 0).
    splits = _split_keys(L, B, 4, seed=5)
    partials = [math_partial_attention(q, k[i], v[i], PartialMask.of(rows, rows.select(i), g), scale) for i in splits]
    assert any(not allowed(rows, rows.select(i), g).any(dim=1).all() for i in splits)
    merged = [merge_partials([partials[j] for j in order]) for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0])]
    for out, lse in merged:
        torch.testing.assert_close(out, full_out, atol=TOL, rtol=0)
        torch.testing.assert_close(lse, full_lse, atol=TOL, rtol=0)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # Nested merges (a ring merging as chunks arrive) equal the flat merge.
    nested = merge_partials([merge_partials(partials[:2]), merge_partials(partials[2:])])
    torch.testing.assert_close(nested[0], full_out, atol=TOL, rtol=0)

    # Gradients through the merge equal gradients of one-shot attention.
    grad_out = torch.randn(full_out.shape, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad(full_out, (q, k, v), grad_out, retain_graph=True)
    got = torch.autograd.grad(merged[1][0], (q, k, v), grad_out)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=TOL, rtol=0)


def test_merge_single_partial_is_identity():
    q, k, v = _qkv(6, 1, 2, 2, 4, seed=0)
    part = math_partial_attention(q, k, v, PartialMask.block_diagonal(6), 0.5)
    out, lse = merge_partials([part])
    assert out is part[0] and lse is part[1]


def _flex_available():
    try:
        q = torch.randn(1, 1, 8, 4)
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        flex_partial_attention(q.permute(2, 0, 1, 3), q.permute(2, 0, 1, 3), q.permute(2, 0, 1, 3),
                               PartialMask.block_diagonal(8), 0.5)
        return True, ""
    except Exception as exc:  # pragma: no cover - depends on the torch build
        return False, f"FlexAttention forward does not run on this CPU build: {type(exc).__name__}: {exc}"


@pytest.mark.parametrize("H,G,window", [(4, 4, None), (4, 2, None), (4, 2, 6)])
def test_flex_forward_matches_math_on_cpu(H, G, window):
    ok, reason = _flex_available()
    if not ok:
        pytest.skip(reason)
    L, B, d = 32, 8, 8
    g = BlockGeometry(L, B, window=window)
    rows = logical_rows(L)
    q, k, v = [x.detach() for x in _qkv(2 * L, 1, H, G, d, seed=7)]
    m = PartialMask.of(rows, rows, g)
    out_f, lse_f = flex_partial_attention(q, k, v, m, 0.35)
    out_m, lse_m = math_partial_attention(q, k, v, m, 0.35)
    torch.testing.assert_close(out_f.float(), out_m, atol=TOL, rtol=0)
    torch.testing.assert_close(lse_f, lse_m, atol=TOL, rtol=0)
    # A partial in which some queries have no key at all: flex must give them a weight-0 lse.
    clean_only = rows.select(torch.arange(L, 2 * L))
    m2 = PartialMask.of(rows, clean_only, g)
    out2, lse2 = flex_partial_attention(q, k[L:], v[L:], m2, 0.35)
    ref2, rlse2 = math_partial_attention(q, k[L:], v[L:], m2, 0.35)
    has = m2.dense().any(dim=1)
    torch.testing.assert_close(out2[has].float(), ref2[has], atol=TOL, rtol=0)
    noisy_only = rows.select(torch.arange(L))
    noisy_part = math_partial_attention(q, k[:L], v[:L], PartialMask.of(rows, noisy_only, g), 0.35)
    merged = merge_partials([(out2, lse2), noisy_part])
    torch.testing.assert_close(merged[0], out_m, atol=TOL, rtol=0)
