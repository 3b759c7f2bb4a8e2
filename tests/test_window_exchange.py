"""The static windowed clean-exchange plan of sliding-window layers under CSBP."""
from __future__ import annotations

import pytest
import torch

from megatron_csbp.layout.exchange import WindowExchangePlan
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, Documents, RowMeta, allowed, logical_rows


def window_plans(case):
    """The plan of every rank of the shard group for an attention-test case."""
    geometry = BlockGeometry(case["L"], case["B"], case["clean_attention"], None)
    layout = SequenceLayout(geometry, case["cp"], case["bp"], case["schedule"])
    windowed = geometry.with_window(case["window"])
    if case.get("documents") is not None:  # packed (tests/test_packing_distributed.py)
        windowed = windowed.with_documents(Documents(tuple(case["documents"]), case["L"]))
    plans = []
    for r in range(layout.shard_group_size):
        members = [layout.rows(m) for m in layout.ring_ranks(r)]
        plans.append(WindowExchangePlan.build(members, layout.ring_clean_rows(r), windowed, layout.ring_of(r)[1]))
    return plans


def window_rows_oracle(layout, windowed, rank):
    """(rows received, rows sent) by `rank` in the windowed clean exchange of one forward, from the
    mask predicate and row ownership alone (no exchange plan): it receives every clean row that one
    of its rows may attend to and that it does not hold; it sends each member of its ring the rows
    of its own clean shard that the member needs and does not hold. The byte tests of the windowed
    exchange (tests/test_block_attention_distributed.py, tests/test_kv_source_exchange.py) count
    against this; `test_plan_covers_exactly_the_needed_rows` holds the plan to the same rule."""
    L = layout.geometry.seq_length
    all_clean = logical_rows(L).select(slice(L, None))

    def needed(r):
        return set(all_clean.position[allowed(layout.rows(r), all_clean, windowed).any(0)].tolist())

    def held(r):
        rows = layout.rows(r)
        return set(rows.position[rows.is_clean].tolist())

    ring, me = layout.ring_ranks(rank), layout.ring_of(rank)[1]
    shards = [set(s.position.tolist()) for s in layout.ring_clean_rows(rank)]
    recv = sum(len((needed(rank) - held(rank)) & shards[j]) for j in range(len(ring)) if j != me)
    send = sum(len((needed(other) - held(other)) & shards[me]) for j, other in enumerate(ring) if j != me)
    return recv, send


def setup(L, B, cp, bp, W, clean="block_causal", schedule="mirrored"):
    case = dict(L=L, B=B, cp=cp, bp=bp, window=W, clean_attention=clean, schedule=schedule)
    layout = SequenceLayout(BlockGeometry(L, B, clean), cp, bp, schedule)
    return layout, layout.geometry.with_window(W), window_plans(case)


CONFIGS = [(64, 4, 2, 2, 5), (64, 4, 4, 4, 9), (64, 4, 2, 4, 3), (128, 8, 4, 4, 16), (64, 4, 4, 4, 1)]


@pytest.mark.parametrize("L,B,cp,bp,W", CONFIGS)
@pytest.mark.parametrize("clean", ["block_causal", "token_causal"])
def test_plan_covers_exactly_the_needed_rows(L, B, cp, bp, W, clean):
    layout, geometry, plans = setup(L, B, cp, bp, W, clean)
    all_clean = logical_rows(L).select(slice(L, None))
    for r in range(layout.shard_group_size):
        rows = layout.rows(r)
        local_clean = set(rows.position[rows.is_clean].tolist())
        received = set(RowMeta.cat(plans[r].recv_rows).position.tolist())
        needed = set(all_clean.position[allowed(rows, all_clean, geometry).any(0)].tolist())
        assert needed <= local_clean | received  # coverage
        assert received <= needed and not (received & local_clean)  # nothing extra moves
        assert (sum(plans[r].recv_counts), sum(plans[r].send_counts)) == window_rows_oracle(layout, geometry, r)


@pytest.mark.parametrize("L,B,cp,bp,W", CONFIGS)
def test_plan_is_symmetric(L, B, cp, bp, W):
    """What member i sends to member j is exactly what j expects from i, row for row."""
    layout, _, plans = setup(L, B, cp, bp, W)
    for r in range(layout.shard_group_size):
        ring = layout.ring_ranks(r)
        me = layout.ring_of(r)[1]
        for j, other in enumerate(ring):
            shard = layout.ring_clean_rows(r)[me]
            sent = shard.position[plans[r].send_index[j]]
            expected = plans[other].recv_rows[me].position
            assert torch.equal(sent, expected)
        assert plans[r].send_counts[me] == plans[r].recv_counts[me] == 0


def test_window_traffic_is_a_small_fraction_of_the_full_clean_exchange():
    L, B, P, W = 256, 8, 4, 16
    layout, _, plans = setup(L, B, P, P, W)
    full_rows = (P - 1) * L // P  # all-gather of the clean stream
    for plan in plans:
        assert sum(plan.recv_counts) <= full_rows / 4
