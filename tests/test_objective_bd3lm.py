"""The BD3-LM loss of `BlockDiffusionModel` against a brute-force per-block computation.

The reference runs each noisy block b on its own, with only the clean prefix before it, through a
copy of the same GPT whose core attention is an explicit float64 softmax over the materialised
oracle mask (`dense_reference_mask`), and evaluates sum w(t) * CE / supervised tokens in float64
with the mask token's logit removed from the softmax.
"""
import math

import pytest
import torch

from megatron_csbp.attention.block_attention import AttentionPlan
from megatron_csbp.attention.core_attention import BlockDiffusionAttention
from megatron_csbp.attention.plan_handles import plan_from_mask, plan_mask
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, RowMeta, dense_reference_mask
from megatron_csbp.model.bdlm import BlockDiffusionModel
from megatron_csbp.model.rotary import LayoutRotaryEmbedding
from megatron_csbp.objectives import BD3LMObjective, sample_generator
from tests.gradients import EXACT_DTYPE

L, B, V = 32, 8, 64
N = L // B
# Float64 on both sides, which differ in summation order only (block attention kernel vs dense
# softmax, one batched pass vs per-block passes, the loss summed in another order): each reordered
# sum of K <= 10^3 terms moves by <= K u64 (u64 = 1.1e-16), compounded over 2 layers and the loss
# sum: < 1e-12 relative. REL_TOL leaves 10^3 over that.
REL_TOL = 1e-9
MASK = 5  # inside the vocabulary, not at its end: excluding it shifts the ids above it
SEED = 77


class DenseReferenceAttention(BlockDiffusionAttention):
    """Float64 softmax over the oracle mask restricted to whatever rows are passed in."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        rows = plan_from_mask(attention_mask).local
        logical = torch.where(rows.is_clean, L + rows.position, rows.position)
        mask = dense_reference_mask(L, B)[logical][:, logical]
        rep = query.shape[2] // key.shape[2]
        q = query.double()
        k = key.double().repeat_interleave(rep, dim=2)
        v = value.double().repeat_interleave(rep, dim=2)
        scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * self.softmax_scale
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
        return out.reshape(out.shape[0], out.shape[1], -1).to(query.dtype)


def reference_gpt(ref):
    """`ref` (a second build with the same seed) with every core attention made the dense oracle."""
    ref.rotary_pos_emb = LayoutRotaryEmbedding(ref.rotary_pos_emb)
    for module in list(ref.modules()):
        ca = getattr(module, "core_attention", None)
        if isinstance(ca, BlockDiffusionAttention):
            new = DenseReferenceAttention(ca.config, ca.layer_number, softmax_scale=ca.softmax_scale)
            module.core_attention = new
    assert sum(isinstance(m, DenseReferenceAttention) for m in ref.modules()) == ref.config.num_layers
    return ref


@torch.no_grad()
def brute_force_loss(ref_gpt, objective, tokens, loss_mask, sample_index):
    """sum over samples and blocks of w(t_b) * CE(masked tokens of b) / number of supervised tokens."""
    noised = objective.noise(tokens, loss_mask, sample_index)
    total = torch.zeros((), dtype=torch.float64)
    geometry = BlockGeometry(L, B)
    keep = [i for i in range(V) if i != MASK]
    for s in range(tokens.shape[0]):
        t = objective.block_times(N, sample_generator(SEED, int(sample_index[s])))
        # The loss weight w(t) = 1/t as the objective stores it: t is fp32, 1/t is rounded once to fp32
        # (the weights test checks w against 1/t). With the exact 1/t instead, every term would move
        # by up to u32 = 6e-8 relative, swamping the float64 comparison below.
        w = 1.0 / t
        for b in range(N):
            noisy_pos = torch.arange(b * B, (b + 1) * B)
            rows = RowMeta.of(noisy_pos, torch.arange(b * B))  # the block and its clean prefix only
            ids = torch.cat([noised.noisy_tokens[s, noisy_pos], tokens[s, : b * B]])[None]
            ref_gpt.rotary_pos_emb.positions = rows.position
            logits = ref_gpt(ids, rows.position[None], attention_mask=plan_mask(AttentionPlan(geometry, rows)))
            logp = torch.log_softmax(logits[0, :B].double()[:, keep], dim=-1)
            masked = (noised.noisy_tokens[s, noisy_pos] == MASK) & loss_mask[s, noisy_pos].bool()
            for i in torch.nonzero(masked).flatten().tolist():
                target = int(tokens[s, b * B + i])
                total = total - logp[i, target - (target > MASK)] * float(w[b])
    return total / loss_mask.sum().double()


def _tokens(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V - 1, (b, L), generator=g)
    return x + (x >= MASK).long()  # clean data never holds the mask token


@pytest.fixture
def model_and_ref(tiny_gpt):
    # float64 (EXACT_DTYPE) on both sides: the model and the oracle differ only in summation order.
    gpt = tiny_gpt(vocab_size=V, seq_length=L, seed=3, params_dtype=EXACT_DTYPE).to(EXACT_DTYPE)
    ref = tiny_gpt(vocab_size=V, seq_length=L, seed=3, params_dtype=EXACT_DTYPE).to(EXACT_DTYPE)
    for a, b in zip(gpt.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    objective = BD3LMObjective(B, MASK, seed=SEED)
    model = BlockDiffusionModel(gpt, objective, SequenceLayout(BlockGeometry(L, B)))
    return model, reference_gpt(ref), objective


@pytest.mark.parametrize("prompt", [0, 11])
def test_loss_equals_per_block_brute_force(model_and_ref, prompt):
    model, ref, objective = model_and_ref
    tokens = _tokens(3)
    loss_mask = torch.ones_like(tokens)
    loss_mask[0, :prompt] = 0  # an SFT prompt (not block aligned) on the first sample
    index = torch.tensor([4, 9, 1000])
    with torch.no_grad():
        out = model(tokens, loss_mask, index)
    want = brute_force_loss(ref, objective, tokens, loss_mask, index)
    assert int(out.num_targets) > 0
    assert out.loss.dtype == torch.float64
    dev = abs(float(out.loss) / float(want) - 1)
    dev_sum = abs(float(out.weighted_sum) / float(loss_mask.sum()) / float(want) - 1)
    print(f"\nbd3lm brute force, prompt {prompt}: loss rel dev {dev:.3g}, weighted_sum rel dev {dev_sum:.3g}")
    assert dev < REL_TOL, (float(out.loss), float(want))
    assert dev_sum < REL_TOL


def test_mask_logit_is_excluded_from_the_softmax(model_and_ref):
    model = model_and_ref[0]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, L, V, generator=g)
    targets = torch.randint(0, V, (2, L), generator=g)
    targets[targets == MASK] = -100
    targets[:, ::3] = -100
    weights = torch.rand(2, L, generator=g) * (targets >= 0)
    base = model.loss(logits, targets, weights, torch.tensor(10.0)).loss
    bumped = logits.clone()
    bumped[..., MASK] += 50.0
    assert torch.equal(model.loss(bumped, targets, weights, torch.tensor(10.0)).loss, base)
    other = logits.clone()
    other[..., MASK + 1] += 50.0  # any other logit does change the loss
    assert not torch.allclose(model.loss(other, targets, weights, torch.tensor(10.0)).loss, base)


def test_prompt_tokens_are_never_noised_or_targets():
    objective = BD3LMObjective(B, MASK, seed=SEED, eps_min=0.9, eps_max=1.0)  # nearly everything masked
    tokens = _tokens(8, seed=3)
    loss_mask = torch.ones_like(tokens)
    prompt = torch.arange(L)[None] < torch.tensor([0, 5, 8, 13, 20, 31, 32, 1])[:, None]
    loss_mask[prompt] = 0
    noised = objective.noise(tokens, loss_mask, torch.arange(8))
    assert torch.equal(noised.noisy_tokens[prompt], tokens[prompt])
    assert (noised.targets[prompt] == -100).all() and (noised.weights[prompt] == 0).all()
    masked = noised.noisy_tokens == MASK
    assert masked[~prompt].float().mean() > 0.8  # the rest is noised as asked
    assert torch.equal(noised.targets[masked], tokens[masked]) and (noised.targets[~masked] == -100).all()
    assert objective.denominator(loss_mask) == (~prompt).sum()


def test_weights_are_inverse_block_time_or_unit():
    for weighting in ("inverse_t", "unit"):
        objective = BD3LMObjective(B, MASK, seed=SEED, loss_weighting=weighting)
        noised = objective.noise(_tokens(6, seed=1), torch.ones(6, L), torch.arange(10, 16))
        for s in range(6):
            t = objective.block_times(N, sample_generator(SEED, 10 + s)).repeat_interleave(B)
            masked = noised.noisy_tokens[s] == MASK
            want = (1.0 / t) if weighting == "inverse_t" else torch.ones_like(t)
            torch.testing.assert_close(noised.weights[s][masked], want[masked])
            assert (noised.weights[s][~masked] == 0).all()


def test_block_times_are_antithetic_and_in_range():
    eps_min, eps_max = 0.05, 0.85
    objective = BD3LMObjective(B, MASK, seed=SEED, eps_min=eps_min, eps_max=eps_max)
    n = 7
    for idx in range(20):
        t = objective.block_times(n, sample_generator(SEED, idx)).double()
        assert ((t >= eps_min - 1e-7) & (t <= eps_max + 1e-7)).all()
        u = (t - eps_min) / (eps_max - eps_min)
        # One uniform draw: slot i holds (u0 + i/n) mod 1, so consecutive slots differ by 1/n mod 1.
        steps = torch.remainder(u[1:] - u[:-1], 1.0)
        torch.testing.assert_close(steps, torch.full_like(steps, 1.0 / n), atol=1e-6, rtol=0)


def test_masking_rate_matches_block_time():
    objective = BD3LMObjective(64, MASK, seed=SEED)
    b, length = 200, 256
    tokens = torch.full((b, length), 7)
    noised = objective.noise(tokens, torch.ones(b, length), torch.arange(b))
    masked = (noised.noisy_tokens == MASK).double().view(b, 4, 64).sum(-1)
    t = torch.stack([objective.block_times(4, sample_generator(SEED, i)) for i in range(b)]).double()
    z = (masked - 64 * t).sum() / torch.sqrt((64 * t * (1 - t)).sum())
    assert abs(float(z)) < 5.0, f"masked counts are not Binomial(64, t): z = {float(z):.2f}"
    # Per block, not per sample: blocks of one sample get different rates.
    spread = (masked.max(dim=1).values - masked.min(dim=1).values).double().mean()
    assert spread > 20


def test_same_noise_for_same_sample_whatever_the_batch(model_and_ref):
    model, _, objective = model_and_ref
    tokens = _tokens(4, seed=5)
    mask = torch.ones_like(tokens)
    index = torch.tensor([12, 40, 3, 7])
    full = objective.noise(tokens, mask, index)
    sub = objective.noise(tokens[[2, 0]], mask[[2, 0]], index[[2, 0]])
    assert torch.equal(sub.noisy_tokens, full.noisy_tokens[[2, 0]])
    assert torch.equal(sub.weights, full.weights[[2, 0]])
    other = objective.noise(tokens[[2]], mask[[2]], torch.tensor([8]))
    assert not torch.equal(other.noisy_tokens, full.noisy_tokens[[2]]), "noise must depend on the sample index"
    # The model's summed loss is the sum over samples computed one at a time.
    with torch.no_grad():
        together = model(tokens, mask, index).weighted_sum
        alone = sum(model(tokens[[i]], mask[[i]], index[[i]]).weighted_sum for i in range(4))
    assert together.dtype == torch.float64
    dev = abs(float(together) / float(alone) - 1)
    print(f"\nbatched vs per-sample weighted sum: rel dev {dev:.3g}")
    assert dev < REL_TOL  # float64, summation order only (see REL_TOL)
