"""`BlockDiffusionModel` on one rank: refused configurations, and the layout-indexed rotary."""
import pytest
import torch

from megatron_csbp.attention.block_attention import plan_for_layout
from megatron_csbp.attention.core_attention import BlockDiffusionAttention
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry
from megatron_csbp.model.bdlm import BlockDiffusionModel
from megatron_csbp.model.rotary import LayoutRotaryEmbedding
from megatron_csbp.objectives import BD3LMObjective

L, B, V, MASK = 32, 8, 64, 63


def _model(gpt, mask_token_id=MASK, layout=None):
    layout = layout or SequenceLayout(BlockGeometry(L, B))
    return BlockDiffusionModel(gpt, BD3LMObjective(B, mask_token_id, seed=1), layout)


def test_seq_length_not_multiple_of_block_size_is_refused():
    with pytest.raises(ValueError, match=r"--seq-length 100 is not a multiple of --block-size 16"):
        SequenceLayout(BlockGeometry(100, 16))
    with pytest.raises(ValueError, match="--block-size"):
        BD3LMObjective(16, MASK).noise(torch.zeros(1, 40, dtype=torch.long), torch.ones(1, 40), torch.arange(1))


def test_batch_of_wrong_length_is_refused(tiny_gpt):
    model = _model(tiny_gpt())
    tokens = torch.randint(0, MASK, (2, L - B))
    with pytest.raises(ValueError, match=f"--seq-length {L}"):
        model(tokens)


@pytest.mark.parametrize("mask_id", [V, V + 10, -1])
def test_mask_token_outside_vocab_is_refused(tiny_gpt, mask_id):
    with pytest.raises(ValueError, match=r"--mask-token-id .* outside the vocabulary \[0, 64\)"):
        _model(tiny_gpt(), mask_token_id=mask_id)


def test_attention_dropout_is_refused(tiny_gpt):
    with pytest.raises(ValueError, match="--attention-dropout must be 0"):
        tiny_gpt(attention_dropout=0.1)


def test_model_without_block_attention_is_refused(tiny_gpt):
    with pytest.raises(ValueError, match="no BlockDiffusionAttention"):
        _model(tiny_gpt(swap=False))


def test_learned_absolute_positions_are_refused(tiny_gpt):
    with pytest.raises(ValueError, match="--position-embedding-type learned_absolute"):
        _model(tiny_gpt(position_embedding_type="learned_absolute"))


def test_ordinary_attention_mask_is_refused(tiny_gpt):
    gpt = tiny_gpt()
    ca = next(m for m in gpt.modules() if isinstance(m, BlockDiffusionAttention))
    q = torch.randn(2 * L, 1, 4, 8)
    k = torch.randn(2 * L, 1, 2, 8)
    with pytest.raises(RuntimeError, match="ordinary attention mask"):
        ca(q, k, k, torch.ones(1, 1, 2 * L, 2 * L, dtype=torch.bool))


def rope_table(positions, dim, base=10000.0):
    """Standard RoPE angles (non-interleaved), written out: Megatron's own forward is CUDA-only."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(positions.float(), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


# fp32 angles pos x inv_freq (|angle| <= L = 32), computed here and by Megatron / the plugin in
# possibly different orders (base ** (i / dim) by pow vs exp-log, 1 / x, the product): each side's
# inv_freq carries <= 2 u32 relative (u32 = 6e-8), the product one more: <= 3 u32 x 32 x 2 sides =
# 1.2e-5 worst; ANGLE_TOL = 1e-5 absolute. Measured: 0 (bit-equal) under avx512 / avx2 / default.
ANGLE_TOL = 1e-5


def _angle_dev(emb, want):
    dev = float((emb - want).abs().max())
    print(f"\nrotary angles: max |ours - standard| {dev:.3e}")
    return dev


def _capture_rotary(model, tokens):
    seen = []
    handle = model.gpt.rotary_pos_emb.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    try:
        model(tokens)
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0]


def test_rotary_gives_noisy_and_clean_copies_the_same_angle(tiny_gpt):
    model = _model(tiny_gpt())
    rope = model.gpt.rotary_pos_emb
    assert isinstance(rope, LayoutRotaryEmbedding)
    tokens = torch.randint(0, MASK, (2, L))
    emb = _capture_rotary(model, tokens)
    assert emb.shape[0] == 2 * L
    # Row p (noisy) and row L + p (clean) hold the same token position: identical angles.
    torch.testing.assert_close(emb[:L], emb[L:], atol=0, rtol=0)
    # ... equal to the standard RoPE angles at positions 0..L-1 (head dim 32 / 4 heads = 8).
    _angle_dev(emb[:L], rope_table(torch.arange(L), 8))
    torch.testing.assert_close(emb[:L], rope_table(torch.arange(L), 8), atol=ANGLE_TOL, rtol=0)
    assert not torch.allclose(emb[1], emb[2])


def test_rotary_follows_a_reordered_layout(tiny_gpt):
    # A block-parallel rank holds its blocks [noisy ; clean prefix] out of logical order: every
    # row still gets the angle of its own token position.
    layout = SequenceLayout(BlockGeometry(L, B), cp_size=1, bp_size=2)
    model = _model(tiny_gpt())
    model.feeder.plan = plan_for_layout(layout, 1)
    rows = layout.rows(1)
    assert not torch.equal(rows.position[: len(rows) // 2], torch.arange(len(rows) // 2)), "not reordered"
    emb = _capture_rotary(model, torch.randint(0, MASK, (1, L)))
    assert emb.shape[0] == len(rows)
    _angle_dev(emb, rope_table(rows.position, 8))
    torch.testing.assert_close(emb, rope_table(rows.position, 8), atol=ANGLE_TOL, rtol=0)


def test_single_rank_loss_has_gradients_everywhere(tiny_gpt):
    model = _model(tiny_gpt())
    tokens = torch.randint(0, MASK, (2, L))
    out = model(tokens, torch.ones_like(tokens), torch.tensor([3, 4]))
    assert out.loss.ndim == 0 and torch.isfinite(out.loss) and int(out.num_targets) > 0
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
