"""DiffusionGemma in Megatron against Hugging Face `diffusion_gemma` (transformers 5.24), fp32, CPU.

The oracle is HF's own per-block call `DiffusionGemmaForBlockDiffusion(input_ids=clean[:, :s_b],
decoder_input_ids=noisy_b)`; the Megatron model runs once over the [noisy ; clean] rows of
`BlockDiffusionModel` (token-causal clean stream, per-layer sliding windows).
"""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

from megatron_csbp.model.families.diffusion_gemma_weights import (ConversionError, hf_to_megatron_state,  # noqa: E402
                                                     megatron_to_hf_state)
from megatron_csbp.layout.layout import SequenceLayout  # noqa: E402
from megatron_csbp.layout.masks import BlockGeometry  # noqa: E402
from megatron_csbp.model.diffusiongemma import FULL, SLIDING, config_from_hf, diffusion_gemma_model  # noqa: E402
from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model  # noqa: E402

V, L, B, BATCH = 96, 24, 4, 2
# fp32 on both sides (transformers keeps norms, softmax and rotary in fp32 whatever the dtype), which
# differ in summation order and kernels. Error model, u32 = 6e-8:
# - logits: dot products of K <= 10^2 terms with random-walk growth sqrt(K) = 10, D = 4 layers + head,
#   relative to the logit scale (|logit| <= ~30 with the soft-cap), both sides:
#   2 x u32 x 10 x 5 x 30 = 1.8e-4 worst; LOGIT_TOL = 1e-4. Measured <= 8.8e-6 (docs/exactness.md).
# - gradients, worst per tensor max|g - g1| / max|g1|: sums over K <= 10^3 rows / vocab entries
#   (sqrt(K) = 32), forward + backward through 4 layers (8), both sides (2), and a tensor's
#   max|g1| / typical|g1| <= 10 (small-gradient tensors: norm and layer scalars):
#   u32 x 32 x 8 x 2 x 10 = 3e-4 = GRAD_TOL. Measured <= 2.3e-5 (13x).
LOGIT_TOL, GRAD_TOL = 1e-4, 3e-4


def _models(window: int, seed: int = 0):
    hf = tiny_hf_model(seed=seed, vocab_size=V, sliding_window=window)
    state, config, rest = hf_to_megatron_state(hf.state_dict(), hf.config)
    gpt = diffusion_gemma_model(config, V, 256)
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return hf, gpt.eval(), config


def _bdlm(gpt, clean_attention="token_causal"):
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import BD3LMObjective

    return BlockDiffusionModel(gpt, BD3LMObjective(B, V - 1), SequenceLayout(BlockGeometry(L, B, clean_attention)))


def _tokens(seed=5):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, V, (BATCH, L), generator=g)
    noisy = torch.randint(0, V, (BATCH, L), generator=g)
    clean[0, 3] = 0  # padding id inside the data: its embedding lookup passes no gradient
    sc = 3 * torch.randn(BATCH, L, V, generator=g)
    return clean, noisy, sc


def _megatron_logits(bdm, clean, noisy, sc=None, sc_mask=None):
    rows = bdm.plan.local
    ids = torch.where(rows.is_clean[None], clean[:, rows.position], noisy[:, rows.position])
    noisy_pos = rows.position[~rows.is_clean]
    with bdm.gpt.self_conditioning_inputs(None if sc is None else sc[:, noisy_pos], sc_mask):
        return bdm.logits(ids), noisy_pos


def _per_block_diffs(hf, bdm, clean, noisy, sc=None, sc_mask=None):
    with torch.no_grad():
        logits, noisy_pos = _megatron_logits(bdm, clean, noisy, sc, sc_mask)
        diffs = []
        for b in range(1, L // B):  # block 0 has no prefix (HF refuses an empty encoder input)
            s = b * B
            kw = {} if sc is None else dict(self_conditioning_logits=sc[:, s : s + B], self_conditioning_mask=sc_mask)
            ref = hf(input_ids=clean[:, :s], decoder_input_ids=noisy[:, s : s + B], **kw).logits
            sel = (noisy_pos >= s) & (noisy_pos < s + B)
            diffs.append((logits[:, sel] - ref).abs().max().item())
    return diffs


@pytest.mark.parametrize("window", [6, 3])  # window wider and narrower than the block
def test_noisy_logits_equal_hf_per_block(megatron_single_rank, window):
    hf, gpt, config = _models(window)
    assert config.window_attn_skip_freq == [1, 0, 1, 0] and config.window_size == (window - 1, 0)
    bdm = _bdlm(gpt)
    clean, noisy, sc = _tokens()
    no_sc = _per_block_diffs(hf, bdm, clean, noisy)
    with_sc = _per_block_diffs(hf, bdm, clean, noisy, sc)
    masked_sc = _per_block_diffs(hf, bdm, clean, noisy, sc, torch.tensor([True, False]))
    print(f"window {window}: max |logit diff| {max(no_sc + with_sc + masked_sc):.3e}; per block, no SC {no_sc}, "
          f"SC {with_sc}, SC masked {masked_sc}")
    assert max(no_sc + with_sc + masked_sc) < LOGIT_TOL
    # Self-conditioning changes the logits (the check above is not vacuous).
    assert max(_per_block_diffs(hf, bdm, clean, noisy, sc)) < LOGIT_TOL
    with torch.no_grad():
        plain, _ = _megatron_logits(bdm, clean, noisy)
        conditioned, _ = _megatron_logits(bdm, clean, noisy, sc)
    assert (plain - conditioned).abs().max() > 1e-2


def test_block_causal_clean_stream_is_not_diffusiongemma(megatron_single_rank):
    hf, gpt, _ = _models(6)
    clean, noisy, _ = _tokens()
    diffs = _per_block_diffs(hf, _bdlm(gpt, "block_causal"), clean, noisy)
    assert max(diffs) > 1e-2, diffs


def test_gradients_equal_hf(megatron_single_rank):
    """Gradient of a random linear function of every block's logits (with self-conditioning)."""
    hf, gpt, _ = _models(3)
    hf.train(), gpt.train()
    bdm = _bdlm(gpt)
    clean, noisy, sc = _tokens()
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(BATCH, L, V, generator=g)
    weight[:, :B] = 0  # block 0 has no HF counterpart
    logits, noisy_pos = _megatron_logits(bdm, clean, noisy, sc)
    (logits * weight[:, noisy_pos]).sum().backward()
    total = 0
    for b in range(1, L // B):
        s = b * B
        ref = hf(input_ids=clean[:, :s], decoder_input_ids=noisy[:, s : s + B], self_conditioning_logits=sc[:, s : s + B]).logits
        total = total + (ref * weight[:, s : s + B]).sum()
    total.backward()
    hf_grads = {}
    for key, value in hf.state_dict().items():
        if key.endswith("layer_scalar"):
            hf_grads[key] = torch.zeros_like(value)
            continue
        p = hf.get_parameter(key)
        hf_grads[key] = p.grad if p.grad is not None else torch.zeros_like(p)
    ref_grads, _, _ = hf_to_megatron_state(hf_grads, hf.config)
    worst = 0.0
    for name, p in gpt.named_parameters():
        ref = ref_grads[name]
        worst = max(worst, ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
    print(f"worst relative gradient difference {worst:.2e}")
    assert worst < GRAD_TOL
    emb = gpt.embedding.word_embeddings.weight
    assert emb.grad is not None and emb.grad.abs().sum() > 0


def test_config_reads_per_layer_config(megatron_single_rank):
    hf = tiny_hf_model(vocab_size=V, sliding_window=6)
    saved = hf.config.to_dict()
    assert "per_layer_config" in saved["text_config"] and "global_head_dim" not in saved["text_config"]
    for source in (hf.config, saved):
        c = config_from_hf(source)
        assert c.layer_types == [SLIDING, FULL, SLIDING, FULL]
        assert (c.kv_channels, c.num_query_groups, c.full_kv_channels, c.full_num_query_groups) == (8, 2, 16, 1)
        assert c.get_config_for_layer(2).kv_channels == 16 and c.get_config_for_layer(3).kv_channels == 8
        assert c.final_logit_softcapping == 30.0 and c.full_rotary_proportion == 0.25
    # Proportional rotary: 2 of the 8 full-layer frequency pairs rotate, the rest are 0.
    inv = config_from_hf(saved).rope_inv_freq(FULL)
    assert inv.numel() == 8 and bool((inv[2:] == 0).all()) and bool((inv[:2] > 0).all())
    bad = dict(saved)
    bad["text_config"] = dict(saved["text_config"], use_bidirectional_attention="all")
    with pytest.raises(ValueError, match="bidirectional"):
        config_from_hf(bad)


def test_conversion_both_ways(megatron_single_rank):
    hf, gpt, config = _models(6)
    sd = hf.state_dict()
    enc, dec = "model.encoder.language_model.layers.1.", "model.decoder.layers.1."
    assert not torch.equal(sd[enc + "layer_scalar"], sd[dec + "layer_scalar"])
    state = gpt.state_dict()
    assert torch.equal(state["decoder.layers.1.clean_layer_scalar"], sd[enc + "layer_scalar"])
    assert torch.equal(state["decoder.layers.1.layer_scalar"], sd[dec + "layer_scalar"])
    _, _, rest = hf_to_megatron_state(sd, hf.config)
    assert rest and all(".vision_tower." in k or ".embed_vision." in k for k in rest)
    # Live-model layout (tied copies, lm_head) back exactly.
    full = megatron_to_hf_state(state, config, extra=rest, tied_copies=True)
    assert set(full) == set(sd) and all(torch.equal(full[k], sd[k]) for k in sd)
    # Saved layout: one decoder copy + the encoder layer_scalars, no lm_head; imports to the same state.
    saved = megatron_to_hf_state(state, config, extra=rest)
    assert "lm_head.weight" not in saved and enc + "layer_scalar" in saved and enc + "input_layernorm.weight" not in saved
    again, _, _ = hf_to_megatron_state(saved, hf.config)
    assert all(torch.equal(again[k], v) for k, v in state.items() if not k.endswith("_extra_state"))
    # Untied copies are refused.
    broken = dict(sd)
    broken[enc + "mlp.up_proj.weight"] = broken[enc + "mlp.up_proj.weight"] + 1e-3
    with pytest.raises(ConversionError, match="tied"):
        hf_to_megatron_state(broken, hf.config)


def test_spec_swaps_block_attention_with_per_layer_windows(megatron_single_rank):
    from megatron_csbp.attention.core_attention import BlockDiffusionAttention
    from megatron_csbp.model.spec import count_block_attention

    _, gpt, _ = _models(6)
    assert count_block_attention(gpt) == 4
    windows = [layer.self_attention.core_attention.window for layer in gpt.decoder.layers]
    assert windows == [6, None, 6, None]
    assert all(isinstance(layer.self_attention.core_attention, BlockDiffusionAttention) for layer in gpt.decoder.layers)
    assert [layer.self_attention.k_eq_v for layer in gpt.decoder.layers] == [False, True, False, True]
    assert gpt.decoder.layers[0].self_attention.core_attention.softmax_scale == 1.0


def _tiny_gemma4(k_eq_v: bool):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                           num_global_key_value_heads=1, layer_types=[SLIDING, FULL, SLIDING, FULL], sliding_window=3,
                           num_experts=4, top_k_experts=2, moe_intermediate_size=12, max_position_embeddings=256,
                           hidden_size_per_layer_input=0, enable_moe_block=True, attention_k_eq_v=k_eq_v,
                           final_logit_softcapping=30.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)) if ("norm" in name or name.endswith("scale"))
                    else 0.15 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_gemma4_text_moe_as_ar_starting_point(megatron_single_rank, k_eq_v):
    """A Gemma 4 text MoE checkpoint converts to the same Megatron model; its clean stream (AR,
    token-causal, sliding windows) reproduces Gemma4ForCausalLM's logits, and the new
    self-conditioning block starts as a no-op."""
    from megatron_csbp.model.families.diffusion_gemma_weights import gemma4_to_megatron_state
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import AutoregressiveObjective

    hf = _tiny_gemma4(k_eq_v)
    state, config, rest = gemma4_to_megatron_state(hf.state_dict(), hf.config)
    assert not rest and config.full_k_eq_v == k_eq_v
    gpt = diffusion_gemma_model(config, V, 256)
    gpt.load_state_dict(state, strict=False)
    gpt.eval()
    assert torch.equal(state["decoder.layers.1.layer_scalar"], state["decoder.layers.1.clean_layer_scalar"])
    assert not bool(state["self_conditioning_mlp.linear_fc2.weight"].any())
    bdm = BlockDiffusionModel(gpt, AutoregressiveObjective(), SequenceLayout(BlockGeometry(L, B, "token_causal")))
    clean, _, _ = _tokens()
    with torch.no_grad():
        rows = bdm.plan.local
        logits = bdm.logits(clean[:, rows.position])
        ref = hf(input_ids=clean).logits
    diff = (logits - ref[:, rows.position]).abs().max().item()
    print(f"Gemma 4 (K=V {k_eq_v}) AR logits: max |diff| {diff:.2e}")
    assert diff < LOGIT_TOL


def test_full_recompute_gives_the_same_gradients(megatron_single_rank):
    """Full-layer activation recompute replays the layers (plan id, layer scalars per row, MoE)."""
    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    install_cpu_compat()
    model_parallel_cuda_manual_seed(3)
    hf = tiny_hf_model(seed=4, vocab_size=V, sliding_window=3)
    state, _, _ = hf_to_megatron_state(hf.state_dict(), hf.config)
    clean, noisy, sc = _tokens()
    weight = torch.randn(BATCH, L, V, generator=torch.Generator().manual_seed(2))
    grads, calls = [], []
    for recompute in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        config = config_from_hf(hf.config, **recompute)
        gpt = diffusion_gemma_model(config, V, 256)
        gpt.load_state_dict(state, strict=False)
        gpt.train()
        bdm = _bdlm(gpt)
        count = [0]
        gpt.decoder.layers[1].register_forward_pre_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        logits, noisy_pos = _megatron_logits(bdm, clean, noisy, sc)
        (logits * weight[:, noisy_pos]).sum().backward()
        calls.append(count[0])
        grads.append({n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None})
    assert calls == [1, 2]  # the recomputed model ran layer 2 again in backward
    assert grads[0].keys() == grads[1].keys()
    worst = max(((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max().clamp_min(1e-6)).item() for n in grads[0])
    print(f"recompute vs no recompute: worst relative gradient difference {worst:.2e}")
    assert worst < 1e-6, worst  # the same kernels replayed: measured 0 under avx512 / avx2 / default
