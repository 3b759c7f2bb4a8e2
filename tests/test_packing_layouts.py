"""Packed documents, model level: loss and every parameter gradient under CP, BP, CSBP (all-gather
and ring, mirrored and contiguous), TP x CSBP with sequence parallelism and full recompute equal
one rank's, in float64 (tests/gradients.py FP64_TOL), with --reset-attention-mask
--reset-position-ids --eod-mask-loss on a micro-batch of two samples whose EOD-delimited documents
differ (boundaries inside blocks, a one-token document, one ending on a block edge); BD3-LM, and the
shifted AR and Fast-dLLM v2 objectives under CSBP."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.gradients import FP64_TOL
from tests.test_model_parallel_exactness import B, L, VOCAB, _tp_slice, build_gpt, case, objective

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
    from megatron_csbp import parallel_state as bps
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


def _rank(rank, world, cases):
    from megatron.core import parallel_state as mpu

    from megatron_csbp import parallel_state as bps
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    out = []
    for c in cases:
        bps.initialize_block_parallel()
        ref_gpt = build_gpt()
        ref_loss = run_layout(ref_gpt, dict(case(clean_attention=c["clean_attention"]), objective=c.get("objective")))
        ref_state = {n: p.detach().clone() for n, p in ref_gpt.named_parameters()}
        ref_grads = {n: p.grad.clone() for n, p in ref_gpt.named_parameters()}
        bps.destroy_block_parallel()
        bps.initialize_block_parallel(tensor_model_parallel_size=c["tp"], context_parallel_size=c["cp"],
                                      block_parallel_size=c["bp"])
        gpt = build_gpt(sequence_parallel=c["sp"], recompute=c["recompute"], tp=c["tp"])
        tp_rank = mpu.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for n, p in gpt.named_parameters():
                p.copy_(_tp_slice(ref_state[n], p, tp_rank))
        loss = run_layout(gpt, c)
        group = bps.get_shard_group()
        dist.all_reduce(loss, group=group)
        errors = {}
        for n, p in gpt.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=group)
            if c["sp"] and getattr(p, "sequence_parallel", False):
                dist.all_reduce(g, group=mpu.get_tensor_model_parallel_group())
            ref = _tp_slice(ref_grads[n], p, tp_rank)
            errors[n] = float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        out.append(dict(loss=float(loss), ref_loss=float(ref_loss), errors=errors))
        bps.destroy_block_parallel()
    return out


CASES = {
    2: [case(cp=2), case(bp=2), case(cp=2, bp=2), case(cp=2, bp=2, transport="ring", clean_attention="token_causal"),
        case(bp=2, schedule="contiguous"), dict(case(cp=2, bp=2), objective="ar"),
        dict(case(cp=2, bp=2), objective="fast-dllm-v2")],
    4: [case(cp=2, bp=4), case(tp=2, cp=2, bp=2, sp=True, recompute=True)],
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_packed_loss_and_grads_match_single_rank(world):
    cases = CASES[world]
    results = run_distributed(_rank, world, cases)
    for i, c in enumerate(cases):
        for rank, per_rank in enumerate(results):
            r = per_rank[i]
            worst = max(r["errors"].items(), key=lambda kv: kv[1])
            if rank == 0:
                print(f"{c}: loss |diff|/|l1| {abs(r['loss'] - r['ref_loss']) / abs(r['ref_loss']):.1e}, worst "
                      f"per-parameter {worst[1]:.1e} ({worst[0]})")
            assert abs(r["loss"] - r["ref_loss"]) <= FP64_TOL["loss"] * abs(r["ref_loss"]), (c, rank, r)
            assert worst[1] <= FP64_TOL["worst"], (c, rank, worst)
