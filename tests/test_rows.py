"""Row-vector masks (`layout.rows`) against the dense predicate `layout.masks.allowed`."""
import pytest
import torch

from megatron_csbp.layout.masks import BlockGeometry, RowMeta, allowed
from megatron_csbp.layout.rows import PartialMask

pytestmark = pytest.mark.quick  # the quick tier (docs/testing.md)


def _random_rows(gen, n, L):
    pos = torch.randint(0, L, (n,), generator=gen)
    clean = torch.rand(n, generator=gen) < 0.5
    return RowMeta(clean, pos)


CASES = [(64, 8, "block_causal", None), (64, 8, "token_causal", None), (96, 16, "block_causal", 20),
         (96, 4, "token_causal", 7), (48, 48, "block_causal", None)]


@pytest.mark.parametrize("L,B,variant,window", CASES)
@pytest.mark.parametrize("tiles", [(8, 8), (16, 4), (5, 7)])
def test_row_vectors_equal_dense_predicate(L, B, variant, window, tiles):
    geometry = BlockGeometry(L, B, variant, window)
    gen = torch.Generator().manual_seed(L + B + (window or 0))
    for trial in range(4):
        q = _random_rows(gen, 37 + trial * 11, L)
        k = _random_rows(gen, 53 - trial * 7, L)
        if trial == 3:  # sorted rows, as layouts order them: [noisy ; clean] by position
            q = RowMeta.of(torch.arange(L // 2), torch.arange(L // 2, L))
            k = RowMeta.of(torch.arange(L), torch.arange(L))
        dense = allowed(q, k, geometry)
        m = PartialMask.of(q, k, geometry)
        assert torch.equal(m.dense(), dense)
        assert m.allowed_pairs() == int(dense.sum())
        assert torch.equal(m.keys_seen(), dense.any(0))
        qt, kt = tiles
        table = m.tiles(qt, kt)
        nq, nk = dense.shape
        for i in range(table.occupied.shape[0]):
            for j in range(table.occupied.shape[1]):
                tile = dense[i * qt:(i + 1) * qt, j * kt:(j + 1) * kt]
                assert bool(table.occupied[i, j]) == bool(tile.any()), (i, j)
                assert bool(table.full[i, j]) == bool(tile.all() and tile.numel() > 0), (i, j)


def test_empty_sides():
    geometry = BlockGeometry(16, 4)
    empty = RowMeta(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long))
    some = RowMeta.of(torch.arange(4), torch.arange(4))
    for q, k in [(empty, some), (some, empty)]:
        m = PartialMask.of(q, k, geometry)
        assert m.allowed_pairs() == 0 and m.dense().shape == (len(q), len(k))
        assert m.keys_seen().shape == (len(k),) and not m.keys_seen().any()


def test_anchored_rows_equal_the_dflash_predicate():
    """DFlash draft blocks (`masks.anchored_allowed`) as row vectors: same pairs, tiles exact."""
    from megatron_csbp.layout.masks import AnchoredGeometry

    gen = torch.Generator().manual_seed(5)
    for window in (None, 6, 11):
        geometry = AnchoredGeometry(4, window)
        anchors = torch.tensor([3, 9, 17, 30])
        doc_starts = torch.tensor([0, 5, 5, 20])
        ctx = torch.arange(40)
        ctx_doc = torch.where(ctx < 5, 0, torch.where(ctx < 20, 5, 20))
        rows = RowMeta.anchored(anchors, doc_starts, 4, ctx, ctx_doc)
        perm = torch.randperm(len(rows), generator=gen)
        for q, k in [(rows, rows), (rows.select(perm[:30]), rows.select(perm))]:
            dense = allowed(q, k, geometry)
            m = PartialMask.of(q, k, geometry)
            assert torch.equal(m.dense(), dense)
            assert m.allowed_pairs() == int(dense.sum())
            assert torch.equal(m.keys_seen(), dense.any(0))
            table = m.tiles(8, 8)
            for i in range(table.occupied.shape[0]):
                for j in range(table.occupied.shape[1]):
                    tile = dense[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8]
                    assert bool(table.occupied[i, j]) == bool(tile.any())
                    assert bool(table.full[i, j]) == bool(tile.all() and tile.numel() > 0)
