"""The drafter's training-time acceptance estimator (`objectives/dflash.py`): per-offset accuracy
conditioned on the earlier slots being right, and the expected acceptance length it implies,
against a hand count."""
import math

import torch

from megatron_csbp.objectives.dflash import acceptance_counts, acceptance_from_counts


def test_acceptance_estimator_by_hand():
    T, F = True, False
    # 4 blocks of B = 4 (slot 0 the anchor): right/wrong per slot; the last block's slot 3 is past
    # the document end (unsupervised)
    correct = torch.tensor([[T, T, T, T], [T, T, F, T], [T, F, T, T], [T, T, T, F]])
    supervised = torch.tensor([[T, T, T, T], [T, T, T, T], [T, T, T, T], [T, T, T, F]])
    counts = acceptance_counts(correct, supervised)
    # offset 1: 3 of 4 right; offset 2: of the 3 with slot 1 right, 2 right; offset 3: of those 2,
    # one has slot 3 supervised and right (the other block's slot 3 is unsupervised: not counted)
    assert counts.tolist() == [[3, 2, 1], [4, 3, 1]]
    acc, tau = acceptance_from_counts(counts)
    assert acc == [0.75, 2 / 3, 1.0]
    assert math.isclose(tau, 1 + 0.75 + 0.75 * 2 / 3 + 0.75 * 2 / 3 * 1.0)
    # additive: two halves summed give the same numbers
    halves = acceptance_counts(correct[:2], supervised[:2]) + acceptance_counts(correct[2:], supervised[2:])
    assert torch.equal(halves, counts)
    # nothing right: one token per verifier step
    assert acceptance_from_counts(acceptance_counts(correct & False, supervised))[1] == 1.0


def test_streamed_top2_matches_full_logits():
    from megatron_csbp.objectives.dflash import streamed_top2

    g = torch.Generator().manual_seed(0)
    h, head = torch.randn(7, 5, generator=g), torch.randn(23, 5, generator=g)
    head[11] = head[3]  # a tie: the lower id wins, margin 0 (as torch.argmax)
    h[0] = head[3]
    ids, margin, scale = streamed_top2(h, head, chunk=4)
    logits = h @ head.T
    top = logits.topk(2, dim=1).values
    assert torch.equal(ids, logits.argmax(dim=1))
    assert torch.allclose(margin, top[:, 0] - top[:, 1]) and torch.allclose(scale, logits.abs().max(dim=1).values)
    assert int(ids[0]) == 3 and float(margin[0]) == 0.0


def test_serving_replay_by_hand():
    """transformers' greedy DFlash loop on P = 2, N = 9, B = 4, replayed from the right runs."""
    from megatron_csbp.objectives.dflash import serving_replay

    # anchors 2..9 (index 0..7); serving: prefill -> y[2]; anchor 2 (run 3): 4 tokens (len 7);
    # anchor 6 (run 0): 1 token (len 8); anchor 7 (run 2, 3 left): 3 tokens -> len 11 = P + N, done.
    r = serving_replay([3, 0, 0, 0, 0, 2, 1, 1], 2, 9, 4)
    assert r["visited"] == [0, 4, 5] and r["tokens"] == [4, 1, 3] and r["left"] == [8, 4, 3]
    assert r["verifier_steps"] == 4 and r["drafting_steps"] == 3 and r["cut"] == []
    # a run reaching the end is cut: anchor 7 with 3 left and run 3 -> 3 tokens, censored at r = 3
    r = serving_replay([3, 0, 0, 0, 0, 3, 1, 1], 2, 9, 4)
    assert r["tokens"] == [4, 1, 3] and r["cut"] == [3]
    # one token left: the verifier steps alone (no drafter call)
    # P + N = 7: prefill (len 3), anchor 2 (run 1): 2 tokens (len 5), anchor 4 (run 0): 1 token (len 6),
    # then one token left: a verifier step alone
    r = serving_replay([1, 0, 0, 0], 2, 5, 4)
    assert r["visited"] == [0, 2] and r["verifier_steps"] == 4 and r["drafting_steps"] == 2
    # the same with run 1 at anchor 4: 2 tokens fill the output exactly (not cut), no lone step
    r = serving_replay([1, 0, 1, 0], 2, 5, 4)
    assert r["verifier_steps"] == 3 and r["cut"] == [] and r["tokens"] == [2, 2]


def test_censored_estimate_bound_by_hand():
    """The bound docs/dflash.md derives: with C cut blocks (censored at r_c), the measured tokens
    per drafting step lies in [tau - (C + sum (B-1-r_c)) / D, tau - C / D]."""
    from megatron_csbp.objectives.dflash import acceptance_counts, acceptance_from_counts

    B = 5
    T, F = True, False
    # 4 blocks: runs 2 (slot 3 wrong), 4 (all right), 0, and a cut block right up to r = 2 (slots 3, 4 past y)
    right = torch.tensor([[F, T, T, F, T], [F, T, T, T, T], [F, F, T, T, T], [F, T, T, F, F]])
    sup = torch.tensor([[F, T, T, T, T], [F, T, T, T, T], [F, T, T, T, T], [F, T, T, F, F]])
    _, tau = acceptance_from_counts(acceptance_counts(right, sup))
    tokens = [3, 5, 1, 2]  # the cut block yields r = 2 tokens
    measured = sum(tokens) / 4
    lo, hi = tau - (1 + (B - 1 - 2)) / 4, tau - 1 / 4
    assert lo - 1e-12 <= measured <= hi + 1e-12, (lo, measured, hi)
    # Kaplan-Meier's tau: a = [3/4, 3/3, 1/2 (the cut block leaves the risk set), 1/1]: 1 + 3/4 + 3/4 + 3/8 + 3/8
    assert math.isclose(tau, 3.25) and math.isclose(measured, 2.75)


def test_evaluate_measured_acceptance_within_the_estimate_bound(tmp_path):
    """`dflash evaluate` on a tiny verifier (vocabulary 8, so a random drafter is sometimes right)
    and a random muse_glimmer_assistant drafter: transformers' greedy DFlash decoding measured,
    the training-time estimator on the same outputs at serving's anchors; no slot within the
    logit tolerance, so the bound is the point tau - C / D = tau (no cut block here) and the
    replay predicts the verifier and drafter calls exactly."""
    import numpy as np
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_csbp.dflash import main
    from tests.test_dflash_features import _indexed
    from tests.test_dflash_import import _save_drafter

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(str(tmp_path / "v"))
    _save_drafter(str(tmp_path / "d"), seed=0)  # block 4, mask 4, target layers 0 and 2
    g = np.random.RandomState(0)
    _indexed(str(tmp_path / "data"), [list(g.randint(0, 8, size=12)) for _ in range(6)])
    r = main(["evaluate", "--verifier", str(tmp_path / "v"), "--drafter", str(tmp_path / "d"), "--prompts-data-path",
              str(tmp_path / "data"), "--eval-sequences", "6", "--prompt-length", "6", "--max-new-tokens", "21"])
    print({k: v for k, v in r.items() if k != "outputs"})
    assert r["identical"] is True and r["uncertain_slots"] == 0
    assert r["serving_estimate_verifier_steps"] == r["verifier_steps"]
    assert r["serving_estimate_drafting_blocks"] == r["drafting_steps"] > 0
    lo, hi = r["measured_acceptance_length_bound"]
    # the bound is exact up to the float rounding of tau's product of ratios (a few ulps)
    assert lo - 1e-12 <= r["measured_acceptance_length"] <= hi + 1e-12
    assert r["serving_expected_acceptance_length"] > 1.0  # some drafts accepted: the check is not vacuous
