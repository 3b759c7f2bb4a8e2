"""Any mask token id inside the vocabulary gives a finite BD3-LM loss and the exact gradient.

The BD3-LM loss removes the mask token's column from the softmax (its logit becomes -inf). Rows
that are no target still pass through Megatron's vocab-parallel cross entropy with a placeholder
target; if that placeholder were the masked column, CE = +inf and inf x 0 = NaN. The reference
below is written independently (float64, an explicit loop over target rows, the mask column
dropped from the log-sum-exp) and compared with `weighted_cross_entropy` for mask ids 0, 1, V-1 on
one rank and, under TP = 2 vocabulary sharding on gloo, for the first and last id of each shard.

Error model (fp32 loss path vs float64 reference): per row, Megatron subtracts the row max (one
rounding of a number <= 2 max|x|), exponentiates (one rounding each) and sums V terms (<= V
roundings, relative) before one log: |CE error| <= (2 max|x| + V + 2) u with u = 2^-24. The loss
error is then <= sum(w) (2 max|x| + V + 2) u / den, and each gradient entry w/den (p - onehot)
carries <= w/den (2 max|x| + V + 2) u. The tolerances are 10x these bounds.
"""
import math

import pytest
import torch

from tests.distributed import run_distributed

U = 2.0 ** -24
B, S = 2, 12


def make_case(vocab: int, mask_id: int, seed: int):
    """Logits in [-4, 4], targets anywhere but the mask id (shard edges included), a third of the
    rows no target (-100), weights 1/t for t in [0.05, 1]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(B, S, vocab, generator=g) * 8 - 4
    targets = torch.randint(0, vocab - 1, (B, S), generator=g)
    targets = targets + (targets >= mask_id).long()  # every id except the mask
    edges = [i for i in (0, 1, vocab // 2 - 1, vocab // 2, vocab - 1) if i != mask_id]
    targets[0, : len(edges)] = torch.tensor(edges)
    targets[:, ::3] = -100
    weights = 1.0 / (0.05 + 0.95 * torch.rand(B, S, generator=g))
    weights = torch.where(targets >= 0, weights, torch.zeros_like(weights))
    return logits, targets, weights, torch.tensor(float((targets >= 0).sum()) + 3.0)


def reference(logits, targets, weights, denominator, mask_id):
    """float64: sum over target rows of w * (logsumexp over ids != mask - logit[target]) / den."""
    x = logits.double().clone().requires_grad_(True)
    keep = [i for i in range(x.shape[-1]) if i != mask_id]
    total = torch.zeros((), dtype=torch.float64)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            t = int(targets[b, s])
            if t < 0:
                continue
            total = total + float(weights[b, s]) * (torch.logsumexp(x[b, s, keep], dim=0) - x[b, s, t])
    loss = total / float(denominator)
    loss.backward()
    return loss.detach(), x.grad


def tolerances(logits, weights, denominator):
    per_row = (2 * float(logits.abs().max()) + logits.shape[-1] + 2) * U
    return 10 * float(weights.sum()) * per_row / float(denominator), 10 * float(weights.max()) * per_row / float(denominator)


def check(loss, grad, ref_loss, ref_grad, logits, weights, denominator):
    loss_tol, grad_tol = tolerances(logits, weights, denominator)
    assert math.isfinite(float(loss)) and torch.isfinite(grad).all()
    assert abs(float(loss) - float(ref_loss)) <= loss_tol, (float(loss), float(ref_loss), loss_tol)
    err = float((grad.double() - ref_grad).abs().max())
    assert err <= grad_tol, (err, grad_tol)


@pytest.mark.parametrize("mask_id", [0, 1, 63])
def test_loss_and_gradient_equal_reference_for_any_mask_id(megatron_single_rank, mask_id):
    from megatron_csbp.model.loss import weighted_cross_entropy

    logits, targets, weights, den = make_case(64, mask_id, seed=mask_id)
    x = logits.clone().requires_grad_(True)
    out = weighted_cross_entropy(x, targets, weights, den, exclude_token=mask_id)
    out.loss.backward()
    ref_loss, ref_grad = reference(logits, targets, weights, den, mask_id)
    check(out.loss.detach(), x.grad, ref_loss, ref_grad, logits, weights, den)
    assert float(x.grad[..., mask_id].abs().max()) == 0.0  # the excluded column gets no gradient


def test_target_equal_to_the_mask_id_is_refused(megatron_single_rank):
    from megatron_csbp.model.loss import weighted_cross_entropy

    logits, targets, weights, den = make_case(64, 0, seed=5)
    targets[1, 1] = 0
    with pytest.raises(ValueError, match="mask token 0"):
        weighted_cross_entropy(logits, targets, weights, den, exclude_token=0)


def _tp2_rank(rank, world_size, vocab, mask_ids):
    from megatron.core import parallel_state as mpu

    from megatron_csbp.model.loss import weighted_cross_entropy

    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    shard = vocab // 2
    results = []
    for mask_id in mask_ids:
        logits, targets, weights, den = make_case(vocab, mask_id, seed=100 + mask_id)
        x = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
        out = weighted_cross_entropy(x, targets, weights, den, exclude_token=mask_id)
        out.loss.backward()
        results.append((float(out.loss), x.grad.clone()))
    mpu.destroy_model_parallel()
    return results


def test_tp2_vocab_sharded_loss_equals_reference_at_shard_edges():
    vocab = 16
    mask_ids = [0, vocab // 2 - 1, vocab // 2, vocab - 1]  # first and last id of each shard
    per_rank = run_distributed(_tp2_rank, 2, vocab, mask_ids)
    for k, mask_id in enumerate(mask_ids):
        logits, targets, weights, den = make_case(vocab, mask_id, seed=100 + mask_id)
        ref_loss, ref_grad = reference(logits, targets, weights, den, mask_id)
        (loss0, g0), (loss1, g1) = per_rank[0][k], per_rank[1][k]
        assert loss0 == loss1  # both TP ranks hold the same all-reduced loss
        check(torch.tensor(loss0), torch.cat([g0, g1], dim=-1), ref_loss, ref_grad, logits, weights, den)


@pytest.mark.parametrize("mask_id", [0, 1, 63])
def test_model_with_mask_id_in_the_data_trains_finite(tiny_gpt, mask_id):
    """A real GPTModel + BD3-LM with the mask id at the vocabulary's edges, and data that contains
    that very id: finite loss and gradients; such tokens are never noised and never targets."""
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import BD3LMObjective

    L, V = 32, 64
    objective = BD3LMObjective(8, mask_id, seed=3, eps_min=0.5, eps_max=1.0)
    model = BlockDiffusionModel(tiny_gpt(vocab_size=V, seq_length=L, seed=1), objective,
                                SequenceLayout(BlockGeometry(L, 8)))
    g = torch.Generator().manual_seed(mask_id)
    tokens = torch.randint(0, V, (2, L), generator=g)
    tokens[:, ::5] = mask_id  # the data holds the mask id itself
    loss_mask = torch.ones_like(tokens)
    index = torch.tensor([3, 8])
    noised = objective.noise(tokens, loss_mask, index)
    assert not (noised.targets == mask_id).any()
    assert (noised.targets >= 0).sum() > 0
    out = model(tokens, loss_mask, index)
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach())) and float(out.loss.detach()) > 0
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
