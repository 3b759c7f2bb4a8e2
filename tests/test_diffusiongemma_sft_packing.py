"""`diffusiongemma-sft` on a packed sample (issue 22, deliverable 4): each document runs alone.

Two conversations packed into one sample (as `--pack-sequences` packs SFT data: documents start on
block edges and are given as document ids, `--reset-attention-mask --reset-position-ids`). The
brute force is tests/test_diffusiongemma_sft.py's, run on every document alone with the Hugging
Face model (positions from 0, nothing of the other document in view) under the pack's noise; the
pack's weights are the sample's (`DiffusionGemmaSFTObjective.noise`: the mean over the pack's
response blocks, plus encoder_loss_weight x the token mean over the pack's AR targets, Megatron's
normalisation over the micro-batch's targets, not per document). Loss and every parameter
gradient must match; unpacked (one document) the same sample must not.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
pytest.importorskip("transformers")

from megatron_csbp.layout.layout import SequenceLayout  # noqa: E402
from megatron_csbp.layout.masks import BlockGeometry  # noqa: E402
from megatron_csbp.layout.packing import Packing  # noqa: E402
from megatron_csbp.model.diffusiongemma.sft import DiffusionGemmaSFTModel  # noqa: E402
from tests.test_diffusiongemma_sft import (LOSS_TOL, B, V, assert_loss_and_gradients_equal,  # noqa: E402
                                          tiny_models)

DOCS = ((0, 12), (12, 24))  # [start, end): two conversations, each a multiple of B
L = 24
EOD = V - 1


def _sample():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V - 1, (1, L), generator=g)
    loss_mask = torch.zeros(1, L, dtype=torch.long)
    loss_mask[0, 4:10] = 1  # doc 0: one prompt block, response ends mid-block (2 padding tokens)
    loss_mask[0, 20:24] = 1  # doc 1: two prompt blocks, one response block
    doc_ids = torch.tensor([[d for d, (s, e) in enumerate(DOCS) for _ in range(s, e)]])
    return tokens, loss_mask, doc_ids


def _alone_terms(hf, obj, tokens, loss_mask, nb):
    """Per document alone: the CE of each response block and the AR CE terms (summed), counts."""
    softcap = hf.config.text_config.final_logit_softcapping
    block_ce, ar_sum, ar_n = [], 0.0, 0
    for s0, e0 in DOCS:
        clean, noisy, sup = tokens[:, s0:e0], nb.noisy_tokens[:, s0:e0], loss_mask[0, s0:e0].bool()
        for s in range(0, e0 - s0, B):
            block_sup = sup[s:s + B]
            if not bool(block_sup.any()):
                continue
            kw = {}
            if bool(nb.self_conditioning[0]):
                with torch.no_grad():
                    kw = dict(self_conditioning_logits=hf(input_ids=clean[:, :s], decoder_input_ids=noisy[:, s:s + B]).logits)
            logits = hf(input_ids=clean[:, :s], decoder_input_ids=noisy[:, s:s + B], **kw).logits[0]
            block_ce.append(F.cross_entropy(logits[block_sup], clean[0, s:s + B][block_sup]))
        out = hf.model(input_ids=clean, decoder_input_ids=noisy[:, :B])
        enc = torch.tanh(hf.lm_head(out.encoder_last_hidden_state[0]).float() / softcap) * softcap
        ok = sup[1:] if obj.encoder_loss_scope == "response" else torch.ones_like(sup[1:])  # `all`: every pair
        ar_sum = ar_sum + F.cross_entropy(enc[:-1][ok], clean[0, 1:][ok], reduction="sum")
        ar_n += int(ok.sum())
    return torch.stack(block_ce), ar_sum, ar_n


@pytest.mark.parametrize("self_conditioning,scope", [(True, "all"), (False, "all"), (True, "response")])
def test_packed_sft_sample_equals_its_documents_alone(megatron_single_rank, self_conditioning, scope):
    hf, gpt, obj = tiny_models(encoder_loss_scope=scope)
    layout = SequenceLayout(BlockGeometry(L, B, "token_causal"))
    packing = Packing(EOD, reset_attention_mask=True, reset_position_ids=True)
    model = DiffusionGemmaSFTModel(gpt, obj, layout, packing=packing)
    tokens, loss_mask, doc_ids = _sample()
    i = 0
    while bool(obj.noise(tokens, loss_mask, torch.tensor([i])).self_conditioning[0]) != self_conditioning:
        i += 1
    index = torch.tensor([i])
    nb = obj.noise(tokens, loss_mask, index)

    out = model(tokens, loss_mask, index, document_ids=doc_ids)
    out.loss.backward()
    block_ce, ar_sum, ar_n = _alone_terms(hf, obj, tokens, loss_mask, nb)
    # no AR pair crosses the documents: `all` counts 11 + 11 pairs, `response` the 6 + 4 response targets
    assert len(block_ce) == 3 and ar_n == (6 + 4 if scope == "response" else 11 + 11)
    ref = block_ce.mean() + obj.encoder_loss_weight * ar_sum / ar_n
    assert_loss_and_gradients_equal(out.loss, ref, gpt, hf)

    # The same sample unpacked attends across the documents: a different loss.
    with torch.no_grad():
        plain = DiffusionGemmaSFTModel(gpt, obj, layout)(tokens, loss_mask, index)
    assert abs(plain.loss.item() - ref.item()) > 100 * LOSS_TOL
