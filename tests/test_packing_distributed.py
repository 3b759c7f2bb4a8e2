"""Packed documents under every layout and transport, attention level, float64 on gloo: outputs
and dQ/dK/dV of every rank equal the dense reference with document ids (the checks of
tests/test_block_attention_distributed.py), and the clean exchange of CSBP moves only the clean
rows some local query of the same document may see (bytes counted by the transports, equal to
the static plan, fewer than unpacked)."""
from __future__ import annotations

import pytest
import torch

from megatron_csbp.attention.accounting import traffic_counter
from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout
from megatron_csbp.attention.kernels import math_partial_attention, tiled_partial_attention
from megatron_csbp.layout.exchange import WindowExchangePlan
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, Documents, dense_reference_mask
from tests.distributed import run_distributed
from tests.gradients import EXACT_DTYPE
from tests.test_block_attention_distributed import _inputs, logical_index, make_case

pytestmark = pytest.mark.exactness
TOL = dict(atol=1e-11, rtol=1e-11)  # as tests/test_block_attention_distributed.py (float64, 64 keys)
L, B = 32, 4
# Boundaries inside blocks (3, 13, 26), a one-token document (13), one ending on a block edge (16).
DOCS = Documents((0, 3, 13, 14, 16, 26), L)


def _layout(case):
    return SequenceLayout(BlockGeometry(L, B, case["clean_attention"], None), case["cp"], case["bp"], case["schedule"])


def _rank(rank, world, cases):
    from megatron_csbp import parallel_state as bps

    results = []
    for case in cases:
        bps.initialize_block_parallel(context_parallel_size=case["cp"], block_parallel_size=case["bp"])
        layout = _layout(case)
        shard_rank = bps.get_shard_rank()
        plan = plan_for_layout(layout, shard_rank, bps.get_clean_ring_group(), case["transport"]).for_documents(DOCS)
        q, k, v, do = _inputs(L, case["b"], case["H"], case["G"], case["d"])
        idx = logical_index(plan.local, L)
        first_holder = {}
        for r in range(layout.shard_group_size):
            for i in logical_index(layout.rows(r), L).tolist():
                first_holder.setdefault(i, r)
        mine = torch.tensor([first_holder[i] == shard_rank for i in idx.tolist()])
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        traffic_counter().reset()
        kernel = tiled_partial_attention if case.get("tiled") else math_partial_attention
        out = block_diffusion_attention(ql, kl, vl, plan, softmax_scale=case["d"] ** -0.5, kernel=kernel,
                                        window=case["window"], layer=1)
        out.backward(do[idx] * mine[:, None, None, None])
        results.append(dict(idx=idx, out=out.detach(), shard_rank=shard_rank, dq=ql.grad, dk=kl.grad, dv=vl.grad,
                            received=traffic_counter().total_received))
        bps.destroy_block_parallel()
    return results


def expected_bytes(case, shard_rank, packed=True):
    """Per layer, forward + backward. CP: K/V of all rows (as unpacked: Megatron's CP has no
    notion of documents). CSBP: exactly the static interval plan's rows (forward: rows received,
    backward: gradients of rows sent); unpacked CSBP all-gathers every clean shard."""
    G, d, b = case["G"], case["d"], case["b"]
    s = torch.tensor([], dtype=EXACT_DTYPE).element_size()
    layout, P = _layout(case), case["cp"]
    if P == 1:
        return 0
    if case["bp"] == 1 or not packed:
        rows = 2 * L if case["bp"] == 1 else L
        return 2 * 2 * rows * b * G * d * s * (P - 1) // P
    geometry = layout.geometry.with_window(case["window"]).with_documents(DOCS)
    members = [layout.rows(m) for m in layout.ring_ranks(shard_rank)]
    plan = WindowExchangePlan.build(members, layout.ring_clean_rows(shard_rank), geometry, layout.ring_of(shard_rank)[1])
    return (sum(plan.recv_counts) + sum(plan.send_counts)) * b * 2 * G * d * s


def dense_reference(case, held):
    q, k, v, do = (t.double() for t in _inputs(L, case["b"], case["H"], case["G"], case["d"]))
    do = do * (held > 0).double()[:, None, None, None]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = dense_reference_mask(L, B, case["clean_attention"], case["window"], document_ids=DOCS.ids().tolist())
    H, G = case["H"], case["G"]
    kk, vv = k.repeat_interleave(H // G, 2), v.repeat_interleave(H // G, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / case["d"] ** 0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, vv)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


CASES = {
    2: [make_case(2, 1, "allgather", "mirrored"), make_case(2, 1, "ring", "mirrored", "token_causal"),
        make_case(1, 2, "allgather", "mirrored"), make_case(2, 2, "allgather", "mirrored"),
        make_case(2, 2, "ring", "contiguous", "token_causal"),
        make_case(2, 2, "allgather", "mirrored", "block_causal", window=6),
        dict(make_case(2, 2, "ring", "mirrored"), tiled=True)],
    4: [make_case(4, 1, "allgather", "mirrored"), make_case(1, 4, "allgather", "mirrored"),
        make_case(4, 4, "allgather", "mirrored"), make_case(2, 4, "ring", "mirrored", "token_causal"),
        make_case(4, 4, "ring", "contiguous", "block_causal", window=7)],
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_packed_layouts_match_dense_reference(world):
    cases = CASES[world]
    for per_rank, case in zip(zip(*run_distributed(_rank, world, cases)), cases):
        label = {k: case[k] for k in ("cp", "bp", "transport", "schedule", "clean_attention", "window")}
        layout = _layout(case)
        held = torch.zeros(2 * L, dtype=torch.long)
        for r in range(layout.shard_group_size):
            held[logical_index(layout.rows(r), L)] += 1
        ref_out, *ref_grads = dense_reference(case, held)
        sums = [torch.zeros_like(r) for r in ref_grads]
        for res in per_rank:
            idx = res["idx"]
            torch.testing.assert_close(res["out"], ref_out[idx], **TOL, msg=lambda m: f"{label}: {m}")
            assert res["received"] == expected_bytes(case, res["shard_rank"]), label
            if case["bp"] > 1 and case["cp"] > 1 and case["window"] is None:
                assert res["received"] < expected_bytes(case, res["shard_rank"], packed=False), label
            for s, g in zip(sums, (res["dq"], res["dk"], res["dv"])):
                s.index_add_(0, idx, g)
        for name, s, r in zip(("dq", "dk", "dv"), sums, ref_grads):
            torch.testing.assert_close(s, r, **TOL, msg=lambda m: f"{label} {name}: {m}")
