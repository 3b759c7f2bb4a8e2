"""Packed documents, model level: loss and every parameter gradient under CP, BP, CSBP (all-gather
and ring, mirrored and contiguous), TP x CSBP with sequence parallelism and full recompute equal
one rank's, in float64 (tests/gradients.py FP64_TOL), with --reset-attention-mask
--reset-position-ids --eod-mask-loss on a micro-batch of two samples whose EOD-delimited documents
differ (boundaries inside blocks, a one-token document, one ending on a block edge); BD3-LM, and the
shifted AR and Fast-dLLM v2 objectives under CSBP."""
from __future__ import annotations

import pytest
import torch

from tests.test_model_parallel_exactness import B, L, VOCAB, case, check_against_single_rank, objective

pytestmark = pytest.mark.exactness
EOD = VOCAB - 2
ENDS = ([3, 4, 13, 16, 27], [9, 10, 22])  # last position of each document but the last, per sample


def packed_batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB - 2, (2, L), generator=g)  # neither EOD nor the mask token
    for s, ends in enumerate(ENDS):
        tokens[s, torch.tensor(ends) - 1] = EOD
    loss_mask = torch.ones_like(tokens)
    loss_mask[0, :6] = 0  # an SFT prompt
    return tokens, loss_mask, torch.tensor([11, 42])


def run_layout(gpt, c):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.layout.packing import Packing
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import AutoregressiveObjective, FastDLLMv2Objective

    layout = SequenceLayout(BlockGeometry(L, B, c["clean_attention"]), c["cp"], c["bp"], c["schedule"])
    obj = {"ar": AutoregressiveObjective, "fast-dllm-v2": lambda: FastDLLMv2Objective(B, VOCAB - 1, seed=3)}.get(
        c.get("objective"), objective)()
    model = BlockDiffusionModel(gpt, obj, layout, bps.get_shard_rank(), bps.get_clean_ring_group(),
                                c["transport"], packing=Packing(EOD, True, True, True))
    out = model(*packed_batch())
    out.loss.backward()
    return out.loss.detach()


CASES = {
    2: [case(cp=2), case(bp=2), case(cp=2, bp=2), case(cp=2, bp=2, transport="ring", clean_attention="token_causal"),
        case(bp=2, schedule="contiguous"), dict(case(cp=2, bp=2), objective="ar"),
        dict(case(cp=2, bp=2), objective="fast-dllm-v2")],
    4: [case(cp=2, bp=4), case(tp=2, cp=2, bp=2, sp=True, recompute=True)],
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_packed_loss_and_grads_match_single_rank(world):
    check_against_single_rank([dict(c, run="tests.test_packing_layouts:run_layout") for c in CASES[world]], world)
