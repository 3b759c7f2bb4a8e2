"""The --seq-length % (2 x shard-group size) rule holds only where zigzag chunks exist (a shard
group of P > 1 ranks): one rank takes any length, odd ones included (before, L = 33 on one rank was
refused as "divisible by 2 x ... = 2", and `convert score` padded odd lengths around the rule)."""
import pytest
import torch

from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry
from tests.distributed import run_distributed
from tests.train_helpers import train_rank

ODD = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "33", "--block-size", "11", "--micro-batch-size", "2", "--no-progress-bar", "--log-interval", "1",
       "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1"]


def test_one_rank_takes_an_odd_length_and_shard_groups_keep_the_rule():
    layout = SequenceLayout(BlockGeometry(33, 11))
    rows = layout.rows(0)
    assert rows.position[~rows.is_clean].tolist() == list(range(33))
    assert rows.position[rows.is_clean].tolist() == list(range(33))
    for cp, bp in ((2, 1), (1, 2), (2, 2)):
        with pytest.raises(ValueError, match="--seq-length 33 must be divisible by 2 x max"):
            SequenceLayout(BlockGeometry(33, 11), cp, bp)


def test_trainer_trains_an_odd_length_on_one_rank():
    r = run_distributed(train_rank, 1, ODD + ["--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1"])[0]
    print(f"L = 33 losses {r['losses']}")
    assert r["iteration"] == 3 and all(torch.isfinite(torch.tensor(r["losses"])))


def test_ar_scorer_at_an_odd_length_needs_no_padding(megatron_single_rank):
    """`convert score`'s next-token scorer at L = 7: the logits of a causal model at position i
    depend on tokens <= i only, so they equal the first 7 rows of the same model at L = 8."""
    from megatron_csbp.conversion.api import ARScorer
    from tests.conftest import build_tiny_gpt

    torch.manual_seed(0)
    model = build_tiny_gpt(seq_length=8).double().eval()
    tokens = torch.randint(0, 60, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        odd = ARScorer(model, 7)(tokens[:, :7])
        even = ARScorer(model, 8)(tokens)
    assert odd.shape == (2, 7, 64)
    torch.testing.assert_close(odd, even[:, :7], rtol=1e-12, atol=1e-12)  # float64 rounding (~1e-16) only
