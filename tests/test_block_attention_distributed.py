"""Attention-level exactness of every layout and transport on gloo against the dense reference.

Each rank holds the logical rows its layout gives it, runs the distributed block attention, and
back-propagates the reference upstream gradient of its rows (a row held by several ranks, like
BP's recomputed clean prefix, gets it on its first holder only, as in a real model where each
copy only feeds its own rank). Checks: outputs on every rank equal the reference; a row held by
one rank has exactly the reference dQ/dK/dV; replicated rows sum to the reference over holders.

In float64 (inputs EXACT_DTYPE; the kernels then compute in float64): the layouts only reorder the
softmax sums and the lse merges of <= 2L = 64 keys, an error ~ 64 u64 ~ 1e-14 on O(1) values;
ATOL = RTOL = 1e-11 leaves 10^3 (tests/gradients.py).
"""
from __future__ import annotations

import pytest
import torch

from megatron_csbp.attention.accounting import traffic_counter
from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout
from megatron_csbp.attention.kernels.registry import get_kernel
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, Documents, dense_reference_mask
from tests.distributed import run_distributed
from tests.gradients import EXACT_DTYPE

pytestmark = pytest.mark.exactness
TOL = dict(atol=1e-11, rtol=1e-11)


def _inputs(L, b, H, G, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2 * L, b, H, d, generator=g)
    k = torch.randn(2 * L, b, G, d, generator=g)
    v = torch.randn(2 * L, b, G, d, generator=g)
    do = torch.randn(2 * L, b, H, d, generator=g)
    return tuple(t.to(EXACT_DTYPE) for t in (q, k, v, do))


def held_rows(case) -> torch.Tensor:
    """How many ranks hold each of the 2L logical rows under the case's layout."""
    geometry = BlockGeometry(case["L"], case["B"], case["clean_attention"], case["window"])
    layout = SequenceLayout(geometry, case["cp"], case["bp"], case["schedule"])
    holders = torch.zeros(2 * case["L"], dtype=torch.long)
    for r in range(layout.shard_group_size):
        holders[logical_index(layout.rows(r), case["L"])] += 1
    return holders


def dense_reference(case, held):
    """Dense masked attention over all 2L logical rows, float64. Rows no rank holds (BP never
    computes the clean copy of the last block: no noisy block needs it) feed no loss, so they
    get no upstream gradient."""
    L, B, H, G, d = case["L"], case["B"], case["H"], case["G"], case["d"]
    q, k, v, do = (t.double() for t in _inputs(L, case["b"], H, G, d))
    do = do * (held > 0).double()[:, None, None, None]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    docs = _documents(case)
    mask = dense_reference_mask(L, B, case["clean_attention"], case["window"],
                                document_ids=None if docs is None else docs.ids().tolist())
    kk, vv = k.repeat_interleave(H // G, 2), v.repeat_interleave(H // G, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / d**0.5
    # nan_to_num: under packing a query may see no key at all (the first piece of a document
    # that starts inside a block has no clean prefix); its output is 0, as the kernels give
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, vv)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _documents(case):
    """The case's packed documents (`documents`: their start positions) or None."""
    starts = case.get("documents")
    return None if starts is None else Documents(tuple(starts), case["L"])


def logical_index(rows, L):
    return rows.position + L * rows.is_clean.long()


def _attention_rank(rank, world, cases):
    """Run every case in one spawned world (spawning is the expensive part on CPU)."""
    from megatron_csbp.parallel import state as bps

    results = []
    for case in cases:
        bps.initialize_block_parallel(context_parallel_size=case["cp"], block_parallel_size=case["bp"])
        geometry = BlockGeometry(case["L"], case["B"], case["clean_attention"], None)
        layout = SequenceLayout(geometry, case["cp"], case["bp"], case["schedule"])
        shard_rank = bps.get_shard_rank()
        plan = plan_for_layout(layout, shard_rank, bps.get_clean_ring_group(), case["transport"])
        plan = plan.for_documents(_documents(case))
        L = case["L"]
        q, k, v, do = _inputs(L, case["b"], case["H"], case["G"], case["d"])
        idx = logical_index(plan.local, L)
        # The first holder of each logical row gets its upstream gradient.
        first_holder = {}
        for r in range(layout.shard_group_size):
            for i in logical_index(layout.rows(r), L).tolist():
                first_holder.setdefault(i, r)
        mine = torch.tensor([first_holder[i] == shard_rank for i in idx.tolist()])
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        traffic_counter().reset()
        kernel = get_kernel(case.get("kernel", "tiled" if case.get("tiled") else "math"), q.device)
        out = block_diffusion_attention(ql, kl, vl, plan, softmax_scale=case["d"] ** -0.5,
                                        kernel=kernel, window=case["window"], layer=1)
        out.backward(do[idx] * mine[:, None, None, None])
        results.append(dict(idx=idx, out=out.detach(), shard_rank=shard_rank, dq=ql.grad, dk=kl.grad, dv=vl.grad,
                            sent=traffic_counter().total_sent, received=traffic_counter().total_received))
        bps.destroy_block_parallel()
    return results


def attention_bytes_formula(case, shard_rank) -> int:
    """Bytes received per rank per layer, forward + backward (design brief section 2), EXACT_DTYPE."""
    L, G, d, b = case["L"], case["G"], case["d"], case["b"]
    s = torch.tensor([], dtype=EXACT_DTYPE).element_size()
    if case["cp"] == 1:
        return 0  # single or BP: nothing moves
    if case["bp"] > 1 and (case["window"] is not None or case.get("documents") is not None):
        # Sliding window or packed documents under CSBP: forward receives K and V of the clean rows its
        # rows may attend to and does not hold, backward the gradients of the rows it sent: counted from
        # the mask predicate (documents included) and row ownership
        # (tests/test_window_exchange.window_rows_oracle), not the plan.
        from megatron_csbp.layout.layout import SequenceLayout
        from megatron_csbp.layout.masks import BlockGeometry
        from tests.test_window_exchange import window_rows_oracle

        layout = SequenceLayout(BlockGeometry(L, case["B"], case["clean_attention"], None), case["cp"], case["bp"],
                                case["schedule"])
        windowed = layout.geometry.with_window(case["window"])
        if case.get("documents") is not None:
            windowed = windowed.with_documents(_documents(case))
        recv, send = window_rows_oracle(layout, windowed, shard_rank)
        return (recv + send) * b * 2 * G * d * s
    P = case["cp"]  # ring size
    rows_moved = 2 * L if case["bp"] == 1 else L  # CP moves all 2L rows, CSBP the L clean rows
    # forward K and V of the other members' rows, backward their gradients
    return 2 * 2 * rows_moved * b * G * d * s * (P - 1) // P


def make_case(cp, bp, transport, schedule, clean_attention="block_causal", window=None, L=32, B=4):
    return dict(L=L, B=B, b=2, H=4, G=2, d=8, clean_attention=clean_attention, window=window,
                cp=cp, bp=bp, transport=transport, schedule=schedule)


WORLD_CASES = {
    2: [
        make_case(2, 1, "allgather", "mirrored"),
        make_case(2, 1, "ring", "mirrored", "token_causal"),
        make_case(1, 2, "allgather", "mirrored"),
        make_case(2, 2, "allgather", "mirrored"),
        make_case(2, 2, "ring", "mirrored", "token_causal"),
        make_case(2, 2, "allgather", "contiguous"),
        make_case(2, 2, "allgather", "mirrored", "token_causal", window=6),
        make_case(2, 2, "allgather", "contiguous", "block_causal", window=3),
        make_case(2, 1, "allgather", "mirrored", "block_causal", window=5),
    ],
    4: [
        make_case(4, 1, "allgather", "mirrored"),
        make_case(4, 1, "ring", "mirrored", "token_causal"),
        make_case(1, 4, "allgather", "mirrored"),
        make_case(4, 4, "allgather", "mirrored"),
        make_case(4, 4, "ring", "mirrored"),
        make_case(2, 4, "allgather", "mirrored", "token_causal"),
        make_case(2, 4, "ring", "contiguous"),
        make_case(4, 4, "allgather", "mirrored", "block_causal", window=7),
        make_case(2, 4, "allgather", "mirrored", "token_causal", window=5),
    ],
}


# cpu_flash: one local partial (strategies); math: separate partials. The 4-rank worlds are in
# the slow set (suite budget, docs/testing.md); both kernels' 2-rank worlds run by default.
# the 2-rank cpu_flash world is in the quick tier
@pytest.mark.parametrize("world,kernel", [pytest.param(w, k, marks=pytest.mark.slow if w == 4 else pytest.mark.quick
                                                       if k == "cpu_flash" else ()) for w in sorted(WORLD_CASES)
                                          for k in ("math", "cpu_flash")])
def test_distributed_attention_matches_dense(world, kernel):
    cases = [dict(case, kernel=kernel) for case in WORLD_CASES[world]]
    for rank_results_of_case, case in zip(zip(*run_distributed(_attention_rank, world, cases)), cases):
        check_case(case, list(rank_results_of_case))


def check_case(case, results):
    label = {k: case[k] for k in ("cp", "bp", "transport", "schedule", "clean_attention", "window")}
    held = held_rows(case)
    L, B = case["L"], case["B"]
    unheld = (held == 0).nonzero().flatten()
    if case.get("documents") is not None and case["cp"] > 1 and case["bp"] > 1 and case["window"] is None:
        # packed CSBP moves fewer rows than the unpacked all-gather
        unpacked = attention_bytes_formula(dict(case, documents=None), 0)
        assert all(res["received"] < unpacked for res in results), label
    if case["bp"] > 1 and case["cp"] == 1:
        # BP recomputes only the clean prefix noisy blocks need: the last clean block is unused.
        assert unheld.tolist() == list(range(2 * L - B, 2 * L)), label
    else:
        assert unheld.numel() == 0, label
    ref_out, ref_dq, ref_dk, ref_dv = dense_reference(case, held)
    holders = torch.zeros(2 * L, dtype=torch.long)
    refs = {"dq": ref_dq, "dk": ref_dk, "dv": ref_dv}
    sums = {n: torch.zeros_like(r) for n, r in refs.items()}
    for res in results:
        idx = res["idx"]
        torch.testing.assert_close(res["out"].double(), ref_out[idx], **TOL, msg=lambda m: f"{label}: {m}")
        expected = attention_bytes_formula(case, res["shard_rank"])
        assert res["received"] == expected, (label, res["received"], expected)
        if case["window"] is None and case.get("documents") is None:
            assert res["sent"] == res["received"], label
        holders[idx] += 1
        for n in sums:
            sums[n].index_add_(0, idx, res[n].double())
    assert torch.equal(holders, held), label
    for res in results:
        single = holders[res["idx"]] == 1  # rows only this rank holds: grads must be exact here
        for n, ref in refs.items():
            torch.testing.assert_close(res[n].double()[single], ref[res["idx"]][single], **TOL,
                                       msg=lambda m: f"{label} {n}: {m}")
    worst = max(float((sums[n] - ref).abs().max() / ref.abs().max()) for n, ref in refs.items())
    worst_out = max(float((res["out"] - ref_out[res["idx"]]).abs().max()) for res in results) / float(ref_out.abs().max())
    print(f"{label}: max|out - ref|/max|ref| {worst_out:.1e}, max|dqkv - ref|/max|ref| {worst:.1e}")
    for n, ref in refs.items():
        torch.testing.assert_close(sums[n], ref, **TOL, msg=lambda m: f"{label} sum {n}: {m}")
