"""A packed sample through the whole model (BD3-LM, float64): every document's noisy-row logits and
loss terms equal that document run alone, piece by piece, on the block grid it has in the pack
(`--reset-attention-mask --reset-position-ids`), with a reference GPT whose attention is a dense
float64 softmax over the unpacked oracle of the document alone (tests/test_packing.alone_mask),
fed only that document's rows at positions restarting at 0. --eod-mask-loss drops EOD targets;
a micro-batch of samples with different documents equals its samples one by one."""
import pytest
import torch

from megatron_csbp.attention.block_attention import AttentionPlan
from megatron_csbp.attention.core_attention import BlockDiffusionAttention
from megatron_csbp.attention.plan_handles import plan_from_mask, plan_mask
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, Documents, RowMeta
from megatron_csbp.layout.packing import Packing
from megatron_csbp.model.bdlm import BlockDiffusionModel
from megatron_csbp.model.rotary import LayoutRotaryEmbedding
from megatron_csbp.objectives import BD3LMObjective, sample_generator
from tests.gradients import EXACT_DTYPE
from tests.test_packing import alone_mask

L, B, V = 32, 4, 64
MASK, EOD, SEED = 5, 63, 77
# Documents end with EOD: [0, 3) [3, 4) one token on a block edge, [4, 13) straddles, [13, 16)
# ends on a block edge, [16, 27), [27, 32) the last one without an EOD.
STARTS = (0, 3, 4, 13, 16, 27)
REL_TOL = 1e-9  # float64 both sides, summation order only (tests/test_objective_bd3lm.py)
_ALONE = {}  # the document the reference attention runs: (start, n)


class AloneAttention(BlockDiffusionAttention):
    """Float64 softmax over the document-alone oracle, restricted to the rows passed in."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        start, n = _ALONE["doc"]
        rows = plan_from_mask(attention_mask).local
        local = (rows.position - start) + n * rows.is_clean.long()
        mask = alone_mask(start, n, B, "block_causal", None)[local][:, local]
        rep = query.shape[2] // key.shape[2]
        q, k, v = query.double(), key.double().repeat_interleave(rep, 2), value.double().repeat_interleave(rep, 2)
        probs = torch.softmax((torch.einsum("qbhd,kbhd->bhqk", q, k) * self.softmax_scale).masked_fill(~mask, -torch.inf), -1)
        out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
        return out.reshape(out.shape[0], out.shape[1], -1).to(query.dtype)


def _tokens(seed=0, starts=STARTS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V - 3, (L,), generator=g)
    x = x + (x >= MASK).long()  # neither the mask token nor EOD
    for s in starts[1:]:
        x[s - 1] = EOD
    return x


@pytest.fixture
def models(tiny_gpt):
    gpt = tiny_gpt(vocab_size=V, seq_length=L, seed=3, params_dtype=EXACT_DTYPE).to(EXACT_DTYPE)
    ref = tiny_gpt(vocab_size=V, seq_length=L, seed=3, params_dtype=EXACT_DTYPE).to(EXACT_DTYPE)
    ref.rotary_pos_emb = LayoutRotaryEmbedding(ref.rotary_pos_emb)
    for module in list(ref.modules()):
        ca = getattr(module, "core_attention", None)
        if isinstance(ca, BlockDiffusionAttention):
            module.core_attention = AloneAttention(ca.config, ca.layer_number, softmax_scale=ca.softmax_scale)
    objective = BD3LMObjective(B, MASK, seed=SEED)

    def packed(**flags):
        return BlockDiffusionModel(gpt, objective, SequenceLayout(BlockGeometry(L, B)),
                                   packing=Packing(EOD, **flags))
    return packed, ref, objective


@torch.no_grad()
def alone_logits(ref, noisy_tokens, tokens, start, n):
    """Noisy-row logits [n, V] of document [start, start + n): each piece alone with the document's
    clean rows before its block, positions restarting at the document start."""
    _ALONE["doc"] = (start, n)
    geometry = BlockGeometry(L, B)
    out = []
    p = start
    while p < start + n:
        block_start = (p // B) * B
        end = min(block_start + B, start + n)
        rows = RowMeta.of(torch.arange(p, end), torch.arange(start, max(start, block_start)))
        ids = torch.cat([noisy_tokens[p:end], tokens[start:max(start, block_start)]])[None]
        ref.rotary_pos_emb.positions = rows.position - start
        logits = ref(ids, (rows.position - start)[None], attention_mask=plan_mask(AttentionPlan(geometry, rows)))
        out.append(logits[0, : end - p])
        p = end
    return torch.cat(out)


def test_each_document_equals_it_alone(models):
    packed, ref, objective = models
    model = packed(reset_attention_mask=True, reset_position_ids=True)
    tokens = _tokens()[None]
    assert Documents.of_eod(tokens[0], EOD).starts == STARTS
    loss_mask = torch.ones_like(tokens)
    index = torch.tensor([12])
    noised = objective.noise(tokens, loss_mask, index)
    plan = model.packing.plan(model.plan, tokens[0])
    rows = model.feeder.rows(plan, noised, tokens)
    with torch.no_grad():
        logits = model.logits(rows.input_ids, plan)[0].double()  # noisy rows, local order = positions 0..L-1
        out = model(tokens, loss_mask, index)
    # w = 1/t as the objective stores it (fp32 t, 1/t rounded once to fp32; tests/test_objective_bd3lm.py)
    w = 1.0 / objective.block_times(L // B, sample_generator(SEED, 12))
    keep = [i for i in range(V) if i != MASK]
    total = torch.zeros((), dtype=torch.float64)
    for start, n in zip(STARTS, Documents(STARTS, L).lengths):
        want = alone_logits(ref, noised.noisy_tokens[0], tokens[0], start, n).double()
        got = logits[start:start + n]
        assert float((got - want).abs().max()) <= REL_TOL * float(want.abs().max()), (start, n)
        logp = torch.log_softmax(want[:, keep], -1)
        for i in range(n):
            pos = start + i
            if int(noised.noisy_tokens[0, pos]) == MASK:
                target = int(tokens[0, pos])
                total -= logp[i, target - (target > MASK)] * float(w[pos // B])
    want_loss = total / loss_mask.sum().double()
    assert abs(float(out.loss) - float(want_loss)) <= REL_TOL * abs(float(want_loss))
    # Unpacked, the same sample attends across documents: different logits.
    with torch.no_grad():
        plain = packed().logits(rows.input_ids, model.plan)[0].double()
    assert float((plain - logits).abs().max()) > 1e-3


def test_eod_mask_loss_and_micro_batches_of_different_documents(models):
    packed, _, objective = models
    model = packed(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
    tokens = torch.stack([_tokens(0), _tokens(1, (0, 9, 10, 22))])
    loss_mask = torch.ones_like(tokens)
    index = torch.tensor([3, 40])
    supervised = model.supervised(tokens, loss_mask)
    assert torch.equal(supervised, (tokens != EOD).long())
    noised = objective.noise(tokens, supervised, index)
    assert not bool((noised.weights[tokens == EOD] != 0).any())  # an EOD is never a target
    with torch.no_grad():
        both = model(tokens, loss_mask, index)
        den = objective.denominator(supervised)
        one = [model(tokens[i:i + 1], loss_mask[i:i + 1], index[i:i + 1], den) for i in range(2)]
    assert abs(float(both.loss) - float(one[0].loss + one[1].loss)) <= 1e-12 * abs(float(both.loss))
    assert int(both.num_targets) == int(one[0].num_targets + one[1].num_targets)
