"""A tiny DiffusionGemma (sliding window 3 < block, K=V full layers, MoE, self-conditioning) gives
the same BD3-LM loss and parameter gradients on 1 rank and under CP, BP and CSBP (gloo, 2 ranks;
CSBP moves only the clean rows inside the sliding windows).

Each rank computes the single-device reference in-process first, then its layout's partial loss
(summed over the sequence group) with the same weights.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed

V, L, B, BATCH = 96, 16, 4, 2


def _gpt():
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config

    model_parallel_cuda_manual_seed(5)
    gpt = diffusion_gemma_model(tiny_megatron_config(sliding_window=3), V, 64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random everywhere, norms and scales near 1, distinct layer scalars
        for name, p in gpt.named_parameters():
            near_one = "layernorm" in name or name.endswith("scale") or "norm.weight" in name
            p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)) if near_one else 0.15 * torch.randn(p.shape, generator=g))
        for name, b in gpt.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return gpt.train()


def _loss(gpt, cp, bp):
    from megatron_csbp import parallel_state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import BD3LMObjective

    layout = SequenceLayout(BlockGeometry(L, B, "token_causal"), cp, bp)
    model = BlockDiffusionModel(gpt, BD3LMObjective(B, mask_token_id=V - 1, seed=3), layout,
                                bps.get_block_parallel_rank(), bps.get_clean_ring_group())
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, V - 1, (BATCH, L), generator=g)
    loss_mask = torch.ones_like(tokens)
    loss_mask[0, :4] = 0
    sc = 3 * torch.randn(BATCH, L, V, generator=g)
    rows = model.plan.local
    noisy_pos = rows.position[~rows.is_clean]
    with gpt.self_conditioning_inputs(sc[:, noisy_pos], torch.tensor([True, False])):
        out = model(tokens, loss_mask, torch.tensor([11, 42]))
    out.loss.backward()
    return out.loss.detach()


def _rank(rank, world, cases):
    from megatron_csbp import parallel_state as bps
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    bps.initialize_block_parallel()
    ref = _gpt()
    ref_loss = _loss(ref, 1, 1)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    bps.destroy_block_parallel()
    out = []
    for cp, bp in cases:
        bps.initialize_block_parallel(context_parallel_size=cp, block_parallel_size=bp)
        gpt = _gpt()
        loss = _loss(gpt, cp, bp)
        group = bps.get_block_parallel_group()
        dist.all_reduce(loss, group=group)
        worst = 0.0
        for n, p in gpt.named_parameters():
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            dist.all_reduce(g, group=group)
            r = ref_grads.get(n, torch.zeros_like(p))
            worst = max(worst, float((g - r).abs().max() / r.abs().max().clamp_min(1e-6)))
        out.append(dict(case=(cp, bp), loss=float(loss), ref=float(ref_loss), worst=worst))
        bps.destroy_block_parallel()
    return out


def test_layouts_equal_single_rank():
    results = run_distributed(_rank, 2, [(2, 1), (1, 2), (2, 2)])
    for res in results[0]:
        print(f"cp, bp = {res['case']}: loss {res['loss']:.6f} (1 rank {res['ref']:.6f}), worst rel grad diff {res['worst']:.2e}")
    for per_rank in results:
        for res in per_rank:
            assert abs(res["loss"] - res["ref"]) < 1e-5 * max(1.0, abs(res["ref"])), res
            assert res["worst"] < 1e-4, res
