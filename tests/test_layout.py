"""Layout metadata: ownership coverage and balance, exchange-plan symmetry, bad input."""
from __future__ import annotations

import pytest
import torch

from megatron_csbp.layout.layout import SequenceLayout, mirrored_order, split_evenly
from megatron_csbp.layout.masks import BlockGeometry, allowed

pytestmark = pytest.mark.quick  # the quick tier (docs/testing.md)


def layout(L=64, B=4, cp=1, bp=1, schedule="mirrored", clean="block_causal"):
    return SequenceLayout(BlockGeometry(L, B, clean), cp, bp, schedule)


def noisy_work(lay: SequenceLayout, rank: int) -> int:
    """Query-key pairs of this rank's noisy rows: its own block plus the clean prefix."""
    B = lay.geometry.block_size
    return sum(B * B + B * (b * B) for b in lay.block_owners[rank])


@pytest.mark.parametrize("cp,bp", [(1, 2), (2, 2), (1, 4), (2, 4), (4, 4), (4, 8), (2, 8)])
@pytest.mark.parametrize("schedule", ["mirrored", "contiguous"])
def test_every_block_owned_exactly_once(cp, bp, schedule):
    lay = layout(L=128, cp=cp, bp=bp, schedule=schedule)
    owned = sorted(b for blocks in lay.block_owners for b in blocks)
    assert owned == list(range(lay.geometry.num_blocks))
    for r in range(lay.shard_group_size):
        rows = lay.rows(r)
        noisy_blocks = sorted(set((rows.position[~rows.is_clean] // 4).tolist()))
        assert noisy_blocks == lay.block_owners[r]


@pytest.mark.parametrize("cp,bp", [(2, 2), (4, 4), (2, 4), (1, 4)])
def test_mirrored_ownership_is_balanced(cp, bp):
    """With n a multiple of 2*BP every rank gets the same noisy work and the same row count."""
    lay = layout(L=128, B=4, cp=cp, bp=bp)
    work = {noisy_work(lay, r) for r in range(bp)}
    assert len(work) == 1
    contiguous = layout(L=128, B=4, cp=cp, bp=bp, schedule="contiguous")
    cwork = [noisy_work(contiguous, r) for r in range(bp)]
    assert max(cwork) > min(cwork)  # the comparison schedule is imbalanced, as in the paper


@pytest.mark.parametrize("P", [2, 4])
def test_csbp_clean_shard_is_own_blocks_and_rows_match_cp(P):
    """BP = CP with n a multiple of 2P: a rank's clean shard is the clean copy of its own noisy
    blocks, and rows per rank are 2L/P as under CP."""
    L = 64
    csbp, cp = layout(L=L, cp=P, bp=P), layout(L=L, cp=P)
    for r in range(P):
        rows = csbp.rows(r)
        noisy = rows.position[~rows.is_clean]
        clean = rows.position[rows.is_clean]
        assert torch.equal(torch.sort(noisy).values, torch.sort(clean).values)
        assert len(rows) == len(cp.rows(r)) == 2 * L // P


def test_clean_rings_each_hold_a_full_copy():
    lay = layout(L=64, cp=2, bp=4)
    for ring_start in (0, 2):
        ranks = lay.ring_ranks(ring_start)
        clean = torch.cat([lay.rows(r).position[lay.rows(r).is_clean] for r in ranks])
        assert sorted(clean.tolist()) == list(range(64))


@pytest.mark.parametrize("cp,bp", [(2, 1), (2, 2), (4, 4), (2, 4)])
def test_exchange_plan_is_symmetric(cp, bp):
    """What rank r expects from ring member i is exactly what member i sends (its clean rows,
    or all rows under CP)."""
    lay = layout(L=64, cp=cp, bp=bp)
    for r in range(lay.shard_group_size):
        ring = lay.ring_ranks(r)
        peers = lay.ring_clean_rows(r)
        for i, member in enumerate(ring):
            sent = lay.rows(member)
            if lay.kind == "csbp":
                sent = sent.select(sent.is_clean)
                assert torch.equal(peers[i].position, sent.position) and bool(peers[i].is_clean.all())
        # every member sends the same number of rows (static shapes for the collectives)
        sizes = {len(lay.rows(m)) if lay.kind == "cp" else int(lay.rows(m).is_clean.sum()) for m in ring}
        assert len(sizes) == 1


def test_bp_clean_prefix_covers_what_owned_blocks_need():
    lay = layout(L=64, bp=4)
    g = lay.geometry
    for r in range(4):
        rows = lay.rows(r)
        clean = set(rows.position[rows.is_clean].tolist())
        noisy = rows.select(~rows.is_clean)
        from megatron_csbp.layout.masks import logical_rows

        full = logical_rows(g.seq_length)
        needed = full.select(full.is_clean)
        m = allowed(noisy, needed, g)
        assert set(needed.position[m.any(0)].tolist()) <= clean


def test_helpers():
    assert mirrored_order(5) == [0, 4, 1, 3, 2]
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(L=30, B=4), "not a multiple of --block-size"),
        (dict(L=36, B=4, cp=4), "divisible by 2 x 4"),
        (dict(L=16, B=8, cp=2, bp=4), "fewer than --block-parallel-size 4"),
        (dict(L=64, B=4, cp=4, bp=2), "multiple of --context-parallel-size"),
        (dict(L=96, B=4, cp=4, bp=6), "multiple of --context-parallel-size"),
        (dict(L=64, B=4, bp=2, schedule="random"), "--block-ownership"),
        (dict(L=64, B=4, clean="causal"), "--clean-attention"),
    ],
)
def test_bad_input_is_refused_with_the_flag_and_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        layout(**kwargs)
