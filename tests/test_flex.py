"""FlexAttention from row vectors (`attention/flex.py`): block tables against `create_block_mask`
tile for tile, the mask_mod against the dense predicate, the forward against dense attention on
CPU (eager flex; torch has no FlexAttention backward on CPU, the GPU script checks gradients), the
bucketed compilation and its hard recompile limit."""
import gc
import weakref

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from megatron_csbp.attention.kernels import flex
from megatron_csbp.attention.kernels.flex import (
    bucket,
    flex_attention_partial,
    flex_block_tables,
    flex_mask,
    mask_mod_of,
    padded_mask,
)
from megatron_csbp.attention.kernels.registry import MASKED_SCORE, get_kernel, math_partial_attention, merge_partials
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.layout.rows import PartialMask


def _random_rows(gen, n, L):
    return RowMeta(torch.rand(n, generator=gen) < 0.5, torch.randint(0, L, (n,), generator=gen))


def _cases():
    """(name, PartialMask): random row sets, windows, token/block causal, sorted layout rows."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for L, B, variant, window, nq, nk in [(256, 16, "block_causal", None, 150, 230),
                                          (256, 8, "token_causal", None, 97, 260),
                                          (320, 16, "block_causal", 40, 200, 130),
                                          (320, 4, "token_causal", 23, 64, 64)]:
        g = BlockGeometry(L, B, variant, window)
        out.append((f"random-{variant}-W{window}", PartialMask.of(_random_rows(gen, nq, L), _random_rows(gen, nk, L), g)))
    for L, B, variant, window in [(256, 16, "block_causal", None), (256, 32, "token_causal", None),
                                  (384, 16, "block_causal", 50), (256, 8, "token_causal", 30)]:
        g = BlockGeometry(L, B, variant, window)
        rows = RowMeta.of(torch.arange(L), torch.arange(L))  # one rank: [noisy ; clean]
        out.append((f"single-{variant}-W{window}", PartialMask.of(rows, rows.select(slice(L, None)), g)))
        # a CSBP rank (P = 2, BP 2): its queries against the ring's clean rows
        layout = SequenceLayout(g, 2, 2)
        q = layout.rows(1)
        keys = RowMeta.cat(layout.ring_clean_rows(1))
        out.append((f"csbp-{variant}-W{window}", PartialMask.of(q, keys, g)))
    return out


CASES = _cases()


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("name,mask", CASES, ids=[c[0] for c in CASES])
def test_block_tables_equal_create_block_mask(name, mask, block):
    nq, nk = mask.shape
    ref = create_block_mask(mask_mod_of(mask), None, None, nq, nk, device="cpu", BLOCK_SIZE=block)
    got = flex_block_tables(mask, block)
    want = (ref.kv_num_blocks, ref.kv_indices, ref.full_kv_num_blocks, ref.full_kv_indices)
    for label, a, b in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (label, a.shape, b.shape)
        assert torch.equal(a, b), f"{label} differs ({name}, block {block})"
    # The padded block mask flex really runs with: the same tables as create_block_mask over the
    # padded row vectors at the bucket lengths, and the same tiles as above where they overlap.
    fm = flex_mask(mask, torch.device("cpu"), block)
    assert (fm.q_len, fm.k_len) == (bucket(nq, block), bucket(nk, block))
    pm = padded_mask(mask, fm.q_len, fm.k_len)
    ref_p = create_block_mask(mask_mod_of(pm), None, None, fm.q_len, fm.k_len, device="cpu", BLOCK_SIZE=block)
    bm = fm.block_mask
    for a, b in ((bm.kv_num_blocks, ref_p.kv_num_blocks), (bm.kv_indices, ref_p.kv_indices),
                 (bm.full_kv_num_blocks, ref_p.full_kv_num_blocks), (bm.full_kv_indices, ref_p.full_kv_indices),
                 (bm.q_num_blocks, ref_p.q_num_blocks), (bm.q_indices, ref_p.q_indices)):
        assert torch.equal(a, b), name
    # Tables that skip nothing would make this test vacuous: layout rows have empty tiles at 16.
    if block == 16 and not name.startswith("random"):
        assert int(got[0].sum() + got[2].sum()) < got[1].shape[-2] * got[1].shape[-1]


@pytest.mark.parametrize("name,mask", CASES[:6], ids=[c[0] for c in CASES[:6]])
def test_mask_mod_equals_dense_predicate(name, mask):
    nq, nk = mask.shape
    got = create_mask(mask_mod_of(mask), None, None, nq, nk, device="cpu")[0, 0]
    assert torch.equal(got, mask.dense())
    # padding adds rows and keys that nothing pairs with
    pm = padded_mask(mask, nq + 7, nk + 130)
    dense = pm.dense()
    assert torch.equal(dense[:nq, :nk], mask.dense()) and not dense[nq:].any() and not dense[:, nk:].any()


def dense_attention_fp64(q, k, v, allowed, scale):
    """Explicit softmax over a materialised mask in float64; GQA by repeating KV heads. Rows with
    no key: output 0, lse MASKED_SCORE (the kernels' convention)."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 2), v.double().repeat_interleave(rep, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v), lse.clamp_min(MASKED_SCORE)


def _math_reference(q, k, v, mask, scale):
    """The math kernel on this mask: it takes the PartialMask (the kernel interface) or, before the
    row-vector call sites land, the dense bool mask."""
    try:
        return math_partial_attention(q, k, v, mask, scale)
    except (AttributeError, TypeError):
        return math_partial_attention(q, k, v, mask.dense(), scale)


def _qkv(nq, nk, b, H, G, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(nq, b, H, d, generator=gen, dtype=dtype), torch.randn(nk, b, G, d, generator=gen, dtype=dtype),
            torch.randn(nk, b, G, d, generator=gen, dtype=dtype))


# random rows; random rows + window; one rank [noisy ; clean] x its clean keys; a CSBP rank + window
@pytest.mark.parametrize("idx,H,G", [(0, 4, 4), (2, 4, 2), (4, 6, 1), (11, 4, 2)])
def test_flex_forward_equals_dense_attention(idx, H, G):
    """Eager flex on CPU in float64 against the fp64 oracle. Error model: both are fp64 softmax
    sums over <= 400 keys with different summation order: |err| <~ 400 * 2^-52 * |v|max ~ 1e-13;
    tolerance 1e-10. In fp32 against the math kernel: ~400 * 2^-24 ~ 2.4e-5 worst case, tolerance
    1e-4 (observed ~1e-6)."""
    name, mask = CASES[idx]
    nq, nk = mask.shape
    dense = mask.dense()
    if idx == 4:  # block 0's noisy queries see no clean key: output 0, lse MASKED_SCORE
        assert not dense.any(1).all()
        # and its 128 x 128 tiles are of all three kinds: partial (mask_mod), full (none), empty
        partial, _, full, _ = flex_block_tables(mask)
        assert 0 < int(partial.sum()) and 0 < int(full.sum()) and int(partial.sum() + full.sum()) < 8
    q, k, v = _qkv(nq, nk, 2, H, G, 8, torch.float64, seed=idx)
    out, lse = flex_attention_partial(q, k, v, mask, 0.37)
    ref, ref_lse = dense_attention_fp64(q, k, v, dense, 0.37)
    assert out.shape == q.shape and lse.shape == (2, H, nq) and lse.dtype == torch.float64  # fp64 in, fp64 lse
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)
    assert torch.equal(lse[..., ~dense.any(1)], torch.full_like(lse[..., ~dense.any(1)], MASKED_SCORE))
    # fp32 against the math kernel on the dense mask (the small-case reference)
    q32, k32, v32 = q.float(), k.float(), v.float()
    out32, lse32 = get_kernel("flex", torch.device("cpu"))(q32, k32, v32, mask, 0.37)
    assert lse32.dtype == torch.float32
    mo, ml = _math_reference(q32, k32, v32, mask, 0.37)
    has = dense.any(1)  # the math kernel gives empty rows a finite garbage output of weight 0
    torch.testing.assert_close(out32[has], mo[has], atol=1e-4, rtol=0)
    torch.testing.assert_close(lse32, ml, atol=1e-4, rtol=1e-6)


def test_partials_over_disjoint_keys_merge_to_the_whole():
    """Flex partials over disjoint key chunks (many rows see nothing in a later chunk: lse
    MASKED_SCORE, weight 0) merge by log-sum-exp to dense attention over all keys. Partials are
    fp64 (lse too); merge_partials may accumulate in fp32: 2^-24 x |v| <~ 4 -> 2.4e-7, tolerance
    1e-6 (1e-10 where the merge keeps fp64)."""
    name, mask = CASES[5]  # a CSBP rank against the ring's clean keys, block causal
    nq, nk = mask.shape
    q, k, v = _qkv(nq, nk, 1, 4, 2, 8, torch.float64, seed=9)
    owner = torch.arange(nk) * 3 // nk  # three ring chunks of the gathered clean keys
    parts, empty_rows = [], 0
    for p in range(3):
        idx = (owner == p).nonzero().flatten()
        sub = PartialMask(mask.q, mask.k.select(idx))
        empty_rows += int((~sub.dense().any(1)).sum())
        parts.append(flex_attention_partial(q, k[idx], v[idx], sub, 0.3))
    assert empty_rows > 0
    out, lse = merge_partials(parts)
    ref, ref_lse = dense_attention_fp64(q, k, v, mask.dense(), 0.3)
    has = mask.dense().any(1)
    tol = 1e-10 if out.dtype == torch.float64 and lse.dtype == torch.float64 and merge_keeps_fp64() else 1e-6
    torch.testing.assert_close(out[has], ref[has], atol=tol, rtol=0)
    torch.testing.assert_close(lse[..., has], ref_lse[..., has], atol=tol, rtol=0)


def merge_keeps_fp64() -> bool:
    """Whether merge_partials accumulates fp64 partials in fp64 (a weight-1 and a weight-0 part)."""
    out = torch.full((1, 1, 1, 1), 1.0 + 2.0 ** -40, dtype=torch.float64)
    lse = torch.zeros(1, 1, 1, dtype=torch.float64)
    merged, _ = merge_partials([(out, lse), (out, lse - 1e30)])
    return bool(merged.flatten()[0] != 1.0)


def test_empty_sides():
    g = BlockGeometry(16, 4)
    rows = RowMeta.of(torch.arange(8), torch.arange(8))
    empty = rows.select(slice(0, 0))
    q, k, v = _qkv(16, 0, 1, 2, 2, 4, torch.float32, 0)
    out, lse = flex_attention_partial(q, k, v, PartialMask.of(rows, empty, g), 0.5)
    assert out.shape == q.shape and not out.any() and (lse == MASKED_SCORE).all()


def test_bucket_bounds():
    sizes = {bucket(n) for n in range(1, 1 << 20, 97)}
    assert len(sizes) <= 48
    for n in list(range(1, 5000)) + [2 ** 17 + 1, 3 * 2 ** 18 - 5, 2 ** 20]:
        b = bucket(n)
        assert b >= n and b % 128 == 0 and (n <= 1024 or b <= 1.25 * n + 128), (n, b)


def test_block_mask_is_owned_by_the_mask():
    gen = torch.Generator().manual_seed(5)
    mask = PartialMask.of(_random_rows(gen, 40, 64), _random_rows(gen, 50, 64), BlockGeometry(64, 8))
    fm = flex_mask(mask, torch.device("cpu"))
    assert flex_mask(mask, torch.device("cpu")) is fm
    ref = weakref.ref(fm.block_mask.kv_indices)
    del fm, mask
    gc.collect()
    assert ref() is None, "the block mask outlived its PartialMask"


def test_compiled_shapes_are_bucketed_and_the_limit_is_a_hard_error(monkeypatch):
    """Compiled flex (aot_eager backend: the CPU inductor backend rejects the lse output) meets
    two partial shapes in one bucket and compiles once; past RECOMPILE_LIMIT it raises instead
    of running uncompiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(torch.nn.attention.flex_attention.flex_attention, backend=counter, dynamic=False)
    g = BlockGeometry(256, 16)
    gen = torch.Generator().manual_seed(3)
    try:
        for nq, nk in [(100, 120), (128, 70)]:  # both in the (128, 128) bucket; 128 rows unpadded
            m = PartialMask.of(_random_rows(gen, nq, 256), _random_rows(gen, nk, 256), g)
            q, k, v = _qkv(nq, nk, 1, 2, 2, 8, torch.float32, nq)
            out, lse = flex_attention_partial(q, k, v, m, 0.5, compile=fn)
            ref, _ = _math_reference(q, k, v, m, 0.5)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
        assert counter.frame_count == 1
        monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
        with pytest.raises(Exception, match="(?i)recompil"):
            for nq in (200,):  # bucket 256: a second shape, past the limit
                m = PartialMask.of(_random_rows(gen, nq, 256), _random_rows(gen, 64, 256), g)
                q, k, v = _qkv(nq, 64, 1, 2, 2, 8, torch.float32, nq)
                flex_attention_partial(q, k, v, m, 0.5, compile=fn)
    finally:
        torch._dynamo.reset()
