"""The flash-attn decomposition (`attention/flash.py`) on CPU, without flash-attn (not installable
here; tests/gpu/run_all.sh runs the real kernel): the varlen calls plus the flex fallback cover
every allowed pair of the PartialMask exactly once, sequences are well formed, and the assembly
(gathers, batch folding, lse layout, log-sum-exp merge, the lse gradient) equals dense fp64
attention when each varlen call is evaluated by `varlen_reference`, an fp64 evaluation of
flash_attn_varlen_func's documented semantics."""
import pytest
import torch

from megatron_csbp.attention.kernels.flash import KEY_COPY_BUDGET, FlashPlan, flash_attention_partial
from megatron_csbp.attention.kernels.registry import MASKED_SCORE, get_kernel
from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.layout.rows import PartialMask
from tests.test_flex import CASES, _qkv, dense_attention_fp64


def _covered(plan: FlashPlan, shape):
    """Count per (query, key) pair how many pieces attend it."""
    count = torch.zeros(shape, dtype=torch.long)
    for call in ([plan.noisy] if plan.noisy is not None else []) + plan.clean:
        pairs = call.pairs()
        count.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs), dtype=torch.long), accumulate=True)
        assert (call.cu_q.diff() > 0).all() and (call.cu_k.diff() > 0).all()
        assert int(call.cu_q[-1]) == call.q_index.numel() and int(call.cu_k[-1]) == call.k_index.numel()
        assert call.max_q == int(call.cu_q.diff().max()) and call.max_k == int(call.cu_k.diff().max())
        # every query of a call has at least one key (flash-attn gives empty rows lse = +inf)
        assert torch.isin(call.q_index, pairs[:, 0]).all()
    if plan.fallback_mask is not None:
        sub = plan.fallback_mask.dense()
        a, b = sub.nonzero().unbind(1)
        count.index_put_((plan.fallback_q[a], plan.clean_keys[b]), torch.ones(len(a), dtype=torch.long), accumulate=True)
    return count


@pytest.mark.parametrize("name,mask", CASES, ids=[c[0] for c in CASES])
def test_pieces_cover_every_allowed_pair_once(name, mask):
    plan = FlashPlan.of(mask)
    count = _covered(plan, mask.shape)
    assert torch.equal(count, mask.dense().long()), name
    gathered = sum(c.k_index.numel() for c in plan.clean)
    assert gathered <= KEY_COPY_BUDGET * max(1, int(mask.k.is_clean.sum()))


def _single_rank(L, B, variant, window=None):
    g = BlockGeometry(L, B, variant, window)
    rows = RowMeta.of(torch.arange(L), torch.arange(L))
    return PartialMask.of(rows, rows.select(slice(L, None)), g), PartialMask.of(rows, rows.select(slice(0, L)), g)


def test_what_flash_takes():
    """Noisy part: one call of B x B sequences. Token-causal clean queries: one causal call (with
    window (W-1, 0) under a window). Block-causal prefixes: mostly left to flex."""
    L, B = 256, 16
    clean_part, noisy_part = _single_rank(L, B, "token_causal")
    plan = FlashPlan.of(noisy_part)
    assert plan.noisy is not None and not plan.clean and plan.fallback_mask is None
    assert torch.equal(plan.noisy.cu_q, torch.arange(0, L + 1, B, dtype=torch.int32))
    assert plan.noisy.max_q == plan.noisy.max_k == B and not plan.noisy.causal
    plan = FlashPlan.of(clean_part)
    causal = [c for c in plan.clean if c.causal]
    assert len(causal) == 1 and causal[0].q_index.numel() == L and causal[0].window == (-1, 0)
    assert torch.equal(causal[0].q_index, torch.arange(L, 2 * L))  # the clean queries, in order
    clean_w = _single_rank(L, B, "token_causal", 40)[0]
    causal = [c for c in FlashPlan.of(clean_w).clean if c.causal]
    assert len(causal) == 1 and causal[0].window == (39, 0) and causal[0].q_index.numel() == L
    block_causal = FlashPlan.of(_single_rank(L, B, "block_causal")[0])
    assert block_causal.fallback_q.numel() > L  # nested per-block prefixes: flash would copy K per block


def varlen_keep(nq, nk, causal=False, window_size=(-1, -1)):
    """[nq, nk] keep-mask of one varlen sequence: causal aligned bottom-right, window (left, right)
    keeps keys in [i + nk - nq - left, i + nk - nq + right] (negative: unbounded)."""
    qi, ki = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    ok = torch.ones(nq, nk, dtype=torch.bool)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0:
        ok &= ki >= qi + nk - nq - left
    if right >= 0:
        ok &= ki <= qi + nk - nq + right
    return ok


def test_varlen_reference_follows_flash_attn_documented_masks():
    """The emulation's masks against flash-attn's own documentation (the docstring of
    flash_attn_varlen_func / README, flash-attn >= 2.1), quoted verbatim, so a misread convention
    fails here; the real kernel is checked against dense fp64 attention by tests/gpu/check_kernels.py
    (the GPU tier, where a flash-attn that fails to import or run is a failure)."""
    # "If seqlen_q = 2 and seqlen_k = 5, the causal mask (1 = keep, 0 = masked out) is:
    #      1 1 1 1 0
    #      1 1 1 1 1
    #  If seqlen_q = 5 and seqlen_k = 2, the causal mask is:
    #      0 0
    #      0 0
    #      0 0
    #      1 0
    #      1 1
    #  If the row of the mask is all zero, the output will be zero."
    assert varlen_keep(2, 5, causal=True).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert varlen_keep(5, 2, causal=True).int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    # "If window_size != (-1, -1), implements sliding window local attention. Query at position i
    #  will only attend to keys between [i + seqlen_k - seqlen_q - window_size[0],
    #  i + seqlen_k - seqlen_q + window_size[1]] inclusive."
    for nq, nk, w in ((4, 6, (1, 0)), (6, 6, (2, 1)), (3, 7, (0, 2))):
        want = [[int(i + nk - nq - w[0] <= j <= i + nk - nq + w[1]) for j in range(nk)] for i in range(nq)]
        assert varlen_keep(nq, nk, window_size=w).int().tolist() == want, (nq, nk, w)
    # causal with a window: window_size[1] is 0 (flash-attn sets it when causal)
    assert varlen_keep(4, 4, causal=True, window_size=(1, -1)).int().tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), return_attn_probs=False):
    """flash_attn_varlen_func's documented semantics in fp64, differentiable in its output like
    flash-attn's (the lse is returned detached, as flash-attn's has no gradient): sequence i
    attends q[cu_q[i]:cu_q[i+1]] to k[cu_k[i]:cu_k[i+1]]; causal is aligned bottom-right and
    window (left, right) keeps keys in [i + sk - sq - left, i + sk - sq + right]; GQA by head
    groups; lse (nheads, total_q)."""
    assert dropout_p == 0.0
    H, G = q.shape[1], k.shape[1]
    outs, lses = [], []
    for i in range(cu_seqlens_q.numel() - 1):
        qs = q[int(cu_seqlens_q[i]):int(cu_seqlens_q[i + 1])].double()
        ks = k[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])].double().repeat_interleave(H // G, 1)
        vs = v[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])].double().repeat_interleave(H // G, 1)
        assert qs.shape[0] <= max_seqlen_q and ks.shape[0] <= max_seqlen_k
        nq, nk = qs.shape[0], ks.shape[0]
        ok = varlen_keep(nq, nk, causal, window_size)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        s = s.masked_fill(~ok, float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
        lses.append(lse)
    out = torch.cat(outs).to(q.dtype)
    lse = torch.cat(lses, 1).detach().float()
    return (out, lse, None) if return_attn_probs else out


def _fallback_fp64(q, k, v, mask, scale):
    """The flex fallback's place on CPU with gradients (flex has no CPU backward): dense fp64."""
    out, lse = dense_attention_fp64(q, k, v, mask.dense(), scale)
    return out.to(q.dtype), lse.float()


# random rows (noisy layer + dense groups + flex), random + window (causal runs with windows), one
# rank token-causal (one causal call), a CSBP rank token-causal + window
@pytest.mark.parametrize("idx,H,G,b", [(0, 4, 2, 2), (3, 4, 4, 1), (6, 6, 2, 1), (11, 4, 1, 2)])
def test_assembly_equals_dense_attention_with_reference_varlen(idx, H, G, b):
    """Outputs, lse and q/k/v gradients (through the output and the lse, which the merges use)
    against dense fp64 attention. All fp64 except the lse (fp32 by the interface): tolerance
    1e-5 on the lse-weighted parts (|lse| < 20, 2^-24 relative), 1e-9 elsewhere."""
    name, mask = CASES[idx]
    nq, nk = mask.shape
    q, k, v = (x.requires_grad_() for x in _qkv(nq, nk, b, H, G, 8, torch.float64, seed=idx))
    out, lse = flash_attention_partial(q, k, v, mask, 0.4, flash_fn=varlen_reference, fallback=_fallback_fp64)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref, ref_lse = dense_attention_fp64(q2, k2, v2, mask.dense(), 0.4)
    has = mask.dense().any(1)
    torch.testing.assert_close(out[has], ref[has], atol=1e-5, rtol=0)
    assert not out[~has].any() and (lse[..., ~has] == MASKED_SCORE).all()
    torch.testing.assert_close(lse[..., has].double(), ref_lse[..., has].float().double(), atol=1e-5, rtol=1e-6)
    gen = torch.Generator().manual_seed(4)
    g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64) * has  # lse of empty rows is a constant
    (out * g_out).sum().add((lse.double() * g_lse).sum()).backward()
    ((ref * g_out).sum() + (ref_lse.masked_fill(~has, 0) * g_lse).sum()).backward()
    for nm, a, w in (("dq", q.grad, q2.grad), ("dk", k.grad, k2.grad), ("dv", v.grad, v2.grad)):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=0, msg=lambda m: f"{nm}: {m}")


def test_flash_needs_flash_attn():
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="--attention-kernel flash needs flash-attn; pip install flash-attn"):
            get_kernel("flash", torch.device("cpu"))
    else:  # pragma: no cover - only where flash-attn is installed
        q = torch.zeros(4, 1, 2, 8)
        mask = CASES[0][1]
        with pytest.raises(ValueError, match="fp16/bf16 on CUDA"):
            get_kernel("flash", torch.device("cpu"))(q, q, q, mask, 1.0)


@pytest.mark.parametrize("variant,window", [("block_causal", None), ("token_causal", None), ("token_causal", 24)])
def test_block_diffusion_attention_with_the_flash_decomposition(variant, window):
    """A whole single-layout attention (block-diagonal noisy part folded into the batch, the clean
    partial) through the flash kernel's decomposition, varlen calls evaluated by
    `varlen_reference`, fallback on the tiled kernel: equals the tiled kernel, outputs and grads
    (fp64, 1e-5: the lse is carried in fp32 by the reference varlen)."""
    tiled = pytest.importorskip("megatron_csbp.attention.kernels.tiled", reason="needs the row-vector call sites")
    from functools import partial

    from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout
    from megatron_csbp.layout.layout import SequenceLayout

    L, B = 96, 8
    plan = plan_for_layout(SequenceLayout(BlockGeometry(L, B, variant), 1, 1))
    flash = partial(flash_attention_partial, flash_fn=varlen_reference, fallback=tiled.tiled_partial_attention)
    grads = []
    for kernel in (flash, tiled.tiled_partial_attention):
        q, k, v = (x.requires_grad_() for x in _qkv(2 * L, 2 * L, 2, 4, 2, 8, torch.float64, seed=1))
        out = block_diffusion_attention(q, k, v, plan, softmax_scale=0.3, kernel=kernel, window=window)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype))
        grads.append([out.detach(), q.grad, k.grad, v.grad])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_lse_layouts_of_flash_attn_releases():
    """flash-attn 2.x returns the varlen lse as (nheads, total_q); some older 2.x releases as
    (batch, nheads, max_seqlen_q), padded per sequence: both read back as (nheads, total_q)."""
    from megatron_csbp.attention.kernels.flash import _lse_rows

    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    rows = torch.randn(2, 9)
    padded = torch.full((3, 2, 5), float("nan"))
    for i in range(3):
        a, b = int(cu[i]), int(cu[i + 1])
        padded[i, :, : b - a] = rows[:, a:b]
    assert _lse_rows(rows, cu, 9) is rows
    assert torch.equal(_lse_rows(padded, cu, 9), rows)
