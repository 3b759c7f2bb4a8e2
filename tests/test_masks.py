"""The mask predicate `allowed` against the dense oracle and hand-written cases of the rule table."""
import itertools

import pytest
import torch

from megatron_csbp.layout.masks import (BlockGeometry, RowMeta, allowed, clean_key_interval,
                                        dense_reference_mask, logical_rows)

pytestmark = pytest.mark.quick  # the quick tier (docs/testing.md)


def _rows_to_mask(spec):
    """Hand mask from {query row name: [key row names]} over rows n0..n{L-1}, c0..c{L-1}."""
    L = len(spec) // 2
    names = [f"n{p}" for p in range(L)] + [f"c{p}" for p in range(L)]
    m = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    for q, keys in spec.items():
        for k in keys:
            m[names.index(q), names.index(k)] = True
    return m


# L = 4, B = 2 (two blocks), straight from the brief's table.
BLOCK_CAUSAL_L4_B2 = {
    "n0": ["n0", "n1"], "n1": ["n0", "n1"],  # block 0: own block, no clean prefix
    "n2": ["n2", "n3", "c0", "c1"], "n3": ["n2", "n3", "c0", "c1"],  # block 1: own block + clean block 0
    "c0": ["c0", "c1"], "c1": ["c0", "c1"],  # clean block 0 sees clean blocks <= 0
    "c2": ["c0", "c1", "c2", "c3"], "c3": ["c0", "c1", "c2", "c3"],
}
TOKEN_CAUSAL_L4_B2 = dict(BLOCK_CAUSAL_L4_B2, c0=["c0"], c1=["c0", "c1"], c2=["c0", "c1", "c2"],
                          c3=["c0", "c1", "c2", "c3"])


@pytest.mark.parametrize("variant,spec", [("block_causal", BLOCK_CAUSAL_L4_B2), ("token_causal", TOKEN_CAUSAL_L4_B2)])
def test_hand_checked_table(variant, spec):
    expected = _rows_to_mask(spec)
    rows = logical_rows(4)
    assert torch.equal(dense_reference_mask(4, 2, variant), expected)
    assert torch.equal(allowed(rows, rows, BlockGeometry(4, 2, variant)), expected)


def test_hand_checked_window():
    # L = 8, B = 2, W = 3. Noisy block 3 (positions 6, 7) keeps the W-1 = 2 clean positions before
    # its start (4, 5); clean query 5 keeps the last 3 positions including itself (3, 4, 5); clean
    # query 4 (block-causal) keeps 2..5 (its whole block, lower bound 4-3+1 = 2).
    g = BlockGeometry(8, 2, "block_causal", window=3)
    rows = logical_rows(8)
    m = allowed(rows, rows, g)
    L = 8

    def keys(row):
        return [("c" if j >= L else "n") + str(j % L) for j in torch.nonzero(m[row]).flatten().tolist()]

    assert keys(6) == ["n6", "n7", "c4", "c5"]
    assert keys(2) == ["n2", "n3", "c0", "c1"]  # block 1: lower bound clamps at 0
    assert keys(0) == ["n0", "n1"]
    assert keys(L + 5) == ["c3", "c4", "c5"]
    assert keys(L + 4) == ["c2", "c3", "c4", "c5"]
    assert torch.equal(m, dense_reference_mask(8, 2, "block_causal", 3))
    tc = allowed(rows, rows, BlockGeometry(8, 2, "token_causal", window=3))
    assert torch.nonzero(tc[L + 4]).flatten().tolist() == [L + 2, L + 3, L + 4]


COMBOS = [
    (L, B, variant, window)
    for L, B in [(4, 1), (4, 2), (4, 4), (8, 2), (12, 3), (16, 4), (24, 8), (32, 8), (30, 5)]
    for variant in ("block_causal", "token_causal")
    for window in (None, 1, 2, 3, 5, 8, 64)
]


@pytest.mark.parametrize("L,B,variant,window", COMBOS)
def test_allowed_equals_dense_oracle(L, B, variant, window):
    rows = logical_rows(L)
    got = allowed(rows, rows, BlockGeometry(L, B, variant, window))
    assert torch.equal(got, dense_reference_mask(L, B, variant, window))


@pytest.mark.parametrize("L,B", [(16, 4), (24, 6), (32, 8)])
def test_pair_count_is_L_times_L_plus_B(L, B):
    # Block-causal without a window admits L*(L+B) pairs: twice causal attention over L.
    assert int(dense_reference_mask(L, B).sum()) == L * (L + B)


@pytest.mark.parametrize("variant,window", [("block_causal", None), ("token_causal", 5), ("block_causal", 3)])
def test_any_physical_row_order(variant, window):
    # The predicate reads only metadata: any permutation (and subset) of query and key rows gives
    # the matching rows and columns of the oracle.
    L, B = 24, 4
    g = BlockGeometry(L, B, variant, window)
    dense = dense_reference_mask(L, B, variant, window)
    rows = logical_rows(L)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        qi = torch.randperm(2 * L, generator=gen)[:30]
        ki = torch.randperm(2 * L, generator=gen)[:35]
        assert torch.equal(allowed(rows.select(qi), rows.select(ki), g), dense[qi][:, ki])


def test_clean_interval_of_noisy_rows_is_strict_prefix():
    g = BlockGeometry(16, 4)
    lo, hi = clean_key_interval(RowMeta.of(torch.arange(16), torch.zeros(0, dtype=torch.long)), g)
    assert lo.tolist() == [0] * 16
    assert hi.tolist() == [0] * 4 + [4] * 4 + [8] * 4 + [12] * 4


def test_noisy_never_seen_by_clean_and_other_blocks():
    for L, B in [(16, 4), (18, 3)]:
        m = dense_reference_mask(L, B)
        assert not m[L:, :L].any(), "a clean query must never see a noisy key"
        blocks = torch.arange(L) // B
        assert torch.equal(m[:L, :L], blocks[:, None] == blocks[None, :])


@pytest.mark.parametrize("kwargs,needle", [
    (dict(seq_length=100, block_size=16), "--block-size"),
    (dict(seq_length=0, block_size=16), "--seq-length"),
    (dict(seq_length=32, block_size=8, clean_attention="causal"), "--clean-attention"),
    (dict(seq_length=32, block_size=8, window=0), "window"),
])
def test_bad_geometry_is_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        BlockGeometry(**kwargs)
