"""DFlash drafter: the anchored mask predicate against an oracle, and logit parity with transformers'
`MuseGlimmerAssistantModel` (conversion both ways)."""
import pytest
import torch

from megatron_csbp.attention.block_attention import AttentionPlan
from megatron_csbp.layout.masks import AnchoredGeometry, RowMeta, allowed


def _oracle(anchors, doc_starts, B, ctx_pos, window):
    """Dense mask over [draft blocks ; context], written from the rule in words: a draft row of the
    block opened at anchor a (document start s) at position a + i sees every row of its own block
    and context position t iff s <= t < a and (no window, or t > a + i - W). Context rows see nothing."""
    n, c = len(anchors) * B, len(ctx_pos)
    m = torch.zeros(n + c, n + c, dtype=torch.bool)
    for bi, (a, s) in enumerate(zip(anchors, doc_starts)):
        for i in range(B):
            r = bi * B + i
            m[r, bi * B: (bi + 1) * B] = True
            for j, t in enumerate(ctx_pos):
                if s <= t < a and (window is None or t > a + i - window):
                    m[r, n + j] = True
    return m


@pytest.mark.parametrize("window", [None, 5])
def test_anchored_predicate_matches_oracle(window):
    g = torch.Generator().manual_seed(3)
    B, L = 4, 40
    doc_starts_of = torch.tensor([0] * 11 + [11] * 17 + [28] * 12)  # three documents
    anchors = torch.randperm(L - B, generator=g)[:6]
    ctx = torch.randperm(L, generator=g)[:25]  # an arbitrary subset, in arbitrary order (a shard)
    rows = RowMeta.anchored(anchors, doc_starts_of[anchors], B, ctx, doc_starts_of[ctx])
    got = allowed(rows, rows, AnchoredGeometry(B, window))
    want = _oracle(anchors.tolist(), doc_starts_of[anchors].tolist(), B, ctx.tolist(), window)
    assert torch.equal(got, want)
    assert got[:, len(anchors) * B:].any()  # some context is visible: the check is not vacuous
    # Any split of the keys gives the same pairs (what the transports rely on).
    perm = torch.randperm(len(rows), generator=g)
    assert torch.equal(allowed(rows, rows.select(perm), AnchoredGeometry(B, window)), want[:, perm])


def test_anchored_geometry_rejects_window_below_block():
    with pytest.raises(ValueError, match="smaller than --block-size"):
        AnchoredGeometry(8, window=4)


def _tiny_shape(**kw):
    from megatron_csbp.model.dflash import DrafterShape

    base = dict(hidden_size=32, num_layers=3, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                ffn_hidden_size=48, target_layer_ids=[0, 2], block_size=4, mask_token_id=5, rotary_base=10000.0,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=6)
    base.update(kw)
    return DrafterShape(**base)


def _random_hf(shape, seed=0):
    from transformers import MuseGlimmerAssistantModel

    torch.manual_seed(seed)
    hf = MuseGlimmerAssistantModel(shape.hf_config()).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3) if "norm" not in name else p.uniform_(0.5, 1.5)
    return hf


def _hf_block(hf, feats, noise):
    """HF's drafter output for one block after `c` context tokens, called as transformers' DFlash
    candidate generator calls it (a DFlashCache told how many context rows precede the block)."""
    from transformers.cache_utils import DFlashCache

    c, B = feats.shape[1], noise.shape[1]
    cache = DFlashCache(config=hf.config)
    cache.set_previous_accepted_tokens(c)
    with torch.no_grad():
        return hf(noise_embeds=noise, context_hidden_states=feats, position_ids=torch.arange(c + B)[None],
                  cache=cache).last_hidden_state[0]


def test_drafter_logit_parity_with_hf(megatron_single_rank):
    """fp32 parity of the final hidden states (and logits through a random head) for a block
    after 13 context tokens, with sliding layers (window 6) that cut the context.

    Error model: both sides run the same fp32 operations in a different order (fused k/v
    projection, merge of partial softmaxes): a few ulps of values O(10) through 3 layers, ~1e-5;
    the bound 1e-4 is the issue's."""
    from megatron_csbp.model.dflash import DFlashDrafter, export_hf_drafter, load_hf_drafter

    shape = _tiny_shape()
    hf = _random_hf(shape)
    c, B, vocab = 13, shape.block_size, 50
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, c, shape.context_width, generator=g)
    noise = torch.randn(1, B, shape.hidden_size, generator=g)
    head = torch.randn(vocab, shape.hidden_size, generator=g)
    ref = _hf_block(hf, feats, noise)

    model = DFlashDrafter(shape)
    load_hf_drafter(model, hf)
    rows = RowMeta.anchored(torch.tensor([c]), torch.tensor([0]), B, torch.arange(c), torch.zeros(c, dtype=torch.long))
    plan = AttentionPlan(AnchoredGeometry(B), rows, clean_queries=False)
    with torch.no_grad():
        out = model(noise.transpose(0, 1), feats.transpose(0, 1), plan)[:, 0]
    assert (out - ref).abs().max() <= 1e-4
    assert (out @ head.T - ref @ head.T).abs().max() <= 1e-4 * 10  # logits: |head row|_1 ~ 8 x 1e-5

    # The window matters here: all-full layers give different outputs (the test can fail).
    full = _random_hf(_tiny_shape(layer_types=["full_attention"] * 3))
    assert (_hf_block(full, feats, noise) - ref).abs().max() > 1e-2

    # Megatron -> HF gives back the same weights.
    back = export_hf_drafter(model)
    for k, v in hf.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
