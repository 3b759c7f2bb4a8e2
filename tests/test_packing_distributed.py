"""Packed documents under every layout and transport, attention level, float64 on gloo: the checks
of tests/test_block_attention_distributed.py (outputs and dQ/dK/dV of every rank against the dense
reference, here with document ids) on a packed sample, and the bytes the transports count equal
the static plan: CSBP's clean exchange moves only the clean rows some local query of the same
document may see (fewer than the unpacked all-gather); CP moves every row, as Megatron's CP."""
from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.test_block_attention_distributed import _attention_rank, check_case, make_case

pytestmark = pytest.mark.exactness
# Boundaries inside blocks (3, 13, 26), a one-token document (13), one ending on a block edge (16).
DOCS = (0, 3, 13, 14, 16, 26)


def packed(*args, **kwargs):
    return dict(make_case(*args, **kwargs), documents=DOCS)


CASES = {
    2: [packed(2, 1, "allgather", "mirrored"), packed(2, 1, "ring", "mirrored", "token_causal"),
        packed(1, 2, "allgather", "mirrored"), packed(2, 2, "allgather", "mirrored"),
        packed(2, 2, "ring", "contiguous", "token_causal"),
        packed(2, 2, "allgather", "mirrored", "block_causal", window=6),
        dict(packed(2, 2, "ring", "mirrored"), tiled=True)],
    4: [packed(4, 1, "allgather", "mirrored"), packed(1, 4, "allgather", "mirrored"),
        packed(4, 4, "allgather", "mirrored"), packed(2, 4, "ring", "mirrored", "token_causal"),
        packed(4, 4, "ring", "contiguous", "block_causal", window=7)],
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_packed_layouts_match_dense_reference(world):
    cases = CASES[world]
    for per_rank, case in zip(zip(*run_distributed(_attention_rank, world, cases)), cases):
        check_case(case, list(per_rank))
