"""DFlash drafter objective: anchors, weights, streamed CE, D-PACE; and loss and gradients equal on
1 rank, CP, BP and CSBP (gloo), with the attention bytes each layout moves."""
import math

import pytest
import torch

from megatron_csbp.objectives.dflash import (DFlashObjective, document_starts, sample_anchors,
                                             streamed_cross_entropy, valid_anchor_mask)
from tests.distributed import run_distributed
from tests.gradients import gradient_error


def test_valid_anchors_and_targets():
    tokens = torch.arange(100, 116)
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1])
    doc_ids = torch.tensor([0] * 6 + [1] * 10)
    valid = valid_anchor_mask(loss_mask, doc_ids)
    # p valid iff p, p+1 supervised, same document, p+1 < L
    want = [False, True, True, True, True, False, True, True, True, True, True, True, False, False, True, False]
    assert valid.tolist() == want
    assert document_starts(doc_ids).tolist() == [0] * 6 + [6] * 10
    obj = DFlashObjective(block_size=4, mask_token_id=7, max_anchors=100, gamma=2.0)
    s = obj.sample(tokens, loss_mask, doc_ids, sample_index=3)
    assert s.anchors.tolist() == [i for i, v in enumerate(want) if v]
    i = s.anchors.tolist().index(3)  # block at 3: targets 4, 5 (document 0 ends at 5), then none
    assert s.draft_tokens[i].tolist() == [103, 7, 7, 7]
    assert s.targets[i].tolist() == [-100, 104, 105, -100]
    j = s.anchors.tolist().index(11)  # targets 12, then 13 unsupervised, 14 supervised
    assert s.targets[j].tolist() == [-100, 112, -100, 114]
    assert s.position_weights[j].tolist() == pytest.approx([0.0, 1.0, 0.0, math.exp(-1.0)])


@pytest.mark.parametrize("sampling", ["uniform", "locality"])
def test_anchor_sampling(sampling):
    valid = torch.zeros(200, dtype=torch.bool)
    valid[10:190] = True
    draws = [sample_anchors(valid, 16, sampling, 8, torch.Generator().manual_seed(s)) for s in range(300)]
    for a in draws:
        assert len(a) == 16 and len(set(a.tolist())) == 16 and bool(valid[a].all())
        assert torch.equal(a, a.sort().values)
    if sampling == "locality":  # stride 8 is not coprime with 180 valid positions: moved to 11
        for a in draws[:20]:
            assert any(set(a.tolist()) == {10 + (s + 11 * i) % 180 for i in range(16)} for s in range(180))
    hits = torch.zeros(200)
    for a in draws:
        hits[a] += 1
    # every valid position drawn with frequency ~ 16/180 per draw (300 draws: mean 26.7)
    assert hits[:10].sum() == 0 and hits[190:].sum() == 0
    assert 10 < hits[10:190].min() and hits[10:190].max() < 50


def test_streamed_cross_entropy_matches_full_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    head = torch.randn(37, 6, dtype=torch.float64, generator=g)
    t = torch.randint(0, 37, (9,), generator=g)
    ce = streamed_cross_entropy(h, head, t, chunk=5)
    ref = torch.nn.functional.cross_entropy(h @ head.T, t, reduction="none")
    assert torch.allclose(ce, ref, atol=1e-12)
    w = torch.randn(9, dtype=torch.float64, generator=g)
    (gh,) = torch.autograd.grad((ce * w).sum(), h)
    (rh,) = torch.autograd.grad((ref * w).sum(), h)
    assert torch.allclose(gh, rh, atol=1e-12)


def test_dpace_weights_by_hand():
    obj = DFlashObjective(block_size=4, mask_token_id=0, loss="dpace", dpace_alpha=0.5, kl_scale=1.0, kl_decay=1.0)
    p = torch.tensor([[1.0, 0.5, 0.25, 0.8]], dtype=torch.float64)
    ce = -p.log()
    sup = torch.tensor([[False, True, True, True]])
    num, den, m = obj.token_loss(ce, torch.zeros(1, 4), sup)
    s = [1.0, 0.75, 0.625, 0.9]  # (1-a) p + a on supervised slots, 1 on slot 0
    P = [1.0, 0.75, 0.75 * 0.625, 0.75 * 0.625 * 0.9]
    w = [0.0, P[1] + P[2] + P[3], P[2] + P[3], P[3]]
    acc = (0.5 + 0.25 + 0.8) / 3
    c = math.exp(-acc)
    want = sum(w[k] * (c * float(ce[0, k]) + (1 - c) * (1 - float(p[0, k]))) for k in range(1, 4))
    assert float(den) == pytest.approx(sum(w), rel=1e-6)
    assert float(num) == pytest.approx(want, rel=1e-6)
    assert m["acceptance"] == pytest.approx(acc)
    assert s[0] == 1.0


# ---- layouts on gloo ------------------------------------------------------------------------------

SHAPE = dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, kv_channels=8,
             ffn_hidden_size=48, target_layer_ids=[1, 3], block_size=4, mask_token_id=5, rotary_base=10000.0,
             layer_types=["sliding_attention", "full_attention"], sliding_window=11)
L, VOCAB = 64, 40


def _data():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(6, VOCAB, (L,), generator=g)
    loss_mask = torch.ones(L, dtype=torch.long)
    loss_mask[:5] = 0
    doc_ids = torch.tensor([0] * 23 + [1] * 30 + [2] * 11)
    features = torch.randn(L, 2 * SHAPE["hidden_size"], generator=g)
    embedding = torch.randn(VOCAB, SHAPE["hidden_size"], generator=g)
    head = torch.randn(VOCAB, SHAPE["hidden_size"], generator=g) * 0.3
    return tokens, loss_mask, doc_ids, features, embedding, head


def _run_case(cp, bp, loss_kind, transport, sampling, shard_rank, shard_group, ring_group):
    from megatron_csbp.attention.accounting import traffic_counter
    from megatron_csbp.attention.dflash import DFlashLayout
    from megatron_csbp.model.dflash import DFlashDrafter, DFlashTrainingModel, DrafterShape, drafter_transformer_config

    shape = DrafterShape(**SHAPE)
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape, drafter_transformer_config(shape, perform_initialization=True))
    with torch.no_grad():  # norms away from 1 so their gradients are exercised
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    tokens, loss_mask, doc_ids, features, embedding, head = _data()
    obj = DFlashObjective(block_size=4, mask_token_id=5, max_anchors=11, sampling=sampling, gamma=3.0, loss=loss_kind,
                          vocab_chunk=16)
    layout = DFlashLayout(L, 4, cp, bp)
    model = DFlashTrainingModel(drafter, embedding, head, obj, layout, shard_rank=shard_rank, shard_group=shard_group,
                                ring_group=ring_group, transport=transport)
    traffic_counter().reset()
    out = model(features, tokens, loss_mask, doc_ids, sample_index=5)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}
    return {"loss": float(out.loss), "grads": grads, "bytes": traffic_counter().total, "metrics": out.metrics}


def layouts_rank(rank, world, cp, bp, cases):
    """Every case on one process group setup: the shard group holds all `world` ranks; the
    one-rank references run on each rank alone (no collective)."""
    import warnings

    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel import state as bps

    warnings.simplefilter("ignore")
    bps.initialize_block_parallel(context_parallel_size=cp, block_parallel_size=bp)
    shard_group, shard_rank = mpu.get_context_parallel_group(), mpu.get_context_parallel_rank()
    out = {}
    for name, (ccp, cbp, loss_kind, transport, sampling) in cases.items():
        if max(ccp, cbp) == 1:
            out[name] = _run_case(1, 1, loss_kind, transport, sampling, 0, None, None)
            continue
        ring = bps.get_clean_ring_group() if ccp == cp else shard_group
        out[name] = _run_case(ccp, cbp, loss_kind, transport, sampling, shard_rank, shard_group, ring)
    return out


def _summed(results, name):
    loss = sum(r[name]["loss"] for r in results)
    grads = {k: sum(r[name]["grads"][k] for r in results) for k in results[0][name]["grads"]}
    return loss, grads


def _check(results, name, ref_name):
    ref = results[0][ref_name]
    loss, grads = _summed(results, name)
    assert loss == pytest.approx(ref["loss"], rel=1e-5)
    worst, rel = gradient_error([(grads[k], ref["grads"][k]) for k in grads])
    assert worst < 1e-4 and rel < 1e-5, (name, worst, rel)
    assert all(r[name]["metrics"]["supervised"] == ref["metrics"]["supervised"] for r in results)


# fp32 error model (u = 2^-24 = 6e-8): the layouts differ only in the order of the softmax merge
# (fp32 lse merge over key chunks) and of the gradient sums over ranks. Each reordered sum moves by
# ~sqrt(K) u of its magnitude (random-walk rounding; K <= 64 keys or ranks x rows here: <= 5e-7), and
# a few hundred such operations in sequence (layers x forward/backward) add independently, ~sqrt(300)
# x 6e-8 = 1e-6 on the loss and the global gradient norm: bound 1e-5 (10x). One gradient tensor's
# max-entry ratio max|g - r| / max|r| can lose another max|r| / typical|r| (~10 here): bound 1e-4.
CASES_2 = {
    "ref_ce": (1, 1, "ce", "allgather", "uniform"),
    "ref_dpace": (1, 1, "dpace", "allgather", "uniform"),
    "csbp": (2, 2, "ce", "allgather", "uniform"),
    "csbp_ring_dpace": (2, 2, "dpace", "ring", "uniform"),
    "bp": (1, 2, "ce", "allgather", "uniform"),
    "cp": (2, 1, "ce", "allgather", "uniform"),
}


def test_layouts_match_one_rank_on_two_ranks():
    """1 rank vs CSBP (all-gather and ring, CE and D-PACE), BP and CP on 2 gloo ranks; bytes."""
    results = run_distributed(layouts_rank, 2, 2, 2, CASES_2)
    for name, ref in [("csbp", "ref_ce"), ("csbp_ring_dpace", "ref_dpace"), ("bp", "ref_ce"), ("cp", "ref_ce")]:
        _check(results, name, ref)
    assert all(r["bp"]["bytes"] == 0 for r in results)
    # CP moves the K/V of context and draft rows; CSBP only the context's.
    assert 0 < max(r["csbp"]["bytes"] for r in results) < min(r["cp"]["bytes"] for r in results)


@pytest.mark.slow
def test_locality_sampling_layouts_on_two_ranks():
    cases = {"ref": (1, 1, "ce", "allgather", "locality"), "csbp": (2, 2, "ce", "allgather", "locality"),
             "cp": (2, 1, "ce", "allgather", "locality"), "bp": (1, 2, "dpace", "allgather", "locality"),
             "ref_dpace": (1, 1, "dpace", "allgather", "locality")}
    results = run_distributed(layouts_rank, 2, 2, 2, cases)
    _check(results, "csbp", "ref")
    _check(results, "cp", "ref")
    _check(results, "bp", "ref_dpace")


@pytest.mark.slow
def test_csbp_two_rings_on_four_ranks():
    """CP = 2, BP = 4: two clean rings, anchors dealt over four ranks."""
    cases = {"ref": (1, 1, "ce", "allgather", "uniform"), "csbp": (2, 4, "ce", "allgather", "uniform"),
             "ref_dpace": (1, 1, "dpace", "allgather", "locality"), "csbp_dpace": (2, 4, "dpace", "ring", "locality")}
    results = run_distributed(layouts_rank, 4, 2, 4, cases)
    _check(results, "csbp", "ref")
    _check(results, "csbp_dpace", "ref_dpace")


def test_planner_drafter_work():
    """The planner's per-rank drafter counts: rows and pairs partition the one-rank totals, the
    pairing balances the attention work, CSBP receives only context rows, CP all rows."""
    from megatron_csbp.planner.work import drafter_rank_work

    (one,) = drafter_rank_work(4096, 16, 64, 1, 1)
    assert one.draft_rows == 64 * 16 and one.exchange_rows == 0
    for cp, bp in [(2, 1), (1, 2), (2, 2), (4, 8)]:
        ranks = drafter_rank_work(4096, 16, 64, cp, bp)
        assert len(ranks) == max(cp, bp)
        assert sum(w.sparse_pairs for w in ranks) == one.sparse_pairs
        assert max(w.sparse_pairs for w in ranks) <= 1.05 * one.sparse_pairs / len(ranks)
        if cp > 1:
            assert all(w.context_rows == 4096 // cp for w in ranks)
    csbp, cp_only = drafter_rank_work(4096, 16, 64, 2, 2), drafter_rank_work(4096, 16, 64, 2, 1)
    assert csbp[0].exchange_rows == 2048 and cp_only[0].exchange_rows == 2048 + 512
