"""`BlockDiffusionModel.logits(tokens, plan, logit_rows)`, the public entry generate and conversion
use, gives the logits the training forward computes its loss from.

The forward's logits are read where they enter the loss (`BlockDiffusionModel.loss`, wrapped to
record its input and then run as is); the public call gets ids this test builds itself from the
objective's noise (clean rows from the clean stream, noisy rows from the noisy one, at the plan's
positions) and, for a clean-row loss, the logit rows this test picks (every noisy row, then the
clean rows that carry a target: on one rank every clean row is counted). float64 models, one
rank: both calls run the same operations on the same rows, so the logits agree bitwise (atol = rtol
= 0), and the loss recomputed from the public logits equals the forward's.
"""
from __future__ import annotations

import torch

from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry
from megatron_csbp.model.bdlm import BlockDiffusionModel

V, L, B = 96, 16, 4
EXACT = dict(atol=0, rtol=0)


def _record_loss_inputs(model):
    seen = []

    def loss(logits, targets, weights, denominator):
        seen.append((logits.detach().clone(), targets, weights, denominator))
        return BlockDiffusionModel.loss(model, logits, targets, weights, denominator)

    model.loss = loss
    return seen


def _ids(plan, tokens, noised):
    rows = plan.local
    return torch.where(rows.is_clean[None], tokens[:, rows.position], noised.noisy_tokens[:, rows.position])


def test_logits_equal_the_forwards_bd3lm(tiny_gpt):
    from megatron_csbp.objectives import BD3LMObjective

    gpt = tiny_gpt(vocab_size=V, seq_length=L, params_dtype=torch.float64).to(torch.float64)
    objective = BD3LMObjective(B, mask_token_id=V - 1, seed=3)
    model = BlockDiffusionModel(gpt, objective, SequenceLayout(BlockGeometry(L, B)))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V - 1, (2, L), generator=g)
    loss_mask = torch.ones_like(tokens)
    index = torch.tensor([4, 9])
    seen = _record_loss_inputs(model)
    out = model(tokens, loss_mask, index)
    (forward_logits, targets, weights, denominator), = seen
    assert forward_logits.dtype == torch.float64 and forward_logits.shape == (2, L, V)

    noised = objective.noise(tokens, loss_mask, index)
    with torch.no_grad():
        logits = model.logits(_ids(model.plan, tokens, noised), model.plan)
    torch.testing.assert_close(logits, forward_logits, **EXACT)
    assert torch.equal(model.loss(logits, targets, weights, denominator).loss, out.loss.detach())
    assert gpt.rotary_pos_emb.positions is None, "logits() leaves no positions behind"


def test_logits_equal_the_forwards_with_canvas_clean_rows_and_self_conditioning(megatron_single_rank):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.sft import DiffusionGemmaSFTModel
    from megatron_csbp.model.diffusiongemma.tiny import redraw_weights, tiny_megatron_config
    from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective

    install_cpu_compat()
    model_parallel_cuda_manual_seed(5)
    gpt = redraw_weights(diffusion_gemma_model(tiny_megatron_config(sliding_window=3, params_dtype=torch.float64),
                                               V, 64), seed=0)
    objective = DiffusionGemmaSFTObjective(B, V, seed=2, encoder_loss_weight=0.7, self_conditioning_prob=1.0)
    model = DiffusionGemmaSFTModel(gpt, objective, SequenceLayout(BlockGeometry(L, B, "token_causal")))
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (2, L), generator=g)
    loss_mask = torch.zeros_like(tokens)
    loss_mask[0, 8:14] = 1  # 2 prompt blocks, the response ends mid-block
    loss_mask[1, 4:] = 1  # 1 prompt block
    index = torch.tensor([0, 1])
    seen = _record_loss_inputs(model)
    out = model(tokens, loss_mask, index)
    (forward_logits, targets, weights, denominator), = seen

    noised = objective.noise(tokens, loss_mask, index)
    assert noised.first_canvas_block == 1 and bool(noised.self_conditioning.all())
    plan = model.canvas_plan(noised.first_canvas_block)
    n = int((~plan.local.is_clean).sum())
    assert n == L - B
    clean_pos = plan.local.position[n:]
    with_target = torch.nonzero((noised.clean_targets[:, clean_pos] >= 0).any(dim=0)).flatten()
    assert 0 < len(with_target) < len(clean_pos)
    logit_rows = torch.cat([torch.arange(n), n + with_target])
    ids = _ids(plan, tokens, noised)
    with torch.no_grad():
        first = model.logits(ids, plan)
        logits = model.logits(ids, plan, logit_rows, self_conditioning_logits=first,
                              self_conditioning_mask=noised.self_conditioning)
    assert forward_logits.shape == (2, len(logit_rows), V)
    torch.testing.assert_close(logits, forward_logits, **EXACT)
    assert torch.equal(model.loss(logits, targets, weights, denominator).loss, out.loss.detach())
