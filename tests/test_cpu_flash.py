"""The GPU flash decomposition (`attention/flash.FlashPlan`) run on torch's CPU flash attention
(`attention/cpu_flash.py`): outputs, lse and q/k/v gradients (through the lse too, including
rows whose lse gradient the flash backward cannot take) against dense fp64 attention on random
row sets, windows, GQA and queries with no key; the pieces cover every allowed pair exactly once;
the one-rank block-diffusion mask runs on flash calls only; layouts through the kernel agree with
the tiled kernel."""
import pytest
import torch

from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout
from megatron_csbp.attention.kernels.cpu_flash import (
    FlashPiece,
    RunGroup,
    TiledPiece,
    cpu_flash_partial_attention,
    cpu_flash_plan,
)
from megatron_csbp.attention.kernels.registry import get_kernel, tiled_partial_attention
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, allowed, logical_rows
from megatron_csbp.layout.rows import PartialMask
from tests.test_tiled import CASES, _grads, _inputs, _random_rows, dense_fp64


def _case(L, B, variant, window, nq, nk):
    geometry = BlockGeometry(L, B, variant, window)
    gen = torch.Generator().manual_seed(L + nq + nk)
    qm, km = _random_rows(gen, nq, L), _random_rows(gen, nk, L, low=L // 4)
    return PartialMask.of(qm, km, geometry), allowed(qm, km, geometry)


def _idx(rows, n):
    if isinstance(rows, tuple):  # a few runs of rows
        return torch.cat([torch.arange(n)[r] for r in rows])
    return torch.arange(n)[rows] if isinstance(rows, slice) else rows


def _piece_pairs(mask, plan):
    """Count of times each (query, key) pair is computed by the plan's pieces: [sq, sk] int."""
    sq, sk = mask.shape
    count = torch.zeros(sq, sk, dtype=torch.long)
    for p in plan.calls:
        q, k = _idx(p.q, sq), _idx(p.k, sk)
        if isinstance(p, TiledPiece):
            count[q[:, None], k[None, :]] += p.mask.dense().long()
            continue
        for qs, ks in zip(q.view(p.seqs, -1), k.view(p.seqs, -1)):
            ok = torch.ones(qs.numel(), ks.numel(), dtype=torch.long)
            if p.causal:
                ok = ok.tril()
            count[qs[:, None], ks[None, :]] += ok
    return count


@pytest.mark.parametrize("L,B,variant,window,nq,nk,H,G,tiles", CASES)
def test_cpu_flash_equals_dense_fp64_on_random_rows(L, B, variant, window, nq, nk, H, G, tiles):
    mask, dense = _case(L, B, variant, window, nq, nk)
    assert (~dense.any(1)).any()  # queries with no key at all
    # Every allowed pair in exactly one piece, no other pair.
    assert torch.equal(_piece_pairs(mask, cpu_flash_plan(mask)), dense.long())
    has = dense.any(1)[None, None, :].expand(2, H, -1)
    q, k, v = _inputs(nq, nk, 2, H, G, 8, torch.float64, seed=nq)
    out, lse = cpu_flash_partial_attention(q, k, v, mask, 0.4)
    out_d, lse_d = dense_fp64(q, k, v, dense, 0.4)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    # fp64 throughout (the CPU flash op runs fp64): rounding of O(1) values over a few hundred keys.
    torch.testing.assert_close(out, out_d, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.where(has, lse, 0.0), torch.where(has, lse_d, 0.0), rtol=0, atol=1e-12)
    assert (lse[~has] == -1e30).all() and (out.permute(1, 2, 0, 3)[~has] == 0).all()
    for a, b in zip(_grads(out, lse, has, (q, k, v), seed=1), _grads(out_d, lse_d, has, (q, k, v), seed=1)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_lse_gradient_without_output_gradient_takes_the_tiled_backward():
    """dO = 0 with dlse != 0 (the lse used by something other than a merge): the flash backward
    reads D from `out` and cannot take dlse there; those rows go through the tiled backward."""
    L, B, variant, window, nq, nk, H, G, _ = CASES[0]
    mask, dense = _case(L, B, variant, window, nq, nk)
    has = dense.any(1)[None, None, :].expand(2, H, -1)
    q, k, v = _inputs(nq, nk, 2, H, G, 8, torch.float64, seed=3)
    gl = torch.randn(2, H, nq, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * has
    go = torch.randn(nq, 2, H, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    go[: nq // 2] = 0  # half the rows: lse gradient only
    grads = []
    for fn in (cpu_flash_partial_attention, lambda *a: dense_fp64(*a[:3], dense, a[4])):
        out, lse = fn(q, k, v, mask, 0.4)
        loss = (torch.where(has, lse, 0.0) * gl).sum() + (out * go).sum()
        grads.append(torch.autograd.grad(loss, (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_fp32_within_the_error_model():
    # fp32 against the fp64 oracle. Error model: outputs and dQ/dK/dV are softmax-weighted sums of
    # O(1) randn values over <= 130 keys, each rounding at most eps32 = 6e-8 relative per
    # operation with blocked accumulation depth <= log2(130) + a few merges (<= 12 roundings):
    # ~12 x 6e-8 x O(1) = 7e-7 per entry, times the gradient's O(few) magnitude; scores q.k over
    # d = 8 at scale 0.4 stay O(1). Measured: 2.0e-6 worst over all five CASES (docs/exactness.md);
    # 1e-5 is a 5x margin (the bound test_tiled uses for the tiled kernel).
    L, B, variant, window, nq, nk, H, G, _ = CASES[2]
    mask, dense = _case(L, B, variant, window, nq, nk)
    has = dense.any(1)[None, None, :].expand(2, H, -1)
    q, k, v = _inputs(nq, nk, 2, H, G, 8, torch.float32, seed=9)
    out, lse = cpu_flash_partial_attention(q, k, v, mask, 0.4)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    out_d, lse_d = dense_fp64(q, k, v, dense, 0.4)
    torch.testing.assert_close(out.double(), out_d, rtol=0, atol=1e-5)
    for a, b in zip(_grads(out, lse, has, (q, k, v), seed=2), _grads(out_d, lse_d, has, (q, k, v), seed=2)):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["block_causal", "token_causal"])
def test_one_rank_mask_runs_on_flash_calls_only(variant):
    """The whole block-diffusion mask (2L rows, no window): whole noisy blocks, clean prefixes and
    token-causal diagonals (causal squares) as flash calls on views of q/k/v; nothing tiled."""
    L, B = 256, 16
    meta = logical_rows(L)
    mask = PartialMask.of(meta, meta, BlockGeometry(L, B, variant))
    plan = cpu_flash_plan(mask)
    calls = plan.calls
    assert all(isinstance(p, FlashPiece) for p in calls)
    assert torch.equal(_piece_pairs(mask, plan), mask.dense().long())
    # keys always a slice of the key rows (no copy); queries too but for the groups that join
    # noisy block c + 1 and clean block c (same clean prefix, rows in two places)
    assert all(isinstance(p.k, slice) for p in calls)
    # the L / B whole noisy blocks (adjacent views of one shape) are one batched call, not a call each
    stacked = [p for p in calls if p.seqs > 1]
    assert [(p.q, p.k, p.seqs) for p in stacked] == [(slice(0, L), slice(0, L), L // B)]
    assert sum(isinstance(p.q, slice) for p in calls) >= 1 + (variant == "token_causal")
    assert sum(p.causal for p in calls) == (variant == "token_causal")  # one L x L causal call
    # the joined queries are two runs of rows; consecutive joined pieces gather their rows once as a
    # group (L / B - 1 of them, 2B rows each: one group at L = 256, B = 16); the plan keeps no index
    # vector (it kept 8 bytes per joined query row, the excess of CSBP's peak memory over CP's)
    joined = [p.q for p in calls if not isinstance(p.q, slice)]
    assert all(isinstance(q, tuple) and len(q) == 2 for q in joined)
    assert bool(joined) == (variant == "block_causal")  # token-causal clean rows have no shared prefix
    groups = [p for p in plan.pieces if isinstance(p, RunGroup)]
    assert [len(g.members) for g in groups] == ([L // B - 1] if variant == "block_causal" else [])
    assert plan.nbytes == 0


@pytest.mark.parametrize("stack_rows", [16, 48, 96, 512])
def test_stacked_noisy_blocks_equal_dense_fp64(stack_rows, monkeypatch):
    """Whole noisy blocks batched into calls of at most STACK_ROWS query rows (one block per call,
    three, all sixteen): outputs, lse and gradients equal dense fp64 attention."""
    import megatron_csbp.attention.kernels.cpu_flash as cf

    monkeypatch.setattr(cf, "STACK_ROWS", stack_rows)
    L, B, H, G = 256, 16, 4, 2
    meta = logical_rows(L)
    mask = PartialMask.of(meta, meta, BlockGeometry(L, B))
    dense = mask.dense()
    plan = cf.CpuFlashPlan.of(mask)
    noisy = [p for p in plan.calls if isinstance(p.k, slice) and p.k.stop <= L]  # keys: rows [0, L)
    per_call = min(stack_rows // B, L // B)
    assert [p.seqs for p in noisy] == [per_call] * (L // B // per_call) + ([L // B % per_call] if L // B % per_call else [])
    assert torch.equal(_piece_pairs(mask, plan), dense.long())
    q, k, v = _inputs(2 * L, 2 * L, 1, H, G, 8, torch.float64, seed=5)
    out, lse = cf.HeadsFirstAttention.apply((cf._forward, cf._backward), q, k, v, mask, plan, 0.4)
    out_d, lse_d = dense_fp64(q, k, v, dense, 0.4)
    torch.testing.assert_close(out, out_d, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse_d, rtol=0, atol=1e-12)
    has = dense.any(1)[None, None, :].expand(1, H, -1)
    for a, b in zip(_grads(out, lse, has, (q, k, v), seed=3), _grads(out_d, lse_d, has, (q, k, v), seed=3)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("variant", ["block_causal", "token_causal"])
def test_one_rank_mask_merges_once_and_gathers_once_per_group(variant):
    """The per-piece costs of CSBP's own chunk (whole noisy blocks with their clean prefixes, the
    clean blocks sharing them): the noisy blocks merge once into the rows their prefixes reached
    (the noisy call runs last; it merged block by block), and the pieces whose queries lie in two
    runs gather their rows once per group and direction (q in forward; dO, q, out, lse and the lse
    fix in backward) and scatter once (out, lse; dq): no concatenation per piece, and the group's
    outputs reuse its gathered q (no buffer beyond the gathered rows)."""
    from torch.profiler import ProfilerActivity, profile

    L, B = 256, 16
    meta = logical_rows(L)
    mask = PartialMask.of(meta, meta, BlockGeometry(L, B, variant))
    plan = cpu_flash_plan(mask)
    assert sum(not first for first in plan.firsts) == 1
    groups = sum(isinstance(p, RunGroup) for p in plan.pieces)
    assert groups == (variant == "block_causal")
    q, k, v = _inputs(2 * L, 2 * L, 1, 4, 2, 8, torch.float32, seed=7)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out, lse = cpu_flash_partial_attention(q, k, v, mask, 0.3)
        (out.sum() + lse.sum()).backward()
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("aten::logaddexp") == 1
    # per group: an index built per direction (arange + repeat_interleave, which gathers once and
    # builds its own range), 1 + 5 gathers, 2 + 1 scatters; nothing else
    assert calls.get("aten::repeat_interleave", 0) == 4 * groups
    assert calls.get("aten::arange", 0) == 4 * groups
    assert calls.get("aten::index_select", 0) == (6 + 2) * groups
    assert calls.get("aten::index_copy_", 0) == 2 * groups
    assert calls.get("aten::index_add_", 0) == groups
    # no concatenation: a member's out, lse and dq are written over its rows of the gathered buffers
    assert calls.get("aten::cat", 0) == 0
    assert calls["aten::_scaled_dot_product_flash_attention_for_cpu"] == len(plan.calls) == plan.flash_calls


def test_selected_on_cpu_by_default():
    assert get_kernel("auto", torch.device("cpu")) is get_kernel("cpu_flash", torch.device("cpu"))


@pytest.mark.parametrize("window", [None, 6])
def test_single_layout_through_block_attention_matches_tiled(window):
    geometry = BlockGeometry(64, 8, "block_causal", window)
    plan = plan_for_layout(SequenceLayout(geometry), 0)
    q, k, v = _inputs(128, 128, 1, 4, 2, 8, torch.float64, seed=11)
    res = []
    for kernel in (get_kernel("cpu_flash", q.device), tiled_partial_attention):
        out = block_diffusion_attention(q, k, v, plan, softmax_scale=0.3, kernel=kernel)
        res.append((out,) + torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out).double()).sum(),
                                                (q, k, v)))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_no_rows_by_keys_tensor_and_plan_linear_in_the_rows():
    from tests.test_tiled import _LargestTensor

    L, B, H, G, d = 1024, 64, 2, 1, 8
    rows = logical_rows(L)
    mask = PartialMask.of(rows, rows, BlockGeometry(L, B))
    q, k, v = _inputs(2 * L, 2 * L, 1, H, G, d, torch.float32, seed=4)
    with _LargestTensor() as probe:
        out, lse = cpu_flash_partial_attention(q, k, v, mask, 0.3)
        (out.sum() + lse.sum()).backward()
    assert probe.largest <= 2 * L * H * d < (2 * L) ** 2 // 16, probe.largest  # q itself is the largest
    assert mask.derived_nbytes() <= 64 * 2 * L


def test_kernel_rate_benchmark_counts_the_whole_mask(tmp_path):
    """The rate benchmark (a benchmark, not a timed test): both kernels and SDPA on the one-rank
    mask, pairs = L (L + B)."""
    import torch as _torch

    from megatron_csbp.bench.kernel_rate import kernel_rates, main

    threads = _torch.get_num_threads()
    try:
        rows = kernel_rates((128,), block_size=16, repeats=1)
        main(["--seq-lengths", "64", "--block-size", "16", "--repeats", "1", "--markdown", str(tmp_path / "r.md")])
    finally:
        _torch.set_num_threads(threads)
    assert {r["kernel"] for r in rows} == {"tiled", "cpu_flash"}
    assert all(r["allowed_pairs"] == 128 * (128 + 16) and r["rate_vs_sdpa"] > 0 for r in rows)
    assert "python -m megatron_csbp.bench.kernel_rate" in (tmp_path / "r.md").read_text()
