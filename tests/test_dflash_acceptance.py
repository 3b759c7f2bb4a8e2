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
