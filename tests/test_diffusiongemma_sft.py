"""`diffusiongemma-sft` against a brute-force computation with the Hugging Face model.

The brute force loops over samples and response blocks, calls HF's
`DiffusionGemmaForBlockDiffusion(input_ids=clean[:s_b], decoder_input_ids=noisy block)` (with a
first HF pass feeding self-conditioning where the sample draws it), takes the block's token-mean
CE, the mean over blocks, averages over samples and adds encoder_loss_weight x the next-token CE
of HF's encoder logits over every pair of the batch (the reference's rule, the default; with
--encoder-loss-scope response the token mean over each sample's response targets, per sample). Loss and every parameter gradient must match the one-pass
Megatron forward.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
pytest.importorskip("transformers")

from megatron_csbp.model.families.diffusion_gemma_weights import hf_to_megatron_state  # noqa: E402
from megatron_csbp.layout.layout import SequenceLayout  # noqa: E402
from megatron_csbp.layout.masks import BlockGeometry  # noqa: E402
from megatron_csbp.model.diffusiongemma import diffusion_gemma_model  # noqa: E402
from megatron_csbp.model.diffusiongemma.sft import DiffusionGemmaSFTModel  # noqa: E402
from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model  # noqa: E402
from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective  # noqa: E402

V, L, B = 96, 24, 4
ENC_W = 0.7
# fp32 on both sides (transformers keeps norms, softmax and rotary in fp32 whatever the dtype).
# Error model, u32 = 6e-8: each token's CE comes from dot products of K <= 10^2 terms (random-walk
# growth sqrt(K) = 10) through D = 4 layers + head (5), on both sides (2): relative error
# u32 x 10 x 5 x 2 = 6e-6 of a CE of ~8 nats -> LOSS_TOL = 5e-5 (measured <= 4.8e-7, one fp32 ulp).
# Gradients, worst per tensor: as tests/test_diffusiongemma.py, u32 x sqrt(10^3) x 8 x 2 x 10 =
# 3e-4 = GRAD_TOL (measured <= 2.1e-5 under avx512 / avx2 / default: 14x).
LOSS_TOL, GRAD_TOL = 5e-5, 3e-4


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (2, L), generator=g)
    loss_mask = torch.zeros(2, L, dtype=torch.long)
    loss_mask[0, 8:22] = 1  # 2 prompt blocks, response ends mid-block (2 trailing pad tokens)
    loss_mask[1, 4:] = 1  # 1 prompt block
    return tokens, loss_mask


def _sample_indices(objective, want):
    """Global sample indices whose self-conditioning draws are `want` (one per sample)."""
    tokens, loss_mask = _batch()
    found = []
    for w in want:
        i = 0
        while True:
            if i not in found and bool(objective.noise(tokens[:1], loss_mask[:1], torch.tensor([i])).self_conditioning[0]) == w:
                found.append(i)
                break
            i += 1
    return torch.tensor(found)


def test_noise_is_uniform_state_per_block_and_seeded_by_sample():
    obj = DiffusionGemmaSFTObjective(B, V, seed=11)
    tokens, loss_mask = _batch()
    nb = obj.noise(tokens, loss_mask, torch.tensor([5, 6]))
    changed = nb.noisy_tokens != tokens
    assert not bool(changed[loss_mask == 0].any())  # prompts and padding never noised
    assert nb.first_canvas_block == 1
    assert torch.equal(nb.targets[loss_mask == 1], tokens[loss_mask == 1]) and bool((nb.targets[loss_mask == 0] == -100).all())
    # Block-then-sample weights: every response block of a sample sums to 1 / (its blocks).
    w = nb.weights.view(2, L // B, B).sum(dim=2)
    assert torch.allclose(w[0, 2:], torch.full((4,), 0.25)) and torch.allclose(w[1, 1:], torch.full((5,), 0.2))
    # AR term (default scope `all`): every next-token pair, prompt included, weight encoder_loss_weight
    # over the global pair count (the denominator's second entry).
    assert torch.equal(nb.clean_targets[:, :-1], tokens[:, 1:]) and bool((nb.clean_targets[:, -1] == -100).all())
    assert bool((nb.clean_weights[:, :-1] == obj.encoder_loss_weight).all())
    assert obj.denominator(loss_mask, tokens).tolist() == [2.0, 2.0 * (L - 1)]
    old_rule = DiffusionGemmaSFTObjective(B, V, seed=11, encoder_loss_scope="response").noise(tokens, loss_mask, torch.tensor([5, 6]))
    assert torch.allclose(old_rule.clean_weights.sum(dim=1), torch.full((2,), obj.encoder_loss_weight))
    assert int(old_rule.clean_targets[0, 7]) == int(tokens[0, 8]) and int(old_rule.clean_targets[0, 6]) == -100
    assert int(old_rule.clean_targets[0, 21]) == -100
    # Same sample index -> same noise, wherever it sits in the batch.
    again = obj.noise(tokens.flip(0), loss_mask.flip(0), torch.tensor([6, 5]))
    assert torch.equal(again.noisy_tokens.flip(0), nb.noisy_tokens)
    # Uniform noise rate follows t: over many samples about half of the tokens are replaced.
    big = torch.randint(0, V, (256, 32), generator=torch.Generator().manual_seed(0))
    frac = (obj.noise(big, torch.ones_like(big), torch.arange(256)).noisy_tokens != big).float().mean().item()
    assert 0.4 < frac < 0.55, frac  # E[t] = 0.5005, minus the 1/V chance of drawing the same id
    with pytest.raises(ValueError, match="multiple of --block-size"):
        bad = loss_mask.clone()
        bad[1, 3] = 1
        obj.noise(tokens, bad, torch.tensor([0, 1]))


def test_block_times_are_antithetic_over_each_samples_response_blocks():
    # The reference's rule (the default): t = (u + i / k) mod 1 over a sample's k response blocks;
    # --block-times independent keeps the rule before (n independent uniforms). The noise is
    # rebuilt from the sample's generator: times, then one draw and one random id per token.
    from megatron_csbp.objectives.base import block_times, sample_generator

    tokens, loss_mask = _batch()
    for rule in ("antithetic", "independent"):
        obj = DiffusionGemmaSFTObjective(B, V, seed=11, block_times=rule)
        nb = obj.noise(tokens, loss_mask, torch.tensor([5, 6]))
        for e, index in enumerate((5, 6)):
            g = sample_generator(11, index)
            blocks = loss_mask[e].view(-1, B).bool().any(dim=1)
            t = torch.ones(L // B, dtype=torch.float64)
            if rule == "antithetic":
                t[blocks] = block_times(int(blocks.sum()), g, 1e-3, 1.0)
                gaps = torch.sort(t[blocks]).values.diff()
                assert torch.allclose(gaps, torch.full_like(gaps, (1 - 1e-3) / int(blocks.sum())))
            else:
                t = block_times(L // B, g, 1e-3, 1.0, antithetic=False)
            t = t.float().repeat_interleave(B)
            replace = (torch.rand(L, generator=g) < t) & loss_mask[e].bool()
            expect = torch.where(replace, torch.randint(0, V, (L,), generator=g), tokens[e])
            assert torch.equal(nb.noisy_tokens[e], expect)


def test_resume_keeps_the_rule_a_checkpoint_was_trained_with(tmp_path):
    import argparse
    import json
    import os

    from megatron_csbp.objectives.diffusiongemma_sft import BLOCK_TIMES, ENCODER_LOSS_SCOPE
    from megatron_csbp.training.arguments import Resolved, resume_objective_flags

    def resolved(meta, finetune=False, **given):
        it = tmp_path / "iter_0000001"
        it.mkdir(exist_ok=True)
        (it / "bdlm_meta.json").write_text(json.dumps({"model_args": meta}))
        args = argparse.Namespace(objective="diffusiongemma-sft", load=str(tmp_path), finetune=finetune,
                                  block_times=None, encoder_loss_scope=None)
        vars(args).update(given)
        resume_objective_flags(args, Resolved(load_step=1 if meta is not None else None))
        return args.block_times, args.encoder_loss_scope

    assert os.path.isdir(tmp_path)
    old = {"objective": "diffusiongemma-sft"}  # saved before the flags existed
    assert resolved(None) == ("antithetic", "all")  # a new run: the reference's rule
    assert resolved(old) == ("independent", "response")
    assert resolved(old, block_times="antithetic") == ("antithetic", "response")  # a given flag wins
    assert resolved(old, finetune=True) == ("antithetic", "all")
    assert resolved({"objective": "bd3lm"}) == ("antithetic", "all")
    assert resolved(dict(old, block_times="antithetic", encoder_loss_scope="response")) == ("antithetic", "response")
    assert (BLOCK_TIMES.before, ENCODER_LOSS_SCOPE.before) == ("independent", "response")


def _brute_force_loss(hf, obj, tokens, loss_mask, nb):
    softcap = hf.config.text_config.final_logit_softcapping
    per_sample, ar_sum = [], []
    for e in range(tokens.shape[0]):
        sup = loss_mask[e].bool()
        if not bool(sup.any()):
            continue
        clean, noisy = tokens[e : e + 1], nb.noisy_tokens[e : e + 1]
        block_losses = []
        for b in range(L // B):
            s = b * B
            block_sup = sup[s : s + B]
            if not bool(block_sup.any()):
                continue
            kw = {}
            if bool(nb.self_conditioning[e]):
                with torch.no_grad():
                    first = hf(input_ids=clean[:, :s], decoder_input_ids=noisy[:, s : s + B]).logits
                kw = dict(self_conditioning_logits=first)
            logits = hf(input_ids=clean[:, :s], decoder_input_ids=noisy[:, s : s + B], **kw).logits[0]
            block_losses.append(F.cross_entropy(logits[block_sup], clean[0, s : s + B][block_sup]))
        diffusion = torch.stack(block_losses).mean()
        out = hf.model(input_ids=clean, decoder_input_ids=noisy[:, :B])
        enc_logits = torch.tanh(hf.lm_head(out.encoder_last_hidden_state[0]).float() / softcap) * softcap
        if obj.encoder_loss_scope == "response":  # token mean over the sample's response targets
            targets_ok = sup[1:]
            ar = F.cross_entropy(enc_logits[:-1][targets_ok], clean[0, 1:][targets_ok])
            per_sample.append(diffusion + obj.encoder_loss_weight * ar)
        else:  # every pair, summed here, over the batch's pair count below
            per_sample.append(diffusion)
            ar_sum.append(F.cross_entropy(enc_logits[:-1], clean[0, 1:], reduction="sum"))
    loss = torch.stack(per_sample).mean()
    if ar_sum:
        loss = loss + obj.encoder_loss_weight * torch.stack(ar_sum).sum() / (tokens.shape[0] * (L - 1))
    return loss


def _grad(p):  # without self-conditioning the SC block is skipped (its gradient is exactly 0)
    return torch.zeros_like(p) if p.grad is None else p.grad


def tiny_models(**objective):
    """(HF model, the Megatron model converted from it, the objective) of these tests."""
    hf = tiny_hf_model(seed=2, vocab_size=V, sliding_window=3).train()
    state, config, _ = hf_to_megatron_state(hf.state_dict(), hf.config)
    gpt = diffusion_gemma_model(config, V, 256)
    gpt.load_state_dict(state, strict=False)
    gpt.train()
    return hf, gpt, DiffusionGemmaSFTObjective(B, V, seed=7, encoder_loss_weight=ENC_W, **objective)


def assert_loss_and_gradients_equal(loss, ref, gpt, hf):
    """Backward the brute-force `ref` (the Megatron loss is backwarded already) and compare the loss
    and every parameter gradient within the error model above."""
    ref.backward()
    print(f"megatron loss {loss.item():.6f}, brute force {ref.item():.6f}, |diff| {abs(loss.item() - ref.item()):.3e}")
    assert abs(loss.item() - ref.item()) < LOSS_TOL
    worst = worst_gradient_difference(gpt, hf)
    print(f"worst relative gradient difference {worst:.2e}")
    assert worst < GRAD_TOL


def worst_gradient_difference(gpt, hf) -> float:
    """Worst per-tensor relative difference of the Megatron model's gradients from the HF model's
    (converted to Megatron's names)."""
    hf_grads = {}
    for key, value in hf.state_dict().items():
        if key.endswith("layer_scalar"):
            hf_grads[key] = torch.zeros_like(value)
            continue
        p = hf.get_parameter(key)
        hf_grads[key] = p.grad if p.grad is not None else torch.zeros_like(p)
    ref_grads, _, _ = hf_to_megatron_state(hf_grads, hf.config)
    return max(((_grad(p) - ref_grads[k]).abs().max() / ref_grads[k].abs().max().clamp_min(1e-6)).item()
               for k, p in gpt.named_parameters())


@pytest.mark.parametrize("want_sc,scope", [((True, False), "all"), ((False, False), "all"),
                                           ((True, False), "response")])
def test_sft_loss_and_gradients_equal_brute_force(megatron_single_rank, want_sc, scope):
    hf, gpt, obj = tiny_models(encoder_loss_scope=scope)
    model = DiffusionGemmaSFTModel(gpt, obj, SequenceLayout(BlockGeometry(L, B, "token_causal")))
    tokens, loss_mask = _batch()
    index = _sample_indices(obj, want_sc)
    nb = obj.noise(tokens, loss_mask, index)
    assert tuple(nb.self_conditioning.tolist()) == want_sc

    out = model(tokens, loss_mask, index)
    out.loss.backward()
    ref = _brute_force_loss(hf, obj, tokens, loss_mask, nb)
    assert_loss_and_gradients_equal(out.loss, ref, gpt, hf)
    assert bool(_grad(gpt.self_conditioning_mlp.linear_fc1.weight).abs().sum() > 0) == want_sc[0]


def test_prompt_blocks_get_no_noisy_copy(megatron_single_rank):
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config

    gpt = diffusion_gemma_model(tiny_megatron_config(), V, 256)
    obj = DiffusionGemmaSFTObjective(B, V)
    model = DiffusionGemmaSFTModel(gpt, obj, SequenceLayout(BlockGeometry(L, B, "token_causal")))
    plan = model.canvas_plan(2)
    assert int((~plan.local.is_clean).sum()) == L - 2 * B and int(plan.local.position[0]) == 2 * B


def test_canvas_plans_are_an_lru_cache(megatron_single_rank):
    # One plan per canvas start would grow with the starts seen; the cache keeps the model's own
    # plan and the CANVAS_PLAN_CACHE most recently used ones, each rebuilt equal when needed again.
    from megatron_csbp.attention.feed import CANVAS_PLAN_CACHE
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config

    gpt = diffusion_gemma_model(tiny_megatron_config(), V, 256)
    L2 = 12 * B
    model = DiffusionGemmaSFTModel(gpt, DiffusionGemmaSFTObjective(B, V),
                                   SequenceLayout(BlockGeometry(L2, B, "token_causal")))
    starts = list(range(1, L2 // B))
    assert len(starts) > CANVAS_PLAN_CACHE + 1
    first = model.canvas_plan(starts[0])
    for s in starts[1:]:
        model.canvas_plan(s)
        model.canvas_plan(starts[1])  # kept in use: never the one evicted
    assert len(model.feeder._plans) == CANVAS_PLAN_CACHE + 1
    assert model.plan in model.feeder._plans.values() and starts[1] in model.feeder._plans
    assert starts[0] not in model.feeder._plans and set(model.feeder._counted_clean) <= set(model.feeder._plans)
    again = model.canvas_plan(starts[0])
    assert again is not first and torch.equal(again.local.position, first.local.position)
