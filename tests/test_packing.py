"""Packed documents (docs/semantics.md "Packed documents"): the predicate with document ids equals
its dense oracle, and every document's attention, through every kernel, equals that document run
alone with the block grid it has in the pack, in float64 (outputs and gradients).

The per-document oracle does not use `Documents` at all: a document of n tokens starting at
position s sits alone at offset o = s mod B of a sequence of its own (positions [o, o + n), the
rest empty), and its mask is the plain, unpacked `dense_reference_mask` of that sequence restricted
to the document's rows. That is "the document alone, on the grid it has in the pack"; for a
document starting on a block edge (o = 0) it is the document alone, full stop.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout
from megatron_csbp.attention.kernels.registry import KERNELS
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, Documents, RowMeta, allowed, dense_reference_mask, logical_rows
from megatron_csbp.layout.rows import PartialMask

# Boundaries that matter: inside blocks, one-token documents, a document ending exactly on a block
# edge, a document starting on one; L = 40, B = 4.
PACKS = {
    "mixed": (0, 3, 4, 5, 12, 13, 14, 27, 36),      # 1-token docs at 3, 4 (block edge), 12, 13; 5..12 ends on an edge
    "edges": (0, 8, 16, 24),                        # every document starts and ends on block edges
    "one_token_tail": (0, 17, 39),                  # a straddling document, the last position alone
}


def random_documents(L, seed, count):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(L - 1, generator=g)[: count - 1] + 1
    return Documents(tuple([0] + sorted(cuts.tolist())), L)


def test_documents_from_eod_tokens_and_ids():
    tokens = torch.tensor([5, 9, 7, 9, 9, 3, 2, 9])  # EOD = 9
    docs = Documents.of_eod(tokens, 9)
    # The EOD belongs to the document it ends; the last token's EOD opens nothing.
    assert docs.starts == (0, 2, 4, 5) and docs.lengths == (2, 2, 1, 3)
    assert docs.ids().tolist() == [0, 0, 1, 1, 2, 3, 3, 3]
    assert Documents.of_ids([4, 4, 1, 1, 1, 7]).starts == (0, 2, 5)
    with pytest.raises(ValueError, match="contiguous runs"):
        Documents.of_ids([0, 0, 1, 0])
    with pytest.raises(ValueError, match="must begin with 0"):
        Documents((1, 3), 8)
    with pytest.raises(ValueError, match="increase strictly"):
        Documents((0, 3, 3), 8)
    with pytest.raises(ValueError, match="documents cover 8 positions"):
        BlockGeometry(16, 4, documents=Documents((0, 3), 8))
    # One document is the unpacked geometry.
    assert BlockGeometry(16, 4).with_documents(Documents((0,), 16)).documents is None


@pytest.mark.parametrize("variant", ["block_causal", "token_causal"])
@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("pack", [*PACKS, "random"])
def test_allowed_equals_dense_oracle_with_documents(variant, window, pack):
    L, B = 40, 4
    docs = random_documents(L, 7, 9) if pack == "random" else Documents(PACKS[pack], L)
    g = BlockGeometry(L, B, variant, window, docs)
    rows = logical_rows(L)
    got = allowed(rows, rows, g)
    want = dense_reference_mask(L, B, variant, window, document_ids=docs.ids().tolist())
    assert torch.equal(got, want)
    # The kernels' row vectors say the same, pair by pair and in their pair count.
    m = PartialMask.of(rows, rows, g)
    assert torch.equal(m.dense(), want)
    assert m.allowed_pairs() == int(want.sum())
    # Never across documents; fewer pairs than unpacked whenever there is more than one document.
    ids = docs.ids().repeat(2)
    assert not bool((want & (ids[:, None] != ids[None, :])).any())
    assert int(want.sum()) < int(dense_reference_mask(L, B, variant, window).sum())


def alone_mask(start, n, B, variant, window):
    """Mask of a document of n tokens alone, on its grid in the pack (offset start mod B), in its
    rows' order [noisy ; clean] (2n x 2n): the unpacked oracle of a sequence holding only it."""
    o = start % B
    Lp = -(-(o + n) // B) * B
    full = dense_reference_mask(Lp, B, variant, window)
    pos = torch.arange(o, o + n)
    idx = torch.cat([pos, Lp + pos])
    return full[idx][:, idx]


def dense_fp64(q, k, v, mask, scale, do):
    """Dense attention in float64 over an explicit mask; (out, dq, dk, dv). GQA by head groups."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("qbhd,kbhd->bhqk", q, kk) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)  # a query with no key: 0
    out = torch.einsum("bhqk,kbhd->qbhd", p, vv)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _kernel(name):
    if name == "flash":  # the flash decomposition, varlen pieces by their documented fp64 semantics
        from megatron_csbp.attention.kernels.flash import flash_attention_partial
        from megatron_csbp.attention.kernels.tiled import tiled_partial_attention
        from tests.test_flash import varlen_reference

        return partial(flash_attention_partial, flash_fn=varlen_reference, fallback=tiled_partial_attention)
    return KERNELS[name]


def _qkvdo(L, seed, b=2, H=4, G=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2 * L, b, h, d, generator=g, dtype=torch.float64) for h in (H, G, G, H)]


# Flash: the reference varlen carries its lse in fp32 (tests/test_flash.py), so 1e-5 there.
KERNEL_TOL = {"math": 1e-12, "tiled": 1e-12, "flex": 1e-12, "flash": 1e-5}


VARIANTS = [("block_causal", None), ("token_causal", None), ("block_causal", 6), ("token_causal", 5)]
# Every kernel on the mixed pack (all boundary kinds); the other packs on the default CPU kernel.
ALONE_CASES = ([(k, v, w, "mixed") for k in ("tiled", "math", "flex", "flash") for v, w in VARIANTS]
               + [("tiled", v, w, p) for v, w in VARIANTS for p in ("edges", "one_token_tail", "random")])


@pytest.mark.parametrize("kernel,variant,window,pack", ALONE_CASES)
def test_each_document_equals_it_alone(kernel, variant, window, pack):
    """Single rank, float64: the packed attention's rows of each document (output, dq, dk, dv)
    equal the document alone on its grid. Gradients: one upstream gradient for all rows; a
    document's dq/dk/dv depend only on its own rows' upstream gradients, so each document's
    alone-run gets the same rows of it."""
    L, B = 40, 4
    docs = random_documents(L, 3, 7) if pack == "random" else Documents(PACKS[pack], L)
    plan = plan_for_layout(SequenceLayout(BlockGeometry(L, B, variant), 1, 1)).for_documents(docs)
    q, k, v, do = _qkvdo(L, seed=11)
    grads = kernel != "flex"  # FlexAttention has no backward on CPU (forward only here)
    q, k, v = (t.clone().requires_grad_(grads) for t in (q, k, v))
    scale = 8 ** -0.5
    out = block_diffusion_attention(q, k, v, plan, softmax_scale=scale, kernel=_kernel(kernel), window=window)
    if grads:
        out.backward(do)
    tol = dict(atol=KERNEL_TOL[kernel], rtol=0)
    for start, n in zip(docs.starts, docs.lengths):
        rows = torch.cat([torch.arange(start, start + n), L + torch.arange(start, start + n)])  # [noisy ; clean]
        mask = alone_mask(start, n, B, variant, window)
        ref = dense_fp64(q[rows], k[rows], v[rows], mask, scale, do[rows])
        for name, got, want in list(zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref))[: 4 if grads else 1]:
            torch.testing.assert_close(got[rows].detach(), want, **tol,
                                       msg=lambda m: f"document [{start}, {start + n}) {name}: {m}")


def test_packed_noisy_blocks_skip_the_folded_fast_path_only_when_split():
    """Documents on block edges keep the B x B folded block-diagonal noisy attention; a block
    split by a boundary takes the masked partial (its pieces are not one B x B problem)."""
    L, B = 32, 4
    plan = plan_for_layout(SequenceLayout(BlockGeometry(L, B), 1, 1))
    assert plan.for_documents(Documents((0, 8, 20), L)).noisy_rows_are_whole_blocks
    assert not plan.for_documents(Documents((0, 9, 20), L)).noisy_rows_are_whole_blocks
    # Positions restart per document only with reset_position_ids.
    docs = Documents((0, 9, 20), L)
    assert torch.equal(plan.for_documents(docs).model_positions(torch.arange(L)), torch.arange(L))
    reset = plan.for_documents(docs, mask=False, reset_position_ids=True)
    assert reset.geometry.documents is None
    assert reset.model_positions(torch.tensor([0, 8, 9, 19, 20, 31])).tolist() == [0, 8, 0, 10, 0, 11]


def test_row_vectors_carry_no_document_bytes():
    """Documents change the values of the kernels' row vectors (block ids become piece ids,
    intervals are cut), never their size: 13 bytes a query row, 9 a key row, as unpacked."""
    L, B = 64, 4
    rows = logical_rows(L)
    plain = PartialMask.of(rows, rows, BlockGeometry(L, B))
    packed = PartialMask.of(rows, rows, BlockGeometry(L, B, documents=random_documents(L, 1, 12)))
    assert packed.nbytes == plain.nbytes == 2 * L * (13 + 9)
    assert packed.allowed_pairs() < plain.allowed_pairs()


@pytest.mark.parametrize("variant,window", VARIANTS)
def test_flash_pieces_cover_every_packed_pair_once(variant, window):
    """The flash decomposition of packed masks: noisy pieces become varlen sequences per block
    piece, clean runs stop at document starts; every allowed pair is covered exactly once."""
    from megatron_csbp.attention.kernels.flash import FlashPlan
    from tests.test_flash import _covered

    L, B = 40, 4
    rows = logical_rows(L)
    m = PartialMask.of(rows, rows, BlockGeometry(L, B, variant, window, Documents(PACKS["mixed"], L)))
    assert torch.equal(_covered(FlashPlan.of(m), m.shape), m.dense().long())


def test_megatron_lm_batch_applies_eod_mask_loss_to_the_diffused_labels():
    """Megatron's GPTDataset masks the target after an EOD input (loss_mask[text[:-1] == EOD] = 0);
    the plugin diffuses labels = text[1:], so its mask must be 0 where the label itself is EOD."""
    from megatron_csbp.layout.packing import Packing
    from megatron_csbp.training.megatron_lm import bdlm_batch

    eod = 9
    text = torch.tensor([[1, 2, 9, 3, 4, 9, 9, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 1]])
    tokens, labels = text[:, :-1], text[:, 1:]
    megatron_mask = (tokens != eod).float()
    megatron_mask[1] = 0  # a padding sample Megatron masks whole stays masked
    clean, supervised = bdlm_batch(dict(tokens=tokens, labels=labels, loss_mask=megatron_mask), None,
                                   Packing(eod, eod_mask_loss=True))
    assert torch.equal(clean, labels)
    assert supervised[0].tolist() == (labels[0] != eod).float().tolist()
    assert supervised[1].sum() == 0


def test_eod_mask_loss_is_megatrons_rule_for_each_target_shift():
    """No target for a row that reads an EOD: block diffusion's row p predicts token p (the EOD
    itself leaves the mask); AR / Fast-dLLM v2 rows predict p + 1 (the token after the EOD)."""
    from megatron_csbp.layout.packing import Packing

    tokens = torch.tensor([[4, 9, 5, 6, 9, 7]])
    ones = torch.ones_like(tokens, dtype=torch.float32)
    pk = Packing(9, eod_mask_loss=True)
    assert pk.loss_mask(tokens, ones).tolist() == [[1, 0, 1, 1, 0, 1]]
    assert pk.loss_mask(tokens, ones, target_shift=1).tolist() == [[1, 1, 0, 1, 1, 0]]
    assert Packing(9).loss_mask(tokens, ones).tolist() == ones.tolist()
    with pytest.raises(ValueError, match="need the EOD token id"):
        Packing(None, reset_attention_mask=True)


def test_bp_ownership_balances_packed_cost():
    """Under BP a packed sample's blocks go to ranks by their in-document cost (`block_costs`):
    every rank keeps its block count, the cost is each piece's n x (n + in-document prefix), and
    the spread of allowed pairs over ranks drops (docs/benchmarks/packing.md)."""
    from dataclasses import replace

    from megatron_csbp.bench.packing import pack_documents, summary
    from megatron_csbp.layout.layout import balanced_owners
    from megatron_csbp.layout.packing import block_costs

    L, B = 64, 4
    docs = Documents((0, 6, 7, 24, 40), L)
    costs = block_costs(docs, B, L)
    # Block 1 = positions 4..7: piece [4, 6) of doc 0 (prefix 4), [6, 7) alone, [7, 8) of doc [7, 24).
    assert costs[1] == 2 * (2 + 4) + 1 * 1 + 1 * 1
    assert sum(costs) == PartialMask.of(logical_rows(L).select(slice(0, L)), logical_rows(L),
                                        BlockGeometry(L, B, documents=docs)).allowed_pairs()
    parts = balanced_owners(list(range(16)), costs, [4, 4, 4, 4])
    assert sorted(b for p in parts for b in p) == list(range(16)) and all(len(p) == 4 for p in parts)
    layout = SequenceLayout(BlockGeometry(L, B), 1, 4)
    assert replace(layout, block_costs=costs).block_owners == [sorted(p) for p in parts]
    hist = pack_documents(1024, histogram={16: 5, 64: 3, 300: 1}, seed=1)
    s = summary(1024, 16, 1, 4, hist)
    assert s["balanced_pairs_spread"] < s["packed_pairs_spread"]
    assert s["balanced_pairs_spread"] < 1.05
