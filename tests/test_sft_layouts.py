"""Canvas layouts (noisy rows for response blocks only) and clean-loss ownership: pure metadata.

The distributed loss/gradient checks of `diffusiongemma-sft` under CP, BP and CSBP are in
tests/test_diffusiongemma_layouts.py.
"""
from __future__ import annotations

import pytest
import torch

from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry

L, B = 32, 4
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (2, 4), (1, 4)]


@pytest.mark.parametrize("cp,bp", LAYOUTS)
@pytest.mark.parametrize("first", [0, 1, 2, 3, 5, 8])
def test_canvas_rows_cover_canvas_and_clean_once(cp, bp, first):
    base = SequenceLayout(BlockGeometry(L, B, "token_causal"), cp, bp, clean_loss=True)
    lay = base.canvas_layout(first)
    s = lay.canvas_start
    assert s <= first  # only ever moved down (extra blocks carry no target)
    P = lay.shard_group_size
    noisy = torch.cat([lay.rows(r).position[~lay.rows(r).is_clean] for r in range(P)])
    for r in range(P):
        rows = lay.rows(r)
        n = int((~rows.is_clean).sum())
        assert bool(rows.is_clean[n:].all()), "local rows must be [noisy ; clean]"
    # every canvas position has exactly one noisy copy, and no prompt block has one
    assert sorted(noisy.tolist()) == list(range(s * B, L))
    if lay.kind == "cp":
        assert len({len(lay.rows(r)) for r in range(P)}) == 1  # equal shards for the all-gather
    if lay.kind in ("bp", "csbp"):
        owned = [lay.block_owners[r] for r in range(P)]
        assert all(owned) and sorted(b for o in owned for b in o) == list(range(s, lay.geometry.num_blocks))
    # every clean position's loss is counted by exactly one rank that holds it
    counted = []
    for r in range(P):
        mine = lay.clean_loss_positions(r)
        held = lay.rows(r).position[lay.rows(r).is_clean]
        assert bool(torch.isin(mine, held).all())
        counted += mine.tolist()
    assert sorted(counted) == list(range(L))


def test_canvas_start_moves_only_where_the_layout_needs_it():
    g = BlockGeometry(L, B, "token_causal")
    assert SequenceLayout(g).canvas_layout(3).canvas_start == 3
    assert SequenceLayout(g, 2, 1).canvas_layout(3).canvas_start == 3  # 12 % 4 == 0
    assert SequenceLayout(g, 4, 1).canvas_layout(3).canvas_start == 2  # 8 rows per zigzag chunk unit
    assert SequenceLayout(g, 1, 4).canvas_layout(6).canvas_start == 4  # each of 4 ranks owns a block
    assert SequenceLayout(g, 2, 2).canvas_layout(5).canvas_start == 5
    # mirrored order over the canvas blocks 2..7 is 2, 7, 3, 6, 4, 5, split in equal counts
    owners = SequenceLayout(g, 2, 2).canvas_layout(2).block_owners
    assert owners == [[2, 3, 7], [4, 5, 6]]


def test_canvas_refusals_name_the_rule():
    g = BlockGeometry(L, B, "token_causal")
    with pytest.raises(ValueError, match="block-parallel-size"):
        SequenceLayout(g, 1, 4, canvas_start=5)
    with pytest.raises(ValueError, match="zigzag"):
        SequenceLayout(g, 4, 1, canvas_start=3)
    with pytest.raises(ValueError, match="outside"):
        SequenceLayout(g, canvas_start=9)
    with pytest.raises(ValueError, match="clean_loss"):
        SequenceLayout(g, 1, 2).clean_loss_positions(0)


def test_bp_clean_loss_holds_the_last_owned_block():
    g = BlockGeometry(L, B, "token_causal")
    plain, with_loss = SequenceLayout(g, 1, 2), SequenceLayout(g, 1, 2, clean_loss=True)
    for r in range(2):
        last = max(plain.block_owners[r])
        assert int(plain.rows(r).is_clean.sum()) == last * B
        assert int(with_loss.rows(r).is_clean.sum()) == (last + 1) * B
